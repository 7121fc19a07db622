"""Tests for engine.graph: torch.export capture into an OpGraph."""
from __future__ import annotations

import json
import resource
import time

import networkx as nx
import pytest
import torch
from torch import nn

from engine.errors import CaptureError
from engine.graph import LayerSummary, OpGraph, capture
from engine.graph.flops import count_flops, op_kind
from engine.models import build_model

NODE_ATTRS = {"name", "op", "target", "module_path", "module_type", "layer", "layer_index",
              "shapes", "dtypes", "output_bytes", "input_bytes", "flops", "param_bytes",
              "param_names", "saved_bytes", "args", "kwargs"}
GRAPH_ATTRS = {"model_name", "batch_size", "seq_len", "dtype", "num_params", "param_bytes",
               "layers"}


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())  # tied: once


@pytest.fixture(scope="module")
def gpt2_tiny():
    b = build_model("gpt2-tiny", batch_size=2, seq_len=32)
    return b, capture(b)


@pytest.fixture(scope="module")
def gpt2():
    b = build_model("gpt2", batch_size=1, seq_len=1024)
    return b, capture(b)


@pytest.fixture(scope="module")
def tessel_gpt():
    b = build_model("tessel-gpt", batch_size=2, seq_len=64)
    return b, capture(b)


@pytest.fixture(scope="module")
def llama_tiny():
    b = build_model("llama-tiny", batch_size=2, seq_len=32)
    return b, capture(b)


# --------------------------------------------------------------------------------- structure
def test_graph_and_node_attributes_are_complete_and_json_able(gpt2_tiny):
    b, g = gpt2_tiny
    assert isinstance(g, OpGraph) and isinstance(g, nx.DiGraph)
    assert GRAPH_ATTRS <= set(g.graph)
    assert g.graph["batch_size"] == 2 and g.graph["seq_len"] == 32
    assert g.graph["dtype"] == "float32" and g.graph["model_name"] == "gpt2-tiny"
    ops = {d["op"] for _, d in g.nodes(data=True)}
    assert ops == {"call_function", "placeholder", "output"}
    for n, d in g.nodes(data=True):
        assert NODE_ATTRS <= set(d), n
        assert len(d["shapes"]) == len(d["dtypes"])
    # parameters are folded, not nodes
    assert not any(n.startswith("p_") for n in g.nodes)
    placeholders = [n for n, d in g.nodes(data=True) if d["op"] == "placeholder"]
    assert placeholders == ["input_ids"]
    assert g.nodes["input_ids"]["shapes"] == [[2, 32]]
    assert g.nodes["input_ids"]["dtypes"] == ["int64"]
    json.dumps(nx.node_link_data(g, edges="links"))  # everything JSON-able


def test_edges_carry_tensor_bytes(gpt2_tiny):
    _, g = gpt2_tiny
    assert g.number_of_edges() > 0
    for u, v, d in g.edges(data=True):
        pu = g.nodes[u]
        if g.nodes[v]["target"] == "operator.getitem":
            assert d["bytes"] == g.nodes[v]["output_bytes"]
        else:
            assert d["bytes"] == pu["output_bytes"], (u, v)
    out = [n for n, d in g.nodes(data=True) if d["op"] == "output"]
    assert len(out) == 1
    assert g.nodes[out[0]]["shapes"] == [[2, 32, 256]]
    assert g.nodes[out[0]]["input_bytes"] == 2 * 32 * 256 * 4


def test_module_paths_and_args_descriptors(gpt2_tiny):
    _, g = gpt2_tiny
    addmm = [d for _, d in g.nodes(data=True) if d["target"] == "aten.addmm.default"]
    assert len(addmm) == 4 * 4  # c_attn, c_proj, c_fc, c_proj per block
    first = addmm[0]
    assert first["module_path"] == "transformer.h.0.attn.c_attn"
    assert first["module_type"] == "Conv1D"
    assert first["layer"] == "transformer.h.0"
    bias, x, w = first["args"]
    assert bias == {"param": "transformer.h.0.attn.c_attn.bias", "shape": [192], "dtype": "float32"}
    assert x["shape"] == [64, 64] and x["dtype"] == "float32" and "param" not in x
    assert w["param"] == "transformer.h.0.attn.c_attn.weight" and w["shape"] == [64, 192]
    assert first["param_names"] == ["transformer.h.0.attn.c_attn.bias",
                                    "transformer.h.0.attn.c_attn.weight"]
    assert first["param_bytes"] == (192 + 64 * 192) * 4
    assert first["flops"] == 2 * 64 * 64 * 192  # M*N*K*2 from torch.utils.flop_counter
    top = [d for _, d in g.nodes(data=True) if d["module_path"] == ""]
    assert all(d["module_type"] == "GPT2LMHeadModelLogitsOnly" for d in top if d["op"] ==
               "call_function")


# ------------------------------------------------------------------------------------ layers
def _check_layer_order(g: OpGraph):
    idx = {n: d["layer_index"] for n, d in g.nodes(data=True)}
    for u, v in g.edges:
        assert idx[u] <= idx[v], (u, v, g.nodes[u]["layer"], g.nodes[v]["layer"])
    for _n, d in g.nodes(data=True):
        assert g.layers()[d["layer_index"]] == d["layer"]


@pytest.mark.parametrize("fixture,n_layer", [("gpt2_tiny", 4), ("gpt2", 12), ("tessel_gpt", 4)])
def test_gpt_layers_in_order(request, fixture, n_layer):
    _, g = request.getfixturevalue(fixture)
    blocks = [f"transformer.h.{i}" for i in range(n_layer)]
    assert g.layers() == (["transformer.wte", "transformer.wpe", "transformer.drop"] + blocks +
                          ["transformer.ln_f", "lm_head"])
    assert len(g.layers()) == n_layer + 5  # wte, wpe, drop + blocks + ln_f, lm_head
    _check_layer_order(g)


def test_llama_layers_in_order(llama_tiny):
    _, g = llama_tiny
    assert g.layers() == (["model.embed_tokens", "model.rotary_emb"] +
                          [f"model.layers.{i}" for i in range(4)] + ["model.norm", "lm_head"])
    _check_layer_order(g)
    # where transformers runs the rotary embedding under no_grad, export makes it a higher-order op
    # (wrap_with_set_grad_enabled) kept as one node of that layer (newer releases, e.g. 5.24, do not)
    hops = [d for _, d in g.nodes(data=True) if d["kind"] == "hop"]
    assert all(d["layer"] == "model.rotary_emb" for d in hops)


def test_ops_in_layer_and_summaries(gpt2_tiny):
    _, g = gpt2_tiny
    ls = g.layer_summaries()
    assert [x.name for x in ls] == g.layers()
    assert all(isinstance(x, LayerSummary) for x in ls)
    all_ops = [n for x in ls for n in x.ops]
    assert sorted(all_ops) == sorted(g.op_nodes())  # every op in exactly one layer
    assert ls[3].ops == g.ops_in_layer("transformer.h.0")
    assert sum(x.flops for x in ls) == pytest.approx(g.total_flops())
    with pytest.raises(KeyError):
        g.ops_in_layer("no.such.layer")
    s = g.summary()
    json.dumps(s)
    assert s["num_layers"] == 9 and s["total_flops"] == pytest.approx(g.total_flops())
    assert s["op_kinds"]["matmul"] == 17  # 16 addmm + lm_head linear


def test_root_only_model_has_single_layer():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(8, 8))

        def forward(self, x):
            return torch.relu(x @ self.w)

    with torch.device("meta"):
        g = capture(Flat(), (torch.zeros(4, 8, device="meta"),))
    assert g.layers() == ["<root>"]
    assert g.nodes["matmul"]["flops"] == 2 * 4 * 8 * 8
    assert g.nodes["matmul"]["param_names"] == ["w"]


# ---------------------------------------------------------------------------------- boundaries
def test_tessel_gpt_block_boundary_is_hidden_state(tessel_gpt):
    _, g = tessel_gpt
    hidden = {"shape": [2, 64, 128], "dtype": "float32"}
    for x in g.layer_summaries():
        if x.name.startswith("transformer.h."):
            assert x.boundary_tensors == [hidden], x.name
            assert x.boundary_bytes == 2 * 64 * 128 * 4
    assert g.layer_summaries()[-1].boundary_tensors == []


def test_hf_block_boundary(gpt2_tiny, llama_tiny):
    # HF under torch.export materialises the causal mask (and Llama its rotary tables); those
    # depend only on the inputs. The only parameter-dependent tensor is the hidden state.
    for (_, g), hidden in ((gpt2_tiny, [2, 32, 64]), (llama_tiny, [2, 32, 64])):
        blocks = [x for x in g.layer_summaries() if ".h." in x.name or ".layers." in x.name]
        assert blocks
        for x in blocks:
            learned = [t for t, n in zip(x.boundary_tensors, x.boundary_nodes)
                       if not g.nodes[n]["input_only"]]
            assert learned == [{"shape": hidden, "dtype": "float32"}], x.name
            assert x.boundary_tensors[0] == learned[0]  # the hidden state comes first
            masks = [t for t in x.boundary_tensors if t["dtype"] == "bool"]
            assert masks == [{"shape": [2, 1, 32, 32], "dtype": "bool"}] or x is blocks[-1]
            assert x.boundary_bytes == sum(_bytes(t) for t in x.boundary_tensors)
        last_block = blocks[-1]
        assert last_block.boundary_tensors == [{"shape": hidden, "dtype": "float32"}]


def _bytes(t):
    n = 1
    for s in t["shape"]:
        n *= s
    return n * torch.empty(0, dtype=getattr(torch, t["dtype"])).element_size()


# ------------------------------------------------------------------------------- FLOPs, bytes
def test_gpt2_total_flops_match_analytic(gpt2):
    b, g = gpt2
    n_params = sum(p.numel() for p in b.module.parameters())
    assert n_params == g.graph["num_params"] == 124_439_808
    tokens, seq, n_layer, d = 1024, 1024, 12, 768
    analytic = 2 * n_params * tokens + 4 * n_layer * seq * seq * d  # + QK^T and AV per layer
    assert g.total_flops() == pytest.approx(analytic, rel=0.10)
    sdpa = [d for _, d in g.nodes(data=True) if d["kind"] == "attention"]
    assert len(sdpa) == 12 and sdpa[0]["flops"] == 4 * 12 * seq * seq * 64


@pytest.mark.parametrize("fixture", ["gpt2_tiny", "gpt2", "tessel_gpt", "llama_tiny"])
def test_param_bytes_sum_equals_model_param_bytes(request, fixture):
    b, g = request.getfixturevalue(fixture)
    total = sum(d["param_bytes"] for _, d in g.nodes(data=True))
    assert total == _param_bytes(b.module) == g.graph["param_bytes"]
    assert sum(x.param_bytes for x in g.layer_summaries()) == total


def test_tied_weight_counted_once_at_first_use(gpt2_tiny):
    _, g = gpt2_tiny
    assert g.graph["tied_params"] == {"lm_head.weight": "transformer.wte.weight"}
    head = [d for _, d in g.nodes(data=True) if d["layer"] == "lm_head" and d["param_names"]]
    assert len(head) == 1
    assert head[0]["param_names"] == ["transformer.wte.weight"] and head[0]["param_bytes"] == 0
    emb = g.nodes["embedding"]
    assert emb["param_names"] == ["transformer.wte.weight"]
    assert emb["param_bytes"] == 256 * 64 * 4


def test_saved_bytes_rules(gpt2_tiny, llama_tiny):
    _, g = gpt2_tiny
    for _, d in g.nodes(data=True):
        if d["kind"] == "view":
            assert d["saved_bytes"] == 0
        if d["kind"] == "dropout":  # gpt2-tiny has p=0: nothing kept
            assert d["saved_bytes"] == 0
    addmm = [d for _, d in g.nodes(data=True) if d["target"] == "aten.addmm.default"][0]
    assert addmm["saved_bytes"] == 64 * 64 * 4  # its activation input, not the weight
    sdpa = [d for _, d in g.nodes(data=True) if d["kind"] == "attention"][0]
    q_bytes = 2 * 4 * 32 * 16 * 4
    mask = 2 * 32 * 32
    assert sdpa["saved_bytes"] == 3 * q_bytes + mask + q_bytes  # q, k, v, mask + output
    block = g.layer_summaries()[3]
    assert 0 < block.saved_bytes <= sum(g.nodes[n]["saved_bytes"] for n in block.ops)
    # a tensor saved by several ops is counted once per layer: in Llama's RMSNorm both
    # pow(x, 2) and x * rsqrt(...) keep x
    _, gl = llama_tiny
    lblock = gl.layer_summaries()[gl.layers().index("model.layers.1")]
    assert 0 < lblock.saved_bytes < sum(gl.nodes[n]["saved_bytes"] for n in lblock.ops)
    # dropout with p > 0 in training mode keeps a 1-byte mask
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Softmax(-1))
    gd = capture(m, (torch.zeros(4, 8, device="meta"),))
    kinds = {d["kind"]: d for _, d in gd.nodes(data=True) if d["op"] == "call_function"}
    assert kinds["dropout"]["saved_bytes"] == 4 * 8
    assert kinds["softmax"]["saved_bytes"] == 4 * 8 * 4  # its output
    assert gd.layers() == ["0", "1", "2"]


def test_flop_formulas():
    x = torch.zeros(2, 3, 16, 16, device="meta")
    w = torch.zeros(8, 3, 3, 3, device="meta")
    out = torch.nn.functional.conv2d(x, w, padding=1)
    assert count_flops(torch.ops.aten.conv2d.default, (x, w), {}, out) == 2 * 2 * 8 * 16 * 16 * 27
    a, bm = torch.zeros(5, 7, device="meta"), torch.zeros(7, 3, device="meta")
    assert count_flops(torch.ops.aten.mm.default, (a, bm), {}, a @ bm) == 2 * 5 * 7 * 3
    lin_w = torch.zeros(3, 7, device="meta")
    assert count_flops(torch.ops.aten.linear.default, (a, lin_w), {}, a @ bm) == 2 * 5 * 7 * 3
    assert count_flops(torch.ops.aten.einsum.default, ("ij,jk->ik", [a, bm]), {},
                       a @ bm) == 2 * 5 * 7 * 3
    assert count_flops(torch.ops.aten.view.default, (a, [35]), {}, a.view(35)) == 0
    assert count_flops(torch.ops.aten.relu.default, (a,), {}, a) == 35
    assert count_flops(torch.ops.aten.sum.default, (a,), {}, a.sum()) == 35
    assert op_kind(torch.ops.aten.layer_norm.default) == "norm"
    assert op_kind(torch.ops.aten.transpose.int) == "view"


# ---------------------------------------------------------------------------------- errors
class _Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        if y.sum() > 0:  # data-dependent control flow: not capturable
            return y * 2
        return y


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), _Gate()])

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


def test_data_dependent_control_flow_raises_capture_error_naming_module():
    with torch.device("meta"):
        m = _Net()
    with pytest.raises(CaptureError) as ei:
        capture(m, (torch.zeros(2, 8, device="meta"),), name="gated")
    msg = str(ei.value)
    assert "blocks.1" in msg and "_Gate" in msg and "gated" in msg
    assert "if y.sum() > 0" in msg
    assert "data-dependent" in msg and "torch.cond" in msg
    assert ei.value.module_path == "blocks.1"
    assert isinstance(ei.value, RuntimeError)


def test_wrong_input_shape_raises_capture_error():
    with torch.device("meta"):
        m = _Net()
    with pytest.raises(CaptureError, match="blocks.0.*Linear(.|\n)*example inputs"):
        capture(m, (torch.zeros(2, 5, device="meta"),))


# ------------------------------------------------------------------------------- large model
def test_gpt3_175b_captures_on_meta_without_allocating():
    t0 = time.perf_counter()
    b = build_model("gpt3-175b")
    assert all(p.device.type == "meta" for p in b.module.parameters())
    g = capture(b)
    elapsed = time.perf_counter() - t0
    assert elapsed < 30, elapsed
    assert 174e9 < g.graph["num_params"] < 176e9
    assert g.graph["seq_len"] == 2048 and len(g.layers()) == 96 + 5
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    assert peak_gib < 2.0, peak_gib  # weights would be 700 GB
    ls = g.layer_summaries()
    blk = ls[g.layers().index("transformer.h.50")]
    assert blk.param_bytes == 12 * 12288 * 12288 * 4 + 13 * 12288 * 4
    assert g.total_flops() == pytest.approx(2 * g.graph["num_params"] * 2048 +
                                            4 * 96 * 2048 * 2048 * 12288, rel=0.05)
