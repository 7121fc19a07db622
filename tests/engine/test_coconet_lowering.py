"""CoCoNet's transformations in the plan, the lowering and the simulator (``engine.coconet``,
``engine.dependency.lower``, ``engine.simulate``): names and refusals are one sentence; the
sharded update lowers to reduce-scatter, an optimizer step over 1/dp and an all-gather, with
Adam's states 1/dp in the static memory; overlapped gradient sync posts DDP-style buckets that
the simulator starts during the last backward block (a collective running while a backward block
runs on the same device); scatter-send sends 1/tp and gathers it; plans keep their
transformations through JSON."""

from __future__ import annotations

import pytest

from engine.baselines import build_schedule
from engine.coconet import TRANSFORMS, check_transforms, gradient_buckets, parse_transforms
from engine.dependency import Op, lower
from engine.errors import CoCoNetError
from engine.placement import pipeline_placement
from engine.simulate import simulate

MB = 2**20


class _Cost:
    """Collectives at 1 s per MiB (per rank of the ring), p2p free, optimizer 1 s per MiB."""

    def p2p_time(self, nbytes, src, dst):
        return 0.0

    def collective_time(self, kind, nbytes, ranks):
        return nbytes / MB * (2.0 if kind == "allreduce" else 1.0) * (len(ranks) - 1) / len(ranks)

    def optimizer_time(self, nbytes):
        return nbytes / MB


def test_names_order_and_refusals():
    assert parse_transforms("overlap-grad-sync, sharded-update") == ("sharded-update", "overlap-grad-sync")
    assert parse_transforms(None) == () and set(TRANSFORMS) == {"sharded-update", "overlap-grad-sync", "tp-split",
                                                                "scatter-send", "chunked-overlap"}
    with pytest.raises(CoCoNetError, match="unknown transformation 'zero'; valid ones: sharded-update"):
        parse_transforms("zero")
    with pytest.raises(CoCoNetError, match="'sharded-update' needs dp > 1 .* dp = 1"):
        check_transforms(["sharded-update"], dp=1, tp=1, pp=2)
    with pytest.raises(CoCoNetError, match="optimizer is 'sgd'"):
        check_transforms(["sharded-update"], dp=2, tp=1, pp=1, optimizer="sgd")
    with pytest.raises(CoCoNetError, match="'tp-split' needs tp > 1 .*'tracer' split"):
        check_transforms(["tp-split"], dp=1, tp=2, pp=1, split="tracer")
    with pytest.raises(CoCoNetError, match="'scatter-send' .* pp = 1"):
        check_transforms(["scatter-send"], dp=1, tp=2, pp=1, split="layers")
    with pytest.raises(CoCoNetError, match="expert-parallel"):
        check_transforms(["overlap-grad-sync"], dp=2, tp=1, pp=1, expert_parallel=True)
    check_transforms(["sharded-update", "tp-split", "scatter-send"], dp=2, tp=2, pp=2, optimizer="adama",
                     split="layers", seq_len=64)
    with pytest.raises(CoCoNetError, match="'chunked-overlap' cannot be combined with 'tp-split'"):
        check_transforms(["tp-split", "chunked-overlap"], dp=1, tp=2, pp=1, split="layers")
    with pytest.raises(CoCoNetError, match="sequence length 63 is not divisible by 2; use --seq-len 62"):
        check_transforms(["scatter-send"], dp=1, tp=2, pp=2, split="layers", seq_len=63)
    check_transforms(["sharded-update", "overlap-grad-sync"], dp=2, tp=1, pp=1)   # ZeRO-2 with overlap
    with pytest.raises(CoCoNetError, match="optimizer 'adama'"):
        check_transforms(["overlap-grad-sync"], dp=2, tp=1, pp=1, optimizer="adama")


def test_buckets_cut_the_flat_buffer():
    assert gradient_buckets(10 * MB, 4 * MB) == [4 * MB, 4 * MB, 2 * MB]
    assert gradient_buckets(4 * MB, 4 * MB) == [4 * MB] and gradient_buckets(0) == []


def _one_stage(dp: int, transforms=(), **kw):
    pl = pipeline_placement(1, forward=1.0, backward=2.0, static_memory=[12 * MB])
    sched = build_schedule("1f1b", pl, 2)
    return lower(sched, dp=dp, segment_param_bytes={0: 4 * MB}, transforms=transforms, **kw)


def test_sharded_update_lowers_to_reduce_scatter_shard_step_and_all_gather():
    plain, sharded = _one_stage(2), _one_stage(2, ("sharded-update",))
    ops = [(i.op, i.nbytes) for i in sharded.streams[0] if i.op not in (Op.F, Op.B)]
    assert ops == [(Op.REDUCESCATTER, 4 * MB), (Op.OPTIM, 2 * MB), (Op.ALLGATHER, 4 * MB)]
    assert [(i.op, i.nbytes) for i in plain.streams[0] if i.op not in (Op.F, Op.B)] == \
        [(Op.ALLREDUCE, 4 * MB), (Op.OPTIM, 4 * MB)]
    # Adam's m and v (2 x 4 MiB) are kept for this replica's half only
    assert plain.static_memory[0] - sharded.static_memory[0] == 2 * (4 * MB - 2 * MB)
    tl = simulate(sharded, _Cost())
    kinds = [e.op for e in tl.events if e.stream == "collective"]
    assert kinds == ["REDUCESCATTER", "ALLGATHER"]
    ag = next(e for e in tl.events if e.op == "ALLGATHER")
    opt = next(e for e in tl.events if e.op == "OPTIM")
    assert ag.start >= opt.end and tl.makespan == pytest.approx(ag.end)
    assert opt.end - opt.start == pytest.approx(2.0)   # 1/dp of the parameters
    assert _one_stage(1, ("sharded-update",)).streams[0][-1].op == Op.OPTIM   # dp = 1: nothing to shard


def test_overlapped_sync_runs_buckets_during_the_last_backward():
    ex = _one_stage(2, ("overlap-grad-sync",), grad_bucket_bytes=1 * MB)
    buckets = [i for i in ex.streams[0] if i.op == Op.ALLREDUCE]
    assert [(i.bucket, i.nbytes, i.ready) for i in buckets] == [(k, MB, (k + 1) / 4) for k in range(4)]
    tl = simulate(ex, _Cost())
    last_b = max((e for e in tl.events if e.op == "B"), key=lambda e: e.end)
    first = min((e for e in tl.events if e.op == "ALLREDUCE"), key=lambda e: e.start)
    assert last_b.start < first.start < last_b.end       # a collective while the backward runs
    plain = simulate(_one_stage(2), _Cost())
    assert tl.makespan < plain.makespan


def test_zero2_with_overlap_reduce_scatters_buckets_during_the_last_backward():
    """``sharded-update`` with ``overlap-grad-sync`` (ZeRO-2 with overlap): one ``REDUCESCATTER`` per
    bucket, each ready after its share of the last backward, then the shard's step and the all-gather;
    the simulator starts the first reduce-scatter while that backward runs."""
    ex = _one_stage(2, ("sharded-update", "overlap-grad-sync"), grad_bucket_bytes=1 * MB)
    ops = [i for i in ex.streams[0] if i.op not in (Op.F, Op.B)]
    assert [(i.op, i.bucket, i.nbytes, i.ready) for i in ops[:4]] == \
        [(Op.REDUCESCATTER, k, MB, (k + 1) / 4) for k in range(4)]
    assert [(i.op, i.nbytes) for i in ops[4:]] == [(Op.OPTIM, 2 * MB), (Op.ALLGATHER, 4 * MB)]
    tl = simulate(ex, _Cost())
    last_b = max((e for e in tl.events if e.op == "B"), key=lambda e: e.end)
    first = min((e for e in tl.events if e.op == "REDUCESCATTER"), key=lambda e: e.start)
    assert last_b.start < first.start < last_b.end
    assert tl.makespan < simulate(_one_stage(2, ("sharded-update",)), _Cost()).makespan


def test_scatter_send_sends_a_slice_and_gathers_it():
    pl = pipeline_placement(2, forward=1.0, backward=2.0, activation_bytes=8 * MB)
    from dataclasses import replace

    from engine.placement import TensorSpec

    out = TensorSpec((4, 1024, 512), "float32")
    pl = replace(pl, blocks=tuple(replace(b, output=out) if b.kind == "F" else b for b in pl.blocks))
    sched = build_schedule("1f1b", pl, 2)
    plain = lower(sched, tp=2)
    scat = lower(sched, tp=2, transforms=("scatter-send",))
    sends = [i.nbytes for i in scat.streams[0] if i.op == Op.SEND]
    assert sends and all(nb * 2 == out.nbytes for nb in sends)
    assert [i.nbytes for i in plain.streams[0] if i.op == Op.SEND][0] == out.nbytes
    gathers = [i for i in scat.streams[1] if i.op == Op.ALLGATHER]
    assert gathers and all(g.block is not None and g.group == 2 and g.nbytes == out.nbytes for g in gathers)
    sp = lower(sched, tp=2, transforms=("tp-split", "scatter-send"))   # the boundary stays sharded
    assert not [i for i in sp.streams[1] if i.op == Op.ALLGATHER]
    split_only = lower(sched, tp=2, transforms=("tp-split",))          # tp-split alone sends the shard too
    assert [i.nbytes for i in split_only.streams[0] if i.op == Op.SEND] == sends
    assert not [i for i in split_only.streams[1] if i.op == Op.ALLGATHER]


def test_plans_record_their_transformations():
    from engine.io import Plan
    from engine.plan import make_plan

    res = make_plan("gpt2-tiny", devices=2, dp=2, micro_batches=2, device_type="cpu", seq_len=32,
                    transforms="sharded-update", grad_bucket_bytes=64 * 1024)
    par = res.plan.parallel
    assert par.transforms == ("sharded-update",)
    again = Plan.from_dict(res.plan.to_dict())
    assert again.parallel.transforms == par.transforms
    from engine.plan import lower_plan

    ops = [str(i.op) for i in lower_plan(again).streams[0]]
    assert "REDUCESCATTER" in ops and "ALLGATHER" in ops
    plain = make_plan("gpt2-tiny", devices=2, dp=2, micro_batches=2, device_type="cpu", seq_len=32)
    assert "transforms" not in plain.plan.to_dict()["parallel"]
    with pytest.raises(CoCoNetError, match="'tp-split' needs tp > 1"):
        make_plan("gpt2-tiny", devices=2, dp=2, micro_batches=2, device_type="cpu", transforms="tp-split")
