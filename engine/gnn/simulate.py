"""Discrete-event simulation of a :class:`~engine.gnn.plan.GNNPlan`: one training epoch as a Timeline.

Every device has a ``load`` stream (host-to-device chunk loads) and a ``compute`` stream (chunk
Scatter/ApplyEdge/Gather, the dense ``apply_vertex_pre`` / ``apply_vertex`` of its intervals, the
optimizer), and takes part in the ``collective`` stream's all-gathers, reduce-scatters and
all-reduce (NGra, USENIX ATC'19, section 4: the next chunk's transfer overlaps the current
chunk's compute). The rules, per device and pass (:class:`~engine.gnn.plan_parts.Pass`):

* the steps run in their order on the compute stream; a ``chunk`` step's compute starts when
  the compute stream is free and its load has ended;
* loads run in the order of the chunk steps, one chunk ahead (double buffering: two chunk
  buffers): the load of the ``k``-th chunk of a pass starts when the previous load has ended and
  the compute of the ``(k-2)``-th chunk has freed its buffer, and never before the pass started
  or before the pass's last collective ended (it reads the vertex data that collective gathers);
* a pass starts when the previous one ended on that device (its vertex data is the previous
  pass's output); a collective starts when every device has reached it and ends after
  :meth:`~engine.gnn.cost.GNNCostModel.collective_time`.

Memory per device is a step curve (bytes over time) of the resident data and the transient
buffers (:func:`memory_bound` explains both); it is checked against the plan's budget. The
Timeline's events: ``LOAD`` on stream ``load`` (name ``"L0F load 2,3"``), ``F``/``B`` compute
(``"L0F chunk 2,3"``, ``"L0F apply 3"``, ``"L0F pre 3"``; ``segment`` = the layer),
``ALLGATHER``/``REDUCESCATTER``/``ALLREDUCE`` on stream ``collective``, ``OPTIM``, and with a
calibrated ``epoch_overhead`` an ``OTHER`` compute event ``"epoch overhead"`` before the optimizer. Units:
seconds and bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import GNNPlanError
from engine.gnn.cost import ADAM_STATES, VATTR_BYTES_PER_VERTEX, GNNCostModel, LayerShape, param_count
from engine.gnn.plan_parts import COLLECTIVE_STEPS, Pass, StreamingPlan
from engine.timeline import Event, Timeline

#: Stream of the chunk loads (``engine.timeline.STREAMS`` has compute, send, recv, collective).
LOAD_STREAM = "load"
_COLLECTIVE_OPS = {"allgather": "ALLGATHER", "reducescatter": "REDUCESCATTER", "allreduce": "ALLREDUCE"}


@dataclass
class PassMemory:
    """Resident bytes of one device around one pass (see :func:`pass_memory`).

    Attributes:
        alloc_start: bytes allocated when the pass starts (the layer's output, transformed
            vertex data and saved aggregates in a forward; the gradient accumulators in a backward).
        free_end: bytes freed when the pass ends.
        alloc_end: bytes allocated when the pass ends (the gradient of the previous layer's
            output rows of this device; the loss gradient after the last forward).
        transient: the largest bytes of chunk buffers, edge tensors and accumulator alive at once
            during the pass (two loaded chunks, one chunk's edge tensors, one accumulator).
    """

    alloc_start: int
    free_end: int
    alloc_end: int
    transient: int


def static_bytes(plan: StreamingPlan) -> int:
    """Bytes resident on every device for the whole epoch: parameters with their gradients and
    Adam's two moments (:data:`~engine.gnn.cost.ADAM_STATES` copies), the input features and
    the per-vertex attributes (degrees) of all N vertices."""
    e = plan.cost.elem_bytes
    n = plan.graph.num_vertices
    return (param_count(plan.layers) * e * ADAM_STATES + n * plan.graph.feature_dim * e
            + n * VATTR_BYTES_PER_VERTEX)


def pass_memory(plan: StreamingPlan, device: int) -> list[PassMemory]:
    """Per pass of ``device`` (in the plan's order), what it allocates and frees.

    With ``e`` bytes per element, N vertices, ``n_d`` the device's vertices:

    * forward of layer ``l``: at its start the output rows of all N vertices ``N out e`` (the
      next layer reads every interval; several devices all-gather them) and, but for the last
      layer, the ReLU's output (another ``N out e``), the ``apply_vertex_pre`` output
      ``N pre_width e`` and the saved aggregates of the device's intervals ``n_d acc_width e``
      (the backward's surrogate reads them); after the last layer the loss gradient ``n_d out e``;
    * backward of layer ``l``: at its start the source-gradient accumulator ``N vertex_width e``,
      the aggregate gradient ``n_d width e`` and, but for the last layer, the gradient through
      the ReLU ``n_d out e``; at its end those, the layer's forward buffers and its output
      gradient are freed and the previous layer's output gradient ``n_d in e`` allocated;
    * transients: two loaded chunks (:meth:`GNNCostModel.chunk_load_bytes`), one chunk's edge
      tensors (:meth:`GNNCostModel.chunk_edge_bytes`, twice in the backward) and, in the forward,
      one accumulator (:meth:`GNNCostModel.accumulator_bytes`), each the largest over the pass.
    """
    cost, layers = plan.cost, plan.layers
    e = cost.elem_bytes
    n = plan.graph.num_vertices
    own = plan.device_intervals(device)
    nd = sum(plan.intervals[j] for j in own)
    chunks = plan.chunks(device)
    fwd_alloc: dict[int, int] = {}
    out = []
    last = len(layers) - 1
    for ps in plan.schedule[device]:
        layer = layers[ps.layer]
        loads = sorted((cost.chunk_load_bytes(layer, plan.chunk_edges[i][j], plan.intervals[i], plan.intervals[j],
                                              ps.phase) for i, j in chunks), reverse=True)
        two_loads = sum(loads[:2])
        edge = max((cost.chunk_edge_bytes(layer, plan.chunk_edges[i][j], ps.phase) for i, j in chunks), default=0)
        relu = ps.layer < last            # ReLU between layers: its output is a tensor of its own
        if ps.phase == "F":
            alloc = (n * layer.out_dim * e * (2 if relu else 1) + n * layer.pre_width * e
                     + nd * layer.acc_width * e)
            fwd_alloc[ps.layer] = alloc
            acc = max((cost.accumulator_bytes(layer, plan.intervals[j]) for j in own), default=0)
            out.append(PassMemory(alloc, 0, nd * layer.out_dim * e if ps.layer == last else 0,
                                  two_loads + edge + acc))
        else:
            alloc = n * layer.vertex_width * e + nd * layer.width * e + (nd * layer.out_dim * e if relu else 0)
            free = alloc + fwd_alloc.get(ps.layer, 0) + nd * layer.out_dim * e
            out.append(PassMemory(alloc, free, nd * layer.in_dim * e if ps.layer > 0 else 0, two_loads + edge))
    return out


def memory_bound(plan: StreamingPlan) -> list[int]:
    """Per device, an upper bound of its simulated memory curve: the largest over its passes of
    the resident bytes during the pass plus the pass's transients (:func:`pass_memory`). The
    planner chooses P by it, so a made plan's simulated memory never exceeds the budget."""
    bounds = []
    for dev in range(plan.num_devices):
        resident = static_bytes(plan)
        peak = resident
        for pm in pass_memory(plan, dev):
            resident += pm.alloc_start
            peak = max(peak, resident + pm.transient)
            resident += pm.alloc_end - pm.free_end
        bounds.append(int(peak))
    return bounds


@dataclass
class GNNSimulation:
    """The simulated epoch of a GNN plan.

    Attributes:
        timeline: events (streams ``load``, ``compute``, ``collective``) and memory curves (bytes).
        budget_bytes: the plan's memory budget per device.
        load_bytes: bytes loaded per device.
    """

    timeline: Timeline
    budget_bytes: int
    load_bytes: list[int] = field(default_factory=list)

    @property
    def epoch_time(self) -> float:
        """Seconds of one epoch (the makespan)."""
        return self.timeline.makespan

    def busy(self, stream: str) -> list[float]:
        """Per device, seconds its ``stream`` is busy."""
        out = [0.0] * self.timeline.num_devices
        for ev in self.timeline.events:
            if ev.stream == stream:
                out[ev.rank] += ev.end - ev.start
        return out

    def over_budget(self) -> tuple[int, float, int] | None:
        """The first ``(device, time_s, bytes)`` where a memory curve exceeds the budget, else ``None``."""
        for dev, curve in enumerate(self.timeline.memory):
            for t, v in curve:
                if v > self.budget_bytes:
                    return dev, t, v
        return None

    def metrics(self) -> dict:
        """JSON-able: ``epoch_time`` (s), ``peak_memory`` (bytes per device), ``budget_bytes``,
        ``compute_time``, ``load_time``, ``collective_time`` (busy seconds per device), ``load_bytes``."""
        return {"epoch_time": self.epoch_time, "peak_memory": self.timeline.peak_memory(),
                "budget_bytes": self.budget_bytes, "compute_time": self.busy("compute"),
                "load_time": self.busy(LOAD_STREAM), "collective_time": self.busy("collective"),
                "load_bytes": list(self.load_bytes)}


class _Device:
    """One device's clocks and memory changes during the simulation."""

    def __init__(self, rank: int):
        self.rank = rank
        self.compute_free = 0.0
        self.load_free = 0.0
        self.load_floor = 0.0          # loads start after this (pass start, last collective's end)
        self.chunk_ends: list[float] = []
        self.mem: list[tuple[float, int]] = []   # (time, +/- bytes)
        self.acc_open: dict[int, int] = {}       # interval -> accumulator bytes allocated
        self.loaded = 0


def _segments(ps: Pass) -> list[tuple[list, str | None]]:
    """The pass's steps cut at its collectives: ``[(steps before, collective kind or None), ...]``."""
    segs: list[tuple[list, str | None]] = []
    cur: list = []
    for st in ps.steps:
        if st.kind in COLLECTIVE_STEPS:
            segs.append((cur, st.kind))
            cur = []
        else:
            cur.append(st)
    segs.append((cur, None))
    return segs


def simulate_gnn(plan: StreamingPlan, cost: GNNCostModel | None = None, *, check_memory: bool = True) -> GNNSimulation:
    """Simulate one training epoch of ``plan`` (see the module docstring for the rules).

    Args:
        plan: the plan.
        cost: a cost model replacing the plan's (e.g. a calibrated one).
        check_memory: raise when a memory curve exceeds the plan's budget.

    Returns:
        The :class:`GNNSimulation` (its Timeline is ``source="predicted"``).

    Raises:
        GNNPlanError: ``check_memory`` and a device's memory exceeds the budget (the message names
            the device, the time and the bytes), or the devices' passes do not run the same
            collectives.
    """
    cost = cost or plan.cost
    layers = plan.layers
    nd = plan.num_devices
    e = cost.elem_bytes
    n = plan.graph.num_vertices
    params = param_count(layers)
    devs = [_Device(r) for r in range(nd)]
    events: list[Event] = []
    static = static_bytes(plan)
    mems = [pass_memory(plan, r) for r in range(nd)]
    for d in devs:
        d.mem.append((0.0, static))
    num_passes = len(plan.schedule[0])
    for k in range(num_passes):
        passes = [plan.schedule[r][k] for r in range(nd)]
        layer = layers[passes[0].layer]
        ph = passes[0].phase
        tag = f"L{layer.index}{ph}"
        for d in devs:
            d.mem.append((d.compute_free, mems[d.rank][k].alloc_start))
            d.load_floor = d.load_free = max(d.load_free, d.compute_free)
            d.chunk_ends = []
        segs = [_segments(ps) for ps in passes]
        if len({len(s) for s in segs}) != 1 or len({tuple(c for _, c in s) for s in segs}) != 1:
            raise GNNPlanError(f"the devices' {tag} passes run different collectives; every device must run the same.")
        for si in range(len(segs[0])):
            for d in devs:
                _run_steps(plan, cost, layer, ph, tag, segs[d.rank][si][0], d, events)
            kind = segs[0][si][1]
            if kind is None:
                continue
            nbytes = params * e if kind == "allreduce" else n * layer.vertex_width * e
            start = max(d.compute_free for d in devs)
            end = start + cost.collective_time(kind, nbytes, nd)
            for d in devs:
                name = "allreduce grads" if kind == "allreduce" else f"{tag} {kind}"
                events.append(Event(d.rank, "collective", _COLLECTIVE_OPS[kind], name, start, end, int(nbytes),
                                    segment=-1 if kind == "allreduce" else layer.index))
                d.compute_free = d.load_floor = d.load_free = end
        for d in devs:
            pm = mems[d.rank][k]
            d.mem.append((d.compute_free, pm.alloc_end - pm.free_end))
    memory = []
    for d in devs:
        # frees before allocations at the same instant (a buffer freed by one step, taken by the next)
        pts = sorted(d.mem, key=lambda p: (p[0], p[1]))
        curve: list[tuple[float, int]] = []
        cur = 0
        for t, delta in pts:
            cur += delta
            if curve and curve[-1][0] == t:
                curve[-1] = (t, cur)
            else:
                curve.append((t, cur))
        memory.append(curve)
    tl = Timeline(events, memory, nd, [static] * nd, "predicted")
    sim = GNNSimulation(tl, plan.budget_bytes, [d.loaded for d in devs])
    if check_memory:
        over = sim.over_budget()
        if over is not None:
            dev, t, v = over
            raise GNNPlanError(f"device {dev} needs {v / 2**30:.3f} GiB at {t * 1e3:.3f} ms, over the "
                               f"{plan.budget_bytes / 2**30:.3f} GiB budget; re-plan with a larger P or budget.")
    return sim


def _run_steps(plan: StreamingPlan, cost: GNNCostModel, layer: LayerShape, ph: str, tag: str, steps: list, d: _Device,
               events: list[Event]) -> None:
    """Simulate one device's steps up to the next collective (see the module docstring)."""
    li = layer.index
    for st in steps:
        if st.kind == "chunk":
            edges = plan.chunk_edges[st.i][st.j]
            index_bytes, row_bytes = cost.chunk_load(layer, edges, plan.intervals[st.i], plan.intervals[st.j], ph)
            nbytes = index_bytes + row_bytes
            k = len(d.chunk_ends)
            ls = max(d.load_floor, d.load_free, d.chunk_ends[k - 2] if k >= 2 else 0.0)
            le = ls + cost.load_time(index_bytes, row_bytes)
            d.load_free = le
            d.loaded += nbytes
            events.append(Event(d.rank, LOAD_STREAM, "LOAD", f"{tag} load {st.i},{st.j}", ls, le, nbytes, segment=li))
            cs = max(d.compute_free, le)
            ce = cs + cost.chunk_compute_time(layer, edges, ph)
            if ph == "F" and st.j not in d.acc_open:
                d.acc_open[st.j] = cost.accumulator_bytes(layer, plan.intervals[st.j])
                d.mem.append((cs, d.acc_open[st.j]))
            ebytes = cost.chunk_edge_bytes(layer, edges, ph)
            d.mem += [(ls, nbytes), (cs, ebytes), (ce, -ebytes - nbytes)]
            events.append(Event(d.rank, "compute", ph, f"{tag} chunk {st.i},{st.j}", cs, ce, segment=li))
            d.compute_free = ce
            d.chunk_ends.append(ce)
        elif st.kind in ("pre", "apply"):
            cs = d.compute_free
            ce = cs + cost.dense_time(layer, plan.intervals[st.j], st.kind, ph)
            if ph == "F" and st.kind == "apply":
                acc = d.acc_open.pop(st.j, None)
                if acc is None:     # an interval without in-edges still gets its (empty) accumulator
                    acc = cost.accumulator_bytes(layer, plan.intervals[st.j])
                    d.mem.append((cs, acc))
                d.mem.append((ce, -acc))
            events.append(Event(d.rank, "compute", ph, f"{tag} {st.kind} {st.j}", cs, ce, segment=li))
            d.compute_free = ce
        elif st.kind == "optim":
            extra = cost.coefficients.get("epoch_overhead", 0.0)
            if extra > 0:       # the epoch's work no chunk record covers (calibrated), before the step
                events.append(Event(d.rank, "compute", "OTHER", "epoch overhead", d.compute_free,
                                    d.compute_free + extra))
                d.compute_free += extra
            cs = d.compute_free
            pbytes = param_count(plan.layers) * cost.elem_bytes
            ce = cs + cost.optimizer_time(pbytes)
            events.append(Event(d.rank, "compute", "OPTIM", "optim", cs, ce, pbytes))
            d.compute_free = ce
        else:  # pragma: no cover - the loader admits STEP_KINDS only, collectives are cut out by _segments
            raise GNNPlanError(f"unknown step kind {st.kind!r}")


__all__ = ["LOAD_STREAM", "GNNSimulation", "PassMemory", "memory_bound", "pass_memory",
           "simulate_gnn", "static_bytes"]
