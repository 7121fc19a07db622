"""Launch a GNN plan on Ray: one actor per plan device, full-batch node classification, measured
against the plan's prediction (NGra, USENIX ATC'19, sections 4-5; docs/gnn.md "Several devices").

``launch_gnn(plan, epochs)``:

1. reads the graph the plan names (``plan.graph_spec``: ``karate``, ``cpython``,
   ``rmat:SCALE:EDGE_FACTOR``, through :func:`engine.gnn.plan.graph_from_spec` with the plan's seed)
   and checks it against the plan's statistics; partitions the model's prepared edges into the
   plan's ``P`` intervals (:func:`engine.gnn.partition.partition_for_model`, reverse Cuthill-McKee
   order, or the identity order where that is what the plan's chunk sizes were counted on);
2. starts (or joins) Ray and one :class:`~runtime.gnn.worker.GNNWorker` actor per plan device with
   :mod:`runtime.cluster` (gloo on CPU; NCCL with one GPU per actor where the cluster has them);
   rank ``r`` owns the destination intervals the plan's ``assignment`` gives device ``r``;
3. trains for ``epochs`` full-graph steps (Adam with the plan's ``lr``, ``weight_decay``, the
   parameters initialised from ``torch.manual_seed(plan.seed)``; the cross-entropy of the graph's
   training vertices), each a collective step of
   :class:`~runtime.gnn.distributed.DistributedStreamedGNN`, and evaluates the final parameters;
4. builds the measured :class:`~engine.timeline.Timeline` of the last epoch from every rank's
   records (streams ``load``, ``compute``, ``collective``; each rank's times from the start of its
   own step, as :mod:`runtime.launcher` aligns ranks), and sets the plan's predicted epoch time
   (:func:`engine.gnn.simulate.simulate_gnn`) next to the measured one and to the prediction of a
   cost model calibrated on rank 0's records and wall time of one epoch (the second where there are three
   or more; :meth:`engine.gnn.plan.GNNPlan.calibrated`
   on the plan as executed: its chunk sizes those of the real partition).

Faults: a rank that raises, dies or hangs (no result within ``step_timeout``) ends the launch with
one :class:`~runtime.runner.LaunchError` sentence naming the rank (the style of
:class:`runtime.runner.Runner`); the actors are killed and Ray is shut down when this call started it
(a caller that started Ray shuts it down itself).

Sources: Ray actors and placement groups (https://docs.ray.io/en/latest/ray-core/),
``torch.distributed`` (https://pytorch.org/docs/stable/distributed.html).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import ray
import torch

from engine.errors import CostModelError, GNNError, TesselError
from engine.gnn.models import build_gnn
from engine.gnn.partition import partition_for_model
from engine.gnn.plan import GNNPlan, GraphStats, build_schedule, graph_from_spec, load_gnn_plan, partition_chunks
from engine.gnn.simulate import simulate_gnn
from engine.timeline import Event, Timeline
from runtime import cluster as _cluster
from runtime.gnn.distributed import OPTIMIZER, owned_rows
from runtime.gnn.streaming import APPLY_VERTEX, APPLY_VERTEX_PRE
from runtime.gnn.worker import DTYPES, GNNWorker
from runtime.runner import LaunchError, Runner
from tasks.graphs import graph_stats

__all__ = ["GNNLaunchResult", "LaunchError", "as_gnn_plan", "launch_gnn", "measured_timeline"]

log = logging.getLogger(__name__)

#: The Adam L2 penalty of a GNN launch by default (Kipf and Welling's recipe, as
#: ``tasks.node_classification.train_full_graph``).
WEIGHT_DECAY = 5e-4
_COLLECTIVE_OPS = {"allgather": "ALLGATHER", "reducescatter": "REDUCESCATTER", "allreduce": "ALLREDUCE"}
STREAMS = ("load", "compute", "collective")


@dataclass
class GNNLaunchResult:
    """What :func:`launch_gnn` measured.

    Attributes:
        epochs: epochs trained (one full-graph step each).
        losses: per epoch, the mean cross-entropy of the training vertices before the epoch's update.
        train_accuracy, val_accuracy, test_accuracy: per epoch, the share of the split's vertices the
            epoch's forward (before its update) classifies right.
        final_accuracy: ``{"train", "val", "test"}`` of the parameters after the last update.
        epoch_times: per epoch, seconds of the slowest rank's step (forward, backward, collectives,
            optimizer; each rank's own clock).
        measured_epoch_time: the median of ``epoch_times`` after the calibration epoch where there are such
            (else of all of them), seconds.
        predicted_epoch_time: the plan's simulated epoch (:func:`engine.gnn.simulate.simulate_gnn`), seconds.
        calibrated_epoch_time: the simulated epoch of the plan as executed with its cost model
            calibrated on rank 0's records and wall time of the second epoch (the first where there are fewer
            than three), seconds (``nan`` when calibration failed).
        timeline: the measured Timeline of the last epoch (``source="measured"``): events on the
            streams ``load``, ``compute`` and ``collective`` per rank; memory one point per rank
            (process RSS on CPU, CUDA peak allocated bytes on a GPU).
        predicted_busy, measured_busy: ``{stream: [seconds per device]}`` of the prediction and of
            the last measured epoch.
        backend: ``"gloo"`` or ``"nccl"``.
        world_size: ranks (the plan's devices).
        partitions: the plan's ``P``.
        order: the vertex order of the partition run (``"rcm"`` or ``"identity"``).
        chunks_as_planned: whether the real partition's chunk sizes are the plan's (``False`` for a
            plan made from statistics: its sizes are expected ones).
        memory_bytes: per rank, the last epoch's memory (see ``timeline``).
        dtype: ``"float32"`` or ``"float64"``.
        elapsed: seconds of the whole launch; setup_time: seconds until every rank was set up.
        parameters: rank 0's final ``state_dict`` (CPU tensors; not in :meth:`to_dict`).
        calibrated_plan: the executed plan with the calibrated cost model, or ``None`` (not in :meth:`to_dict`).
    """

    epochs: int
    losses: list[float]
    train_accuracy: list[float]
    val_accuracy: list[float]
    test_accuracy: list[float]
    final_accuracy: dict[str, float]
    epoch_times: list[float]
    measured_epoch_time: float
    predicted_epoch_time: float
    calibrated_epoch_time: float
    timeline: Timeline | None
    predicted_busy: dict[str, list[float]] = field(default_factory=dict)
    measured_busy: dict[str, list[float]] = field(default_factory=dict)
    backend: str = "gloo"
    world_size: int = 1
    partitions: int = 1
    order: str = "rcm"
    chunks_as_planned: bool = True
    memory_bytes: list[int] = field(default_factory=list)
    dtype: str = "float32"
    elapsed: float = 0.0
    setup_time: float = 0.0
    parameters: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    calibrated_plan: GNNPlan | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        """JSON-able summary (the timeline as its metrics; no parameters, no calibrated plan)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("timeline", "parameters", "calibrated_plan")}
        d["timeline_metrics"] = self.timeline.metrics() if self.timeline is not None else None
        return d


# ------------------------------------------------------------------------------------------ helpers
def as_gnn_plan(plan: Any) -> GNNPlan:
    """A :class:`GNNPlan` from a plan, its JSON dict or a path to ``gnn_plan.json``.

    Raises:
        TypeError: ``plan`` is none of these.
        engine.errors.PlanFormatError: a malformed plan (the message names the field path).
    """
    if isinstance(plan, GNNPlan):
        return plan
    if isinstance(plan, dict):
        return GNNPlan.from_dict(plan)
    if isinstance(plan, (str, os.PathLike)):
        return load_gnn_plan(os.fspath(plan))
    raise TypeError(f"launch_gnn() takes a GNNPlan, its dict or a path, got {type(plan).__name__}")


def _graph(plan: GNNPlan) -> Any:
    """The plan's graph (``graph_from_spec``), checked against its statistics.

    Raises:
        LaunchError: (``kind="setup"``) the plan names no graph, an unknown one, or one whose
            statistics are not the plan's.
    """
    if not plan.graph_spec:
        raise LaunchError("the GNN plan names no graph (graph.spec is empty, it was made from statistics), so there "
                          "is nothing to train on; re-plan with `tessel plan --gnn KIND --graph SPEC`.", kind="setup")
    try:
        data = graph_from_spec(plan.graph_spec, plan.seed)
        stats = GraphStats.of(graph_stats(data))
    except TesselError as e:
        raise LaunchError(str(e), kind="setup") from e
    if stats != plan.graph:
        raise LaunchError(f"graph {plan.graph_spec!r} has {stats.num_vertices} vertices, {stats.num_edges} edges, "
                          f"{stats.feature_dim} features and {stats.num_classes} classes, but the plan was made for "
                          f"{plan.graph.num_vertices}, {plan.graph.num_edges}, {plan.graph.feature_dim} and "
                          f"{plan.graph.num_classes}; re-plan it with `tessel plan --gnn`.", kind="setup")
    return data


def _partition(plan: GNNPlan, edge_index: torch.Tensor) -> tuple[Any, str, bool]:
    """``(partition, order, chunks_as_planned)``: the plan's ``P``-way partition of the model's
    prepared edges in RCM order, or in the identity order where only that one has the plan's chunk sizes.

    Raises:
        LaunchError: (``kind="setup"``) the intervals are not the plan's, or a plan counted on a
            partition (``chunk_source == "partition"``) whose chunk sizes neither order gives.
    """
    with torch.device("meta"):   # only the first layer's prepare_edges is needed: no weights
        model = build_gnn(plan.model)
    n = plan.graph.num_vertices
    first = None
    for order in ("rcm", "identity"):
        part = partition_for_model(model, edge_index, n, plan.partitions, order)
        intervals, chunks = partition_chunks(part)
        if intervals != plan.intervals:
            raise LaunchError(f"the plan's {plan.partitions} intervals hold {plan.intervals} vertices, but the runtime "
                              f"cuts them at k N // P into {intervals}; re-plan with `tessel plan --gnn`.",
                              kind="setup")
        if chunks == plan.chunk_edges:
            return part, order, True
        first = first or part
        if plan.chunk_source != "partition":
            break
    if plan.chunk_source == "partition":
        raise LaunchError(f"the plan's chunk sizes are not those of graph {plan.graph_spec!r} partitioned into "
                          f"P={plan.partitions} intervals (in RCM or identity order); re-plan it with "
                          "`tessel plan --gnn`.", kind="setup")
    assert first is not None
    return first, "rcm", False


def _executed_plan(plan: GNNPlan, partition: Any) -> GNNPlan:
    """The plan with the real partition's chunk sizes (and the schedule over its non-empty chunks)."""
    _, chunks = partition_chunks(partition)
    if chunks == plan.chunk_edges:
        return plan
    schedule = build_schedule(plan.layers, chunks, plan.assignment, plan.num_devices)
    return dataclasses.replace(plan, chunk_edges=chunks, chunk_source="partition", schedule=schedule)


def _event_name(layer: int, phase: str, i: int, j: int, kind: str, op: str) -> tuple[str, str]:
    """The Timeline ``(op, name)`` of a record, named as :mod:`engine.gnn.simulate` names its events."""
    tag = f"L{layer}{phase}"
    if kind == "collective":
        if layer < 0:
            return _COLLECTIVE_OPS[op], "allreduce grads" if phase == "B" else "allreduce loss"
        return _COLLECTIVE_OPS[op], f"{tag} {op}"
    if kind == "load":
        return "LOAD", f"{tag} load {i},{j}"
    if i == OPTIMIZER:
        return "OPTIM", "optim"
    if i == APPLY_VERTEX:
        return phase, f"{tag} apply {j}"
    if i == APPLY_VERTEX_PRE:
        return phase, f"{tag} pre {j}"
    return phase, f"{tag} chunk {i},{j}"


def measured_timeline(records: Sequence[Sequence[Sequence[Any]]], memory: Sequence[int] = ()) -> Timeline:
    """The measured Timeline of one epoch from every rank's records.

    Args:
        records: ``records[rank]``: that rank's ``(layer, phase, i, j, kind, start, end, bytes, op)``
            (:func:`runtime.gnn.worker.record_tuple`; seconds from the start of the rank's step).
        memory: per rank, bytes (one memory point at 0 s).

    Returns:
        Events on the streams ``load`` (op ``LOAD``), ``compute`` (``F``, ``B``, ``OPTIM``) and
        ``collective`` (``ALLGATHER``, ``REDUCESCATTER``, ``ALLREDUCE``), named as the simulator
        names them (``"L0F chunk 2,3"``, ``"L1B reducescatter"``, ...), ``segment`` = the layer;
        ``source="measured"``.
    """
    events: list[Event] = []
    for rank, recs in enumerate(records):
        for layer, phase, i, j, kind, start, end, nbytes, op in recs:
            stream = "compute" if kind == "compute" else kind
            ev_op, name = _event_name(int(layer), str(phase), int(i), int(j), str(kind), str(op))
            events.append(Event(rank, stream, ev_op, name, float(start), float(end),
                                int(nbytes) if kind != "compute" else 0, segment=int(layer)))
    n = len(records)
    mem = [[(0.0, int(memory[r]) if r < len(memory) else 0)] for r in range(n)]
    return Timeline(events, mem, n, [], source="measured")


def _busy(tl: Timeline) -> dict[str, list[float]]:
    out = {s: [0.0] * tl.num_devices for s in STREAMS}
    for e in tl.events:
        if e.stream in out:
            out[e.stream][e.rank] += e.end - e.start
    return out


def _calibrated(executed: GNNPlan, records: Sequence[Sequence[Any]], epoch_seconds: float) -> GNNPlan | None:
    """The executed plan calibrated on one rank's chunk records of one epoch and that epoch's wall time
    (whose excess over the calibrated simulation, the collectives and the loss among it, becomes the
    cost model's epoch overhead); ``None``, logged, where it cannot be."""
    usable = [r for r in records if r[4] in ("load", "compute") and int(r[0]) >= 0 and int(r[3]) >= 0]
    try:
        return executed.calibrated(usable, [epoch_seconds])
    except (CostModelError, TesselError) as e:
        log.warning("could not calibrate the GNN cost model on a measured epoch: %s", e)
        return None


# ------------------------------------------------------------------------------------------ launch
def launch_gnn(plan: Any, epochs: int | None = None, *, address: str | None = None, device: str = "auto",
               dtype: str = "float32", weight_decay: float = WEIGHT_DECAY, prefetch: bool = True,
               step_timeout: float = 120.0, fail_at: tuple[int, int] | None = None) -> GNNLaunchResult:
    """Train a GNN plan on Ray actors (one per plan device) and measure it (see the module docstring).

    Args:
        plan: a :class:`GNNPlan`, its JSON dict or a path to ``gnn_plan.json``.
        epochs: full-graph training steps; ``None``: the plan's ``training.epochs``.
        address: a Ray address; ``None`` starts a local cluster (when Ray is not already initialised).
        device: ``"auto"`` (NCCL with one GPU per rank where the cluster has them, else gloo on CPU),
            ``"cpu"`` or ``"cuda"`` (:func:`runtime.cluster.choose_backend`).
        dtype: ``"float32"`` or ``"float64"`` parameters and features.
        weight_decay: Adam's L2 penalty (default :data:`WEIGHT_DECAY`).
        prefetch: the streamed executor's next-chunk prefetch thread.
        step_timeout: seconds a rank may take for one epoch (and, at least 60, for its setup).
        fail_at: ``(rank, epoch)``: that rank raises at the start of that epoch (fault tests).

    Returns:
        The :class:`GNNLaunchResult`.

    Raises:
        LaunchError: ``epochs`` or ``dtype`` invalid, the plan's graph missing or not the plan's, its
            partition not the plan's, or an assignment whose devices do not own contiguous runs of
            intervals in device order (``kind="setup"``, before Ray starts); the cluster cannot host
            the ranks (``kind="cluster"``); a rank raised, died or hung (the message names the rank
            and the epoch; ``step`` is the epoch).
        engine.errors.PlanFormatError: a malformed plan file or dict.
    """
    t_start = time.perf_counter()
    plan = as_gnn_plan(plan)
    epochs = plan.epochs if epochs is None else epochs
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise LaunchError(f"epochs must be a positive integer, got {epochs!r}.", kind="setup")
    if dtype not in DTYPES:
        raise LaunchError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.", kind="setup")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise LaunchError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}.", kind="setup")
    if not step_timeout > 0:
        raise LaunchError(f"step_timeout must be positive seconds, got {step_timeout!r}.", kind="setup")
    data = _graph(plan)
    partition, order, as_planned = _partition(plan, data.edge_index)
    executed = _executed_plan(plan, partition)
    nd = plan.num_devices
    try:
        owned_rows(partition.boundaries.tolist(), plan.assignment, nd)   # contiguous runs in rank order
    except GNNError as e:
        raise LaunchError(str(e), kind="setup") from e
    graph = {"x": data.x, "y": data.y, "train_mask": data.train_mask, "val_mask": data.val_mask,
             "test_mask": data.test_mask}
    fail_rank, fail_epoch = (int(fail_at[0]), int(fail_at[1])) if fail_at is not None else (-1, -1)
    owned = False
    pool = None
    clean = False
    try:
        owned = _cluster.init_ray(address)
        graph_ref, part_ref = ray.put(graph), ray.put(partition)
        plan_dict = plan.to_dict()

        def make_args(backend: _cluster.Backend) -> Any:
            def args_for_rank(r: int, addr: str, port: int) -> tuple[tuple, dict]:
                return ((plan_dict, graph_ref, part_ref, r, nd, addr, port),
                        {"backend": backend.name, "dtype": dtype, "weight_decay": float(weight_decay),
                         "prefetch": bool(prefetch), "timeout_s": float(max(step_timeout, 60.0)),
                         "fail_at": fail_epoch if r == fail_rank else None})
            return args_for_rank

        pool, backend = _cluster.start_actors(GNNWorker, nd, device, make_args, step_timeout=step_timeout,
                                              error=LaunchError)
        runner = Runner(pool)
        runner.call("setup", [()] * nd, timeout=max(step_timeout, 60.0), step=None, what="setup")
        setup_time = time.perf_counter() - t_start
        outs: list[list[dict]] = []
        first: list[dict] = []
        for epoch in range(epochs):
            keep = epoch in (0, 1, epochs - 1)  # records of the first, the calibration and the last epoch
            try:
                res = runner.call("train_epoch", [(epoch, keep)] * nd, timeout=step_timeout, step=None,
                                  what=f"epoch {epoch}")
            except LaunchError as e:
                e.step = epoch
                raise
            if epoch == 0:
                first = res
            outs.append(res)
            log.info("epoch %d: loss %.4f, %.4f s", epoch, res[0]["loss"], max(o["seconds"] for o in res))
        final = runner.call("evaluate", [()] * nd, timeout=step_timeout, step=None, what="evaluation")[0]
        params = runner.call("state", [()], timeout=step_timeout, step=None, what="final state", ranks=[0])[0]
        clean = True
    finally:
        if pool is not None:
            pool.close(graceful=clean)
        _cluster.shutdown_ray(owned)
    return _result(plan, executed, outs, first, final, params, backend=backend.name, order=order,
                   as_planned=as_planned, dtype=dtype, elapsed=time.perf_counter() - t_start, setup_time=setup_time)


def _result(plan: GNNPlan, executed: GNNPlan, outs: list[list[dict]], first: list[dict], final: dict,
            params: dict, **kw: Any) -> GNNLaunchResult:
    """The :class:`GNNLaunchResult` of the ranks' per-epoch answers."""
    last = outs[-1]
    timeline = measured_timeline([o["records"] for o in last], [o["memory_bytes"] for o in last])
    times = [max(o["seconds"] for o in res) for res in outs]
    sim = simulate_gnn(plan, check_memory=False)
    # Calibrate on the second epoch where there are later ones to compare with (the first pays one-time
    # costs: allocator growth, thread pools), and measure on the epochs after it.
    k = 1 if len(outs) > 2 else 0
    calibrated = _calibrated(executed, outs[k][0]["records"] if k else first[0]["records"], times[k])
    acc = [res[0]["accuracy"] for res in outs]
    return GNNLaunchResult(
        epochs=len(outs), losses=[res[0]["loss"] for res in outs],
        train_accuracy=[a["train"] for a in acc], val_accuracy=[a["val"] for a in acc],
        test_accuracy=[a["test"] for a in acc], final_accuracy=dict(final), epoch_times=times,
        measured_epoch_time=statistics.median(times[k + 1:] if len(times) > k + 1 else times),
        predicted_epoch_time=sim.epoch_time,
        calibrated_epoch_time=calibrated.metrics["epoch_time"] if calibrated is not None else math.nan,
        timeline=timeline, predicted_busy={s: sim.busy(s) for s in STREAMS}, measured_busy=_busy(timeline),
        world_size=plan.num_devices, partitions=plan.partitions, chunks_as_planned=kw.pop("as_planned"),
        memory_bytes=[int(o["memory_bytes"]) for o in last], parameters=params, calibrated_plan=calibrated, **kw)
