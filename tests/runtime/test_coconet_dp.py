"""CoCoNet's data-parallel transformations in the runtime train exactly like one process.

``sharded-update`` (CoCoNet section 6.1; ZeRO-1/2: the gradient all-reduce becomes a
reduce-scatter, each replica updates only its ``1/dp`` chunks with Adam states for them only, an
all-gather distributes the parameters) and ``overlap-grad-sync`` (CoCoNet section 4; PyTorch DDP's
buckets: each bucket of the flat gradient buffer all-reduced during the segment's last backward as
soon as its gradients are final), on dp x pp = 2 x 2 plans (world 4, ``make_plan(..., transforms=...,
grad_bucket_bytes=64 KiB)``, 1F1B and ZB-H1, llama-tiny and tessel-gpt, whose ``wte``/``lm_head`` are a
tied group across the two pipeline ranks), 3 steps on real processes over gloo
(``worker_harness.WorkerPool``), against the single-process reference
(``runtime.reference.reference_run``) and against the same plan without the transformation:

- every micro-batch loss equal (rtol 1e-4), the merged parameters equal (``assert_params_match``) to
  the reference's, and bit for bit equal to the untransformed plan's: Adam is elementwise, a bucket's
  sum is the whole buffer's sum on its slice, and two replicas' sums do not depend on the order;
- AdamA (``optimizer="adama"``) with the sharded update too;
- the optimizer state bytes per rank with the sharded update are ``1/dp`` of the plain ones (up to
  the padding of each parameter to a multiple of ``dp``);
- the measured timeline of ``overlap-grad-sync`` has bucket all-reduces that start while the
  rank's last backward block runs;
- both together (ZeRO-2 with overlap): bucketed reduce-scatters during the last backward, the
  sharded update's numbers bit for bit;
- a sharded-update checkpoint resumes exactly (Adam and AdamA);
- tensor parallelism: dp x tp = 2 x 2 with each transformation against the reference.

There is deliberately no ``tests/runtime/__init__.py`` (see ``test_worker.py``).
"""

from __future__ import annotations

import re

import pytest
import torch
from test_tensor_parallel import assert_params_match
from worker_harness import WorkerPool

STEPS = 3
MBS, SEQ, M, DP = 2, 16, 4, 2
BUCKET = 64 * 1024

_RUNS: dict = {}
_REFS: dict = {}


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(4)
    yield p
    p.close()


# ----------------------------------------------------------------------------- helpers
def _plan(model: str, schedule: str, transforms: tuple[str, ...] = (), optimizer: str = "adam", tp: int = 1):
    from engine.plan import make_plan

    pp = 4 // (DP * tp)
    return make_plan(model, devices=DP * tp * pp, dp=DP, tp=tp, micro_batches=M, schedule=schedule,
                     device_type="cpu", micro_batch_size=MBS, seq_len=SEQ, transforms=list(transforms),
                     grad_bucket_bytes=BUCKET, optimizer=optimizer).plan


def _batches(plan) -> list[tuple]:
    from engine.models import task_for_plan

    task = task_for_plan(plan, seed=0)
    return [tuple(task.train_batch(i, DP * M * MBS)) for i in range(STEPS)]


def _train(pool, model: str, schedule: str, transforms: tuple[str, ...] = (), optimizer: str = "adam",
           tp: int = 1) -> tuple:
    """``(plan, batches, {rank: result})`` of 3 uninterrupted steps (cached per configuration)."""
    key = (model, schedule, transforms, optimizer, tp)
    if key not in _RUNS:
        plan = _plan(model, schedule, transforms, optimizer, tp)
        batches = _batches(plan)
        task = {"plan": plan.to_dict(), "batches": batches, "steps": list(range(STEPS)), "fresh_process": tp > 1}
        _RUNS[key] = (plan, batches, pool.run_ok("worker_harness:step_task", task, world=4))
    return _RUNS[key]


def _reference(plan, batches, model: str, optimizer: str):
    """The single-process run (the same for every schedule and transformation of a model)."""
    from runtime.reference import reference_run

    if (model, optimizer) not in _REFS:
        _REFS[(model, optimizer)] = reference_run(plan, batches, seed=0, lr=1e-3, optimizer=optimizer)
    return _REFS[(model, optimizer)]


def _losses(out: dict) -> list[list[float]]:
    """Per step, every micro-batch loss in global order (replica 0's, then replica 1's), from the
    tensor rank 0 holders of the last stage."""
    holders = sorted((p["info"]["dp_index"], r) for r, p in out.items()
                     if p["losses"][0] and p["info"]["tp_rank"] == 0)
    assert [d for d, _ in holders] == list(range(DP))
    return [sum((out[r]["losses"][i] for _, r in holders), []) for i in range(len(out[holders[0][1]]["losses"]))]


def _merged(out: dict) -> dict:
    from runtime.worker import merge_model_state

    return merge_model_state(p["state"] for p in out.values())


def _assert_like_reference(out: dict, ref, label: str) -> None:
    for step, (g, r) in enumerate(zip(_losses(out), ref.losses)):
        assert torch.allclose(torch.tensor(g), torch.tensor(r), rtol=1e-4, atol=0), \
            f"{label} step {step}: {g} vs reference {r}"
    assert_params_match(_merged(out), ref.model, label)


def _assert_same_run(out: dict, plain: dict, label: str) -> None:
    """Bit for bit the untransformed plan's losses and parameters."""
    assert _losses(out) == _losses(plain), f"{label}: losses differ from the plan without the transformation"
    got, want = _merged(out), _merged(plain)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), \
            f"{label}: {k} differs from the plan without the transformation by {(got[k] - want[k]).abs().max():.3g}"


def _padding_bound(out: dict) -> int:
    """Most bytes a rank's sharded Adam states can exceed ``1/dp`` of the plain ones: each of ``m``
    and ``v`` pads every parameter to a multiple of ``dp`` (at most ``dp - 1`` floats)."""
    n = max(len(seg) for p in out.values() for seg in p["state"]["segments"].values())
    return 2 * 4 * (DP - 1) * n


# ----------------------------------------------------------------------------- the transformations
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("model", ["llama-tiny", "tessel-gpt"])
def test_sharded_update_trains_like_one_process_with_a_dp_th_of_the_states(pool, model, schedule):
    plan, batches, out = _train(pool, model, schedule, ("sharded-update",))
    label = f"{model} {schedule} sharded-update"
    for p in out.values():   # a reduce-scatter instead of the all-reduce, an all-gather after OPTIM
        assert any(s.startswith("REDUCESCATTER") for s in p["stream"])
        assert p["stream"][-1].startswith("ALLGATHER") and not any(s.startswith("ALLREDUCE grads") for s in p["stream"])
        names = {e["name"] for e in p["events"][-1]}
        assert {f"reducescatter s{s}" for s in p["info"]["segments"]} <= names
        assert {f"allgather s{s}" for s in p["info"]["segments"]} <= names
    _assert_like_reference(out, _reference(plan, batches, model, "adam"), label)
    _, _, plain = _train(pool, model, schedule)
    _assert_same_run(out, plain, label)
    for r, p in out.items():   # Adam's m and v for this replica's chunks only
        sharded, full = p["state_bytes"][-1], plain[r]["state_bytes"][-1]
        assert full > 0 and 0 <= sharded * DP - full <= _padding_bound(out), \
            f"{label} rank {r}: {sharded} optimizer state bytes, {full} without sharding"


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("model", ["llama-tiny", "tessel-gpt"])
def test_overlap_grad_sync_trains_like_one_process_and_overlaps_the_last_backward(pool, model, schedule):
    plan, batches, out = _train(pool, model, schedule, ("overlap-grad-sync",))
    label = f"{model} {schedule} overlap-grad-sync"
    _assert_like_reference(out, _reference(plan, batches, model, "adam"), label)
    _, _, plain = _train(pool, model, schedule)
    _assert_same_run(out, plain, label)
    for r, p in out.items():
        n_buckets = sum(1 for s in p["stream"] if " bucket " in s)
        assert n_buckets >= 3, f"{label} rank {r}: {BUCKET} B buckets must cut the gradients several times"
        for events in p["events"]:
            buckets = [e for e in events if re.fullmatch(r"allreduce s\d+ b\d+", e["name"])]
            assert len(buckets) == n_buckets
            last = max((e for e in events if e["op"] in ("B", "W")), key=lambda e: e["end"])
            # every bucket is posted while the last backward block runs (or right at its end), one starts inside it
            assert all(e["start"] >= last["start"] and e["end"] >= e["start"] for e in buckets)
            assert min(e["start"] for e in buckets) < last["end"], \
                f"{label} rank {r}: no bucket all-reduce starts before {last['name']} ends"


@pytest.mark.parametrize("model,schedule", [("llama-tiny", "1f1b"), ("tessel-gpt", "zb-h1")])
def test_zero2_with_overlap_trains_like_one_process_reduce_scattering_during_the_last_backward(pool, model,
                                                                                             schedule):
    """``sharded-update`` with ``overlap-grad-sync`` (ZeRO-2 with overlap): each gradient bucket is
    reduce-scattered to the replicas' shards as soon as it is final during the segment's last backward
    (``REDUCESCATTER`` with ``bucket``), each replica updates its chunks with Adam states for them only,
    then all-gathers the parameters: the single process's losses and parameters, and bit for bit the
    plain sharded update's (the same sums on the same chunks)."""
    plan, batches, out = _train(pool, model, schedule, ("sharded-update", "overlap-grad-sync"))
    label = f"{model} {schedule} ZeRO-2 with overlap"
    _assert_like_reference(out, _reference(plan, batches, model, "adam"), label)
    _, _, plain = _train(pool, model, schedule, ("sharded-update",))
    _assert_same_run(out, plain, label)
    for r, p in out.items():
        n_buckets = sum(1 for s in p["stream"] if s.startswith("REDUCESCATTER"))   # one per bucket
        assert n_buckets >= 3 and not any(s.startswith("ALLREDUCE grads") for s in p["stream"]), p["stream"]
        assert p["stream"][-1].startswith("ALLGATHER")
        for events in p["events"]:
            buckets = [e for e in events if re.fullmatch(r"reducescatter s\d+ b\d+", e["name"])]
            assert len(buckets) == n_buckets
            last = max((e for e in events if e["op"] in ("B", "W")), key=lambda e: e["end"])
            assert min(e["start"] for e in buckets if e["end"] > e["start"]) < last["end"], \
                f"{label} rank {r}: no bucket reduce-scatter starts before {last['name']} ends"
        sharded, full = p["state_bytes"][-1], plain[r]["state_bytes"][-1]
        assert sharded == full, f"{label} rank {r}: Adam states {sharded} B, the plain sharded update's {full} B"


@pytest.mark.parametrize("model,schedule", [("tessel-gpt", "1f1b"), ("llama-tiny", "zb-h1")])
def test_adama_sharded_update_trains_like_one_process(pool, model, schedule):
    """AdamA reduce-scatters its per-step ``[m | v | tied gradients]`` sums; each replica keeps
    ``m``/``v`` for its chunks only (the tied ``wte``/``lm_head`` chunks are summed across the
    pipeline ranks and folded once)."""
    plan, batches, out = _train(pool, model, schedule, ("sharded-update",), "adama")
    label = f"{model} {schedule} adama sharded-update"
    assert all(p["info"]["optimizer"] == "adama" for p in out.values())
    _assert_like_reference(out, _reference(plan, batches, model, "adama"), label)
    _, _, plain = _train(pool, model, schedule, (), "adama")
    for r, p in out.items():
        sharded, full = p["state_bytes"][-1], plain[r]["state_bytes"][-1]
        assert full > 0 and 0 <= sharded * DP - full <= _padding_bound(out), f"{label} rank {r}"


@pytest.mark.parametrize("optimizer,model", [("adam", "llama-tiny"), ("adama", "tessel-gpt")])
def test_a_sharded_update_checkpoint_resumes_exactly(pool, optimizer, model):
    """2 steps, each rank's state (its parameters and its optimizer shard), a fresh world, 1 more step:
    the losses and the parameters equal 3 uninterrupted steps."""
    plan, batches, whole = _train(pool, model, "1f1b", ("sharded-update",), optimizer)
    task = {"plan": plan.to_dict(), "batches": batches}
    first = pool.run_ok("worker_harness:step_task", dict(task, steps=[0, 1]), world=4)
    shard = first[0]["state"]["optimizer"]["shard"]
    assert shard["dp"] == DP and shard["index"] == 0 and first[2]["state"]["optimizer"]["shard"]["index"] == 1
    second = pool.run_ok("worker_harness:step_task", dict(task, steps=[2]), world=4,
                         per_rank={r: {"state": first[r]["state"]} for r in range(4)})
    assert _losses(second) == _losses(whole)[2:]
    for k, v in _merged(whole).items():
        assert torch.equal(_merged(second)[k], v), k


@pytest.mark.parametrize("model,transform", [("llama-tiny", "sharded-update"), ("tessel-gpt", "overlap-grad-sync")])
def test_tensor_parallel_parameters_keep_working(pool, model, transform):
    """dp x tp = 2 x 2: the transformations act on each rank's local DTensor shards (tessel-gpt's
    vocab-parallel embedding gets a replicated gradient, laid out like its parameter first)."""
    plan, batches, out = _train(pool, model, "1f1b", (transform,), tp=2)
    assert plan.parallel.tp == 2 and any(p["state"]["tp_shards"] for p in out.values())
    _assert_like_reference(out, _reference(plan, batches, model, "adam"), f"{model} tp=2 {transform}")


# ----------------------------------------------------------------------------- no processes
def test_shard_layout_round_trips_and_keeps_tied_chunks_aligned():
    from runtime.worker.optimizer import ShardLayout

    tensors = [torch.arange(7.0), torch.arange(4.0) + 100, torch.arange(1.0) + 200]
    lay = ShardLayout([t.numel() for t in tensors], 3)
    assert lay.chunks == [3, 2, 1] and lay.offsets == [0, 3, 5] and lay.width == 6
    rows = torch.full((3, lay.width), -1.0)
    for i, t in enumerate(tensors):
        lay.put(rows, i, t)
    assert rows[1].tolist() == [3, 4, 5, 102, 103, 0] and rows[2].tolist() == [6, 0, 0, 0, 0, 0]
    for i, t in enumerate(tensors):
        assert torch.equal(lay.get(rows, i), t)
        shard = torch.full((lay.width,), -1.0)
        lay.load_chunks(shard, i, t, 2)
        cols = slice(lay.offsets[i], lay.offsets[i] + lay.chunks[i])
        assert torch.equal(shard[cols], rows[2, cols])


def test_sharded_optimizer_states_load_only_into_the_same_shard():
    from runtime.worker import WorkerError
    from runtime.worker.optimizer import WorkerOptimizer

    def make(sharded: bool, index: int = 0) -> WorkerOptimizer:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
        opt = WorkerOptimizer("adam", 1e-3, {0: params}, set(), DP, torch.device("cpu"), sharded=sharded,
                              shard_index=index)
        for p in params:
            p.grad = torch.ones_like(p)
        if sharded:
            opt.shards[0].grad.fill_(1.0)
        opt.step([], 1)
        return opt

    sharded, plain = make(True), make(False)
    assert sharded.state_bytes() == 2 * 4 * (8 + 2) and plain.state_bytes() == 2 * 4 * 18
    sd = sharded.state_dict(compact=False)
    assert sd["shard"] == {"dp": DP, "index": 0, "widths": [[0, 10]]}
    make(True).load_state_dict(sd)
    with pytest.raises(WorkerError, match="not this rank's"):
        make(True, 1).load_state_dict(sd)
    with pytest.raises(WorkerError, match="are sharded across replicas but this plan does not use") as e:
        plain.load_state_dict(sd)
    assert "\n" not in str(e.value)
    with pytest.raises(WorkerError, match="are not sharded"):
        make(True).load_state_dict(plain.state_dict(compact=False))


def test_adama_with_overlap_grad_sync_is_refused_in_one_sentence():
    from runtime.worker.grad_sync import transform_refusal

    why = transform_refusal(("overlap-grad-sync",), optimizer="adama", dp=2, expert_parallel=False)
    assert why and "'overlap-grad-sync'" in why and "'adama'" in why and "\n" not in why
    assert transform_refusal(("sharded-update",), optimizer="adama", dp=2, expert_parallel=False) is None
    assert "expert-parallel" in transform_refusal(("sharded-update",), optimizer="adam", dp=2, expert_parallel=True)
    assert transform_refusal(("overlap-grad-sync",), optimizer="adama", dp=1, expert_parallel=False) is None
