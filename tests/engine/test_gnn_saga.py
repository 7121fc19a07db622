"""SAGA-NN layers against PyTorch Geometric's, and the chunk API against the full graph (issue 19).

References: every layer is compared with the PyG layer it copies (outputs, and gradients with
respect to the input and every parameter), on Zachary's karate club and on a random graph with
isolated vertices, duplicate edges and self-loops. The chunk API is checked against the layer's
own full-graph execution (itself equal to PyG): the edges are cut into random chunks (one
destination interval, 3 chunks; and 3 x 3 interval chunks, each split in 2), folded with
``gather_update`` in a random order, and the sum of the chunks' ``chunk_surrogate`` gradients must
equal the full-graph gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch_geometric.datasets import KarateClub
from torch_geometric.nn import GATConv, GCNConv, GINConv, ResGatedGraphConv, SAGEConv

from engine.errors import GNNError, TesselError
from engine.gnn.models import GNN_KINDS, GNNConfig, build_gnn
from engine.gnn.saga import GatedGCNLayer, GATLayer, GCNLayer, GINLayer, SAGALayer, SAGELayer

RTOL, ATOL = 1e-5, 1e-10


def _mlp(f_in: int, f_out: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(f_in, f_out), torch.nn.ReLU(), torch.nn.Linear(f_out, f_out))


# name -> (PyG conv factory from the input width, our layer class, our gather kind)
CASES = {
    "gcn": (lambda f: GCNConv(f, 5), GCNLayer, "sum"),
    "gcn-no-loops": (lambda f: GCNConv(f, 5, add_self_loops=False), GCNLayer, "sum"),
    "gat": (lambda f: GATConv(f, 3, heads=2), GATLayer, "softmax"),
    "gat-mean-heads": (lambda f: GATConv(f, 4, heads=3, concat=False, negative_slope=0.1), GATLayer, "softmax"),
    "sage-mean": (lambda f: SAGEConv(f, 5), SAGELayer, "mean"),
    "sage-max": (lambda f: SAGEConv(f, 5, aggr="max"), SAGELayer, "max"),
    "sage-sum-no-root": (lambda f: SAGEConv(f, 5, aggr="sum", root_weight=False), SAGELayer, "sum"),
    "gin": (lambda f: GINConv(_mlp(f, 5), eps=0.3, train_eps=True), GINLayer, "sum"),
    "gated-gcn": (lambda f: ResGatedGraphConv(f, 5), GatedGCNLayer, "sum"),
}


def _karate() -> tuple[torch.Tensor, torch.Tensor]:
    """Zachary's karate club (bundled with PyG): one-hot features [34, 34] (many ties for max), 156 edges."""
    data = KarateClub()[0]
    return data.x.double(), data.edge_index


def _random_graph() -> tuple[torch.Tensor, torch.Tensor]:
    """30 vertices; 25..29 isolated; random edges plus duplicates and (duplicate) self-loops."""
    gen = torch.Generator().manual_seed(7)
    src = torch.randint(0, 25, (90,), generator=gen)
    dst = torch.randint(0, 25, (90,), generator=gen)
    edges = torch.stack([src, dst])
    loops = torch.tensor([[3, 3, 8], [3, 3, 8]])
    edge_index = torch.cat([edges, edges[:, :15], loops], dim=1)
    x = torch.randn(30, 6, generator=gen, dtype=torch.float64)
    return x, edge_index


GRAPHS = {"karate": _karate, "random": _random_graph}


def _make(case: str, f_in: int) -> tuple[torch.nn.Module, SAGALayer]:
    factory, cls, _ = CASES[case]
    torch.manual_seed(11)
    conv = factory(f_in).double()
    with torch.no_grad():  # non-zero biases so that their copy is tested too
        for name, p in conv.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    return conv, cls.from_pyg(conv)


def _value_and_grads(module: torch.nn.Module, x: torch.Tensor, edge_index: torch.Tensor, g: torch.Tensor):
    x = x.clone().requires_grad_()
    out = module(x, edge_index)
    names = [n for n, _ in module.named_parameters()]
    grads = torch.autograd.grad((out * g).sum(), [x, *module.parameters()], allow_unused=True)
    return out, grads[0], dict(zip(names, grads[1:]))


@pytest.mark.parametrize("graph", sorted(GRAPHS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_equals_pyg_outputs_and_gradients(case, graph):
    x, edge_index = GRAPHS[graph]()
    conv, layer = _make(case, x.size(1))
    assert layer.gather_kind == CASES[case][2]
    g = torch.randn(x.size(0), layer.out_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out_ref, gx_ref, gp_ref = _value_and_grads(conv, x, edge_index, g)
    out, gx, gp = _value_and_grads(layer, x, edge_index, g)
    assert out.dtype == torch.float64 and out.shape == out_ref.shape
    torch.testing.assert_close(out, out_ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(gx, gx_ref, rtol=RTOL, atol=ATOL)
    assert set(gp) == set(gp_ref)
    for name in gp_ref:
        torch.testing.assert_close(gp[name], gp_ref[name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def test_max_gradient_splits_ties_evenly_like_pyg():
    """Karate's one-hot features make nearly every max a tie; the split must match PyG's amax backward."""
    x, edge_index = _karate()
    conv, layer = _make("sage-max", x.size(1))
    g = torch.ones(x.size(0), 5, dtype=torch.float64)
    _, gx_ref, _ = _value_and_grads(conv, x, edge_index, g)
    _, gx, _ = _value_and_grads(layer, x, edge_index, g)
    fractional = (gx_ref * 3).frac().abs() > 1e-9  # shares like 1/2, 1/3: ties were split
    assert bool(fractional.any())
    torch.testing.assert_close(gx, gx_ref, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- chunk API
def _chunks(edge_index, bounds, n_sub, gen):
    """Edge chunks (i, j) with local indices, each split into n_sub random pieces: {j: [(i, src, dst)]}."""
    src, dst = edge_index
    out: dict[int, list] = {}
    intervals = list(zip(bounds[:-1], bounds[1:]))
    for j, (c, d) in enumerate(intervals):
        out[j] = []
        for i, (a, b) in enumerate(intervals):
            idx = ((src >= a) & (src < b) & (dst >= c) & (dst < d)).nonzero().view(-1)
            idx = idx[torch.randperm(idx.numel(), generator=gen)]
            for piece in torch.tensor_split(idx, n_sub):
                out[j].append((i, src[piece] - a, dst[piece] - c))
        order = torch.randperm(len(out[j]), generator=gen).tolist()
        out[j] = [out[j][k] for k in order]
    return out


def _streamed(layer: SAGALayer, x, edge_index, bounds, n_sub, g_out):
    """A tiny chunk-by-chunk executor: forward folds chunks; backward uses chunk_surrogate."""
    gen = torch.Generator().manual_seed(5)
    n = x.size(0)
    edge_index = layer.prepare_edges(edge_index, n)
    vattr = layer.vertex_attrs(edge_index, n, dtype=x.dtype)
    intervals = list(zip(bounds[:-1], bounds[1:]))
    chunks = _chunks(edge_index, bounds, n_sub, gen)
    x = x.clone().requires_grad_()
    h = layer.apply_vertex_pre(x)

    def messages(i, j, s_loc, d_loc):
        (a, b), (c, d) = intervals[i], intervals[j]
        edata = layer.scatter(h[a:b], h[c:d], s_loc, d_loc, vattr[a:b], vattr[c:d])
        return layer.apply_edge(edata)

    accs, aggs, outs = [], [], []
    with torch.no_grad():
        for j, (c, d) in enumerate(intervals):
            acc = layer.gather_init(d - c, x)
            for i, s_loc, d_loc in chunks[j]:
                msg, logit = messages(i, j, s_loc, d_loc)
                acc = layer.gather_update(acc, msg, logit, d_loc)
            accs.append(acc)
            aggs.append(layer.gather_finalize(acc, vattr[c:d]))
            outs.append(layer.apply_vertex(h[c:d], x[c:d], aggs[-1]))
    leaves = [agg.clone().requires_grad_() for agg in aggs]
    vertex_loss = sum((layer.apply_vertex(h[c:d], x[c:d], leaf) * g_out[c:d]).sum()
                      for (c, d), leaf in zip(intervals, leaves))
    grad_aggs = torch.autograd.grad(vertex_loss, leaves, retain_graph=True)
    total = vertex_loss
    for j, (c, d) in enumerate(intervals):
        for i, s_loc, d_loc in chunks[j]:
            msg, logit = messages(i, j, s_loc, d_loc)
            total = total + layer.chunk_surrogate(msg, logit, d_loc, aggs[j], grad_aggs[j], accs[j], vattr[c:d])
    grads = torch.autograd.grad(total, [x, *layer.parameters()], allow_unused=True)
    return torch.cat(aggs), torch.cat(outs), grads


def _full_gather(layer: SAGALayer, x, edge_index):
    n = x.size(0)
    edge_index = layer.prepare_edges(edge_index, n)
    vattr = layer.vertex_attrs(edge_index, n, dtype=x.dtype)
    with torch.no_grad():
        h = layer.apply_vertex_pre(x)
        msg, logit = layer.apply_edge(layer.scatter(h, h, edge_index[0], edge_index[1], vattr, vattr))
        return layer.gather(msg, logit, edge_index[1], n)


@pytest.mark.parametrize("split", ["one-interval-3-chunks", "3x3-intervals-2-pieces"])
@pytest.mark.parametrize("graph", sorted(GRAPHS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_chunk_api_equals_full_graph(case, graph, split):
    x, edge_index = GRAPHS[graph]()
    _, layer = _make(case, x.size(1))
    n = x.size(0)
    bounds, n_sub = ([0, n], 3) if split.startswith("one") else ([0, n // 3, (2 * n) // 3 + 1, n], 2)
    g = torch.randn(n, layer.out_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    agg, out, grads = _streamed(layer, x, edge_index, bounds, n_sub, g)
    torch.testing.assert_close(agg, _full_gather(layer, x, edge_index), rtol=RTOL, atol=ATOL)
    out_ref, gx_ref, gp_ref = _value_and_grads(layer, x, edge_index, g)
    torch.testing.assert_close(out, out_ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grads[0], gx_ref, rtol=RTOL, atol=ATOL)
    for (name, ref), got in zip(gp_ref.items(), grads[1:]):
        torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def test_gather_update_returns_a_new_accumulator():
    x, edge_index = _random_graph()
    _, layer = _make("gat", x.size(1))
    acc = layer.gather_init(x.size(0), x)
    before = {k: v.clone() for k, v in acc.items()}
    edge_index = layer.prepare_edges(edge_index, x.size(0))
    vattr = layer.vertex_attrs(edge_index, x.size(0), dtype=x.dtype)
    h = layer.apply_vertex_pre(x)
    msg, logit = layer.apply_edge(layer.scatter(h, h, edge_index[0], edge_index[1], vattr, vattr))
    new = layer.gather_update(acc, msg, logit, edge_index[1])
    for k in acc:
        assert torch.equal(acc[k], before[k])
        assert not torch.equal(new[k], before[k])


def test_vertex_attrs_are_whole_graph_degrees():
    x, edge_index = _random_graph()
    _, layer = _make("gcn", x.size(1))
    prepared = layer.prepare_edges(edge_index, x.size(0))
    vattr = layer.vertex_attrs(prepared, x.size(0), dtype=x.dtype)
    assert vattr.shape == (30, 2)
    # one self-loop per vertex after preparation (the two duplicates on vertex 3 collapse to one)
    assert int(((prepared[0] == prepared[1]) & (prepared[0] == 3)).sum()) == 1
    in_deg = torch.bincount(prepared[1], minlength=30).double()
    out_deg = torch.bincount(prepared[0], minlength=30).double()
    assert torch.equal(vattr[:, 0], in_deg) and torch.equal(vattr[:, 1], out_deg)
    assert torch.equal(vattr[25:], torch.ones(5, 2, dtype=torch.float64))  # isolated: their self-loop only


def test_stages_run_in_saga_profiler_ranges():
    x, edge_index = _karate()
    _, layer = _make("gat", x.size(1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        layer(x, edge_index)
    names = {e.name for e in prof.events()}
    assert {"saga.apply_vertex", "saga.scatter", "saga.apply_edge", "saga.gather"} <= names


# --------------------------------------------------------------------------- models
def _pyg_twin(layer: SAGALayer) -> torch.nn.Module:
    """The PyG layer with our layer's configuration, loaded with our layer's weights."""
    if isinstance(layer, GCNLayer):
        conv: torch.nn.Module = GCNConv(layer.in_dim, layer.out_dim)
    elif isinstance(layer, GATLayer):
        conv = GATConv(layer.in_dim, layer.head_dim, heads=layer.heads, concat=layer.concat)
    elif isinstance(layer, SAGELayer):
        conv = SAGEConv(layer.in_dim, layer.out_dim, aggr=layer.gather_kind)
    elif isinstance(layer, GINLayer):
        conv = GINConv(copy.deepcopy(layer.nn))
    else:
        assert isinstance(layer, GatedGCNLayer)
        conv = ResGatedGraphConv(layer.in_dim, layer.out_dim)
    conv = conv.to(next(layer.parameters()).dtype)
    conv.load_state_dict(layer.state_dict())
    return conv


@pytest.mark.parametrize("kind", GNN_KINDS)
def test_build_gnn_equals_pyg_stack(kind):
    x, edge_index = _karate()
    config = GNNConfig(kind, in_dim=34, hidden=8, out_dim=4, layers=3, heads=2 if kind == "gat" else 1)
    torch.manual_seed(0)
    model = build_gnn(config).double()
    assert len(model.layers) == 3 and all(isinstance(m, SAGALayer) for m in model.layers)
    convs = [_pyg_twin(m) for m in model.layers]
    xr = x.clone().requires_grad_()
    ref = xr
    for i, conv in enumerate(convs):
        ref = conv(ref, edge_index)
        ref = torch.relu(ref) if i < len(convs) - 1 else ref
    xo = x.clone().requires_grad_()
    out = model(xo, edge_index)
    assert out.shape == (34, 4)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), xo)[0], torch.autograd.grad(ref.sum(), xr)[0],
                               rtol=RTOL, atol=ATOL)
    assert model.parameter_bytes() == sum(p.numel() * 8 for c in convs for p in c.parameters())


def test_build_gnn_is_seed_deterministic():
    config = GNNConfig("gat", in_dim=6, hidden=8, out_dim=3, layers=2, heads=2)
    states = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        states.append(build_gnn(config).state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not all(torch.equal(states[0][k], states[2][k]) for k in states[0])


def test_single_layer_model_maps_in_to_out():
    x, edge_index = _random_graph()
    model = build_gnn(GNNConfig("sage", in_dim=6, hidden=16, out_dim=2, layers=1)).double()
    assert model(x, edge_index).shape == (30, 2)


# --------------------------------------------------------------------------- errors
def _one_sentence(err: BaseException) -> None:
    text = str(err)
    assert isinstance(err, TesselError) and isinstance(err, ValueError)
    assert text.endswith(".") and ". " not in text and "\n" not in text, text


@pytest.mark.parametrize("kwargs, needle", [
    ({"kind": "gcnx"}, "kind"),
    ({"in_dim": 0}, "in_dim"),
    ({"hidden": -3}, "hidden"),
    ({"layers": 0}, "layers"),
    ({"out_dim": 2.5}, "out_dim"),
    ({"heads": 2}, "heads"),
    ({"kind": "gat", "hidden": 10, "heads": 3}, "multiple of heads"),
])
def test_bad_config_is_one_sentence(kwargs, needle):
    args = {"kind": "gcn", "in_dim": 4, "hidden": 8, "out_dim": 2, "layers": 2, "heads": 1} | kwargs
    with pytest.raises(GNNError, match=needle) as info:
        GNNConfig(**args)
    _one_sentence(info.value)


@pytest.mark.parametrize("make, needle", [
    (lambda: SAGALayer(4, 4, (4,), "median", False), "gather kind"),
    (lambda: SAGELayer(4, 4, aggr="lstm"), "aggr"),
    (lambda: GCNLayer.from_pyg(GCNConv(4, 4, normalize=False)), "normalize"),
    (lambda: GATLayer.from_pyg(GATConv(4, 4, dropout=0.5)), "dropout"),
    (lambda: GCNLayer.from_pyg(SAGEConv(4, 4)), "GCNConv"),
    (lambda: GINLayer(torch.nn.ReLU()), "in_dim"),
    (lambda: GCNLayer(4, 3)(torch.zeros(5, 4), torch.tensor([[0, 1], [1, 5]])), "outside"),
    (lambda: GCNLayer(4, 3)(torch.zeros(5, 4), torch.tensor([[0.0], [1.0]])), "int64"),
    (lambda: GCNLayer(4, 3)(torch.zeros(5, 4), torch.tensor([0, 1])), "[2, E]"),
    (lambda: GCNLayer(4, 3)(torch.zeros(5, 3), torch.tensor([[0], [1]])), "shape"),
])
def test_bad_layer_input_is_one_sentence(make, needle):
    with pytest.raises(GNNError) as info:
        make()
    assert needle in str(info.value)
    _one_sentence(info.value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunk_grads_are_the_surrogates_gradients(case):
    """``chunk_grads`` (what the streamed backward passes as ``grad_outputs``) equals autograd's gradient of
    ``chunk_surrogate`` with respect to the chunk's messages and logits, for every gather kind."""
    x, edge_index = GRAPHS[sorted(GRAPHS)[0]]()
    _, layer = _make(case, x.size(1))
    n = x.size(0)
    edge_index = layer.prepare_edges(edge_index, n)
    vattr = layer.vertex_attrs(edge_index, n, dtype=x.dtype)
    with torch.no_grad():
        h = layer.apply_vertex_pre(x)
        msg, logit = layer.apply_edge(layer.scatter(h, h, edge_index[0], edge_index[1], vattr, vattr))
        acc = layer.gather_update(layer.gather_init(n, x), msg, logit, edge_index[1])
        agg = layer.gather_finalize(acc, vattr)
    g = torch.randn(agg.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    msg = msg.clone().requires_grad_()
    logit = None if logit is None else logit.clone().requires_grad_()
    s = layer.chunk_surrogate(msg, logit, edge_index[1], agg, g, acc, vattr)
    ref = torch.autograd.grad(s, [msg] + ([logit] if logit is not None else []))
    g_msg, g_logit = layer.chunk_grads(msg, logit, edge_index[1], agg, g, acc, vattr)
    torch.testing.assert_close(g_msg, ref[0], rtol=RTOL, atol=ATOL)
    if logit is None:
        assert g_logit is None
    else:
        torch.testing.assert_close(g_logit, ref[1], rtol=RTOL, atol=ATOL)
