"""Chunk-streamed GNN execution (NGra section 4; issue 19) against full-graph execution.

References: the model's own full-graph forward (``GNNModel(x, edge_index)``, itself tested equal
to PyTorch Geometric's layers in tests/engine/test_gnn_saga.py), its autograd gradients and its
full-graph training; for memory, the full-graph step measured the same way (in a fresh
subprocess) and the bytes of a tensor of known size.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from engine.errors import GNNError
from engine.gnn.models import GNN_KINDS, GNNConfig, GNNModel, build_gnn
from engine.gnn.partition import choose_partitions, partition_for_model, predict_streamed_peak
from engine.gnn.saga import SAGELayer
from runtime.gnn.memory import MemoryMeasurementError, measure_peak, measure_peak_bytes
from runtime.gnn.streaming import APPLY_VERTEX, APPLY_VERTEX_PRE, StreamedGNN, predict, train_step

RTOL, ATOL = 1e-5, 1e-9
N = 300


def _graph(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """300 vertices (290..299 isolated), 2400 random edges, 100 duplicated, a few self-loops; float64 x [N, 7]."""
    gen = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, N - 10, (2, 2400), generator=gen)
    ei = torch.cat([ei, ei[:, :100], torch.tensor([[5, 5, 17], [5, 5, 17]])], dim=1)
    return torch.randn(N, 7, generator=gen, dtype=torch.float64), ei


def _model(kind: str) -> GNNModel:
    torch.manual_seed(3)
    if kind == "sage-max":  # the max gather (ties from the duplicated edges included)
        config = GNNConfig("sage", 7, 8, 3)
        model = GNNModel(config, [SAGELayer(7, 8, aggr="max"), SAGELayer(8, 3, aggr="max")])
    else:
        model = build_gnn(GNNConfig(kind, 7, 8, 3, layers=2, heads=2 if kind == "gat" else 1))
    model = model.double()
    with torch.no_grad():  # non-zero biases, so that every parameter gets a gradient
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    return model


def _grads(model: GNNModel, run, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    out = run(x)
    (out * g).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("parts", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", list(GNN_KINDS) + ["sage-max"])
def test_streamed_equals_full_graph_outputs_and_gradients(kind: str, parts: int) -> None:
    x, ei = _graph()
    model = _model(kind)
    g = torch.randn(N, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    full = _grads(model, lambda xx: model(xx, ei), x, g)
    part = partition_for_model(model, ei, N, parts)
    streamed = StreamedGNN(model, part, prefetch=parts != 2)  # P = 2 without the loader thread
    got = _grads(model, streamed, x, g)
    names = ["output", "x.grad"] + [f"{n}.grad" for n, _ in model.named_parameters()]
    assert len(got) == len(full)
    for name, a, b in zip(names, got, full):
        assert b is not None and a is not None, name
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")

    # one load and one compute per non-empty chunk, layer and phase; a chunk's compute after its load
    records = streamed.reset_records()
    nonempty = int((part.chunk_edges() > 0).sum())
    chunk_records = [r for r in records if r.i >= 0]
    for phase in "FB":
        for kind_ in ("load", "compute"):
            assert sum(r.phase == phase and r.kind == kind_ for r in chunk_records) == 2 * nonempty
    loads = {(r.layer, r.phase, r.i, r.j): r for r in chunk_records if r.kind == "load"}
    for r in chunk_records:
        if r.kind == "compute":
            assert loads[(r.layer, r.phase, r.i, r.j)].end <= r.start
            assert r.bytes > 0 and r.end >= r.start
    dense = [r for r in records if r.i in (APPLY_VERTEX, APPLY_VERTEX_PRE)]
    assert len(dense) == 2 * 2 * parts and all(0 <= r.j < parts for r in dense)


@pytest.mark.parametrize("kind", ["gat", "gin"])
def test_streamed_training_equals_full_graph_training(kind: str) -> None:
    x, ei = _graph(seed=1)
    gen = torch.Generator().manual_seed(4)
    y = torch.randint(0, 3, (N,), generator=gen)
    mask = torch.rand(N, generator=gen) < 0.6
    ref = _model(kind)
    mine = copy.deepcopy(ref)
    part = partition_for_model(mine, ei, N, 4)
    streamed = StreamedGNN(mine, part)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=0.05)
    opt_mine = torch.optim.Adam(mine.parameters(), lr=0.05)
    for _ in range(4):
        opt_ref.zero_grad()
        loss = F.cross_entropy(ref(x, ei)[mask], y[mask])
        loss.backward()
        opt_ref.step()
        step = train_step(streamed, None, x, y, mask, opt_mine)
        assert step.loss == pytest.approx(float(loss.detach()), rel=RTOL)
        assert step.records and step.seconds > 0
    for (name, a), b in zip(mine.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(predict(mine, part, x), ref(x, ei).detach(), rtol=RTOL, atol=ATOL)


def test_bad_inputs_raise_one_sentence() -> None:
    x, ei = _graph()
    model = _model("gcn")
    part = partition_for_model(model, ei, N, 2)
    streamed = StreamedGNN(model, part)
    with pytest.raises(GNNError, match=r"x must be \[300, 7\]"):
        streamed(x[:, :5])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    y = torch.zeros(N, dtype=torch.long)
    with pytest.raises(GNNError, match="selects no vertex"):
        train_step(model, part, x, y, torch.zeros(N, dtype=torch.bool), opt)
    with pytest.raises(GNNError, match="mask must be a bool tensor"):
        train_step(model, part, x, y, torch.ones(N), opt)
    with pytest.raises(GNNError, match="needs its GraphPartition"):
        predict(model, None, x)
    mixed = GNNModel(model.config, [model.layers[0], SAGELayer(8, 3)])
    with pytest.raises(GNNError, match="all add self-loops or all do not"):
        StreamedGNN(mixed, part)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path (side-stream index copies) needs a GPU; "
                    "none on this machine")
def test_cuda_streamed_equals_cpu() -> None:  # pragma: no cover - no GPU here
    x, ei = _graph()
    model = _model("gat")
    part = partition_for_model(model, ei, N, 4)
    want = StreamedGNN(model, part)(x).detach()
    got = StreamedGNN(model.cuda(), part)(x.cuda()).detach().cpu()
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


# --- memory ---------------------------------------------------------------------------------------

def _allocate(nbytes: int) -> float:
    t = torch.ones(nbytes // 4, dtype=torch.float32)
    return float(t[-1])


def _raise() -> None:
    raise ValueError("this input is bad")


def test_measure_peak_bytes_sees_a_tensor_of_known_size_and_reports_child_errors() -> None:
    nbytes = 64 * 2**20
    peak = measure_peak_bytes(_allocate, nbytes)
    assert nbytes <= peak <= nbytes + 8 * 2**20
    with pytest.raises(MemoryMeasurementError, match=r"_raise failed in its subprocess with ValueError: this input "
                                                     r"is bad\.$"):
        measure_peak(_raise)


BUDGET = 256 * 2**20
CONFIG = GNNConfig("gat", 32, 64, 8, layers=2, heads=4)


def _setup_step(parts: int) -> tuple:
    """In the measuring child: the R-MAT graph, the model, the partition (``parts == 0``: none, the
    full graph), then one warm-up step of each kind on a small graph, so that the process's one-time
    state (autograd engine, thread pools, kernel caches) is in the baseline."""
    from tasks.graphs import rmat_graph

    data = rmat_graph(15, 6, feature_dim=32, seed=0)
    torch.manual_seed(0)
    model = build_gnn(CONFIG)
    part = partition_for_model(model, data.edge_index, data.num_nodes, parts) if parts else None
    small = rmat_graph(9, 4, feature_dim=32, seed=1)
    warm = copy.deepcopy(model)
    warm_part = partition_for_model(warm, small.edge_index, small.num_nodes, 4)
    _step(warm, warm_part, small.x, small.y, small.train_mask, small.edge_index)
    _step(warm, None, small.x, small.y, small.train_mask, small.edge_index)
    return model, part, data.x, data.y, data.train_mask, data.edge_index


def _step(model, part, x, y, mask, edge_index) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if part is None:
        F.cross_entropy(model(x, edge_index)[mask], y[mask]).backward()
        opt.step()
    else:
        train_step(model, part, x, y, mask, opt)


def test_streamed_peak_stays_under_the_planned_budget_where_the_full_graph_exceeds_it() -> None:
    """GAT, 4 heads, on a 32k-vertex, 358k-edge R-MAT graph (390k with self-loops): P is planned for a
    256 MiB budget by choose_partitions; the measured streamed step fits it, the full-graph step does not."""
    from tasks.graphs import rmat_graph

    data = rmat_graph(15, 6, feature_dim=32, seed=0)
    prepared = build_gnn(CONFIG).layers[0].prepare_edges(data.edge_index, data.num_nodes)
    parts = choose_partitions(data.num_nodes, prepared.shape[1], CONFIG, BUDGET, edge_index=prepared)
    assert parts > 1
    streamed = measure_peak_bytes(_step, parts, setup=_setup_step)
    full = measure_peak_bytes(_step, 0, setup=_setup_step)
    assert streamed <= BUDGET < full, (parts, streamed, full)
    # and the prediction the plan used bounds the measurement
    part = partition_for_model(build_gnn(CONFIG), data.edge_index, data.num_nodes, parts)
    assert streamed <= predict_streamed_peak(data.num_nodes, part.max_chunk_edges, CONFIG, parts).total_bytes
