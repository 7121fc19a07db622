"""Cost model for the model families of issue 15 against independent references.

- Boundary bytes: every tensor that crosses a stage cut is counted (hand counts from each
  model's config: GPT-2 hidden + causal mask; Llama hidden + mask + rotary cos/sin; T5 hidden +
  relative position bias + mask), in the segment, the forward SEND and the backward SEND (the
  gradient: differentiable tensors only), and through a plan save/load.
- Grouped matmuls (Mixtral experts, transformers 5 ``grouped_mm``/``batched_mm``): FLOPs
  within 10% of the hand count ``tokens*k*(2*H*2I + 2*I*H) + 2*tokens*H*E``.
- A user's expert loop (data-dependent row counts) captures and counts each expert at its row
  bound (``N * k``), the documented estimate.
- Hugging Face MoE blocks are MoE layers: ``dp=2`` plans expert parallelism for mixtral-tiny as
  for the built-in gpt-moe-tiny.
"""

from __future__ import annotations

import pytest
import torch

from engine.errors import TransformError
from engine.graph import capture
from engine.graph.flops import count_flops, grouped_mm_flops
from engine.io import load_plan, save_plan
from engine.models import build_model
from engine.models.moe.comm import HF_GATE, find_moe_layers
from engine.models.moe.hf_moe import hf_moe_blocks, traceable_experts
from engine.plan import lower_plan, make_plan
from engine.transform import boundary_spec

B, T = 2, 16


def _summary(graph, layer):
    return next(ls for ls in graph.layer_summaries() if ls.name == layer)


def _sends(execution, kind):
    """nbytes of the SEND instructions of blocks of ``kind`` (F: activations, B: gradients)."""
    return {ins.nbytes for s in execution.streams for ins in s if ins.op == "SEND" and ins.block.kind == kind}


@pytest.fixture(scope="module")
def captured():
    out = {}
    for name in ("gpt2-tiny", "llama-tiny", "t5-tiny"):
        b = build_model(name, batch_size=B, seq_len=T)
        out[name] = (b, capture(b.module, b.example_inputs, name=name))
    return out


def test_gpt2_boundary_is_hidden_plus_causal_mask(captured):
    b, g = captured["gpt2-tiny"]
    h = b.module.config.n_embd
    hidden = B * T * h * 4                 # [B, T, H] float32
    mask = B * 1 * T * T * 1               # [B, 1, T, T] bool
    fwd, grad = boundary_spec(g, _summary(g, "transformer.h.1"))
    assert fwd.nbytes == hidden + mask
    assert grad.nbytes == hidden           # the mask has no gradient


def test_llama_boundary_is_hidden_mask_and_rotary_tables(captured):
    b, g = captured["llama-tiny"]
    c = b.module.config
    head_dim = c.hidden_size // c.num_attention_heads
    hidden = B * T * c.hidden_size * 4
    mask = B * T * T                       # [B, 1, T, T] bool
    rotary = 2 * 1 * T * head_dim * 4      # cos and sin [1, T, head_dim] (position ids arange(T)[None])
    fwd, grad = boundary_spec(g, _summary(g, "model.layers.1"))
    assert fwd.nbytes == hidden + mask + rotary
    assert [t.shape for t in fwd.tensors()].count((1, T, head_dim)) == 2
    assert grad.nbytes == hidden           # mask and rotary tables come from inputs only


def test_t5_boundary_has_hidden_position_bias_and_mask(captured):
    b, g = captured["t5-tiny"]
    c = b.module.config
    hidden = B * T * c.d_model * 4
    bias = 1 * c.num_heads * T * T * 4     # relative position bias [1, heads, T, T], from block 0's parameters
    mask = B * T * T                       # [B, 1, T, T] bool
    layers = g.layers()
    # while capture lists the shared `encoder.dropout` (applied to the embeddings first) after
    # block 0, the embedding output also crosses this cut
    late_dropout = layers.index("encoder.dropout") > layers.index("encoder.block.0")
    extra = hidden if late_dropout else 0
    fwd, grad = boundary_spec(g, _summary(g, "encoder.block.0"))
    assert fwd.nbytes == hidden + bias + mask + extra
    assert grad.nbytes == hidden + bias + extra   # the position bias carries block 0's gradient


def test_plan_sends_every_boundary_tensor_and_survives_save_load(tmp_path):
    res = make_plan("llama-tiny", devices=2, micro_batches=2, micro_batch_size=B, seq_len=T, device_type="cpu")
    c = build_model("llama-tiny", batch_size=1, seq_len=T, device="meta").module.config
    hidden = B * T * c.hidden_size * 4
    full = hidden + B * T * T + 2 * T * (c.hidden_size // c.num_attention_heads) * 4
    seg0 = res.plan.segments[0]
    assert seg0["boundary_bytes"] == full and res.plan.segments[1]["boundary_bytes"] == 0
    assert _sends(res.execution, "F") == {full} and _sends(res.execution, "B") == {hidden}
    sends = [e for e in res.timeline.events if e.op == "SEND"]
    assert sends and {e.nbytes for e in sends} == {full, hidden}
    loaded = load_plan(save_plan(res.plan, tmp_path / "plan.json"))
    assert loaded.segments[0]["output"] == seg0["output"] and len(seg0["output"]["parts"]) == 3
    again = lower_plan(loaded)
    assert _sends(again, "F") == {full} and _sends(again, "B") == {hidden}


# ---------------------------------------------------------------- grouped matmul FLOPs


def test_grouped_mm_flops_layouts():
    # 2d x 3d: 10 rows split over 3 groups, K=4, N=5: sum_g 2*M_g*4*5 = 2*10*4*5 whatever the split
    assert grouped_mm_flops((10, 4), (3, 4, 5)) == 2 * 10 * 4 * 5
    assert grouped_mm_flops((3, 6, 4), (3, 4, 5)) == 3 * 2 * 6 * 4 * 5   # batched
    assert grouped_mm_flops((6, 12), (12, 5)) == 2 * 6 * 12 * 5        # K split (weight gradient)
    with pytest.raises(ValueError, match="2-D or 3-D"):
        grouped_mm_flops((2,), (3, 4, 5))


def test_aten_grouped_mm_is_counted_as_matmuls():
    a = torch.randn(10, 4, device="meta")
    w = torch.randn(3, 4, 5, device="meta")
    offs = torch.tensor([3, 7, 10], dtype=torch.int32, device="meta")
    out = torch.empty(10, 5, device="meta")
    ref = sum(2 * m * 4 * 5 for m in (3, 4, 3))   # the three groups' matmuls
    assert count_flops(torch.ops.aten._grouped_mm.default, (a, w, offs), {}, out) == ref


def _hand_count(tokens: int, h: int, i: int, e: int, k: int) -> int:
    """Mixtral sparse MoE block forward FLOPs: each token through k SwiGLU experts (H->2I, I->H)
    plus the router (H->E)."""
    return tokens * k * (2 * h * 2 * i + 2 * i * h) + 2 * tokens * h * e


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_mixtral_expert_flops_match_hand_count(impl):
    b = build_model("mixtral-tiny", batch_size=B, seq_len=T)
    c = b.module.config
    b.module.config._experts_implementation = impl
    g = capture(b.module, b.example_inputs, name="mixtral-tiny")
    hand = _hand_count(B * T, c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok)
    assert hand == hf_moe_blocks(b.module)[0].forward_flops(B * T)
    for layer in range(c.num_hidden_layers):
        path = f"model.layers.{layer}.mlp"
        got = sum(d.get("flops", 0.0) for _, d in g.nodes(data=True)
                  if str(d.get("module_path", "")).startswith(path))
        assert abs(got - hand) <= 0.1 * hand, (path, got, hand)


def test_traceable_experts_switches_eager_and_restores():
    b = build_model("mixtral-tiny", batch_size=1, seq_len=8)
    cfg = b.module.model.layers[0].mlp.experts.config
    cfg._experts_implementation = "eager"   # transformers' loop (a raw model may default to it)
    with traceable_experts(b.module) as switched:
        assert cfg._experts_implementation == "grouped_mm" and len(switched) == 4
    assert cfg._experts_implementation == "eager"
    with pytest.raises(ValueError, match="not traceable"):
        with traceable_experts(b.module, "eager"):
            pass


# ---------------------------------------------------------------- MoE recognition and expert parallelism


def test_hf_moe_blocks_are_moe_layers():
    b = build_model("mixtral-tiny", batch_size=B, seq_len=T, device="meta")
    c = b.module.config
    found = find_moe_layers(b.module, B * T)
    e, i, h, k = c.num_local_experts, c.intermediate_size, c.hidden_size, c.num_experts_per_tok
    assert [m.path for m in found] == [f"model.layers.{n}.mlp" for n in range(c.num_hidden_layers)]
    m = found[0]
    assert (m.num_experts, m.hidden, m.element_size, m.gate, m.rows) == (e, h, 4, HF_GATE, B * T * k)
    assert m.expert_param_bytes == e * (2 * i * h + h * i) * 4
    # one all-to-all sends every (token, expert) row: N*k rows of H float32 values
    assert m.all_to_all_bytes(2) == B * T * k * h * 4


def _plan(name, dp, devices=4):
    return make_plan(name, devices=devices, dp=dp, micro_batches=4, seq_len=T, device_type="cpu")


@pytest.mark.parametrize("name", ["mixtral-tiny", "gpt-moe-tiny"])
def test_dp2_plans_expert_parallelism(name):
    dense, ep = _plan(name, 1, devices=2), _plan(name, 2)   # both pp=2: the same stage split
    assert [s["layers"] for s in dense.plan.segments] == [s["layers"] for s in ep.plan.segments]
    moe = {ml.path: ml for ml in find_moe_layers(build_model(name, batch_size=1, seq_len=T, device="meta").module, T)}
    assert moe
    # every MoE layer lands in one segment's "moe" list; each EP rank holds half of the experts
    seg_moe = [[x["path"] for x in s.get("moe", [])] for s in ep.plan.segments]
    assert sorted(p for ps in seg_moe for p in ps) == sorted(moe)
    for s in ep.plan.segments:
        full = sum(moe[p].expert_param_bytes for p in (x["path"] for x in s.get("moe", [])))
        assert s["param_bytes"] == dense.plan.segments[s["index"]]["param_bytes"] - full + full // 2
    # 2 all-to-alls per MoE layer per F and per B block, of the layer's send buffer
    for r, stream in enumerate(ep.execution.streams):
        layers = [moe[p] for p in seg_moe[r]]
        a2a = [ins.nbytes for ins in stream if ins.op == "ALLTOALL"]
        assert len(a2a) == 2 * len(layers) * 2 * 4
        assert set(a2a) == {ml.all_to_all_bytes(2) for ml in layers}
    assert any(e.op == "ALLTOALL" for e in ep.timeline.events)
    assert not any(ins.op == "ALLTOALL" for s in dense.execution.streams for ins in s)


def test_expert_parallel_needs_dp_dividing_the_experts():
    with pytest.raises(TransformError, match=r"4 experts .*dp=3.*use dp in \{1, 2, 4\}"):
        _plan("mixtral-tiny", 3, devices=3)


class _LoopMoE(torch.nn.Module):
    """A user's expert loop: each expert runs on the rows routed to it (data-dependent sizes)."""

    def __init__(self, h=8, i=16, e=4, k=2):
        super().__init__()
        self.k = k
        self.gate = torch.nn.Linear(h, e, bias=False)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(h, i), torch.nn.ReLU(), torch.nn.Linear(i, h)) for _ in range(e))

    def forward(self, x):
        w, idx = self.gate(x).softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for j, ex in enumerate(self.experts):
            tok, slot = torch.where(idx == j)
            out = out.index_add(0, tok, ex(x[tok]) * w[tok, slot, None])
        return out


def test_expert_loop_with_data_dependent_rows_is_counted_at_its_bound():
    n, h, i, e, k = 32, 8, 16, 4, 2
    g = capture(torch.nn.Sequential(_LoopMoE(h, i, e, k)), (torch.randn(n, h),), name="loop")
    linears = [d["flops"] for _, d in g.nodes(data=True) if str(d.get("target")) == "aten.linear.default"
               and ".experts." in "." + str(d.get("module_path")) + "."]
    # each expert sees at most n*k rows (the torch.where over the [n, k] routing table)
    assert sorted(set(linears)) == [2 * n * k * h * i]
    assert len(linears) == 2 * e
