"""engine.gnn.characterize: the SAGA-stage / kernel-class breakdown of GNN time (torch.profiler).

Checked against the profiler's own inclusive range times (the cells of a layer add up to its
``gnn.layer{k}`` range), against the layers' definitions (where their matmuls and index_selects
are), and relatively (a denser graph with the same vertices shifts GAT's time to the graph stages).
No absolute timing is asserted.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.profiler import record_function

from engine.errors import CharacterizeError
from engine.gnn.characterize import (
    GRAPH_STAGES,
    KERNEL_CLASSES,
    LOSS,
    OUTSIDE,
    STAGES,
    ProfileGraph,
    characterize,
    find_layers,
    kernel_class,
    pivot,
    sweep,
)
from engine.gnn.models import GNN_KINDS, GNNConfig, build_gnn


def _model(kind: str, width: int = 32, layers: int = 2, heads: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return build_gnn(GNNConfig(kind, width, width, width, layers, heads if kind == "gat" else 1))


def _x(n: int, width: int = 32) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def er_graph() -> ProfileGraph:
    return ProfileGraph.erdos_renyi(400, 8, seed=0, name="er")


@pytest.fixture(scope="module")
def gat_training(er_graph):
    return characterize(_model("gat"), _x(er_graph.num_nodes), er_graph.edge_index, "training", repeats=1, warmup=1,
                        label="gat", graph="er")


def test_kernel_classes_by_op_name():
    gathers = ["aten::index_select", "aten::index", "aten::index_add_", "aten::gather", "aten::scatter_add_",
               "aten::scatter_reduce", "aten::index_select_backward", "aten::segment_reduce", "aten::_index_put_impl_"]
    matmuls = ["aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"]
    elementwise = ["aten::mul", "aten::add_", "aten::exp", "aten::leaky_relu", "aten::sum", "aten::zeros",
                   "aten::copy_", "aten::indices"]
    overhead = ["saga.gather", "gnn.layer0", "MulBackward0", "autograd::engine::evaluate_function: MmBackward0",
                "torch::autograd::AccumulateGrad", "detach"]
    for names, cls in ((gathers, "gather_scatter"), (matmuls, "matmul"), (elementwise, "elementwise"),
                       (overhead, "overhead")):
        assert {n: kernel_class(n) for n in names} == dict.fromkeys(names, cls)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_stage_cells_add_up_to_the_profiled_layer_range(er_graph, gat_training, mode):
    c = gat_training if mode == "training" else characterize(
        _model("gat"), _x(er_graph.num_nodes), er_graph.edge_index, "inference", repeats=1, warmup=1)
    assert c.layers == ["layer0", "layer1"]
    totals = c.layer_total_seconds()
    stages = c.stage_seconds("forward")
    classes = c.class_seconds("forward")
    for lay in c.layers:
        assert totals[lay] > 0
        # self times of everything inside the range, by stage and by class, are the range's inclusive time
        assert sum(stages[lay].values()) == pytest.approx(totals[lay], rel=1e-6)
        assert sum(classes[lay].values()) == pytest.approx(totals[lay], rel=1e-6)
        for st in ("scatter", "gather", "apply_vertex"):
            assert stages[lay][st] > 0, (lay, st)
    # the whole step is the layers + the time outside them (ReLU) + the loss and backward
    layers_and_outside = sum(totals.values()) + c.seconds(phase="forward", layer=OUTSIDE)
    assert c.seconds(phase="forward") == pytest.approx(layers_and_outside, rel=1e-6)
    assert c.total_seconds() <= sum(c.wall_seconds) * 1.5  # a profiled self time is within the step's wall time


def test_kernels_land_in_the_stages_the_layer_defines(gat_training):
    """GAT (engine.gnn.saga.GATLayer): its only matmul is ``W x`` in apply_vertex, its scatter is index_select."""
    c = gat_training
    for lay in c.layers:
        for st in STAGES:
            mm = c.seconds(phase="forward", layer=lay, stage=st, kernel_class="matmul")
            assert (mm > 0) == (st == "apply_vertex"), (lay, st, mm)
        assert c.seconds(phase="forward", layer=lay, stage="scatter", kernel_class="gather_scatter") > 0
        assert c.seconds(phase="forward", layer=lay, stage="gather", kernel_class="gather_scatter") > 0


@pytest.mark.serial
def test_backward_is_attributed_to_forward_stages_by_sequence_number(gat_training):
    c = gat_training
    # what no forward stage owns is the autograd engine's own bookkeeping (class "overhead": on this
    # 400-vertex graph 20-25% of a ~2 ms backward), never a kernel: no gather/scatter or matmul time, and
    # elementwise time under 5% of the backward
    backward = c.seconds(phase="backward")
    for kc in ("gather_scatter", "matmul"):
        assert c.seconds(phase="backward", layer="outside", kernel_class=kc) == 0, kc
    assert c.seconds(phase="backward", layer="outside", kernel_class="elementwise") < 0.05 * backward
    assert min(c.backward_attributed) > 0.6
    for lay in c.layers:
        # the backward of W x (mm) is attributed to apply_vertex only
        for st in STAGES:
            mm = c.seconds(phase="backward", layer=lay, stage=st, kernel_class="matmul")
            assert (mm > 0) == (st == "apply_vertex"), (lay, st, mm)
        # the softmax gather's backward (gather + scatter ops) belongs to the gather stage
        assert c.seconds(phase="backward", layer=lay, stage="gather", kernel_class="gather_scatter") > 0
    # layer1's input requires grad: the index_select of its scatter back-propagates as index_add (scatter stage)
    assert c.seconds(phase="backward", layer="layer1", stage="scatter", kernel_class="gather_scatter") > 0
    assert c.seconds(phase="backward", layer=LOSS) > 0
    assert c.seconds(phase="loss", layer=LOSS) > 0


def test_gat_on_a_denser_graph_spends_a_larger_share_in_the_graph_stages():
    n = 1000
    sparse = ProfileGraph.erdos_renyi(n, 2, seed=0)
    dense = ProfileGraph.erdos_renyi(n, 64, seed=0)
    x = _x(n)
    model = _model("gat")
    # one thread: OpenMP threads waiting on descheduled peers on a busy machine would swamp the shares
    before = torch.get_num_threads()
    cs = characterize(model, x, sparse.edge_index, "inference", repeats=3, warmup=1, threads=1)
    cd = characterize(model, x, dense.edge_index, "inference", repeats=3, warmup=1, threads=1)
    assert cs.meta["threads"] == cd.meta["threads"] == 1 and torch.get_num_threads() == before

    def graph_and_edge(c):
        return sum(c.seconds(phase="forward", layer=lay, stage=st) for lay in c.layers for st in GRAPH_STAGES)

    assert graph_and_edge(cd) > graph_and_edge(cs)
    assert cd.graph_stage_share() > cs.graph_stage_share()
    assert cd.class_share("gather_scatter", "forward") > cs.class_share("gather_scatter", "forward")


def test_every_kind_and_mode_runs_in_a_sweep(er_graph):
    small = ProfileGraph.erdos_renyi(120, 4, seed=0, name="small")
    rows = sweep(GNN_KINDS, [small], [16], ["inference", "training"], heads=2, repeats=1, warmup=0)
    json.dumps(rows)
    seen = {(r["model"], r["mode"]) for r in rows}
    assert seen == {(k, m) for k in GNN_KINDS for m in ("inference", "training")}
    for kind in GNN_KINDS:
        for mode in ("inference", "training"):
            mine = [r for r in rows if r["model"] == kind and r["mode"] == mode]
            assert {r["graph"] for r in mine} == {"small"} and {r["width"] for r in mine} == {16}
            assert {r["num_edges"] for r in mine} == {small.num_edges}
            stages = pivot(mine, ("layer",), "stage", {"phase": "forward"})
            for lay in ("layer0", "layer1"):
                assert stages[(lay,)].get("scatter", 0) > 0 and stages[(lay,)].get("gather", 0) > 0, (kind, lay)
            phases = {r["phase"] for r in mine}
            assert phases == ({"forward", "loss", "backward"} if mode == "training" else {"forward"}), (kind, mode)
            assert {r["stage"] for r in mine} <= set(STAGES)
            assert {r["kernel_class"] for r in mine} <= set(KERNEL_CLASSES)


def test_rows_and_summary_match_the_accessors(gat_training):
    c = gat_training
    rows = c.rows()
    json.dumps(c.to_dict())
    by_stage = pivot(rows, ("layer",), "stage", {"phase": "backward"})
    for lay, cells in c.stage_seconds("backward").items():
        for st, sec in cells.items():
            assert by_stage.get((lay,), {}).get(st, 0.0) == pytest.approx(sec, abs=1e-12), (lay, st)
    s = c.summary()
    assert s["mode"] == "training" and s["num_nodes"] == 400 and s["layers"] == ["layer0", "layer1"]
    assert sum(s["stage_seconds"]["forward"].values()) == pytest.approx(sum(c.layer_total_seconds().values()),
                                                                        rel=1e-6)
    assert 0 < s["graph_stage_share"] < 1


class _OneStage(nn.Module):
    """A model without ``layers``: the whole model is one layer, its matmul in one saga range."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, edge_index):
        with record_function("saga.apply_vertex"):
            h = self.lin(x)
        with record_function("saga.scatter"):
            e = h.index_select(0, edge_index[0])
        with record_function("saga.gather"):
            return torch.zeros_like(h).index_add_(0, edge_index[1], e)


def test_a_model_without_layers_is_one_layer_and_hooks_are_removed():
    m = _OneStage()
    assert find_layers(m) == [m]
    ei = torch.tensor([[0, 1, 2], [1, 2, 0]])
    c = characterize(m, torch.randn(3, 8), ei, "training", repeats=2, warmup=0)
    assert c.layers == ["layer0"]
    assert c.seconds(phase="forward", layer="layer0", stage="apply_vertex", kernel_class="matmul") > 0
    assert c.seconds(phase="backward", layer="layer0", stage="gather", kernel_class="gather_scatter") > 0
    assert not m._forward_hooks and not m._forward_pre_hooks
    assert m.training  # restored


def test_bad_inputs_raise_one_sentence(er_graph):
    m, x, ei = _model("gcn"), _x(er_graph.num_nodes), er_graph.edge_index
    cases = [dict(mode="train"), dict(repeats=0), dict(warmup=-1), dict(threads=0)]
    for kw in cases:
        args = {"mode": "inference", **kw}
        with pytest.raises(CharacterizeError) as e:
            characterize(m, x, ei, **args)
        assert str(e.value).endswith(".") and "\n" not in str(e.value)
    with pytest.raises(CharacterizeError, match="vertex"):
        characterize(m, x[:10], ei)
    with pytest.raises(CharacterizeError, match=r"\[2, E\]"):
        characterize(m, x, ei.float())
    with pytest.raises(CharacterizeError, match="outside"):
        ProfileGraph("g", torch.tensor([[0], [5]]), 3)
    with pytest.raises(CharacterizeError, match="average degree"):
        ProfileGraph.erdos_renyi(10, 20)
    with pytest.raises(CharacterizeError, match="at least one"):
        sweep(["gcn"], [], [16])
