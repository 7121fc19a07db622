"""Ordered point-to-point matching of the stage worker, on CPU with gloo (runs everywhere).

NCCL ignores message tags: it matches a communicator's sends and receives by posting order and
runs them in order on one stream. ``WorkerConfig(p2p_matching="ordered")`` (the default with NCCL)
therefore gives every ordered pair of ranks with traffic its own one-directional 2-rank group and
posts each pair's receives in the SENDER's stream order with a constant tag. Gloo honours that
order too, so the whole ordered path (pair groups, order derivation, receive posting, evaluate)
runs here; only the literal CUDA tensors and NCCL calls need a GPU (``test_cuda_worker.py``).

Checks: ordered-mode training over 2 and 4 ranks (GPipe, 1F1B, interleaved, Tessel-searched) and
dp=2 x pp=2 equals the single-process reference (same tolerance as ``test_worker.py``) and tag
mode exactly; receives posted lazily (at their RECV, in sender order) give the same; evaluate()
equals tag mode; an inconsistent peer order is refused at setup with a clear error; and the
pair-order derivation itself on plain lowered streams.

The multi-process harness is the shared ``worker_harness.WorkerPool``; the per-rank task is
``test_worker._run_task`` run with a StageWorker whose defaults select the matching mode.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_worker import M, _batches, _check_run, _pipelined_losses, _plan
from worker_harness import WorkerPool


# ----------------------------------------------------------------------------- task (runs in a pool process)
def _run_task(task: dict) -> dict:
    """``test_worker._run_task`` with ``StageWorker`` defaults ``p2p_matching=task["p2p"]`` and
    ``prepost_receives=task["prepost"]``; ``task["drop_send"]`` makes every rank believe that
    pipeline rank 0 does not post its SEND number ``drop_send`` (an inconsistent peer order);
    ``task["swap_on"]``: that rank alone believes pipeline rank 0 posts its first two SENDs the
    other way round (the same messages, in the wrong order)."""
    import dataclasses

    import test_worker

    from runtime import worker as wmod

    real = wmod.StageWorker
    drop = task.get("drop_send")
    swap_on = task.get("swap_on")

    class _Configured(real):
        def __init__(self, *args, config=None, **kw):
            config = dataclasses.replace(config or wmod.WorkerConfig(), p2p_matching=task["p2p"],
                                         prepost_receives=task.get("prepost", True))
            super().__init__(*args, config=config, **kw)

        def _peer_streams(self, plan):
            streams = super()._peer_streams(plan)
            sends = [i for i, ins in enumerate(streams[0]) if ins.op == "SEND"]
            if drop is not None:
                del streams[0][sends[drop]]
            if swap_on == self.rank:
                a, b = sends[0], sends[1]
                streams[0][a], streams[0][b] = streams[0][b], streams[0][a]
            return streams

    wmod.StageWorker = _Configured
    try:
        return test_worker._run_task(task)
    finally:
        wmod.StageWorker = real


class _Pool(WorkerPool):
    def run_mode(self, plan, batches, *, world: int, p2p: str, prepost: bool = True, drop_send: int | None = None,
                 swap_on: int | None = None, expect_errors: bool = False):
        return self.run("test_ordered_p2p:_run_task",
                        {"plan": plan.to_dict(), "batches": batches, "pg_timeout": 60.0, "p2p": p2p,
                         "prepost": prepost, "drop_send": drop_send, "swap_on": swap_on},
                        world=world, expect_errors=expect_errors)


@pytest.fixture(scope="module")
def pool():
    p = _Pool(4)
    yield p
    p.close()


def _ok(out: dict) -> dict:
    return {r: p for r, (_, p) in out.items()}


def _check_ordered(out: dict, plan, world: int) -> None:
    """Every rank ran ordered matching over one-directional pair groups of its own replica."""
    pp = plan.schedule.placement.num_devices
    for r, (_, p) in out.items():
        info = p["info"]
        assert info["p2p_matching"] == "ordered" and info["backend"] == "gloo" and info["device"] == "cpu"
        pairs = [tuple(x) for x in info["p2p_pairs"]]
        assert pairs and all(r in x and x[0] != x[1] and x[0] // pp == x[1] // pp == r // pp for x in pairs)
        # a rank that sends to a peer also receives from it (activations out, gradients back)
        assert {(b, a) for a, b in pairs} == set(pairs)


# ----------------------------------------------------------------------------- the pair orders (no processes)
def test_pair_order_of_1f1b_two_ranks():
    from engine.dependency import lower
    from runtime.worker.p2p_order import pair_send_orders, stream_messages

    plan = _plan(2, "1f1b")
    streams = lower(plan.schedule).streams
    counts = [(2, 1)]   # one boundary: 2 tensors forward (hidden states, mask), 1 gradient back
    orders = pair_send_orders(streams, counts)
    assert set(orders) == {(0, 1), (1, 0)}
    # rank 0 -> 1: the activations of micro-batches 0..m-1 in order, tensors in index order
    assert orders[(0, 1)] == [(0, 0, j, k) for j in range(M) for k in range(2)]
    # rank 1 -> 0: the input gradients, micro-batches in 1F1B's backward order (0..m-1)
    assert orders[(1, 0)] == [(0, 1, j, 0) for j in range(M)]
    assert stream_messages(streams[1], 0, "RECV", counts) == orders[(0, 1)]


def test_pair_order_follows_the_sender_and_refuses_mismatches():
    from engine.dependency import lower
    from runtime.worker import WorkerError
    from runtime.worker.p2p_order import pair_send_orders

    plan = _plan(2, "interleaved")   # 4 segments on 2 ranks: both directions carry both kinds
    streams = lower(plan.schedule).streams
    counts = [(2, 1)] * 3
    orders = pair_send_orders(streams, counts)
    assert {d for _, d, _, _ in orders[(0, 1)]} == {0, 1} and {d for _, d, _, _ in orders[(1, 0)]} == {0, 1}
    # the receiver's order is the sender's, whatever order the receiver consumes them in
    sends = [i for i, ins in enumerate(streams[0]) if ins.op == "SEND" and ins.peer == 1]
    swapped = [list(s) for s in streams]
    a, b = sends[0], sends[1]
    swapped[0][a], swapped[0][b] = swapped[0][b], swapped[0][a]
    reordered = pair_send_orders(swapped, counts)[(0, 1)]
    assert sorted(reordered) == sorted(orders[(0, 1)]) and reordered != orders[(0, 1)]
    assert reordered[:2] == orders[(0, 1)][2:4]
    # a SEND the receiver does not expect: a clear error naming the pair and the message
    dropped = [list(s) for s in streams]
    recvs = [i for i, ins in enumerate(dropped[1]) if ins.op == "RECV" and ins.peer == 0]
    lost = dropped[1].pop(recvs[2])
    with pytest.raises(WorkerError, match=r"pair pipeline rank 0 -> pipeline rank 1: the sender sends the "
                                          rf".* micro-batch {lost.block.micro_batch}, "
                                          r"which the receiver does not expect"):
        pair_send_orders(dropped, counts)
    # a receive the sender never posts
    short = [list(s) for s in streams]
    del short[0][sends[-1]]
    with pytest.raises(WorkerError, match="pair pipeline rank 0 -> pipeline rank 1: the receiver expects"):
        pair_send_orders(short, counts)


# ----------------------------------------------------------------------------- ordered == reference == tags
CASES = [
    (2, "gpipe", False), (2, "1f1b", False), (2, "interleaved", False),
    (2, "zb-h1", True),            # Tessel over the split-backward (I/W) placement
    (4, "gpipe", False), (4, "1f1b", False), (4, "interleaved", False),
    (4, "interleaved", True),      # Tessel over the interleaved placement (out-of-order micro-batches)
]
_TAGS: dict = {}


def _tag_run(pool, key, plan, dp: int, world: int) -> dict:
    if key not in _TAGS:
        _TAGS[key] = _ok(pool.run_mode(plan, _batches(dp), world=world, p2p="tags"))
    return _TAGS[key]


def _same_as_tags(out: dict, tags: dict, plan) -> None:
    ordered = _pipelined_losses(out, plan)
    tagged = _pipelined_losses({r: ("ok", p) for r, p in tags.items()}, plan)
    assert ordered == tagged, f"ordered {ordered} vs tags {tagged}"   # same arithmetic, bit for bit
    for r, (_, p) in out.items():
        assert p["eval"] == tags[r]["eval"]
        assert p["info"]["p2p_matching"] == "ordered" and tags[r]["info"]["p2p_matching"] == "tags"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("devices,schedule,tessel", CASES,
                         ids=[f"{d}-{'tessel-' if t else ''}{s}" for d, s, t in CASES])
def test_ordered_matching_equals_reference_and_tags(pool, devices, schedule, tessel):
    plan = _plan(devices, schedule, tessel=tessel)
    if tessel:
        assert plan.schedule.name == "tessel"
    out = pool.run_mode(plan, _batches(1), world=devices, p2p="ordered")
    _check_run(out, plan)
    _check_ordered(out, plan, devices)
    _same_as_tags(out, _tag_run(pool, (devices, schedule, tessel), plan, 1, devices), plan)


@pytest.mark.timeout(400)
def test_ordered_data_parallel_pipeline(pool):
    plan = _plan(4, "1f1b", dp=2)          # dp=2 x pp=2: pairs only inside a replica
    out = pool.run_mode(plan, _batches(2), world=4, p2p="ordered")
    _check_run(out, plan, dp=2)
    _check_ordered(out, plan, 4)
    assert sorted(tuple(x) for x in out[2][1]["info"]["p2p_pairs"]) == [(2, 3), (3, 2)]
    _same_as_tags(out, _tag_run(pool, "dp2", plan, 2, 4), plan)
    for pp_rank in (0, 1):   # replicas hold identical parameters
        a, b = out[pp_rank][1]["state"], out[2 + pp_rank][1]["state"]
        assert all(torch.equal(a[s][k], b[s][k]) for s in a for k in a[s])


@pytest.mark.timeout(400)
def test_lazy_receives_in_sender_order(pool):
    """``prepost_receives=False``: each RECV posts, in the sender's order, up to its own messages."""
    plan = _plan(4, "interleaved", tessel=True)
    out = pool.run_mode(plan, _batches(1), world=4, p2p="ordered", prepost=False)
    _check_run(out, plan)
    _same_as_tags(out, _tag_run(pool, (4, "interleaved", True), plan, 1, 4), plan)


@pytest.mark.timeout(300)
def test_inconsistent_peer_order_is_refused_at_setup(pool):
    plan = _plan(2, "1f1b")
    out = pool.run_mode(plan, _batches(1)[:1], world=2, p2p="ordered", drop_send=1, expect_errors=True)
    for r in (0, 1):   # every rank derives every pair alike, so all refuse before any collective
        status, msg = out[r]
        assert status == "error"
        assert "WorkerError: point-to-point pair pipeline rank 0 -> pipeline rank 1: the receiver expects the " \
               "activation tensor 0 of boundary 0 (segment 0 -> 1), micro-batch 1, which the sender does not send" \
               in msg, msg


@pytest.mark.timeout(300)
def test_receives_out_of_sender_order_corrupt_training(pool):
    """Why the receiver must follow the sender's order: with one constant tag gloo, like NCCL,
    pairs a group's receives with its sends by position, so a receiver that posts micro-batch 1's
    receives before micro-batch 0's (believing a swapped order; the sets agree, so setup cannot
    notice) trains on swapped activations."""
    from test_worker import _reference

    plan = _plan(2, "1f1b")
    out = _ok(pool.run_mode(plan, _batches(1), world=2, p2p="ordered", swap_on=1))
    got = out[1]["steps"][0]["losses"]
    ref = _reference(plan, _batches(1), 1)[0]
    assert not torch.allclose(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=0), (got, ref)
    assert torch.allclose(torch.tensor(got[2:]), torch.tensor(ref[2:]), rtol=1e-4, atol=0)   # before any update


def test_matching_mode_errors(monkeypatch):
    from runtime.worker import StageWorker, WorkerConfig, WorkerError

    plan = _plan(2, "1f1b")
    for kw, pattern in [({"p2p_matching": "fifo"}, "unknown p2p_matching 'fifo'"),
                        ({"backend": "nccl", "device": "cpu"}, "backend 'nccl' moves CUDA tensors only"),
                        ({"backend": "gloo", "device": "cuda"}, "gloo's point-to-point needs CPU tensors"),
                        ({"backend": "nccl", "device": "cuda:99"}, "needs GPU 99, but this process sees"),
                        ({"device": "tpu"}, "device 'tpu'")]:
        with pytest.raises(WorkerError, match=pattern):
            StageWorker(plan.to_dict(), 0, 2, "127.0.0.1", 1, config=WorkerConfig(**kw)).setup()
    w = StageWorker(plan.to_dict(), 0, 2, "127.0.0.1", 1)
    monkeypatch.setenv("TESSEL_P2P", "ordered")      # auto mode reads it (tests, launches on a local Ray)
    w._resolve_device_and_matching()
    assert w.p2p_mode == "ordered"
    monkeypatch.setenv("TESSEL_P2P", "bogus")
    with pytest.raises(WorkerError, match="TESSEL_P2P='bogus'"):
        w._resolve_device_and_matching()
    monkeypatch.delenv("TESSEL_P2P")
    w._resolve_device_and_matching()
    assert w.p2p_mode == "tags" and w._sync is None and not w._cuda   # gloo default: unchanged
    monkeypatch.setenv("TESSEL_P2P", "tags")
    with pytest.raises(WorkerError, match="p2p_matching 'tags' needs gloo"):
        StageWorker(plan.to_dict(), 0, 2, "127.0.0.1", 1,
                    config=WorkerConfig(backend="nccl", device="cuda"))._resolve_device_and_matching()


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([os.path.abspath(__file__), "-q"]))
