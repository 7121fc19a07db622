"""Tessel's placements with all-device blocks train exactly like one process.

The M shape as a language model fills it (the embedding and the final norm + LM head each on all
devices, vocab-parallel, a pipeline of blocks between them: ``engine.shapes.m_model_shape``) and
the NN shape (all-device blocks at the start and in the middle of a pipeline), searched by Tessel
with the model's real costs (``engine.plan.model_search.model_search_plan``) for a Llama-style model,
Hugging Face GPT-2 on M (its ``Conv1D`` projections sharded by ``runtime.conv1d_parallel``) and
a GPT-2-style model (``tessel-gpt``, whose tied ``wte``/``lm_head`` are then two copies sharded over
all devices in different segments, or, in NN, one sharded copy and one whole) on 2 ranks: each
all-device segment runs as a tensor-parallel group over its devices (DTensor), the boundary
between it and the one-device stages is lowered by the engine (``engine.dependency.lower``: no
send where the activation is already replicated, a send from the one-device stage to every other
device of the block), and 3 Adam steps over gloo equal the single-process reference
(``runtime.reference.reference_run``):
every micro-batch loss (rtol 1e-4) and every parameter (merged from the ranks' shards;
``test_tensor_parallel.assert_params_match``).

There is deliberately no ``tests/runtime/__init__.py`` (see ``test_worker.py``).
"""

from __future__ import annotations

import pytest
import torch
from test_tensor_parallel import STEPS, assert_params_match
from worker_harness import WorkerPool

MBS, SEQ, M = 2, 16, 4


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2)
    yield p
    p.close()


def _search_plan(model: str, shape: str, devices: int = 2, tp_plan: dict | None = None):
    from engine.plan import model_search_plan

    return model_search_plan(model, shape, devices, M, micro_batch_size=MBS, seq_len=SEQ, device_type="cpu",
                             time_limit=10, tp_plan=tp_plan).plan


@pytest.mark.parametrize("model,shape", [(m, s) for m in ("llama-tiny", "tessel-gpt") for s in ("m", "nn", "x")]
                         + [("gpt2-tiny", "m"), ("gpt-neox-tiny", "m")])   # GPT-2: Conv1D, the derived plan
def test_all_device_placements_train_like_one_process(pool, model, shape):
    _train_like_one_process(pool, model, shape, _search_plan(model, shape))


#: A user's plan (``tessel search --tp-plan``) sharding Llama's attention only: its MLPs stay replicated.
ATTENTION_ONLY = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
                  "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}


def test_a_users_tp_plan_shards_the_nn_blocks_as_it_says(pool):
    """``model_search_plan(tp_plan=...)`` (``tessel search --tp-plan``): NN's all-device blocks are sharded by
    the user's plan, which the plan records, and train like one process."""
    plan = _search_plan("llama-tiny", "nn", tp_plan=ATTENTION_ONLY)
    assert plan.parallel.tp_plan == ATTENTION_ONLY and plan.meta["tp_plan"]["source"] == "user"
    out = _train_like_one_process(pool, "llama-tiny", "nn", plan)
    for p in out.values():
        sharded = p["state"]["tp_shards"]
        assert any(k.endswith("self_attn.q_proj.weight") for k in sharded)
        assert not any(".mlp." in k for k in sharded), sorted(sharded)


def _train_like_one_process(pool, model: str, shape: str, plan) -> dict:
    """Train ``plan`` on 2 ranks and check it against the single process; returns the ranks' outputs."""
    from engine.models import task_for_plan
    from runtime.reference import reference_run
    from runtime.worker import merge_model_state

    pl = plan.schedule.placement
    assert pl.name == shape.upper()
    multi = sorted(b.segment for b in pl.blocks if b.kind == "F" and len(b.devices) > 1)
    assert multi == {"m": [0, 3], "nn": [0, 2], "x": []}[shape]   # M: embedding and head on all devices
    assert plan.model.split == "layers"
    n_data = M * pl.data_per_instance   # X: each placement instance carries a micro-batch through each replica
    task = task_for_plan(plan, seed=0)
    batches = [tuple(task.train_batch(i, n_data * MBS)) for i in range(STEPS)]
    out = pool.run_ok("worker_harness:train_task",
                      {"plan": plan.to_dict(), "batches": batches, "fresh_process": True}, world=2)
    for p in out.values():   # every rank runs the all-device segments
        assert set(multi) <= set(p["info"]["segments"])
        assert all(p["info"]["tensor_parallel"][s] for s in multi), "all-device segments are sharded"
        # M's all-device LM head computes the loss on vocab-sharded logits (loss parallel)
        assert p["info"]["loss_parallel"] == ([3] if shape == "m" else [])
    ref = reference_run(plan, batches, seed=0, lr=1e-3)
    for step in range(STEPS):   # every data micro-batch's loss, from whichever rank ends its chain
        got = {}
        for p in out.values():
            got.update(zip(p["loss_micro_batches"][step], p["losses"][step]))
        assert sorted(got) == list(range(n_data))
        assert torch.allclose(torch.tensor([got[d] for d in range(n_data)]), torch.tensor(ref.losses[step]),
                              rtol=1e-4, atol=0), f"{model} {shape} step {step}"
    merged = merge_model_state(p["state"] for p in out.values())
    assert_params_match(merged, ref.model, f"{model} {shape}")
    return out


def test_two_towers_on_the_k_placement_train_like_one_process(pool):
    """Tessel's K shape on a two-tower model (``two-tower-tiny``: docstring and code towers, a
    contrastive head): each tower on its own device, the parameter-free head on both (replicated),
    the head's input gradients split between the two towers; 3 Adam steps on CPython docstring /
    function-body pairs equal one process."""
    from engine.models import task_for_plan
    from runtime.reference import reference_run
    from runtime.worker import merge_model_state

    plan = _search_plan("two-tower-tiny", "k")
    pl = plan.schedule.placement
    assert pl.name == "K" and plan.model.split == "layers" and plan.model.task == "contrastive"
    assert [s.get("inputs") for s in plan.segments] == [[0], [1], None]
    assert [list(pl.spec("F", s).devices) for s in range(3)] == [[0], [1], [0, 1]]
    task = task_for_plan(plan, seed=0)
    batches = [tuple(task.train_batch(i, M * MBS)) for i in range(STEPS)]
    out = pool.run_ok("worker_harness:train_task",
                      {"plan": plan.to_dict(), "batches": batches, "fresh_process": True}, world=2)
    ref = reference_run(plan, batches, seed=0, lr=1e-3)
    for p in out.values():   # the head runs on both ranks: each reports every micro-batch's loss
        for step in range(STEPS):
            assert torch.allclose(torch.tensor(p["losses"][step]), torch.tensor(ref.losses[step]), rtol=1e-4, atol=0)
    assert out[0]["losses"][-1] != out[0]["losses"][0]
    assert_params_match(merge_model_state(p["state"] for p in out.values()), ref.model, "two-tower K")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_two_towers_on_a_plain_pipeline_train_like_one_process(pool, schedule):
    """The same two-tower model on the plain V pipeline (Tessel's yardstick for K): eager stages
    carrying both towers' sides (``runtime.stages.layer_split.TwoTowerRunStage``: the code ids ride along
    the text tower's stage) equal one process for 3 Adam steps."""
    from engine.models import task_for_plan
    from engine.plan import make_plan
    from runtime.reference import reference_run
    from runtime.worker import merge_model_state

    plan = make_plan("two-tower-tiny", devices=2, micro_batches=M, schedule=schedule, device_type="cpu",
                     micro_batch_size=MBS, seq_len=SEQ).plan
    assert plan.model.split == "layers" and plan.model.task == "contrastive"
    task = task_for_plan(plan, seed=0)
    batches = [tuple(task.train_batch(i, M * MBS)) for i in range(STEPS)]
    out = pool.run_ok("worker_harness:train_task", {"plan": plan.to_dict(), "batches": batches}, world=2)
    ref = reference_run(plan, batches, seed=0, lr=1e-3)
    last = [p for p in out.values() if p["losses"][0]]
    assert len(last) == 1
    for step in range(STEPS):
        assert torch.allclose(torch.tensor(last[0]["losses"][step]), torch.tensor(ref.losses[step]), rtol=1e-4, atol=0)
    assert_params_match(merge_model_state(p["state"] for p in out.values()), ref.model, f"two-tower V {schedule}")
