"""A Tessel search's result as a plan: the one function (:func:`plan_from_search`) that
``tessel search``, the app's Search tab and the Python API call, so the CLI and the app save the
same plan for the same search.

Three kinds of search end here:

* an abstract placement (a Tessel shape in units, or a placement JSON file): the plan has no
  model to build (``model.name`` ``"abstract"``, ``source`` ``"units"``, F = 1 and B = 2 units per
  block; or the file's path and ``source`` ``"placement-json"``), no segments and no cost model;
  ``meta["abstract"]`` is set and ``meta["memory_unit"]`` says in what fraction of one segment's
  activations its memory is counted (``tessel search`` counts half-units so the interleaved
  baseline's half-size segments stay integral);
* a model's shape (:func:`engine.plan.model_search.model_search_plan`): the model's plan built for
  the searched schedule;
* a loaded plan's own placement re-scheduled (the app's "current plan's placement"):
  :func:`with_schedule`.

Either way ``meta["searched"] = "tessel"`` (and ``meta["shape"]`` for a shape of a model,
``meta["memory_limit"]`` for a limit) and ``metrics`` is the search's summary (period, bounds,
solver timings) plus :func:`engine.plan.metrics.predicted_metrics` of the plan.

Importing this module does not import torch (an abstract ``tessel search`` stays light).

Source: Tessel (Lin et al., HPCA 2024), sections III-IV.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from engine.config import ModelRef, ParallelConfig
from engine.io.plan import Plan
from engine.plan.metrics import predict
from engine.schedule import Schedule
from engine.timeline import Timeline

if TYPE_CHECKING:
    from engine.tessel import SearchResult

__all__ = ["ABSTRACT_MODEL", "abstract_plan_for", "memory_unit_label", "plan_from_search", "with_schedule"]

#: The ``model`` section of an abstract plan of a Tessel shape: costs in units, F = 1 and B = 2 per block.
ABSTRACT_MODEL: dict[str, Any] = {"name": "abstract", "source": "units", "forward": 1.0, "backward": 2.0}


def memory_unit_label(memory_scale: int) -> str:
    """``meta["memory_unit"]`` of an abstract plan counting ``memory_scale`` units per segment's
    activations (``"1/2 activation unit"``; ``tessel show`` reads the scale back)."""
    return f"1/{memory_scale} activation unit"


def abstract_plan_for(schedule: Schedule, *, model: dict[str, Any] | None = None, memory_scale: int = 1) -> Plan:
    """The plan of ``schedule`` on an abstract placement: no segments, no cost model
    (communication is free in its simulation), ``model`` as its ``model`` section (default
    :data:`ABSTRACT_MODEL`), ``meta["abstract"]`` and ``meta["memory_unit"]``
    (:func:`memory_unit_label`). Metrics are empty."""
    pl = schedule.placement
    parallel = ParallelConfig.from_dict({"dp": 1, "tp": 1, "pp": pl.num_devices,
                                         "micro_batches": schedule.num_micro_batches, "devices": pl.num_devices,
                                         "optimizer": "adam"})
    return Plan(model=ModelRef.from_dict(dict(model or ABSTRACT_MODEL)), parallel=parallel, segments=[],
                schedule=schedule, cost={}, metrics={},
                meta={"abstract": True, "memory_unit": memory_unit_label(memory_scale)})


def with_schedule(plan: Plan, schedule: Schedule) -> Plan:
    """``plan`` running ``schedule`` (of the same placement) instead of its own: the micro-batches
    follow it, and the model's batch size (where the plan records its micro-batch size) is
    ``micro_batch_size x micro-batches x dp x`` the placement's ``data_per_instance``."""
    m = schedule.num_micro_batches
    model = plan.model
    if model.recorded("micro_batch_size"):
        replicas = max(1, plan.parallel.dp) * max(1, schedule.placement.data_per_instance)
        model = replace(model, batch_size=model.micro_batch_size * m * replicas)
    return replace(plan, schedule=schedule, model=model, parallel=replace(plan.parallel, micro_batches=m))


def plan_from_search(result: SearchResult, plan: Plan | None = None, *, memory_limit: float | None = None,
                     memory_scale: int = 1, model: dict[str, Any] | None = None,
                     shape: str | None = None) -> tuple[Plan, Timeline]:
    """The plan of a Tessel search's schedule, with its predicted timeline.

    Args:
        result: the :class:`engine.tessel.SearchResult`.
        plan: the plan the searched schedule runs in (a model's plan for a shape of it, or a
            loaded plan whose placement was searched; :func:`with_schedule` puts the schedule in);
            ``None``: an abstract placement (:func:`abstract_plan_for`).
        memory_limit: the per-device limit the search honoured (bytes, or the placement's memory
            units), recorded as ``meta["memory_limit"]``; ``None``: none (a plan's own stays).
        memory_scale: abstract plans: memory units per segment's activations.
        model: abstract plans: the ``model`` section (default :data:`ABSTRACT_MODEL`).
        shape: the Tessel shape of a model's search, recorded as ``meta["shape"]``.

    Returns:
        ``(plan, timeline)``: ``plan.metrics`` is ``result.summary()`` plus
        :func:`engine.plan.metrics.predicted_metrics` of the plan; ``timeline`` is its
        prediction (:func:`engine.plan.metrics.predict`).

    Raises:
        PlanFormatError, TransformError, DeadlockError: as :func:`engine.plan.metrics.predict`.
    """
    if plan is None:
        base = abstract_plan_for(result.schedule, model=model, memory_scale=memory_scale)
    else:
        base = with_schedule(plan, result.schedule)
    meta = {**base.meta, "searched": "tessel"}
    if shape is not None:
        meta["shape"] = shape
    if memory_limit is not None:
        meta["memory_limit"] = memory_limit
    new = replace(base, metrics={}, meta=meta)
    timeline, predicted = predict(new)
    new.metrics = {**result.summary(), **predicted}
    return new, timeline
