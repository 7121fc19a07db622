"""Gantt of a chunk-streamed GNN plan: a load lane and a compute lane per device, memory against the budget.

:class:`GNNPlanView` draws the predicted epoch of a :class:`~engine.gnn.plan.GNNPlan` (simulated by
:func:`engine.gnn.simulate.simulate_gnn`; NGra, USENIX ATC'19, section 4): two rows per device,
device 0 at the top, x = time in ms,

* the compute lane: every chunk's Scatter/ApplyEdge/Gather (forward ``F`` blue, backward ``B``
  orange, as the project's Gantt colours them), the dense ``apply_vertex_pre``/``apply_vertex`` of
  the device's intervals, the optimizer step;
* the load lane: every chunk load (host to device), running one chunk ahead of the compute, and
  the collectives between layers (all-gather of the vertex data, reduce-scatter of the source
  gradients, all-reduce of the parameter gradients);

and under them one memory step-line per device with the plan's budget as a dashed line. The header
states the graph and model, the predicted epoch time, P, the devices and the peak memory against
the budget.

The column data is the project Gantt's own (:func:`planner_ui.gantt_edit.block_columns` over the
Timeline: compute events as rectangles, the other streams as quads; :func:`planner_ui.sources.memory_columns`
for the curves), moved into the two lanes by :func:`gnn_lane_columns` (pure, tested without a
browser).

CSS hooks for browser tests (``css_classes``):

==========================  ==============================================================
``tessel-gnn-view``         the whole view (a ``pn.Column``)
``tessel-gnn-header``       header (HTML): ``.tessel-gnn-epoch``, ``.tessel-gnn-partitions``,
                            ``.tessel-gnn-devices``, ``.tessel-gnn-peak``, ``.tessel-gnn-budget``
                            and ``.tessel-gnn-over`` (only when a device exceeds the budget)
``tessel-gnn-gantt``        the Bokeh pane of the lanes figure
``tessel-gnn-memory``       the Bokeh pane of the memory figure
==========================  ==============================================================

Source libraries: Panel (``pn.viewable.Viewer``, ``pn.pane.Bokeh``, ``pn.pane.HTML``) and Bokeh
(``figure``, ``Rect``/``Quad``/``MultiLine`` glyphs, ``HoverTool``, ``Span``, ``FixedTicker``).
"""

from __future__ import annotations

import html

import numpy as np
import panel as pn
import param
from bokeh.models import ColumnDataSource, FixedTicker, HoverTool, Range1d, Span
from bokeh.plotting import figure

from engine.gnn.plan import GNNPlan
from engine.gnn.simulate import GNNSimulation, simulate_gnn
from planner_ui.background import bokeh_safe
from planner_ui.gantt_edit import BLOCK_COLUMNS, COMM_COLUMNS, block_columns, fmt_memory
from planner_ui.sources import KIND_COLORS, PALETTE, memory_columns

#: Colour of a chunk load (the project's KIND_COLORS has none for the ``load`` stream).
LOAD_COLOR = "#8CB5D9"
#: Height of a compute rectangle and of a load-lane quad (a lane is 1 unit).
LANE_HEIGHT = 0.72


def gnn_lane_columns(sim: GNNSimulation | None, *, scale: float = 1e3) -> tuple[dict, dict]:
    """The lanes' column data: ``(compute, loads)``.

    ``compute``: :func:`~planner_ui.gantt_edit.block_columns`' blocks (every compute-stream
    event as a Rect: ``x`` centre, ``width``, ``y``, ``height``, hover fields) with ``y = 2 d``, the
    compute lane of device ``d``. ``loads``: its communication quads (the ``load`` and
    ``collective`` streams, positive durations) with ``top``/``bottom`` around ``2 d + 1``, the
    load lane of device ``d``; loads coloured :data:`LOAD_COLOR`. Times in display units
    (``scale`` x seconds, ms by default).
    """
    if sim is None:
        return {k: [] for k in BLOCK_COLUMNS}, {k: [] for k in COMM_COLUMNS}
    blocks, comm, _labels = block_columns(sim.timeline, None, scale=scale, show_comm=True)
    blocks["y"] = 2.0 * np.asarray(blocks["device"], dtype=np.float64)
    blocks["height"] = np.full(len(blocks["y"]), LANE_HEIGHT)
    lane = 2.0 * np.asarray(comm["device"], dtype=np.float64) + 1.0
    comm["top"], comm["bottom"] = lane - LANE_HEIGHT / 2.0, lane + LANE_HEIGHT / 2.0
    comm["color"] = [LOAD_COLOR if op == "LOAD" else c for op, c in zip(comm["op"], comm["color"])]
    comm["what"] = ["chunk load (host to device)" if op == "LOAD" else w for op, w in zip(comm["op"], comm["what"])]
    return blocks, comm


def gnn_header_html(plan: GNNPlan | None, sim: GNNSimulation | None) -> str:
    """The header: graph, model, epoch time, P, devices, peak memory per device against the budget."""
    if plan is None or sim is None:
        return '<div class="tessel-gnn-summary">No GNN plan loaded: run <code>tessel plan --gnn</code>.</div>'
    peaks = sim.timeline.peak_memory()
    peak = max(peaks, default=0)
    budget = plan.budget_bytes
    over = [d for d, p in enumerate(peaks) if p > budget]
    m = plan.model
    graph = html.escape(plan.graph_spec or f"{plan.graph.num_vertices:,} vertices")
    heads = f", {m.heads} heads" if int(getattr(m, "heads", 1) or 1) > 1 else ""
    per_dev = ", ".join(f"d{d}: {fmt_memory(p, False)}" for d, p in enumerate(peaks))
    parts = [
        f"<b>{html.escape(str(m.kind))}</b> ({m.layers} layers, hidden {m.hidden}{heads}) on <b>{graph}</b> "
        f"({plan.graph.num_vertices:,} vertices, {plan.graph.num_edges:,} edges)",
        f'epoch <b class="tessel-gnn-epoch">{sim.epoch_time * 1e3:,.3f} ms</b> predicted',
        f'P = <b class="tessel-gnn-partitions">{plan.partitions}</b> ({plan.chunk_source} chunk sizes)',
        f'<b class="tessel-gnn-devices">{plan.num_devices}</b> &times; {html.escape(plan.device_type)}',
        f'peak memory <b class="tessel-gnn-peak">{fmt_memory(peak, False)}</b>'
        f' <span style="color:#666" title="per device">({per_dev})</span>',
        f'budget <b class="tessel-gnn-budget">{fmt_memory(budget, False)}</b>'
        + (f' <span class="tessel-gnn-over" style="color:#c00">over on device(s) {over}</span>' if over else ""),
    ]
    legend = " ".join(
        f'<span style="display:inline-block;width:10px;height:10px;background:{color};margin:0 3px 0 8px"></span>'
        f"{label}" for label, color in (("forward", KIND_COLORS["F"]), ("backward", KIND_COLORS["B"]),
                                        ("load", LOAD_COLOR), ("all-gather", KIND_COLORS["ALLGATHER"]),
                                        ("reduce-scatter", KIND_COLORS["REDUCESCATTER"]),
                                        ("all-reduce", KIND_COLORS["ALLREDUCE"]), ("optimizer", KIND_COLORS["OPTIM"])))
    return ('<div class="tessel-gnn-summary">' + " &middot; ".join(parts) + "</div>"
            + f'<div class="tessel-gnn-legend" style="font-size:85%">{legend}</div>')


class GNNPlanView(pn.viewable.Viewer):
    """The lanes Gantt and memory curves of a GNN plan (see the module docstring).

    Parameters:
        plan: the :class:`~engine.gnn.plan.GNNPlan` shown (``None``: an empty view).
        width: figure width in pixels; ``None`` stretches to the container.
        memory_height: height of the memory figure in pixels.
        webgl_threshold: above this many glyphs the lanes figure uses WebGL (as the project's Gantt).

    Attributes:
        simulation: the :class:`~engine.gnn.simulate.GNNSimulation` drawn (``None`` without a plan).
        compute_source, load_source, memory_source: the Bokeh sources (read by the tests).
        budget_span: the dashed budget line of the memory figure.
    """

    plan = param.ClassSelector(class_=GNNPlan, allow_None=True, doc="the GNN plan shown")
    width = param.Integer(default=None, allow_None=True, bounds=(200, None), doc="figure width, px (None: stretch)")
    memory_height = param.Integer(default=200, bounds=(80, None), doc="memory figure height, px")
    webgl_threshold = param.Integer(default=1000, bounds=(0, None), doc="glyphs above which WebGL is used")

    def __init__(self, **params):
        super().__init__(**params)
        self.simulation: GNNSimulation | None = None
        self._header = pn.pane.HTML("", css_classes=["tessel-gnn-header"], sizing_mode="stretch_width")
        self._plot_pane = pn.pane.Bokeh(None, css_classes=["tessel-gnn-gantt"], sizing_mode="stretch_width")
        self._mem_pane = pn.pane.Bokeh(None, css_classes=["tessel-gnn-memory"], sizing_mode="stretch_width")
        self._layout = pn.Column(self._header, self._plot_pane, self._mem_pane, css_classes=["tessel-gnn-view"],
                                 sizing_mode="stretch_width")
        self.refresh()
        self.param.watch(lambda _e: self.refresh(), ["plan", "webgl_threshold"])

    def __panel__(self):
        return self._layout

    @property
    def webgl(self) -> bool:
        """The lanes figure uses the WebGL backend."""
        return self.figure.output_backend == "webgl"

    @bokeh_safe
    def refresh(self) -> None:
        """Simulate the plan (without raising for memory: an over-budget plan is shown as such) and redraw."""
        self.simulation = simulate_gnn(self.plan, check_memory=False) if self.plan is not None else None
        compute, loads = gnn_lane_columns(self.simulation)
        self._build(len(compute["x"]) + len(loads["left"]) > self.webgl_threshold)
        self.compute_source.data = compute
        self.load_source.data = loads
        self._sync_axes()
        self._sync_memory()
        self._header.object = gnn_header_html(self.plan, self.simulation)

    def _build(self, webgl: bool) -> None:
        size = {"sizing_mode": "stretch_width"} if self.width is None else {"width": self.width}
        self.compute_source = ColumnDataSource({k: [] for k in BLOCK_COLUMNS}, name="tessel-gnn-compute")
        self.load_source = ColumnDataSource({k: [] for k in COMM_COLUMNS}, name="tessel-gnn-loads")
        self.memory_source = ColumnDataSource({"xs": [], "ys": [], "color": [], "label": []})
        fig = figure(height=300, output_backend="webgl" if webgl else "canvas",
                     tools="xpan,xwheel_zoom,box_zoom,reset,save", toolbar_location="above", x_range=Range1d(0, 1),
                     y_range=Range1d(1.5, -0.5), min_border_left=120, **size)
        fig.xgrid.grid_line_alpha = 0.4
        fig.ygrid.grid_line_color = None
        fig.xaxis.axis_label = "time (ms)"
        self.load_renderer = fig.quad(left="left", right="right", top="top", bottom="bottom", source=self.load_source,
                                      fill_color="color", fill_alpha=0.9, line_color="white", line_width=0.3)
        self.compute_renderer = fig.rect(x="x", y="y", width="width", height="height", source=self.compute_source,
                                         fill_color="color", fill_alpha="alpha", line_color="white", line_width=0.3)
        fig.add_tools(HoverTool(renderers=[self.compute_renderer], tooltips=[
            ("compute", "@name (@op)"), ("device", "@device"), ("start", "@start{0.000} ms"),
            ("end", "@end{0.000} ms"), ("duration", "@duration{0.000} ms")]))
        fig.add_tools(HoverTool(renderers=[self.load_renderer], tooltips=[
            ("", "@what"), ("event", "@name"), ("device", "@device"), ("start", "@start{0.000} ms"),
            ("end", "@end{0.000} ms"), ("duration", "@duration{0.000} ms"), ("bytes", "@nbytes{0,0}")]))
        self.figure = fig
        mem = figure(height=self.memory_height, tools="xpan,xwheel_zoom,reset,save", toolbar_location="above",
                     x_range=fig.x_range, y_range=Range1d(0, 1), min_border_left=120, **size)
        mem.xaxis.axis_label = "time (ms)"
        self.memory_renderer = mem.multi_line(xs="xs", ys="ys", line_color="color", line_width=1.6,
                                              source=self.memory_source, legend_field="label")
        mem.legend.location = "top_left"
        mem.legend.orientation = "horizontal"
        mem.legend.label_text_font_size = "8pt"
        self.budget_span = Span(location=0, dimension="width", line_color="#d62728", line_dash="dashed", line_width=2)
        mem.add_layout(self.budget_span)
        mem.add_tools(HoverTool(renderers=[self.memory_renderer],
                                tooltips=[("", "@label"), ("time", "$x{0.000} ms"), ("memory", "$y{0.000}")]))
        self.memory_figure = mem
        self._plot_pane.object = fig
        self._mem_pane.object = mem

    def _memory_unit(self) -> tuple[float, str]:
        """GiB when a device peaks at 1 GiB or more, MiB below (as the project's Gantt)."""
        peak = max(self.simulation.timeline.peak_memory(), default=0) if self.simulation is not None else 0
        return (2.0**-30, "GiB") if peak >= 2**30 else (2.0**-20, "MiB")

    def _sync_axes(self) -> None:
        n = self.plan.num_devices if self.plan is not None else 1
        fig = self.figure
        fig.y_range.start, fig.y_range.end = 2 * n - 0.5, -0.5
        fig.yaxis.ticker = FixedTicker(ticks=list(range(2 * n)))
        fig.yaxis.major_label_overrides = {k: f"device {k // 2} {'load' if k % 2 else 'compute'}"
                                           for k in range(2 * n)}
        fig.height = int(min(700, max(200, 70 + 44 * 2 * n)))
        end = self.simulation.epoch_time * 1e3 if self.simulation is not None else 1.0
        pad = 0.01 * end if end > 0 else 1.0
        fig.x_range.start, fig.x_range.end = -pad, end + pad

    def _sync_memory(self) -> None:
        scale, unit = self._memory_unit()
        self.memory_figure.yaxis.axis_label = f"memory ({unit})"
        if self.simulation is None or self.plan is None:
            self.memory_source.data = {"xs": [], "ys": [], "color": [], "label": []}
            self.budget_span.visible = False
            return
        curves = memory_columns(self.simulation.timeline, scale=1e3, mem_scale=scale)
        self.memory_source.data = {
            "xs": [np.asarray(c["x"], dtype=np.float64) for c in curves],
            "ys": [np.asarray(c["y"], dtype=np.float64) for c in curves],
            "color": [PALETTE[d % len(PALETTE)] for d in range(len(curves))],
            "label": [f"device {d}" for d in range(len(curves))],
        }
        budget = self.plan.budget_bytes * scale
        self.budget_span.location = budget
        self.budget_span.visible = True
        peak = max((max(c["y"]) for c in curves if c["y"]), default=0.0)
        self.memory_figure.y_range.start = 0
        # a budget far above the curves (80 GiB over a few MiB) would flatten them; the header states it
        top = max(peak, budget) if budget <= 3 * max(peak, 1e-12) else peak
        self.memory_figure.y_range.end = top * 1.1 if top > 0 else 1.0


__all__ = ["GNNPlanView", "LOAD_COLOR", "gnn_header_html", "gnn_lane_columns"]
