"""Space-time Gantt view of the current plan, with memory curves and editing.

:class:`GanttView` draws one row per device (device 0 at the top, x = time in ms, or abstract
units for plans without a model), every compute block (F/B/I/W/OPTIM) as one rectangle of a
single Bokeh ``Rect`` glyph on one ``ColumnDataSource`` (coloured by kind, labelled with its
micro-batch when the plan is small), communication in a thin lane under each row, the forward
that activation recomputation runs again hatched at the start of each ``B``/``I`` block (its
seconds in the hover; :func:`planner_ui.sources.recompute_columns`), and below it
one memory step-line per device with the memory limit as a dashed ``Span``. The header shows
the schedule name, makespan, bubble ratio, peak memory and limit.

Editing (all validated by the engine through :class:`~planner_ui.state.PlanState`):

* drag a block (Bokeh ``BoxEditTool``) to a new place in its device's order; the browser's
  change of the block source arrives in :meth:`GanttView._on_blocks_data`, which finds the
  moved block and calls :meth:`GanttView.on_drag` -> ``state.drop_block``; the source is then
  re-synced from the state, so a rejected drop puts the block back;
* tap a block (or type its name) and use the form: "new position" + Move;
* Undo / Redo.

CSS hooks for browser tests (``css_classes``):

==========================  ==============================================================
``tessel-gantt``            the whole view (a ``pn.Column``)
``tessel-gantt-header``     header (HTML): ``.tessel-makespan``, ``.tessel-bubble``,
                            ``.tessel-peak-memory``, ``.tessel-memory-limit``,
                            ``.tessel-measured-makespan`` spans and the ``.tessel-gantt-legend``
``tessel-gantt-plot``       the Bokeh pane of the blocks figure
``tessel-memory-plot``      the Bokeh pane of the memory figure
``tessel-block-input``      TextInput: type a block name ("1B3") to select it
``tessel-selected-block``   HTML: the selected block, its device(s) and position
``tessel-move-device``      Select: device of a block that runs on several devices
``tessel-move-position``    IntInput: the new position in the device's order
``tessel-move-button``      Button "Move"
``tessel-undo``             Button "Undo"
``tessel-redo``             Button "Redo"
``tessel-show-comm``        Checkbox: draw communication blocks
``tessel-message``          Alert bound to ``state.message`` / ``state.message_kind``
==========================  ==============================================================

WebGL: the blocks figure uses ``output_backend="webgl"`` when the plan has more than
``webgl_threshold`` glyphs (default 1000). Small plans stay on the 2D canvas: it is exact at
any zoom, needs no GPU context (browsers cap them at ~16 per page, and the app may show several
charts) and costs nothing to start; above the threshold WebGL draws and pans the single Rect
glyph of 10,000 blocks far faster on a real GPU. The memory figure (one line per device) always
uses the canvas. Crossing the threshold (a newly loaded plan) rebuilds the two figures; an edit
never does (it assigns ``source.data`` once). Measured here, headless Chromium without a GPU
(SwiftShader WebGL) shows a 9,608-block plan about 1.3 s after the page's response with WebGL
and about 1.0 s with the canvas; pass a large ``webgl_threshold`` to force the canvas.

Source libraries: Panel (``pn.viewable.Viewer``, widgets, ``pn.pane.Bokeh``) and Bokeh
(``figure``, ``Rect``/``Quad``/``MultiLine`` glyphs, ``BoxEditTool``, ``TapTool``,
``HoverTool``, ``Span``).
"""

from __future__ import annotations

import numpy as np
import panel as pn
import param
from bokeh.models import (
    BoxEditTool,
    ColumnDataSource,
    FixedTicker,
    HoverTool,
    Legend,
    LegendItem,
    Range1d,
    Span,
    TapTool,
    WheelZoomTool,
)
from bokeh.plotting import figure

from engine.errors import TesselError
from engine.schedule import parse_action
from planner_ui.background import bokeh_safe
from planner_ui.gantt_edit import (
    BLOCK_COLUMNS,
    COMM_COLUMNS,
    MEASURED_COLUMNS,
    SCHEDULE_OPS,
    block_columns,
    find_dragged,
    header_html,
    measured_columns,
)
from planner_ui.sources import (
    COMPUTE_HEIGHT,
    PALETTE,
    RECOMPUTE_COLUMNS,
    memory_columns,
    recompute_columns,
    row_labels,
)
from planner_ui.state import EditResult, PlanState

_ALERT_TYPES = {"info": "info", "success": "success", "error": "danger"}


class GanttView(pn.viewable.Viewer):
    """Gantt chart + memory curves + edit form of ``state``'s plan.

    Parameters:
        state: the shared :class:`~planner_ui.state.PlanState` (a new empty one when omitted).
        show_comm: draw communication blocks (SEND/RECV/ALLREDUCE, and MoE ALLTOALL in their own
            colour, ``KIND_COLORS["ALLTOALL"]``) in a lane under each row.
        width: figure width in pixels; ``None`` stretches to the container.
        height: height of the blocks figure in pixels; ``None`` picks it from the device count.
        memory_height: height of the memory figure in pixels.
        webgl_threshold: above this many glyphs the figures use WebGL (see the module doc).
        label_threshold: micro-batch labels are drawn only up to this many compute blocks.

    Key methods (what the browser does, callable from tests): :meth:`on_drag`,
    :meth:`select`, :meth:`move_selected`, :meth:`undo`, :meth:`redo`, :meth:`refresh`.
    Properties: :attr:`block_count`, :attr:`webgl`, :attr:`labels_shown`.
    Errors are never raised for user mistakes; they go to ``state.message`` (kind ``"error"``).
    """

    state = param.ClassSelector(class_=PlanState, doc="shared plan state")
    show_comm = param.Boolean(default=True, doc="draw communication blocks")
    width = param.Integer(default=None, allow_None=True, bounds=(200, None), doc="figure width, px (None: stretch)")
    height = param.Integer(default=None, allow_None=True, bounds=(120, None), doc="blocks figure height, px")
    memory_height = param.Integer(default=215, bounds=(80, None), doc="memory figure height, px")
    webgl_threshold = param.Integer(default=1000, bounds=(0, None), doc="glyphs above which WebGL is used")
    label_threshold = param.Integer(default=1500, bounds=(0, None), doc="max compute blocks with labels")
    show_message = param.Boolean(default=True,
                                 doc="show state.message under the chart (the app shows it at the top instead)")

    def __init__(self, **params):
        if params.get("state") is None:
            params["state"] = PlanState()
        super().__init__(**params)
        self._syncing = False          # True while we write sources (ignore our own change events)
        self._form_syncing = False
        self._webgl: bool | None = None
        self._x = np.zeros(0)          # last synced block centres / rows (to detect drags)
        self._y = np.zeros(0)
        self._w = np.zeros(0)
        self._names: list[str] = []
        self._devices = np.zeros(0, dtype=np.int64)
        self._ops: list[str] = []
        self._tap_device: int | None = None

        self._header = pn.pane.HTML("", css_classes=["tessel-gantt-header"], sizing_mode="stretch_width")
        self._plot_pane = pn.pane.Bokeh(None, css_classes=["tessel-gantt-plot"], sizing_mode="stretch_width")
        self._mem_pane = pn.pane.Bokeh(None, css_classes=["tessel-memory-plot"], sizing_mode="stretch_width")
        self._build_form()
        self.refresh()                 # builds the figures for the right backend, then fills them
        self.state.param.watch(self._on_state, ["revision", "selected_segment", "selected_block", "measured",
                                                "memory_limit"])
        self.state.param.watch(self._on_message, ["message", "message_kind"])
        self.param.watch(lambda _e: self.refresh(), ["show_comm", "label_threshold", "webgl_threshold"])
        self._layout = pn.Column(
            self._header, self._plot_pane, self._mem_pane,
            pn.Row(self._block_input, self._device_select, self._position_input, self._move_button,
                   self._undo_button, self._redo_button, self._show_comm_box, align="end"),
            self._selected_html, *([self._alert] if self.show_message else []),
            css_classes=["tessel-gantt"], sizing_mode="stretch_width")

    def __panel__(self):
        return self._layout

    # ------------------------------------------------------------------ properties
    @property
    def block_count(self) -> int:
        """Number of compute blocks drawn (F/B/I/W/OPTIM events of the predicted timeline)."""
        return len(self._names)

    @property
    def webgl(self) -> bool:
        """The figures currently use the WebGL backend."""
        return bool(self._webgl)

    @property
    def labels_shown(self) -> bool:
        """Micro-batch labels are drawn (the plan has at most ``label_threshold`` compute blocks)."""
        return len(self.label_source.data["text"]) > 0

    # ------------------------------------------------------------------ building
    def _build_form(self) -> None:
        self._block_input = pn.widgets.TextInput(label="Block", placeholder="e.g. 1B3", width=110,
                                                 css_classes=["tessel-block-input"])
        self._block_input.param.watch(self._on_block_input, "value")
        self._device_select = pn.widgets.Select(label="Device", options={}, width=110, visible=False,
                                                css_classes=["tessel-move-device"])
        self._device_select.param.watch(lambda _e: None if self._form_syncing else self._sync_form(), "value")
        self._position_input = pn.widgets.IntInput(label="new position", value=0, start=0, width=110,
                                                   css_classes=["tessel-move-position"])
        self._move_button = pn.widgets.Button(label="Move", color="primary", disabled=True, width=80,
                                              css_classes=["tessel-move-button"])
        self._move_button.on_click(lambda _e: self.move_selected())
        self._undo_button = pn.widgets.Button(label="Undo", disabled=True, width=70, css_classes=["tessel-undo"])
        self._undo_button.on_click(lambda _e: self.undo())
        self._redo_button = pn.widgets.Button(label="Redo", disabled=True, width=70, css_classes=["tessel-redo"])
        self._redo_button.on_click(lambda _e: self.redo())
        self._show_comm_box = pn.widgets.Checkbox.from_param(self.param.show_comm, label="communication",
                                                             css_classes=["tessel-show-comm"])
        self._selected_html = pn.pane.HTML("", css_classes=["tessel-selected-block"], sizing_mode="stretch_width")
        self._alert = pn.pane.Alert("", alert_type="info", visible=False, css_classes=["tessel-message"],
                                    sizing_mode="stretch_width")
        self._on_message()

    def _build_figures(self, webgl: bool) -> None:
        """(Re)create the two figures and their sources for the given backend."""
        self._webgl = webgl
        backend = "webgl" if webgl else "canvas"
        size = {"sizing_mode": "stretch_width"} if self.width is None else {"width": self.width}
        self._range_key = None  # a new figure starts at Range1d(0, 1): fit it on the next sync
        self.block_source = ColumnDataSource({k: [] for k in BLOCK_COLUMNS}, name="tessel-gantt-blocks")
        self.comm_source = ColumnDataSource({k: [] for k in COMM_COLUMNS}, name="tessel-gantt-comm")
        self.label_source = ColumnDataSource({"x": [], "y": [], "text": [], "alpha": []})
        self.selection_source = ColumnDataSource({"x": [], "y": [], "width": [], "height": []})
        self.measured_source = ColumnDataSource({k: [] for k in MEASURED_COLUMNS})
        self.recompute_source = ColumnDataSource({k: [] for k in RECOMPUTE_COLUMNS}, name="tessel-gantt-recompute")
        self.memory_source = ColumnDataSource({"xs": [], "ys": [], "color": [], "label": []})

        fig = figure(height=self.height or 300, output_backend=backend, tools="xpan,xwheel_zoom,box_zoom,reset,save",
                     toolbar_location="above", x_range=Range1d(0, 1), y_range=Range1d(0.5, -0.5),
                     min_border_left=100, **size)
        fig.xgrid.grid_line_alpha = 0.4
        fig.ygrid.grid_line_color = None
        fig.yaxis.ticker = FixedTicker(ticks=[])
        self.comm_renderer = fig.quad(left="left", right="right", top="top", bottom="bottom", source=self.comm_source,
                                      fill_color="color", fill_alpha="alpha", line_color=None)
        self.block_renderer = fig.rect(x="x", y="y", width="width", height="height", source=self.block_source,
                                       fill_color="color", fill_alpha="alpha", line_color="white", line_width=0.5)
        # tap/drag selection must not restyle blocks (our own highlight is the outline overlay)
        self.block_renderer.selection_glyph = None
        self.block_renderer.nonselection_glyph = None
        # activation recomputation: the recomputed forward at the start of a B / I block, hatched
        self.recompute_renderer = fig.quad(left="left", right="right", top="top", bottom="bottom",
                                           source=self.recompute_source, fill_alpha=0.0, line_color=None,
                                           hatch_pattern="/", hatch_color="white", hatch_alpha=0.9,
                                           hatch_scale=8.0)
        self.label_renderer = fig.text(x="x", y="y", text="text", text_alpha="alpha", source=self.label_source,
                                       text_align="center", text_baseline="middle", text_font_size="8pt",
                                       text_color="white")
        self.measured_renderer = fig.quad(left="left", right="right", top="top", bottom="bottom",
                                          source=self.measured_source, fill_color="color", fill_alpha=0.55,
                                          line_color="black", line_width=1.2)
        self.selection_renderer = fig.rect(x="x", y="y", width="width", height="height", source=self.selection_source,
                                           fill_alpha=0.0, line_color="black", line_width=2.5)
        self.measured_legend = Legend(items=[LegendItem(label="measured", renderers=[self.measured_renderer])],
                                      location="top_right", visible=False, label_text_font_size="8pt")
        fig.add_layout(self.measured_legend)
        self.block_hover = HoverTool(renderers=[self.block_renderer], tooltips=self._block_tooltips("ms"))
        self.comm_hover = HoverTool(renderers=[self.comm_renderer], tooltips=self._comm_tooltips("ms"))
        self.measured_hover = HoverTool(renderers=[self.measured_renderer], tooltips=self._measured_tooltips("ms"))
        self.recompute_hover = HoverTool(renderers=[self.recompute_renderer], tooltips=self._recompute_tooltips("ms"))
        self.box_edit = BoxEditTool(renderers=[self.block_renderer], dimensions="both")
        fig.add_tools(self.block_hover, self.comm_hover, self.measured_hover, self.recompute_hover,
                      TapTool(renderers=[self.block_renderer]), self.box_edit)
        # BoxEditTool handles tap, press, pan and move: it is a "multi" gesture tool
        fig.toolbar.active_multi = self.box_edit
        fig.toolbar.active_scroll = fig.select_one({"type": WheelZoomTool})
        self.block_source.on_change("data", self._on_blocks_data)
        self.block_source.selected.on_change("indices", self._on_tap)
        self.figure = fig

        mem = figure(height=self.memory_height, output_backend="canvas", x_range=fig.x_range,
                     tools="xpan,xwheel_zoom,reset,save", toolbar_location="above", min_border_left=100,
                     y_range=Range1d(0, 1), **size)
        self.memory_renderer = mem.multi_line(xs="xs", ys="ys", line_color="color", line_width=1.6,
                                              source=self.memory_source, legend_field="label")
        # the legend sits below the plot area, never over the curves (Bokeh: a legend added to the
        # "below" side panel instead of the default "center" one)
        legend = mem.legend[0]
        mem.center = [r for r in mem.center if r is not legend]
        legend.orientation = "horizontal"
        legend.location = "center"
        legend.label_text_font_size = "8pt"
        legend.margin = 2
        legend.padding = 2
        legend.border_line_alpha = 0
        mem.add_layout(legend, "below")
        self.memory_legend = legend
        self.memory_span = Span(location=0, dimension="width", line_color="#d62728", line_dash="dashed",
                                line_width=2, visible=False)
        mem.add_layout(self.memory_span)
        self.memory_hover = HoverTool(renderers=[self.memory_renderer],
                                      tooltips=[("", "@label"), ("time", "$x{0.000}"), ("memory", "$y{0.000}")])
        mem.add_tools(self.memory_hover)
        self.memory_figure = mem
        self._plot_pane.object = fig
        self._mem_pane.object = mem

    @staticmethod
    def _block_tooltips(unit: str) -> list[tuple[str, str]]:
        return [("block", "@name (@op)"), ("micro-batch", "@micro_batch"), ("segment", "@segment"),
                ("device", "@device"), ("position", "@position"), ("start", f"@start{{0.000}} {unit}"),
                ("end", f"@end{{0.000}} {unit}"), ("duration", f"@duration{{0.000}} {unit}")]

    @staticmethod
    def _comm_tooltips(unit: str) -> list[tuple[str, str]]:
        return [("op", "@op"), ("what", "@what"), ("transfer", "@name"), ("micro-batch", "@micro_batch"),
                ("segment", "@segment"), ("device", "@device"), ("start", f"@start{{0.000}} {unit}"),
                ("end", f"@end{{0.000}} {unit}"), ("duration", f"@duration{{0.000}} {unit}"), ("bytes", "@nbytes{0,0}")]

    @staticmethod
    def _recompute_tooltips(unit: str) -> list[tuple[str, str]]:
        return [("block", "@name (@op)"), ("recomputed forward", f"@recompute{{0.000}} {unit} (@granularity)"),
                ("of the block", f"@duration{{0.000}} {unit}"), ("segment", "@segment"), ("device", "@device"),
                ("micro-batch", "@micro_batch")]

    @staticmethod
    def _measured_tooltips(unit: str) -> list[tuple[str, str]]:
        return [("measured", "@name (@op)"), ("device", "@device"), ("start", f"@start{{0.000}} {unit}"),
                ("end", f"@end{{0.000}} {unit}"), ("duration", f"@duration{{0.000}} {unit}")]

    # ------------------------------------------------------------------ syncing from state
    @bokeh_safe
    def _on_state(self, *events) -> None:
        names = {e.name for e in events}
        if "revision" in names:
            self.refresh()
            return
        if "selected_segment" in names:
            self._sync_blocks()
        if "selected_block" in names:
            self._sync_selection()
            self._sync_form()
        if "measured" in names:
            self._sync_measured()
            self._sync_x_range()
            self._sync_header()
        if "memory_limit" in names:
            self._sync_memory()
            self._sync_header()
        self._push()

    @bokeh_safe
    def refresh(self) -> None:
        """Re-draw everything from ``state`` (blocks, memory, overlays, header, form)."""
        cols = self._columns()
        n_glyphs = len(cols[0]["x"]) + len(cols[1]["left"])
        want_webgl = n_glyphs > self.webgl_threshold
        if want_webgl != self._webgl:
            self._build_figures(webgl=want_webgl)
        self._sync_axes()
        self._sync_blocks(cols)
        self._sync_memory()
        self._sync_measured()
        self._sync_selection()
        self._sync_header()
        self._sync_form()
        self._push()

    def _columns(self):
        st = self.state
        factor, _unit = st.time_scale
        return block_columns(st.timeline, st.schedule, scale=factor, show_comm=self.show_comm,
                             highlight_segment=st.selected_segment)

    def _sync_x_range(self) -> None:
        """Fit the time axis to the step when another plan is shown (or an edit outgrows it);
        keep the user's zoom across edits of the same plan."""
        st = self.state
        if st.timeline is None:
            return
        factor, unit = st.time_scale
        end = max(st.timeline.makespan, st.measured.makespan if st.measured is not None else 0.0) * factor
        key = (st.plan.model.name, st.schedule.num_devices, st.schedule.num_micro_batches, unit,
               st.schedule.name.removesuffix(" (edited)"))
        rng = self.figure.x_range
        if key != getattr(self, "_range_key", None) or end > rng.end:
            pad = 0.01 * end if end > 0 else 1.0
            rng.start, rng.end = -pad, end + pad
            self._range_key = key

    def _sync_axes(self) -> None:
        st = self.state
        n = st.schedule.num_devices if st.schedule is not None else (st.timeline.num_devices if st.timeline else 1)
        fig = self.figure
        fig.y_range.start, fig.y_range.end = n - 0.5, -0.5
        fig.yaxis.ticker = FixedTicker(ticks=list(range(n)))
        par = st.plan.parallel if st.plan is not None else None
        fig.yaxis.major_label_overrides = row_labels(n, tp=par.tp, dp=par.dp, layout=par.layout) if par \
            else row_labels(n)
        self._sync_x_range()
        if self.height is None:
            fig.height = int(min(640, max(200, 70 + 46 * n)))
        _f, unit = st.time_scale
        fig.xaxis.axis_label = f"time ({unit})"
        self.memory_figure.xaxis.axis_label = f"time ({unit})"
        self.memory_figure.yaxis.axis_label = f"memory ({self._memory_unit()[1]})"
        self.block_hover.tooltips = self._block_tooltips(unit)
        self.comm_hover.tooltips = self._comm_tooltips(unit)
        self.measured_hover.tooltips = self._measured_tooltips(unit)
        self.recompute_hover.tooltips = self._recompute_tooltips(unit)
        mu = self._memory_unit()[1]
        self.memory_hover.tooltips = [("", "@label"), ("time", f"$x{{0.000}} {unit}"), ("memory", f"$y{{0.000}} {mu}")]

    def _sync_blocks(self, cols=None) -> None:
        """Assign the block, communication and label sources (one ``data`` assignment each)."""
        blocks, comm, labels = cols if cols is not None else self._columns()
        self._x = np.array(blocks["x"], dtype=np.float64)
        self._y = np.array(blocks["y"], dtype=np.float64)
        self._w = np.array(blocks["width"], dtype=np.float64)
        self._names = list(blocks["name"])
        self._ops = list(blocks["op"])
        self._devices = np.array(blocks["device"], dtype=np.int64)
        if len(self._names) > self.label_threshold:
            labels = {"x": [], "y": [], "text": [], "alpha": []}
        self._syncing = True
        try:
            self.block_source.data = blocks
            self.comm_source.data = comm
            self.label_source.data = labels
            st = self.state
            self.recompute_source.data = recompute_columns(
                st.timeline, st.plan.segments if st.plan is not None else None, scale=st.time_scale[0])
        finally:
            self._syncing = False

    def _memory_unit(self) -> tuple[float, str]:
        """``(scale, unit)`` of the memory axis: units for abstract plans, GiB when a device
        peaks at 1 GiB or more, MiB below (so small models do not read 0.005 GiB)."""
        st = self.state
        if st.abstract:
            return 1.0, "units"
        peak = max(st.timeline.peak_memory(), default=0) if st.timeline is not None else 0
        return (2.0**-30, "GiB") if peak >= 2**30 else (2.0**-20, "MiB")

    def _sync_memory(self) -> None:
        st = self.state
        mem_scale = self._memory_unit()[0]
        factor, _unit = st.time_scale
        if st.timeline is None:
            self.memory_source.data = {"xs": [], "ys": [], "color": [], "label": []}
            self.memory_span.visible = False
            return
        curves = memory_columns(st.timeline, scale=factor, mem_scale=mem_scale)
        self.memory_source.data = {
            "xs": [np.asarray(c["x"], dtype=np.float64) for c in curves],
            "ys": [np.asarray(c["y"], dtype=np.float64) for c in curves],
            "color": [PALETTE[d % len(PALETTE)] for d in range(len(curves))],
            "label": [f"device {d}" for d in range(len(curves))],
        }
        peak = max((max(c["y"]) for c in curves if c["y"]), default=0.0)
        limit = st.memory_limit
        top = peak
        if limit is not None:
            self.memory_span.location = limit * mem_scale
            self.memory_span.visible = True
            # show the limit when it is within reach of the curves; a far-away limit (80 GiB over
            # a few MiB) would flatten them, the header states it anyway
            if limit * mem_scale <= 3 * max(peak, 1e-12):
                top = max(top, limit * mem_scale)
        else:
            self.memory_span.visible = False
        self.memory_figure.y_range.start = 0
        self.memory_figure.y_range.end = top * 1.15 if top > 0 else 1.0

    def _sync_measured(self) -> None:
        st = self.state
        factor, _unit = st.time_scale
        self.measured_source.data = measured_columns(st.measured, scale=factor)
        shown = st.measured is not None
        self.measured_renderer.visible = shown
        self.measured_legend.visible = shown

    def _rows_of(self, name: str) -> list[int]:
        return [i for i, n in enumerate(self._names) if n == name] if name else []

    def _sync_selection(self) -> None:
        rows = self._rows_of(self.state.selected_block)
        data = self.block_source.data
        self.selection_source.data = {
            "x": [float(self._x[i]) for i in rows], "y": [float(self._y[i]) for i in rows],
            "width": [float(data["width"][i]) for i in rows], "height": [COMPUTE_HEIGHT + 0.06 for _ in rows]}

    def _sync_header(self) -> None:
        self._header.object = header_html(self.state)

    def _block_devices(self, name: str) -> list[int]:
        s = self.state.schedule
        if s is None or not name:
            return []
        try:
            b = parse_action(name)
        except TesselError:
            return []
        return [d for d, order in enumerate(s.orders) if b in order]

    def _sync_form(self) -> None:
        st = self.state
        self._undo_button.disabled = not st.can_undo
        self._redo_button.disabled = not st.can_redo
        name = st.selected_block
        devs = self._block_devices(name)
        self._form_syncing = True
        try:
            if self._block_input.value != name:
                self._block_input.value = name
            opts = {f"device {d}": d for d in devs}
            if self._device_select.options != opts:
                cur = self._device_select.value
                self._device_select.options = opts
                pref = (self._tap_device if self._tap_device in devs
                        else (cur if cur in devs else (devs[0] if devs else None)))
                self._device_select.value = pref
            self._device_select.visible = len(devs) > 1
            if not devs:
                self._move_button.disabled = True
                self._selected_html.object = ("<i>No block selected: tap a block or type its name (e.g. 1B3).</i>"
                                              if st.plan is not None else "")
                return
            dev = self._device_select.value if self._device_select.value in devs else devs[0]
            order = st.schedule.orders[dev]
            pos = st.position_of(dev, name)
            self._position_input.end = len(order) - 1
            self._position_input.value = pos
            self._move_button.disabled = False
            b = parse_action(name)
            kind = {"F": "forward", "B": "backward", "I": "input-gradient backward",
                    "W": "weight-gradient backward"}[b.kind]
            where = ", ".join(f"device {d}" for d in devs)
            self._selected_html.object = (f"Selected <b>{name}</b>: {kind} of segment {b.segment}, micro-batch "
                                          f"{b.micro_batch}, on {where}; position {pos} of 0..{len(order) - 1} "
                                          f"on device {dev}.")
        finally:
            self._form_syncing = False

    def _on_message(self, *_events) -> None:
        st = self.state
        if not self.show_message:  # the app's message bar shows it; this alert is not on the page
            return
        self._alert.object = st.message
        self._alert.alert_type = _ALERT_TYPES.get(st.message_kind, "info")
        self._alert.visible = bool(st.message) and self.show_message

    def _push(self) -> None:
        """Send Bokeh model changes to a Jupyter output (no-op in ``panel serve`` and tests)."""
        try:
            pn.io.push_notebook(self._plot_pane, self._mem_pane)
        except Exception:  # pragma: no cover - a closed comm must not break an edit
            pass

    # ------------------------------------------------------------------ user actions
    def _error(self, text: str) -> EditResult:
        self.state.param.update(message_kind="error", message=text)
        return EditResult(False, text, "input")

    def select(self, name: str) -> bool:
        """Select the block with action string ``name`` (``"1B3"``); ``""`` clears the selection.

        Returns ``False`` (and reports an error in ``state.message``) when the name is malformed
        or the block is not in the current schedule.
        """
        name = (name or "").strip().upper() if name else ""
        st = self.state
        if not name:
            st.selected_block = ""
            return True
        if st.schedule is None:
            self._error("no plan is loaded; plan a model or run a search first")
            return False
        try:
            b = parse_action(name)
        except TesselError:
            self._error(f"'{name}' is not a block name: write <segment><F|B|I|W><micro-batch>, e.g. 1B3")
            return False
        if not self._block_devices(str(b)):
            s = st.schedule
            self._error(f"block {b} is not in this schedule ({s.num_devices} devices, micro-batches "
                        f"0..{s.num_micro_batches - 1}; segments are listed in the hover of each block)")
            return False
        if st.selected_block == str(b):
            self._sync_form()
        st.selected_block = str(b)
        return True

    @bokeh_safe
    def _on_block_input(self, event) -> None:
        if self._form_syncing:
            return
        self._tap_device = None
        self.select(event.new)
        self._push()

    def _on_tap(self, attr, old, new) -> None:
        """Browser selection (TapTool / BoxEditTool) changed: select the newest tapped block."""
        if self._syncing or not new:
            return
        added = [i for i in new if i not in set(old or [])]
        idx = (added or list(new))[-1]
        if not 0 <= idx < len(self._names):
            return
        if self._ops[idx] not in SCHEDULE_OPS:
            self.state.param.update(message_kind="info",
                                    message=f"{self._names[idx]} ({self._ops[idx]}) is not a schedule block; "
                                            "only F/B/I/W blocks can be moved")
            return
        self._tap_device = int(self._devices[idx])
        self.select(self._names[idx])
        self._push()

    def move_selected(self, position: int | None = None, device: int | None = None) -> EditResult:
        """Move the selected block to ``position`` (default: the "new position" input) in the order of
        ``device`` (default: the device selector, or the block's only device). What the Move button does."""
        st = self.state
        name = st.selected_block
        devs = self._block_devices(name)
        if not devs:
            return self._error("select a block first: tap it in the chart or type its name (e.g. 1B3)")
        if device is None:
            device = self._device_select.value if self._device_select.value in devs else devs[0]
        if position is None:
            position = int(self._position_input.value or 0)
        res = st.move_block_named(name, int(device), int(position))
        self._sync_form()
        self._push()
        return res

    def on_drag(self, name: str, new_x_display: float, new_y: float) -> EditResult:
        """A block dragged in the browser: ``name`` now centred at ``new_x_display`` (display units:
        ms, or abstract units) on row ``new_y`` (fractional device index).

        Calls ``state.drop_block(name, device=round(new_y), x=seconds)``; the engine validates the
        new order (dependency, memory, deadlock, placement). An applied edit re-simulates the plan
        (the view refreshes from ``state.revision``); otherwise the block source is re-synced from
        the state, which puts the block back, and the message explains why.
        """
        st = self.state
        rev = st.revision
        factor, _unit = st.time_scale
        try:
            op = parse_action(name).kind
        except TesselError:
            op = None
        if op not in SCHEDULE_OPS:
            res = self._error(f"{name} is not a schedule block; only F/B/I/W blocks can be moved")
        else:
            device = int(round(float(new_y)))
            n = st.schedule.num_devices if st.schedule is not None else 0
            if not 0 <= device < n:
                res = self._error(f"cannot move {name} to row {device}: this plan has devices 0..{n - 1}")
            else:
                self._tap_device = device
                res = st.drop_block(name, device, float(new_x_display) / factor)
        if st.revision == rev:      # rejected or no-op: put the block back where the plan has it
            self._sync_blocks()
            self._sync_selection()
        self._push()
        return res

    def _on_blocks_data(self, attr, old, new) -> None:
        """The block source changed in the browser (BoxEditTool drag, or an add/delete we refuse)."""
        if self._syncing:
            return
        try:
            moved = find_dragged(self._x, self._y, new.get("x", []), new.get("y", []))
        except (ValueError, TypeError):
            self._error("blocks cannot be added or deleted in the chart; drag a block to move it "
                        "(the chart was restored)")
            self._sync_blocks()
            self._sync_selection()
            self._push()
            return
        if not moved:
            return
        names = {self._names[i] for i in moved}
        if len(names) > 1 and self.state.selected_block in names:
            moved = [i for i in moved if self._names[i] == self.state.selected_block]
            names = {self.state.selected_block}
        if len(names) > 1:
            self._error("drag one block at a time (the chart was restored)")
            self._sync_blocks()
            self._sync_selection()
            self._push()
            return
        i = moved[0]
        try:
            resized = (abs(float(np.asarray(new["width"], dtype=np.float64)[i]) - float(self._w[i]))
                       > 1e-9 * max(1.0, abs(float(self._w[i]))))
        except (KeyError, IndexError, TypeError, ValueError):
            resized = True
        if resized:
            self._error("blocks can only be moved, not resized (the chart was restored)")
            self._sync_blocks()
            self._sync_selection()
            self._push()
            return
        nx = float(np.asarray(new["x"], dtype=np.float64)[i])
        ny = float(np.asarray(new["y"], dtype=np.float64)[i])
        self.on_drag(self._names[i], nx, ny)

    def undo(self) -> bool:
        """Undo the last applied edit (``state.undo``)."""
        ok = self.state.undo()
        self._sync_form()
        self._push()
        return ok

    def redo(self) -> bool:
        """Redo the last undone edit (``state.redo``)."""
        ok = self.state.redo()
        self._sync_form()
        self._push()
        return ok


__all__ = ["GanttView"]
