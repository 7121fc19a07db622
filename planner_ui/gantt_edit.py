"""Pure helpers of the Gantt view: column data for Bokeh sources, drag detection, header HTML.

No Bokeh or Panel objects here (numpy and engine only), so every rule of the chart is tested
without a browser. Times come in seconds and go out in display units (``scale`` x seconds:
ms, or abstract units with ``scale=1``); memory in bytes goes out in GiB (``mem_scale=2**-30``)
or raw units for abstract placements (``mem_scale=1``).
"""

from __future__ import annotations

import html

import numpy as np

from engine.plan.metrics import model_flops, peak_flops, plan_facts
from engine.schedule import Schedule
from engine.timeline import Timeline
from planner_ui.sources import COMM_DESCRIPTIONS, COMPUTE_HEIGHT, KIND_COLORS, gantt_columns

#: Columns of the block (compute) source sent to the browser. ``x``/``width`` are the Rect
#: centre and width (display units), so Bokeh's BoxEditTool can drag the rectangles.
BLOCK_COLUMNS = ("x", "width", "y", "height", "color", "alpha", "name", "op", "micro_batch", "segment",
                 "device", "position", "start", "end", "duration")
#: Columns of the communication source (Quad glyph, not editable).
COMM_COLUMNS = ("left", "right", "top", "bottom", "color", "alpha", "name", "op", "micro_batch", "segment",
                "device", "start", "end", "duration", "nbytes", "what")
MEASURED_COLUMNS = ("left", "right", "top", "bottom", "color", "name", "op", "device", "start", "end", "duration")
SCHEDULE_OPS = ("F", "B", "I", "W")
#: Kinds drawn in the legend (label, colour key).
LEGEND_KINDS = (("F", "F"), ("B", "B"), ("I", "I"), ("W", "W"), ("SEND/RECV", "SEND"),
                ("ALLREDUCE", "ALLREDUCE"), ("REDUCE-SCATTER", "REDUCESCATTER"), ("ALL-GATHER", "ALLGATHER"),
                ("ALL-TO-ALL (MoE)", "ALLTOALL"), ("OPTIM", "OPTIM"))

_FLOAT_COLS = {"x", "width", "y", "height", "alpha", "start", "end", "duration", "left", "right", "top", "bottom"}
_INT_COLS = {"micro_batch", "segment", "device", "position", "nbytes"}


def _as_column(key: str, values: list):
    if key in _FLOAT_COLS:
        return np.asarray(values, dtype=np.float64)
    if key in _INT_COLS:
        return np.asarray(values, dtype=np.int64)
    return list(values)


def block_columns(timeline: Timeline | None, schedule: Schedule | None, *, scale: float, show_comm: bool = True,
                  highlight_segment: int | None = None) -> tuple[dict, dict, dict]:
    """Split :func:`planner_ui.sources.gantt_columns` into the Gantt's Bokeh column data.

    Returns ``(blocks, comm, labels)``:

    * ``blocks``: every compute-stream event (F/B/I/W/OPTIM) as a Rect (``x`` centre, ``width``,
      ``y`` device row, ``height``) plus hover fields; numeric columns are numpy arrays (sent to
      the browser as binary buffers, fast for 10,000 blocks).
    * ``comm``: communication events (SEND/RECV/ALLREDUCE/ALLTOALL, with a ``what`` description)
      with a positive duration as Quads in
      the thin lane under each row (``top``/``bottom``); empty when ``show_comm`` is false.
      Zero-length events (free communication of abstract plans) are not drawn.
    * ``labels``: ``x``, ``y``, ``text`` (micro-batch number) and ``alpha`` of the F/B/I/W blocks.

    ``highlight_segment`` dims (alpha 0.25) every event not of that segment.
    """
    if timeline is None:
        return ({k: [] for k in BLOCK_COLUMNS}, {k: [] for k in COMM_COLUMNS},
                {"x": [], "y": [], "text": [], "alpha": []})
    cols = gantt_columns(timeline, schedule, scale=scale, include_comm=show_comm, highlight_segment=highlight_segment)
    n = len(cols["left"])
    stream = cols["stream"]
    left = np.asarray(cols["left"], dtype=np.float64)
    right = np.asarray(cols["right"], dtype=np.float64)
    is_comp = np.fromiter((s == "compute" for s in stream), dtype=bool, count=n)
    is_comm = ~is_comp & (right > left)
    ci = np.nonzero(is_comp)[0]
    mi = np.nonzero(is_comm)[0]

    def pick(key, idx):
        vals = cols[key]
        return [vals[i] for i in idx]

    blocks: dict = {}
    blocks["x"] = (left[ci] + right[ci]) / 2.0
    blocks["width"] = right[ci] - left[ci]
    for k in BLOCK_COLUMNS[2:]:
        blocks[k] = _as_column(k, pick(k, ci))
    comm: dict = {}
    y = np.asarray(cols["y"], dtype=np.float64)[mi]
    h = np.asarray(cols["height"], dtype=np.float64)[mi]
    comm["left"], comm["right"] = left[mi], right[mi]
    comm["top"], comm["bottom"] = y - h / 2.0, y + h / 2.0
    for k in COMM_COLUMNS[4:]:
        comm[k] = _as_column(k, pick(k, mi))
    lab = np.asarray([i for i in ci if cols["label"][i] != ""], dtype=np.int64)
    labels = {"x": (left[lab] + right[lab]) / 2.0,
              "y": np.asarray(pick("y", lab), dtype=np.float64),
              "text": pick("label", lab),
              "alpha": np.asarray(pick("alpha", lab), dtype=np.float64)}
    return blocks, comm, labels


def measured_columns(measured: Timeline | None, *, scale: float) -> dict:
    """Quads for the compute events of a measured timeline, drawn in the upper part of each row.

    Times are shifted so the measured step starts at 0 (like the prediction), then scaled.
    """
    out = {k: [] for k in MEASURED_COLUMNS}
    if measured is None or not measured.events:
        return out
    t0 = min(e.start for e in measured.events)
    top_off = -COMPUTE_HEIGHT / 2.0
    for e in measured.events:
        if e.stream != "compute":
            continue
        out["left"].append((e.start - t0) * scale)
        out["right"].append((e.end - t0) * scale)
        out["top"].append(e.rank + top_off)
        out["bottom"].append(e.rank + top_off + 0.22)
        out["color"].append(KIND_COLORS.get(e.op, "#888888"))
        out["name"].append(e.name)
        out["op"].append(e.op)
        out["device"].append(e.rank)
        out["start"].append((e.start - t0) * scale)
        out["end"].append((e.end - t0) * scale)
        out["duration"].append((e.end - e.start) * scale)
    return {k: _as_column(k, v) for k, v in out.items()}


def find_dragged(old_x, old_y, new_x, new_y, *, tol: float = 1e-9) -> list[int]:
    """Row indices whose ``x`` or ``y`` changed between two versions of the block source.

    Raises:
        ValueError: the lengths differ (a box was added or deleted, not moved).
    """
    ox, oy = np.asarray(old_x, dtype=np.float64), np.asarray(old_y, dtype=np.float64)
    nx, ny = np.asarray(new_x, dtype=np.float64), np.asarray(new_y, dtype=np.float64)
    if not (len(ox) == len(oy) == len(nx) == len(ny)):
        raise ValueError("the number of blocks changed")
    scale = max(1.0, float(np.max(np.abs(ox))) if len(ox) else 1.0)
    moved = (np.abs(nx - ox) > tol * scale) | (np.abs(ny - oy) > tol)
    return [int(i) for i in np.nonzero(moved)[0]]


def fmt_memory(value: float | None, abstract: bool) -> str:
    """Bytes as GiB for display (``"1.25 GiB"``), or raw units for abstract placements."""
    if value is None:
        return "none"
    if abstract:
        return f"{value:.4g} units"
    gib = value / 2.0**30
    return f"{gib:.3g} GiB" if gib >= 0.01 or gib == 0 else f"{gib:.3g} GiB ({value / 2.0**20:.3g} MiB)"


def legend_html(measured: bool = False) -> str:
    """Small HTML legend of block kinds (colour swatches), with "measured" when shown."""
    items = []
    for label, key in LEGEND_KINDS:
        tip = html.escape(COMM_DESCRIPTIONS.get(key, ""), quote=True)
        title = f' title="{tip}"' if tip else ""
        items.append(f'<span class="tessel-legend-item" style="margin-right:10px;white-space:nowrap"{title}>'
                     f'<span style="display:inline-block;width:12px;height:12px;background:{KIND_COLORS[key]};'
                     f'vertical-align:middle;margin-right:3px"></span>{html.escape(label)}</span>')
    if measured:
        items.append('<span class="tessel-legend-item" style="white-space:nowrap">'
                     '<span style="display:inline-block;width:12px;height:6px;border:1.5px solid #000;'
                     'vertical-align:middle;margin-right:3px"></span>measured</span>')
    return '<div class="tessel-gantt-legend" style="font-size:12px">' + "".join(items) + "</div>"


def _model_parts(plan, makespan: float) -> list[str]:
    """The header's model facts of a (non-abstract) plan: precision, sequence length, global batch,
    recomputation (:func:`engine.plan.metrics.plan_facts`) and, where the plan's segments record
    FLOPs, TFLOP/s per device and MFU at the shown schedule's ``makespan`` (seconds;
    :func:`engine.plan.metrics.model_flops`, Megatron-LM's count)."""
    f = plan_facts(plan)
    seq = f"{f['seq_len']:,}" if f["seq_len"] else "-"
    parts = [f'<span class="tessel-precision">{html.escape(str(f["precision"]))}</span>, seq {seq}, '
             f'global batch {f["global_batch"]:,}, recompute {html.escape(str(f["recompute"]))}']
    flops = model_flops(plan)
    if flops > 0 and makespan > 0:
        tflops = flops / makespan / max(1, int(plan.parallel.devices)) / 1e12
        peak = peak_flops(plan)
        mfu = f' &middot; MFU <b class="tessel-mfu">{tflops * 1e12 / peak:.1%}</b>' if peak > 0 else ""
        parts.append(f'<b class="tessel-tflops">{tflops:,.1f}</b> TFLOP/s per device{mfu}')
    return parts


def header_html(state) -> str:
    """Header of the Gantt: schedule name, makespan, bubble ratio, peak memory, limit, the plan's
    precision, sequence length, global batch and recomputation, TFLOP/s per device and MFU, legend.

    ``state`` is a :class:`~planner_ui.state.PlanState`; text values carry css classes
    (``tessel-makespan``, ``tessel-bubble``, ``tessel-peak-memory``, ``tessel-memory-limit``,
    ``tessel-measured-makespan``, ``tessel-precision``, ``tessel-tflops``, ``tessel-mfu``) for
    browser tests.
    """
    if state is None or state.plan is None or state.timeline is None:
        return '<div class="tessel-gantt-summary">No plan loaded: plan a model or run a search.</div>' + legend_html()
    m = state.metrics()
    abstract = state.abstract
    peaks = m.get("peak_memory") or []
    peak = max(peaks) if peaks else 0
    per_dev = ", ".join(f"d{d}: {fmt_memory(p, abstract)}" for d, p in enumerate(peaks))
    limit = state.memory_limit
    over = [d for d, p in enumerate(peaks) if limit is not None and p > limit]
    name = html.escape(str(state.schedule.name))
    model = html.escape(str(state.plan.model.name))
    parts = [
        f"<b>{name}</b>" + (f" &middot; {model}" if model else ""),
        f'{state.schedule.num_devices} devices &times; {state.schedule.num_micro_batches} micro-batches',
        f'makespan <b class="tessel-makespan">{html.escape(state.fmt_time(m["makespan"]))}</b>',
        f'bubble ratio <b class="tessel-bubble">{m["bubble_ratio"] * 100:.1f}%</b>',
        f'peak memory <b class="tessel-peak-memory">{fmt_memory(peak, abstract)}</b>'
        f' <span style="color:#666" title="per device">({per_dev})</span>',
        f'limit <b class="tessel-memory-limit">{fmt_memory(limit, abstract)}</b>'
        + (f' <span style="color:#c00">over on device(s) {over}</span>' if over else ""),
    ]
    if not abstract:
        parts.extend(_model_parts(state.plan, m["makespan"]))
    if state.measured is not None:
        ms = state.measured.makespan
        rel = (ms / m["makespan"] - 1.0) * 100 if m["makespan"] > 0 else 0.0
        parts.append(f'measured <b class="tessel-measured-makespan">{html.escape(state.fmt_time(ms))}</b> '
                     f'({rel:+.1f}%)')
    return ('<div class="tessel-gantt-summary">' + " &middot; ".join(parts) + "</div>"
            + legend_html(state.measured is not None))


__all__ = ["block_columns", "measured_columns", "find_dragged", "header_html", "legend_html", "fmt_memory",
           "BLOCK_COLUMNS", "COMM_COLUMNS", "MEASURED_COLUMNS", "SCHEDULE_OPS"]
