"""Plans: making one, lowering it, its metrics, its checks, comparing schedules, calibrating it and
turning a Tessel search into one; one function each, used by the ``tessel`` CLI, the app and the
Python API alike.

Modules:

* :mod:`~engine.plan.make`: :func:`make_plan` (capture -> transform -> schedule -> lower ->
  simulate), ``PlanResult``, ``placement_from_segments``;
* :mod:`~engine.plan.lowering`: :func:`plan_lower_options` (a plan's
  :class:`~engine.dependency.LowerOptions`), :func:`lower_plan`, :func:`plan_tied_groups`;
* :mod:`~engine.plan.metrics`: :func:`predicted_metrics` / :func:`predict`, THE predicted numbers of a plan;
* :mod:`~engine.plan.check`: :func:`check_plan`, a loaded plan's consistency (``tessel show``, ``tessel launch``);
* :mod:`~engine.plan.compare`: :func:`compare_baselines`, :func:`measure`, schedules of one placement side by side;
* :mod:`~engine.plan.calibrate`: :func:`with_segment_times`, :func:`with_calibration`,
  :func:`calibrate_plan` (from a launch's measured steps), :func:`resimulate`;
* :mod:`~engine.plan.from_search`: :func:`plan_from_search`, a Tessel search's result as a plan;
* :mod:`~engine.plan.model_search`: :func:`model_search_plan`, a Tessel search on a model's shape,
  as a launchable plan;
* :mod:`~engine.plan.limits`: :func:`check_memory_limit`, the one check of a memory limit.

Imports. ``engine.plan`` and its modules import neither torch nor transformers, except
:mod:`~engine.plan.make` and :mod:`~engine.plan.model_search`, which capture models: their names
(``make_plan``, ``PlanResult``, ``placement_from_segments``, ``model_search_plan``,
``SearchPlan``) are loaded on first use (PEP 562 module ``__getattr__``), so an abstract
``tessel search`` (placements in units, no model) stays free of torch. Code that always plans a
model may import :mod:`engine.plan.make` directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.lazy_names import load_lazy_name
from engine.plan.calibrate import CalibrationCheck, calibrate_plan, resimulate, with_calibration, with_segment_times
from engine.plan.check import check_plan
from engine.plan.compare import ScheduleMetrics, compare_baselines, measure
from engine.plan.from_search import plan_from_search, with_schedule
from engine.plan.limits import MemoryLimitError, check_memory_limit
from engine.plan.lowering import lower_plan, plan_lower_options, plan_tied_groups
from engine.plan.metrics import (
    METRIC_KEYS,
    is_abstract,
    predict,
    predict_execution,
    predicted_metrics,
    tokens_per_step,
)

if TYPE_CHECKING:
    from engine.plan.make import PlanResult, make_plan, placement_from_segments
    from engine.plan.model_search import SearchPlan, model_search_plan

#: Names loaded on first use, from the modules that import torch.
_LAZY = {"make_plan": "engine.plan.make", "PlanResult": "engine.plan.make",
         "placement_from_segments": "engine.plan.make", "model_search_plan": "engine.plan.model_search",
         "SearchPlan": "engine.plan.model_search"}

__all__ = ["METRIC_KEYS", "CalibrationCheck", "MemoryLimitError", "PlanResult", "ScheduleMetrics", "SearchPlan",
           "calibrate_plan", "check_memory_limit", "check_plan", "compare_baselines", "is_abstract", "lower_plan",
           "make_plan", "measure", "model_search_plan", "placement_from_segments", "plan_from_search",
           "plan_lower_options", "plan_tied_groups", "predict", "predict_execution", "predicted_metrics", "resimulate",
           "tokens_per_step", "with_calibration", "with_schedule", "with_segment_times"]


def __getattr__(name: str) -> Any:
    """PEP 562: ``engine.plan.make_plan`` and the other names of :data:`_LAZY`, imported on first use."""
    return load_lazy_name(__name__, _LAZY, globals(), name)
