"""One check of a loaded plan's consistency, shared by ``tessel show`` and ``tessel launch``.

A plan file is edited by hand, imported from a torch pipelining CSV or produced by an older
version; :func:`check_plan` refuses one whose declared parallel degrees disagree with its
schedule (a plan declaring 10^6 micro-batches whose orders hold 4 would be trained on 4 and
reported on 10^6) or whose schedule breaks a rule of :meth:`engine.schedule.Schedule.validate`
(completeness, same-device dependency, cross-device deadlock, memory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import ScheduleError

if TYPE_CHECKING:
    from engine.io.plan import Plan

#: How a message says to repair a plan.
FIX_HINT = ("re-create it with `tessel plan` or `tessel search`, or repair its schedule.orders "
            "(`tessel show` checks an edited plan)")


def check_plan(plan: Plan, *, name: str = "the plan", memory_limit: float | None = None) -> None:
    """Refuse an inconsistent plan with one sentence.

    Args:
        plan: a loaded :class:`engine.io.plan.Plan`.
        name: how messages name the plan (e.g. its path).
        memory_limit: peak memory allowed per device, in the plan's memory unit (bytes for a
            model plan), or ``None`` for no memory rule.

    Raises:
        engine.transform.TransformError: a parallel degree that is not a positive integer
            (``ParallelConfig.check``).
        ScheduleError: ``parallel.micro_batches`` differs from ``schedule.num_micro_batches``
            (rule ``"micro-batches"``), ``parallel.pp`` from the number of device orders (rule
            ``"device"``), or the schedule breaks a rule of ``Schedule.validate``.
    """
    par, sched = plan.parallel, plan.schedule
    par.check()
    if par.micro_batches != sched.num_micro_batches:
        raise ScheduleError("micro-batches", f"{name} declares parallel.micro_batches = {par.micro_batches:,} but "
                                             f"its schedule has {sched.num_micro_batches:,} micro-batches "
                                             f"(schedule.num_micro_batches); {FIX_HINT}")
    if par.pp != sched.num_devices:
        raise ScheduleError("device", f"{name} declares parallel.pp = {par.pp} pipeline ranks but its schedule "
                                      f"orders {sched.num_devices} devices; {FIX_HINT}")
    try:
        sched.validate(memory_limit)
    except ScheduleError as e:
        raise ScheduleError(e.rule, f"{name}: {e}; {FIX_HINT}", e.device, e.block) from None
