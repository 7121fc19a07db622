"""GNN characterization viewer: a stacked-bar chart of time per model x layer, by SAGA stage or kernel class.

Shows the breakdown of *Architectural Implications of Graph Neural Networks* (Zhang et al.,
2020) as :mod:`engine.gnn.characterize` measures it: one bar per model x layer (x axis grouped
by model), stacked by NGra's SAGA-NN stage (scatter, apply_edge, gather, apply_vertex, other)
or, with the toggle, by kernel class (gather/scatter, dense matmul, elementwise, host overhead).
Selectors pick the phase (forward, backward, both) and, when the rows hold several, the graph,
the mode (inference / training) and the feature width. Time outside the layers (activations
between layers, the loss) is not a bar; the header states it per model.

Input: tidy rows (:meth:`engine.gnn.characterize.Characterization.rows`,
:func:`engine.gnn.characterize.sweep`, ``tessel profile-gnn --json``'s ``rows``) or
characterizations (:meth:`GNNProfileView.from_characterizations`). Bar data comes from
:func:`stacked_bar_data` (pure), so the tests check it without a browser.

CSS hooks for browser tests (``css_classes``):

================================  =========================================================
``tessel-gnn-profile``            the whole view (a ``pn.Column``)
``tessel-gnn-profile-header``     header (HTML) with one ``.tessel-gnn-profile-model`` per
                                  model (its graph-stage share and outside-layer time)
``tessel-gnn-profile-breakdown``  RadioButtonGroup: SAGA stage / kernel class
``tessel-gnn-profile-phase``      RadioButtonGroup: forward / backward / forward + backward
``tessel-gnn-profile-graph``      Select of the graph (``tessel-gnn-profile-mode``: the
                                  mode, ``tessel-gnn-profile-width``: the feature width)
``tessel-gnn-profile-plot``       the Bokeh pane of the stacked bars
``tessel-gnn-profile-message``    Alert when the selection has no rows or a file is refused
``tessel-gnn-profile-load``       FileInput: add the rows of a ``tessel profile-gnn --json`` file
``tessel-gnn-profile-clear``      Button: remove every row
================================  =========================================================

Source libraries: Panel (``pn.viewable.Viewer``, ``RadioButtonGroup``, ``Select``,
``pn.pane.Bokeh``) and Bokeh (``figure.vbar_stack``, ``FactorRange``, ``HoverTool``).

To show it as a tab of the app: ``pn.Tabs(..., ("GNN profile", GNNProfileView()))``; the user
loads ``tessel profile-gnn --json`` outputs with the file input (several runs add up: one bar per
model x layer of each).
"""

from __future__ import annotations

import html
import json
import logging
from typing import Any, Iterable, Mapping, Sequence

import panel as pn
import param
from bokeh.models import FactorRange, HoverTool
from bokeh.plotting import figure

from engine.gnn.characterize import GRAPH_STAGES, KERNEL_CLASSES, LOSS, OUTSIDE, STAGES, Characterization
from planner_ui.background import bokeh_safe

log = logging.getLogger(__name__)

#: Stack colours per SAGA stage (graph stages warm, neural stages cool, other grey).
STAGE_COLORS = {"scatter": "#F28E2B", "apply_edge": "#E15759", "gather": "#EDC948", "apply_vertex": "#4E79A7",
                "other": "#BAB0AC"}
#: Stack colours per kernel class.
CLASS_COLORS = {"gather_scatter": "#E15759", "matmul": "#4E79A7", "elementwise": "#59A14F", "overhead": "#BAB0AC"}
BREAKDOWNS = {"SAGA stage": "stage", "kernel class": "kernel_class"}
PHASE_CHOICES = {"forward": ("forward",), "backward": ("backward",), "forward + backward": ("forward", "backward")}
_ALL = "(all)"


def _is_layer(name: Any) -> bool:
    return isinstance(name, str) and name.startswith("layer") and name[5:].isdigit()


def stacked_bar_data(rows: Iterable[Mapping[str, Any]], breakdown: str = "stage",
                     phases: Sequence[str] = ("forward",), where: Mapping[str, Any] | None = None,
                     scale: float = 1e3) -> tuple[list[tuple[str, str]], list[str], dict[str, list]]:
    """The stacked bars of tidy characterization rows.

    Args:
        rows: tidy rows (``model``, ``layer``, ``phase``, ``stage``, ``kernel_class``, ``seconds``, ...).
        breakdown: ``"stage"`` (stacks :data:`~engine.gnn.characterize.STAGES`) or ``"kernel_class"``
            (stacks :data:`~engine.gnn.characterize.KERNEL_CLASSES`).
        phases: the phases summed into each bar.
        where: keep only rows whose fields equal these (e.g. ``{"graph": "karate", "mode": "training"}``).
        scale: display unit per second (ms by default).

    Returns:
        ``(factors, categories, columns)``: one factor ``(model, layer)`` per bar (models in first-seen
        order, layers in number order; only ``layer{k}`` rows: the time outside the layers is no
        bar), the stack categories in order, and the ColumnDataSource columns ``x`` (the factors),
        one column per category (display units) and ``total``.

    Raises:
        ValueError: an unknown ``breakdown``.
    """
    if breakdown not in ("stage", "kernel_class"):
        raise ValueError(f"breakdown must be 'stage' or 'kernel_class', got {breakdown!r}")
    cats = list(STAGES if breakdown == "stage" else KERNEL_CLASSES)
    bars: dict[tuple[str, str], dict[str, float]] = {}
    models: list[str] = []
    for r in rows:
        if r.get("phase") not in phases or not _is_layer(r.get("layer")):
            continue
        if where and any(r.get(k) != v for k, v in where.items()):
            continue
        model = str(r["model"])
        if model not in models:
            models.append(model)
        cell = bars.setdefault((model, str(r["layer"])), dict.fromkeys(cats, 0.0))
        cell[str(r[breakdown])] = cell.get(str(r[breakdown]), 0.0) + float(r["seconds"]) * scale
    factors = sorted(bars, key=lambda k: (models.index(k[0]), int(k[1][5:])))
    cols: dict[str, list] = {"x": factors}
    for c in cats:
        cols[c] = [bars[f][c] for f in factors]
    cols["total"] = [sum(bars[f][c] for c in cats) for f in factors]
    return factors, cats, cols


def header_html(rows: Sequence[Mapping[str, Any]], phases: Sequence[str] = ("forward",)) -> str:
    """Per model: the graph-stage share of its layers' time (``phases``) and its time outside the
    layers (between layers, loss), as HTML spans ``.tessel-gnn-profile-model``."""
    models: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("phase") not in phases:
            continue
        m = models.setdefault(str(r["model"]), {"graph": 0.0, "layers": 0.0, "outside": 0.0})
        s = float(r["seconds"])
        if _is_layer(r.get("layer")):
            m["layers"] += s
            if r.get("stage") in GRAPH_STAGES:
                m["graph"] += s
        elif r.get("layer") in (OUTSIDE, LOSS):
            m["outside"] += s
    if not models:
        return '<div class="tessel-gnn-profile-summary">No characterization rows for this selection.</div>'
    parts = []
    for name, m in models.items():
        share = m["graph"] / m["layers"] if m["layers"] > 0 else 0.0
        parts.append(f'<span class="tessel-gnn-profile-model" data-model="{html.escape(name)}"><b>'
                     f'{html.escape(name)}</b> graph stages {share:.0%} of {m["layers"] * 1e3:.3g} ms'
                     f' <span style="color:#666">(outside layers {m["outside"] * 1e3:.3g} ms)</span></span>')
    return ('<div class="tessel-gnn-profile-summary">' + f'{" + ".join(phases)}: ' + " &middot; ".join(parts)
            + "</div>")


class GNNProfileView(pn.viewable.Viewer):
    """Stacked bars of a GNN characterization: one bar per model x layer.

    Parameters:
        rows: tidy characterization rows (see the module doc).
        breakdown: ``"stage"`` or ``"kernel_class"`` (the toggle).
        phase: ``"forward"``, ``"backward"`` or ``"forward + backward"``.
        graph, mode, width: the selection when the rows hold several (``"(all)"`` sums them).

    Attributes: :attr:`figure` (the current Bokeh figure), :attr:`bar_count`, :attr:`factors`,
    :attr:`categories`, :attr:`columns` (the bar data), :attr:`header_text`.
    """

    rows = param.List(default=[], doc="tidy characterization rows")
    breakdown = param.Selector(default="stage", objects=["stage", "kernel_class"], doc="what the bars stack")
    phase = param.Selector(default="forward", objects=list(PHASE_CHOICES), doc="phases summed into the bars")
    graph = param.String(default=_ALL, doc="graph shown ('(all)': every graph summed)")
    mode = param.String(default=_ALL, doc="mode shown ('(all)': both summed)")
    width = param.String(default=_ALL, doc="feature width shown ('(all)': every width summed)")

    def __init__(self, **params):
        super().__init__(**params)
        self._header = pn.pane.HTML("", css_classes=["tessel-gnn-profile-header"], sizing_mode="stretch_width")
        self._breakdown = pn.widgets.RadioButtonGroup.from_param(
            self.param.breakdown, options=BREAKDOWNS, css_classes=["tessel-gnn-profile-breakdown"])
        self._phase = pn.widgets.RadioButtonGroup.from_param(self.param.phase, css_classes=["tessel-gnn-profile-phase"])
        self._selects = {k: pn.widgets.Select(label=k, css_classes=[f"tessel-gnn-profile-{k}"], width=160)
                         for k in ("graph", "mode", "width")}
        for k, w in self._selects.items():
            w.param.watch(lambda e, k=k: setattr(self, k, e.new), "value")
        self._plot_pane = pn.pane.Bokeh(None, css_classes=["tessel-gnn-profile-plot"], sizing_mode="stretch_width")
        self._alert = pn.pane.Alert("", alert_type="info", visible=False, css_classes=["tessel-gnn-profile-message"],
                                    sizing_mode="stretch_width")
        self._load = pn.widgets.FileInput(accept=".json", css_classes=["tessel-gnn-profile-load"])
        self._load.param.watch(self._on_file, "value")
        self._clear = pn.widgets.Button(label="Clear", css_classes=["tessel-gnn-profile-clear"])
        self._clear.on_click(lambda _e: setattr(self, "rows", []))
        self._refused = ""
        self._sync_selects()
        self.refresh()
        self.param.watch(lambda _e: (self._sync_selects(), self.refresh()), ["rows"])
        self.param.watch(lambda _e: self.refresh(), ["breakdown", "phase", "graph", "mode", "width"])
        self._layout = pn.Column(
            self._header,
            pn.Row(self._load, self._clear),
            pn.Row(self._breakdown, self._phase, *self._selects.values()),
            self._plot_pane, self._alert, css_classes=["tessel-gnn-profile"], sizing_mode="stretch_width")

    @classmethod
    def from_characterizations(cls, chars: Iterable[Characterization], **params) -> GNNProfileView:
        """A view of several :class:`~engine.gnn.characterize.Characterization` (their rows, concatenated)."""
        rows: list[dict] = []
        for c in chars:
            rows.extend(c.rows())
        return cls(rows=rows, **params)

    def __panel__(self):
        return self._layout

    # ------------------------------------------------------------------ data
    def add_json(self, obj: Any) -> int:
        """Add the rows of a ``tessel profile-gnn --json`` result (``{"characterization": {"rows":
        [...]}}``), of :meth:`~engine.gnn.characterize.Characterization.to_dict` (``{"rows": [...]}``)
        or a list of rows; returns how many were added.

        Raises:
            ValueError: ``obj`` is none of these (or a row lacks ``model``, ``layer``, ``phase``,
                ``stage``, ``kernel_class`` or ``seconds``).
        """
        if isinstance(obj, dict) and isinstance(obj.get("characterization"), dict):
            obj = obj["characterization"]
        if isinstance(obj, dict) and obj.get("ok") is False:
            raise ValueError(f"the file is a failed run ({obj.get('error', 'no error given')})")
        rows = obj.get("rows") if isinstance(obj, dict) else obj
        need = ("model", "layer", "phase", "stage", "kernel_class", "seconds")
        if not isinstance(rows, list) or not all(isinstance(r, dict) and all(k in r for k in need) for r in rows):
            raise ValueError("expected the JSON of tessel profile-gnn --json (or a list of characterization rows)")
        self.rows = [*self.rows, *rows]
        return len(rows)

    def _on_file(self, event) -> None:
        if not event.new:
            return
        try:
            n = self.add_json(json.loads(event.new))
        except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
            self._refused = f"Cannot load {self._load.filename or 'the file'}: {e}."
            self.refresh()
            return
        self._refused = ""
        self.refresh()
        log.info("added %d characterization rows from %s", n, self._load.filename)

    def selection(self) -> dict[str, Any]:
        """The ``where`` filter of the selectors (graph, mode, width; ``(all)`` is no filter)."""
        out: dict[str, Any] = {}
        for k in ("graph", "mode", "width"):
            v = getattr(self, k)
            if v != _ALL:
                out[k] = int(v) if k == "width" else v
        return out

    def _selected_rows(self) -> list[Mapping[str, Any]]:
        where = self.selection()
        return [r for r in self.rows if all(r.get(k) == v for k, v in where.items())]

    @property
    def bar_count(self) -> int:
        """Bars drawn (model x layer)."""
        return len(self.factors)

    @property
    def header_text(self) -> str:
        return self._header.object

    def _sync_selects(self) -> None:
        for k, w in self._selects.items():
            vals = sorted({str(r[k]) for r in self.rows if r.get(k) is not None},
                          key=lambda v: (0, int(v)) if v.isdigit() else (1, v))
            opts = vals if len(vals) == 1 else [_ALL, *vals]
            w.options = opts or [_ALL]
            w.visible = len(vals) > 1
            cur = getattr(self, k)
            new = cur if cur in opts else (opts[0] if opts else _ALL)
            if w.value != new:
                w.value = new
            if cur != new:
                setattr(self, k, new)

    @bokeh_safe
    def refresh(self) -> None:
        """Recompute the bars from the rows and the selection and redraw the figure."""
        phases = PHASE_CHOICES[self.phase]
        rows = self._selected_rows()
        self.factors, self.categories, self.columns = stacked_bar_data(rows, self.breakdown, phases)
        self._header.object = header_html(rows, phases)
        self.figure = self._figure()
        self._plot_pane.object = self.figure
        if self._refused:
            text, kind = self._refused, "warning"
        elif not self.rows:
            text, kind = "No characterization loaded: load a tessel profile-gnn --json file.", "info"
        else:
            text, kind = "No layer time for this selection (is there a backward phase?).", "info"
        self._alert.object, self._alert.alert_type = text, kind
        self._alert.visible = bool(self._refused) or not self.factors

    def _figure(self):
        colors = STAGE_COLORS if self.breakdown == "stage" else CLASS_COLORS
        fig = figure(x_range=FactorRange(*self.factors), height=320, sizing_mode="stretch_width",
                     title=f"time per model x layer by {'SAGA stage' if self.breakdown == 'stage' else 'kernel class'}"
                           f" ({self.phase})", toolbar_location="above", tools="save,reset")
        fig.vbar_stack(self.categories, x="x", width=0.8, source=dict(self.columns),
                       color=[colors[c] for c in self.categories], legend_label=list(self.categories))
        fig.add_tools(HoverTool(tooltips=[("bar", "@x"), ("part", "$name"), ("ms", "@$name{0.000}"),
                                          ("total ms", "@total{0.000}")]))
        fig.y_range.start = 0
        fig.yaxis.axis_label = "ms"
        fig.xaxis.major_label_orientation = 0.8
        fig.legend.location = "top_left"
        fig.legend.orientation = "horizontal"
        fig.legend.label_text_font_size = "8pt"
        return fig


__all__ = ["BREAKDOWNS", "CLASS_COLORS", "PHASE_CHOICES", "STAGE_COLORS", "GNNProfileView", "header_html",
           "stacked_bar_data"]
