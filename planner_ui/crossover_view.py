"""Read-only Gantt of co-located data-parallel jobs (CrossoverScheduler) predicted by the engine.

:class:`CrossoverView` shows a :class:`engine.crossover.ColocatedPrediction`: one row per device
(device 0 at the top, x = time in ms), every compute event (F/B/I/W/OPTIM) of every job as a
rectangle coloured by job (forward lighter, backward solid, optimizer faint; the op and block
are in the hover), and the jobs' gradient all-reduces in the thin lane under each row, as in
:class:`planner_ui.gantt.GanttView`. Each row is split into one sub-lane per job (``lanes``),
so the hand-over of the compute token in crossover mode reads as a staircase and the
overlapping blocks of uncoordinated jobs stay visible. The header states the mode, makespan,
steady-state round time, aggregate throughput, per-job throughput, the speedup over running
the jobs one after the other (when the sequential prediction is known), the co-located
memory peak and, when given (``link``), the link the prediction is for. A mode selector
switches between the predictions of :func:`engine.crossover.compare_modes` (computed once;
:meth:`CrossoverView.from_plans` builds them from plans).

Column data comes from :func:`crossover_columns` (pure, reuses
:func:`planner_ui.sources.gantt_columns`), so the tests check it without a browser.

CSS hooks for browser tests (``css_classes``):

==============================  ==========================================================
``tessel-crossover``            the whole view (a ``pn.Column``)
``tessel-crossover-header``     header (HTML) with ``.tessel-crossover-mode``,
                                ``.tessel-crossover-makespan``, ``.tessel-crossover-cycle``,
                                ``.tessel-crossover-throughput``, ``.tessel-crossover-job``
                                (one per job), ``.tessel-crossover-speedup``,
                                ``.tessel-crossover-link`` (when the link is stated),
                                ``.tessel-crossover-memory`` and ``.tessel-crossover-warning``
``tessel-crossover-mode-select``  RadioButtonGroup: crossover / uncoordinated / sequential
``tessel-crossover-plot``       the Bokeh pane of the Gantt figure
``tessel-crossover-message``    Alert for a mode without a prediction
==============================  ==========================================================

Source libraries: Panel (``pn.viewable.Viewer``, ``RadioButtonGroup``, ``pn.pane.Bokeh``) and
Bokeh (``figure``, ``Quad`` glyphs, ``HoverTool``, ``FixedTicker``).
"""

from __future__ import annotations

import html

import numpy as np
import panel as pn
import param
from bokeh.models import ColumnDataSource, FixedTicker, HoverTool, Range1d, WheelZoomTool
from bokeh.plotting import figure

from engine.crossover import MODES, ColocatedPrediction, compare_modes
from planner_ui.background import bokeh_safe
from planner_ui.gantt_edit import fmt_memory
from planner_ui.sources import COMM_HEIGHT, COMM_OFFSET, COMPUTE_HEIGHT, PALETTE, gantt_columns

#: Columns of the compute and communication sources (Quad glyphs).
CROSSOVER_COLUMNS = ("left", "right", "top", "bottom", "color", "alpha", "job", "job_index", "op", "name",
                     "device", "micro_batch", "segment", "start", "end", "duration", "nbytes")
#: Fill alpha per op: the job's colour, forward lighter than backward, optimizer faint.
OP_ALPHA = {"F": 0.6, "B": 0.95, "I": 0.95, "W": 0.8, "OPTIM": 0.35, "ALLREDUCE": 0.9}
MODE_LABELS = {"crossover": "crossover (compute token)", "uncoordinated": "uncoordinated", "sequential": "sequential"}

_FLOAT = {"left", "right", "top", "bottom", "alpha", "start", "end", "duration"}
_INT = {"job_index", "device", "micro_batch", "segment", "nbytes"}


def job_color(index: int) -> str:
    """The palette colour of the ``index``-th job."""
    return PALETTE[index % len(PALETTE)]


def crossover_columns(prediction: ColocatedPrediction | None, *, scale: float = 1e3,
                      lanes: bool = True) -> tuple[dict, dict]:
    """Column data of the co-located Gantt: ``(compute, comm)``.

    ``compute``: one Quad per compute-stream event (F/B/I/W/OPTIM, every job, every device);
    ``comm``: one Quad per ALLREDUCE with a positive duration, in the thin lane under the row.
    Columns (:data:`CROSSOVER_COLUMNS`): ``left``/``right``/``start``/``end``/``duration`` in
    display units (``scale`` x seconds, ms by default), ``top``/``bottom`` (row geometry: with
    ``lanes`` each job gets ``1/jobs`` of the row's height, in job order; else the full height),
    ``color`` (the job's), ``alpha`` (:data:`OP_ALPHA`), ``job``, ``job_index``, ``op``,
    ``name`` (``"A 0F0"``), ``device``, ``micro_batch``, ``segment``, ``nbytes``.
    """
    empty = ({k: [] for k in CROSSOVER_COLUMNS}, {k: [] for k in CROSSOVER_COLUMNS})
    if prediction is None:
        return empty
    tl = prediction.timeline
    base = gantt_columns(tl, None, scale=scale, include_comm=True)
    jobs = list(prediction.jobs)
    jidx = {j: i for i, j in enumerate(jobs)}
    nj = max(1, len(jobs))
    out = empty
    for i, e in enumerate(tl.events):  # gantt_columns keeps one row per event, in order
        comm = e.stream != "compute"
        if comm and not base["right"][i] > base["left"][i]:
            continue
        cols = out[1] if comm else out[0]
        k = jidx.get(e.job, 0)
        full = COMM_HEIGHT if comm else COMPUTE_HEIGHT
        centre = e.rank + (COMM_OFFSET if comm else 0.0)
        top0 = centre - full / 2.0
        h = full / nj if lanes else full
        top = top0 + (k * h if lanes else 0.0)
        cols["left"].append(base["left"][i])
        cols["right"].append(base["right"][i])
        cols["top"].append(top)
        cols["bottom"].append(top + h)
        cols["color"].append(job_color(k))
        cols["alpha"].append(OP_ALPHA.get(e.op, 0.9))
        cols["job"].append(e.job)
        cols["job_index"].append(k)
        for key in ("op", "name", "device", "micro_batch", "segment", "start", "end", "duration", "nbytes"):
            cols[key].append(base[key][i])
    return tuple({k: (np.asarray(v, dtype=np.float64) if k in _FLOAT else np.asarray(v, dtype=np.int64)
                      if k in _INT else list(v)) for k, v in c.items()} for c in out)  # type: ignore[return-value]


def fmt_ms(seconds: float) -> str:
    """Seconds as ms for display (3 decimals below 10 ms, 1 above)."""
    ms = seconds * 1e3
    return f"{ms:.3f} ms" if ms < 10 else f"{ms:.1f} ms"


def fmt_rate(tps: float) -> str:
    """Tokens per second for display (tokens/s, k tokens/s, M tokens/s)."""
    if tps >= 1e6:
        return f"{tps / 1e6:.2f} M tokens/s"
    if tps >= 1e3:
        return f"{tps / 1e3:.1f} k tokens/s"
    return f"{tps:.1f} tokens/s"


#: The header while nothing is predicted (words for the user, no function names).
EMPTY_TEXT = ("No prediction yet: press <b>Predict co-location</b> to see copies of the current data-parallel plan "
              "share its devices, and how much faster they run with a compute token than one after the other.")


def crossover_header_html(prediction: ColocatedPrediction | None,
                          predictions: dict[str, ColocatedPrediction] | None = None, link: str = "") -> str:
    """Header HTML: mode, makespan, round time, aggregate and per-job throughput, speedup over
    ``predictions["sequential"]`` (when given), memory peak, the link the prediction is for
    (``link``, a description; not shown when empty) and warnings (css classes in the module doc)."""
    if prediction is None:
        return f'<div class="tessel-crossover-summary">{EMPTY_TEXT}</div>'
    p = prediction
    parts = [
        f'mode <b class="tessel-crossover-mode">{html.escape(p.mode)}</b>',
        f'{len(p.jobs)} jobs &times; {p.steps} steps on {p.num_devices} devices'
        + (f' over <b class="tessel-crossover-link">{html.escape(link)}</b>' if link else ""),
        f'makespan <b class="tessel-crossover-makespan">{fmt_ms(p.makespan)}</b>',
        f'round <b class="tessel-crossover-cycle" title="steady state: every job one step">{fmt_ms(p.cycle_time)}</b>',
        f'aggregate <b class="tessel-crossover-throughput">{fmt_rate(p.aggregate_tokens_per_second)}</b>',
    ]
    seq = (predictions or {}).get("sequential")
    if seq is not None and p.mode != "sequential" and seq.aggregate_tokens_per_second > 0:
        sp = p.aggregate_tokens_per_second / seq.aggregate_tokens_per_second
        parts.append(f'vs sequential <b class="tessel-crossover-speedup">{sp:.2f}&times;</b>')
    peaks = p.timeline.peak_memory()
    if peaks:
        parts.append(f'peak memory <b class="tessel-crossover-memory">{fmt_memory(max(peaks), False)}</b>')
    jobs = []
    for i, j in enumerate(p.jobs):
        c, m = p.compute_times.get(j, 0.0), p.comm_times.get(j, 0.0)
        jobs.append(
            f'<span class="tessel-crossover-job" data-job="{html.escape(j)}">'
            f'<span style="display:inline-block;width:10px;height:10px;background:{job_color(i)};'
            'margin-right:3px"></span>'
            f'<b>{html.escape(j)}</b> {fmt_rate(p.per_job_tokens_per_second.get(j, 0.0))}'
            f' <span style="color:#666">(step {fmt_ms(p.step_times.get(j, 0.0))}, C {fmt_ms(c)}, M {fmt_ms(m)})'
            '</span></span>')
    out = ('<div class="tessel-crossover-summary">' + " &middot; ".join(parts) + "</div>"
           + '<div class="tessel-crossover-jobs">' + " &nbsp; ".join(jobs) + "</div>")
    for w in p.warnings:
        out += f'<div class="tessel-crossover-warning" style="color:#c00">{html.escape(w)}</div>'
    return out


class CrossoverView(pn.viewable.Viewer):
    """Read-only Gantt + header + mode selector of co-located jobs.

    Parameters:
        prediction: the :class:`~engine.crossover.ColocatedPrediction` shown.
        predictions: ``{mode: prediction}`` (from :func:`engine.crossover.compare_modes`) the
            mode selector switches between; defaults to ``{prediction.mode: prediction}``.
        mode: the selected mode (``crossover``, ``uncoordinated``, ``sequential``); setting it
            shows ``predictions[mode]`` (a message when there is none).
        lanes: one sub-lane per job in each device row.
        link: the link the prediction is for, as the header states it (``""``: not stated).
        width: figure width in px (``None`` stretches); height: px (``None``: from the devices).

    Construct with ``CrossoverView(prediction=p, predictions=compare_modes(plans))`` or
    :meth:`from_plans`. Properties: :attr:`block_count`, :attr:`comm_count`,
    :attr:`header_text`. Nothing is editable.
    """

    prediction = param.ClassSelector(class_=ColocatedPrediction, allow_None=True, doc="prediction shown")
    predictions = param.Dict(default=None, allow_None=True, doc="{mode: ColocatedPrediction} for the selector")
    mode = param.Selector(default="crossover", objects=list(MODES), doc="the selected mode")
    message = param.String(default="", doc="why a mode cannot be shown")
    lanes = param.Boolean(default=True, doc="one sub-lane per job in each device row")
    link = param.String(default="", doc="the link the prediction is for, stated in the header ('' = not stated)")
    width = param.Integer(default=None, allow_None=True, bounds=(200, None), doc="figure width, px (None: stretch)")
    height = param.Integer(default=None, allow_None=True, bounds=(120, None), doc="figure height, px")

    def __init__(self, **params):
        super().__init__(**params)
        if self.predictions is None:
            self.predictions = {self.prediction.mode: self.prediction} if self.prediction is not None else {}
        if self.prediction is None and self.predictions:
            self.prediction = self.predictions.get(self.mode) or next(iter(self.predictions.values()))
        if self.prediction is not None and self.prediction.mode != self.mode:
            with param.discard_events(self):
                self.mode = self.prediction.mode
        self._header = pn.pane.HTML("", css_classes=["tessel-crossover-header"], sizing_mode="stretch_width")
        self._mode_select = pn.widgets.RadioButtonGroup.from_param(
            self.param.mode, options={MODE_LABELS[m]: m for m in MODES},
            css_classes=["tessel-crossover-mode-select"])
        self._plot_pane = pn.pane.Bokeh(None, css_classes=["tessel-crossover-plot"], sizing_mode="stretch_width")
        self._alert = pn.pane.Alert("", alert_type="warning", visible=False, css_classes=["tessel-crossover-message"],
                                    sizing_mode="stretch_width")
        self._build_figure()
        self.refresh()
        self.param.watch(self._on_mode, ["mode"])
        self.param.watch(lambda _e: self.refresh(), ["prediction", "lanes"])
        self.param.watch(lambda *_e: self._sync_header(), ["predictions", "link"])
        self._layout = pn.Column(self._header, self._mode_select, self._plot_pane, self._alert,
                                 css_classes=["tessel-crossover"], sizing_mode="stretch_width")

    @classmethod
    def from_plans(cls, plans: list, steps: int = 2, mode: str = "crossover", **params) -> CrossoverView:
        """Predict every mode of ``plans`` with :func:`~engine.crossover.compare_modes` and show ``mode``.

        Raises:
            TesselError: as :func:`engine.crossover.predict_colocated` (pipeline plans, different
                device counts, ...).
        """
        preds = compare_modes(plans, steps)
        return cls(prediction=preds[mode], predictions=preds, mode=mode, **params)

    def __panel__(self):
        return self._layout

    # ------------------------------------------------------------------ properties
    @property
    def block_count(self) -> int:
        """Compute blocks drawn (F/B/I/W/OPTIM events of every job on every device)."""
        return len(self.block_source.data["left"])

    @property
    def comm_count(self) -> int:
        """All-reduce blocks drawn in the communication lanes."""
        return len(self.comm_source.data["left"])

    @property
    def header_text(self) -> str:
        """The header HTML."""
        return self._header.object

    # ------------------------------------------------------------------ building
    def _build_figure(self) -> None:
        size = {"sizing_mode": "stretch_width"} if self.width is None else {"width": self.width}
        self.block_source = ColumnDataSource({k: [] for k in CROSSOVER_COLUMNS}, name="tessel-crossover-blocks")
        self.comm_source = ColumnDataSource({k: [] for k in CROSSOVER_COLUMNS}, name="tessel-crossover-comm")
        fig = figure(height=self.height or 260, tools="xpan,xwheel_zoom,box_zoom,reset,save", toolbar_location="above",
                     x_range=Range1d(0, 1), y_range=Range1d(0.5, -0.5), min_border_left=90, **size)
        fig.xgrid.grid_line_alpha = 0.4
        fig.ygrid.grid_line_color = None
        fig.xaxis.axis_label = "time (ms)"
        self.comm_renderer = fig.quad(left="left", right="right", top="top", bottom="bottom", source=self.comm_source,
                                      fill_color="color", fill_alpha="alpha", line_color=None)
        self.block_renderer = fig.quad(left="left", right="right", top="top", bottom="bottom",
                                       source=self.block_source, fill_color="color", fill_alpha="alpha",
                                       line_color="white", line_width=0.5)
        tips = [("job", "@job"), ("op", "@op"), ("block", "@name"), ("device", "@device"),
                ("start", "@start{0.000} ms"), ("end", "@end{0.000} ms"), ("duration", "@duration{0.000} ms")]
        self.block_hover = HoverTool(renderers=[self.block_renderer], tooltips=tips)
        self.comm_hover = HoverTool(renderers=[self.comm_renderer], tooltips=tips + [("bytes", "@nbytes{0,0}")])
        fig.add_tools(self.block_hover, self.comm_hover)
        fig.toolbar.active_scroll = fig.select_one({"type": WheelZoomTool})
        self.figure = fig
        self._plot_pane.object = fig

    # ------------------------------------------------------------------ syncing
    def _on_mode(self, event) -> None:
        self.select_mode(event.new)

    def select_mode(self, mode: str) -> bool:
        """Show ``predictions[mode]``; returns ``False`` (and sets :attr:`message`) when there
        is no prediction for that mode. Never raises for a user's choice."""
        if mode != self.mode:
            self.mode = mode  # the watcher calls back here
            return self.prediction is not None and self.prediction.mode == mode
        pred = (self.predictions or {}).get(mode)
        if pred is None:
            self.message = (f"no prediction for mode {mode!r} yet: predict the co-located jobs first "
                            "(the Co-locate tab's Predict co-location button)")
        else:
            self.message = ""
            self.prediction = pred
        self._sync_alert()
        return pred is not None

    @bokeh_safe
    def refresh(self) -> None:
        """Re-draw the blocks, axes and header from :attr:`prediction`."""
        blocks, comm = crossover_columns(self.prediction, scale=1e3, lanes=self.lanes)
        self.block_source.data = blocks
        self.comm_source.data = comm
        fig = self.figure
        n = self.prediction.num_devices if self.prediction is not None else 1
        fig.y_range.start, fig.y_range.end = n - 0.5, -0.5
        fig.yaxis.ticker = FixedTicker(ticks=list(range(n)))
        fig.yaxis.major_label_overrides = {i: f"device {i}" for i in range(n)}
        if self.height is None:
            fig.height = int(min(640, max(200, 90 + 60 * n)))
        end = self.prediction.makespan * 1e3 if self.prediction is not None else 1.0
        pad = 0.01 * end if end > 0 else 1.0
        fig.x_range.start, fig.x_range.end = -pad, end + pad
        self._sync_header()
        self._sync_alert()

    def _sync_header(self) -> None:
        self._header.object = crossover_header_html(self.prediction, self.predictions, self.link)

    def _sync_alert(self) -> None:
        self._alert.object = self.message
        self._alert.visible = bool(self.message)


__all__ = [
    "CROSSOVER_COLUMNS",
    "OP_ALPHA",
    "CrossoverView",
    "EMPTY_TEXT",
    "crossover_columns",
    "crossover_header_html",
    "fmt_ms",
    "fmt_rate",
    "job_color",
]
