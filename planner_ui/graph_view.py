"""The model graph view: the plan's operator graph as a DAG, collapsible from ops to layers to segments.

:class:`GraphView` draws ``state.graph`` (an :class:`~engine.graph.OpGraph`) laid out by
topological generation (:func:`planner_ui.graph_layout.layout`), collapsed to ops, layers or
segments (:func:`planner_ui.graph_layout.collapse`), coloured by segment or device. Hovering a
node shows its name, op count, shapes, FLOPs and bytes; tapping it selects its segment
(``state.selected_segment``), which the Gantt highlights; tapping empty space clears it.
For an abstract placement (no model, ``state.graph is None``) it shows the placement's segment
chain instead, so the view is never empty.

All data comes from the pure functions of :mod:`planner_ui.graph_layout`; this module only
builds Bokeh models (``figure``, ``multi_line``, ``scatter``, ``HoverTool``, ``TapTool``) from it.
"""

from __future__ import annotations

import html

import networkx as nx
import panel as pn
import param
from bokeh.models import (
    BoxZoomTool,
    ColumnDataSource,
    HoverTool,
    PanTool,
    ResetTool,
    SaveTool,
    TapTool,
    WheelZoomTool,
)
from bokeh.plotting import figure

from planner_ui.background import bokeh_safe
from planner_ui.graph_layout import (
    LEVELS,
    SHARDING_COLORS,
    annotate_sharding,
    collapse,
    edge_columns,
    layout,
    node_color,
    node_columns,
    placement_dag,
    plan_segments,
)
from planner_ui.state import PlanState

#: Above this many nodes the figure uses Bokeh's WebGL backend.
WEBGL_NODES = 300
#: At the ops level, node labels are drawn only up to this many nodes.
OPS_LABEL_LIMIT = 60

NODE_TOOLTIPS = [
    ("node", "@name"),
    ("kind", "@kind"),
    ("layer", "@layer"),
    ("ops", "@ops"),
    ("shapes", "@shapes_text"),
    ("FLOPs", "@flops_text"),
    ("params", "@params_text"),
    ("activations", "@act_text"),
    ("saved for backward", "@saved_text"),
    ("time", "@time_text"),
    ("segment", "@segment"),
    ("device", "@devices"),
]
ABSTRACT_TOOLTIPS = [
    ("node", "@name"),
    ("time", "@time_text"),
    ("activation memory", "@act_text"),
    ("segment", "@segment"),
    ("device", "@devices"),
]
EDGE_TOOLTIPS = [("edge", "@src → @dst"), ("tensors", "@tensors"), ("bytes", "@bytes_text")]


class GraphView(pn.viewable.Viewer):
    """The model graph of ``state.plan``, with segment selection linked to the Gantt.

    Parameters:
        state: the shared :class:`~planner_ui.state.PlanState` (reads ``graph``, ``plan``,
            ``revision``, ``selected_segment``; writes ``selected_segment``).
        level: ``"ops"``, ``"layers"`` (default) or ``"segments"``: the level of detail.
        color_by: ``"segment"`` (default), ``"device"`` or ``"sharding"`` (column-, row-,
            vocab-parallel, sharded or replicated under the plan's tensor parallelism;
            :func:`planner_ui.graph_layout.annotate_sharding`).
        height: figure height in pixels.

    Attributes (for tests and other components):
        dag: the drawn ``networkx.DiGraph`` (collapsed graph or placement chain).
        positions: ``{node: (x, y)}`` of :attr:`dag`.
        nodes_source, edges_source: the Bokeh ``ColumnDataSource`` of nodes and edges.
        note: the text shown above the figure ("" when there is nothing to say).

    CSS hooks: ``tessel-graph`` (figure pane), ``tessel-graph-level`` (level selector),
    ``tessel-graph-color`` (colour selector), ``tessel-graph-note`` (note), ``tessel-graph-view``
    (the whole view).
    """

    state = param.ClassSelector(class_=PlanState)
    level = param.Selector(default="layers", objects=list(LEVELS), doc="level of detail: ops, layers or segments")
    color_by = param.Selector(default="segment", objects=["segment", "device", "sharding"],
                              doc="node colour: segment, device, or tensor-parallel sharding")
    height = param.Integer(default=380, bounds=(120, None), doc="figure height, px")

    def __init__(self, **params):
        if params.get("state") is None:
            params["state"] = PlanState()
        super().__init__(**params)
        self.dag: nx.DiGraph = nx.DiGraph()
        self.positions: dict = {}
        self.note = ""
        #: with ``color_by="sharding"``: which tensor-parallel plan the colours show (one sentence)
        self.sharding_note = ""
        self.abstract = False
        self._key = None
        self._cache_key = None
        self._cache: dict = {}
        self._tapping = False
        self.nodes_source = ColumnDataSource(data=node_columns(self.dag, {}))
        self.edges_source = ColumnDataSource(data=edge_columns(self.dag, {}))
        self._level_w = pn.widgets.RadioButtonGroup.from_param(
            self.param.level, name="", css_classes=["tessel-graph-level"])
        self._color_w = pn.widgets.RadioButtonGroup.from_param(
            self.param.color_by, name="", css_classes=["tessel-graph-color"])
        self._note_pane = pn.pane.Markdown("", css_classes=["tessel-graph-note"], sizing_mode="stretch_width",
                                           margin=(0, 10))
        self._pane = pn.pane.Bokeh(None, css_classes=["tessel-graph"], sizing_mode="stretch_width")
        self._legend_pane = pn.pane.HTML("", css_classes=["tessel-graph-legend"], sizing_mode="stretch_width",
                                         margin=(0, 10))
        self._layout = pn.Column(
            pn.Row(pn.pane.Markdown("**Level**", margin=(12, 5, 0, 10)), self._level_w,
                   pn.pane.Markdown("**Colour by**", margin=(12, 5, 0, 20)), self._color_w),
            self._note_pane, self._legend_pane, self._pane, sizing_mode="stretch_width",
            css_classes=["tessel-graph-view"])
        self.state.param.watch(self._on_structure, ["graph", "revision"])
        self.state.param.watch(self._on_selection, ["selected_segment"])
        self.param.watch(self._on_structure, ["level", "height"])
        self.param.watch(self._on_selection, ["color_by"])
        self.refresh()

    # ------------------------------------------------------------------ data
    def build_dag(self) -> tuple[nx.DiGraph, str]:
        """The DAG to draw and a note for the user.

        With an operator graph and a plan with segments: ``collapse(state.graph, level, segments)``
        (cached per graph, level and segmentation). Without a graph (abstract placement), or
        without segments: the placement's segment chain (:func:`placement_dag`). No plan: an
        empty graph. Never raises for a mismatched graph: layers the plan does not name are
        assigned like the planner does and the note says so.
        """
        st = self.state
        plan = st.plan
        if plan is None:
            self.abstract = False
            return nx.DiGraph(level=self.level), "No plan loaded yet: plan a model or run a search."
        segs = plan_segments(plan)
        if st.graph is None or not segs:
            self.abstract = st.abstract
            why = ("an abstract placement" if st.abstract or st.graph is None else "a plan without segments")
            dag = self._cached(("placement", id(plan.placement)), lambda: placement_dag(plan.placement))
            note = (f"No operator graph for this plan ({why}): showing the placement's segment chain "
                    f"({dag.number_of_nodes()} segments, forward order); the level of detail applies to "
                    "planned models.")
            return dag, note
        self.abstract = False
        seg_key = tuple((int(s["index"]), tuple(s.get("layers", [])), tuple(s.get("devices", []))) for s in segs)
        dag = self._cached((id(st.graph), self.level, seg_key), lambda: collapse(st.graph, self.level, segs))
        notes = []
        if dag.graph.get("unmapped_layers"):
            un = dag.graph["unmapped_layers"]
            notes.append(f"{len(un)} layer(s) of the graph are in no segment of the plan "
                         f"({', '.join(un[:3])}{'...' if len(un) > 3 else ''}); "
                         "they are shown with a neighbouring segment.")
        if dag.graph.get("dropped_edges"):
            notes.append(f"{dag.graph['dropped_edges']} edge(s) that would make a cycle at this level are hidden.")
        return dag, " ".join(notes)

    def _cached(self, key, make):
        if key not in self._cache:
            if len(self._cache) > 8:
                self._cache.clear()
            self._cache[key] = make()
        self._cache_key = key
        return self._cache[key]

    def node_data(self) -> dict[str, list]:
        """Node columns of the current :attr:`dag` (colour, highlight of ``state.selected_segment``)."""
        if self.color_by == "sharding":
            self.sharding_note = annotate_sharding(self.dag, self.state.graph, self.state.plan)
        labels = self.dag.graph.get("level") != "ops" or self.dag.number_of_nodes() <= OPS_LABEL_LIMIT
        return node_columns(self.dag, self.positions, color_by=self.color_by,
                            selected_segment=self.state.selected_segment, labels=labels, abstract=self.abstract)

    def edge_data(self) -> dict[str, list]:
        """Edge columns of the current :attr:`dag`."""
        return edge_columns(self.dag, self.positions, selected_segment=self.state.selected_segment)

    # ------------------------------------------------------------------ actions
    def select_node(self, node_id) -> int | None:
        """Select the segment of node ``node_id`` (as in the ``id`` column, or the node itself);
        ``None`` clears the selection. Sets ``state.selected_segment`` (the Gantt dims blocks of
        other segments) and returns it.

        Raises:
            KeyError: ``node_id`` is not a node of the drawn graph.
        """
        if node_id is None:
            self.state.selected_segment = None
            return None
        node = self._node(node_id)
        seg = self.dag.nodes[node].get("segment", -1)
        seg = int(seg) if seg is not None and seg >= 0 else None
        self.state.selected_segment = seg
        return seg

    def _node(self, node_id):
        if node_id in self.dag:
            return node_id
        for n in self.dag.nodes:
            if str(n) == str(node_id):
                return n
        raise KeyError(f"no node {node_id!r} in the {self.dag.graph.get('level', '')} graph")

    @staticmethod
    def dag_is_chain(dag: nx.DiGraph) -> bool:
        """True when ``dag`` is a placement's segment chain (no operator graph behind it)."""
        return bool(dag.graph.get("abstract"))

    def refresh(self, force: bool = False) -> None:
        """Recompute the DAG; rebuild the figure when the drawn graph changed, else restyle it."""
        dag, note = self.build_dag()
        key = (self._cache_key if self.state.plan is not None else None, self.level, self.height)
        self.note = note
        self._note_pane.object = note
        self._level_w.disabled = bool(self.dag_is_chain(dag))
        if force or dag is not self.dag or key != self._key or self._pane.object is None:
            self._key = key
            self.dag = dag
            self.positions = layout(dag)
            self._pane.object = self._figure()
        else:
            self._restyle()
        self._legend_pane.object = self._legend_object()

    # ------------------------------------------------------------------ bokeh
    def _figure(self):
        n = self.dag.number_of_nodes()
        level = self.dag.graph.get("level", self.level)
        nodes = ColumnDataSource(data=self.node_data())
        edges = ColumnDataSource(data=self.edge_data())
        xs = [p[0] for p in self.positions.values()] or [0.0]
        ys = [p[1] for p in self.positions.values()] or [0.0]
        span_x = max(xs) - min(xs)
        title = {"ops": "operators", "layers": "layers", "segments": "segments"}.get(level, level)
        fig = figure(
            height=self.height, sizing_mode="stretch_width",
            x_range=(min(xs) - 0.8 - 0.02 * span_x, max(xs) + 0.8 + 0.02 * span_x),
            y_range=(min(ys) - 1.0, max(ys) + 1.6),
            tools=[], toolbar_location="above",
            output_backend="webgl" if n > WEBGL_NODES else "canvas",
            title=(f"{self.state.plan.model.name} — {n} {title}" if self.state.plan is not None
                   else "model graph"),
        )
        fig.axis.visible = False
        fig.grid.visible = False
        fig.outline_line_color = None
        edge_r = fig.multi_line("xs", "ys", source=edges, line_color="color", line_alpha="alpha",
                                line_width="line_width")
        node_r = fig.scatter("x", "y", source=nodes, size="size", marker="circle", fill_color="color",
                             fill_alpha="alpha", line_color="line_color", line_width="line_width")
        # highlighting comes from the state (selected segment), not from Bokeh's own selection
        node_r.nonselection_glyph = None
        node_r.selection_glyph = None
        edge_r.nonselection_glyph = None
        if any(nodes.data["label"]):
            fig.text("x", "y", text="label", source=nodes, text_font_size="9pt", text_align="center",
                     text_baseline="top", y_offset=12, text_color="#333333")
        wheel = WheelZoomTool(dimensions="width" if level == "ops" else "both")
        fig.add_tools(PanTool(), wheel, BoxZoomTool(), ResetTool(), SaveTool())
        fig.toolbar.active_scroll = wheel
        fig.add_tools(HoverTool(renderers=[node_r], tooltips=ABSTRACT_TOOLTIPS if self.abstract else NODE_TOOLTIPS))
        fig.add_tools(HoverTool(renderers=[edge_r], tooltips=EDGE_TOOLTIPS, line_policy="interp"))
        tap = TapTool(renderers=[node_r])
        fig.add_tools(tap)
        fig.toolbar.active_tap = tap
        nodes.selected.on_change("indices", self._on_tap)
        self.nodes_source, self.edges_source = nodes, edges
        return fig

    def _restyle(self) -> None:
        data = dict(self.nodes_source.data)
        fresh = self.node_data()
        for k in ("color", "alpha", "line_color", "line_width", "selected"):
            data[k] = fresh[k]
        self.nodes_source.data = data
        self.edges_source.data = self.edge_data()

    # ------------------------------------------------------------------ events
    @bokeh_safe
    def _on_structure(self, *_events) -> None:
        self.refresh()

    @bokeh_safe
    def _on_selection(self, *_events) -> None:
        if self.dag.number_of_nodes():
            self._restyle()
        self._legend_pane.object = self._legend_object()

    def _legend_object(self) -> str:
        """The legend's HTML; with ``color_by="sharding"`` also which tensor-parallel plan it shows."""
        out = legend_html(self.legend())
        if self.color_by == "sharding" and self.sharding_note:
            out += f'<div class="tessel-graph-sharding-note">{html.escape(self.sharding_note)}</div>'
        return out

    def legend(self) -> list[tuple[str, str]]:
        """``[(colour, meaning)]`` of the node colours drawn now (:func:`legend_items`)."""
        return legend_items(self.dag, self.color_by)

    def _on_tap(self, _attr, _old, new) -> None:
        if self._tapping:
            return
        self._tapping = True
        try:
            ids = self.nodes_source.data.get("id", [])
            self.select_node(ids[new[0]] if new and new[0] < len(ids) else None)
        finally:
            self._tapping = False

    def __panel__(self):
        return self._layout


def legend_items(dag: nx.DiGraph, color_by: str = "segment") -> list[tuple[str, str]]:
    """What the node colours of ``dag`` mean: ``[(colour, label)]`` in segment or device order,
    e.g. ``("#1f77b4", "segment 0 (device 0)")``, ``("#9D9D9D", "on several devices")``; the
    colours are :func:`planner_ui.graph_layout.node_color`'s, so the legend matches the nodes."""
    if color_by == "sharding":
        kinds = {str(a.get("sharding", "replicated")) for _n, a in dag.nodes(data=True)}
        return [(c, k) for k, c in SHARDING_COLORS.items() if k in kinds]
    items: dict[str, tuple[tuple, str]] = {}
    for _n, a in dag.nodes(data=True):
        color = node_color(a, color_by)
        if color in items:
            continue
        devs = sorted(int(d) for d in (a.get("devices") or []))
        seg = a.get("segment", -1)
        if color_by == "device":
            key, label = ((0, devs[0]), f"device {devs[0]}") if len(devs) == 1 else ((1, 0), "on several devices")
        elif seg is not None and seg >= 0:
            where = (f" (device {devs[0]})" if len(devs) == 1
                     else f" (devices {', '.join(map(str, devs))})" if devs else "")
            key, label = (0, int(seg)), f"segment {int(seg)}{where}"
        else:
            key, label = (1, 0), "in no segment"
        items[color] = (key, label)
    return [(c, label) for c, (_k, label) in sorted(items.items(), key=lambda kv: kv[1][0])]


def legend_html(items: list[tuple[str, str]]) -> str:
    """A one-line HTML legend: a colour swatch and its label per item (empty for no items)."""
    if not items:
        return ""
    sw = ('<span style="display:inline-block;width:12px;height:12px;border-radius:6px;background:{c};'
          'margin:0 4px -1px 12px"></span>{t}')
    return ('<div class="tessel-graph-legend-items"><b>Colours:</b>'
            + "".join(sw.format(c=html.escape(c), t=html.escape(t)) for c, t in items) + "</div>")


__all__ = ["OPS_LABEL_LIMIT", "WEBGL_NODES", "GraphView", "legend_html", "legend_items"]
