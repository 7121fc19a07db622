"""A plan's predicted metrics, computed from the plan alone: the one source of every predicted number.

``tessel plan``, ``tessel search`` (its plan and its table), ``tessel show``, ``tessel launch``'s
"predicted" column and the app all print what :func:`predicted_metrics` returns for the same
plan, so they agree; ``plan.metrics`` as saved by :func:`engine.plan.make.make_plan` and
:func:`engine.plan.from_search.plan_from_search` equals ``predicted_metrics(load_plan(path))``
(plus, for a searched plan, the search's summary).

The prediction lowers the plan with everything it records (:func:`engine.plan.lowering.lower_plan`:
segments' parameter bytes, ``dp``/``tp``, tied weights, CoCoNet transformations, MoE all-to-alls)
and simulates it (:func:`engine.simulate.simulate`) with its stored cost model
(``plan.cost``; a calibration in ``plan.meta["calibration"]`` included). A plan without a cost
model is abstract (``tessel search`` without ``--model``): its times and memory are in the
placement's own units, ``time_unit`` says so and it has no tokens.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from engine.cost import CostModel
from engine.cost.calibrate import CalibratedCost, Calibration
from engine.dependency import ExecutionPlan
from engine.plan.lowering import lower_plan
from engine.simulate import simulate
from engine.timeline import Timeline

if TYPE_CHECKING:
    from engine.io.plan import Plan

__all__ = ["predict", "predict_execution", "predicted_metrics", "is_abstract", "tokens_per_step", "METRIC_KEYS"]

#: The keys :func:`predicted_metrics` always returns.
METRIC_KEYS = ("makespan", "bubble_ratio", "bubble_ratios", "peak_memory", "time_unit", "memory_unit",
               "tokens_per_step", "tokens_per_second", "memory_capacity")


def is_abstract(plan: Plan) -> bool:
    """Whether ``plan`` is in abstract units: it records no cost model (``plan.cost`` empty), as
    ``tessel search`` without ``--model`` (placement shapes or a placement JSON file) writes."""
    return not plan.cost


def tokens_per_step(plan: Plan) -> int:
    """Tokens (samples for a task without a sequence) one step of ``plan`` trains on:
    ``micro_batch_size x seq_len x micro-batches x data replicas``, where the data replicas are
    ``dp`` times the placement's ``data_per_instance`` (2 for Tessel's X shape: two model
    replicas per instance) and the micro-batches are the schedule's. 0 for an abstract plan.
    """
    if is_abstract(plan):
        return 0
    ref = plan.model
    replicas = max(1, int(plan.parallel.dp)) * max(1, int(plan.placement.data_per_instance))
    return int(ref.micro_batch_size) * int(ref.seq_len or 1) * int(plan.schedule.num_micro_batches) * replicas


def _memory_capacity(plan: Plan) -> float | None:
    """The per-device memory the plan was checked against: ``plan.meta["memory_limit"]`` (bytes, or
    units for an abstract plan) where the planner recorded one, else the cost model's device
    capacity (bytes); ``None`` for an abstract plan without a limit."""
    limit = plan.meta.get("memory_limit")
    if limit is not None:
        return float(limit)
    if is_abstract(plan):
        return None
    return float(CostModel.from_dict(plan.cost).device.mem_capacity)


def _lower_and_simulate(plan: Plan) -> tuple[ExecutionPlan, Timeline]:
    """The plan's instruction streams and their simulation with its cost model (and calibration)."""
    cost: Any = CostModel.from_dict(plan.cost) if plan.cost else None
    cal = plan.meta.get("calibration")
    if cal and cost is not None:
        cost = CalibratedCost(cost, Calibration.from_dict(cal))
    execution = lower_plan(plan)
    return execution, simulate(execution, cost)


def _metrics(plan: Plan, timeline: Timeline) -> dict:
    m = timeline.metrics()
    abstract = is_abstract(plan)
    tokens = tokens_per_step(plan)
    makespan = float(m["makespan"])
    m["time_unit"] = "units" if abstract else "s"
    m["memory_unit"] = "units" if abstract else "bytes"
    m["tokens_per_step"] = tokens
    m["tokens_per_second"] = tokens / makespan if tokens and makespan > 0 and math.isfinite(makespan) else 0.0
    if abstract:
        m["tokens_note"] = "an abstract plan (no model, times in units) has no tokens per second"
    m["memory_capacity"] = _memory_capacity(plan)
    return m


def predict(plan: Plan) -> tuple[Timeline, dict]:
    """Lower and simulate ``plan`` and compute its metrics.

    Returns:
        ``(timeline, metrics)``: the predicted :class:`~engine.timeline.Timeline` of one step and
        :func:`predicted_metrics`'s dict.

    Raises:
        PlanFormatError: a malformed ``moe`` or ``tied_weights`` entry.
        TransformError: a segment's experts do not divide by the plan's ``dp``.
        DeadlockError: the plan's device orders deadlock.
    """
    _, tl = _lower_and_simulate(plan)
    return tl, _metrics(plan, tl)


def predict_execution(plan: Plan) -> tuple[ExecutionPlan, Timeline, dict]:
    """:func:`predict` that also returns the lowered instruction streams (for ``make_plan``)."""
    ex, tl = _lower_and_simulate(plan)
    return ex, tl, _metrics(plan, tl)


def predicted_metrics(plan: Plan) -> dict:
    """A plan's predicted metrics, from the plan alone.

    Returns:
        ``makespan`` (seconds; units for an abstract plan), ``bubble_ratio`` (idle / (devices x
        makespan)), ``bubble_ratios`` (per device), ``peak_memory`` (per device, bytes; units for
        an abstract plan), ``time_unit`` (``"s"`` or ``"units"``), ``memory_unit`` (``"bytes"`` or
        ``"units"``), ``tokens_per_step`` (:func:`tokens_per_step`), ``tokens_per_second``
        (``tokens_per_step / makespan``; 0 only for a plan without tokens, then ``tokens_note``
        says why), ``memory_capacity`` (bytes per device the plan is checked against, or
        ``None``).

    Raises:
        PlanFormatError, TransformError, DeadlockError: as :func:`predict`.
    """
    return predict(plan)[1]
