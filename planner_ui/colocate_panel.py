"""The "Co-locate" tab: predict two (or more) data-parallel jobs sharing the same devices.

CrossoverScheduler (docs/ARCHITECTURE.md, Sources): while one job all-reduces its gradients the
other computes, through a per-device compute token. The tab co-locates the current plan with
copies of itself, or with plans added to the Compare tab that have the same devices, predicts
crossover, uncoordinated and sequential execution (:func:`engine.crossover.compare_modes`) and
shows both jobs interleaved on each device (:class:`~planner_ui.crossover_view.CrossoverView`).
"""

from __future__ import annotations

import panel as pn
import param

from engine.crossover import compare_modes
from engine.errors import TesselError
from planner_ui.crossover_view import CrossoverView
from planner_ui.state import PlanState


class ColocatePanel(pn.viewable.Viewer):
    """Predict co-located copies of the current plan (``jobs`` of them).

    Only data-parallel plans (pp = 1) can be co-located; others get a message saying how to
    plan one (``DP degree`` = devices in the plan form). Errors go to ``state.message``.
    """

    state = param.ClassSelector(class_=PlanState)
    jobs = param.Integer(default=2, bounds=(2, 8), doc="co-located copies of the current plan")
    steps = param.Integer(default=4, bounds=(1, 100), doc="steps simulated per job")

    def __init__(self, **params):
        super().__init__(**params)
        self.view = CrossoverView()
        self.button = pn.widgets.Button(name="Predict co-location", button_type="primary",
                                        css_classes=["tessel-colocate-run"])
        self.button.on_click(lambda _e: self.predict())
        self.note = pn.pane.Markdown(
            "Co-locate copies of the current **data-parallel** plan (pp = 1) on the same devices: "
            "crossover hands a compute token between the jobs at their gradient all-reduce.",
            css_classes=["tessel-colocate-note"], sizing_mode="stretch_width")

    def predict(self) -> bool:
        """Predict the co-location of ``jobs`` copies of the current plan; ``False`` on a mistake."""
        plan = self.state.plan
        if plan is None:
            return self._error("no plan is loaded; plan a data-parallel model first")
        if self.state.abstract:
            return self._error("co-location needs a model plan (real compute and all-reduce times); "
                               "plan a model with DP degree = devices")
        try:
            preds = compare_modes([plan] * self.jobs, steps=self.steps,
                                  names=[chr(ord("A") + i) for i in range(self.jobs)])
        except TesselError as e:
            return self._error(f"cannot co-locate this plan: {e}")
        self.view.param.update(predictions=preds, prediction=preds[self.view.mode])
        c, s = preds["crossover"], preds["sequential"]
        self.state.message_kind = "success"
        self.state.message = (f"co-location of {self.jobs} jobs predicted: crossover "
                              f"{c.aggregate_tokens_per_second:,.0f} tokens/s vs sequential "
                              f"{s.aggregate_tokens_per_second:,.0f} "
                              f"({c.aggregate_tokens_per_second / s.aggregate_tokens_per_second:.2f}x)")
        return True

    def _error(self, text: str) -> bool:
        self.state.message_kind = "error"
        self.state.message = text
        return False

    def __panel__(self):
        return pn.Column(self.note, pn.Row(pn.widgets.IntInput.from_param(self.param.jobs, width=120),
                                           pn.widgets.IntInput.from_param(self.param.steps, width=120),
                                           self.button, align="end"),
                         self.view, sizing_mode="stretch_width", css_classes=["tessel-colocate"])


__all__ = ["ColocatePanel"]
