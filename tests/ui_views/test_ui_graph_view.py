"""Model graph view: collapse levels, layout, column data, selection, abstract fallback (no browser)."""

from __future__ import annotations

import itertools
import math

import networkx as nx
import panel as pn
import pytest

from engine.baselines.generic import one_f_one_b_any
from engine.plan import make_plan
from engine.shapes import make_shape
from planner_ui.graph_layout import (
    LEVELS,
    NODE_COLUMNS,
    collapse,
    edge_columns,
    fmt_bytes,
    fmt_flops,
    generations,
    layer_assignment,
    layout,
    node_columns,
    placement_dag,
    plan_segments,
    short_label,
)
from planner_ui.graph_view import WEBGL_NODES, GraphView
from planner_ui.state import PlanState


@pytest.fixture(scope="module")
def tiny():
    return make_plan("gpt2-tiny", devices=4, micro_batches=8)


@pytest.fixture(scope="module")
def gpt2():
    return make_plan("gpt2", devices=4, micro_batches=8, precision="32-true")   # float32 boundary tensors


@pytest.fixture(scope="module")
def tessel_gpt():
    return make_plan("tessel-gpt", devices=4, micro_batches=8)


def _state(res) -> PlanState:
    st = PlanState()
    st.load(res.plan, graph=res.graph)
    return st


# ------------------------------------------------------------------ collapse
def test_collapse_preserves_flops_and_param_bytes(tiny):
    g = tiny.graph
    segs = plan_segments(tiny.plan)
    total_flops = g.total_flops()
    total_params = sum(d.get("param_bytes", 0) for _, d in g.nodes(data=True))
    total_saved = sum(d.get("saved_bytes", 0) for _, d in g.nodes(data=True))
    assert total_flops > 0 and total_params > 0
    counts = {}
    for level in LEVELS:
        dag = collapse(g, level, segs)
        counts[level] = dag.number_of_nodes()
        assert nx.is_directed_acyclic_graph(dag)
        assert nx.number_of_selfloops(dag) == 0
        assert math.isclose(sum(a["flops"] for _, a in dag.nodes(data=True)), total_flops, rel_tol=1e-12)
        assert sum(a["param_bytes"] for _, a in dag.nodes(data=True)) == total_params
        assert sum(a["saved_bytes"] for _, a in dag.nodes(data=True)) == total_saved
        assert sum(a["ops"] for _, a in dag.nodes(data=True)) == len(g.op_nodes())
        # the column data carries the same totals to the chart
        cols = node_columns(dag)
        assert math.isclose(sum(cols["flops"]), total_flops, rel_tol=1e-12)
    assert counts["ops"] == g.number_of_nodes()
    assert counts["layers"] == len(g.layers())
    assert counts["segments"] == len(tiny.plan.segments)
    assert counts["ops"] > counts["layers"] > counts["segments"]


def test_layer_level_matches_layer_summaries(tiny):
    g = tiny.graph
    dag = collapse(g, "layers", plan_segments(tiny.plan))
    for ls in g.layer_summaries():
        a = dag.nodes[ls.name]
        assert a["ops"] == len(ls.ops)
        assert math.isclose(a["flops"], ls.flops, rel_tol=1e-12)
        assert a["param_bytes"] == ls.param_bytes
        assert a["activation_bytes"] == ls.activation_bytes
        assert a["label"] == short_label(ls.name)


def test_ops_level_edges_keep_tensor_bytes(tiny):
    g = tiny.graph
    dag = collapse(g, "ops", plan_segments(tiny.plan))
    assert dag.number_of_edges() == g.number_of_edges()
    assert sum(e["bytes"] for *_, e in dag.edges(data=True)) == sum(e["bytes"] for *_, e in g.edges(data=True))
    op = g.op_nodes()[5]
    assert dag.nodes[op]["shapes"] == [list(s) for s in g.nodes[op]["shapes"]]
    assert dag.nodes[op]["kind"] == g.nodes[op]["kind"]


def test_segment_level_is_the_plans_chain(tessel_gpt, gpt2):
    # tessel-gpt: one hidden state flows segment to segment: exactly a chain
    segs = plan_segments(tessel_gpt.plan)
    dag = collapse(tessel_gpt.graph, "segments", segs)
    n = len(segs)
    assert sorted(dag.nodes) == list(range(n))
    assert set(dag.edges) == {(i, i + 1) for i in range(n - 1)}
    for s in segs:
        a = dag.nodes[s["index"]]
        assert a["devices"] == list(tessel_gpt.plan.placement.spec("F", s["index"]).devices)
        assert a["layers"] == s["layers"]
        assert math.isclose(a["flops"], s["flops"], rel_tol=1e-9)  # tp=1: the planner's own sums
        # the graph counts a tied weight once (first use); the plan counts every stage's copy
        copies = sum(g["nbytes"] for g in tessel_gpt.plan.tied_weights
                     if s["index"] in {m[0] for m in g["members"][1:]})
        assert a["param_bytes"] + copies == s["param_bytes"]
    # gpt2 also sends the attention mask forward from segment 0, but the chain is there and
    # every edge goes forward, so the layout puts segment i at generation i
    segs = plan_segments(gpt2.plan)
    dag = collapse(gpt2.graph, "segments", segs)
    assert dag.number_of_nodes() == len(gpt2.plan.segments) == 4
    assert all(dag.has_edge(i, i + 1) for i in range(3))
    assert all(u < v for u, v in dag.edges)
    assert generations(dag) == {i: i for i in range(4)}
    hidden = segs[0]["output"]
    hidden_bytes = math.prod(hidden["shape"]) * 4
    for i in range(3):
        assert dag.edges[i, i + 1]["bytes"] >= hidden_bytes


def test_gpt2_layers_level_is_readable(gpt2):
    g = gpt2.graph
    dag = collapse(g, "layers", plan_segments(gpt2.plan))
    assert nx.is_directed_acyclic_graph(dag)
    assert 12 <= dag.number_of_nodes() <= 40
    pos = layout(dag)
    # consecutive layers line up left to right in layer order
    xs = [pos[name][0] for name in g.layers()]
    assert xs == sorted(xs)
    blocks = [f"transformer.h.{i}" for i in range(12)]
    assert len({pos[b][1] for b in blocks}) == 1
    assert [pos[b][0] for b in blocks] == [pos[blocks[0]][0] + i for i in range(12)]


def test_every_op_has_segment_and_device(gpt2):
    plan = gpt2.plan
    dag = collapse(gpt2.graph, "ops", plan_segments(plan))
    n_seg, n_dev = len(plan.segments), plan.placement.num_devices
    for n, a in dag.nodes(data=True):
        assert 0 <= a["segment"] < n_seg, n
        assert 0 <= a["device"] < n_dev, n
        assert a["device"] == plan.placement.spec("F", a["segment"]).devices[0]
    # the embedding goes to the first segment and the head to the last, as the planner cut them
    emb = [n for n, a in dag.nodes(data=True) if a["layer"] == "transformer.wte"]
    head = [n for n, a in dag.nodes(data=True) if a["layer"] == "lm_head"]
    assert emb and {dag.nodes[n]["segment"] for n in emb} == {0}
    assert head and {dag.nodes[n]["segment"] for n in head} == {n_seg - 1}


def test_layer_assignment_of_layers_no_segment_names(tiny):
    layers = tiny.graph.layers()
    # a plan that names only the blocks: leading layers -> first segment, trailing -> last
    segs = [{"index": 0, "layers": layers[3:5]}, {"index": 1, "layers": layers[5:7]}]
    mapping, unmapped = layer_assignment(tiny.graph, segs)
    assert unmapped == layers[:3] + layers[7:]
    assert [mapping[x] for x in layers] == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    dag = collapse(tiny.graph, "segments", segs)
    assert sorted(dag.nodes) == [0, 1] and dag.graph["unmapped_layers"] == unmapped
    assert math.isclose(sum(a["flops"] for _, a in dag.nodes(data=True)), tiny.graph.total_flops())
    with pytest.raises(ValueError, match="unknown graph level"):
        collapse(tiny.graph, "blocks")
    with pytest.raises(ValueError, match="segments"):
        collapse(tiny.graph, "segments", None)


# ------------------------------------------------------------------ layout and columns
@pytest.mark.parametrize("level", LEVELS)
def test_layout_edges_go_to_higher_generation(gpt2, level):
    dag = collapse(gpt2.graph, level, plan_segments(gpt2.plan))
    pos = layout(dag)
    assert set(pos) == set(dag.nodes)
    for u, v in dag.edges:
        assert pos[u][0] < pos[v][0], (u, v)
    # nodes of one generation are spread one unit apart, centred on y = 0
    by_x: dict[float, list[float]] = {}
    for x, y in pos.values():
        by_x.setdefault(x, []).append(y)
    for ys in by_x.values():
        ys.sort()
        assert math.isclose(sum(ys), 0.0, abs_tol=1e-9)
        assert all(math.isclose(b - a, 1.0) for a, b in itertools.pairwise(ys))


def test_node_and_edge_columns(tiny):
    segs = plan_segments(tiny.plan)
    dag = collapse(tiny.graph, "layers", segs)
    pos = layout(dag)
    cols = node_columns(dag, pos, color_by="segment", selected_segment=1)
    assert set(cols) == set(NODE_COLUMNS)
    assert all(len(v) == dag.number_of_nodes() for v in cols.values())
    by_id = {i: k for k, i in enumerate(cols["id"])}
    h0 = by_id["transformer.h.0"]
    assert cols["segment"][h0] == 1 and cols["selected"][h0]
    assert cols["alpha"][h0] > cols["alpha"][by_id["lm_head"]]
    assert cols["flops_text"][h0] == fmt_flops(dag.nodes["transformer.h.0"]["flops"])
    assert cols["flops_text"][h0].endswith("FLOP") and cols["params_text"][h0].endswith("iB")
    assert "[1, 128, 64]" in cols["shapes_text"][h0]
    # colour by segment vs device: one device per segment here, so both give 4 colours
    assert len(set(cols["color"])) == len(segs)
    dev = node_columns(dag, pos, color_by="device")
    assert [c for c in dev["color"]] == [c for c in cols["color"]]  # segment i is on device i
    with pytest.raises(ValueError):
        node_columns(dag, pos, color_by="layer")
    ecols = edge_columns(dag, pos)
    assert len(ecols["xs"]) == dag.number_of_edges()
    for xs, ys, src, dst in zip(ecols["xs"], ecols["ys"], ecols["src"], ecols["dst"]):
        assert (xs[0], ys[0]) == pos[src] and (xs[-1], ys[-1]) == pos[dst]
    assert fmt_bytes(3 * 2**20) == "3 MiB" and fmt_flops(2.5e9) == "2.5 GFLOP"


# ------------------------------------------------------------------ the view
def test_view_builds_and_selects(gpt2):
    st = _state(gpt2)
    view = GraphView(state=st)
    assert view.level == "layers"
    assert view.dag.number_of_nodes() == len(gpt2.graph.layers())
    assert view.nodes_source.data["label"][0]  # layers are labelled
    root = pn.panel(view).get_root()
    classes = {c for m in root.references() for c in (getattr(m, "css_classes", None) or [])}
    assert {"tessel-graph", "tessel-graph-level", "tessel-graph-color"} <= classes

    seg = view.select_node("transformer.h.5")
    assert seg == 1 and st.selected_segment == 1
    data = view.nodes_source.data
    for s, a, sel in zip(data["segment"], data["alpha"], data["selected"]):
        assert sel == (s == 1)
        assert (a > 0.5) == (s == 1)
    view.select_node(None)
    assert st.selected_segment is None and not any(view.nodes_source.data["selected"])
    with pytest.raises(KeyError):
        view.select_node("no.such.layer")
    # a tap in the browser arrives as a selection on the node source; an empty tap clears it
    i = view.nodes_source.data["id"].index("lm_head")
    view.nodes_source.selected.indices = [i]
    assert st.selected_segment == len(gpt2.plan.segments) - 1
    view.nodes_source.selected.indices = []
    assert st.selected_segment is None
    # a selection made elsewhere (the Gantt) is highlighted here too
    st.selected_segment = 2
    assert {s for s, sel in zip(view.nodes_source.data["segment"], view.nodes_source.data["selected"]) if sel} == {2}


def test_view_levels_colour_and_edits(gpt2):
    st = _state(gpt2)
    view = GraphView(state=st)
    view.level = "ops"
    assert view.dag.number_of_nodes() == gpt2.graph.number_of_nodes()
    fig = view._pane.object
    assert gpt2.graph.number_of_nodes() > WEBGL_NODES and fig.output_backend == "webgl"
    assert not any(view.nodes_source.data["label"])  # too many ops to label
    node = gpt2.graph.op_nodes()[-3]
    assert gpt2.graph.nodes[node]["layer"] in gpt2.plan.segments[-1]["layers"]
    assert view.select_node(node) == len(gpt2.plan.segments) - 1
    view.level = "segments"
    assert list(view.nodes_source.data["id"]) == ["0", "1", "2", "3"]
    assert view.select_node("2") == 2 and st.selected_segment == 2
    view.color_by = "device"
    assert view.nodes_source.data["color"] == node_columns(view.dag, view.positions, color_by="device")["color"]
    # an edit bumps the revision: same graph and segments, so the same figure is kept
    fig = view._pane.object
    res = st.move_block(1, 2, 1)
    assert res.ok, res.message
    assert view._pane.object is fig and view.dag.number_of_nodes() == 4
    # loading another model's plan redraws
    other = make_plan("tessel-gpt", devices=2, micro_batches=4)
    st.load(other.plan, graph=other.graph)
    assert view.dag.number_of_nodes() == 2 and view._pane.object is not fig


@pytest.mark.parametrize("shape", ["v", "x", "nn"])
def test_abstract_placement_shows_segment_chain(shape):
    pl = make_shape(shape, 4)
    st = PlanState()
    st.load(one_f_one_b_any(pl, 6))
    assert st.graph is None
    view = GraphView(state=st)
    assert view.dag.number_of_nodes() == pl.num_segments
    assert "abstract placement" in view.note and view._level_w.disabled
    chain = placement_dag(pl)
    assert set(view.dag.edges) == set(chain.edges)
    for b in pl.blocks:
        if b.kind == "F":
            for d in b.deps:
                assert view.dag.has_edge(pl.blocks[d].segment, b.segment)
            assert view.dag.nodes[b.segment]["devices"] == list(b.devices)
    cols = view.nodes_source.data
    assert all(t.endswith("units") for t in cols["time_text"])
    assert view.select_node(str(pl.num_segments - 1)) == pl.num_segments - 1
    pn.panel(view).get_root()


def test_no_plan_is_not_an_error():
    view = GraphView(state=PlanState())
    assert view.dag.number_of_nodes() == 0 and "No plan" in view.note
    pn.panel(view).get_root()


def test_colour_by_sharding_shows_the_plans_tensor_parallel_split():
    """GPT-2 at tp 2 (its derived plan): at the op level the fused query/key/value and the MLP's up
    projection are column-parallel, both c_proj row-parallel, the token embedding and LM head
    vocab-parallel, norms replicated; with a user's attention-only plan the MLP is replicated; at
    tp 1 nothing is sharded. The legend names the kinds and which plan it is."""
    from planner_ui.graph_layout import SHARDING_COLORS

    res = make_plan("gpt2-tiny", devices=2, tp=2, micro_batches=2, device_type="cpu", seq_len=16)
    view = GraphView(state=_state(res), level="ops", color_by="sharding")
    kinds = {n: a["sharding"] for n, a in view.dag.nodes(data=True)}
    paths = {n: a.get("module_path", "") for n, a in view.dag.nodes(data=True)}

    def kinds_of(suffix: str) -> set[str]:
        return {kinds[n] for n in kinds if paths[n].endswith(suffix)}

    assert kinds_of("attn.c_attn") == {"column-parallel"} and kinds_of("mlp.c_fc") == {"column-parallel"}
    assert kinds_of("attn.c_proj") == {"row-parallel"} and kinds_of("mlp.c_proj") == {"row-parallel"}
    assert kinds_of("transformer.wte") == {"vocab-parallel"} and kinds_of("lm_head") == {"vocab-parallel"}
    assert kinds_of("ln_1") == {"replicated"} and kinds_of("transformer.wpe") == {"replicated"}
    data = view.nodes_source.data
    for n, c in zip(data["id"], data["color"]):
        assert c == SHARDING_COLORS[kinds[n]]
    labels = [label for _c, label in view.legend()]
    assert labels[:2] == ["column-parallel", "row-parallel"] and "replicated" in labels
    assert "derived from its graph" in view._legend_pane.object

    user = make_plan("gpt2-tiny", devices=2, tp=2, micro_batches=2, device_type="cpu", seq_len=16,
                     tp_plan={"h.*.attn.c_attn": "packed_colwise:3", "h.*.attn.c_proj": "rowwise"})
    view = GraphView(state=_state(user), level="ops", color_by="sharding")
    got = {a.get("module_path", ""): a["sharding"] for _n, a in view.dag.nodes(data=True)}
    assert {k for p, k in got.items() if p.endswith("mlp.c_fc")} == {"replicated"}
    assert {k for p, k in got.items() if p.endswith("attn.c_attn")} == {"column-parallel"}
    assert "yours (--tp-plan)" in view._legend_pane.object

    one = make_plan("gpt2-tiny", devices=2, micro_batches=2, device_type="cpu", seq_len=16)
    view = GraphView(state=_state(one), color_by="sharding")
    assert {a["sharding"] for _n, a in view.dag.nodes(data=True)} == {"replicated"}
    assert "Nothing is tensor-parallel" in view._legend_pane.object
