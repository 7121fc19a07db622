"""``benchmarks/tune_cpu_bench.py``'s noise floor and ``--report`` on a small made-up result (no
launch): the repeat-launch oracle picks the profiled plan whose own launches were fastest."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import tune_cpu_bench as tcb  # noqa: E402


def _result() -> dict:
    rows = [{"label": "a", "predicted": 1.0, "calibrated": 1.0, "runs": [0.30, 0.31, 0.32], "measured": 0.31},
            {"label": "b", "predicted": 2.0, "calibrated": 2.0, "runs": [0.20, 0.21, 0.22], "measured": 0.21},
            {"label": "c", "predicted": 3.0, "calibrated": 3.0, "runs": [0.25, 0.26, 0.24], "measured": 0.25}]
    # "a" launched fast while profiling (0.10-0.12 s) and slow when measured: the oracle takes it
    checks = [{"label": "a", "measured_makespan": t} for t in (0.12, 0.10, 0.11)] + \
        [{"label": "c", "measured_makespan": t} for t in (0.24, 0.25, 0.26)]
    order = ["a", "b", "c"]
    return {"model": "two-tower-tiny", "ranks": 2, "candidates": 3, "rows": rows, "tune_seconds": 0.1,
            "test_retest_spearman": tcb._test_retest(rows), "profiled": tcb._ranking(rows, "predicted", order),
            "calibrated": tcb._ranking(rows, "calibrated", order), "tune_seconds_calibrated": 0.1,
            "profiling_checks": checks}


def test_the_repeat_oracle_picks_the_profiled_plan_whose_own_launches_were_fastest():
    r = _result()
    got = tcb._repeat_oracle(r["rows"], r["profiling_checks"])
    assert got["pick"] == "a" and got["profiling_median"] == pytest.approx(0.11)
    assert got["pick_gap"] == pytest.approx(0.31 / 0.21 - 1)
    assert tcb._repeat_oracle(r["rows"], []) is None
    assert r["test_retest_spearman"] == pytest.approx(1.0)


def test_report_prints_the_table_of_an_earlier_run_with_the_oracle_column(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"results": [_result()]}))
    assert tcb.main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "oracle" in out.splitlines()[0] and f"{0.31 / 0.21 - 1:6.1%}" in out
    assert tcb.main(["--report", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["repeat_oracle"]["pick"] == "a"
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        tcb.main(["--report", str(tmp_path / "bad.json")])
    assert e.value.code == 2 and "not a tune_cpu_bench --json result" in capsys.readouterr().err


def test_the_picks_p_value_says_whether_its_launches_are_measurably_slower_than_the_bests():
    r = _result()
    # every launch of "a" (0.30-0.32 s) is slower than every launch of the best, "b": p = 1/20
    assert r["profiled"]["pick"]["label"] == "a" and r["profiled"]["pick_slower_p"] == pytest.approx(0.05)
    assert not r["profiled"]["targets"]["pick_not_measurably_slower"]
    assert r["profiled"]["not_measurably_slower_than_best"] == 1   # "c" (0.24-0.26 s) is slower too
    assert tcb._repeat_oracle(r["rows"], r["profiling_checks"])["pick_slower_p"] == pytest.approx(0.05)
    # one of "c"'s launches (0.205 s) among the best's: not measurably slower, though its median is 19% slower
    rows = [dict(x) for x in r["rows"]]
    rows[2]["runs"] = [0.25, 0.26, 0.205]
    got = tcb._ranking(rows, "predicted", ["c", "a", "b"])
    assert got["pick_gap"] == pytest.approx(0.25 / 0.21 - 1) and got["pick_slower_p"] > tcb.SIGNIFICANCE
    assert got["targets"]["pick_not_measurably_slower"] and not got["targets"]["pick_within_5pct"]
    assert got["not_measurably_slower_than_best"] == 2
    assert tcb._ranking(rows, "predicted", ["b", "a", "c"])["pick_slower_p"] == 1.0
