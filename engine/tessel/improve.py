"""Improve a finished schedule by large-neighbourhood search on the exact whole-schedule model.

Tessel (:func:`engine.tessel.search.tessel_search`) builds a schedule from a periodic repetend
and completes it with a warmup and a cooldown (Lin et al., "Tessel", HPCA 2024, section IV-B;
:mod:`engine.tessel.completion`). The whole-schedule CP-SAT model of :mod:`engine.tessel.exact_model`
finds shorter schedules for moderate ``m`` when hinted with Tessel's, but the full model is too
large to improve quickly beyond a few micro-batches. :func:`improve_schedule` keeps the model
small: it re-solves one *neighbourhood* at a time with every other instance fixed.

The search
----------
The incumbent is a solution of the exact model: start ticks of every block instance ``(i, b)``.
It starts as the input schedule's per-device orders executed as soon as possible (durations and
lags in ticks), FIFO-relabelled (:meth:`engine.tessel.exact_model.ExactProblem.asap`; the relabelled
times are a solution of the model, see :mod:`engine.tessel.exact_model`), and its makespan caps the
model's. Each *round*:

1. takes a *window*: ``size`` consecutive instances in the order of their start times (a time
   window across all devices), and fixes every other instance at its start tick;
2. solves the neighbourhood model (:meth:`engine.tessel.exact_model.ExactProblem.build` with ``fixed``:
   only the free instances are variables; the dependencies, FIFO chains and in-flight
   precedences that tie them to fixed ones become their domains; the fixed intervals and memory
   terms they can meet stay as constants) with CP-SAT, minimising lexicographically the makespan
   and then the sum of the window's start ticks (so a window that cannot change the makespan is
   packed as early as it can go), hinted with the incumbent;
3. re-times the resulting orders as soon as possible (:meth:`~engine.tessel.exact_model.ExactProblem.asap`:
   every later instance moves up into the room the window made, at no solver cost; memory fits
   because a device's memory depends on its order alone) and accepts the result when
   ``(makespan, sum of all start ticks)`` decreased.

Windows start at ``WINDOW_PER_DEVICE`` instances per device and sweep the schedule with half
overlaps, the first sweep taking the cooldown (where the makespan is decided) and the warmup
first. The size stays while its sweeps shorten the makespan (on large ``m`` every sweep moves
the steady state up a little); a sweep that does not grows the window by :data:`GROWTH`, up to
the whole schedule (the full model), and the per-round budget with it; after the whole schedule,
the cycle starts again from the small windows, shifted by a quarter window. The search stops
when its deterministic budget is spent (``"budget"``), when the makespan reaches the lower
bound (``"bound"``: the model's path bound and, with exact ticks,
:func:`engine.tessel.bounds.makespan_lower_bound` under the limit), when the whole schedule as
one window is solved to optimality (``"optimal"``: the incumbent is optimal in ticks), or when
two cycles in a row accept nothing (``"converged"``: the next ones would repeat them).

Budget and determinism
----------------------
``deterministic_time`` is CP-SAT's deterministic time (``max_deterministic_time``; its own count
of work, independent of machine speed and load) summed over the rounds, plus a charge per round
for what the solver does not count (:data:`ROUND_CHARGE_S`, :data:`CHARGE_PER_INSTANCE_S`: building
the neighbourhood model and re-timing the schedule in Python). On these small models CP-SAT
counts about 0.1 deterministic second per wall second (a 2-core x86 machine; the completion's
:data:`engine.tessel.budget.COMPLETION_DET_PER_S` measures the same rate), so a budget of 0.1 is
about 1-2 s of wall time, 0.3 about 3-5 s and 1.0 about 8-13 s. With ``workers=1`` the result
depends only on the inputs, the budget and ``seed``: two runs, loaded or not, give the same
orders. ``time_limit`` (wall seconds, the whole call) is a guard for a slow or loaded machine:
if it ends the search, the result says so (``wall_guard_hit``) and may differ between runs.

The returned schedule is never worse than the input: its makespan is evaluated like the input's
(simulated, with ``comm`` when given) and the input is returned unchanged unless the result is
strictly shorter.

Sources: the model is :mod:`engine.tessel.exact_model`'s (Tessel's problem, HPCA 2024 section III);
the completion it improves on is Tessel's (HPCA 2024 section IV-B); large-neighbourhood search
is P. Shaw, "Using Constraint Programming and Local Search Methods to Solve Vehicle Routing
Problems" (CP 1998): relax a part of the incumbent, re-solve it exactly with constraint
programming, keep it if better; time-window neighbourhoods are the usual ones for scheduling.
The solver interface is OR-Tools CP-SAT's (``CpSolver``, ``max_deterministic_time``,
``AddHint``; https://developers.google.com/optimization/cp/cp_solver). CP-SAT's own LNS workers
need ``num_workers > 1`` (with one worker it runs no LNS; ``interleave_search`` keeps several
workers deterministic in one thread). On the full model they did far worse than these windows:
M on 4 devices, limit 12, m = 16, hinted with Tessel's 140 units: one worker found nothing
shorter in 5 deterministic s (6 s), 8 interleaved workers 139 in 12 s, this search 127 in 3 s.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from ortools.sat.python import cp_model

from engine.dependency import lower
from engine.errors import RunError, ScheduleError, TesselError
from engine.placement import Placement
from engine.schedule import Schedule
from engine.simulate import simulate
from engine.tessel.comm import transfer_lags
from engine.tessel.exact_model import ExactProblem, Inst, prepare_exact
from engine.tessel.repetend import EXACT_REL_TOL

if TYPE_CHECKING:
    from engine.simulate import CommCost

__all__ = ["ImproveResult", "improve_schedule"]

log = logging.getLogger(__name__)

#: Free instances per device in the first windows (``size = WINDOW_PER_DEVICE x devices``, at
#: least :data:`MIN_WINDOW`): most are solved to optimality in a few thousandths of a
#: deterministic second. Measured on Tessel's schedules of M, NN, X (4-8 devices, m = 16 and 64):
#: 4 per device improves the most per deterministic second overall (6 does better on M with 8
#: devices and m = 16, worse on NN with m = 64; 3 about as 4).
WINDOW_PER_DEVICE = 4
MIN_WINDOW = 16

#: Factor a window grows by after a sweep that did not shorten the makespan (1.5 did a little
#: better than 2 on the same measurements: more sizes in the range that still solves quickly).
GROWTH = 1.5

#: CP-SAT deterministic seconds one round may use, per free instance of its window (so the
#: per-round cap grows with the window), at least :data:`MIN_ROUND_DET_S`. A round that ends on
#: its cap still keeps an improvement it found.
ROUND_DET_PER_INSTANCE_S = 0.0005
MIN_ROUND_DET_S = 0.005

#: Deterministic seconds charged per round for the work CP-SAT does not count: building the
#: neighbourhood model and re-timing the whole schedule in Python, a fixed part and a part per
#: block instance of the schedule (about 20-40 ms of wall time for 2,000 instances, at CP-SAT's
#: rate of about 0.1 deterministic second per wall second).
ROUND_CHARGE_S = 0.0005
CHARGE_PER_INSTANCE_S = 2e-6


@dataclass
class ImproveResult:
    """Outcome of :func:`improve_schedule`.

    Attributes:
        schedule: the improved schedule (named and with the ``meta`` of the input, plus
            ``meta["improve"]``), or the input itself when nothing shorter was found.
        makespan: the returned schedule's makespan in the placement's time unit:
            :func:`engine.simulate.simulate` of :func:`engine.dependency.lower` with ``comm``
            (communication free without it); with ``lags`` and no ``comm``, its orders executed
            as soon as possible with the exact durations and lags; ``evaluate(schedule)`` when given.
        improved: ``makespan < before``.
        before: the input's makespan, measured the same way.
        rounds: neighbourhoods solved.
        deterministic_time: deterministic seconds used: CP-SAT's, summed over the rounds, plus the
            per-round charge (see the module docstring).
        wall_guard_hit: ``time_limit`` ended the search (or a round) before its deterministic
            budget: the result may then differ between runs with the same seed.
        wall_time: seconds of the whole call (``time.perf_counter``).
        makespan_ticks: the search's own makespan of the returned schedule, in ticks (its orders as
            soon as possible with durations and lags rounded up to ticks); ``before_ticks`` the input's.
        resolution: placement time units per tick.
        lower_bound: :func:`engine.tessel.bounds.makespan_lower_bound` (placement units; transfers
            ignored): no schedule is shorter.
        stop: why the search ended: ``"budget"`` (deterministic budget spent), ``"bound"`` (the
            makespan reached the lower bound), ``"optimal"`` (the whole schedule as one window was
            solved to optimality), ``"converged"`` (two cycles of every window size accepted
            nothing), or ``"wall"`` (the guard). See the module docstring.
        meta: details: ``window_sizes`` (the sizes tried), ``accepted`` (rounds that improved the
            incumbent), ``history`` (``(deterministic time used, makespan ticks)`` at each
            improvement of the makespan).
    """

    schedule: Schedule
    makespan: float
    improved: bool
    before: float
    rounds: int
    deterministic_time: float
    wall_guard_hit: bool
    wall_time: float = 0.0
    makespan_ticks: int = 0
    before_ticks: int = 0
    resolution: float = 1.0
    lower_bound: float = 0.0
    stop: str = "budget"
    meta: dict = field(default_factory=dict)


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise TesselError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def improve_schedule(
    placement: Placement,
    schedule: Schedule,
    *,
    memory_limit: float | Sequence[float] | None = None,
    lags: dict[tuple[int, int], float] | None = None,
    comm: CommCost | None = None,
    evaluate: Callable[[Schedule], float] | None = None,
    deterministic_time: float,
    time_limit: float,
    seed: int = 0,
    workers: int = 1,
) -> ImproveResult:
    """A schedule no longer than ``schedule`` (usually shorter), by large-neighbourhood search.

    See the module docstring for the search. The rounds re-solve windows of the exact
    whole-schedule model (:mod:`engine.tessel.exact_model`) around the incumbent, starting from the
    input's start times, with the makespan capped by the input's.

    Budget (Tessel's schedules of the abstract shapes, ``make_shape(..., activation=2)``, a
    2-core x86 machine, where a deterministic second is about 8-13 wall seconds): with m = 16,
    0.1-0.3 deterministic s finds what 1.0 finds on M, NN, X (4-8 devices) and reaches the lower
    bound on V with 16 devices (M, 4 devices, limit 12: 140 -> 127; X, 8 devices, limit 12:
    128 -> 111); with m = 64 the sweeps keep shortening the steady state and 1.0 is worth it
    (M, 4 devices: 540 -> 499; NN: 774 -> 709; X, 8 devices: 464 -> 399, the bound being 393).
    Schedules at the lower bound (K, 4 devices, limit 4) return at once.

    Args:
        placement: the blocks of one micro-batch (durations in any time unit).
        schedule: a valid schedule of ``placement`` (its blocks' kinds, segments, devices and
            dependencies), e.g. :func:`engine.tessel.search.tessel_search`'s, within ``memory_limit``.
        memory_limit: per-device limit in the placement's memory units (a scalar or one value per
            device), static memory included; ``None``: no limit (memory is then not constrained).
        lags: time units of communication on dependencies, ``(a, b) -> lag`` by block index (``b``
            waits ``lag`` after ``a`` ends); default: the transfers of ``comm``
            (:func:`engine.tessel.comm.transfer_lags`), none without it.
        comm: the plan's cost model (anything with ``p2p_time``, ``collective_time`` and
            ``optimizer_time``, e.g. ``engine.cost.CostModel``): its transfers are the lags the
            search sees, and the makespans compared and returned are simulated with it, as in
            :func:`engine.tessel.search.tessel_search`.
        evaluate: ``schedule -> makespan``: how the input and the result are compared and the
            result's ``makespan`` (e.g. the plan's predicted step time); default as ``makespan``
            is documented in :class:`ImproveResult`.
        deterministic_time: the search's budget in deterministic seconds (CP-SAT's deterministic
            time summed over the rounds, plus a charge per round): the result depends on it, not
            on the machine.
        time_limit: wall-clock seconds for the whole call: a guard only (``wall_guard_hit``).
        seed: CP-SAT random seed of every round.
        workers: CP-SAT workers per round; 1 (default) keeps the result deterministic for a fixed
            seed, more run CP-SAT's parallel portfolio on each window (not deterministic; on
            2 cores it did fewer rounds per deterministic second and no better: M, 4 devices,
            m = 16, 0.3 s: 130 with 2 workers, 127 with 1).

    Returns:
        :class:`ImproveResult`.

    Raises:
        TesselError: a budget, time limit or worker count that is not positive; a malformed
            ``memory_limit`` or lag; a schedule of another placement, or one that is not valid
            (``ScheduleError``: its rule) or exceeds ``memory_limit``.
        InfeasibleMemoryError: the limit is below :func:`engine.tessel.bounds.memory_floor`.
        RunError: CP-SAT rejected a neighbourhood model (a bug here).
    """
    t0 = time.perf_counter()
    budget = _positive("deterministic_time", deterministic_time)
    wall = _positive("time_limit", time_limit)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise TesselError(f"workers must be a positive integer, got {workers!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TesselError(f"seed must be an integer, got {seed!r}")
    if lags is None and comm is not None:
        lags = transfer_lags(placement, comm.p2p_time)
    m = schedule.num_micro_batches
    prob = prepare_exact(placement, m, memory_limit=memory_limit, lags=lags, hint=schedule, hint_must_fit=True)

    def measure(s: Schedule) -> float:
        if evaluate is not None:
            return float(evaluate(s))
        if comm is not None:
            return simulate(lower(s), comm).makespan
        return prob.span_units(s)

    before = measure(schedule)
    assert prob.hint_starts is not None and prob.hint_span is not None
    search = _Search(prob, budget=budget, deadline=t0 + wall, seed=seed, workers=workers)
    search.run()

    out, makespan, improved = schedule, before, False
    span_ticks = prob.hint_span
    if search.span < prob.hint_span or search.total < search.total0:
        cand = Schedule(placement, m, prob.orders(search.cur), schedule.name, dict(schedule.meta))
        try:
            cand.validate(prob.limits)
        except ScheduleError as e:   # the model and validate disagree (e.g. zero-duration blocks)
            log.warning("improve_schedule: the improved schedule is invalid (%s); the input is kept", e)
        else:
            after = measure(cand)
            if after < before - 1e-9 * max(1.0, abs(before)):
                out, makespan, improved = cand, after, True
                span_ticks = prob.span_ticks(cand.orders)
    elapsed = time.perf_counter() - t0
    info = {"before": before, "makespan": makespan, "rounds": search.rounds, "accepted": search.accepted,
            "deterministic_time": search.used, "wall_guard_hit": search.wall_hit, "stop": search.stop,
            "window_sizes": search.sizes, "history": search.history, "makespan_ticks": span_ticks,
            "before_ticks": prob.hint_span}
    if improved:
        out.meta["improve"] = info
    log.info("improve_schedule %s m=%d: %.6g -> %.6g (%d rounds, %.2f deterministic s, %.2f s, stop: %s)",
             placement.name, m, before, makespan, search.rounds, search.used, elapsed, search.stop)
    return ImproveResult(schedule=out, makespan=makespan, improved=improved, before=before, rounds=search.rounds,
                         deterministic_time=search.used, wall_guard_hit=search.wall_hit, wall_time=elapsed,
                         makespan_ticks=span_ticks, before_ticks=prob.hint_span, resolution=prob.resolution,
                         lower_bound=prob.makespan_lower_bound, stop=search.stop,
                         meta={"window_sizes": search.sizes, "accepted": search.accepted, "history": search.history})


class _Search:
    """The rounds of :func:`improve_schedule` over an :class:`~engine.tessel.exact_model.ExactProblem`."""

    def __init__(self, prob: ExactProblem, *, budget: float, deadline: float, seed: int, workers: int) -> None:
        assert prob.hint_starts is not None
        self.prob = prob
        self.budget = budget
        self.deadline = deadline
        self.seed = seed
        self.workers = workers
        self.cur: dict[Inst, int] = dict(prob.hint_starts)
        self.span = prob.span(self.cur)
        self.total = self.total0 = sum(self.cur.values())
        self.used = 0.0
        self.rounds = 0
        self.accepted = 0
        self.wall_hit = False
        self.stop = "budget"
        self.sizes: list[int] = []
        self.history: list[tuple[float, int]] = []
        n_inst = len(self.cur)
        self.charge = ROUND_CHARGE_S + CHARGE_PER_INSTANCE_S * n_inst
        # no schedule is shorter than the model's path bound, nor (exact ticks only) makespan_lower_bound
        floor = prob.lb_ticks
        if not prob.rounded:
            x = prob.makespan_lower_bound / prob.resolution
            floor = max(floor, math.ceil(x - EXACT_REL_TOL * max(1.0, x)))
        self.floor = floor

    def _left(self) -> float:
        return self.budget - self.used

    def run(self) -> None:
        prob = self.prob
        N = len(self.cur)
        if N == 0:
            self.stop = "converged"
            return
        first = min(N, max(MIN_WINDOW, WINDOW_PER_DEVICE * prob.placement.num_devices))
        size, shift, first_sweep = first, False, True
        cycle_accepted, idle_cycles = 0, 0
        while True:
            self.sizes.append(size)
            step = max(1, size // 2)
            last = max(0, N - size)
            positions = list(range(step // 2 if shift else 0, last + 1, step))
            if not positions or positions[-1] != last:
                positions.append(last)
            if first_sweep:   # the cooldown (the makespan) first, then the warmup, then the sweep
                positions = [last] + positions
                first_sweep = False
            span0, accepted0 = self.span, self.accepted
            for pos in positions:
                if self.span <= self.floor:
                    self.stop = "bound"
                    return
                if self._left() <= 0:
                    self.stop = "budget"
                    return
                if time.perf_counter() >= self.deadline:
                    self.wall_hit, self.stop = True, "wall"
                    return
                optimal = self._round(pos, size)
                if self.wall_hit:
                    self.stop = "wall"
                    return
                if size >= N and optimal and self.accepted == accepted0:
                    self.stop = "optimal"   # the whole schedule as one window, solved to optimality
                    return
            cycle_accepted += self.accepted - accepted0
            if self.span < span0:
                continue   # the makespan improved: sweep again at this size
            if size < N:
                size = min(N, max(size + 1, int(GROWTH * size)))
                continue
            # every size up to the whole schedule: again from small windows, shifted by a quarter
            idle_cycles = 0 if cycle_accepted else idle_cycles + 1
            if idle_cycles >= 2:
                self.stop = "converged"   # two cycles (both shifts) without a change: they would repeat
                return
            size, shift, cycle_accepted = first, not shift, 0

    def _round(self, pos: int, size: int) -> bool:
        """Solve the window of ``size`` instances from position ``pos`` of the start order, and keep
        the result if it improves the incumbent (``self.accepted`` counts it). True if CP-SAT solved
        the window to optimality."""
        t_round = time.perf_counter()
        prob, cur = self.prob, self.cur
        order = sorted(cur, key=lambda x: (cur[x], x))
        free = set(order[pos:pos + size])
        fixed = {x: t for x, t in cur.items() if x not in free}
        em = prob.build(fixed=fixed, horizon=self.span, hint=cur)
        # lexicographic: the makespan, then the window's start ticks (packed as early as they go)
        weight = len(free) * (self.span + 1) + 1
        em.model.minimize(weight * em.makespan + sum(em.start.values()))
        solver = cp_model.CpSolver()
        p = solver.parameters
        cap = max(MIN_ROUND_DET_S, ROUND_DET_PER_INSTANCE_S * len(free))
        p.max_deterministic_time = max(1e-3, min(cap, self._left() - self.charge))
        p.max_time_in_seconds = max(0.01, self.deadline - time.perf_counter())
        p.num_workers = self.workers
        p.random_seed = self.seed
        t_solve = time.perf_counter()
        code = solver.solve(em.model)
        log.debug("improve_schedule round %d: window %d+%d, %s, %.4f deterministic s, %.4f s solving, %.4f s building",
                  self.rounds, pos, size, solver.status_name(code), solver.deterministic_time,
                  time.perf_counter() - t_solve, t_solve - t_round)
        self.rounds += 1
        self.used += solver.deterministic_time + self.charge
        if code == cp_model.MODEL_INVALID:
            raise RunError(f"improve_schedule built an invalid CP-SAT model: {em.model.validate()}")
        if code in (cp_model.FEASIBLE, cp_model.UNKNOWN) and \
                solver.deterministic_time < p.max_deterministic_time - 1e-6:
            self.wall_hit = True   # stopped by the wall-clock guard, not by its deterministic budget
        if code == cp_model.INFEASIBLE:   # the incumbent is a solution of every neighbourhood
            log.warning("improve_schedule: CP-SAT proved a neighbourhood of a feasible schedule infeasible "
                        "(window %d+%d): skipped", pos, size)
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return False
        optimal = code == cp_model.OPTIMAL
        sol = em.solution(solver)
        if sum(sol[x] for x in free) >= sum(cur[x] for x in free) and solver.value(em.makespan) >= self.span:
            return optimal
        new = prob.asap(prob.orders(sol))
        span, total = prob.span(new), sum(new.values())
        if (span, total) >= (self.span, self.total):
            return optimal
        if span < self.span:
            self.history.append((round(self.used, 6), span))
            log.debug("improve_schedule: makespan %d -> %d ticks (window %d+%d, %.3f deterministic s)",
                      self.span, span, pos, size, self.used)
        self.cur, self.span, self.total = new, span, total
        self.accepted += 1
        return optimal

