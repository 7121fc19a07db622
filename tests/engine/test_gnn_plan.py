"""GNN plans (engine.gnn.plan, engine.gnn.cost, engine.gnn.simulate; NGra, ATC'19, section 4).

References: the layers' own shapes and parameter counts (``build_gnn``), a brute-force
contiguous split for the interval balance, the plan's own chunk list for the simulated timeline,
and a cost model with known coefficients whose simulated records the calibration must recover.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import random
import re

import pytest
import torch

from engine.errors import GNNPlanError, PlanFormatError
from engine.gnn.cost import GNNCostModel, layer_shapes, param_count
from engine.gnn.models import GNN_KINDS, GNNConfig, build_gnn
from engine.gnn.plan import GNNPlan, balance_intervals, expected_chunks, load_gnn_plan, make_gnn_plan, save_gnn_plan
from engine.gnn.plan_parts import GraphStats
from engine.gnn.simulate import memory_bound, simulate_gnn, static_bytes

BIG = GraphStats(num_vertices=1 << 20, num_edges=16 << 20, feature_dim=128, num_classes=16)
SMALL = GraphStats(num_vertices=300, num_edges=4000, feature_dim=12, num_classes=3)
GiB = 2**30


def config(kind: str, stats: GraphStats = SMALL, hidden: int = 16, layers: int = 2) -> GNNConfig:
    return GNNConfig(kind, stats.feature_dim, hidden, stats.num_classes, layers, 4 if kind == "gat" else 1)


class SkewedPartition:
    """A stand-in with GraphPartition's counting interface: heavy diagonal chunks, empty far-off ones."""

    def __init__(self, p: int, n: int, seed: int = 0):
        rng = random.Random(seed)
        self.num_parts = p
        self._sizes = [n // p + (1 if k < n % p else 0) for k in range(p)]
        self._counts = [[(rng.randint(200, 900) if i == j else rng.randint(0, 120) if abs(i - j) == 1 else 0)
                         for j in range(p)] for i in range(p)]

    def interval_size(self, k: int) -> int:
        return self._sizes[k]

    def chunk_edges(self) -> torch.Tensor:
        return torch.tensor(self._counts)


# ---------------------------------------------------------------------------------------------- cost model
@pytest.mark.parametrize("kind", GNN_KINDS)
def test_layer_shapes_match_the_built_layers(kind):
    for layers in (1, 3):
        cfg = GNNConfig(kind, 13, 24, 5, layers, 4 if kind == "gat" else 1)
        torch.manual_seed(0)
        model = build_gnn(cfg)
        shapes = layer_shapes(cfg)
        assert param_count(shapes) == sum(p.numel() for p in model.parameters())
        x = torch.randn(7, 13)
        for shape, layer in zip(shapes, model.layers):
            assert (shape.in_dim, shape.out_dim) == (layer.in_dim, layer.out_dim)
            assert shape.width == math.prod(layer.message_shape)
            assert shape.vertex_width == layer.apply_vertex_pre(x).shape[1]
            assert shape.has_pre == (layer.apply_vertex_pre(x) is not x)      # the default stage is the identity
            assert shape.self_loops == layer.self_loops
            x = torch.randn(7, layer.out_dim)


def test_cost_model_times_grow_with_the_work_and_know_the_cpu():
    cpu = GNNCostModel.for_device("cpu")
    h100 = GNNCostModel.for_device("h100")
    layer = layer_shapes(config("gcn"))[0]
    for cost in (cpu, h100):
        assert 0 < cost.chunk_compute_time(layer, 100, "F") < cost.chunk_compute_time(layer, 1000, "F")
        assert cost.chunk_compute_time(layer, 1000, "F") < cost.chunk_compute_time(layer, 1000, "B")
        assert cost.chunk_compute_time(layer, 0, "F") == 0.0
        assert cost.load_time(*cost.chunk_load(layer, 1000, 50, 50, "F")) > 0
        assert cost.collective_time("allgather", 1 << 20, 1) == 0.0 < cost.collective_time("allgather", 1 << 20, 2)
    # the CPU's FLOP rate and bandwidth are far below an H100's
    assert cpu.chunk_compute_time(layer, 10**6, "F") > 10 * h100.chunk_compute_time(layer, 10**6, "F")
    assert cpu.host_bandwidth == cpu.base.device.mem_bandwidth * cpu.base.device.bw_efficiency


# ---------------------------------------------------------------------------------------------- building
def test_expected_chunks_hold_every_vertex_and_edge():
    for kind, loops in (("gcn", SMALL.num_vertices), ("sage", 0)):
        for p in (1, 3, 8):
            intervals, chunks = expected_chunks(SMALL, p, layer_shapes(config(kind))[0].self_loops)
            assert sum(intervals) == SMALL.num_vertices and max(intervals) - min(intervals) <= 1
            assert sum(map(sum, chunks)) == SMALL.num_edges + loops
    with pytest.raises(GNNPlanError, match="between 1 and the 300 vertices"):
        expected_chunks(SMALL, 301, False)


def test_balance_intervals_is_the_best_contiguous_split():
    rng = random.Random(1)
    for _ in range(30):
        p = rng.randint(1, 9)
        d = rng.randint(1, p)
        w = [rng.randint(0, 50) for _ in range(p)]
        got = balance_intervals(w, d)
        assert got == sorted(got) and set(got) == set(range(d))
        load = max(sum(w[j] for j in range(p) if got[j] == k) for k in range(d))
        best = min(max(sum(w[a:b]) for a, b in zip((0, *cuts), (*cuts, p)))
                   for cuts in itertools.combinations(range(1, p), d - 1))
        assert load == best
    with pytest.raises(GNNPlanError, match="at least as many intervals"):
        balance_intervals([1, 2], 3)


def test_schedule_forward_by_destination_backward_by_source():
    plan = make_gnn_plan(config("gat"), SMALL, devices=2, P=4, device_type="cpu")
    assert plan.assignment == [0, 0, 1, 1]
    for dev, passes in enumerate(plan.schedule):
        assert [(p.layer, p.phase) for p in passes] == [(0, "F"), (1, "F"), (1, "B"), (0, "B")]
        fwd = [(s.i, s.j) for s in passes[0].steps if s.kind == "chunk"]
        bwd = [(s.i, s.j) for s in passes[3].steps if s.kind == "chunk"]
        assert fwd == sorted(fwd, key=lambda c: (c[1], c[0]))       # destination-major
        assert bwd == sorted(bwd)                                   # source-major
        assert {j for _, j in fwd} == set(plan.device_intervals(dev))
        kinds = [s.kind for s in passes[0].steps]
        # GAT has apply_vertex_pre: pre of the own intervals, the all-gather, then chunks and applies
        assert kinds[:3] == ["pre", "pre", "allgather"]
        assert [s.kind for s in passes[-1].steps][-2:] == ["allreduce", "optim"]


# ---------------------------------------------------------------------------------------------- P and budget
def test_P_is_the_smallest_power_of_two_that_fits():
    cfg = config("gcn", BIG, hidden=64)
    bounds = {p: max(memory_bound(make_gnn_plan(cfg, BIG, 1, 10**15, P=p))) for p in (1, 2, 4, 8, 16)}
    assert all(bounds[p] > bounds[2 * p] for p in (1, 2, 4, 8))      # chunk buffers shrink with P
    for p in (2, 4, 8):
        plan = make_gnn_plan(cfg, BIG, 1, bounds[p])
        assert plan.partitions == p and max(plan.metrics["memory_bound"]) <= bounds[p]
        assert make_gnn_plan(cfg, BIG, 1, bounds[p] - 1).partitions == 2 * p
    # several devices start at the first power of two with an interval per device
    assert make_gnn_plan(cfg, BIG, 3, 10**15).partitions == 4


def test_too_small_budget_is_one_sentence():
    cfg = config("sage", BIG, hidden=64)
    plan = make_gnn_plan(cfg, BIG, 1, 10**15)
    with pytest.raises(GNNPlanError) as err:
        make_gnn_plan(cfg, BIG, 1, static_bytes(plan))
    msg = str(err.value)
    assert "too small" in msg and msg.endswith(".") and ". " not in msg
    with pytest.raises(GNNPlanError, match=r"with P=1 the predicted peak .* over the .* budget"):
        make_gnn_plan(cfg, BIG, 1, bounds_at(cfg, 2), P=1)
    with pytest.raises(GNNPlanError, match="between the 4 devices"):
        make_gnn_plan(cfg, BIG, 4, 10**15, P=2)
    with pytest.raises(GNNPlanError, match="graph has 128 features"):
        make_gnn_plan(GNNConfig("gcn", 7, 8, 16), BIG, 1, 10**15)


def bounds_at(cfg, p):
    return max(memory_bound(make_gnn_plan(cfg, BIG, 1, 10**15, P=p)))


# ---------------------------------------------------------------------------------------------- simulation
NAME = re.compile(r"L(\d+)([FB]) (chunk|load) (\d+),(\d+)$")


def _plans():
    yield make_gnn_plan(config("gcn"), SMALL, 1, 10**12, P=4, device_type="cpu")
    yield make_gnn_plan(config("gat", layers=3), SMALL, 3, 10**12, P=8, device_type="h100")
    yield make_gnn_plan(config("gin"), SMALL, 2, 10**12, device_type="a100", partition=SkewedPartition(6, 300))
    cfg = config("gated-gcn", BIG, hidden=64)
    tight = max(memory_bound(make_gnn_plan(cfg, BIG, 2, 10**15, P=8)))
    yield make_gnn_plan(cfg, BIG, 2, tight)            # budget exactly the chosen P's bound


@pytest.mark.parametrize("plan", list(_plans()), ids=["gcn-1", "gat-3", "gin-skewed", "gated-tight"])
def test_simulated_timeline_streams_every_chunk_once(plan: GNNPlan):
    tl = simulate_gnn(plan).timeline
    layers = len(plan.layers)
    computes: dict[tuple, object] = {}
    loads: dict[tuple, object] = {}
    for e in tl.events:
        m = NAME.match(e.name)
        if not m:
            continue
        key = (e.rank, int(m[1]), m[2], int(m[4]), int(m[5]))
        table = computes if m[3] == "chunk" else loads
        assert key not in table, f"{e.name} twice on device {e.rank}"
        table[key] = e
        assert e.stream == ("compute" if m[3] == "chunk" else "load")
    want = {(plan.assignment[j], layer, ph, i, j) for layer in range(layers) for ph in "FB" for i, j in plan.chunks()}
    assert set(computes) == want == set(loads)
    for key, c in computes.items():
        assert loads[key].end <= c.start + 1e-15                       # a chunk computes after its load
    for dev in range(plan.num_devices):
        comp = sorted((e for e in tl.events if e.rank == dev and e.stream == "compute"), key=lambda e: e.start)
        assert all(a.end <= b.start + 1e-15 for a, b in zip(comp, comp[1:]))   # one compute at a time
        lds = sorted((e for e in tl.events if e.rank == dev and e.stream == "load"), key=lambda e: e.start)
        assert all(a.end <= b.start + 1e-15 for a, b in zip(lds, lds[1:]))
        # double buffering: when a load starts, at most two chunks (it included) hold a buffer
        for ld in lds:
            holding = [k for k, c in computes.items() if k[0] == dev and loads[k].start <= ld.start < c.end]
            assert len(holding) <= 2, (ld.name, holding)
    # memory: never over the budget nor the bound P was chosen by; back to the static bytes at the end
    assert tl.memory and len(tl.memory) == plan.num_devices
    for dev, curve in enumerate(tl.memory):
        assert max(v for _, v in curve) <= plan.budget_bytes
        assert max(v for _, v in curve) <= memory_bound(plan)[dev]
        assert curve[-1][1] == static_bytes(plan)
    # collectives: with several devices every device runs each at the same time
    coll = [e for e in tl.events if e.stream == "collective"]
    assert bool(coll) == (plan.num_devices > 1)
    for name in {e.name for e in coll}:
        same = [e for e in coll if e.name == name]
        assert len(same) == plan.num_devices and len({(e.start, e.end) for e in same}) == 1


def test_over_budget_plan_is_refused_by_the_simulation():
    plan = make_gnn_plan(config("gcn"), SMALL, 1, 10**12, P=2, device_type="cpu")
    plan.budget_bytes = max(plan.metrics["peak_memory"]) - 1
    with pytest.raises(GNNPlanError, match="device 0 needs .* over the .* budget"):
        simulate_gnn(plan)
    assert simulate_gnn(plan, check_memory=False).over_budget()[0] == 0


def test_more_devices_give_a_shorter_epoch():
    cfg = config("gcn", BIG, hidden=64)
    times = [make_gnn_plan(cfg, BIG, d, 16 * GiB, P=8).metrics["epoch_time"] for d in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True) and len(set(times)) == 4
    assert times[1] < 0.75 * times[0]


# ---------------------------------------------------------------------------------------------- calibration
def _records(sim):
    """The simulated timeline as the executor's records (layer, phase, i, j, kind, start, end, bytes)."""
    out = []
    for e in sim.timeline.events:
        layer, ph = (int(e.name[1]), e.name[2]) if e.name.startswith("L") else (-1, "")
        words = e.name.split()
        if e.op == "LOAD" or words[1:2] == ["chunk"]:
            i, j = map(int, words[2].split(","))
            out.append((layer, ph, i, j, "load" if e.op == "LOAD" else "compute", e.start, e.end, e.nbytes))
        elif words[1:2] in (["apply"], ["pre"]) and ph == "F":
            out.append((layer, ph, -1 if words[1] == "apply" else -2, int(words[2]), "compute", e.start, e.end, 0))
    return out


def test_calibration_recovers_the_coefficients_that_made_the_records():
    plan = make_gnn_plan(config("gat"), SMALL, 1, 10**12, device_type="cpu", partition=SkewedPartition(6, 300))
    truth = copy.deepcopy(plan.cost)
    c = truth.coefficients
    c.update(edge_scale_F=4.0, edge_scale_B=7.0, chunk_overhead_F=2e-4, chunk_overhead_B=5e-4, vertex_scale_F=30.0,
             vertex_overhead_F=1e-4, load_scale_index=6.0, load_scale_rows=0.5, load_overhead=3e-5)
    c.update(vertex_scale_B=c["vertex_scale_F"], vertex_overhead_B=c["vertex_overhead_F"])
    measured = simulate_gnn(plan, truth)
    cal = plan.calibrated(_records(measured))
    for k, v in c.items():
        assert cal.cost.coefficients[k] == pytest.approx(v, rel=1e-3, abs=1e-9), k
    assert cal.metrics["epoch_time"] == pytest.approx(measured.epoch_time, rel=1e-6)
    assert plan.metrics["epoch_time"] < 0.5 * measured.epoch_time       # before: far off
    assert cal.cost.calibrated_from == len(_records(measured))
    # measured epochs longer than their records explain: the excess becomes a per-epoch overhead
    t = measured.epoch_time
    cal2 = plan.calibrated(_records(measured), epoch_seconds=[t + 0.02, t + 0.01, t + 0.5])
    assert cal2.cost.coefficients["epoch_overhead"] == pytest.approx(0.02)
    assert cal2.metrics["epoch_time"] == pytest.approx(t + 0.02)
    extra = [e for e in simulate_gnn(cal2).timeline.events if e.name == "epoch overhead"]
    assert len(extra) == 1 and extra[0].duration == pytest.approx(0.02)
    assert plan.calibrated(_records(measured), epoch_seconds=[t / 2]).cost.coefficients["epoch_overhead"] == 0.0
    with pytest.raises(Exception, match="no measured chunk records"):
        plan.cost.calibrate([], plan.layers, plan.chunk_edges, plan.intervals)
    with pytest.raises(Exception, match="names layer 5"):
        plan.cost.calibrate([(5, "F", 0, 0, "compute", 0.0, 1.0, 0)], plan.layers, plan.chunk_edges, plan.intervals)


# ---------------------------------------------------------------------------------------------- JSON
def test_json_round_trip(tmp_path):
    plan = make_gnn_plan(config("gat"), SMALL, 2, 10**9, device_type="cpu", partition=SkewedPartition(4, 300),
                         graph_spec="small", epochs=7, lr=0.05, seed=3)
    path = save_gnn_plan(plan, tmp_path / "gnn_plan.json")
    back = load_gnn_plan(path)
    assert back == plan
    assert back.to_dict() == json.loads(path.read_text())
    d = json.loads(path.read_text())
    assert (d["format"], d["version"]) == ("tessel-gnn-plan", 1)
    assert simulate_gnn(back).epoch_time == plan.metrics["epoch_time"]


def _broken(plan, edit):
    d = plan.to_dict()
    edit(d)
    return d


@pytest.mark.parametrize("edit,path", [
    (lambda d: d.pop("partitions"), "partitions is missing"),
    (lambda d: d.__setitem__("format", "tessel-plan"), "format is 'tessel-plan'"),
    (lambda d: d.__setitem__("version", 2), "version is 2"),
    (lambda d: d["chunk_edges"][0].__setitem__(1, -1), r"chunk_edges\[0\]\[1\] should be a non-negative int"),
    (lambda d: d["chunk_edges"].pop(), "chunk_edges should have 4 rows"),
    (lambda d: d["intervals"].__setitem__(0, 1), "intervals sum to"),
    (lambda d: d["assignment"].__setitem__(3, 7), r"assignment\[3\] is device 7"),
    (lambda d: d["schedule"][1][0]["steps"].__setitem__(2, ["chunk", 9, 0]), r"schedule\[1\]\[0\]\.steps\[2\]"),
    (lambda d: d["schedule"][1][0]["steps"].__setitem__(0, ["load", 0, 0]),
     r"schedule\[1\]\[0\]\.steps\[0\] should be"),
    (lambda d: d["schedule"][0][2]["steps"].pop(3), r"schedule\[0\]\[2\]\.steps should have each non-empty chunk"),
    (lambda d: d["schedule"][0][2]["steps"].pop(-1), r"schedule\[0\]\[2\]\.steps should have one 'pre' step"),
    (lambda d: d["schedule"][0][1].__setitem__("phase", "X"), r"schedule\[0\]\[1\]\.phase is 'X'"),
    (lambda d: d["model"].__setitem__("kind", "mlp"), "model: Unknown GNN kind 'mlp'"),
    (lambda d: d["model"].__setitem__("width", 3), "model.width is not a GNNConfig field"),
    (lambda d: d["cost"]["coefficients"].__setitem__("load_overhead", "x"),
     "cost.coefficients.load_overhead should be int/float"),
    (lambda d: d["cost"]["base"]["device"].pop("mem_bandwidth"), "cost.base"),
    (lambda d: d["graph"].__setitem__("num_vertices", 0), "graph"),
])
def test_loading_errors_name_the_field(tmp_path, edit, path):
    plan = make_gnn_plan(config("gcn"), SMALL, 2, 10**9, P=4, device_type="cpu")
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(_broken(plan, edit)))
    with pytest.raises(PlanFormatError, match=path) as err:
        load_gnn_plan(f)
    assert str(err.value).startswith(str(f))


# ---------------------------------------------------------------------------------------------- with the real graph
def test_exact_partitions_count_what_graph_partition_counts():
    from engine.gnn.partition import GraphPartition
    from tasks.graphs import graph_stats, rmat_graph

    g = rmat_graph(10, 8, seed=0)
    stats = GraphStats.of(graph_stats(g))
    cfg = GNNConfig("gcn", stats.feature_dim, 32, stats.num_classes)
    budget = max(memory_bound(make_gnn_plan(cfg, stats, 2, 10**12, 8, "cpu", edge_index=g.edge_index)))
    plan = make_gnn_plan(cfg, stats, 2, budget, device_type="cpu", edge_index=g.edge_index)
    assert plan.partitions == 8
    model = build_gnn(cfg)
    ref = GraphPartition.build(model.layers[0].prepare_edges(g.edge_index, g.num_nodes), g.num_nodes,
                               plan.partitions, "rcm")
    assert plan.chunk_source == "partition"
    assert plan.chunk_edges == ref.chunk_edges().tolist()
    assert plan.intervals == [ref.interval_size(k) for k in range(plan.partitions)]
    assert max(plan.metrics["peak_memory"]) <= budget
    half = make_gnn_plan(cfg, stats, 2, 10**12, 4, "cpu", edge_index=g.edge_index)
    assert max(memory_bound(half)) > budget          # the smallest power of two: P = 4 would not fit
    # the expected sizes know no locality: the renumbered power-law graph's diagonal chunks are far heavier
    expected = make_gnn_plan(cfg, stats, 2, 10**12, plan.partitions, "cpu")
    assert max(map(max, plan.chunk_edges)) > 2 * max(map(max, expected.chunk_edges))


def test_load_bytes_are_what_the_streamed_executor_loads():
    from engine.gnn.partition import partition_for_model
    from runtime.gnn.streaming import StreamedGNN, train_step
    from tasks.graphs import graph_stats, rmat_graph

    g = rmat_graph(7, 4, seed=0)
    stats = GraphStats.of(graph_stats(g))
    for kind in GNN_KINDS:
        cfg = config(kind, stats)
        torch.manual_seed(0)
        model = build_gnn(cfg)
        part = partition_for_model(model, g.edge_index, g.num_nodes, 4)
        plan = make_gnn_plan(cfg, stats, 1, 10**12, device_type="cpu", partition=part)
        res = train_step(StreamedGNN(model, part), None, g.x, g.y, g.train_mask,
                         torch.optim.SGD(model.parameters(), lr=0.1))
        loads = [r for r in res.records if r.kind == "load"]
        assert len(loads) == 2 * len(plan.layers) * len(plan.chunks())      # each chunk, layer and phase once
        for r in loads:
            assert r.bytes == plan.cost.chunk_load_bytes(plan.layers[r.layer], plan.chunk_edges[r.i][r.j],
                                                         plan.intervals[r.i], plan.intervals[r.j], r.phase), r
        # the executor's records calibrate the plan (timings differ run to run: no time is asserted)
        cal = plan.calibrated(res.records)
        assert cal.cost.calibrated_from > 0 and cal.metrics["epoch_time"] > 0
