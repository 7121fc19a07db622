"""GNN plans: chunk-streamed training of a GNN on a graph, as versioned JSON ``tessel-gnn-plan`` v1.

A :class:`GNNPlan` says how one epoch of full-graph training of a
:class:`~engine.gnn.models.GNNConfig` runs on ``num_devices`` devices with a memory budget, after
NGra (Ma et al., "NeuGraph: Parallel Deep Neural Network Computation on Large Graphs", USENIX
ATC 2019, section 4):

* the vertices are cut into ``P`` intervals and the edges into ``P x P`` chunks, chunk ``(i, j)``
  holding the edges from interval ``i`` to interval ``j`` (:mod:`engine.gnn.partition`; from the
  graph's statistics alone the chunk sizes are their expectation, see :func:`expected_chunks`);
* the destination intervals are spread over the devices, contiguous and balanced by edges
  (:func:`balance_intervals`);
* each device runs, per layer, a forward pass by destination interval (for each of its intervals
  ``j``: chunks ``(0..P-1, j)`` folded into ``j``'s accumulator, then ``apply_vertex`` on ``j``)
  and, in reverse layer order, a backward pass by source interval (for each ``i``: chunks
  ``(i, j)`` of its intervals ``j``, recomputed and back-propagated). Each chunk is loaded
  (host to device) before it computes, the next chunk's load overlapping the current compute;
* with several devices each layer all-gathers the vertex data its chunks read and
  reduce-scatters the source gradients back; the parameter gradients are all-reduced before the
  optimizer step;
* ``P`` is the smallest power of two (at least ``num_devices``) whose predicted peak memory
  (:func:`engine.gnn.simulate.memory_bound`) fits the budget.

Its parts (:class:`~engine.gnn.plan_parts.GraphStats`, :class:`~engine.gnn.plan_parts.Step`,
:class:`~engine.gnn.plan_parts.Pass`) are in :mod:`engine.gnn.plan_parts`. The plan is simulated by
:mod:`engine.gnn.simulate`; its times and memory come from :class:`~engine.gnn.cost.GNNCostModel`.
Files are written atomically; loading errors are :class:`~engine.errors.PlanFormatError` naming the
field path. Units: seconds and bytes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from engine import __version__
from engine.envelope import Envelope, FieldReader
from engine.errors import CostModelError, GNNPlanError, PartitionError, PlanFormatError
from engine.gnn.cost import GNNCostModel, LayerShape, layer_shapes
from engine.gnn.plan_parts import COLLECTIVE_STEPS, STEP_KINDS, GraphStats, Pass, Step
from engine.gnn.simulate import memory_bound, simulate_gnn
from engine.io.atomic import atomic_write_text

log = logging.getLogger(__name__)

GNN_PLAN_FORMAT = "tessel-gnn-plan"
GNN_PLAN_VERSION = 1
#: The GNN plan's envelope (``path``-style messages: ``"plan.json: schedule[0][1].steps[3] ..."``).
GNN_PLAN_ENVELOPE = Envelope(
    GNN_PLAN_FORMAT, GNN_PLAN_VERSION, PlanFormatError, what="a GNN plan",
    format_hint="; is this a `tessel plan --gnn` file?",
    version_hint="; re-create the plan with this version of `tessel plan --gnn`",
)
#: The largest ``P`` the planner tries (the schedule lists ``P**2`` chunks per layer and pass).
MAX_PARTITIONS = 256


# ---------------------------------------------------------------------------------------------- the plan
@dataclass
class GNNPlan:
    """A chunk-streamed GNN training plan (see the module docstring).

    Attributes:
        model: the model (:class:`~engine.gnn.models.GNNConfig`: ``kind``, ``in_dim``,
            ``hidden``, ``out_dim``, ``layers``, ``heads``).
        graph: the graph's statistics (:class:`GraphStats`).
        graph_spec: how the graph is named (``"karate"``, ``"cpython"``, ``"rmat:20:16"``), or
            ``""`` when the plan was made from statistics only.
        partitions: ``P``, the number of vertex intervals (``P x P`` edge chunks).
        num_devices: devices the destination intervals are spread over.
        device_type: the cost table's device (``h100``, ``a100``, ``cpu``).
        intervals: vertices per interval (``P`` entries, summing to N).
        chunk_edges: ``chunk_edges[i][j]``: edges from interval ``i`` to interval ``j`` (as the
            layers see them: with the self-loops of GCN/GAT).
        chunk_source: ``"partition"`` (counted on a :class:`~engine.gnn.partition.GraphPartition`)
            or ``"expected"`` (from the statistics, :func:`expected_chunks`).
        assignment: ``assignment[j]``: the device that owns destination interval ``j``
            (contiguous, balanced by edges).
        budget_bytes: the memory budget per device, bytes.
        schedule: per device, its passes in order: the forward of layers 0..L-1, then the
            backward of layers L-1..0 (:class:`Pass`, :class:`Step`).
        cost: the cost model (:class:`~engine.gnn.cost.GNNCostModel`).
        epochs: training epochs (one full-graph step each).
        lr: the optimizer's learning rate (Adam).
        seed: seed of the parameter initialisation and the training masks.
        metrics: the prediction of :func:`engine.gnn.simulate.simulate_gnn`: ``epoch_time`` (s),
            ``peak_memory`` (bytes per device), ``memory_bound`` (bytes per device, the bound P was
            chosen by), ``compute_time``/``load_time``/``collective_time`` (busy seconds per device).
        meta: free-form facts (tool version, command line).
    """

    model: Any
    graph: GraphStats
    graph_spec: str
    partitions: int
    num_devices: int
    device_type: str
    intervals: list[int]
    chunk_edges: list[list[int]]
    chunk_source: str
    assignment: list[int]
    budget_bytes: int
    schedule: list[list[Pass]]
    cost: GNNCostModel
    epochs: int = 200
    lr: float = 0.01
    seed: int = 0
    metrics: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    # ------------------------------------------------------------ derived
    @property
    def layers(self) -> list[LayerShape]:
        """The per-layer costs (:func:`engine.gnn.cost.layer_shapes`)."""
        return layer_shapes(self.model, self.cost.base.dtype)

    def device_intervals(self, device: int) -> list[int]:
        """The destination intervals ``device`` owns, ascending."""
        return [j for j, d in enumerate(self.assignment) if d == device]

    def device_vertices(self, device: int) -> int:
        """Vertices in the intervals ``device`` owns."""
        return sum(self.intervals[j] for j in self.device_intervals(device))

    def chunks(self, device: int | None = None) -> list[tuple[int, int]]:
        """Non-empty chunks ``(i, j)`` (of the destination intervals of ``device``, or all)."""
        p = self.partitions
        return [(i, j) for j in range(p) for i in range(p)
                if self.chunk_edges[i][j] > 0 and (device is None or self.assignment[j] == device)]

    def calibrated(self, records: Any, epoch_seconds: Sequence[float] | None = None) -> "GNNPlan":
        """A copy whose cost model is calibrated on measured chunk records
        (:meth:`GNNCostModel.calibrate`, e.g. ``runtime.gnn.streaming.StepResult.records`` of steps
        after the first) and whose ``metrics`` are re-simulated with it.

        Args:
            records: the measured chunk records (several epochs' may be passed together).
            epoch_seconds: the measured wall time of those epochs (``StepResult.seconds``); their
                median's excess over the calibrated simulation becomes the cost model's
                ``epoch_overhead`` (the loss, the dense backward inside autograd, the optimizer's
                Python: what no record covers). ``None`` leaves it as it is.

        Raises:
            CostModelError: no usable record, one that names a layer or interval this plan lacks,
                or a non-positive epoch time.
        """
        cost = self.cost.calibrate(records, self.layers, self.chunk_edges, self.intervals)
        if epoch_seconds is not None:
            secs = [float(t) for t in epoch_seconds]
            if not secs or min(secs) <= 0:
                raise CostModelError(f"epoch_seconds must be positive measured epoch times, got {secs}.")
            cost.coefficients["epoch_overhead"] = 0.0
            base = simulate_gnn(dataclasses.replace(self, cost=cost), check_memory=False).epoch_time
            cost.coefficients["epoch_overhead"] = max(0.0, statistics.median(secs) - base)
        plan = dataclasses.replace(self, cost=cost, metrics={})
        plan.metrics = {**simulate_gnn(plan, check_memory=False).metrics(), "memory_bound": memory_bound(plan)}
        return plan

    # ------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        """The JSON document (``format``, ``version`` first)."""
        return GNN_PLAN_ENVELOPE.wrap({
            "meta": {"tessel_version": __version__, **self.meta},
            "model": _config_to_dict(self.model),
            "graph": {"spec": self.graph_spec, **self.graph.to_dict()},
            "partitions": self.partitions,
            "num_devices": self.num_devices,
            "device_type": self.device_type,
            "budget_bytes": self.budget_bytes,
            "intervals": list(self.intervals),
            "chunk_edges": [list(r) for r in self.chunk_edges],
            "chunk_source": self.chunk_source,
            "assignment": list(self.assignment),
            "schedule": [[p.to_dict() for p in passes] for passes in self.schedule],
            "training": {"epochs": self.epochs, "lr": self.lr, "seed": self.seed},
            "cost": self.cost.to_dict(),
            "metrics": self.metrics,
        })

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "") -> "GNNPlan":
        """Rebuild a plan from its JSON document.

        Raises:
            PlanFormatError: a wrong format or version, or a missing or malformed field; the
                message names the field path (e.g. ``schedule[1][0].steps[4]``).
        """
        GNN_PLAN_ENVELOPE.check(d, source)
        r = GNN_PLAN_ENVELOPE.reader(source)
        model = _config_from_dict(r.need(d, "model", dict, "model"), r)
        g = r.need(d, "graph", dict, "graph")
        try:
            stats = GraphStats(*(r.need(g, k, int, f"graph.{k}")
                                 for k in ("num_vertices", "num_edges", "feature_dim", "num_classes")))
        except GNNPlanError as e:
            raise r.fail("graph", f": {e}") from None
        spec = r.optional(g, "spec", str, "graph.spec", "")
        p = r.need(d, "partitions", int, "partitions")
        nd = r.need(d, "num_devices", int, "num_devices")
        if p < 1 or nd < 1:
            raise r.fail("partitions" if p < 1 else "num_devices", " should be at least 1")
        intervals = _int_list(r, r.need(d, "intervals", list, "intervals"), "intervals", p)
        if sum(intervals) != stats.num_vertices:
            raise r.fail("intervals", f" sum to {sum(intervals)}, but the graph has {stats.num_vertices} vertices")
        rows = r.need(d, "chunk_edges", list, "chunk_edges")
        if len(rows) != p:
            raise r.fail("chunk_edges", f" should have {p} rows (P), got {len(rows)}")
        chunk_edges = [_int_list(r, row, f"chunk_edges[{i}]", p) for i, row in enumerate(rows)]
        assignment = _int_list(r, r.need(d, "assignment", list, "assignment"), "assignment", p)
        for j, dev in enumerate(assignment):
            if not 0 <= dev < nd:
                raise r.fail(f"assignment[{j}]", f" is device {dev}, but the plan has devices 0..{nd - 1}")
        sched_raw = r.need(d, "schedule", list, "schedule")
        if len(sched_raw) != nd:
            raise r.fail("schedule", f" should have one list of passes per device ({nd}), got {len(sched_raw)}")
        schedule = [_passes_from_json(r, passes, f"schedule[{dev}]", p) for dev, passes in enumerate(sched_raw)]
        tr = r.optional(d, "training", dict, "training", {})
        cost = GNNCostModel.from_dict(r.need(d, "cost", dict, "cost"), r, "cost")
        plan = cls(model, stats, spec, p, nd, r.need(d, "device_type", str, "device_type"), intervals, chunk_edges,
                   str(r.optional(d, "chunk_source", str, "chunk_source", "expected")), assignment,
                   r.need(d, "budget_bytes", int, "budget_bytes"), schedule, cost,
                   int(r.optional(tr, "epochs", int, "training.epochs", 200)),
                   float(r.optional(tr, "lr", (int, float), "training.lr", 0.01)),
                   int(r.optional(tr, "seed", int, "training.seed", 0)),
                   dict(r.optional(d, "metrics", dict, "metrics", {})), dict(r.optional(d, "meta", dict, "meta", {})))
        _check_schedule(plan, r)
        return plan


def _int_list(r: FieldReader, value: Any, path: str, length: int) -> list[int]:
    if not isinstance(value, list):
        raise r.fail(path, f" should be a list, got {type(value).__name__}")
    if len(value) != length:
        raise r.fail(path, f" should have {length} entries (P), got {len(value)}")
    for k, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise r.fail(f"{path}[{k}]", f" should be a non-negative int, got {v!r}")
    return [int(v) for v in value]


def _passes_from_json(r: FieldReader, passes: Any, path: str, p: int) -> list[Pass]:
    if not isinstance(passes, list):
        raise r.fail(path, f" should be a list of passes, got {type(passes).__name__}")
    out = []
    for k, pd in enumerate(passes):
        where = f"{path}[{k}]"
        layer = r.need(pd, "layer", int, f"{where}.layer")
        phase = r.need(pd, "phase", str, f"{where}.phase")
        if phase not in ("F", "B"):
            raise r.fail(f"{where}.phase", f" is {phase!r}, expected 'F' or 'B'")
        steps_raw = r.need(pd, "steps", list, f"{where}.steps")
        steps = []
        for s, st in enumerate(steps_raw):
            sp = f"{where}.steps[{s}]"
            if not (isinstance(st, list) and len(st) == 3 and st[0] in STEP_KINDS
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in st[1:])):
                raise r.fail(sp, f" should be [kind, i, j] with kind one of {', '.join(STEP_KINDS)}, got {st!r}")
            kind, i, j = st
            if kind == "chunk" and not (0 <= i < p and 0 <= j < p):
                raise r.fail(sp, f" names chunk ({i}, {j}), but P is {p}")
            if kind in ("pre", "apply") and not 0 <= j < p:
                raise r.fail(sp, f" names interval {j}, but P is {p}")
            steps.append(Step(kind, i, j))
        out.append(Pass(layer, phase, steps))
    return out


def _check_schedule(plan: GNNPlan, r: FieldReader) -> None:
    """Every device's passes cover its chunks once per layer and phase, and name only its own intervals."""
    num_layers = len(plan.layers)
    order = [(layer, "F") for layer in range(num_layers)] + [(layer, "B") for layer in reversed(range(num_layers))]
    collectives = None
    for dev, passes in enumerate(plan.schedule):
        where = f"schedule[{dev}]"
        got = [(ps.layer, ps.phase) for ps in passes]
        if got != order:
            raise r.fail(where, f" has passes {got}, expected the forward of layers 0..{num_layers - 1} then their "
                                "backward in reverse order")
        mine = set(plan.chunks(dev))
        colls = []
        for k, ps in enumerate(passes):
            seen = [(s.i, s.j) for s in ps.steps if s.kind == "chunk"]
            if len(seen) != len(set(seen)) or set(seen) != mine:
                missing = sorted(mine - set(seen))
                extra = sorted(set(seen) - mine) or sorted({c for c in seen if seen.count(c) > 1})
                raise r.fail(f"{where}[{k}].steps", f" should have each non-empty chunk of device {dev}'s intervals "
                                                    f"once (missing {missing[:4]}, extra or repeated {extra[:4]})")
            for s, st in enumerate(ps.steps):
                if st.kind in ("pre", "apply") and plan.assignment[st.j] != dev:
                    raise r.fail(f"{where}[{k}].steps[{s}]", f" is interval {st.j} of device "
                                                             f"{plan.assignment[st.j]}, not of device {dev}")
            own = plan.device_intervals(dev)
            for stage in ("apply", "pre"):
                got_j = sorted(st.j for st in ps.steps if st.kind == stage)
                need = own if stage == "apply" or plan.layers[ps.layer].has_pre else []
                if got_j != need:
                    raise r.fail(f"{where}[{k}].steps", f" should have one '{stage}' step per interval of device "
                                                        f"{dev} ({need}), got {got_j}")
            colls.append([st.kind for st in ps.steps if st.kind in COLLECTIVE_STEPS])
        if collectives is None:
            collectives = colls
        elif colls != collectives:
            raise r.fail(where, " has other collectives than device 0; every device runs the same collectives")


def _config_to_dict(model: Any) -> dict:
    if dataclasses.is_dataclass(model) and not isinstance(model, type):
        return dataclasses.asdict(model)
    return {k: getattr(model, k) for k in ("kind", "in_dim", "hidden", "out_dim", "layers", "heads")}


def _config_from_dict(d: dict, r: FieldReader) -> Any:
    from engine.gnn.models import GNNConfig

    known = {f.name for f in dataclasses.fields(GNNConfig)}
    for k in d:
        if k not in known:
            raise r.fail(f"model.{k}", f" is not a GNNConfig field (fields: {', '.join(sorted(known))})")
    try:
        return GNNConfig(**d)
    except (TypeError, ValueError) as e:   # GNNError is a ValueError
        raise r.fail("model", f": {e}") from None


# ---------------------------------------------------------------------------------------------- building
def graph_from_spec(spec: str, seed: int = 0) -> Any:
    """The graph (a :class:`torch_geometric.data.Data` with ``x``, ``edge_index``, ``y`` and masks) a
    spec names: :func:`tasks.graphs.graph_from_spec` (``karate``, ``cpython``, ``rmat:SCALE:EDGE_FACTOR``).

    Raises:
        GraphError: an unknown name or malformed numbers (one sentence listing the forms).
    """
    from tasks.graphs import graph_from_spec as from_spec

    return from_spec(spec, seed)


def expected_chunks(stats: GraphStats, partitions: int, self_loops: bool) -> tuple[list[int], list[list[int]]]:
    """Interval sizes and chunk edge counts expected from the statistics alone.

    The N vertices are cut into ``P`` intervals at ``k N // P`` (as
    :class:`~engine.gnn.partition.GraphPartition` cuts them); the E edges are spread evenly over
    the ``P x P`` chunks (the first ``E % P**2`` chunks, in row-major order, one more), as for a
    graph without locality; with
    ``self_loops`` each diagonal chunk ``(i, i)`` gets one edge per vertex of interval ``i``. A
    locality-renumbered graph (reverse Cuthill-McKee) has heavier diagonal chunks: plan with a
    :class:`~engine.gnn.partition.GraphPartition` for its exact sizes.

    Returns:
        ``(intervals, chunk_edges)``.

    Raises:
        GNNPlanError: ``partitions`` is not in ``1..N``.
    """
    n, p = stats.num_vertices, int(partitions)
    if not 1 <= p <= n:
        raise GNNPlanError(f"the partition count P must be between 1 and the {n} vertices, got {partitions}.")
    intervals = [(k + 1) * n // p - k * n // p for k in range(p)]
    base, extra = divmod(stats.num_edges, p * p)
    chunk_edges = [[base + (1 if i * p + j < extra else 0) for j in range(p)] for i in range(p)]
    if self_loops:
        for i in range(p):
            chunk_edges[i][i] += intervals[i]
    return intervals, chunk_edges


def partition_chunks(partition: Any) -> tuple[list[int], list[list[int]]]:
    """Interval sizes and chunk edge counts of a :class:`~engine.gnn.partition.GraphPartition`
    (its ``interval_size(k)`` and ``chunk_edges()`` ``[P, P]`` counts)."""
    p = int(partition.num_parts)
    counts = partition.chunk_edges()
    rows = counts.tolist() if hasattr(counts, "tolist") else counts
    return [int(partition.interval_size(k)) for k in range(p)], [[int(v) for v in row] for row in rows]


def balance_intervals(weights: Sequence[float], devices: int) -> list[int]:
    """Assign ``P`` intervals to ``devices`` devices in contiguous runs minimising the largest
    per-device weight (the linear-partition dynamic programme, ``O(devices P^2)``; ties go to
    the earlier cut, so equal weights give equal runs).

    Args:
        weights: per interval (edges into it).
        devices: number of devices, at most ``len(weights)``.

    Returns:
        ``assignment[j]``, the device of interval ``j`` (non-decreasing, every device used).

    Raises:
        GNNPlanError: more devices than intervals.
    """
    p = len(weights)
    if not 1 <= devices <= p:
        raise GNNPlanError(f"{devices} devices need at least as many intervals, but P is {p}; use --partitions of at "
                           f"least {devices}.")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = math.inf
    # best[k][m]: smallest max weight splitting the first m intervals into k runs; cut[k][m]: start of the last run
    best = [[inf] * (p + 1) for _ in range(devices + 1)]
    cut = [[0] * (p + 1) for _ in range(devices + 1)]
    best[0][0] = 0.0
    for k in range(1, devices + 1):
        for m in range(k, p - (devices - k) + 1):
            for s in range(k - 1, m):
                v = max(best[k - 1][s], prefix[m] - prefix[s])
                if v < best[k][m] - 1e-12 * max(1.0, abs(v)):
                    best[k][m], cut[k][m] = v, s
    assignment = [0] * p
    m = p
    for k in range(devices, 0, -1):
        s = cut[k][m]
        for j in range(s, m):
            assignment[j] = k - 1
        m = s
    return assignment


def build_schedule(layers: Sequence[LayerShape], chunk_edges: Sequence[Sequence[int]], assignment: Sequence[int],
                   num_devices: int) -> list[list[Pass]]:
    """Every device's passes (NGra section 4).

    Forward of layer ``l``: ``pre`` of each own interval (a layer with ``apply_vertex_pre``),
    ``allgather`` (several devices; not for the first layer without ``apply_vertex_pre``, whose
    input features every device has), then per own destination interval ``j`` its non-empty
    chunks ``(0..P-1, j)`` and ``apply`` ``j``. Backward of layer ``l``: ``apply`` (backward) of
    each own interval, per source interval ``i`` the non-empty chunks ``(i, j)`` of the own
    intervals ``j``, ``reducescatter`` of the source gradients (several devices; not for the first
    layer without ``apply_vertex_pre``: the input features need no gradient), ``pre`` (backward)
    of each own interval; the last pass ends with ``allreduce`` (several devices) and ``optim``.
    """
    p = len(chunk_edges)
    out: list[list[Pass]] = []
    for dev in range(num_devices):
        own = [j for j in range(p) if assignment[j] == dev]
        passes = []
        for layer in layers:
            steps = [Step("pre", -1, j) for j in own] if layer.has_pre else []
            if num_devices > 1 and (layer.index > 0 or layer.has_pre):
                steps.append(Step("allgather"))
            for j in own:
                steps += [Step("chunk", i, j) for i in range(p) if chunk_edges[i][j] > 0]
                steps.append(Step("apply", -1, j))
            passes.append(Pass(layer.index, "F", steps))
        for layer in reversed(layers):
            steps = [Step("apply", -1, j) for j in own]
            steps += [Step("chunk", i, j) for i in range(p) for j in own if chunk_edges[i][j] > 0]
            if num_devices > 1 and (layer.index > 0 or layer.has_pre):
                steps.append(Step("reducescatter"))
            if layer.has_pre:
                steps += [Step("pre", -1, j) for j in own]
            passes.append(Pass(layer.index, "B", steps))
        if num_devices > 1:
            passes[-1].steps.append(Step("allreduce"))
        passes[-1].steps.append(Step("optim"))
        out.append(passes)
    return out


def _candidate(model: Any, stats: GraphStats, spec: str, p: int, devices: int, device_type: str, budget: int,
               cost: GNNCostModel, partition: Any, training: dict) -> GNNPlan:
    layers = layer_shapes(model, cost.base.dtype)
    if partition is not None:
        intervals, chunk_edges = partition_chunks(partition)
        source = "partition"
    else:
        intervals, chunk_edges = expected_chunks(stats, p, layers[0].self_loops)
        source = "expected"
    weights = [sum(chunk_edges[i][j] for i in range(p)) for j in range(p)]
    assignment = balance_intervals(weights, devices)
    schedule = build_schedule(layers, chunk_edges, assignment, devices)
    return GNNPlan(model, stats, spec, p, devices, device_type, intervals, chunk_edges, source, assignment, budget,
                   schedule, cost, **training)


def _check_p(P: Any, devices: int, stats: GraphStats) -> None:
    top = min(stats.num_vertices, MAX_PARTITIONS)
    if isinstance(P, bool) or not isinstance(P, int) or not devices <= P <= top:
        raise GNNPlanError(f"the partition count P must be an integer between the {devices} devices and {top}, "
                           f"got {P!r}.")


def _partitioner(model: Any, stats: GraphStats, edge_index: Any, order: str) -> Any:
    """``p -> GraphPartition`` of the graph's edges as the model's layers prepare them (one locality
    order, computed once, for every ``p``)."""
    import torch

    from engine.gnn.models import build_gnn
    from engine.gnn.partition import GraphPartition, locality_order

    if not isinstance(edge_index, torch.Tensor) or edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise GNNPlanError(f"edge_index must be a [2, E] tensor, got {type(edge_index).__name__}.")
    if edge_index.shape[1] != stats.num_edges:
        raise GNNPlanError(f"edge_index has {edge_index.shape[1]} edges but the statistics say {stats.num_edges}; "
                           "pass the edges of the same graph.")
    with torch.device("meta"):          # only the layer's prepare_edges is needed: no weights
        first: Any = build_gnn(model).layers[0]
    prepared = first.prepare_edges(edge_index.to(torch.int64), stats.num_vertices)
    try:
        perm = locality_order(prepared, stats.num_vertices, order)
    except PartitionError as e:
        raise GNNPlanError(str(e)) from None

    def build(p: int) -> Any:
        return GraphPartition.build(prepared, stats.num_vertices, p, order=perm)

    return build


def make_gnn_plan(model_config: Any, graph: Any, devices: int = 1, budget_bytes: int | None = None,
                  P: int | None = None, device_type: str = "h100", *, partition: Any = None,
                  edge_index: Any = None, order: str = "rcm", cost: GNNCostModel | None = None,
                  link: str | None = None, epochs: int = 200, lr: float = 0.01,
                  seed: int = 0, graph_spec: str = "", meta: dict | None = None) -> GNNPlan:
    """Plan chunk-streamed training of ``model_config`` on a graph, and simulate it.

    Args:
        model_config: a :class:`~engine.gnn.models.GNNConfig`; its ``in_dim`` must be the graph's
            feature width and its ``out_dim`` the number of classes.
        graph: a graph spec (``"karate"``, ``"cpython"``, ``"rmat:SCALE:EDGE_FACTOR"``: built by
            :func:`graph_from_spec`, summarised by ``tasks.graphs.graph_stats``, its edges used as
            ``edge_index``), or its statistics (:class:`GraphStats`, a dict, or ``graph_stats``'s result).
        devices: devices to spread the destination intervals over.
        budget_bytes: memory per device, bytes; ``None``: the device's capacity.
        P: the partition count; ``None`` chooses the smallest power of two (at least ``devices``,
            at most :data:`MAX_PARTITIONS` and N) whose predicted peak fits ``budget_bytes``.
        device_type: the cost table's device (``h100``, ``a100``, ``cpu``).
        partition: a :class:`~engine.gnn.partition.GraphPartition` of the (prepared) graph whose
            exact chunk sizes replace the expected ones (its ``num_parts`` is ``P``).
        edge_index: the graph's ``[2, E]`` edges (the raw graph of the statistics): every candidate
            P is then counted on the real partition (the layers' prepared edges, self-loops as they
            add them, in one locality ``order`` for all P: ``GraphPartition.build``) instead of the
            expected sizes, which a locality-renumbered power-law graph far exceeds on its diagonal.
        order: the vertex order of those partitions (``"rcm"`` or ``"identity"``).
        cost: a (calibrated) :class:`GNNCostModel`; default ``GNNCostModel.for_device(device_type, link)``.
        link: the link between devices (see :meth:`CostModel.for_device`), when ``cost`` is not given.
        epochs, lr, seed: the training fields of the plan.
        graph_spec: the graph's spec, recorded in the plan when ``graph`` is given as statistics.
        meta: free-form facts stored in the plan.

    Returns:
        The plan, with ``metrics`` from :func:`engine.gnn.simulate.simulate_gnn`.

    Raises:
        GNNPlanError: no P fits the budget (one sentence naming the resident bytes), a given P does
            not fit or is out of range, more devices than P or vertices, a model that does not match
            the graph.
        CostModelError: an unknown device type or link.
    """
    if isinstance(graph, str):
        from tasks.graphs import graph_stats

        data = graph_from_spec(graph, seed)
        spec, stats = graph, GraphStats.of(graph_stats(data))
        if partition is None and edge_index is None:
            edge_index = data.edge_index
    else:
        spec, stats = str(graph_spec), GraphStats.of(graph)
    if int(model_config.in_dim) != stats.feature_dim or int(model_config.out_dim) != stats.num_classes:
        raise GNNPlanError(f"the model maps {model_config.in_dim} features to {model_config.out_dim} classes, but the "
                           f"graph has {stats.feature_dim} features and {stats.num_classes} classes; build the "
                           "GNNConfig with in_dim=feature width and out_dim=classes.")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise GNNPlanError(f"devices must be a positive integer, got {devices!r}.")
    if devices > stats.num_vertices:
        raise GNNPlanError(f"{devices} devices need at least one vertex each, but the graph has {stats.num_vertices}.")
    if cost is None:
        cost = GNNCostModel.for_device(device_type, link)
    elif cost.base.device.name != str(device_type).lower():
        device_type = cost.base.device.name
    budget = int(budget_bytes) if budget_bytes is not None else int(cost.base.device.mem_capacity)
    if budget <= 0:
        raise GNNPlanError(f"the memory budget must be positive, got {budget_bytes!r} bytes.")
    training = {"epochs": int(epochs), "lr": float(lr), "seed": int(seed),
                "meta": {"tessel_version": __version__, **(meta or {})}}
    partition_for = _partitioner(model_config, stats, edge_index, order) if edge_index is not None else None
    if partition is not None:
        P = int(partition.num_parts)
    elif P is not None and partition_for is not None:
        _check_p(P, devices, stats)
        partition = partition_for(P)
    if P is not None:
        _check_p(P, devices, stats)
        chosen = _candidate(model_config, stats, spec, P, devices, device_type, budget, cost, partition, training)
        bound = max(memory_bound(chosen))
        if bound > budget:
            raise GNNPlanError(f"with P={P} the predicted peak is {fmt_bytes(bound)} per device, over the "
                               f"{fmt_bytes(budget)} budget; use a larger P or leave P out to choose it.")
    else:
        p = 1 << max(0, (devices - 1).bit_length())
        limit = min(stats.num_vertices, MAX_PARTITIONS)
        plan: GNNPlan | None = None
        best: tuple[int, float] | None = None
        while p <= limit:
            part = partition_for(p) if partition_for is not None else None
            cand = _candidate(model_config, stats, spec, p, devices, device_type, budget, cost, part, training)
            bound = max(memory_bound(cand))
            if bound <= budget:
                plan = cand
                break
            best = (p, bound) if best is None or bound < best[1] else best
            p *= 2
        if plan is None:
            if best is None:
                raise GNNPlanError(f"{devices} devices need a power-of-two P between {devices} and {limit}, and "
                                   "there is none; use fewer devices.")
            raise GNNPlanError(f"the memory budget of {fmt_bytes(budget)} per device is too small: even with "
                               f"P={best[0]} the predicted peak is {fmt_bytes(best[1])} (the vertex data and "
                               "parameters are resident whatever P), so raise the budget to at least that.")
        chosen = plan
    plan = chosen
    sim = simulate_gnn(plan)
    plan.metrics = sim.metrics()
    plan.metrics["memory_bound"] = memory_bound(plan)
    log.info("GNN plan: P=%d, %d devices, epoch %.4g s predicted", plan.partitions, devices,
             plan.metrics["epoch_time"])
    return plan


def fmt_bytes(nbytes: float) -> str:
    """Bytes for messages: ``"1.500 GiB"``, ``"12.25 MiB"`` or ``"3.1 KiB"``."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:,.3f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:,.2f} MiB"
    return f"{nbytes / 2**10:,.1f} KiB"


# ---------------------------------------------------------------------------------------------- files
def save_gnn_plan(plan: GNNPlan, path: str | Path) -> Path:
    """Write the plan JSON atomically to ``path``; returns the path."""
    return atomic_write_text(path, json.dumps(plan.to_dict(), indent=1))


def load_gnn_plan(path: str | Path) -> GNNPlan:
    """Read a GNN plan file.

    Raises:
        PlanFormatError: the file is missing, not JSON (with line and column), of another format or
            version, or a field is missing or malformed (named by its path).
    """
    path = Path(path)
    if not path.is_file():
        raise PlanFormatError(f"{path}: no such GNN plan file")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PlanFormatError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    return GNNPlan.from_dict(d, source=str(path))


__all__ = ["GNN_PLAN_FORMAT", "GNN_PLAN_VERSION", "MAX_PARTITIONS", "GNNPlan", "balance_intervals", "build_schedule",
           "expected_chunks", "fmt_bytes", "graph_from_spec", "load_gnn_plan", "make_gnn_plan", "partition_chunks",
           "save_gnn_plan"]
