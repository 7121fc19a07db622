"""Tensor parallelism on two Hugging Face encoders: ``tp > 1`` plans train exactly like one process.

BERT's masked LM (``bert-tiny``: post-norm layers, tied word embedding / MLM decoder with a bias,
vocabulary 260) and a ViT image classifier on the digits' 8x8 images
(``user_hf_models:vit``: patch embedding, CLS token, pre-norm layers, 10 classes, no vocabulary)
are planned with the layer split and the plan derived Megatron-style
(:data:`engine.tp_plan.BERT_TP_PLAN`, :data:`engine.tp_plan.VIT_TP_PLAN`), then trained on
dp x tp x pp = 1 x 2 x 2 and 2 x 2 x 1 with 1F1B: real processes over gloo
(``worker_harness.WorkerPool``), 3 Adam steps on each task's own data (CPython sources masked;
the digits), against the single-process reference (``runtime.reference.reference_run``):

- every micro-batch loss of every step equal (rtol 1e-4), on both tensor ranks of the last stage;
- the merged parameters load strictly into the unsplit model and match it
  (``test_tensor_parallel.assert_params_match``);
- the projections really are sharded: every rank holds half of each column/row-parallel weight
  (BERT's word embedding and MLM decoder over the vocabulary too); ViT's classifier is not
  sharded and its loss is not vocab-parallel.

Two fast checks without processes: the planner records the layer split and the derived plans, and
refuses CoCoNet transformations the encoders do not run in one sentence (exit status 2).

The key projections' biases are compared only within 1e-4 (a tenth of one Adam step of lr 1e-3): their
gradient is exactly zero in exact arithmetic (softmax over the keys is invariant to adding ``q . b_k`` to
every score of a query), so what either run computes is rounding noise, which Adam turns into steps
of its own (seen: the ViT's ``k_proj.bias`` at most 1.7e-5 from zero and 1.7e-5 apart, 5 of 32
elements beyond atol 1e-5; BERT's at most 1.2e-6 apart), as ``test_tensor_parallel`` leaves out the
GPT's.

There is deliberately no ``tests/runtime/__init__.py`` (see ``test_worker.py``).
"""

from __future__ import annotations

import pytest
from test_tensor_parallel import assert_losses_match, assert_params_match
from worker_harness import WorkerPool

STEPS = 3
MBS, SEQ, M = 2, 16, 4
VIT = "user_hf_models:vit"


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(4)
    yield p
    p.close()


def _plan(model: str, dp: int, tp: int, pp: int):
    from engine.plan import make_plan

    return make_plan(model, devices=dp * tp * pp, dp=dp, tp=tp, micro_batches=M, schedule="1f1b",
                     device_type="cpu", micro_batch_size=MBS, seq_len=SEQ).plan


def _batches(plan, dp: int) -> list[tuple]:
    from engine.models import task_for_plan
    task = task_for_plan(plan, seed=0)
    return [tuple(task.train_batch(i, dp * M * MBS)) for i in range(STEPS)]


_DEGREES = {"1x2x2-1f1b": (1, 2, 2), "2x2x1-1f1b": (2, 2, 1)}
_CASES = [(d, m) for m in ("bert-tiny", VIT) for d in _DEGREES]
#: parameters each model's ranks must hold sharded (the other column/row-parallel ones are checked by shape)
_SHARDED = {"bert-tiny": ("attention.self.query.weight", "attention.output.dense.weight", "intermediate.dense.weight",
                          "cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"),
            VIT: ("attention.q_proj.weight", "attention.o_proj.weight", "mlp.fc1.weight", "mlp.fc2.weight")}

#: the key projections' biases: compared within a tenth of one Adam step only (see the module docstring)
_KEY_BIAS = ("attention.self.key.bias", "attention.k_proj.bias")


def test_the_planner_derives_the_encoders_plans():
    """``make_plan`` with ``tp=2`` records the layer split and the derived plan (no processes)."""
    from engine.plan import make_plan
    from engine.tp_plan import BERT_TP_PLAN, VIT_TP_PLAN

    for model, derived, task in (("bert-tiny", BERT_TP_PLAN, "masked-lm"), (VIT, VIT_TP_PLAN, "image-classification")):
        plan = make_plan(model, devices=2, tp=2, micro_batches=2, schedule="1f1b", device_type="cpu",
                         micro_batch_size=MBS, seq_len=SEQ).plan
        assert (plan.model.split, plan.model.task) == ("layers", task), model
        assert plan.meta["tp_plan"] == {"source": "derived", "blocks": derived}, model


@pytest.mark.parametrize("model,transform,words", [
    ("bert-tiny", "tp-split", "'bert-tiny' is a BERT encoder"),
    (VIT, "scatter-send", "cuts each boundary's 5 tokens (the image's patches and its CLS token) into tp=2")])
def test_a_transformation_the_encoders_do_not_run_is_one_sentence_and_exit_status_2(tmp_path, model, transform, words):
    """``tessel plan`` refuses CoCoNet's ``tp-split`` on an encoder (its sequence parallelism rewrites
    decoder blocks) and ``scatter-send`` on the ViT (5 tokens per image do not split in 2), before any
    rank starts: one sentence, exit status 2, no plan written."""
    from cli_inprocess import run_cli

    p = run_cli("plan", "--model", model, "--devices", "4", "--tp", "2", "--micro-batches", "2", "--device-type",
                "cpu", "--seq-len", str(SEQ), "--transform", transform, "-o", str(tmp_path / "o"))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert words in p.stderr.strip().splitlines()[-1], p.stderr
    assert not (tmp_path / "o" / "plan.json").exists()


@pytest.mark.parametrize("degrees,model", _CASES, ids=[f"{d}-{m.rsplit(':', 1)[-1]}" for d, m in _CASES])
def test_an_encoder_tensor_parallel_plan_trains_like_one_process(pool, model, degrees):
    from runtime.reference import reference_run
    from runtime.worker import merge_model_state

    dp, tp, pp = _DEGREES[degrees]
    plan = _plan(model, dp, tp, pp)
    assert (plan.parallel.tp, plan.parallel.pp, plan.model.split) == (tp, pp, "layers")
    batches = _batches(plan, dp)
    out = pool.run_ok("worker_harness:train_task",
                      {"plan": plan.to_dict(), "batches": batches, "fresh_process": True}, world=dp * tp * pp)
    ref = reference_run(plan, batches, seed=0, lr=1e-3)
    holders = {(p["info"]["dp_index"], p["info"]["tp_rank"]): r for r, p in out.items() if p["losses"][0]}
    assert sorted(holders) == [(d, t) for d in range(dp) for t in range(tp)]
    for r in holders.values():   # BERT's logits stay vocab-sharded; a ViT has no vocabulary
        assert out[r]["info"]["loss_parallel"] == ([pp - 1] if model == "bert-tiny" else [])
    assert_losses_match(out, holders, ref.losses, dp, tp, f"{model} {degrees}")
    full = ref.model.state_dict()
    sharded: set[str] = set()
    for p in out.values():
        shards = p["state"]["tp_shards"]
        assert shards and all(v[2] == tp for v in shards.values())
        for seg in p["state"]["segments"].values():
            for name, (dim, *_) in ((k, shards[k]) for k in seg if k in shards):
                assert seg[name].shape[dim] * tp == full[name].shape[dim], name
                sharded.add(name)
    for suffix in _SHARDED[model]:
        assert any(n.endswith(suffix) for n in sharded), f"{model}: no {suffix} sharded in {sorted(sharded)}"
    assert not any(n.startswith(("classifier.", "vit.embeddings.")) for n in sharded), sorted(sharded)
    merged = merge_model_state(p["state"] for p in out.values())
    for name in (n for n in full if n.endswith(_KEY_BIAS)):   # rounding noise only (module docstring)
        noise = float((merged[name] - full[name]).abs().max())
        assert noise <= 1e-4, f"{model}: {name} differs by {noise:.3g}, more than a tenth of one Adam step"
        merged[name] = full[name]
    assert_params_match(merged, ref.model, f"{model} 1f1b {dp}x{tp}x{pp}")
