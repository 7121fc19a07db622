"""`tessel demo`: the README's main job end to end (plan, launch on Ray, report, calibrate)."""

from __future__ import annotations

import json

import pytest
from tessel_run import run_tessel

pytest.importorskip("ray")


@pytest.mark.timeout(400)
def test_demo_plans_trains_reports_and_calibrates(tmp_path):
    # a hang fails with every thread's stack (see tests/tessel_run.py)
    p = run_tessel("demo", "--steps", "6", "--model", "gpt2-tiny", "--step-timeout", "60", "-o", str(tmp_path),
                   "--json", timeout=330)
    assert p.returncode == 0, p.stderr[-6000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["ok"] and res["steps"] == 6 and res["model"] == "gpt2-tiny"
    assert res["loss_end"] < res["loss_start"] and res["tokens_per_second"] > 0
    for name in ("plan.json", "trace.json", "schedule.csv", "trace.measured.json", "plan.calibrated.json"):
        assert (tmp_path / name).is_file(), name
    # 6 steps: the first is warm-up; 2 calibrate, the prediction is checked on the 3 after them
    cal = res["calibration"]
    assert cal["held_out"] is True and cal["steps"] == 5 and cal["predicted_makespan"] > 0
    assert "checked on the 3 later ones" in p.stdout
    calibrated = json.loads((tmp_path / "plan.calibrated.json").read_text())
    assert calibrated["meta"]["calibration"]["steps"] == 5
