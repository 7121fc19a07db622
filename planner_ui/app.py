"""The planner app: every component around one shared :class:`~planner_ui.state.PlanState`.

``PlannerApp(state)`` is a Panel Viewer: display it in Jupyter (after ``pn.extension()``), or
serve :meth:`PlannerApp.template` with ``panel serve apps/planner.py`` / ``tessel serve``.
Tabs: Schedule (Gantt + memory + editing), Model graph, Search (Tessel), Compare, Co-locate
(CrossoverScheduler prediction), Launch, Tune (``tessel tune``: a clicked configuration is
loaded and the Schedule tab shown), GNN;
the sidebar holds the plan form and export/import.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc

import panel as pn
import param
from bokeh.document import Document

from engine.io.plan import Plan, load_plan
from engine.plan import make_plan, resimulate
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
from planner_ui.tune_panel import TunePanel

#: Panel extensions the components need loaded on the page (the Compare table is a Tabulator).
EXTENSIONS = ("tabulator",)


def load_extensions(**kwargs) -> None:
    """``pn.extension(*EXTENSIONS, **kwargs)``: call it first in a served session or a notebook
    (``load_extensions(inline=True)`` for notebooks that must render offline)."""
    pn.extension(*EXTENSIONS, **kwargs)


#: Tab titles, in order (tests and docs refer to them).
TABS = ("Schedule", "Model graph", "Search", "Compare", "Co-locate", "Launch", "Tune", "GNN")


class PlannerApp(pn.viewable.Viewer):
    """The whole planner.

    Attributes:
        state: the shared plan state.
        form, gantt, export: the sidebar and Schedule components (built with the app).
        graph, search, compare, colocate, launch, tune, gnn: the other tabs' components, built when their
            tab is first shown or the attribute first read (:meth:`show_tab`).
    """

    state = param.ClassSelector(class_=PlanState)
    ray_address = param.String(default=None, allow_None=True, doc="Ray cluster for the Launch tab (None: local)")

    def __init__(self, state: PlanState | None = None, **params):
        super().__init__(state=state or PlanState(), **params)
        st = self.state
        self.form = PlanForm(state=st)
        self.gantt = GanttView(state=st, show_message=False)
        self.message = message_bar(st)
        self.export = ExportPanel(state=st)
        self._built: dict[str, pn.viewable.Viewable] = {TABS[0]: self.gantt}
        # Tabs other than the Schedule are built when first shown (a session opens in well under a
        # second); once built they stay in the page (dynamic=False): a hidden dynamic tab's detached
        # Panel panes re-point their shared stylesheets at cdn.holoviz.org when they update.
        self._slots = {name: pn.Column(sizing_mode="stretch_width") for name in TABS[1:]}
        self.tabs = pn.Tabs((TABS[0], self.gantt), *self._slots.items(), dynamic=False,
                            sizing_mode="stretch_width", css_classes=["tessel-tabs"])
        self.tabs.param.watch(self._on_tab, "active")

    def _component(self, tab: str):
        """The component of ``tab`` (one of :data:`TABS`), built on first use."""
        if tab not in self._built:
            st = self.state
            if tab == TABS[5]:
                comp = LaunchPanel(state=st)
                if self.ray_address and "address" in comp.param:
                    comp.address = self.ray_address
            elif tab == TABS[6]:
                comp = TunePanel(state=st)
                # a configuration loaded from the Tune tab is shown where it is drawn and edited
                comp.param.watch(lambda _e: setattr(self.tabs, "active", 0), "loaded")
            else:
                comp = {TABS[1]: GraphView, TABS[2]: SearchPanel, TABS[3]: CompareView, TABS[4]: ColocatePanel,
                        TABS[7]: lambda state: GNNPanel()}[tab](state=st)
            self._built[tab] = comp
        return self._built[tab]

    def show_tab(self, tab: str) -> None:
        """Build ``tab``'s component if needed and put it in its tab (what selecting the tab does)."""
        comp = self._component(tab)
        slot = self._slots.get(tab)
        if slot is not None and not slot.objects:
            slot.objects = [comp]

    def _on_tab(self, event) -> None:
        self.show_tab(TABS[event.new])

    graph = property(lambda self: self._component(TABS[1]), doc="the Model graph tab (GraphView)")
    search = property(lambda self: self._component(TABS[2]), doc="the Search tab (SearchPanel)")
    compare = property(lambda self: self._component(TABS[3]), doc="the Compare tab (CompareView)")
    colocate = property(lambda self: self._component(TABS[4]), doc="the Co-locate tab (ColocatePanel)")
    launch = property(lambda self: self._component(TABS[5]), doc="the Launch tab (LaunchPanel)")
    gnn = property(lambda self: self._component(TABS[7]), doc="the GNN tab (GNNPanel)")
    tune = property(lambda self: self._component(TABS[6]), doc="the Tune tab (TunePanel)")

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
    """``(plan, graph, timeline)`` of a session's first plan, made once per process and shared.

    Every browser session of ``tessel serve`` opens on the same model: it is captured, planned
    (:func:`engine.plan.make.make_plan`) and simulated (:func:`engine.plan.calibrate.resimulate`) once.
    The plan, its OpGraph and Timeline are immutable in the app (an edit makes a new Schedule and
    Plan with ``dataclasses.replace``); each session's :class:`PlanState` holds its own copies of
    the Plan and Schedule objects (:func:`copy.copy`), so renaming an edited schedule cannot touch
    another session's.

    Raises:
        engine.errors.TesselError: the model cannot be planned with these settings.
    """
    res = make_plan(model, devices=devices, micro_batches=micro_batches, schedule=schedule, device_type=device_type)
    return res.plan, res.graph, resimulate(res.plan)


def warm_up(*, model: str | None = "gpt2", plan: str | Plan | None = None, devices: int = 4, micro_batches: int = 8,
            schedule: str = "1f1b", device_type: str = "h100") -> None:
    """Make the first session's plan now and render one session (call it before the server listens,
    e.g. in ``tessel serve``): with the same arguments as :func:`build_app`, the first browser
    session then opens about as fast as later ones.

    Raises:
        engine.errors.TesselError: as :func:`build_app`.
    """
    if plan is None and model:
        initial_plan(model, devices, micro_batches, schedule, device_type)
    # one throw-away session rendered into a document: Bokeh's and Panel's first-use costs are paid here
    build_app(model=model, plan=plan, devices=devices, micro_batches=micro_batches, schedule=schedule,
              device_type=device_type).template().server_doc(Document())


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
        shared, graph, timeline = initial_plan(model, devices, micro_batches, schedule, device_type)
        state.load(dataclasses.replace(shared, schedule=copy.copy(shared.schedule)), graph=graph, timeline=timeline,
                   message=f"planned {model}: {schedule} on {devices} {device_type} devices, "
                           f"{micro_batches} micro-batches")
    gc.freeze()
    return app


__all__ = ["PlannerApp", "build_app", "initial_plan", "warm_up", "TABS", "EXTENSIONS", "load_extensions"]
