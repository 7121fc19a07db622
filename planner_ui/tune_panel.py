"""The Tune tab: ``tessel tune`` in the app. Search the parallel configuration of the loaded model,
see throughput against peak memory, and load any configuration into the Schedule tab.

The user sets the space (GPUs, GPUs per node, global batch, micro-batch sizes, schedules,
recomputation, CoCoNet's transformations, device type, precision, memory limit, time limit) and
presses Run. :func:`engine.tune.tune` then runs in a daemon thread
(:func:`planner_ui.background.run_in_background`); its ``progress(visited, total)`` is shown
under the button (handed to the session's loop at most every :data:`PROGRESS_PERIOD` seconds).

The result is drawn as a Bokeh scatter of the fitting configurations: tokens per second (y)
against predicted peak memory in GiB (x), coloured by the knob chosen in ``color_by`` (a
categorical palette, one legend entry per value), with the Pareto front of throughput against
memory drawn as a line through ringed points, and a hover naming the configuration and its
numbers. Beside it, a Tabulator holds the same rows (:data:`engine.tune.report.TABLE_HEADERS`),
and under them the sentence on why the runner-up loses
(:func:`engine.tune.report.why_runner_up_loses`). When nothing fits, the message bar says the
smallest change that would (:func:`engine.tune.report.nothing_fits_advice`) and the plan stays.

Tapping a point (Bokeh ``TapTool``: ``source.selected.indices``) or selecting a table row loads
that configuration's plan into :class:`~planner_ui.state.PlanState`: the tuner's own plan when it
kept it (the top rows and the Pareto front, ``TuneResult.plans``), else the configuration planned
by :func:`engine.plan.make_plan` with the same knobs, precision, sequence length and memory limit
(the tuner plans exactly as ``make_plan`` does; ``tests/engine/test_tune.py``), in a background
thread. :attr:`TunePanel.loaded` then increases: the app watches it to show the Schedule tab,
where the plan is drawn, editable and launchable like any other.

Source of the method: the tuner (Alpa, Galvatron, Metis and nnScaler search the same kind of
space over a cost model); the degrees' rules are Megatron-LM's (Narayanan et al., SC'21, 3.3).
"""

from __future__ import annotations

import threading
import time
from typing import Any, cast

import numpy as np
import pandas as pd
import panel as pn
import param
from bokeh.models import ColumnDataSource, HoverTool, NumeralTickFormatter, TapTool
from bokeh.palettes import Category10_10, Category20_20
from bokeh.plotting import figure

from engine.errors import TesselError
from engine.plan import check_memory_limit, make_plan
from engine.precision import PRECISIONS
from engine.recompute import RECOMPUTE
from engine.tune import TuneSpace, tune
from engine.tune.report import TABLE_HEADERS, nothing_fits_advice, table_row, why_runner_up_loses
from engine.tune.space import DEFAULT_SCHEDULES
from planner_ui.background import bokeh_safe, current_document, on_session_loop, run_in_background
from planner_ui.plan_form import DEVICE_TYPES
from planner_ui.search_panel import is_model_plan
from planner_ui.state import PlanState

#: Knobs the scatter can be coloured by (keys of :meth:`engine.tune.space.Candidate.knobs`).
KNOBS = ("schedule", "tp", "pp", "dp", "virtual_stages", "micro_batch_size", "micro_batches", "recompute",
         "transforms", "optimizer")

#: Columns of the scatter's source (:attr:`TunePanel.source`), one entry per fitting row.
POINT_COLUMNS = ("row", "rank", "label", "x", "y", "step_ms", "mfu", "bubble", "knob", "color", "pareto")

#: Most seconds between two progress updates handed to the page.
PROGRESS_PERIOD = 0.2

_GIB = float(2**30)


def parse_sizes(text: str) -> tuple[int, ...]:
    """Micro-batch sizes typed as ``"1,2,4"`` -> ``(1, 2, 4)``.

    Raises:
        TesselError: not whole numbers above 0 separated by commas (one sentence).
    """
    try:
        values = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise TesselError(f"micro-batch sizes must be whole numbers above 0 separated by commas, got {text!r}")
    return values


def knob_value(candidate, knob: str) -> str:
    """The value of ``knob`` of ``candidate`` as a legend label (``none`` for no transformation)."""
    v = candidate.knobs()[knob]
    return str(v) if v != "" else "none"


def knob_colors(values: list[str]) -> dict[str, str]:
    """A categorical colour per distinct value (numbers in numeric order, else text order):
    Bokeh's ``Category10`` up to ten values, ``Category20`` beyond (cycled past twenty)."""
    distinct = sorted(set(values), key=lambda v: (0, float(v), v) if v.replace(".", "", 1).isdigit() else (1, 0.0, v))
    palette = Category10_10 if len(distinct) <= 10 else Category20_20
    return {v: palette[i % len(palette)] for i, v in enumerate(distinct)}


class TunePanel(pn.viewable.Viewer):
    """The Tune tab over one :class:`~planner_ui.state.PlanState`.

    Construct with ``TunePanel(state=state)``. Inputs are parameters (settable from code, shown as
    widgets): ``model`` (the loaded model plan's by default), ``gpus``, ``gpus_per_node``,
    ``global_batch`` (samples per step), ``micro_batch_sizes`` (text ``"1,2"``), ``schedules``,
    ``recompute``, ``sharded_update``, ``sequence_parallel``, ``overlap_grad_sync``,
    ``device_type``, ``precision`` (``default``: the device type's), ``seq_len`` (``None``: the
    model's), ``memory_limit`` (GiB per device; ``None``: the device's capacity), ``time_limit``
    (s), and ``color_by`` (:data:`KNOBS`).

    Methods: :meth:`start` (tune in the background), :meth:`run` (``wait=True``: blocking, for
    tests and notebooks), :meth:`load_row` (load a row's plan), :meth:`select_point` (what a tap
    on the scatter does), :meth:`join`.

    Outputs: :attr:`result` (the last :class:`~engine.tune.TuneResult`), :attr:`source` (the
    scatter's ``ColumnDataSource``, :data:`POINT_COLUMNS`, named ``tessel-tune-points``),
    :attr:`table` (a ``pn.widgets.Tabulator``), ``progress_text``, ``why_text``, ``running``,
    ``loaded`` (bumped after each row loaded into the state), ``loaded_row`` (that row's index in
    ``result.rows``). Errors (an empty space, an unknown model, bad sizes) go to
    ``state.message`` as one sentence with kind ``"error"``; the plan stays.
    """

    state = param.ClassSelector(class_=PlanState, doc="the shared planner state")
    model = param.String(default="gpt2", doc="model to tune (the loaded model plan's by default)")
    gpus = param.Integer(default=4, bounds=(1, 1 << 20), doc="devices in all (tp x pp x dp)")
    gpus_per_node = param.Integer(default=8, bounds=(1, 1024), doc="devices per node (tp stays inside a node)")
    global_batch = param.Integer(default=8, bounds=(1, 1 << 30), doc="samples per optimizer step")
    micro_batch_sizes = param.String(default="1,2", doc="micro-batch sizes to try, e.g. 1,2,4")
    schedules = param.ListSelector(default=["1f1b", "interleaved", "zb-h1"], objects=list(DEFAULT_SCHEDULES),
                                   doc="predefined schedules to try")
    recompute = param.ListSelector(default=["none", "full"], objects=list(RECOMPUTE),
                                   doc="recomputation granularities to try")
    sharded_update = param.Boolean(default=True, doc="try CoCoNet's sharded update (ZeRO-1) where dp > 1")
    sequence_parallel = param.Boolean(default=False, doc="try tp-split (sequence parallelism) where tp > 1")
    overlap_grad_sync = param.Boolean(default=False, doc="try overlapped gradient all-reduce where dp > 1")
    device_type: param.Selector = param.Selector(default="h100", objects=DEVICE_TYPES, doc="cost table of one device")
    precision: param.Selector = param.Selector(default="default", objects=["default", *PRECISIONS],
                               doc="precision policy (default: the device type's)")
    seq_len = param.Integer(default=None, allow_None=True, bounds=(1, None), doc="tokens per sample (None: model's)")
    memory_limit = param.Number(default=None, allow_None=True, bounds=(0, None),
                                doc="GiB per device; None = the device's capacity")
    time_limit = param.Number(default=60.0, bounds=(0.1, 36000), doc="seconds for the whole search")
    color_by: param.Selector = param.Selector(default="schedule", objects=list(KNOBS),
                                              doc="knob that colours the scatter")

    running = param.Boolean(default=False, doc="a search (or a row's planning) is running")
    progress_text = param.String(default="", doc="candidates visited of all, elapsed seconds")
    why_text = param.String(default="", doc="why the runner-up loses, or why nothing fits")
    loaded = param.Integer(default=0, doc="bumped after each row loaded into the state (the app shows the Schedule)")
    loaded_row = param.Integer(default=None, allow_None=True, doc="index in result.rows of the row loaded last")

    def __init__(self, **params):
        super().__init__(**params)
        if self.state is None:
            self.state = PlanState()
        self.result = None
        self._result_model, self._result_kwargs = "", {}
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._last_progress = 0.0
        self._model_key: str | None = None
        self._from_plan(keep=set(params))
        self._st.param.watch(lambda *_: self._from_plan(), "plan")
        self._build()

    @property
    def _st(self) -> PlanState:
        return cast(PlanState, self.state)

    def _from_plan(self, keep: set[str] | frozenset[str] = frozenset()) -> None:
        """A model plan of another model: tune that model, on its devices, device type and sequence length
        (except the parameters in ``keep``)."""
        plan: Any = self._st.plan
        if not is_model_plan(plan) or plan.model.name == self._model_key:
            return
        self._model_key = plan.model.name
        device = (plan.cost.get("device") or {}).get("name") if isinstance(plan.cost, dict) else None
        start: dict[str, Any] = {"model": plan.model.name, "gpus": max(1, int(plan.parallel.devices)),
                                 "seq_len": plan.model.seq_len or None}
        if device in DEVICE_TYPES:
            start["device_type"] = device
        self.param.update(**{k: v for k, v in start.items() if k not in keep})

    # ------------------------------------------------------------------ widgets
    def _build(self) -> None:
        w = pn.widgets
        self.source = ColumnDataSource({k: [] for k in POINT_COLUMNS}, name="tessel-tune-points")
        self.pareto_source = ColumnDataSource({"x": [], "y": []}, name="tessel-tune-pareto")
        fig = figure(height=420, width=620, tools="pan,wheel_zoom,box_zoom,reset",
                     x_axis_label="peak memory (GiB)", y_axis_label="tokens/s", title="Tokens/s against peak memory")
        fig.line("x", "y", source=self.pareto_source, line_color="#444444", line_dash="dashed", line_width=1.5,
                 legend_label="Pareto front")
        fig.scatter("x", "y", source=self.pareto_source, size=17, fill_color=None, line_color="#222222",
                    line_width=2, legend_label="Pareto front")
        self.points = fig.scatter("x", "y", source=self.source, size=11, fill_color="color", line_color="color",
                                  fill_alpha=0.8, legend_field="knob", nonselection_fill_alpha=0.35,
                                  nonselection_line_alpha=0.35)
        fig.add_tools(TapTool(renderers=[self.points]),
                      HoverTool(renderers=[self.points], tooltips=[
                          ("", "@label"), ("rank", "@rank"), ("tokens/s", "@y{0,0}"), ("step", "@step_ms{0.000} ms"),
                          ("peak", "@x{0.000} GiB"), ("MFU", "@mfu{0.0} %"), ("bubble", "@bubble{0.0} %"),
                          ("Pareto", "@pareto")]))
        fig.yaxis.formatter = NumeralTickFormatter(format="0,0")
        legend = fig.legend[0]   # beside the plot, never over a point a user may click
        fig.center = [m for m in fig.center if m is not legend]
        fig.add_layout(legend, "right")
        legend.title = self.color_by
        self.figure = fig
        self.source.selected.on_change("indices", self._on_tap)
        self.table = w.Tabulator(pd.DataFrame(columns=[*TABLE_HEADERS, "Pareto"]), selectable=1, disabled=True,
                                 show_index=False, height=420, sizing_mode="stretch_width", pagination=None,
                                 css_classes=["tessel-tune-table"])
        self.table.param.watch(self._on_table_selection, "selection")
        self._table_rows: list[int] = []
        self.run_button = w.Button(label="Run tune", color="primary", css_classes=["tessel-tune-run"])
        self.run_button.on_click(lambda _e: None if self.start() else None)
        self.progress_pane = pn.pane.Markdown("", css_classes=["tessel-tune-progress"])
        self.why_pane = pn.pane.Markdown("", css_classes=["tessel-tune-why"], sizing_mode="stretch_width")
        self.param.watch(self._sync_widgets, ["running", "progress_text", "why_text"])
        self.param.watch(lambda *_: self._recolor(), ["color_by"])

    def _input(self, name: str, widget, label: str, **kw):
        return widget.from_param(self.param[name], name=label, css_classes=[f"tessel-tune-{name.replace('_', '-')}"],
                                 **kw)

    def _sync_widgets(self, *_events) -> None:
        self.run_button.disabled = self.running
        self.progress_pane.object = self.progress_text
        self.why_pane.object = self.why_text

    def __panel__(self):
        w = pn.widgets
        form = pn.Column(
            pn.Row(self._input("model", w.TextInput, "Model"), self._input("gpus", w.IntInput, "GPUs"),
                   self._input("gpus_per_node", w.IntInput, "GPUs per node"),
                   self._input("global_batch", w.IntInput, "Global batch (samples)"),
                   self._input("micro_batch_sizes", w.TextInput, "Micro-batch sizes")),
            pn.Row(self._input("schedules", w.MultiChoice, "Schedules"),
                   self._input("recompute", w.MultiChoice, "Recomputation"),
                   self._input("device_type", w.Select, "Device type"),
                   self._input("precision", w.Select, "Precision")),
            pn.Row(self._input("seq_len", w.IntInput, "Sequence length"),
                   self._input("memory_limit", w.FloatInput, "Memory limit (GiB; blank: the device's)"),
                   self._input("time_limit", w.FloatInput, "Time limit (s)"),
                   pn.Column(self._input("sharded_update", w.Checkbox, "Sharded update"),
                             self._input("sequence_parallel", w.Checkbox, "Sequence parallelism (tp-split)"),
                             self._input("overlap_grad_sync", w.Checkbox, "Overlapped gradient sync"))),
        )
        return pn.Column(
            form, pn.Row(self.run_button, self.progress_pane),
            pn.Row(pn.Column(self._input("color_by", w.Select, "Colour by"), pn.pane.Bokeh(self.figure),
                             css_classes=["tessel-tune-plot"], width=640),
                   self.table, sizing_mode="stretch_width"),
            self.why_pane,
            css_classes=["tessel-tune-panel"], sizing_mode="stretch_width",
        )

    # ------------------------------------------------------------------ running
    def space(self) -> TuneSpace:
        """The :class:`~engine.tune.TuneSpace` of the inputs.

        Raises:
            TesselError: bad micro-batch sizes, no schedule or recomputation chosen, or a space the
                tuner refuses (:class:`engine.tune.TuneSpaceError`), in one sentence.
        """
        return TuneSpace(gpus=int(self.gpus), global_batch=int(self.global_batch),
                         gpus_per_node=int(self.gpus_per_node), micro_batch_sizes=parse_sizes(self.micro_batch_sizes),
                         schedules=tuple(self.schedules), recompute=tuple(self.recompute),
                         sharded_update=bool(self.sharded_update), sequence_parallel=bool(self.sequence_parallel),
                         overlap_grad_sync=bool(self.overlap_grad_sync))

    def _tune_kwargs(self) -> dict:
        limit = None if self.memory_limit is None else check_memory_limit(self.memory_limit) * _GIB
        return {"device_type": self.device_type, "precision": None if self.precision == "default" else self.precision,
                "seq_len": self.seq_len, "memory_limit": limit, "time_limit": float(self.time_limit)}

    def start(self) -> bool:
        """Tune in a background thread; ``False`` (and a one-sentence message) when it cannot start."""
        if self.running:
            self._say("a search is already running; wait for it to finish", "error")
            return False
        model = self.model.strip()
        try:
            if not model:
                raise TesselError("no model to tune: plan a model first or type its name in Model")
            space, kwargs = self.space(), self._tune_kwargs()
        except TesselError as e:
            self._say(f"cannot tune: {e}", "error")
            return False
        doc = current_document()
        self._t0 = self._last_progress = time.perf_counter()

        def progress(done: int, total: int) -> None:   # the tuner's thread: hand the text to the page
            now = time.perf_counter()
            if now - self._last_progress >= PROGRESS_PERIOD or done == total:
                self._last_progress = now
                text = f"tuning {model}: {done} of {total} configurations, {now - self._t0:.1f} s"
                on_session_loop(doc, lambda: self._set_progress(text))

        self.param.update(running=True, progress_text=f"tuning {model} on {space.gpus} GPUs...")
        self._say(f"tuning {model} on {space.gpus} {self.device_type} GPUs, global batch {space.global_batch}", "info")
        self._thread = run_in_background(lambda: tune(model, space, progress=progress, **kwargs),
                                         lambda res, err: self._finish(model, kwargs, res, err), name="tessel-tune")
        return True

    def _set_progress(self, text: str) -> None:
        if self.running:
            self.progress_text = text

    def join(self, timeout: float | None = None) -> None:
        """Wait for the background thread (a search or a row's planning) to finish."""
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self, wait: bool = True):
        """Tune; with ``wait=True`` block until done and return the :class:`~engine.tune.TuneResult`
        (``None`` when it failed: see ``state.message``)."""
        if not self.start():
            return None
        if wait:
            self.join()
        return self.result

    @bokeh_safe
    def _finish(self, model: str, kwargs: dict, res, err: BaseException | None) -> None:
        self.running = False
        if err is not None:
            self.progress_text = ""
            what = str(err) if isinstance(err, (TesselError, ValueError)) else f"{type(err).__name__}: {err}"
            self._say(f"cannot tune {model}: {what}", "error")
            return
        self.result = res
        self._result_model, self._result_kwargs = model, kwargs
        self._fill(res)
        counts = res.counts()
        fit = counts["ok"]
        self.progress_text = (f"{len(res.rows)} configurations in {res.wall_time:.1f} s: {fit} fit, "
                              f"{counts['over memory'] + counts['memory bound']} over memory, "
                              f"{counts['dominated']} dominated, {counts['refused']} refused"
                              + (f", {counts['not visited']} not visited (time limit)" if res.timed_out else ""))
        if res.best is None:
            self.why_text = nothing_fits_advice(res)
            self._say(self.why_text, "error")
            return
        best = res.rows[0]
        self.why_text = why_runner_up_loses(res) or "only one configuration fits"
        self._say(f"tuned {model}: best {best.candidate.label()}, {best.tokens_per_second:,.0f} tokens/s, "
                  f"{best.peak_memory / _GIB:.3g} GiB; click a point or a row to load its plan", "success")

    # ------------------------------------------------------------------ drawing
    def _fill(self, res) -> None:
        """The scatter, the Pareto line and the table from ``res``'s fitting rows."""
        fit = [i for i, r in enumerate(res.rows) if r.fits]
        front = set(res.pareto)
        data: dict[str, Any] = {k: [] for k in POINT_COLUMNS}
        for i in fit:
            r = res.rows[i]
            data["row"].append(i)
            data["rank"].append(i + 1)
            data["label"].append(r.candidate.label())
            data["x"].append(r.peak_memory / _GIB)
            data["y"].append(r.tokens_per_second)
            data["step_ms"].append(r.step_time * 1e3)
            data["mfu"].append(float("nan") if r.mfu is None else r.mfu * 100)
            data["bubble"].append(r.bubble_ratio * 100)
            data["pareto"].append("yes" if i in front else "no")
        for k in ("row", "rank"):
            data[k] = np.array(data[k], dtype=np.int64)
        for k in ("x", "y", "step_ms", "mfu", "bubble"):
            data[k] = np.array(data[k], dtype=np.float64)
        data["knob"], data["color"] = self._knob_columns([res.rows[i] for i in fit])
        pts = sorted((res.rows[i].peak_memory / _GIB, res.rows[i].tokens_per_second) for i in res.pareto)
        self.source.selected.indices = []
        self.source.data = data
        self.pareto_source.data = {"x": [p[0] for p in pts], "y": [p[1] for p in pts]}
        self.figure.legend.title = self.color_by
        self._table_rows = fit
        table = [[*table_row(i + 1, res.rows[i]), "yes" if i in front else ""] for i in fit]
        self.table.selection = []
        self.table.value = pd.DataFrame(table, columns=[*TABLE_HEADERS, "Pareto"])

    def _knob_columns(self, rows) -> tuple[list[str], list[str]]:
        values = [knob_value(r.candidate, self.color_by) for r in rows]
        colors = knob_colors(values)
        return values, [colors[v] for v in values]

    @bokeh_safe
    def _recolor(self) -> None:
        """Colour the points by ``color_by`` (one assignment of the source's columns)."""
        if self.result is None:
            return
        rows = [self.result.rows[i] for i in self.source.data["row"]]
        knob, color = self._knob_columns(rows)
        self.source.data = {**dict(self.source.data), "knob": knob, "color": color}
        self.figure.legend.title = self.color_by

    # ------------------------------------------------------------------ loading a row
    def _on_tap(self, _attr, _old, new) -> None:
        if new:   # overlapping points: the best ranked of them
            self.load_row(min(int(self.source.data["row"][k]) for k in new), wait=False)

    def _on_table_selection(self, event) -> None:
        if event.new and self._table_rows:
            self.load_row(self._table_rows[event.new[0]], wait=False)

    def select_point(self, k: int, wait: bool = True) -> None:
        """Select point ``k`` of the scatter, as a tap does (its plan is loaded; ``wait``: join
        the planning thread, if any)."""
        self.source.selected.indices = [k]
        if wait:
            self.join()

    def load_row(self, index: int, wait: bool = True) -> bool:
        """Load the plan of ``result.rows[index]`` into the state.

        The tuner's kept plan (``result.plans``) is loaded at once; another row is planned by
        :func:`engine.plan.make_plan` with its knobs in a background thread (``wait``: joined).
        Returns ``False`` (and a message) when there is no such simulated row or a search runs.
        """
        res = self.result
        if res is None or not 0 <= index < len(res.rows) or res.rows[index].step_time is None:
            self._say("no such configuration: run tune first, then click a point or a row", "error")
            return False
        if self.running:
            self._say("wait for the running search or planning to finish", "error")
            return False
        kept = res.plans.get(index)
        if kept is not None:
            self._apply(index, kept, None)
            return True
        c = res.rows[index].candidate
        self.running = True
        self._say(f"planning {c.label()} ...", "info")
        self._thread = run_in_background(lambda: self._plan_row(index), lambda got, err: self._apply(index, got, err),
                                         name="tessel-tune-plan")
        if wait:
            self.join()
        return True

    def _plan_row(self, index: int):
        """``result.rows[index]`` planned by ``make_plan`` as the tuner planned it."""
        res = self.result
        c = res.rows[index].candidate
        kw = self._result_kwargs
        return make_plan(self._result_model, devices=c.gpus, dp=c.dp, tp=c.tp, dp_shard=c.dp_shard,
                         micro_batches=c.micro_batches,
                         micro_batch_size=c.micro_batch_size, schedule=c.schedule, virtual_stages=c.virtual_stages,
                         recompute=c.recompute, transforms=list(c.transforms), optimizer=c.optimizer,
                         seq_len=kw["seq_len"], device_type=kw["device_type"], precision=kw["precision"],
                         memory_limit=res.memory_limit)

    @bokeh_safe
    def _apply(self, index: int, got, err: BaseException | None) -> None:
        self.running = False
        row = self.result.rows[index]
        label = row.candidate.label()
        if err is not None:
            what = str(err) if isinstance(err, (TesselError, ValueError)) else f"{type(err).__name__}: {err}"
            self._say(f"cannot plan {label}: {what}", "error")
            return
        self._st.load(got.plan, graph=got.graph,
                      message=f"loaded the tuned configuration #{index + 1} of {self._result_model}: {label}, "
                              f"step {row.step_time * 1e3:.4g} ms, {row.tokens_per_second:,.0f} tokens/s, "
                              f"peak {row.peak_memory / _GIB:.3g} GiB")
        self._st.message_kind = "success"
        self.loaded_row = index
        self.loaded += 1

    def _say(self, text: str, kind: str) -> None:
        self._st.message_kind = kind
        self._st.message = text


__all__ = ["TunePanel", "KNOBS", "POINT_COLUMNS", "knob_colors", "knob_value", "parse_sizes"]
