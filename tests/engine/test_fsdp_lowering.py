"""Fully sharded data parallelism in the lowering and the simulator (``engine.dependency.fsdp``,
``engine.simulate``): each unit all-gathered before its forward and backward, the next unit's
all-gather running while the previous unit computes (FSDP2's prefetch), reduce-scatters after
each unit's backward, HSDP's all-reduce over the replicate group, the pipeline's gather-once rule,
and the shards in the static memory; checked against times and bytes worked out by hand."""

from __future__ import annotations

import pytest

from engine.baselines import build_schedule
from engine.config import ParallelConfig
from engine.dependency import Op, lower
from engine.errors import TransformError
from engine.placement import pipeline_placement
from engine.precision import get_policy
from engine.simulate import simulate

MB = 2**20


class _Cost:
    """Collectives at 1 s per MiB per ring step fraction ((n-1)/n), all-reduce twice that; p2p free;
    the optimizer 1 s per MiB."""

    def p2p_time(self, nbytes, src, dst):
        return 0.0

    def collective_time(self, kind, nbytes, ranks):
        return nbytes / MB * (2.0 if kind == "allreduce" else 1.0) * (len(ranks) - 1) / len(ranks)

    def optimizer_time(self, nbytes):
        return nbytes / MB


#: a root unit without parameters, then four blocks of 1 MiB, a quarter of the compute each
UNITS = {0: [(0, 0.0), (MB, 1.0), (MB, 1.0), (MB, 1.0), (MB, 1.0)]}


def _one_rank(dp=2, dp_shard=2, **kw):
    pl = pipeline_placement(1, forward=4.0, backward=8.0, static_memory=[12 * MB])
    sched = build_schedule("1f1b", pl, 1)
    return lower(sched, dp=dp, dp_shard=dp_shard, segment_param_bytes={0: 4 * MB}, fsdp_units=UNITS, **kw)


def _events(tl, kind):
    return sorted((e for e in tl.events if e.op == kind), key=lambda e: e.start)


def test_prefetched_all_gather_runs_while_the_previous_unit_computes():
    plan = _one_rank()
    ops = [str(i.op) for i in plan.streams[0]]
    assert ops == ["UNSHARD"] * 5 + ["F"] + ["UNSHARD"] * 4 + ["B"] + ["REDUCESCATTER"] * 4 + ["RESHARD", "OPTIM"]
    tl = simulate(plan, _Cost())
    f, b = (next(e for e in tl.events if e.op == k) for k in ("F", "B"))
    gathers = [e for e in _events(tl, "ALLGATHER")]
    # 1 MiB over 2 ranks: 0.5 s each. Forward: unit 1 waits for its gather (0.5 s), units 2-4's
    # gathers start as the unit before them starts computing and end before it ends.
    assert [(g.start, g.end) for g in gathers[:4]] == [(0.0, 0.5), (0.5, 1.0), (1.5, 2.0), (2.5, 3.0)]
    assert (f.start, f.end) == (0.0, 4.5)   # 4 s of compute + only the first gather exposed (not 4 x 0.5)
    overlapped = [g for g in gathers[1:4] if f.start < g.start and g.end < f.end]
    assert len(overlapped) == 3
    # backward: units 4..1 gathered again (reshard after forward), the first one exposed
    assert [(g.start, g.end) for g in gathers[4:]] == [(4.5, 5.0), (5.0, 5.5), (7.0, 7.5), (9.0, 9.5)]
    assert (b.start, b.end) == (4.5, 13.0)
    # a reduce-scatter after each unit's 2 s of backward; the optimizer waits for the last one
    rs = _events(tl, "REDUCESCATTER")
    assert [(e.start, e.end) for e in rs] == [(7.0, 7.5), (9.0, 9.5), (11.0, 11.5), (13.0, 13.5)]
    opt = next(e for e in tl.events if e.op == "OPTIM")
    assert (opt.start, opt.end) == (13.5, 15.5)   # Adam on this rank's 2 MiB shard


def test_without_prefetch_each_gather_would_be_exposed():
    """The same block with all-gathers that take longer than a unit's compute: the compute waits
    for every one (the block stretches to the gathers' chain), never starting a unit early."""

    class _Slow(_Cost):
        def collective_time(self, kind, nbytes, ranks):
            return 4 * super().collective_time(kind, nbytes, ranks)

    tl = simulate(_one_rank(), _Slow())
    f = next(e for e in tl.events if e.op == "F")
    g = _events(tl, "ALLGATHER")[:4]
    # gathers of 2 s back to back on the gather stream; unit k computes 1 s after gather k ends
    assert [(x.start, x.end) for x in g] == [(0.0, 2.0), (2.0, 4.0), (4.0, 6.0), (6.0, 8.0)]
    assert f.end == 9.0


def test_memory_holds_the_shards_and_at_most_two_gathered_units():
    plan = _one_rank()
    pol = get_policy("32-true")
    # static: 12 MiB replicated (weights and Adam's m, v) -> fp32 shard and m, v over 2 ranks
    assert plan.static_memory == [4 * MB * pol.fsdp_sharded_bytes_per_param // 4 // 2] == [6 * MB]
    tl = simulate(plan, _Cost())
    curve = tl.memory[0]
    during_f = [m for t, m in curve if 0.0 <= t < 4.5]
    assert max(during_f) == 6 * MB + 2 * MB   # the unit computing and the one prefetched
    # backward: two units' parameters with their unsharded gradients (this placement records no
    # gradient buffer; make_plan's do, test_plan_memory_* below)
    assert max(m for _, m in curve) == 6 * MB + 2 * (MB + MB)
    assert curve[-1][1] == 6 * MB   # everything gathered freed, the gradient released by OPTIM
    replicated = simulate(lower(build_schedule("1f1b", pipeline_placement(
        1, forward=4.0, backward=8.0, static_memory=[12 * MB]), 1), dp=2, segment_param_bytes={0: 4 * MB}), _Cost())
    assert max(m for _, m in replicated.memory[0]) == 12 * MB   # no hold: the placement records no gradient


def test_keeping_the_parameters_after_the_forward_gathers_once():
    plan = _one_rank(reshard_after_forward=False)
    ops = [str(i.op) for i in plan.streams[0]]
    assert ops == ["UNSHARD"] * 5 + ["F", "B"] + ["REDUCESCATTER"] * 4 + ["RESHARD", "OPTIM"]
    tl = simulate(plan, _Cost())
    # all four units gathered until the reshard, and two units' unsharded gradients in the backward
    assert max(m for _, m in tl.memory[0]) == 6 * MB + 4 * MB + 2 * MB


def test_hsdp_reduces_the_shard_over_the_replicate_group():
    plan = _one_rank(dp=4, dp_shard=2)
    assert plan.shard_group(0) == [0, 1] and plan.replicate_group(0) == [0, 2]
    ar = [i for i in plan.streams[0] if i.op == Op.ALLREDUCE]
    assert len(ar) == 4 and all(i.group == 2 and i.nbytes == MB // 2 and i.block is not None for i in ar)
    tl = simulate(plan, _Cost())
    hs = _events(tl, "ALLREDUCE")
    assert [(e.start, e.end) for e in hs][:1] == [(7.5, 8.0)]   # after unit 4's reduce-scatter, 2 x 0.5 MiB x 1/2


def test_a_pipeline_gathers_a_stage_once_and_syncs_at_its_last_backward():
    pl = pipeline_placement(2, forward=1.0, backward=2.0)
    sched = build_schedule("1f1b", pl, 4)
    units = {0: [(MB, 0.5), (MB, 0.5)], 1: [(0, 0.0), (2 * MB, 1.0)]}
    plan = lower(sched, dp=2, dp_shard=2, segment_param_bytes={0: 2 * MB, 1: 2 * MB}, fsdp_units=units)
    for r, stream in enumerate(plan.streams):
        ops = [str(i.op) for i in stream]
        assert ops.count("UNSHARD") == 2 and ops.count("REDUCESCATTER") == len([u for u in units[r] if u[0]])
        assert ops.count("RESHARD") == 1
        last_b = max(i for i, x in enumerate(stream) if x.op == Op.B)
        assert all(i > last_b for i, x in enumerate(stream) if x.op in (Op.REDUCESCATTER, Op.RESHARD))
    simulate(plan, _Cost())
    with pytest.raises(TransformError, match="reshard_after_forward with a pipeline is not modelled"):
        lower(sched, dp=2, dp_shard=2, segment_param_bytes={0: 2 * MB, 1: 2 * MB}, reshard_after_forward=True)


def test_the_degrees_are_checked_and_kept_in_the_plan_json():
    with pytest.raises(TransformError, match="dp_shard must be a positive integer dividing dp=4"):
        ParallelConfig(dp=4, dp_shard=3).check()
    cfg = ParallelConfig(dp=4, dp_shard=2, reshard_after_forward=False)
    cfg.check()
    back = ParallelConfig.from_dict(cfg.to_dict())
    assert (back.dp_shard, back.dp_replicate, back.reshard_after_forward) == (2, 2, False)
    assert "dp_shard" not in ParallelConfig(dp=2).to_dict()
    assert ParallelConfig.from_dict(ParallelConfig(dp=2).to_dict()).dp_shard == 1
    assert ParallelConfig(dp=2, dp_shard=2).resharded_after_forward
    assert not ParallelConfig(dp=2, dp_shard=2, pp=2).resharded_after_forward


def test_the_backward_keeps_the_roots_share_of_the_compute():
    """A root unit (still gathered in the backward, so not gathered again) keeps its share of the
    backward's compute: the block lasts its whole duration, the block gather running meanwhile."""
    pl = pipeline_placement(1, forward=2.0, backward=4.0, static_memory=[12 * MB])
    plan = lower(build_schedule("1f1b", pl, 1), dp=2, dp_shard=2, segment_param_bytes={0: 2 * MB},
                 fsdp_units={0: [(MB, 1.0), (MB, 1.0)]})
    tl = simulate(plan, _Cost())
    f, b = (next(e for e in tl.events if e.op == k) for k in ("F", "B"))
    assert (f.start, f.end) == (0.0, 2.5)   # the root's gather exposed, the block's prefetched
    assert (b.start, b.end) == (2.5, 6.5)   # the block's 2 s after its gather, and the root's 2 s
    g = _events(tl, "ALLGATHER")[-1]
    assert (g.start, g.end) == (2.5, 3.0)   # the block's gather, issued when the backward starts
