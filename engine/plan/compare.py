"""Compare schedules of one placement: predefined baselines next to a searched schedule.

Which baselines apply: GPipe and 1F1B to any placement (on a plain pipeline (V) the predefined
schedules that ``tessel plan`` runs, elsewhere the list-scheduling policies of
:mod:`engine.baselines.generic`; a predefined 1F1B above the memory limit is replaced by the
policy, which honours it); interleaved 1F1B and ZB-H1 only to a plain pipeline (V), run on the same
model cut into twice as many segments (interleaved) or with the backward split into I and W
(ZB-H1). A baseline whose peak memory exceeds the limit is reported, marked ``over_limit``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from engine.baselines import build_schedule
from engine.baselines.generic import gpipe_any, one_f_one_b_any
from engine.dependency import lower
from engine.errors import TesselError
from engine.placement import Placement
from engine.schedule import Schedule
from engine.simulate import simulate


@dataclass
class ScheduleMetrics:
    """Simulated metrics of one schedule.

    Attributes:
        name: schedule name.
        makespan: seconds (or abstract units) for one step.
        bubble_ratio: idle / (devices x makespan).
        peak_memory: per device, bytes or units.
        over_limit: the peak exceeds the memory limit.
        schedule: the schedule itself (``None`` when it does not apply).
        note: why it does not apply, if so.
    """

    name: str
    makespan: float | None
    bubble_ratio: float | None
    peak_memory: list[int] | None
    over_limit: bool = False
    schedule: Schedule | None = None
    note: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "makespan": self.makespan, "bubble_ratio": self.bubble_ratio,
                "peak_memory": self.peak_memory, "over_limit": self.over_limit, "note": self.note}


#: ``schedule -> metrics dict`` (``makespan``, ``bubble_ratio``, ``peak_memory``): a plan's prediction,
#: e.g. :meth:`engine.plan.model_search.SearchPlan.predict` (:func:`engine.plan.metrics.predicted_metrics`).
Predictor = Callable[[Schedule], dict]


def measure(schedule: Schedule, memory_limit=None, cost=None, predict: Optional[Predictor] = None) -> ScheduleMetrics:
    """Simulate a schedule.

    Args:
        schedule: the schedule.
        memory_limit: per-device limit (same units as the placement's memory), or ``None``.
        cost: a cost model for communication, or ``None`` (free).
        predict: where the schedule is part of a plan, the plan's prediction
            (:func:`engine.plan.metrics.predicted_metrics` of it: tied weights, optimizer step and
            the plan's cost model included), so the row shows what ``tessel show`` shows for that
            plan; ``None``: the bare schedule lowered without parameters and simulated with ``cost``.
    """
    if predict is not None:
        m = predict(schedule)
        makespan, bubble, peak = m["makespan"], m["bubble_ratio"], list(m["peak_memory"])
    else:
        tl = simulate(lower(schedule), cost)
        makespan, bubble, peak = tl.makespan, tl.bubble_ratio(), tl.peak_memory()
    over = memory_limit is not None and any(p > memory_limit for p in peak)
    return ScheduleMetrics(schedule.name, makespan, bubble, peak, over, schedule)


def _is_plain_pipeline(placement: Placement) -> bool:
    return placement.name == "V" and all(len(b.devices) == 1 for b in placement.blocks)


def _policy_row(name: str, placement: Placement, m: int, memory_limit, cost,
                predict: Optional[Predictor]) -> ScheduleMetrics:
    """GPipe or 1F1B on ``placement``: on a plain pipeline (V) the predefined schedule, the one
    ``tessel plan --schedule`` runs (the list-scheduling policy drifts from it when stage times are
    uneven); a predefined 1F1B above ``memory_limit``, or any other placement, gets the policy of
    :mod:`engine.baselines.generic` (1F1B honouring the limit).

    Raises:
        TesselError: the memory-limited 1F1B policy cannot run within the limit.
    """
    if _is_plain_pipeline(placement):
        try:
            row = measure(build_schedule(name, placement, m), memory_limit, cost, predict)
        except (TesselError, ValueError):
            row = None
        if row is not None and not (name == "1f1b" and row.over_limit):
            return row
    if name == "gpipe":
        return measure(gpipe_any(placement, m), memory_limit, cost, predict)
    return measure(one_f_one_b_any(placement, m, memory_limit=memory_limit), memory_limit, cost, predict)


def compare_baselines(
    placement: Placement,
    m: int,
    *,
    memory_limit: float | None = None,
    cost=None,
    variant: Callable[[str], Placement] | None = None,
    predict: Optional[Predictor] = None,
) -> list[ScheduleMetrics]:
    """GPipe, 1F1B, interleaved and ZB-H1 on ``placement`` where they apply.

    Args:
        placement: the placement searched.
        m: micro-batches.
        memory_limit: per-device limit (same units as the placement's memory).
        cost: cost model for communication in the simulation (``None``: free).
        variant: for a V placement, ``variant("interleaved")`` / ``variant("zb-h1")`` returns the
            same model's placement that schedule needs; ``None`` skips them.
        predict: each schedule's prediction as a plan (:func:`measure`), or ``None``.

    Returns:
        one :class:`ScheduleMetrics` per schedule, in the order GPipe, 1F1B, interleaved, ZB-H1.
    """
    rows = [_policy_row("gpipe", placement, m, memory_limit, cost, predict)]
    try:
        rows.append(_policy_row("1f1b", placement, m, memory_limit, cost, predict))
    except TesselError as e:
        rows.append(ScheduleMetrics("1f1b", None, None, None, note=str(e)))
    for name in ("interleaved", "zb-h1"):
        if placement.name != "V" or variant is None:
            rows.append(ScheduleMetrics(name, None, None, None,
                                        note=f"needs a plain pipeline (V); this is {placement.name}"))
            continue
        try:
            rows.append(measure(build_schedule(name, variant(name), m), memory_limit, cost, predict))
        except (TesselError, ValueError) as e:
            rows.append(ScheduleMetrics(name, None, None, None, note=str(e)))
    return rows
