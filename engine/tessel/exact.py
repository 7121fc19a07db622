"""The exact optimum of the full scheduling problem for a few micro-batches (OR-Tools CP-SAT).

Tessel (:func:`engine.tessel.search.tessel_search`) builds a schedule from a periodic repetend
and a completion; :func:`engine.tessel.bounds.makespan_lower_bound` bounds every schedule from
below. Where the two differ, :func:`exact_schedule` tells whose the gap is: it solves the whole
problem for ``m`` micro-batches at once, with no repetend, and returns the optimal makespan with
a proof (CP-SAT status ``OPTIMAL``), or the best schedule and the best proven bound found in the
time given.

The problem, the CP-SAT model over every block instance, the FIFO symmetry breaking (with its
proof) and the redundant constraints are :mod:`engine.tessel.exact_model`'s (the memory
constraints :mod:`engine.tessel.exact_memory`'s); this module solves that model whole and turns
its solution into a validated :class:`~engine.schedule.Schedule`. Durations and lags are integer
ticks: where they are not whole ticks they are rounded up, which the result reports as
``rounded`` and the status ``"optimal_at_resolution"``.

Sources: the problem is Tessel's (Lin et al., HPCA 2024, section III: placement of one
micro-batch, scheduling of many); the solver is OR-Tools CP-SAT.

Limits: the model has ``m x blocks`` intervals; proofs are quick for a few micro-batches and get
hard beyond about 8 on 4-device shapes with a tight memory limit, where the result is a feasible
schedule and a proven bound.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Sequence

from ortools.sat.python import cp_model

from engine.errors import RunError, ScheduleError, TesselError
from engine.placement import Placement
from engine.schedule import Schedule
from engine.tessel.exact_model import prepare_exact
from engine.tessel.repetend import EXACT_REL_TOL, MAX_DENOMINATOR

__all__ = ["ExactResult", "exact_schedule"]

log = logging.getLogger(__name__)

_CP_STATUS = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible", cp_model.INFEASIBLE: "infeasible",
              cp_model.UNKNOWN: "unknown"}


@dataclass
class ExactResult:
    """Outcome of :func:`exact_schedule`.

    Attributes:
        status: ``"optimal"`` (proven, exact durations), ``"optimal_at_resolution"`` (proven for the
            durations rounded up to ticks: ``rounded``), ``"feasible"`` (a schedule, optimality not
            proven in the time given), ``"infeasible"`` (proven: no schedule fits the memory limit),
            ``"unknown"`` (nothing found in the time given).
        makespan: the returned schedule's makespan in the placement's time unit (the simulated one,
            :func:`engine.simulate.simulate` of :func:`engine.dependency.lower`, when there are no
            lags; with lags, the same as-soon-as-possible execution of its orders with the lags
            added); ``None`` without a schedule.
        lower_bound: placement time units: no schedule is shorter. The larger of CP-SAT's proven
            bound (``solver_bound``, left out when ``rounded``: it then bounds the rounded-up problem,
            not the exact one) and ``makespan_lower_bound``; ``inf`` when proven infeasible.
        schedule: the best schedule found (per-device orders by start time, named ``"exact"``), or
            ``None``; it passes ``schedule.validate(memory_limit)``.
        wall_time: seconds of the whole call (``time.perf_counter``), model building included.
        resolution: placement time units per solver tick.
        rounded: durations or lags are not whole ticks and were rounded up: ``makespan`` is then
            that of a schedule optimal for the rounded durations, not necessarily for the exact ones.
        solver_bound: CP-SAT's proven bound on the tick model's makespan, in placement time units
            (a lower bound in exact time only when not ``rounded``); ``None`` when nothing was proven.
        makespan_lower_bound: :func:`engine.tessel.bounds.makespan_lower_bound` for ``m`` and the
            limit (communication ignored).
        makespan_ticks: the schedule's makespan in ticks (durations and lags rounded up to ticks).
        fifo: whether the FIFO symmetry breaking was on (always, except in tests).
        meta: solver details: ``cp_sat_status``, ``wall_time_solver`` (s), ``hint_makespan_ticks``,
            ``model_lower_bound_ticks`` (the model's own path bound), ``horizon_ticks``.
    """

    status: str
    makespan: float | None
    lower_bound: float
    schedule: Schedule | None
    wall_time: float
    resolution: float
    rounded: bool = False
    solver_bound: float | None = None
    makespan_lower_bound: float = 0.0
    makespan_ticks: int | None = None
    fifo: bool = True
    meta: dict = field(default_factory=dict)

    @property
    def proven_optimal(self) -> bool:
        """The makespan is proven optimal in exact time (``status == "optimal"``)."""
        return self.status == "optimal"

    @property
    def gap(self) -> float | None:
        """``makespan / lower_bound - 1``: 0 when proven optimal; ``None`` without a makespan."""
        if self.makespan is None or not self.lower_bound or math.isinf(self.lower_bound):
            return None
        return self.makespan / self.lower_bound - 1


def _ticks_to_units(ticks: int, resolution: float) -> float:
    """``ticks`` x ``resolution``, computed on the tick's rational value where it has one (40 ticks of
    0.1 are 4.0, not 4.000000000000001)."""
    q = Fraction(resolution).limit_denominator(MAX_DENOMINATOR)
    if abs(float(q) - resolution) <= EXACT_REL_TOL * resolution:
        return float(q * ticks)
    return ticks * resolution


# ----------------------------------------------------------------------------- the solver
def exact_schedule(
    placement: Placement,
    m: int,
    *,
    memory_limit: float | Sequence[float] | None = None,
    lags: dict[tuple[int, int], float] | None = None,
    time_limit: float = 60.0,
    workers: int = 1,
    seed: int = 0,
    hint: Schedule | None = None,
    use_bound: bool = False,
    _fifo: bool = True,
    _cumulative: bool = True,
) -> ExactResult:
    """The minimum-makespan schedule of ``m`` micro-batches, solved exactly with CP-SAT.

    See :mod:`engine.tessel.exact_model` for the model, the FIFO symmetry breaking and its proof,
    and the redundant constraints. Meant for a few micro-batches (up to about 16 on 4-device
    shapes): the model has ``m x blocks`` intervals.

    Args:
        placement: the blocks of one micro-batch (durations in any time unit; memory in any unit).
        m: micro-batches, at least 1.
        memory_limit: per-device limit in the placement's memory units (a scalar for every device,
            or one value per device), static memory included, as for
            :func:`engine.tessel.search.tessel_search`; ``None``: no limit.
        lags: time units of communication on dependencies, ``(a, b) -> lag`` by block index (``b``
            waits ``lag`` after ``a`` ends), as for ``tessel_search``; ``None``: free communication.
        time_limit: wall-clock seconds for the whole call, model building included; CP-SAT returns
            its best solution and bound when it hits.
        workers: CP-SAT search workers (1: deterministic for a fixed ``seed``).
        seed: CP-SAT random seed.
        hint: a schedule of the same placement and ``m`` (e.g. Tessel's) whose start times, its
            orders executed as soon as possible (as :func:`engine.simulate.simulate` does, with the
            lags and the rounded durations of the model), FIFO-relabelled, seed CP-SAT
            (``AddHint``); when it fits the memory limit its makespan also caps the model's.
        use_bound: also require ``makespan >= makespan_lower_bound`` (in ticks, rounded up). Faster
            proofs, but the optimum then relies on :mod:`engine.tessel.bounds` being right.
        _fifo: the FIFO symmetry breaking (tests switch it off to check it changes nothing).
        _cumulative: the memory as a ``Cumulative`` with in-flight precedences where the activations
            pair up (:func:`engine.tessel.exact_memory.add_memory`); off: the plain reservoir (tests
            check both agree).

    Returns:
        :class:`ExactResult`.

    Raises:
        TesselError: ``m < 1``, a time limit or worker count that is not positive, a malformed
            ``memory_limit`` or lag, a hint of another placement or micro-batch count, or one whose
            orders are not a valid schedule (``ScheduleError``).
        InfeasibleMemoryError: the limit is below :func:`engine.tessel.bounds.memory_floor` (what
            one micro-batch at a time needs).
        RunError: the model and the schedule built from its solution disagree (a bug here).
    """

    t0 = time.perf_counter()
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise TesselError(f"need at least one micro-batch, got m={m!r}")
    if not (isinstance(time_limit, (int, float)) and math.isfinite(time_limit) and time_limit > 0):
        raise TesselError(f"the time limit must be a positive number of seconds, got {time_limit!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise TesselError(f"workers must be a positive integer, got {workers!r}")
    prob = prepare_exact(placement, m, memory_limit=memory_limit, lags=lags, hint=hint, use_bound=use_bound,
                         fifo=_fifo, cumulative=_cumulative)
    em = prob.build(hint=prob.hint_starts)
    pl, model, start, makespan = placement, em.model, em.start, em.makespan
    res, rounded, limits, ms_lb = prob.resolution, prob.rounded, prob.limits, prob.makespan_lower_bound
    hint_span, horizon, lb_ticks = prob.hint_span, prob.horizon, prob.lb_ticks

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit - (time.perf_counter() - t0))
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    code = solver.solve(model)
    if code == cp_model.MODEL_INVALID:
        raise RunError(f"exact_schedule built an invalid CP-SAT model: {model.validate()}")
    status = _CP_STATUS.get(code, "unknown")
    if status == "infeasible" and prob.hint_fits:
        raise RunError("exact_schedule: CP-SAT proved infeasible a model whose hint fits the memory limit (a bug)")
    solver_bound_ticks: int | None = None
    if status in ("optimal", "feasible", "unknown"):
        bound = solver.best_objective_bound
        if math.isfinite(bound):
            solver_bound_ticks = int(math.ceil(bound - 1e-9))

    schedule = None
    span = None
    span_ticks = None
    if status in ("optimal", "feasible"):
        found = {inst: solver.value(v) for inst, v in start.items()}
        obj = solver.value(makespan)
        orders = prob.orders(found)
        schedule = Schedule(pl, m, orders, "exact")
        try:
            schedule.validate(limits)
        except ScheduleError as e:
            raise RunError(f"exact_schedule: the schedule from the CP-SAT solution is invalid ({e}): a bug") from e
        span_ticks = prob.span_ticks(orders)
        if span_ticks > obj:  # the model allowed what the orders cannot do: its bound stays a bound
            log.warning("exact_schedule: the solution's orders run in %d ticks, the model said %d; not optimal",
                        span_ticks, obj)
            status = "feasible"
        elif span_ticks < obj and status == "optimal":  # a shorter solution than the proven optimum
            log.warning("exact_schedule: the solution's orders run in %d ticks, shorter than the proven optimum %d: "
                        "the model is over-constrained%s", span_ticks, obj,
                        " (use_bound: makespan_lower_bound exceeds the optimum)" if use_bound else "")
            status = "feasible"
            solver_bound_ticks = None
        span = prob.span_units(schedule)
        if status == "optimal" and rounded:
            status = "optimal_at_resolution"
        schedule.meta["exact"] = {"status": status, "makespan": span, "makespan_ticks": span_ticks,
                                  "resolution": res, "rounded": rounded, "fifo": _fifo}

    solver_bound = None if solver_bound_ticks is None else _ticks_to_units(solver_bound_ticks, res)
    if status == "infeasible":
        lower_bound = math.inf
    else:
        lower_bound = ms_lb if (solver_bound is None or rounded) else max(ms_lb, solver_bound)
    if span is not None and ms_lb > span * (1 + 1e-9):
        log.warning("exact_schedule: makespan_lower_bound %.6g exceeds a feasible schedule's makespan %.6g: the bound "
                    "is wrong for this placement (m=%d, memory_limit=%s)", ms_lb, span, m, memory_limit)
    wall = time.perf_counter() - t0
    log.info("exact_schedule %s m=%d: %s, makespan %s, lower bound %.6g (%.2f s, %d workers)", pl.name, m, status,
             span, lower_bound, wall, workers)
    return ExactResult(status=status, makespan=span, lower_bound=lower_bound, schedule=schedule, wall_time=wall,
                       resolution=res, rounded=rounded, solver_bound=solver_bound, makespan_lower_bound=ms_lb,
                       makespan_ticks=span_ticks, fifo=_fifo,
                       meta={"cp_sat_status": solver.status_name(code), "wall_time_solver": solver.wall_time,
                             "hint_makespan_ticks": hint_span, "model_lower_bound_ticks": lb_ticks,
                             "horizon_ticks": horizon})
