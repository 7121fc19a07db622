"""Our torch pipelining CSV is what PyTorch's own pipelining runtime reads and runs.

``_PipelineScheduleRuntime._load_csv`` parses each cell with ``_Action.from_str`` and checks the
orders with ``_validate_schedule``; lowering with ``_add_send_recv`` and dry-running with
``_simulate_comms_compute`` is how PyTorch checks a compute-only schedule for deadlocks.
"""

from __future__ import annotations

import csv

import pytest

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

from engine.baselines import build_schedule, placement_requirements  # noqa: E402
from engine.io import write_torch_csv  # noqa: E402


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_pytorch_loads_validates_and_dry_runs_our_csv(tmp_path, name, pp, m):
    req = placement_requirements(name)
    pl = req.make_placement(pp)
    sched = build_schedule(name, pl, m)
    path = write_torch_csv(sched, tmp_path / "s.csv")
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    actions = {r: [torch_schedules._Action.from_str(a) for a in row] for r, row in enumerate(rows)}
    assert [[str(a) for a in actions[r]] for r in range(pp)] == sched.to_actions()
    num_stages = pl.num_segments
    torch_schedules._validate_schedule(actions, pp, num_stages, m)

    def stage_to_rank(s: int) -> int:
        return pl.spec("F", s).devices[0]

    with_comms = torch_schedules._add_send_recv(actions, stage_to_rank, num_stages)
    torch_schedules._simulate_comms_compute(with_comms, stage_to_rank, num_stages)
