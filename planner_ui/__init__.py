"""Panel/Bokeh components of the planner: param-based Viewers around one shared
:class:`~planner_ui.state.PlanState`, usable in ``panel serve``, Jupyter and tests.

``PlannerApp`` composes them; each also works alone, e.g. ``GanttView(state=state)`` in a notebook.
"""

from planner_ui.app import PlannerApp, build_app
from planner_ui.compare_view import CompareView
from planner_ui.export_panel import ExportPanel
from planner_ui.gantt import GanttView
from planner_ui.graph_view import GraphView
from planner_ui.launch_panel import LaunchPanel
from planner_ui.plan_form import PlanForm
from planner_ui.search_panel import SearchPanel
from planner_ui.state import EditResult, PlanState, abstract_plan

__all__ = ["PlanState", "EditResult", "abstract_plan", "GanttView", "GraphView", "SearchPanel", "CompareView",
           "ExportPanel", "LaunchPanel", "PlanForm", "PlannerApp", "build_app"]
