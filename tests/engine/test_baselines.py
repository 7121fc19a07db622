"""Predefined schedules against PyTorch's own ``torch.distributed.pipelining`` schedules.

Two PyTorch references:

* the IR, ``pipeline_order``, as returned by ``_schedule_visualizer.get_schedule_ops`` (for the
  multi-stage classes, derived from ``_PipelineScheduleRuntime``, it is exactly what runs);
* for the single-stage classes (``ScheduleGPipe``, ``Schedule1F1B``) the order their
  ``_step_microbatches`` actually executes, traced on a mocked stage with the p2p calls stubbed.

Known PyTorch deviation (torch 2.13): ``Schedule1F1B._get_pipeline_order`` lists forwards
``1..m`` on the last rank instead of ``0..m-1`` (it starts the steady state at
``forward_mb + 1`` with no warm-up forward). Its runtime order is right; we mirror the runtime
and assert this exact deviation of the IR so it cannot pass unnoticed.

Cases PyTorch refuses (it raises ``ValueError``) are skipped with PyTorch's own message, after
checking that our builder refuses them too with rule ``"micro-batches"``.
"""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch.distributed.pipelining.schedules as S
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.stage import PipelineStage

from engine.baselines import (
    SCHEDULES,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    placement_requirements,
    zb_h1,
    zb_v,
    zbv_placement,
)
from engine.errors import PlacementError, ScheduleError
from engine.placement import pipeline_placement
from engine.schedule import peak_memory, validate

PP = (2, 4, 8)
MS = (4, 8, 16)

#: our name -> (PyTorch class, stages per rank)
PYTORCH = {
    "gpipe": (S.ScheduleGPipe, 1),
    "1f1b": (S.Schedule1F1B, 1),
    "interleaved": (S.ScheduleInterleaved1F1B, 2),
    "zb-h1": (S.ScheduleInterleavedZeroBubble, 1),
    "interleaved-zb": (S.ScheduleInterleavedZeroBubble, 2),
    "zb-v": (S.ScheduleZBVZeroBubble, 2),
}
COMPUTE = {"F", "B", "I", "W"}


def compute_actions(grid) -> list[list[str]]:
    """Each rank's non-None compute actions (F/B/I/W) as strings like ``"2I0"``."""
    return [[str(a) for a in row if a is not None and a.computation_type.value in COMPUTE] for row in grid]


def pytorch_ir(cls, pp: int, m: int, stages_per_rank: int) -> list[list[str]]:
    """PyTorch's per-rank compute order (its ``pipeline_order`` IR).

    ``get_schedule_ops`` asserts ``num_stages_per_rank >= 2`` for every ``PipelineScheduleMulti``
    class, so ``ScheduleInterleavedZeroBubble`` with ONE stage per rank (ZB-H1) is built the same
    way ``get_schedule_ops`` builds it (an autospec'd ``PipelineStage`` per local stage), just
    without that assertion.
    """
    if issubclass(cls, S.PipelineScheduleSingle) or stages_per_rank >= 2:
        return compute_actions(get_schedule_ops(cls, pp, m, num_stages_per_rank=stages_per_rank))
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, pp, None
    stage.num_stages = pp * stages_per_rank
    sched = cls([stage] * stages_per_rank, m)
    return compute_actions([sched.pipeline_order[r] for r in range(pp)])


def pytorch_runtime(cls, pp: int, m: int) -> list[list[str]]:
    """The order a single-stage PyTorch schedule's ``_step_microbatches`` runs, rank by rank."""
    out = []
    for rank in range(pp):
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.submod = rank, pp, None
        stage.num_stages, stage.stage_index = pp, rank
        stage.is_first, stage.is_last = rank == 0, rank == pp - 1
        trace: list[str] = []
        stage.forward_one_chunk.side_effect = lambda i, *a, _r=rank, _t=trace, **k: _t.append(f"{_r}F{i}")
        stage.backward_one_chunk.side_effect = lambda i, *a, _r=rank, _t=trace, **k: _t.append(f"{_r}B{i}")
        sched = cls(stage, m)
        sched._initialize_stage = lambda *a, **k: None  # shape inference needs real tensors
        with mock.patch.object(S, "_batch_p2p", return_value=[]), \
                mock.patch.object(S, "_sorted_batch_p2p", return_value={}), \
                mock.patch.object(S, "_wait_batch_p2p"):
            sched._step_microbatches([()] * m, [{}] * m, None, None)
        out.append(trace)
    return out


def placement_for(name: str, pp: int, **kwargs):
    return placement_requirements(name).make_placement(pp, **kwargs)


def pytorch_or_skip(name: str, pp: int, m: int, ref):
    """Call ``ref()``; if PyTorch refuses the case, check that we refuse it too, then skip."""
    try:
        return ref()
    except ValueError as e:
        with pytest.raises(ScheduleError) as ours:
            build_schedule(name, placement_for(name, pp), m)
        assert ours.value.rule == "micro-batches"
        pytest.skip(f"PyTorch {PYTORCH[name][0].__name__} refuses pp={pp}, m={m}: {e}")


# --------------------------------------------------------------------------- vs PyTorch
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("pp", PP)
@pytest.mark.parametrize("name", list(PYTORCH))
def test_orders_match_pytorch_ir(name, pp, m):
    cls, k = PYTORCH[name]
    theirs = pytorch_or_skip(name, pp, m, lambda: pytorch_ir(cls, pp, m, k))
    s = build_schedule(name, placement_for(name, pp), m)
    ours = s.to_actions()
    assert len(ours) == len(theirs) == pp
    if name == "1f1b":
        # torch 2.13 Schedule1F1B IR bug on the last rank: forward indices shifted by one.
        last = pp - 1
        shifted = [f"{last}F{b.micro_batch + 1}" if b.kind == "F" else str(b) for b in s.orders[last]]
        assert theirs[last] == shifted, "PyTorch's Schedule1F1B IR changed; revisit the note in one_f_one_b.py"
        ours, theirs = ours[:last], theirs[:last]
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert a == b, f"{name} pp={pp} m={m} rank {rank}:\n ours  {' '.join(a)}\n torch {' '.join(b)}"


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("pp", PP)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_single_stage_orders_match_pytorch_runtime(name, pp, m):
    cls, _ = PYTORCH[name]
    theirs = pytorch_or_skip(name, pp, m, lambda: pytorch_runtime(cls, pp, m))
    assert build_schedule(name, placement_for(name, pp), m).to_actions() == theirs


@pytest.mark.parametrize("v", [3, 4])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 6), (4, 3), (4, 10)])
@pytest.mark.parametrize("name", ["interleaved", "interleaved-zb"])
def test_more_virtual_stages_and_uneven_m_match_pytorch(name, pp, m, v):
    cls, _ = PYTORCH[name]
    theirs = pytorch_or_skip(name, pp, m, lambda: pytorch_ir(cls, pp, m, v))
    assert build_schedule(name, placement_for(name, pp, virtual_stages=v), m).to_actions() == theirs


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb-h1", "interleaved-zb"])
def test_micro_batch_rules_match_pytorch(name):
    """For pp=4 and m = 1..13: we refuse exactly the m PyTorch refuses."""
    cls, k = PYTORCH[name]
    pl = placement_for(name, 4)
    for m in range(1, 14):
        try:
            pytorch_ir(cls, 4, m, k)
            torch_ok = True
        except ValueError:
            torch_ok = False
        try:
            build_schedule(name, pl, m)
            ours_ok = True
        except ScheduleError as e:
            assert e.rule == "micro-batches"
            ours_ok = False
        assert ours_ok == torch_ok, f"{name} m={m}: PyTorch accepts={torch_ok}, ours accepts={ours_ok}"


def test_zbv_placement_is_pytorch_v_mapping():
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    for pp in PP:
        pl = zbv_placement(pp)
        mapping = generate_stage_to_rank_mapping(pp, 2 * pp, style="v")
        assert all(pl.spec(k, s).devices == (mapping[s],) for s in range(2 * pp) for k in "FIW")


# --------------------------------------------------------------------------- validity, memory
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("pp", PP)
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_validates(name, pp, m):
    pl = placement_for(name, pp, activation_bytes=1000)
    try:
        s = build_schedule(name, pl, m)
    except ScheduleError as e:
        assert e.rule == "micro-batches"
        pytest.skip(f"{name} refuses pp={pp}, m={m}: {e}")
    validate(s)
    assert s.name == name and s.num_micro_batches == m
    json.dumps(s.meta)  # JSON-able


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 8), (4, 16), (8, 16)])
def test_peak_memory_1f1b_vs_gpipe(pp, m):
    act = 1 << 20
    pl = pipeline_placement(pp, activation_bytes=act)
    f1b, gp = peak_memory(one_f_one_b(pl, m)), peak_memory(gpipe(pl, m))
    assert f1b[0] == pp * act
    assert f1b == [(pp - r) * act for r in range(pp)]
    assert gp == [m * act] * pp


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 8), (4, 16), (8, 16)])
def test_zb_h1_peak_memory_equals_1f1b(pp, m):
    act = 1 << 20
    f1b = peak_memory(one_f_one_b(pipeline_placement(pp, activation_bytes=act), m))
    s = zb_h1(pipeline_placement(pp, activation_bytes=act, split_backward=True), m)
    assert max(peak_memory(s)) == max(f1b) == pp * act
    # with W holding the whole activation (weight_grad_fraction=1), no rank exceeds pp in flight
    whole = zb_h1(pipeline_placement(pp, activation_bytes=act, split_backward=True, weight_grad_fraction=1.0), m)
    assert peak_memory(whole) == [pp * act] * pp


def test_zb_h1_defers_r_weight_passes_on_rank_r():
    s = zb_h1(pipeline_placement(4, split_backward=True), 8)
    for r, order in enumerate(s.orders):
        kinds = "".join(b.kind for b in order)
        assert kinds.startswith("F" * (4 - r) + "I")  # 1F1B's warm-up, then the first step's F
        # before the first W, rank r has run r + 1 input-gradient passes
        assert kinds[: kinds.index("W")].count("I") == r + 1


def test_interleaved_uses_both_chunks():
    s = interleaved_1f1b(pipeline_placement(4, virtual_stages=2), 8)
    assert {b.segment for b in s.orders[1]} == {1, 5}


def test_gpipe_forward_only():
    s = gpipe(pipeline_placement(3, forward_only=True), 4)
    assert s.to_actions()[2] == ["2F0", "2F1", "2F2", "2F3"]
    assert s.meta["pytorch"] == "_ScheduleForwardOnly"


# --------------------------------------------------------------------------- errors
def test_1f1b_too_few_micro_batches():
    with pytest.raises(ScheduleError) as e:
        build_schedule("1f1b", pipeline_placement(8), 4)
    assert e.value.rule == "micro-batches"
    assert "at least as many micro-batches as pipeline stages" in str(e.value)


@pytest.mark.parametrize("name", ["interleaved", "zb-h1"])
def test_interleaved_rounds_rule(name):
    with pytest.raises(ScheduleError) as e:
        build_schedule(name, placement_for(name, 4), 9)
    assert e.value.rule == "micro-batches"
    assert "multiple of its number of rounds" in str(e.value) and "m = 8 or m = 10" in str(e.value)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_zero_micro_batches(name):
    with pytest.raises(ScheduleError) as e:
        build_schedule(name, placement_for(name, 2), 0)
    assert e.value.rule == "micro-batches"


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="valid schedules are: gpipe, 1f1b, interleaved, zb-h1"):
        build_schedule("pipedream", pipeline_placement(2), 4)
    with pytest.raises(ValueError, match="unknown schedule"):
        placement_requirements("nope")


@pytest.mark.parametrize(
    "name,placement,needle",
    [
        ("zb-h1", pipeline_placement(4), "split into input-gradient (I)"),
        ("1f1b", pipeline_placement(4, split_backward=True), "full backward (B)"),
        ("interleaved", pipeline_placement(4), "at least 2 segment(s) per device"),
        ("1f1b", pipeline_placement(2, virtual_stages=2), "exactly 1 segment(s) per device"),
        ("zb-v", pipeline_placement(2, virtual_stages=2, split_backward=True), "expects block 2F on device 1"),
        ("1f1b", pipeline_placement(2, forward_only=True), "no backward blocks"),
    ],
)
def test_wrong_placement(name, placement, needle):
    with pytest.raises(PlacementError) as e:
        build_schedule(name, placement, 8)
    assert needle in str(e.value)


def test_placement_requirements():
    assert placement_requirements("gpipe").virtual_stages == 1
    assert not placement_requirements("1f1b").split_backward
    r = placement_requirements("interleaved")
    assert (r.virtual_stages, r.min_virtual_stages, r.max_virtual_stages, r.split_backward) == (2, 2, None, False)
    r = placement_requirements("zb-h1")
    assert (r.virtual_stages, r.split_backward, r.pytorch) == (
        1, True, "ScheduleInterleavedZeroBubble (1 stage per rank)")
    assert placement_requirements("ZB-V").shape == "v"
    assert set(SCHEDULES) >= {"gpipe", "1f1b", "interleaved", "zb-h1"}
    zb_v(placement_requirements("zb-v").make_placement(3), 5)
