"""The planner app: every component around one shared :class:`~planner_ui.state.PlanState`.

``PlannerApp(state)`` is a Panel Viewer: display it in Jupyter (after ``pn.extension()``), or
serve :meth:`PlannerApp.template` with ``panel serve apps/planner.py`` / ``tessel serve``.
Tabs: Schedule (Gantt + memory + editing), Model graph, Search (Tessel), Compare, Co-locate
(CrossoverScheduler prediction), Launch;
the sidebar holds the plan form and export/import.
"""

from __future__ import annotations

import functools
import gc

import panel as pn
import param

from engine.io.plan import Plan, load_plan
from planner_ui.colocate_panel import ColocatePanel
from planner_ui.compare_view import CompareView
from planner_ui.export_panel import ExportPanel
from planner_ui.gantt import GanttView
from planner_ui.gnn_panel import GNNPanel
from planner_ui.graph_view import GraphView
from planner_ui.launch_panel import LaunchPanel
from planner_ui.message_bar import message_bar
from planner_ui.plan_form import PlanForm
from planner_ui.search_panel import SearchPanel
from planner_ui.state import PlanState

#: Panel extensions the components need loaded on the page (the Compare table is a Tabulator).
EXTENSIONS = ("tabulator",)


def load_extensions(**kwargs) -> None:
    """``pn.extension(*EXTENSIONS, **kwargs)``: call it first in a served session or a notebook
    (``load_extensions(inline=True)`` for notebooks that must render offline)."""
    pn.extension(*EXTENSIONS, **kwargs)


#: Tab titles, in order (tests and docs refer to them).
TABS = ("Schedule", "Model graph", "Search", "Compare", "Co-locate", "Launch", "GNN")


class PlannerApp(pn.viewable.Viewer):
    """The whole planner.

    Attributes:
        state: the shared plan state.
        form, gantt, graph, search, compare, colocate, launch, export: the components.
    """

    state = param.ClassSelector(class_=PlanState)
    ray_address = param.String(default=None, allow_None=True, doc="Ray cluster for the Launch tab (None: local)")

    def __init__(self, state: PlanState | None = None, **params):
        super().__init__(state=state or PlanState(), **params)
        st = self.state
        self.form = PlanForm(state=st)
        self.gantt = GanttView(state=st, show_message=False)
        self.message = message_bar(st)
        self.graph = GraphView(state=st)
        self.search = SearchPanel(state=st)
        self.compare = CompareView(state=st)
        self.colocate = ColocatePanel(state=st)
        self.launch = LaunchPanel(state=st)
        if self.ray_address and "address" in self.launch.param:
            self.launch.address = self.ray_address
        self.export = ExportPanel(state=st)
        self.gnn = GNNPanel()
        self.tabs = pn.Tabs(
            (TABS[0], self.gantt), (TABS[1], self.graph), (TABS[2], self.search),
            (TABS[3], self.compare), (TABS[4], self.colocate), (TABS[5], self.launch),
            (TABS[6], self.gnn), dynamic=True, sizing_mode="stretch_width", css_classes=["tessel-tabs"],
        )

    def sidebar(self) -> list:
        """The sidebar column's contents: plan form and export/import."""
        return [self.form, pn.layout.Divider(), self.export]

    def __panel__(self):
        return pn.Row(pn.Column(*self.sidebar(), width=300),
                      pn.Column(self.message, self.tabs, sizing_mode="stretch_width"),
                      sizing_mode="stretch_width")

    def template(self, title: str = "Tessel Planner"):
        """A served page (loads :data:`EXTENSIONS`): ``pn.template.BootstrapTemplate`` (its
        resources are bundled with Panel: the page loads offline) with the sidebar and the tabs."""
        load_extensions()
        return pn.template.BootstrapTemplate(
            title=title, sidebar=self.sidebar(), main=[self.message, self.tabs], sidebar_width=320,
            header_background="#2F4B7C",
        )


@functools.lru_cache(maxsize=8)
def initial_plan(model: str, devices: int, micro_batches: int, schedule: str, device_type: str):
    """``make_plan`` for a session's first plan, cached: every browser session of ``tessel serve``
    opens on the same model, so it is captured once per process (plans are never mutated in place)."""
    from engine.planner import make_plan

    return make_plan(model, devices=devices, micro_batches=micro_batches, schedule=schedule, device_type=device_type)


def build_app(*, model: str | None = "gpt2", plan: str | Plan | None = None, devices: int = 4,
              micro_batches: int = 8, schedule: str = "1f1b", device_type: str = "h100",
              ray_address: str | None = None) -> PlannerApp:
    """A planner opened on a plan file (``plan``) or on ``model`` planned with the given settings.

    After loading, the objects alive so far (imported libraries, the captured graph) are moved out
    of the garbage collector's reach with ``gc.freeze()`` (Python docs, ``gc.freeze``): a full
    collection over them otherwise lands in one edit in forty and stalls it for ~0.3 s.

    Raises:
        engine.errors.TesselError: the model cannot be planned or the plan file is malformed.
    """
    state = PlanState()
    app = PlannerApp(state, ray_address=ray_address)
    if plan is not None:
        state.load(load_plan(plan) if not isinstance(plan, Plan) else plan)
    elif model:
        app.form.param.update(model=model, devices=devices, micro_batches=micro_batches,
                              schedule=schedule, device_type=device_type)
        app.form._model_w.value = model
        res = initial_plan(model, devices, micro_batches, schedule, device_type)
        state.load(res.plan, graph=res.graph,
                   message=f"planned {model}: {schedule} on {devices} {device_type} devices, "
                           f"{micro_batches} micro-batches")
    gc.freeze()
    return app


__all__ = ["PlannerApp", "build_app", "TABS", "EXTENSIONS", "load_extensions"]
