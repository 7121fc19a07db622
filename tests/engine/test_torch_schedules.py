"""Looped BFS and DualPipeV against PyTorch's own ``ScheduleLoopedBFS`` and ``ScheduleDualPipeV``.

The reference is each class's ``pipeline_order`` (torch 2.13), built on mocked stages without a
process group, as ``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops`` does.
DualPipeV runs on the split-backward V placement, so PyTorch's actions are mapped to our blocks
as documented in :mod:`engine.baselines.dualpipe_v`: ``sBk`` (full backward) -> ``sIk sWk``, and
``OVERLAP_F_B`` -> its sub-actions in order. Then: the schedules validate, PyTorch's runtime
checks accept their CSV and dry-run it, and Tessel's search on the same placement is compared
with them in the simulator.
"""

from __future__ import annotations

import csv
from unittest import mock

import pytest
import torch.distributed.pipelining.schedules as S
from torch.distributed.pipelining.stage import PipelineStage

from engine.baselines import build_schedule, dualpipe_v, looped_bfs, placement_requirements, zbv_placement
from engine.errors import PlacementError, ScheduleError
from engine.io import write_torch_csv
from engine.placement import pipeline_placement
from engine.plan import measure
from engine.tessel import tessel_search

PYTORCH = {"looped-bfs": S.ScheduleLoopedBFS, "dualpipev": S.ScheduleDualPipeV}


def torch_order(cls, pp: int, m: int, stages_per_rank: int = 2):
    """PyTorch's ``pipeline_order`` (rank -> actions, ``None`` = idle), from mocked stages."""
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, pp, None
    stage.num_stages = pp * stages_per_rank
    sched = cls([stage] * stages_per_rank, m)
    return [sched.pipeline_order[r] for r in range(pp)]


def to_blocks(action, split: bool) -> list[str]:
    """One PyTorch compute action as our block strings; ``split``: the placement splits every
    backward into I + W (DualPipeV's mapping, see the module docstring)."""
    kind = action.computation_type.value
    if kind == "OVERLAP_F_B":
        return [b for sub in action.sub_actions for b in to_blocks(sub, split)]
    if kind == "B" and split:
        return [f"{action.stage_index}I{action.microbatch_index}", f"{action.stage_index}W{action.microbatch_index}"]
    return [str(action)]


def torch_blocks(name: str, pp: int, m: int, v: int = 2) -> list[list[str]]:
    """PyTorch's order for our schedule ``name`` as our block strings, rank by rank."""
    rows = torch_order(PYTORCH[name], pp, m, v)
    return [[b for a in row if a is not None for b in to_blocks(a, name == "dualpipev")] for row in rows]


def placement(name: str, pp: int, **kw):
    return placement_requirements(name).make_placement(pp, **kw)


# --------------------------------------------------------------------------- orders vs PyTorch
@pytest.mark.parametrize("pp,m", [(2, 4), (2, 7), (3, 6), (4, 8), (4, 16), (4, 17), (8, 16), (8, 24)])
@pytest.mark.parametrize("name", ["looped-bfs", "dualpipev"])
def test_orders_equal_pytorch(name, pp, m):
    theirs = torch_blocks(name, pp, m)
    ours = build_schedule(name, placement(name, pp), m).to_actions()
    for rank in range(pp):
        assert ours[rank] == theirs[rank], f"{name} pp={pp} m={m} rank {rank}"


@pytest.mark.parametrize("v,pp,m", [(1, 4, 8), (3, 4, 8), (4, 2, 5), (3, 3, 1)])
def test_looped_bfs_any_virtual_stages_equals_pytorch(v, pp, m):
    ours = looped_bfs(pipeline_placement(pp, virtual_stages=v), m).to_actions()
    assert ours == torch_blocks("looped-bfs", pp, m, v)


def test_dualpipev_reference_uses_the_mapped_actions():
    """The DualPipeV cases above exercise both mapped action types (so the mapping is tested)."""
    kinds = {a.computation_type.value for row in torch_order(S.ScheduleDualPipeV, 4, 16) for a in row if a}
    assert {"OVERLAP_F_B", "B", "I", "W"} <= kinds


@pytest.mark.parametrize("name", ["looped-bfs", "dualpipev"])
def test_micro_batch_rule_equals_pytorch(name):
    """For pp=4 and m = 1..12 we refuse exactly the m PyTorch refuses (DualPipeV: m < 8)."""
    for m in range(1, 13):
        try:
            torch_order(PYTORCH[name], 4, m)
            torch_ok = True
        except ValueError:
            torch_ok = False
        try:
            build_schedule(name, placement(name, 4), m)
            ours_ok = True
        except ScheduleError as e:
            assert e.rule == "micro-batches" and (name != "dualpipev" or "use m >= 8" in str(e))
            ours_ok = False
        assert ours_ok == torch_ok, f"{name} m={m}: PyTorch accepts={torch_ok}, ours accepts={ours_ok}"


def test_wrong_placements_are_refused():
    with pytest.raises(PlacementError, match="full backward"):
        looped_bfs(pipeline_placement(4, virtual_stages=2, split_backward=True), 8)
    with pytest.raises(PlacementError, match="expects block 4F on device 3"):
        dualpipe_v(pipeline_placement(4, virtual_stages=2, split_backward=True), 8)
    with pytest.raises(PlacementError, match="split into input-gradient"):
        dualpipe_v(pipeline_placement(4, virtual_stages=2), 8)


# --------------------------------------------------------------------------- PyTorch runs our CSV
@pytest.mark.parametrize("name,pp,m", [("looped-bfs", 4, 8), ("dualpipev", 4, 8), ("dualpipev", 3, 10)])
def test_pytorch_validates_and_dry_runs_our_csv(tmp_path, name, pp, m):
    pl = placement(name, pp)
    s = build_schedule(name, pl, m)
    with open(write_torch_csv(s, tmp_path / "s.csv"), newline="") as f:
        actions = {r: [S._Action.from_str(a) for a in row] for r, row in enumerate(csv.reader(f))}
    S._validate_schedule(actions, pp, pl.num_segments, m)

    def stage_to_rank(stage: int) -> int:
        return pl.spec("F", stage).devices[0]

    S._simulate_comms_compute(S._add_send_recv(actions, stage_to_rank, pl.num_segments), stage_to_rank,
                              pl.num_segments)


# --------------------------------------------------------------------------- Tessel vs the baselines
def _tessel_vs(name: str, pp: int, m: int, with_limit: bool) -> tuple[float, float]:
    """(Tessel's simulated makespan, the baseline's) on the baseline's placement, F=1, B=2 per
    segment (I = W = 1), one memory unit of activations per segment; with ``with_limit`` Tessel
    gets the baseline's peak memory as its limit."""
    pl = pipeline_placement(pp, virtual_stages=2, activation_bytes=1) if name == "looped-bfs" \
        else zbv_placement(pp, activation_bytes=1)
    base = measure(build_schedule(name, pl, m))
    limit = max(base.peak_memory) if with_limit else None
    res = tessel_search(pl, m, memory_limit=limit, time_limit=5.0, seed=0)
    ours = measure(res.schedule, memory_limit=limit)
    assert not ours.over_limit
    return ours.makespan, base.makespan


@pytest.mark.parametrize("name", ["looped-bfs", "dualpipev"])
def test_tessel_matches_baseline_within_its_memory(name):
    tessel, base = _tessel_vs(name, 4, 8, with_limit=True)
    assert tessel <= base + 1e-9


def test_tessel_matches_dualpipev_without_limit():
    tessel, base = _tessel_vs("dualpipev", 4, 8, with_limit=False)
    assert tessel <= base + 1e-9


@pytest.mark.xfail(strict=True, reason="issue 21: unlimited Tessel search on the looped v=2 placement, pp=4 m=8, "
                   "ends at 60 units vs Looped BFS's 57 (= the makespan lower bound); the search keeps few "
                   "micro-batches in flight and its warmup/cooldown is longer")
def test_tessel_matches_looped_bfs_without_limit():
    tessel, base = _tessel_vs("looped-bfs", 4, 8, with_limit=False)
    assert tessel <= base + 1e-9


@pytest.mark.xfail(strict=True, reason="issue 21: at 8 ranks, m=16, within DualPipeV's peak memory (17 units) "
                   "Tessel's schedule is 113 units vs DualPipeV's 103 (the makespan lower bound)")
def test_tessel_matches_dualpipev_8_ranks():
    tessel, base = _tessel_vs("dualpipev", 8, 16, with_limit=True)
    assert tessel <= base + 1e-9
