"""Fully sharded data parallelism (FSDP2, ZeRO-3; ``parallel.dp_shard > 1``) in the runtime trains
exactly like one process.

Each rank's eager stages are wrapped with ``torch.distributed.fsdp.fully_shard`` per transformer
block and per stage root (:mod:`runtime.fsdp`, torchtitan's ``apply_fsdp``), over gloo on real
processes (``worker_harness.WorkerPool``, a fresh process per rank: DTensor caches per mesh), 3 Adam
steps of ``llama-tiny`` or ``tessel-gpt`` (its ``wte``/``lm_head`` a tied group across pipeline ranks)
against the single-process reference (``runtime.reference.reference_run``): every micro-batch loss
equal (rtol 1e-4) and the merged parameters equal (``assert_params_match``), for

- dp_shard 2 alone (each rank really holds half of every parameter and Adam state);
- dp_shard 2 x pp 2 on 1F1B, ZB-H1 and interleaved 1F1B (torch.distributed.pipelining's rule:
  gradients reduced after a stage's last backward; the zero-bubble ``W`` reduces by hand; two FSDP
  roots per rank when interleaved);
- dp_shard 2 x tp 2 (FSDP over DTensor tensor-parallel shards of one root mesh);
- dp_replicate 2 x dp_shard 2 (HSDP, a 2-D data-parallel mesh);
- ``bf16-mixed`` (FSDP2's mixed precision, rtol 2e-2 against the single process's autocast);
- a checkpoint of sharded states resumes exactly.

ZeRO-2 with overlap (``sharded-update`` + ``overlap-grad-sync``) is in ``test_coconet_dp.py``.
There is deliberately no ``tests/runtime/__init__.py`` (see ``test_worker.py``).
"""

from __future__ import annotations

import pytest
import torch
from test_tensor_parallel import assert_params_match
from worker_harness import WorkerPool

STEPS = 3
MBS, SEQ, M = 2, 16, 4

_REFS: dict = {}


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(4)
    yield p
    p.close()


def _plan(model: str, schedule: str, *, dp: int, dp_shard: int, tp: int = 1, pp: int = 1, precision: str = "32-true"):
    from engine.plan import make_plan

    plan = make_plan(model, devices=dp * tp * pp, dp=dp, tp=tp, dp_shard=dp_shard, micro_batches=M,
                     schedule=schedule, device_type="cpu", micro_batch_size=MBS, seq_len=SEQ,
                     precision=precision).plan
    assert plan.parallel.dp_shard == dp_shard and plan.parallel.pp == pp
    assert plan.model.split == "layers", "dp_shard > 1 needs eager per-block stages (engine.split.choose_split)"
    return plan


def _batches(plan) -> list[tuple]:
    from engine.models import task_for_plan

    task = task_for_plan(plan, seed=0)
    return [tuple(task.train_batch(i, plan.parallel.dp * M * MBS)) for i in range(STEPS)]


def _run(pool, plan, batches, steps=range(STEPS), per_rank=None, evaluate: bool = False) -> dict:
    task = {"plan": plan.to_dict(), "batches": batches, "steps": list(steps), "fresh_process": True,
            "evaluate": evaluate}
    return pool.run_ok("worker_harness:step_task", task, world=plan.parallel.devices, per_rank=per_rank)


def _reference(plan, batches, key):
    from runtime.reference import reference_run

    if key not in _REFS:
        _REFS[key] = reference_run(plan, batches, seed=0, lr=1e-3)
    return _REFS[key]


def _losses(out: dict, dp: int) -> list[list[float]]:
    """Per step, every micro-batch loss in global order, from the tensor rank 0 holders of the last stage."""
    holders = sorted((p["info"]["dp_index"], r) for r, p in out.items() if p["losses"][0] and p["info"]["tp_rank"] == 0)
    assert [d for d, _ in holders] == list(range(dp))
    return [sum((out[r]["losses"][i] for _, r in holders), []) for i in range(len(out[holders[0][1]]["losses"]))]


def _merged(out: dict) -> dict:
    from runtime.worker import merge_model_state

    return merge_model_state(p["state"] for p in out.values())


def _assert_like_reference(out: dict, plan, ref, label: str) -> None:
    got = _losses(out, plan.parallel.dp)
    for step, (g, r) in enumerate(zip(got, ref.losses)):
        assert torch.allclose(torch.tensor(g), torch.tensor(r), rtol=1e-4, atol=0), \
            f"{label} step {step}: {g} vs reference {r}"
    assert got[-1] != got[0], f"{label}: the model must actually train"
    assert_params_match(_merged(out), ref.model, label)


def _assert_sharded(out: dict, ref, dp_shard: int, label: str) -> None:
    """Every rank holds ``1/dp_shard`` of dim 0 of each parameter it runs (FSDP's ``torch.chunk``), its
    Adam states only for those elements, and the shards of a shard group add up to the whole."""
    full = ref.model.state_dict()
    for r, p in out.items():
        fsdp = p["state"]["fsdp_shards"]
        assert fsdp, f"{label} rank {r}: no fully sharded entry in its checkpoint"
        tp_shards = p["state"]["tp_shards"]
        for seg in p["state"]["segments"].values():
            for name, t in seg.items():
                if name not in fsdp:
                    continue
                assert fsdp[name][2] == dp_shard
                rows = full[name].shape[0] // (tp_shards[name][2] if tp_shards.get(name, [1])[0] == 0 else 1)
                chunks = torch.arange(rows).chunk(dp_shard)
                mine = len(chunks[fsdp[name][1]]) if fsdp[name][1] < len(chunks) else 0
                assert t.shape[0] == mine, \
                    f"{label} rank {r}: {name} holds {t.shape[0]} of {rows} rows, not its 1/{dp_shard}"
        local = p["info"]["params"]   # elements of the rank's (distinct) parameters: its shards
        assert p["state_bytes"][-1] == 2 * 4 * local, \
            f"{label} rank {r}: {p['state_bytes'][-1]} optimizer state bytes for {local} local elements"


# ----------------------------------------------------------------------------- processes
def test_dp_shard_2_trains_like_one_process_holding_half_of_each_parameter(pool):
    plan = _plan("llama-tiny", "1f1b", dp=2, dp_shard=2)
    batches = _batches(plan)
    out = _run(pool, plan, batches, evaluate=True)   # evaluate() after the steps, then the checkpoint
    ref = _reference(plan, batches, "llama-tiny")
    _assert_like_reference(out, plan, ref, "llama-tiny dp_shard 2")
    _assert_sharded(out, ref, 2, "llama-tiny dp_shard 2")
    total = sum(p.numel() for p in ref.model.parameters())
    assert sum(p["info"]["params"] for p in out.values()) == total   # the two halves, nothing held twice
    from engine.plan import lower_plan

    want = [str(i) for i in lower_plan(plan).streams[0]]
    for p in out.values():   # the engine's FSDP markers; no data-parallel all-reduce (FSDP reduces in the blocks)
        assert p["stream"] == want
        assert any(s.startswith("UNSHARD") for s in want) and any(s.startswith("REDUCESCATTER") for s in want)
        assert not any(s.startswith("ALLREDUCE grads") for s in p["stream"]), p["stream"]
    from engine.plan import make_plan

    replicated = make_plan("llama-tiny", devices=2, dp=2, micro_batches=M, schedule="1f1b", device_type="cpu",
                           micro_batch_size=MBS, seq_len=SEQ).plan
    plain = _run(pool, replicated, batches, evaluate=True)
    for r, p in out.items():   # evaluation gathers the trained shards: the replicated run's loss
        assert p["evaluated"] == pytest.approx(plain[r]["evaluated"], rel=1e-4)
    for r, p in out.items():   # the blocks save about what replicated ones do: gathered parameters (about
        # 0.86 MB here, more than the activations) are no activations; seen: 5% less (713,860 against 754,820 B)
        got, want = p["activations"][-1], plain[r]["activations"][-1]
        assert 0.9 * want <= got <= 1.05 * want, (r, got, want)


@pytest.mark.parametrize("model,schedule", [("tessel-gpt", "1f1b"), ("llama-tiny", "zb-h1"),
                                            ("tessel-gpt", "interleaved")])
def test_dp_shard_2_with_a_pipeline_trains_like_one_process(pool, model, schedule):
    plan = _plan(model, schedule, dp=2, dp_shard=2, pp=2)
    batches = _batches(plan)
    out = _run(pool, plan, batches)
    ref = _reference(plan, batches, model)
    label = f"{model} {schedule} dp_shard 2 x pp 2"
    _assert_like_reference(out, plan, ref, label)
    _assert_sharded(out, ref, 2, label)


def test_dp_shard_2_with_tensor_parallelism_trains_like_one_process(pool):
    plan = _plan("llama-tiny", "1f1b", dp=2, dp_shard=2, tp=2)
    batches = _batches(plan)
    out = _run(pool, plan, batches)
    ref = _reference(plan, batches, "llama-tiny")
    assert any(p["state"]["tp_shards"] for p in out.values())
    _assert_like_reference(out, plan, ref, "llama-tiny dp_shard 2 x tp 2")
    _assert_sharded(out, ref, 2, "llama-tiny dp_shard 2 x tp 2")


def test_hsdp_dp_replicate_2_x_dp_shard_2_trains_like_one_process(pool):
    plan = _plan("tessel-gpt", "1f1b", dp=4, dp_shard=2)
    assert plan.parallel.dp_replicate == 2
    batches = _batches(plan)
    out = _run(pool, plan, batches)
    ref = _reference(plan, batches, "tessel-gpt dp 4")
    _assert_like_reference(out, plan, ref, "tessel-gpt HSDP 2 x 2")
    _assert_sharded(out, ref, 2, "tessel-gpt HSDP 2 x 2")
    by_shard: dict = {}   # the replicas of a shard hold the same elements
    for p in out.values():
        by_shard.setdefault(p["info"]["dp_index"] % 2, []).append(p["state"]["segments"])
    for states in by_shard.values():
        a, b = states
        for s in a:
            for k in a[s]:
                assert torch.equal(a[s][k], b[s][k]), k


def test_bf16_mixed_gathers_bfloat16_parameters_and_trains_like_autocast(pool):
    """``bf16-mixed``: FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``
    over float32 master shards trains like the single process's autocast (the same bfloat16 matmuls;
    the norms see bfloat16-rounded weights here, so rtol 2e-2), and the shards stay float32."""
    from runtime.reference import reference_run

    plan = _plan("llama-tiny", "1f1b", dp=2, dp_shard=2, precision="bf16-mixed")
    batches = _batches(plan)
    out = _run(pool, plan, batches)
    ref = reference_run(plan, batches, seed=0, lr=1e-3)
    got = _losses(out, 2)
    for step, (g, r) in enumerate(zip(got, ref.losses)):
        assert torch.allclose(torch.tensor(g), torch.tensor(r), rtol=2e-2, atol=0), f"step {step}: {g} vs {r}"
    assert sum(got[-1]) < sum(got[0])
    for p in out.values():
        assert all(t.dtype == torch.float32 for seg in p["state"]["segments"].values() for t in seg.values()
                   if t.is_floating_point())


def test_a_fully_sharded_checkpoint_resumes_exactly(pool):
    """2 steps, each rank's sharded state (its parameter shards and Adam states), a fresh world, 1
    more step: the losses and merged parameters equal 3 uninterrupted steps."""
    plan = _plan("llama-tiny", "1f1b", dp=2, dp_shard=2)
    batches = _batches(plan)
    whole = _run(pool, plan, batches)
    first = _run(pool, plan, batches, steps=[0, 1])
    second = _run(pool, plan, batches, steps=[2], per_rank={r: {"state": first[r]["state"]} for r in first})
    assert _losses(second, 2) == _losses(whole, 2)[2:]
    want = _merged(whole)
    got = _merged(second)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


# ----------------------------------------------------------------------------- no processes
def test_reducing_blocks_follow_the_markers_else_the_last_backward():
    from engine.dependency import Instruction, Op
    from engine.schedule import Block
    from runtime.fsdp import reducing_blocks

    def blk(kind: str, s: int, j: int) -> Block:
        return Block(s, kind, j)

    stream = [Instruction(Op.F, blk("F", 0, 0)), Instruction(Op.F, blk("F", 0, 1)),
              Instruction(Op.I, blk("I", 0, 0)), Instruction(Op.W, blk("W", 0, 0)),
              Instruction(Op.I, blk("I", 0, 1)), Instruction(Op.W, blk("W", 0, 1)),
              Instruction(Op.F, blk("F", 1, 0)), Instruction(Op.B, blk("B", 1, 0)),
              Instruction(Op.F, blk("F", 1, 1)), Instruction(Op.B, blk("B", 1, 1))]
    assert reducing_blocks(stream, [0, 1]) == {(0, 1, "W"), (1, 1, "B")}
    marked = stream + [Instruction(Op.REDUCESCATTER, blk("B", 1, 0), segment=1, bucket=0),
                       Instruction(Op.REDUCESCATTER, blk("I", 0, 0), segment=0, bucket=0)]
    assert reducing_blocks(marked, [0, 1]) == {(0, 0, "W"), (1, 0, "B")}
    assert reducing_blocks(stream, [1]) == {(1, 1, "B")}


def test_fsdp_units_are_the_blocks_and_choose_split_picks_the_layer_split():
    from engine.models import build_model
    from engine.split import choose_split
    from runtime.fsdp import fsdp_blocks
    from runtime.stages.layer_split import split_layers

    model = build_model("tessel-gpt", batch_size=1, seq_len=SEQ).module
    assert choose_split(model) == "tracer" and choose_split(model, dp_shard=2) == "layers"
    n = len(model.transformer.h)
    stage = split_layers(model, [["transformer.wte", "transformer.wpe"] + [f"transformer.h.{i}" for i in range(n)]
                                 + ["transformer.ln_f", "lm_head"]], "tessel-gpt")[0]
    assert fsdp_blocks(stage) == list(stage.transformer.h)


def test_what_fsdp_does_not_run_is_refused_in_one_sentence():
    from runtime.fsdp import fsdp_refusal

    ok = {"precision": "bf16-mixed", "optimizer": "adam", "transforms": (), "split": "layers"}
    assert fsdp_refusal(**ok) is None
    for change, needle in ((dict(split="tracer"), "'layers' split"), (dict(optimizer="adama"), "'adama'"),
                           (dict(transforms=("sharded-update",)), "'sharded-update'"),
                           (dict(precision="16-mixed"), "'16-mixed'"), (dict(moe=True), "MoE")):
        why = fsdp_refusal(**{**ok, **change})
        assert why and needle in why and "\n" not in why and "dp_shard" in why, why


def test_a_plan_fsdp_cannot_run_is_refused_before_anything_starts():
    from runtime.stages import RuntimeNotSupported, check_executable

    plan = _plan("llama-tiny", "1f1b", dp=2, dp_shard=2)
    check_executable(plan)
    plan.model.split = "tracer"
    with pytest.raises(RuntimeNotSupported, match="fully_shard"):
        check_executable(plan)


def test_mixed_precision_policy_follows_the_plan():
    from engine.precision import get_policy
    from runtime.fsdp import mixed_precision

    mp = mixed_precision(get_policy("bf16-mixed"))
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision(get_policy("32-true")).param_dtype is None
