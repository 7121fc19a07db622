"""``tessel plan --micro-batches 1000000000`` ran past two minutes without an answer (issue 32's
review): a count no plan can hold is refused before any schedule is built (the old code would run
for days, past the test's timeout), in one sentence with exit status 2."""

from __future__ import annotations

from cli_inprocess import run_cli

from engine.config import MAX_MICRO_BATCHES


def test_a_micro_batch_count_no_plan_can_hold_is_refused_at_once(tmp_path):
    p = run_cli("plan", "--model", "gpt2-tiny", "--devices", "2", "--micro-batches", "1000000000",
                "-o", str(tmp_path))
    assert p.returncode == 2, p.stderr
    assert "micro_batches = 1,000,000,000 is more than a plan can hold" in p.stderr
    assert f"{MAX_MICRO_BATCHES:,}" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "plan.json").exists()
