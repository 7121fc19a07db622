"""build_stages cuts every model family into the plan's stages, and the stage chain computes exactly
what the unsplit model computes (output and every parameter gradient), single process, no Ray.

Reference: the unsplit model built with the same seed (``torch.manual_seed(0)`` before
``build_model``, as ``build_stages`` does), run eagerly on the same example inputs.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.models import build_model
from engine.plan import make_plan
from runtime.stages import SequentialStage, StageSplitError, TracedStage, build_stages

RTOL, ATOL = 1e-5, 1e-6
USER = "split_user_models:make_net"


def _plan(name: str, S: int):
    return make_plan(name, devices=S, micro_batches=max(2, S), schedule="1f1b", device_type="cpu",
                     seq_len=16).plan


def _reference(plan):
    torch.manual_seed(0)
    b = build_model(plan.model.name, batch_size=plan.model.micro_batch_size, seq_len=plan.model.seq_len,
                    device="cpu", dtype=torch.float32, task=plan.model.task)
    return b.module.float().train(), tuple(b.example_inputs)


def _loss(out: torch.Tensor) -> torch.Tensor:
    w = torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape)   # every logit gets its own gradient
    return (out * w).sum() + out.square().mean()


CASES = [("gpt2-tiny", 2), ("gpt2-tiny", 4), ("llama-tiny", 2), ("llama-tiny", 4), ("mixtral-tiny", 2),
         ("mixtral-tiny", 4), ("bert-tiny", 2), ("bert-tiny", 4), ("t5-tiny", 2), ("t5-tiny", 4),
         ("cnn-digits", 2), ("cnn-digits", 3), (USER, 2), (USER, 4),
         ("split_user_models:make_keyword_only_net", 2)]   # example inputs as a dict, a keyword-only forward


@pytest.mark.parametrize("name,S", CASES, ids=[f"{n.split(':')[-1]}-{s}" for n, s in CASES])
def test_stage_chain_matches_the_unsplit_model(name, S):
    plan = _plan(name, S)
    st = build_stages(plan, seed=0)
    ref, inputs = _reference(plan)

    # structure: one stage per segment, the recorded method, the unsplit model's names
    assert sorted(st.modules) == list(range(S)) == [int(s["index"]) for s in plan.segments]
    want_method = "module" if isinstance(ref, torch.nn.Sequential) else "tracer"
    assert st.split == want_method
    assert plan.model.split in (None, want_method)
    kind = SequentialStage if want_method == "module" else TracedStage
    assert all(isinstance(m, kind) for m in st.modules.values())
    canon = {}
    for n, p in ref.named_parameters(remove_duplicate=False):
        canon[n] = next(m for m, q in ref.named_parameters() if q is p)
    ref_keys = set(ref.state_dict())
    tied_names = {n for n in canon if n != canon[n]} | {canon[n] for n in canon if n != canon[n]}
    seen: dict[str, int] = {}
    for m in st.modules.values():
        for k in m.state_dict():
            assert k in ref_keys, f"stage key {k} not in the unsplit model"
            seen[k] = seen.get(k, 0) + 1
    assert {canon.get(k, k) for k in seen} == {canon.get(k, k) for k in ref_keys}
    assert all(c == 1 or k in tied_names for k, c in seen.items()), "only tied parameters may be copied"
    assert [m.shape for m in st.inputs] == [tuple(x.shape) for x in inputs]

    # numerics: forward and backward through the chain == the unsplit model
    vals = inputs
    for i in range(S):
        vals = st.modules[i](*vals)
        if i < S - 1:
            assert [tuple(v.shape) for v in vals] == [m.shape for m in st.boundaries[i]]
    assert len(vals) == 1
    out = vals[0]
    want = ref(*inputs)
    assert out.shape == want.shape == st.output.shape
    torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL)
    _loss(out).backward()
    _loss(want).backward()
    got: dict[str, torch.Tensor] = {}
    for m in st.modules.values():
        for n, p in m.named_parameters():
            if p.grad is not None:
                c = canon[n]
                got[c] = got[c] + p.grad if c in got else p.grad.clone()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert ref_grads and set(got) == set(ref_grads)
    for n, g in ref_grads.items():
        torch.testing.assert_close(got[n], g, rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"{n}: {m}")
    # tied groups name every copy of a parameter that several stages hold
    for group in st.tied:
        assert len({canon[n] for _, n in group}) == 1 and len({s for s, _ in group}) == len(group)


def test_t5_gives_one_stage_per_segment_and_feeds_both_inputs_to_stage_0():
    plan = _plan("t5-tiny", 4)
    st = build_stages(plan, seed=0)
    assert len(st.modules) == 4 and len(st.inputs) == 2
    assert st.inputs[1].shape[1] < st.inputs[0].shape[1]   # decoder ids [B, T'] (span-corruption targets)
    assert st.output.shape[:2] == st.inputs[1].shape


def test_mixtral_moe_blocks_are_eager_submodules_of_the_traced_stages():
    from engine.models.moe.hf_moe import is_hf_moe_block

    plan = _plan("mixtral-tiny", 2)
    st = build_stages(plan, seed=0)
    blocks = [(s, n) for s, m in st.modules.items() for n, x in m.named_modules() if is_hf_moe_block(x)]
    assert sorted(n for _, n in blocks) == [f"model.layers.{i}.mlp" for i in range(4)]
    for s, n in blocks:
        parent = st.modules[s].get_submodule(n.rpartition(".")[0])
        calls = [x for x in parent.graph.nodes if x.op == "call_module" and x.target == "mlp"]
        assert len(calls) == 1 and len(calls[0].args) == 1   # one call, mlp(hidden_states)
        assert type(parent.mlp).__name__ == "MixtralSparseMoeBlock"


def test_untraceable_non_sequential_model_fails_with_one_sentence_naming_the_layer():
    plan = _plan(USER, 2)
    bad = dataclasses.replace(plan, model=dataclasses.replace(plan.model, name="split_user_models:make_branchy_net"))
    with pytest.raises(StageSplitError) as ei:
        build_stages(bad, seed=0)
    msg = str(ei.value)
    assert "\n" not in msg and msg.count(". ") == 0 and not msg.endswith(".")
    assert "'blocks.1' (DataDependentBlock)" in msg
    assert "data-dependent control flow" in msg and "x.sum() > 0" in msg
    assert msg.startswith("cannot split 'split_user_models:make_branchy_net' into stages")


def test_a_traced_stage_keeps_only_its_own_parameters_alive():
    """A rank keeps only its own stages: a traced stage must not hold the split graph (its fx nodes
    reference the whole traced model), or every rank would keep every other stage's parameters."""
    import gc
    import weakref

    st = build_stages(_plan("gpt2-tiny", 2), seed=0)
    assert isinstance(st.modules[0], TracedStage)
    own = {id(p) for p in st.modules[0].parameters()}
    others = [weakref.ref(p) for p in st.modules[1].parameters() if id(p) not in own]
    assert others
    kept = st.modules[0]
    del st
    gc.collect()
    assert [r for r in others if r() is not None] == []
    kept(*[torch.zeros(1, 16, dtype=torch.long)])   # the kept stage still runs
