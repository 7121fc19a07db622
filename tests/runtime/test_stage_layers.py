"""The layer split (``runtime.stages.layer_split``): eager decoder stages equal the unsplit model.

For a Llama-style HF model, HF GPT-2, the in-project GPT and T5, at 2 and 4 segments: the stage chain's logits
and every parameter gradient equal the unsplit model's (they run the same eager modules, so
exactly), the stages' state-dict keys are the unsplit model's, only the hidden state crosses a
boundary, and a plan whose segments are not contiguous runs of blocks is refused in one sentence.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch


def _plan(model: str, devices: int):
    from engine.plan import make_plan

    plan = make_plan(model, devices=devices, micro_batches=devices, schedule="1f1b", device_type="cpu",
                     micro_batch_size=2, seq_len=16).plan
    return dataclasses.replace(plan, model=dataclasses.replace(plan.model, split="layers"))


def _chain(modules: dict, inputs: tuple) -> torch.Tensor:
    """Run the stages in order on ``inputs`` as the pipeline does (each stage's inputs detached leaves),
    then the backward of ``logits.square().mean()`` stage by stage, every boundary tensor with a gradient
    passing it back; returns the logits."""
    vals, records = inputs, []
    for i in range(len(modules)):
        ins = tuple(v.detach().requires_grad_(v.is_floating_point()) for v in vals)
        vals = modules[i](*ins)
        records.append((ins, vals))
    vals[0].square().mean().backward()
    for i in range(len(modules) - 1, 0, -1):
        pairs = [(o, x.grad) for o, x in zip(records[i - 1][1], records[i][0]) if x.grad is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return vals[0]


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("model", ["llama-tiny", "gpt2-tiny", "tessel-gpt"])
def test_layer_stages_equal_the_unsplit_model(model, devices):
    from engine.models import build_model
    from runtime.stages import build_stages

    plan = _plan(model, devices)
    st = build_stages(plan, seed=0)
    assert st.split == "layers" and len(st.modules) == devices
    assert all(len(b) == 1 and b[0].shape == (2, 16, b[0].shape[-1]) for b in st.boundaries)   # hidden only
    torch.manual_seed(0)
    ref = build_model(model, batch_size=2, seq_len=16, device="cpu", dtype=torch.float32).module.float().train()
    keys = [k for m in st.modules.values() for k in m.state_dict()]
    assert sorted(set(keys)) == sorted(ref.state_dict())
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    want = ref(ids)
    want.square().mean().backward()
    assert torch.equal(_chain(st.modules, (ids,)), want)
    grads = {n: p.grad for m in st.modules.values() for n, p in m.named_parameters()}
    for group in st.tied:   # tied copies (GPT's wte / lm_head): the unsplit model's gradient is their sum
        total = sum(grads[n] for _, n in group)
        grads.update({n: total for _, n in group})
    for n, p in ref.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("devices", [2, 4])
def test_t5_stages_equal_the_unsplit_model(devices):
    """T5 (encoder-decoder, ``runtime.stages.seq2seq_split``): the chain carries the encoder output, the
    decoder's ids or hidden state and each stack's relative position bias; logits and every gradient equal
    the unsplit model's (the tied embeddings' and LM head's copies summed)."""
    from engine.models import build_model
    from runtime.stages import build_stages

    plan = _plan("t5-tiny", devices)
    st = build_stages(plan, seed=0)
    assert st.split == "layers" and len(st.modules) == devices
    shapes = [[tuple(m.shape) for m in b] for b in st.boundaries]
    # 2 stages: the encoder output and the decoder's hidden state; 4: each stack's bias [1, heads, q, k] crosses too
    assert shapes == ([[(2, 16, 64), (2, 4, 64)]] if devices == 2 else
                      [[(2, 16, 64), (2, 4), (1, 4, 16, 16)], [(2, 16, 64), (2, 4, 64)],
                       [(2, 16, 64), (2, 4, 64), (1, 4, 4, 4)]]), shapes
    torch.manual_seed(0)
    ref = build_model("t5-tiny", batch_size=2, seq_len=16, device="cpu", dtype=torch.float32).module.float().train()
    g = torch.Generator().manual_seed(1)
    ids, dec = torch.randint(0, 290, (2, 16), generator=g), torch.randint(0, 290, (2, 4), generator=g)
    want = ref(ids, dec)
    want.square().mean().backward()
    assert torch.equal(_chain(st.modules, (ids, dec)), want)
    grads = {n: p.grad for m in st.modules.values() for n, p in m.named_parameters()}
    for group in st.tied:
        total = sum(grads[n] for _, n in group)
        grads.update({n: total for _, n in group})
    for n, p in ref.named_parameters():   # shared.weight: held as the stacks' embeddings and the LM head
        if n in grads:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)
    assert "encoder.block.1.layer.0.SelfAttention.q.weight" in grads


def test_segments_that_are_not_runs_of_blocks_are_refused():
    from engine.models import build_model
    from runtime.stages import StageSplitError
    from runtime.stages.layer_split import split_layers

    model = build_model("tessel-gpt", batch_size=2, seq_len=16, device="cpu").module
    with pytest.raises(StageSplitError, match=r"contiguous run of its 4 decoder blocks.*\[\[0, 2\], \[1, 3\]\]"):
        split_layers(model, [["transformer.h.0", "transformer.h.2"], ["transformer.h.1", "transformer.h.3"]],
                     "tessel-gpt")


def test_merging_tensor_parallel_shards_needs_every_tensor_rank():
    from runtime.worker import merge_model_state
    from runtime.worker.errors import WorkerError

    w = torch.arange(8.0).view(4, 2)
    states = [{"rank": t, "segments": {0: {"w": w[:, t:t + 1]}}, "tp_shards": {"w": [1, t, 2]}} for t in range(2)]
    assert torch.equal(merge_model_state(states)["w"], w)
    with pytest.raises(WorkerError, match=r"tensor-parallel shards \[0\] of 2"):
        merge_model_state(states[:1])


@pytest.mark.parametrize("cuts", [(6,), (1,), (7, 9), (2, 6, 12)], ids=["towers", "wte|wpe", "mid-code", "three"])
def test_two_tower_chain_stages_equal_the_unsplit_model(cuts):
    """A two-tower model on a plain pipeline: any cut of its layers (between a tower's ``wte`` and
    ``wpe``, inside a tower, at the tower boundary, before the head) chained stage after stage gives
    the unsplit model's logits and, backward, its gradients."""
    from engine.models import build_model
    from runtime.stages import StageSplitError
    from runtime.stages.layer_split import TwoTowerRunStage, split_two_towers

    torch.manual_seed(0)
    m = build_model("two-tower-tiny", batch_size=3, seq_len=16, device="cpu").module
    layers = ([f"text.{p}" for p in ("wte", "wpe", "h.0", "h.1", "ln_f", "proj")]
              + [f"code.{p}" for p in ("wte", "wpe", "h.0", "h.1", "ln_f", "proj")] + ["head"])
    bounds = [0, *cuts, len(layers)]
    segs = [layers[a:b] for a, b in zip(bounds, bounds[1:])]
    stages = split_two_towers(m, segs, "two-tower-tiny", chain=True)
    assert all(isinstance(s, TwoTowerRunStage) for s in stages.values())
    g = torch.Generator().manual_seed(1)
    text, code = torch.randint(1, 256, (3, 16), generator=g), torch.randint(1, 256, (3, 16), generator=g)
    state: tuple = (text, code)
    for i in range(len(segs)):
        state = stages[i](*state)
    want = m(text, code)
    assert len(state) == 1 and torch.allclose(state[0], want, rtol=1e-5, atol=1e-6)
    state[0].square().sum().backward()
    want.square().sum().backward()
    got = {n: p.grad for s in stages.values() for n, p in s.named_parameters()}
    for n, p in m.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-4, atol=1e-6), n
    with pytest.raises(StageSplitError, match="in model order"):
        split_two_towers(m, [layers[6:], layers[:6]], "two-tower-tiny", chain=True)
