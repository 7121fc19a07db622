"""The app's GNN tab: plan chunk-streamed GNN training and profile a GNN's SAGA stages.

A form (model kind, graph, hidden width, layers, heads, devices, memory budget, device type)
plans with :func:`engine.gnn.plan.make_gnn_plan` (NGra, USENIX ATC'19, section 4: vertex intervals,
edge chunks, P chosen from the budget) and shows the plan in :class:`~planner_ui.gnn_view.GNNPlanView`
(a load lane and a compute lane per device, memory against the budget). "Profile" runs
:func:`engine.gnn.characterize.characterize` (the GNN characterization study's stage and
kernel-class breakdown) on the same model and graph and adds its rows to
:class:`~planner_ui.gnn_profile_view.GNNProfileView`. A mistake (a budget nothing fits, heads on a
model that has none) is one sentence in the tab's message; the previous plan stays.

CSS hooks (``css_classes``): ``tessel-gnn-panel`` (the tab), ``tessel-gnn-kind``,
``tessel-gnn-graph``, ``tessel-gnn-hidden``, ``tessel-gnn-layers``, ``tessel-gnn-heads``,
``tessel-gnn-devices``, ``tessel-gnn-budget``, ``tessel-gnn-device-type``, ``tessel-gnn-plan``
(button), ``tessel-gnn-profile`` (button), ``tessel-gnn-message`` (alert).

Source libraries: Panel (widgets, ``pn.pane.Alert``, ``pn.viewable.Viewer``).
"""

from __future__ import annotations

import logging

import panel as pn
import param
import torch

from engine.errors import TesselError
from engine.gnn.characterize import characterize
from engine.gnn.models import GNN_KINDS, GNNConfig, build_gnn
from engine.gnn.plan import graph_from_spec, make_gnn_plan
from engine.gnn.plan_parts import GraphStats
from planner_ui.gnn_profile_view import GNNProfileView
from planner_ui.gnn_view import GNNPlanView
from tasks.graphs import graph_stats

log = logging.getLogger(__name__)

#: Graphs offered in the form (``engine.gnn.plan.graph_from_spec`` specs). The CPython code graph
#: takes about 20 s to build the first time (then it is cached).
GRAPHS = ("karate", "rmat:12:8", "rmat:14:8", "rmat:16:8", "cpython")


class GNNPanel(pn.viewable.Viewer):
    """Plan and profile a GNN on one of :data:`GRAPHS` (see the module doc).

    Parameters are the form's values; :attr:`plan` is the last plan made (``None`` before),
    :attr:`message` the last one-sentence refusal (``""`` when the last action succeeded).
    """

    kind = param.Selector(default="gat", objects=list(GNN_KINDS), doc="GNN layer kind")
    graph = param.Selector(default="karate", objects=list(GRAPHS), doc="graph spec")
    hidden = param.Integer(default=64, bounds=(1, None), doc="hidden width (features per vertex)")
    layers = param.Integer(default=2, bounds=(1, None), doc="SAGA-NN layers")
    heads = param.Integer(default=4, bounds=(1, None), doc="attention heads (GAT only)")
    devices = param.Integer(default=2, bounds=(1, None), doc="devices the destination intervals spread over")
    budget_mib = param.Number(default=None, allow_None=True, bounds=(0, None),
                              doc="memory budget per device, MiB (None: the device's capacity)")
    device_type = param.Selector(default="cpu", objects=["cpu", "h100", "a100"], doc="cost table device")
    message = param.String(default="", doc="the last refusal, one sentence")

    def __init__(self, **params):
        super().__init__(**params)
        self.plan = None
        self._data_cache: dict[str, object] = {}
        self.plan_view = GNNPlanView()
        self.profile_view = GNNProfileView()
        w = {name: pn.widgets.Select.from_param(getattr(self.param, name), css_classes=[f"tessel-gnn-{name}"])
             for name in ("kind", "graph")}
        w["device_type"] = pn.widgets.Select.from_param(self.param.device_type, css_classes=["tessel-gnn-device-type"])
        for name in ("hidden", "layers", "heads", "devices"):
            w[name] = pn.widgets.IntInput.from_param(getattr(self.param, name), css_classes=[f"tessel-gnn-{name}"],
                                                     width=110)
        w["budget"] = pn.widgets.FloatInput.from_param(self.param.budget_mib, name="budget (MiB)",
                                                       css_classes=["tessel-gnn-budget"], width=130)
        self._widgets = w
        self._plan_button = pn.widgets.Button(label="Plan", button_type="primary", css_classes=["tessel-gnn-plan"])
        self._plan_button.on_click(lambda _e: self.make_plan())
        self._profile_button = pn.widgets.Button(label="Profile", css_classes=["tessel-gnn-profile"])
        self._profile_button.on_click(lambda _e: self.profile())
        self._alert = pn.pane.Alert("", alert_type="danger", visible=False, css_classes=["tessel-gnn-message"],
                                    sizing_mode="stretch_width")
        self.param.watch(self._show_message, "message")
        self._layout = pn.Column(
            pn.Row(*w.values()), pn.Row(self._plan_button, self._profile_button), self._alert,
            self.plan_view, pn.layout.Divider(), self.profile_view,
            css_classes=["tessel-gnn-panel"], sizing_mode="stretch_width")

    def __panel__(self):
        return self._layout

    def _show_message(self, _event=None) -> None:
        self._alert.object = self.message
        self._alert.visible = bool(self.message)

    def _data(self):
        if self.graph not in self._data_cache:
            self._data_cache[self.graph] = graph_from_spec(self.graph)
        return self._data_cache[self.graph]

    def _config(self, data):
        st = graph_stats(data)
        heads = self.heads if self.kind == "gat" else 1
        return GNNConfig(self.kind, st["feature_dim"], self.hidden, st["num_classes"], self.layers, heads)

    def make_plan(self):
        """Plan the form's model on its graph; returns the :class:`~engine.gnn.plan.GNNPlan`, or ``None``
        with :attr:`message` set to the one-sentence reason."""
        try:
            data = self._data()
            config = self._config(data)
            budget = int(self.budget_mib * 2**20) if self.budget_mib else None
            plan = make_gnn_plan(config, GraphStats.of(graph_stats(data)), self.devices, budget, None,
                                 self.device_type, edge_index=data.edge_index, graph_spec=self.graph)
        except TesselError as e:
            self.message = str(e)
            return None
        self.message = ""
        self.plan = plan
        self.plan_view.plan = plan
        return plan

    def profile(self, repeats: int = 3) -> int:
        """Characterize the form's model on its graph (inference and training, one thread); adds the rows
        to the profile view and returns how many were added (0 with :attr:`message` set on a mistake)."""
        try:
            data = self._data()
            torch.manual_seed(0)
            model = build_gnn(self._config(data))
            rows: list[dict] = []
            for mode in ("inference", "training"):
                c = characterize(model, data.x, data.edge_index, mode, repeats=repeats, warmup=1, graph=self.graph,
                                 labels=data.y, threads=1, label=self.kind)
                rows.extend(c.rows())
        except TesselError as e:
            self.message = str(e)
            return 0
        self.message = ""
        self.profile_view.rows = list(self.profile_view.rows) + rows
        return len(rows)


__all__ = ["GNNPanel", "GRAPHS"]
