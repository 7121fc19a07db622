"""Chunk-streamed GNN training against PyG's full-graph layers under one memory budget (issue 19).

NGra (Ma et al., USENIX ATC'19, section 4) streams a graph too large for a device through it chunk
by chunk: ``P x P`` edge chunks, one chunk and one accumulator resident beside the vertex data.
This benchmark measures what that buys here, for GAT (4 heads) and GCN, 2 layers, feature width
64, hidden 64, 8 classes, on R-MAT graphs of growing size (``tasks.graphs.rmat_graph``, Graph500
parameters, symmetrised; default scales 12..19, edge factor 16), Adam (lr 0.01), cross-entropy
over the training mask, float32, ``torch.set_num_threads(1)`` in every measured process.

The full-graph reference is a stack of PyG's own layers (``torch_geometric.nn.GATConv`` /
``GCNConv``, ReLU between, the widths of ``engine.gnn.models.build_gnn``); the streamed model is
a copy of the same weights (``GATLayer.from_pyg`` / ``GCNLayer.from_pyg``) run by
``runtime.gnn.streaming.StreamedGNN`` on a ``GraphPartition`` with ``P`` from
``engine.gnn.partition.choose_partitions`` for the budget (the exact largest chunk counted on the
graph). Both are trained from the same weights, so their losses agree (``loss diff`` column).

Memory: the peak of ONE training step (forward, backward, Adam step), measured in a fresh
subprocess by ``runtime.gnn.memory.measure_peak`` (VmHWM over the baseline taken after the
graph, the model and the streamed run's partition are loaded and after a warm-up step on a small
graph, so that the process's one-time state is in the baseline). Never computed. The full-graph
series of a model stops after the first size that does not fit (larger graphs are not run: ``-``
with the reason in the table); the streamed series stops at the first size that does not fit or
for which ``choose_partitions`` finds no ``P`` (the resident vertex data alone exceeds the budget).

Targets:

1. capacity: a graph at least 10x larger (edges) than the largest the full-graph PyG step fits in
   the budget trains streamed within the budget (both measured, on the series);
2. throughput: on every graph both fit, the streamed epoch's edges/s at least 0.5x PyG's full-graph
   edges/s (``--epochs`` epochs, default 6, PyG and streamed interleaved in one process so that
   machine noise hits both alike; the median of epochs 3.., epochs 1 and 2 being the calibration
   epochs below);
3. prediction: ``engine.gnn.plan.make_gnn_plan`` for the graph, model and budget (on the executed
   partition, device type ``cpu``), calibrated on the chunk records and time of epoch 2, the first
   warm one (``GNNPlan.calibrated``; ``tessel launch`` calibrates a GNN plan the same way), within 20%
   of the median of the later epochs (3..); the uncalibrated prediction is shown too, and the
   prediction calibrated on epoch 1 instead (the first epoch on a graph pays one-time costs: page
   faults of its first allocations, about 1.6-2x a later epoch on the smallest graphs here, for PyG
   and streamed alike).

The default budget is 768 MiB (``--budget-mib``): at 512 MiB and at 1 GiB a full-graph step of the
series lands within 4% of the budget (measured here: GCN on ``rmat:15:16`` 510 MiB, GAT on
``rmat:15:16`` 987 MiB, GCN on ``rmat:16:16`` 1048 MiB), so whether it fits would be measurement
noise; at 768 MiB every full-graph step is at least 20% away from it.

Findings (one default run here: 2 shared CPU cores, torch 2.13, PyG 2.8, 6 min 49 s):

- capacity, NOT met: PyG's full-graph step fits up to ``rmat:14:16`` for GAT (477 MiB; 991 MiB on
  ``rmat:15:16``) and ``rmat:15:16`` for GCN (509 MiB; 1045 MiB on ``rmat:16:16``); the streamed step
  fits ``rmat:17:16`` for GAT (P = 256, 518 MiB) and ``rmat:18:16`` for GCN (P = 512, 740 MiB):
  8.7x and 8.6x the edges. Why: the streamed executor keeps 3,200 B (GAT) / 2,720 B (GCN) per
  vertex resident whatever P (``predict_streamed_peak``'s vertex data; the measured peaks stay
  3-15% under the predictions), against 1,173 / 604 B per edge of the full-graph step, so at the
  R-MAT average degree of about 28 it can hold at most about 10.4x (GAT) / 6.4x (GCN) the
  full-graph edges, and the doubling series rounds that to 8x; the next size does not fit on its
  vertex data alone (800 MiB GAT, 1360 MiB GCN predicted). 10x at degree 28 needs at most about
  3,300 B (GAT) / 1,700 B (GCN) per resident vertex. Large P is also slow: GAT on ``rmat:17:16``
  at P = 256 takes 60 s a step (the hub rows keep the largest RCM chunk at 2% of the edges).
- throughput, NOT met on one graph: 0.42x (GAT, ``rmat:13:16``, P = 1) to 0.70x (GCN, ``rmat:15:16``,
  P = 8); GAT at P = 1 measured 0.41-0.52x over three runs. Why (``torch.profiler``, ``rmat:13:16``):
  the streamed backward recomputes each chunk and back-propagates a scalar surrogate: GCN's step
  runs 16 ``index_select`` and 14 ``mul`` over ``[E, F]`` against PyG's 2 and 8 (267 ms against
  140 ms); GAT's scatter gathers the ``[E, 68]`` rows of ``[W x | a_src]`` and slices them, whose
  backward zero-fills and copies ``[E, 68]`` tensors (``fill_``, ``copy_``, ``add``: about 100 of 500
  ms). Patched in a scratch run (same losses): gathering the two column blocks separately takes
  GAT to 0.55-0.60x, and back-propagating ``(msg, logit)`` with ``grad_outputs`` instead of the
  surrogate to 0.74x; GCN with ``grad_outputs`` 0.56x -> 0.71x.
- prediction, NOT met on the smallest graph: calibrated on epoch 1, +4% to +13% on every graph
  whose epoch takes 0.27 s or more, but +49% (GAT) and +63% (GCN) on ``rmat:12:16`` (epochs of
  0.07-0.15 s): the first epoch on a graph pays 40-75 ms of one-time cost (page faults of its first
  allocations; PyG's first epoch doubles alike). Calibrated on epoch 2 instead: within 9.2%
  everywhere. Uncalibrated (the ``cpu`` cost table): 7-13x too fast.

Usage: ``python benchmarks/gnn_bench.py [--json] [--budget-mib 768] [--models gat,gcn]
[--scales 12-19] [--edge-factor 16] [--epochs 6] [--quick] [--timeout 1200]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

MODELS = ("gat", "gcn")
DEFAULT_BUDGET_MIB = 768
DEFAULT_SCALES = tuple(range(12, 20))
DEFAULT_EDGE_FACTOR = 16
DEFAULT_EPOCHS = 6
#: --quick: small graphs and budget, GAT only, so that the smoke test runs in well under a minute
QUICK = {"budget_mib": 16, "scales": (8, 11), "edge_factor": 8, "epochs": 3, "models": ("gat",)}
CAPACITY_TARGET = 10.0
THROUGHPUT_TARGET = 0.5
PREDICTION_TARGET = 0.2
LR = 0.01
#: the warm-up graph of every measured process (its first steps create one-time state)
WARM_SCALE, WARM_EDGE_FACTOR = 8, 4


@dataclass(frozen=True)
class Case:
    """One model on one graph: the GNN (``kind``, widths) and the R-MAT graph (``scale``, ``edge_factor``)."""

    kind: str
    scale: int
    edge_factor: int
    feature_dim: int = 64
    hidden: int = 64
    num_classes: int = 8
    heads: int = 4
    seed: int = 0

    @property
    def spec(self) -> str:
        return f"rmat:{self.scale}:{self.edge_factor}"

    def config(self) -> Any:
        """The ``GNNConfig`` (2 layers; GAT with ``heads`` heads, GCN with 1)."""
        from engine.gnn.models import GNNConfig

        return GNNConfig(self.kind, self.feature_dim, self.hidden, self.num_classes, layers=2,
                         heads=self.heads if self.kind == "gat" else 1)

    def graph(self, scale: int | None = None, edge_factor: int | None = None) -> Any:
        """The seeded R-MAT graph (``torch_geometric.data.Data``: ``x``, ``edge_index``, ``y``, masks)."""
        from tasks.graphs import rmat_graph

        return rmat_graph(self.scale if scale is None else scale,
                          self.edge_factor if edge_factor is None else edge_factor,
                          seed=self.seed, feature_dim=self.feature_dim, num_classes=self.num_classes)


class PyGNet(nn.Module):
    """The full-graph reference: PyG's ``GATConv`` / ``GCNConv`` stacked as ``build_gnn`` stacks our layers.

    GAT: ``GATConv(F, hidden / heads, heads)`` (heads concatenated), ReLU, ``GATConv(hidden, classes,
    heads, concat=False)`` (heads averaged); GCN: ``GCNConv(F, hidden)``, ReLU, ``GCNConv(hidden,
    classes)``. ``forward(x [N, F], edge_index [2, E]) -> [N, classes]``.
    """

    def __init__(self, config: Any):
        super().__init__()
        from torch_geometric.nn import GATConv, GCNConv

        (a, b), (c, d) = config.widths()
        self.config = config
        if config.kind == "gat":
            self.convs = nn.ModuleList([GATConv(a, b // config.heads, heads=config.heads),
                                        GATConv(c, d, heads=config.heads, concat=False)])
        elif config.kind == "gcn":
            self.convs = nn.ModuleList([GCNConv(a, b), GCNConv(c, d)])
        else:
            raise ValueError(f"PyGNet builds 'gat' or 'gcn', got {config.kind!r}.")

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = torch.relu(self.convs[0](x, edge_index))
        return self.convs[1](x, edge_index)


def saga_copy(ref: PyGNet) -> Any:
    """Our ``GNNModel`` with the reference's weights (``from_pyg`` of each conv)."""
    from engine.gnn.models import GNNModel
    from engine.gnn.saga import GATLayer, GCNLayer

    layer = GATLayer if ref.config.kind == "gat" else GCNLayer
    return GNNModel(ref.config, [layer.from_pyg(conv) for conv in ref.convs])


def _full_step(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor, mask: Tensor,
               edge_index: Tensor) -> float:
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x, edge_index)[mask], y[mask])
    loss.backward()
    opt.step()
    return float(loss.detach())


def _models(case: Case, parts: int, data: Any) -> tuple[nn.Module, Any, Any]:
    """``(model, partition or None, streamed executor or None)``: PyG's stack for ``parts == 0``."""
    from engine.gnn.partition import partition_for_model
    from runtime.gnn.streaming import StreamedGNN

    torch.manual_seed(case.seed)
    ref = PyGNet(case.config())
    if parts == 0:
        return ref, None, None
    ours = saga_copy(ref)
    part = partition_for_model(ours, data.edge_index, data.num_nodes, parts)
    return ours, part, StreamedGNN(ours, part)


def _warm_up(case: Case, parts: int) -> None:
    """Two training steps of the same kind (full graph, or streamed with ``min(parts, 4)`` intervals)
    on a small graph, so that the autograd engine, thread pools and kernel caches exist."""
    from runtime.gnn.streaming import train_step

    small = case.graph(WARM_SCALE, WARM_EDGE_FACTOR)
    model, _, streamed = _models(case, min(parts, 4), small)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for _ in range(2):
        if streamed is None:
            _full_step(model, opt, small.x, small.y, small.train_mask, small.edge_index)
        else:
            train_step(streamed, None, small.x, small.y, small.train_mask, opt)


def _setup_memory(case: Case, parts: int) -> tuple:
    """In the measuring child, before the baseline: one thread, the graph, the model (and partition), a warm-up."""
    torch.set_num_threads(1)
    data = case.graph()
    model, _, streamed = _models(case, parts, data)
    _warm_up(case, parts)
    return model, streamed, data.x, data.y, data.train_mask, data.edge_index


def _train_once(model: nn.Module, streamed: Any, x: Tensor, y: Tensor, mask: Tensor, edge_index: Tensor) -> None:
    """The measured function: one training step (a fresh Adam, as the first step of a training run)."""
    from runtime.gnn.streaming import train_step

    opt = torch.optim.Adam(model.parameters(), lr=LR)
    if streamed is None:
        _full_step(model, opt, x, y, mask, edge_index)
    else:
        train_step(streamed, None, x, y, mask, opt)


def measure_step_peak(case: Case, parts: int, timeout_s: float = 1200.0) -> Any:
    """``runtime.gnn.memory.PeakMemory`` of one training step in a fresh subprocess (``parts == 0``: PyG full graph)."""
    from runtime.gnn.memory import measure_peak

    return measure_peak(_train_once, case, parts, setup=_setup_memory, timeout_s=timeout_s)


def _timing_child(case: Case, parts: int, epochs: int, budget_bytes: int) -> dict:
    """In a fresh process (one thread): ``epochs`` interleaved PyG full-graph and streamed epochs from the
    same weights, and the plan's predictions: uncalibrated, calibrated on epoch 1 (the first on this
    graph) and on epoch 2. Returns plain numbers (seconds, losses)."""
    from engine.errors import GNNPlanError
    from engine.gnn.plan import make_gnn_plan
    from engine.gnn.plan_parts import GraphStats
    from runtime.gnn.streaming import train_step
    from tasks.graphs import graph_stats

    torch.set_num_threads(1)
    data = case.graph()
    ref, _, _ = _models(case, 0, data)
    ours, part, streamed = _models(case, parts, data)
    _warm_up(case, 0)
    _warm_up(case, parts)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=LR)
    opt_ours = torch.optim.Adam(ours.parameters(), lr=LR)
    full_s, full_loss, st_s, st_loss, records = [], [], [], [], []
    for epoch in range(epochs):
        start = time.perf_counter()
        full_loss.append(_full_step(ref, opt_ref, data.x, data.y, data.train_mask, data.edge_index))
        full_s.append(time.perf_counter() - start)
        res = train_step(streamed, None, data.x, data.y, data.train_mask, opt_ours)
        st_s.append(res.seconds)
        st_loss.append(res.loss)
        if epoch < 2:
            records.append(res.records)
    stats = GraphStats.of(graph_stats(data))
    out: dict[str, Any] = {"full_s": full_s, "streamed_s": st_s, "full_loss": full_loss, "streamed_loss": st_loss,
                           "plan_partitions": None, "predicted_s": None, "calibrated_s": None,
                           "calibrated_epoch1_s": None, "plan_error": None}
    try:
        planned = make_gnn_plan(case.config(), stats, 1, budget_bytes, device_type="cpu", edge_index=data.edge_index,
                                graph_spec=case.spec)
        out["plan_partitions"] = planned.partitions
        plan = make_gnn_plan(case.config(), stats, 1, budget_bytes, device_type="cpu", partition=part,
                             graph_spec=case.spec)
        out["predicted_s"] = plan.metrics["epoch_time"]
        # the target's calibration is on epoch 2, the first warm one (as tessel launch calibrates a GNN plan);
        # epoch 1's (first-touch page faults in it) is kept as a diagnostic
        out["calibrated_s"] = plan.calibrated(records[1], epoch_seconds=[st_s[1]]).metrics["epoch_time"]
        out["calibrated_epoch1_s"] = plan.calibrated(records[0], epoch_seconds=[st_s[0]]).metrics["epoch_time"]
    except GNNPlanError as e:
        out["plan_error"] = str(e)
    return out


def measure_epochs(case: Case, parts: int, epochs: int, budget_bytes: int, timeout_s: float = 1200.0) -> dict:
    """:func:`_timing_child` in a fresh ``spawn`` process (its result dict)."""
    ctx = mp.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(_timing_child, case, parts, epochs, budget_bytes).result(timeout=timeout_s)


# ------------------------------------------------------------------------------------------------ the series
def _mib(nbytes: float) -> float:
    return nbytes / 2**20


def memory_series(kind: str, scales: list[int], edge_factor: int, budget: int, timeout_s: float,
                  log: Any) -> list[dict]:
    """Per graph size: the measured full-graph and streamed step peaks (each series stops at its first miss)."""
    from engine.errors import PartitionError
    from engine.gnn.models import build_gnn
    from engine.gnn.partition import (
        MAX_PARTITIONS,
        choose_partitions,
        partition_for_model,
        predict_streamed_peak,
    )

    rows: list[dict] = []
    full_stop = streamed_stop = None
    for scale in scales:
        case = Case(kind, scale, edge_factor)
        data = case.graph()
        cfg = case.config()
        model = build_gnn(cfg)
        prepared = model.layers[0].prepare_edges(data.edge_index, data.num_nodes)
        row: dict[str, Any] = {"model": kind, "graph": case.spec, "num_nodes": data.num_nodes,
                               "num_edges": int(data.edge_index.shape[1]), "full_peak_bytes": None, "full_fits": None,
                               "full_seconds": None, "full_note": None, "partitions": None,
                               "predicted_peak_bytes": None, "predicted_vertex_bytes": None,
                               "streamed_peak_bytes": None, "streamed_fits": None, "streamed_seconds": None,
                               "streamed_note": None, "streamed_error": None}
        if full_stop is None:
            log(f"{kind} {case.spec}: full-graph step")
            pk = measure_step_peak(case, 0, timeout_s)
            row.update(full_peak_bytes=pk.peak_bytes, full_fits=pk.peak_bytes <= budget, full_seconds=pk.seconds)
            if not row["full_fits"]:
                full_stop = case.spec
        else:
            row["full_note"] = f"PyG full graph not run: the series stopped after {full_stop}, which did not fit"
        if streamed_stop is None:
            try:
                p = choose_partitions(data.num_nodes, int(prepared.shape[1]), cfg, budget, edge_index=prepared)
            except PartitionError as e:
                vertex = predict_streamed_peak(data.num_nodes, 0, cfg, 1).vertex_bytes
                row.update(predicted_vertex_bytes=vertex, streamed_error=str(e),
                           streamed_note=f"streamed not run: choose_partitions finds no P up to {MAX_PARTITIONS} "
                                         f"(the resident vertex data alone is predicted at {_mib(vertex):.0f} MiB)")
                streamed_stop = case.spec
            else:
                part = partition_for_model(model, data.edge_index, data.num_nodes, p)
                est = predict_streamed_peak(data.num_nodes, part.max_chunk_edges, cfg, p)
                del part
                log(f"{kind} {case.spec}: streamed step, P={p}")
                pk = measure_step_peak(case, p, timeout_s)
                row.update(partitions=p, predicted_peak_bytes=est.total_bytes, predicted_vertex_bytes=est.vertex_bytes,
                           streamed_peak_bytes=pk.peak_bytes, streamed_fits=pk.peak_bytes <= budget,
                           streamed_seconds=pk.seconds)
                if not row["streamed_fits"]:
                    streamed_stop = case.spec
        else:
            row["streamed_note"] = f"streamed not run: the series stopped after {streamed_stop}"
        rows.append(row)
        if full_stop is not None and streamed_stop is not None:
            break
    return rows


def capacity(rows: list[dict], budget: int) -> dict:
    """Target 1 for one model's rows: largest fitting graph (edges) full-graph and streamed, and their ratio."""
    full = [r for r in rows if r["full_fits"]]
    streamed = [r for r in rows if r["streamed_fits"]]
    full_limited = any(r["full_fits"] is False for r in rows)
    out: dict[str, Any] = {"model": rows[0]["model"] if rows else None, "largest_full": None,
                           "largest_full_edges": None, "largest_streamed": None, "largest_streamed_edges": None,
                           "ratio": None, "met": None, "note": None, "full_bytes_per_edge": None,
                           "streamed_vertex_bytes_per_vertex": None, "streamed_degree": None,
                           "vertex_bound_ratio": None}
    if full:
        out.update(largest_full=full[-1]["graph"], largest_full_edges=full[-1]["num_edges"])
    if streamed:
        out.update(largest_streamed=streamed[-1]["graph"], largest_streamed_edges=streamed[-1]["num_edges"])
    if not full_limited:
        out["note"] = "the full-graph step fits every graph of the series: extend --scales"
    elif not full:
        out["note"] = "the full-graph step fits no graph of the series: start --scales lower"
    elif not streamed:
        out["note"] = "no streamed run fits"
    else:
        out["ratio"] = out["largest_streamed_edges"] / out["largest_full_edges"]
        out["met"] = out["ratio"] >= CAPACITY_TARGET
        # why: the streamed peak's resident vertex data (predicted bytes per vertex) bounds N
        per_edge = full[-1]["full_peak_bytes"] / full[-1]["num_edges"]
        per_vertex = streamed[-1]["predicted_vertex_bytes"] / streamed[-1]["num_nodes"]
        degree = streamed[-1]["num_edges"] / streamed[-1]["num_nodes"]
        out.update(full_bytes_per_edge=per_edge, streamed_vertex_bytes_per_vertex=per_vertex,
                   streamed_degree=degree, vertex_bound_ratio=degree * per_edge / per_vertex)
        first_miss = next((r for r in rows if r["streamed_fits"] is not True), None)
        if first_miss is not None:
            why = first_miss["streamed_note"] or (f"measured {_mib(first_miss['streamed_peak_bytes']):.0f} MiB, over "
                                                  f"the budget")
            out["note"] = f"the streamed series stops at {first_miss['graph']} ({why})"
    return out


def throughput_row(row: dict, budget: int, epochs: int, timeout_s: float, log: Any) -> dict:
    """Targets 2 and 3 on one graph both fit: interleaved epochs, edges/s, predicted vs measured epoch time."""
    case = Case(row["model"], *map(int, row["graph"].split(":")[1:]))
    log(f"{case.kind} {case.spec}: {epochs} interleaved epochs, P={row['partitions']}")
    res = measure_epochs(case, row["partitions"], epochs, budget, timeout_s)
    later = slice(2, None)   # epochs 1 and 2 calibrate; 3.. are measured
    full_med = statistics.median(res["full_s"][later])
    st_med = statistics.median(res["streamed_s"][later])
    edges = row["num_edges"]
    out = {"model": case.kind, "graph": case.spec, "num_edges": edges, "partitions": row["partitions"],
           "plan_partitions": res["plan_partitions"], "epochs": epochs,
           "full_epoch_s": full_med, "streamed_epoch_s": st_med,
           "full_epochs_s": res["full_s"], "streamed_epochs_s": res["streamed_s"],
           "full_edges_per_s": edges / full_med, "streamed_edges_per_s": edges / st_med,
           "throughput_ratio": full_med / st_med, "throughput_met": full_med / st_med >= THROUGHPUT_TARGET,
           "max_loss_diff": max(abs(a - b) for a, b in zip(res["full_loss"], res["streamed_loss"])),
           "loss_first": res["full_loss"][0], "loss_last": res["full_loss"][-1],
           "predicted_s": res["predicted_s"], "calibrated_s": res["calibrated_s"],
           "calibrated_epoch1_s": res["calibrated_epoch1_s"], "measured_s": st_med,
           "prediction_error": None, "prediction_met": None, "prediction_error_epoch1": None,
           "plan_error": res["plan_error"]}
    if res["calibrated_s"] is not None:
        out["prediction_error"] = res["calibrated_s"] / st_med - 1.0
        out["prediction_met"] = abs(out["prediction_error"]) <= PREDICTION_TARGET
        out["prediction_error_epoch1"] = res["calibrated_epoch1_s"] / st_med - 1.0
    return out


def _verdict(values: list[Any]) -> bool | None:
    known = [v for v in values if v is not None]
    return None if not known else all(known)


def _met(flag: bool | None) -> str:
    return "n/a" if flag is None else ("met" if flag else "NOT met")


# ------------------------------------------------------------------------------------------------ CLI
def _scales(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-", 1)
        values = list(range(int(lo), int(hi) + 1))
    else:
        values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(not 1 <= v <= 30 for v in values) or values != sorted(set(values)):
        raise ValueError("give increasing scales in 1..30, as 12-18 or 12,14,16")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: GAT on rmat:8:8 and rmat:11:8, {QUICK['budget_mib']} MiB, 3 epochs "
                         "(the other flags, where given, still apply)")
    ap.add_argument("--budget-mib", type=float, default=None,
                    help=f"the memory budget of a training step's measured peak, MiB (default {DEFAULT_BUDGET_MIB})")
    ap.add_argument("--models", default=None, help="comma-separated of gat,gcn (default both)")
    ap.add_argument("--scales", default=None, help="R-MAT scales, as 12-19 or 12,14 (default 12-19)")
    ap.add_argument("--edge-factor", type=int, default=None, help=f"R-MAT edge factor (default {DEFAULT_EDGE_FACTOR})")
    ap.add_argument("--epochs", type=int, default=None,
                    help="epochs per throughput run: epochs 1 and 2 calibrate, the median of epochs 3.. is "
                         f"measured (default {DEFAULT_EPOCHS})")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds allowed per measured process")
    args = ap.parse_args(argv)
    quick = QUICK if args.quick else {}
    budget_mib = args.budget_mib if args.budget_mib is not None else quick.get("budget_mib", DEFAULT_BUDGET_MIB)
    if not budget_mib > 0:
        ap.error(f"--budget-mib must be positive, got {budget_mib}")
    try:
        scales = _scales(args.scales) if args.scales else list(quick.get("scales", DEFAULT_SCALES))
    except ValueError as e:
        ap.error(f"--scales {args.scales!r}: {e}")
    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else list(
        quick.get("models", MODELS))
    for m in models:
        if m not in MODELS:
            ap.error(f"--models {m!r}: not one of {', '.join(MODELS)}")
    edge_factor = args.edge_factor if args.edge_factor is not None else quick.get("edge_factor", DEFAULT_EDGE_FACTOR)
    epochs = args.epochs if args.epochs is not None else quick.get("epochs", DEFAULT_EPOCHS)
    if edge_factor < 1 or epochs < 3:
        ap.error("--edge-factor must be >= 1 and --epochs >= 3 (two calibrating epochs and at least one measured)")
    budget = int(budget_mib * 2**20)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s] {msg}", file=sys.stderr, flush=True)

    memory: list[dict] = []
    caps: list[dict] = []
    runs: list[dict] = []
    for kind in models:
        rows = memory_series(kind, scales, edge_factor, budget, args.timeout, log)
        memory += rows
        caps.append(capacity(rows, budget))
        for row in rows:
            if row["full_fits"] and row["streamed_fits"]:
                runs.append(throughput_row(row, budget, epochs, args.timeout, log))
    result = {
        "budget_bytes": budget, "edge_factor": edge_factor, "scales": scales, "models": models, "epochs": epochs,
        "threads": 1, "feature_dim": Case("gat", 1, 1).feature_dim, "hidden": Case("gat", 1, 1).hidden,
        "heads": Case("gat", 1, 1).heads, "num_classes": Case("gat", 1, 1).num_classes,
        "torch": torch.__version__, "memory": memory, "capacity": caps, "throughput": runs,
        "targets": {
            "capacity": {"target_ratio": CAPACITY_TARGET, "met": _verdict([c["met"] for c in caps])},
            "throughput": {"target_ratio": THROUGHPUT_TARGET, "met": _verdict([r["throughput_met"] for r in runs])},
            "prediction": {"target_error": PREDICTION_TARGET, "met": _verdict([r["prediction_met"] for r in runs])},
        },
        "wall_s": time.perf_counter() - t0,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    _print_table(result)
    return 0


def _print_table(res: dict) -> None:
    budget = res["budget_bytes"]
    print(f"budget {_mib(budget):.0f} MiB of measured step peak over the baseline; R-MAT edge factor "
          f"{res['edge_factor']}; F={res['feature_dim']}, hidden {res['hidden']}, {res['num_classes']} classes, "
          f"2 layers, GAT {res['heads']} heads; torch.set_num_threads(1) in every measured process")
    print()
    print(f"{'model':>5} {'graph':>11} {'vertices':>9} {'edges':>11} | {'PyG full MiB':>12} {'fits':>4} "
          f"{'step s':>7} | {'P':>4} {'pred MiB':>8} {'streamed MiB':>12} {'fits':>4} {'step s':>7}")
    notes: dict[tuple[str, str], list[str]] = {}
    for r in res["memory"]:
        def fit(v: bool | None) -> str:
            return "-" if v is None else ("yes" if v else "NO")
        full = "-" if r["full_peak_bytes"] is None else f"{_mib(r['full_peak_bytes']):.0f}"
        fs = "-" if r["full_seconds"] is None else f"{r['full_seconds']:.2f}"
        st = "-" if r["streamed_peak_bytes"] is None else f"{_mib(r['streamed_peak_bytes']):.0f}"
        pred = "-" if r["predicted_peak_bytes"] is None else f"{_mib(r['predicted_peak_bytes']):.0f}"
        ss = "-" if r["streamed_seconds"] is None else f"{r['streamed_seconds']:.2f}"
        p = "-" if r["partitions"] is None else str(r["partitions"])
        print(f"{r['model']:>5} {r['graph']:>11} {r['num_nodes']:>9,} {r['num_edges']:>11,} | {full:>12} "
              f"{fit(r['full_fits']):>4} {fs:>7} | {p:>4} {pred:>8} {st:>12} {fit(r['streamed_fits']):>4} {ss:>7}")
        for key in ("full_note", "streamed_note"):
            if r[key]:
                notes.setdefault((r["model"], r[key]), []).append(r["graph"])
    for (model, note), graphs in notes.items():
        print(f"  {model} {', '.join(graphs)}: {note}")
    print("(edges: directed edges of the graph, each undirected edge twice, before self-loops; P from "
          "choose_partitions; pred: predict_streamed_peak)")
    print()
    for c in res["capacity"]:
        if c["ratio"] is None:
            print(f"capacity, {c['model']}: n/a ({c['note']})")
            continue
        print(f"capacity, {c['model']}: largest full-graph fit {c['largest_full']} "
              f"({c['largest_full_edges']:,} edges), "
              f"largest streamed fit {c['largest_streamed']} ({c['largest_streamed_edges']:,} edges) = "
              f"{c['ratio']:.1f}x (target >= {CAPACITY_TARGET:.0f}x): {_met(c['met'])}"
              + (f"; {c['note']}" if c["note"] else ""))
        full_cap = budget / c["full_bytes_per_edge"]
        streamed_cap = budget / c["streamed_vertex_bytes_per_vertex"] * c["streamed_degree"]
        print(f"  why: the full-graph step takes {c['full_bytes_per_edge']:,.0f} B per edge (measured on "
              f"{c['largest_full']}), so it holds about {full_cap:,.0f} edges; the streamed run keeps "
              f"{c['streamed_vertex_bytes_per_vertex']:,.0f} B per vertex resident whatever P (predicted vertex data), "
              f"so it holds at most about {streamed_cap:,.0f} edges at the average degree {c['streamed_degree']:.1f} "
              f"of {c['largest_streamed']} (less the chunks' room): about {c['vertex_bound_ratio']:.1f}x, which the "
              "series' doubling sizes round to a power of two")
    print()
    print(f"{'model':>5} {'graph':>11} {'P':>3} {'plan P':>6} | {'PyG s':>7} {'streamed s':>10} {'PyG edges/s':>12} "
          f"{'str. edges/s':>12} {'ratio':>6} {'>=0.5':>7} | {'plan s':>7} {'cal. s':>7} {'meas. s':>7} "
          f"{'error':>7} {'<=20%':>7} | {'cal.e1 s':>8} {'err. e1':>7} | {'loss diff':>9}")
    for r in res["throughput"]:
        def sec(v: float | None) -> str:
            return "-" if v is None else f"{v:.3f}"

        def pct(v: float | None) -> str:
            return "-" if v is None else f"{v:+.1%}"
        plan = "-" if r["plan_partitions"] is None else str(r["plan_partitions"])
        print(f"{r['model']:>5} {r['graph']:>11} {r['partitions']:>3} {plan:>6} | {r['full_epoch_s']:>7.3f} "
              f"{r['streamed_epoch_s']:>10.3f} {r['full_edges_per_s']:>12,.0f} {r['streamed_edges_per_s']:>12,.0f} "
              f"{r['throughput_ratio']:>6.2f} {_met(r['throughput_met']):>7} | {sec(r['predicted_s']):>7} "
              f"{sec(r['calibrated_s']):>7} {r['measured_s']:>7.3f} {pct(r['prediction_error']):>7} "
              f"{_met(r['prediction_met']):>7} | {sec(r['calibrated_epoch1_s']):>8} "
              f"{pct(r['prediction_error_epoch1']):>7} | {r['max_loss_diff']:>9.1e}")
        if r["plan_error"]:
            print(f"  {r['model']} {r['graph']}: no plan: {r['plan_error']}")
    print(f"(graphs both fit; {res['epochs']} epochs, PyG and streamed interleaved in one process from the same "
          "weights; epoch times (PyG s, streamed s, meas. s): median of epochs 3.., epochs 1 and 2 calibrate; ratio: "
          "streamed / PyG edges per second; plan s: make_gnn_plan on the executed partition (device type cpu), "
          "uncalibrated; cal. s: calibrated on epoch 2's records and time (the first warm epoch; the target); error: "
          "cal. / measured - 1; cal.e1 s, err. e1: the same calibrated on epoch 1 instead (first-touch costs in it); "
          "plan P: the planner's own "
          "choice of P for the budget; loss diff: largest |PyG loss - streamed loss| over the epochs)")
    print()
    t = res["targets"]
    print(f"targets: capacity >= {CAPACITY_TARGET:.0f}x: {_met(t['capacity']['met'])}; throughput >= "
          f"{THROUGHPUT_TARGET}x PyG on every graph both fit: {_met(t['throughput']['met'])}; calibrated prediction "
          f"within {PREDICTION_TARGET:.0%}: {_met(t['prediction']['met'])}   ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
