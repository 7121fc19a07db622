"""CoCoNet's tensor-parallel transformations in the runtime train exactly like plans without them.

CoCoNet (Jangda et al., ASPLOS 2022) rewrites communication and computation together; the runtime
executes three of its rewrites of tensor parallelism (``plan.parallel.transforms``):

- ``tp-split`` (Megatron sequence parallelism: reduce-scatter, norms / dropout / residual adds on the
  ``1/tp`` sequence shard, all-gather before the column-parallel layers; ``runtime.tensor_parallel``),
- ``scatter-send`` (each tensor rank sends its ``1/tp`` slice of a boundary tensor, the receiving
  tensor group all-gathers it; ``runtime.worker.tp_comm``),
- ``chunked-overlap`` (a row-parallel matmul and its all-reduce pipelined over sequence chunks;
  ``runtime.chunked_overlap``).

For each, on ``tessel-gpt`` and ``llama-tiny`` with 1F1B and ZB-H1 (``tp-split`` and
``chunked-overlap`` on dp x tp x pp = 2 x 2 x 1, ``scatter-send`` on 1 x 2 x 2; ``tp-split`` on llama-tiny also
on 1 x 2 x 2, where the boundary is the ``[B, T/tp, H]`` shard), real gloo processes
(``worker_harness.WorkerPool``) train 3 Adam steps on the CPython sources and

- every micro-batch loss equals the plan without the transformation's and the single-process
  reference's (``runtime.reference.reference_run``; rtol 1e-4),
- every parameter equals the reference's (``test_tensor_parallel.assert_params_match``: merged
  tensor-parallel shards, at most one element in 10,000 beyond atol 1e-5),
- and the transformation really ran: ``scatter-send`` sends ``1/tp`` of the plain plan's bytes per
  boundary message (measured SEND events) and all-gathers each received block; ``tp-split``'s
  boundaries are ``[B, T/tp, H]``; ``chunked-overlap``'s row-parallel layers are chunked.

There is deliberately no ``tests/runtime/__init__.py`` (see ``test_worker.py``).
"""

from __future__ import annotations

import pytest
import torch
from test_tensor_parallel import assert_params_match
from worker_harness import WorkerPool, free_port

STEPS = 3
MBS, SEQ, M = 2, 16, 4


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(4)
    yield p
    p.close()


def _plan(model: str, schedule: str, dp: int, tp: int, pp: int, transforms: str = ""):
    from engine.plan import make_plan

    return make_plan(model, devices=dp * tp * pp, dp=dp, tp=tp, micro_batches=M, schedule=schedule,
                     device_type="cpu", micro_batch_size=MBS, seq_len=SEQ, transforms=transforms or None).plan


def _batches(plan, dp: int) -> list[tuple]:
    from engine.models import task_for_plan
    task = task_for_plan(plan, seed=0)
    return [tuple(task.train_batch(i, dp * M * MBS)) for i in range(STEPS)]


def _train(task: dict) -> dict:
    """A pool task: one rank trains ``task["batches"]``; returns its setup info, losses per step, final
    state, the evaluation loss of the first batch after training (``None`` off the last stage), the bytes
    of every SEND / RECV of the first step (by event name), its ALLGATHER events, and which layers run
    chunked (``chunked-overlap``)."""
    from runtime.chunked_overlap import ChunkedRowwiseLinear
    from runtime.worker import StageWorker, WorkerConfig

    w = StageWorker(task["plan"], task["rank"], task["world"], "127.0.0.1", task["port"],
                    config=WorkerConfig(timeout_s=60.0))
    try:
        info = w.setup()
        steps = [w.step(i, b) for i, b in enumerate(task["batches"])]
        events = steps[0]["events"]
        return {"info": info, "losses": [s["losses"] for s in steps], "state": w.state_dict(),
                "eval": w.evaluate(task["batches"][0]),
                "sends": {e["name"]: e["nbytes"] for e in events if e["op"] == "SEND"},
                "recvs": {e["name"]: e["nbytes"] for e in events if e["op"] == "RECV"},
                "gathers": [(e["name"], e["nbytes"]) for e in events if e["op"] == "ALLGATHER"],
                "chunked": sorted(f"s{s}:{n}" for s in w.segments for n, m in w.modules[s].named_modules()
                                  if isinstance(m, ChunkedRowwiseLinear)),
                "tp_rank": w.tp_rank, "dp_index": w.dp_index}
    finally:
        w.shutdown()


_RUNS: dict = {}


def _run(pool, model: str, schedule: str, dims: tuple[int, int, int], transforms: str) -> tuple:
    """(plan, batches, per-rank results) of one plan, each configuration trained once per module."""
    key = (model, schedule, dims, transforms)
    if key not in _RUNS:
        dp, tp, pp = dims
        plan = _plan(model, schedule, dp, tp, pp, transforms)
        assert plan.parallel.transforms == ((transforms,) if transforms else ())
        batches = _batches(plan, dp)
        out = pool.run_ok("test_coconet_tp:_train", {"plan": plan.to_dict(), "batches": batches, "fresh_process": True},
                          world=dp * tp * pp)
        _RUNS[key] = (plan, batches, out)
    return _RUNS[key]


def _losses(out: dict, dp: int, tp_rank: int) -> list[list[float]]:
    """Per step, the micro-batch losses of all replicas in global order, from the ranks of ``tp_rank``."""
    holders = {p["dp_index"]: p for p in out.values() if p["losses"][0] and p["tp_rank"] == tp_rank}
    assert sorted(holders) == list(range(dp))
    return [sum((holders[d]["losses"][i] for d in range(dp)), []) for i in range(STEPS)]


def _check_trains_like_plain_and_reference(pool, model: str, schedule: str, dims: tuple[int, int, int],
                                           transforms: str) -> dict:
    from runtime.reference import reference_run
    from runtime.worker import merge_model_state

    dp, tp, pp = dims
    plan, batches, out = _run(pool, model, schedule, dims, transforms)
    _, _, plain = _run(pool, model, schedule, dims, "")
    ref = reference_run(plan, batches, seed=0, lr=1e-3)
    label = f"{model} {schedule} {dp}x{tp}x{pp} {transforms}"
    for t in range(tp):
        got, base = _losses(out, dp, t), _losses(plain, dp, t)
        for step in range(STEPS):
            for other, what in ((base[step], "without it"), (ref.losses[step], "the reference")):
                assert torch.allclose(torch.tensor(got[step]), torch.tensor(other), rtol=1e-4, atol=0), \
                    f"{label}: tp rank {t} step {step}: {got[step]} vs {what} {other}"
        assert got[-1] != got[0], "the model must actually train"
    for r, p in out.items():   # evaluation (forward only, whole boundaries or shards) after training
        assert (p["eval"] is None) == (plain[r]["eval"] is None)
        if p["eval"] is not None:
            assert p["eval"] == pytest.approx(plain[r]["eval"], rel=1e-4), f"{label}: rank {r} evaluate"
    assert_params_match(merge_model_state(p["state"] for p in out.values()), ref.model, label)
    return out


@pytest.mark.parametrize("model", ["tessel-gpt", "llama-tiny"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_tp_split_trains_like_plain_tensor_parallelism(pool, model, schedule):
    """``tp-split`` on dp=2 x tp=2: equal losses and parameters; the norms' weights are replicated
    (their partial gradients summed over the tensor group), the rest sharded as before."""
    out = _check_trains_like_plain_and_reference(pool, model, schedule, (2, 2, 1), "tp-split")
    for p in out.values():
        assert not p["chunked"]


def test_tp_split_sends_the_sequence_shard_between_stages(pool):
    """``tp-split`` on tp=2 x pp=2 (llama-tiny: its stages wrap the received shard back into a ``Shard(1)``
    DTensor): each boundary tensor is this tensor rank's ``[B, T/2, H]`` shard, sent as is (half the plain
    plan's bytes) with no all-gather, and training is unchanged."""
    out = _check_trains_like_plain_and_reference(pool, "llama-tiny", "1f1b", (1, 2, 2), "tp-split")
    _, _, plain = _run(pool, "llama-tiny", "1f1b", (1, 2, 2), "")
    for r, p in out.items():
        assert [b["shape"] for bs in p["info"]["boundaries"] for b in bs] == \
            [[s[0], s[1] // 2, *s[2:]] for bs in plain[r]["info"]["boundaries"] for s in (b["shape"] for b in bs)]
        assert not p["gathers"]
        assert p["sends"] and {k: 2 * v for k, v in p["sends"].items()} == plain[r]["sends"]


@pytest.mark.parametrize("model", ["tessel-gpt", "llama-tiny"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_scatter_send_trains_like_whole_sends_and_sends_a_tp_th(pool, model, schedule):
    """``scatter-send`` on tp=2 x pp=2: equal losses and parameters; every SEND (activations and
    input gradients) and RECV carries half the plain plan's bytes, and every received block is
    all-gathered (the whole boundary's bytes) from the tensor group."""
    out = _check_trains_like_plain_and_reference(pool, model, schedule, (1, 2, 2), "scatter-send")
    _, _, plain = _run(pool, model, schedule, (1, 2, 2), "")
    for r, p in out.items():
        assert p["sends"] and set(p["sends"]) == set(plain[r]["sends"])
        for name, nbytes in p["sends"].items():
            assert nbytes * 2 == plain[r]["sends"][name], f"rank {r} {name}: {nbytes} vs {plain[r]['sends'][name]}"
        for name, nbytes in p["recvs"].items():
            assert nbytes * 2 == plain[r]["recvs"][name]
        assert len(p["gathers"]) == len(p["recvs"])
        assert all(nb == 2 * next(iter(p["recvs"].values())) for _, nb in p["gathers"])
        assert [b["shape"] for bs in p["info"]["boundaries"] for b in bs] == \
            [b["shape"] for bs in plain[r]["info"]["boundaries"] for b in bs]   # whole tensors to the stages


@pytest.mark.parametrize("model", ["tessel-gpt", "llama-tiny"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_chunked_overlap_trains_like_plain_tensor_parallelism(pool, model, schedule):
    """``chunked-overlap`` on dp=2 x tp=2: equal losses and parameters; every row-parallel layer (the
    attention output and MLP down projections) runs chunked."""
    out = _check_trains_like_plain_and_reference(pool, model, schedule, (2, 2, 1), "chunked-overlap")
    want = {"tessel-gpt": ("attn.c_proj", "mlp.c_proj"), "llama-tiny": ("self_attn.o_proj", "mlp.down_proj")}[model]
    for p in out.values():
        assert p["chunked"] and {n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] for n in p["chunked"]} == set(want)
        assert len(p["chunked"]) == 2 * 4   # two per block, four blocks


def test_chunked_matmul_equals_the_all_reduced_matmul():
    """:class:`runtime.chunked_overlap.ChunkedRowwiseMatmul` on one gloo rank: the chunks (uneven: 5
    over 16 positions) put together equal ``x @ W^T + b``, and its backward equals autograd's."""
    import torch.distributed as dist

    from runtime.chunked_overlap import chunked_rowwise_matmul

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 16, 12, generator=g, requires_grad=True)
        w = torch.randn(8, 12, generator=g, requires_grad=True)
        b = torch.randn(8, generator=g, requires_grad=True)
        y = chunked_rowwise_matmul(x, w, b, dist.group.WORLD, 5)
        want = torch.nn.functional.linear(x, w, b)
        torch.testing.assert_close(y, want)
        gy = torch.randn(y.shape, generator=g)
        got = torch.autograd.grad(y, (x, w, b), gy)
        exp = torch.autograd.grad(want, (x, w, b), gy)
        for a, e in zip(got, exp):
            torch.testing.assert_close(a, e)
    finally:
        if started:
            dist.destroy_process_group()


@pytest.mark.parametrize("transforms,seq,match", [
    ("tp-split,chunked-overlap", SEQ, r"'chunked-overlap'.*'tp-split'.*one of the two"),
    ("scatter-send", 15, r"'scatter-send' cuts each sequence of 15 tokens.*divisible by 2"),
    ("tp-split", 15, r"'tp-split' cuts each sequence of 15 tokens.*divisible by 2"),
])
def test_refusals_are_one_sentence_at_setup(transforms, seq, match):
    """``chunked-overlap`` with ``tp-split``, and a sequence ``tp`` does not divide, are refused by the
    planner in one sentence; a plan file edited by hand to ask for them anyway is refused by the worker's
    setup before it joins any process group, again in one sentence."""
    from engine.errors import CoCoNetError
    from engine.plan import make_plan
    from runtime.stages import RuntimeNotSupported
    from runtime.worker import StageWorker, WorkerConfig

    kwargs = dict(devices=4, dp=1, tp=2, micro_batches=M, schedule="1f1b", device_type="cpu",
                  micro_batch_size=MBS, seq_len=seq)
    with pytest.raises(CoCoNetError) as planned:
        make_plan("tessel-gpt", transforms=transforms, **kwargs)
    assert "\n" not in str(planned.value) and transforms.split(",")[-1] in str(planned.value)

    # The same request written into a plan file by hand: the worker refuses it too.
    d = make_plan("tessel-gpt", **kwargs).plan.to_dict()
    d["parallel"]["transforms"] = transforms.split(",")
    w = StageWorker(d, 0, 4, "127.0.0.1", 1, WorkerConfig())
    with pytest.raises(RuntimeNotSupported, match=match) as e:
        w.setup()
    assert "\n" not in str(e.value)
