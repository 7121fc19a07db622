"""Column data for the planner's charts, as plain ``dict[str, list]`` (Bokeh ColumnDataSource data).

Pure functions of engine objects (Timeline, Schedule, Plan): no Bokeh or Panel here, so they
are unit-tested without a browser. Times come in seconds and go out in display units
(``scale`` x seconds, ms by default); memory in bytes goes out in GiB (or raw units for abstract
placements, ``mem_scale=1``).
"""

from __future__ import annotations

from engine.layout import DEFAULT_ORDER, LEGACY, RankLayout
from engine.schedule import Schedule
from engine.timeline import Timeline

#: Fill colour per block kind (F/B/I/W compute, communication, optimizer).
KIND_COLORS = {
    "F": "#4C78A8",   # forward: blue
    "B": "#F58518",   # backward: orange
    "I": "#E45756",   # backward for inputs: red
    "W": "#72B7B2",   # backward for weights: teal
    "SEND": "#9D9D9D",
    "RECV": "#BAB0AC",
    "ALLREDUCE": "#B279A2",
    "ALLTOALL": "#D4A017",  # MoE expert-parallel all-to-all: dark gold
    "REDUCESCATTER": "#8E6C8A",  # CoCoNet: sharded update, tensor-parallel split
    "ALLGATHER": "#C5A3C0",
    "OPTIM": "#54A24B",
}

#: What a communication event is, for hovers and legends.
COMM_DESCRIPTIONS = {
    "SEND": "pipeline send (activation or input gradient)",
    "RECV": "pipeline receive (waits for the tensor)",
    "ALLREDUCE": "gradient all-reduce (data-parallel replicas, or tied weights across pipeline ranks)",
    "ALLTOALL": "MoE expert-parallel all-to-all (token dispatch/combine over the data-parallel group; blocks compute)",
    "REDUCESCATTER": "reduce-scatter (sharded update: gradients to each replica's shard; FSDP: one block's "
                     "gradients after its backward; tensor-parallel split: a row-parallel output to the sequence "
                     "shard)",
    "ALLGATHER": "all-gather (sharded update: the updated parameter shards; FSDP: one block's parameters, "
                 "prefetched while the block before it computes; scatter-send / tensor-parallel split: a "
                 "sequence-sharded activation)",
}

#: Categorical palette for segments / devices (Tableau 10).
PALETTE = ["#4E79A7", "#F28E2B", "#E15759", "#76B7B2", "#59A14F", "#EDC948", "#B07AA1",
           "#FF9DA7", "#9C755F", "#BAB0AC"]

COMPUTE_OPS = ("F", "B", "I", "W", "OPTIM")
#: Row height of a compute block; communication blocks sit in a thin lane under it.
COMPUTE_HEIGHT = 0.62
COMM_HEIGHT = 0.16
COMM_OFFSET = 0.42

GANTT_COLUMNS = ("left", "right", "y", "height", "device", "stream", "op", "name", "label", "color",
                 "alpha", "micro_batch", "segment", "position", "start", "end", "duration", "nbytes",
                 "editable", "line_color", "what")


def segment_color(segment: int) -> str:
    """The palette colour of a segment (cycles after 10)."""
    return PALETTE[segment % len(PALETTE)] if segment >= 0 else "#cccccc"


def gantt_columns(timeline: Timeline, schedule: Schedule | None = None, *, scale: float = 1e3,
                  include_comm: bool = True, highlight_segment: int | None = None,
                  selected_block: str = "") -> dict[str, list]:
    """One row per event of ``timeline`` for a Gantt chart.

    Columns (one value per event): ``left``/``right`` (start/end x ``scale``), ``y`` (row centre:
    the device for compute, ``device + COMM_OFFSET`` for communication), ``height``, ``device``,
    ``stream``, ``op`` (F/B/I/W/OPTIM/SEND/RECV/ALLREDUCE), ``name`` (``"1B3"``), ``label``
    (micro-batch number for F/B/I/W, else ``""``), ``color``, ``alpha`` (dimmed when a segment
    is highlighted and this block is not of it), ``micro_batch``, ``segment``, ``position``
    (index in the device's order, -1 for non-schedule events), ``start``/``end``/``duration``
    (display units), ``nbytes``, ``editable`` (a schedule block that can be dragged),
    ``line_color`` (black outline on the selected block), ``what`` (a description of a
    communication event, :data:`COMM_DESCRIPTIONS`; ``""`` for compute).
    """
    cols: dict[str, list] = {k: [] for k in GANTT_COLUMNS}
    pos: dict[tuple[int, str], int] = {}
    if schedule is not None:
        for d, order in enumerate(schedule.orders):
            for i, b in enumerate(order):
                pos[(d, str(b))] = i
    for e in timeline.events:
        comm = e.stream != "compute"
        if comm and not include_comm:
            continue
        sched_block = e.op in ("F", "B", "I", "W")
        dim = highlight_segment is not None and e.segment != highlight_segment
        cols["left"].append(e.start * scale)
        cols["right"].append(e.end * scale)
        cols["y"].append(e.rank + (COMM_OFFSET if comm else 0.0))
        cols["height"].append(COMM_HEIGHT if comm else COMPUTE_HEIGHT)
        cols["device"].append(e.rank)
        cols["stream"].append(e.stream)
        cols["op"].append(e.op)
        cols["name"].append(e.name)
        cols["label"].append(str(e.micro_batch) if sched_block and e.micro_batch >= 0 else "")
        cols["color"].append(KIND_COLORS.get(e.op, "#888888"))
        cols["alpha"].append(0.25 if dim else 0.95)
        cols["micro_batch"].append(e.micro_batch)
        cols["segment"].append(e.segment)
        cols["position"].append(pos.get((e.rank, e.name), -1) if sched_block else -1)
        cols["start"].append(e.start * scale)
        cols["end"].append(e.end * scale)
        cols["duration"].append((e.end - e.start) * scale)
        cols["nbytes"].append(e.nbytes)
        cols["editable"].append(sched_block and schedule is not None)
        cols["line_color"].append("#000000" if selected_block and e.name == selected_block and sched_block else None)
        cols["what"].append(COMM_DESCRIPTIONS.get(e.op, e.op) if comm else "")
    return cols


#: Columns of :func:`recompute_columns` (Bokeh ``Quad`` data plus hover fields).
RECOMPUTE_COLUMNS = ("left", "right", "top", "bottom", "name", "op", "segment", "device", "micro_batch",
                     "recompute", "granularity", "duration")


def recompute_columns(timeline: Timeline | None, segments: list[dict] | None, *, scale: float = 1e3) -> dict[str, list]:
    """The recomputed forward inside each backward block, for the Gantt's hatched overlay.

    Activation recomputation (:mod:`engine.recompute`) runs a segment's forward again at the start
    of its backward: of a ``B`` block, or of an ``I`` block when the backward is split (zero
    bubble), the first ``recompute_time`` seconds (the plan's segment dicts, present only when not
    0) are that forward. One row per such block: ``left``/``right`` (start and start + the
    recompute, capped at the block's length, x ``scale``), ``top``/``bottom`` (the compute block's
    extent in its device row), ``name`` (``"1B3"``), ``op``, ``segment``, ``device``,
    ``micro_batch``, ``recompute`` (display units), ``granularity`` (``"full"``, ``"selective"``)
    and ``duration`` (the whole block's, display units). Empty without a timeline or recomputation.
    """
    cols: dict[str, list] = {k: [] for k in RECOMPUTE_COLUMNS}
    if timeline is None or not segments:
        return cols
    rc = {int(sd.get("index", i)): (float(sd.get("recompute_time", 0.0)), str(sd.get("recompute", "full")))
          for i, sd in enumerate(segments)}
    for e in timeline.events:
        if e.stream != "compute" or e.op not in ("B", "I"):
            continue
        secs, gran = rc.get(e.segment, (0.0, "none"))
        if secs <= 0:
            continue
        part = min(secs, e.end - e.start)
        cols["left"].append(e.start * scale)
        cols["right"].append((e.start + part) * scale)
        cols["top"].append(e.rank - COMPUTE_HEIGHT / 2)
        cols["bottom"].append(e.rank + COMPUTE_HEIGHT / 2)
        cols["name"].append(e.name)
        cols["op"].append(str(getattr(e.op, "value", e.op)))
        cols["segment"].append(e.segment)
        cols["device"].append(e.rank)
        cols["micro_batch"].append(e.micro_batch)
        cols["recompute"].append(part * scale)
        cols["granularity"].append(gran)
        cols["duration"].append((e.end - e.start) * scale)
    return cols


def memory_columns(timeline: Timeline, *, scale: float = 1e3, mem_scale: float = 2.0**-30) -> list[dict[str, list]]:
    """Per device, a step curve ``{"x": [...], "y": [...]}`` of memory over time.

    ``x`` in display units (``scale`` x seconds), ``y`` = bytes x ``mem_scale`` (GiB by default).
    Each step point is doubled so that a plain line draws the step function; the curve is
    extended to the makespan.
    """
    end = timeline.makespan * scale
    out = []
    for pts in timeline.memory:
        xs: list[float] = []
        ys: list[float] = []
        prev = None
        for t, b in pts:
            x, y = t * scale, b * mem_scale
            if prev is not None:
                xs.append(x)
                ys.append(prev)
            xs.append(x)
            ys.append(y)
            prev = y
        if prev is not None and (not xs or xs[-1] < end):
            xs.append(end)
            ys.append(prev)
        out.append({"x": xs, "y": ys})
    return out


def metrics_summary(timeline: Timeline, memory_limit: float | None = None) -> dict:
    """``makespan``, ``bubble_ratio``, ``peak_memory`` (list), ``over_limit`` (list of bool)."""
    m = timeline.metrics()
    peaks = timeline.peak_memory()
    m["over_limit"] = [memory_limit is not None and p > memory_limit for p in peaks]
    return m


__all__ = ["KIND_COLORS", "COMM_DESCRIPTIONS", "PALETTE", "gantt_columns", "memory_columns", "metrics_summary",
           "recompute_columns", "segment_color", "COMPUTE_HEIGHT", "COMM_HEIGHT", "COMM_OFFSET", "GANTT_COLUMNS",
           "RECOMPUTE_COLUMNS", "row_labels"]


def row_labels(rows: int, *, tp: int = 1, dp: int = 1, layout: str = DEFAULT_ORDER) -> dict[int, str]:
    """The Gantt's row labels: row ``r`` is pipeline rank ``r`` of data-parallel replica 0 with its
    ``tp`` tensor ranks folded in. With ``tp = dp = 1`` it is ``"device r"``; otherwise its
    ``(pp, dp, tp)`` indices and device ids in the plan's layout (:mod:`engine.layout`), e.g.
    ``"pp 1 · dp 0 · tp 0-7 (devices 64-71)"`` (``legacy``: the one id the simulator gave it).

    Raises:
        engine.errors.TransformError: a degree below 1 or an unknown layout.
    """
    if tp * dp == 1:
        return {r: f"device {r}" for r in range(rows)}
    lay = RankLayout(tp, dp, max(1, rows), layout)
    out = {}
    for r in range(rows):
        tps = "tp 0" if tp == 1 else f"tp 0-{tp - 1}"
        ids = [lay.device(0, 0, r)] if layout == LEGACY else lay.group_of("tensor", lay.device(0, 0, r))
        where = f"device {ids[0]}" if len(ids) == 1 else f"devices {ids[0]}-{ids[-1]}"
        out[r] = f"pp {r} · dp 0 · {tps} ({where})"
    return out

