"""Tessel search: the shortest repetend under a memory limit, completed into a schedule.

``tessel_search(placement, m, memory_limit=...)`` returns a :class:`~engine.tessel.result.SearchResult`
whose ``schedule`` is an ordinary :class:`~engine.schedule.Schedule` (the simulator, plan I/O, UI
and runtime treat it like a baseline), with the repetend, the bounds and the gap to them.

The phases, one function each in the order :func:`tessel_search` calls them (numbered as
:class:`~engine.tessel.result.SearchResult` and :func:`tessel_search`'s arguments count them):

* (1) :func:`_seed_phase`: the memory-aware 1F1B policy's periodic steady states
  (:mod:`engine.tessel.seed`) seed the windows of their size (skipped where the policy probe
  would not fit its share of the time, and for the latency objective);
* (1, 2) :func:`_period_phase` (:mod:`engine.tessel.period_search`): ``r = 1`` micro-batch per
  window (or the fixed ``window_micro_batches``) bisects its window length from the lower bound,
  a CP-SAT feasibility solve per step; windows of ``r = 2 .. max_window_micro_batches`` refine it
  in rounds of growing per-solve budgets, each size trying the longest window that beats the
  best period per micro-batch so far and bisecting below it, no window tried below the rate
  bound (busiest device, Little's law on memory); (2) at the best window, a CP-SAT solve for the
  least micro-batch latency (which sets the warmup + cooldown length; never longer than before)
  and then the least memory;
* (2b) :func:`_deferral_phase` (:mod:`engine.tessel.defer`): the best repetend and the policy
  steady states of the same period get their sinks (e.g. ``W`` blocks) deferred by whole windows
  while the unrolled makespan for ``m`` does not grow and memory fits, and the shortest wins (on
  the split V placement this yields ZB-H1's schedule);
* (3) :func:`_completion_phase` (:mod:`engine.tessel.completion`): the unrolled repetend and,
  unless it already reaches the makespan lower bound, a CP-SAT-compacted warmup/cooldown, keeping
  the one with the shorter simulated makespan; with ``fallback_baselines``, :func:`_fallback`: the
  memory-aware 1F1B or GPipe policy where one is shorter;
* (4) :func:`_improvement_phase` (:mod:`engine.tessel.improve`): a large-neighbourhood search on
  the whole schedule;
* :func:`_result`: the schedule validated, its makespan in the solver's tick model, the times.

Search control: a wall-clock ``time_limit`` split among the phases by a
:class:`~engine.tessel.budget.SearchBudget` (the best solution found so far is returned when it
hits), a ``progress`` callback receiving :class:`~engine.tessel.control.SearchProgress` after every
solver call, a tqdm bar (``progress_bar=True``), cancellation through
:class:`~engine.tessel.control.SearchControl` (from another thread, e.g. a UI), and deterministic
results for a fixed ``seed`` (one CP-SAT worker by default).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from engine.baselines.generic import gpipe_any, one_f_one_b_any
from engine.dependency import lower
from engine.errors import InfeasibleMemoryError, ScheduleError, SearchCancelled, TesselError
from engine.placement import Placement
from engine.schedule import Schedule
from engine.simulate import simulate
from engine.tessel.bounds import (
    critical_path,
    makespan_lower_bound,
    memory_floor,
    memory_time_bound,
    period_lower_bound,
)
from engine.tessel.budget import SEED_INSTANCES_PER_S, SearchBudget
from engine.tessel.comm import asap_makespan, transfer_lags
from engine.tessel.completion import complete, to_schedule, unrolled
from engine.tessel.control import ProgressReporter, SearchControl, SearchProgress
from engine.tessel.defer import defer_sinks, unrolled_makespan
from engine.tessel.improve import improve_schedule
from engine.tessel.period_search import MODEL_INSTANCES_PER_S, PeriodSearch, Window, critical_ticks
from engine.tessel.repetend import Repetend, auto_resolution, is_exact
from engine.tessel.result import SearchResult
from engine.tessel.seed import policy_rate_repetend, policy_repetends, policy_starts

if TYPE_CHECKING:
    from engine.simulate import CommCost

__all__ = ["tessel_search"]

#: Micro-batches the seed phase's policy probe schedules at least (:func:`engine.tessel.seed.policy_starts`);
#: four per device where that is more.
SEED_PROBE_MICRO_BATCHES = 48


def tessel_search(
    placement: Placement,
    m: int,
    *,
    memory_limit: float | list[float] | None = None,
    time_limit: float = 10.0,
    wall_limit: float | None = None,
    seed: int = 0,
    resolution: float | None = None,
    lags: dict[tuple[int, int], float] | None = None,
    comm: CommCost | None = None,
    tail: Sequence[float] | None = None,
    evaluate: Callable[[Schedule], float] | None = None,
    objective: str = "throughput",
    workers: int = 1,
    progress: Callable[[SearchProgress], None] | None = None,
    progress_bar: bool = False,
    control: SearchControl | None = None,
    max_window_micro_batches: int = 3,
    window_micro_batches: int | None = None,
    fallback_baselines: bool = False,
    completion_stall: float | None = None,
    improve: bool = True,
) -> SearchResult:
    """Find a repetend of minimal period and complete it into a schedule of ``m`` micro-batches.

    The phases are the module docstring's, each on its share of ``time_limit``
    (:class:`~engine.tessel.budget.SearchBudget`).

    Args:
        placement: the blocks of one micro-batch (training or forward-only).
        m: micro-batches per step (placement instances).
        memory_limit: per-device limit in the placement's memory units (bytes for a captured
            model, abstract units for unit placements), static memory included; ``None`` = no limit.
        time_limit: wall-clock seconds for the whole search, every phase included; when it hits,
            the best solution so far is completed and returned (``timed_out`` set; the sequential
            repetend, one micro-batch at a time, when nothing better was found). The phases before
            the completion stop early enough to leave it its estimated time
            (:data:`~engine.tessel.budget.FINISH_INSTANCES_PER_S`), a solve is not started when the
            time left cannot build its model
            (:data:`~engine.tessel.period_search.MODEL_INSTANCES_PER_S`), and the seed phase is
            skipped where it would not fit :data:`~engine.tessel.budget.SEED_SHARE` of the limit
            (:class:`~engine.tessel.budget.SearchBudget`).
        wall_limit: wall-clock seconds for the whole search where they should be more than
            ``time_limit``, which then only sizes the phases' deterministic budgets. The budgets
            take about 40-60% of ``time_limit`` on an idle 2-core x86 machine, so a machine more than
            about 1.7x slower (or as loaded) can end a phase on the wall clock (``wall_guard_hit``)
            and give another schedule; ``wall_limit=3 * time_limit`` keeps the idle machine's
            schedule there. ``None`` (default): ``time_limit``.
        seed: CP-SAT random seed; with ``workers=1`` the result is deterministic (the completion
            runs on CP-SAT's deterministic time; only a repetend solve that ends on its wall-clock
            cap, ``timed_out``, or a completion on a machine so loaded that its wall-clock guard
            ends it first, can differ between runs).
        resolution: seconds per solver tick (default: the longest block is 100 ticks). Durations
            are rounded up to ticks.
        lags: seconds of communication on cross-device dependencies, ``(a, b) -> s`` by block index;
            default: the transfers of ``comm`` (:func:`engine.tessel.comm.transfer_lags`), none without it.
        comm: the plan's cost model (``engine.cost.CostModel``, or anything with ``p2p_time``,
            ``collective_time`` and ``optimizer_time``): every dependency between blocks on different
            devices waits for its tensor's transfer (its lag, as the simulator times it) in the
            repetend and completion solves, and the schedules compared and returned are simulated
            with it, so the search's makespan is the one ``tessel show`` predicts. ``None``:
            communication is free (abstract units).
        tail: per device, seconds it works after its last block in a step (its tied-weight
            all-reduce and optimizer step, :func:`engine.tessel.comm.step_tail`): part of the
            search's own makespan (``SearchResult.solver_makespan``).
        evaluate: ``schedule -> seconds``, the makespan of one step running a schedule as the plan
            will predict it (e.g. :func:`engine.plan.metrics.predicted_metrics` of the plan, optimizer
            step included); the completions and fallbacks are compared by it and it is the result's
            ``makespan``. Default: the schedule simulated with ``comm``.
        objective: ``"throughput"`` (shortest period) or, for inference, ``"latency"`` (the
            repetend's micro-batch latency equals the critical path, at the shortest period that
            allows it). The schedule is an order per device executed as soon as inputs arrive, so
            with unequal stage times a fast first stage still runs ahead and later micro-batches
            queue before the slow stage: the steady-state latency then exceeds the repetend's.
        workers: CP-SAT workers (1 keeps results deterministic).
        progress: called after every solver call with a :class:`~engine.tessel.control.SearchProgress`.
        progress_bar: show a tqdm bar with the best period so far.
        control: a :class:`~engine.tessel.control.SearchControl` to cancel from another thread.
        max_window_micro_batches: largest number ``r`` of micro-batches in one repetend window
            the search refines (default 3); ``r > 1`` reaches fractional periods per micro-batch
            (e.g. 23 units per 3 micro-batches on M, 4 devices, limit 6: 7.67 where one or two
            micro-batches per window give 8). The memory-aware 1F1B policy's periodic steady state
            (windows of up to 3 micro-batches) always competes as found, so the result may hold up
            to ``max(3, max_window_micro_batches)`` micro-batches per window. Larger windows need
            more time: their solves get growing budgets in rounds, at most 40% of ``time_limit``.
        window_micro_batches: a fixed number of micro-batches per repetend window: only that size
            is searched (bisected like ``r = 1``; a policy steady state of that size still seeds
            it). ``None`` (default): windows of 1 to ``max_window_micro_batches`` are searched.
        fallback_baselines: also run the GPipe and memory-aware 1F1B policies on the same
            placement (within the same memory limit) and return the shortest of the three: a
            planner returning the best plan it knows. The schedule is still named ``"tessel"``;
            ``schedule.meta["tessel"]["equals_baseline"]`` names the policy when one wins, and
            ``schedule.meta["tessel"]["pure_makespan"]`` always holds the searched schedule's
            simulated makespan. Off by default: the result is then the search's own.
        completion_stall: seconds; stop each completion (warmup/cooldown) solve once it has gone
            this long, and as long as it took to find its last improvement, without a better
            solution, instead of running to its share of ``time_limit``. For interactive use: on
            ``benchmarks/tessel_bench.py`` 0.3 s halves the total search time (slowest 4-device
            case 3.96 s -> 1.8 s) and leaves m=16 makespans up to 9% longer in 5 of 20 cases
            (m=64 within 1%). Wall-clock based, so a solve it stops may differ between runs even
            with ``workers=1``. ``None`` (default): deterministic, as described above.
        improve: (4) re-solve windows of the whole schedule with CP-SAT, starting from the one phases
            1-3 (and the fallback) give (:func:`engine.tessel.improve.improve_schedule`: the
            warmup, the cooldown and the steady state, e.g. all-device blocks of several
            micro-batches grouped, which no repetend of up to three micro-batches holds), on
            :data:`~engine.tessel.budget.IMPROVE_SHARE` of ``time_limit`` plus the nominal seconds
            phase 1 left unused; ``schedule.meta["tessel"]["improve"]`` says what it did.
            ``False``: phases 1-3 only.

    Returns:
        :class:`~engine.tessel.result.SearchResult`.

    Raises:
        InfeasibleMemoryError: the limit is below the memory floor (the message gives the
            smallest feasible limit).
        SearchCancelled: cancelled before the search started.
        TesselError: ``m < 1``, a bad objective, ``max_window_micro_batches < 1``, a
            ``window_micro_batches`` that is not a positive integer, a time limit that
            is not a positive number, a wall limit shorter than it, or a time limit shorter than
            building and checking the schedule alone takes (blocks x ``m`` /
            :data:`~engine.tessel.budget.FINISH_INSTANCES_PER_S` seconds, and
            :data:`~engine.tessel.budget.FALLBACK_INSTANCES_PER_S` with ``fallback_baselines``).
    """
    _check_arguments(m, objective, max_window_micro_batches, window_micro_batches, control, time_limit, wall_limit)
    budget = SearchBudget.for_search(placement, m, time_limit, fallback_baselines=fallback_baselines,
                                     wall_limit=wall_limit)
    task = _Task.make(placement, m, memory_limit=memory_limit, lags=lags, comm=comm, tail=tail, evaluate=evaluate,
                      resolution=resolution, objective=objective, seed=seed, workers=workers, control=control)
    rate_s = _rate_bound(task, budget)
    lb_s = max(period_lower_bound(placement), rate_s)
    reporter = ProgressReporter(progress, progress_bar, lb_s, budget.t_start)
    search = _period_search(task, budget, rate_s, reporter)
    _seed_phase(task, budget, search, window_micro_batches)
    found = _period_phase(task, budget, search, window_micro_batches, max_window_micro_batches)
    reporter.close()
    ms_lb = _makespan_bound(task, budget, rate_s)
    found = _deferral_phase(task, budget, search, found, ms_lb)
    t_completion = time.perf_counter()
    schedule = _completion_phase(task, budget, found, lb_s, ms_lb, completion_stall)
    if fallback_baselines and not task.cancelled():
        schedule = _fallback(placement, m, task.caps_or_peak(found.best), schedule, task.step_makespan)
    schedule, makespan = _improvement_phase(task, budget, found, schedule, ms_lb, improve)
    return _result(task, budget, search, found, schedule, makespan, lb_s, ms_lb, t_completion)


def _check_arguments(m: int, objective: str, max_window_micro_batches: int, window_micro_batches: int | None,
                     control: SearchControl | None, time_limit: float, wall_limit: float | None) -> None:
    """The checks of :func:`tessel_search`'s arguments that need no placement (its ``Raises``)."""
    if m < 1:
        raise TesselError(f"need at least one micro-batch, got m={m}")
    if objective not in ("throughput", "latency"):
        raise TesselError(f"objective must be 'throughput' or 'latency', got {objective!r}")
    if isinstance(max_window_micro_batches, bool) or not isinstance(max_window_micro_batches, int) \
            or max_window_micro_batches < 1:
        raise TesselError(f"max_window_micro_batches must be an integer >= 1 (micro-batches per repetend window, "
                          f"default 3), got {max_window_micro_batches!r}")
    if window_micro_batches is not None and (isinstance(window_micro_batches, bool)
                                             or not isinstance(window_micro_batches, int) or window_micro_batches < 1):
        raise TesselError(f"window_micro_batches must be an integer >= 1 (the micro-batches of every repetend window) "
                          f"or None (searched), got {window_micro_batches!r}")
    if control is not None and control.cancelled:
        raise SearchCancelled("the search was cancelled before it started")
    if not (isinstance(time_limit, (int, float)) and math.isfinite(time_limit) and time_limit > 0):
        raise TesselError(f"the time limit must be a positive number of seconds, got {time_limit!r}")
    if wall_limit is not None and not (isinstance(wall_limit, (int, float)) and math.isfinite(wall_limit)
                                       and wall_limit >= time_limit):
        raise TesselError(f"the wall limit must be a number of seconds no shorter than the time limit "
                          f"({time_limit:g} s), got {wall_limit!r}")


def _limits(placement: Placement, memory_limit) -> list[float] | None:
    if memory_limit is None:
        return None
    if isinstance(memory_limit, (int, float)):
        return [float(memory_limit)] * placement.num_devices
    lim = [float(x) for x in memory_limit]
    if len(lim) != placement.num_devices:
        raise TesselError(f"memory_limit has {len(lim)} values for {placement.num_devices} devices")
    return lim


@dataclass
class _Task:
    """One search's checked inputs, as every phase reads them.

    Attributes:
        placement, m: as given; ``caps``: the per-device memory limit (or ``None``); ``floor``: per
            device, the least memory any schedule needs (:func:`engine.tessel.bounds.memory_floor`).
        lags: seconds per cross-device dependency (given, or ``comm``'s transfers), or ``None``.
        comm, tail, evaluate, objective, seed, workers, control: as given to :func:`tessel_search`.
        res: seconds per solver tick; ``rounded``: durations or lags were rounded up to ticks.
        has_memory: some block allocates memory and the placement trains.
    """

    placement: Placement
    m: int
    caps: list[float] | None
    floor: list[int]
    lags: dict[tuple[int, int], float] | None
    comm: CommCost | None
    tail: Sequence[float] | None
    evaluate: Callable[[Schedule], float] | None
    objective: str
    seed: int
    workers: int
    control: SearchControl | None
    res: float
    rounded: bool
    has_memory: bool

    @classmethod
    def make(cls, placement: Placement, m: int, *, memory_limit, lags, comm, tail, evaluate, resolution, objective,
             seed, workers, control) -> _Task:
        """Check the placement-dependent arguments (``InfeasibleMemoryError``, ``TesselError``)."""
        caps = _limits(placement, memory_limit)
        floor = memory_floor(placement)
        if caps is not None:
            worst = max(range(placement.num_devices), key=lambda d: floor[d] - caps[d])
            if floor[worst] > caps[worst] + 1e-9:
                need = max(floor)
                raise InfeasibleMemoryError(
                    f"memory limit {caps[worst]:g} is infeasible: device {worst} needs at least {floor[worst]:g} "
                    f"even with one micro-batch at a time; the smallest feasible limit is {need:g}", need, worst)
        if lags is None and comm is not None:
            lags = transfer_lags(placement, comm.p2p_time)
        if tail is not None and len(tail) != placement.num_devices:
            raise TesselError(f"tail has {len(tail)} values for {placement.num_devices} devices")
        if resolution is None:
            res, rounded = auto_resolution(placement, lags=lags)
        elif isinstance(resolution, (int, float)) and math.isfinite(resolution) and resolution > 0:
            res = float(resolution)
            rounded = not is_exact([b.duration for b in placement.blocks] + list((lags or {}).values()), res)
        else:
            raise TesselError(f"the resolution must be a positive number of seconds per tick (or None for the "
                              f"durations' common divisor), got {resolution!r}")
        has_memory = any(x.memory for x in placement.blocks) and not placement.forward_only
        return cls(placement, m, caps, floor, lags, comm, tail, evaluate, objective, seed, workers, control, res,
                   rounded, has_memory)

    def cancelled(self) -> bool:
        return self.control is not None and self.control.cancelled

    def step_makespan(self, sched: Schedule) -> float:
        """One step's makespan of ``sched``: ``evaluate``, or simulated with ``comm``."""
        return self.evaluate(sched) if self.evaluate is not None else simulate(lower(sched), self.comm).makespan

    def caps_or_peak(self, rep: Repetend) -> list[float] | None:
        """The limit; without one (and with memory), the repetend's highest per-device peak: what the
        deferral, the completion, the fallback and the improvement keep to."""
        if self.has_memory and rep.peak and self.caps is None:
            return [max(rep.peak)] * self.placement.num_devices
        return self.caps


@dataclass
class _Found:
    """What the repetend phases found.

    Attributes:
        window: the window (micro-batches per repetend) of the best repetend; ``best`` that repetend.
        optimal: the period is proven optimal in exact time; ``optimal_at_resolution``: in ticks.
        timed_out: the time limit or a cancellation cut the repetend phases short.
        source: ``"search"`` or ``"policy seed"`` (after the deferral); ``deferred``: windows each
            deferred sink moved by.
    """

    window: Window
    best: Repetend
    optimal: bool
    optimal_at_resolution: bool
    timed_out: bool
    source: str = "search"
    deferred: dict[int, int] = field(default_factory=dict)


def _rate_bound(task: _Task, budget: SearchBudget) -> float:
    """Seconds per micro-batch no repetend beats under the memory limit: Little's law on memory for
    one micro-batch (:func:`engine.tessel.bounds.memory_time_bound`; 0 without a limit). Its term is
    quadratic in the blocks: a small share of the time."""
    if task.caps is not None and task.has_memory:
        deadline = budget.rate_bound_deadline()
        bound = memory_time_bound(task.placement, 1, task.caps, deadline=deadline)
        budget.note_deadline(deadline)
        return bound
    return 0.0


def _makespan_bound(task: _Task, budget: SearchBudget, rate_s: float) -> float:
    """Seconds no schedule of ``m`` micro-batches beats (:func:`engine.tessel.bounds.makespan_lower_bound`
    under the limit, and ``m`` times the rate bound). The memory-aware terms grow with the blocks
    (quadratic) and ``m``: a share of what time is left."""
    tail = list(task.tail) if task.tail else None
    deadline = budget.makespan_bound_deadline()
    bound = makespan_lower_bound(task.placement, task.m, memory_limit=task.caps, lags=task.lags, tail=tail,
                                 deadline=deadline)
    budget.note_deadline(deadline)
    return max(bound, task.m * rate_s)


def _period_search(task: _Task, budget: SearchBudget, rate_s: float, reporter: ProgressReporter) -> PeriodSearch:
    """The period search's state (:mod:`engine.tessel.period_search`), reporting every solve."""
    res = task.res

    def on_step(w: Window, window: int, status: str) -> None:
        reporter.step(budget.clock.steps, window * res / w.r, status, search.best_w.per_mb * res)

    search = PeriodSearch(task.placement, task.caps, res, task.lags, task.objective, rate_s / res, budget.clock,
                          budget.time_limit, task.seed, task.workers, control=task.control, on_step=on_step)
    return search


def _seed_phase(task: _Task, budget: SearchBudget, search: PeriodSearch, window_micro_batches: int | None) -> None:
    """(1) The memory-aware 1F1B policy's steady state, where periodic, seeds the window of its size;
    skipped where its probe would not fit its share of the time (placements of many blocks)."""
    placement = task.placement
    # the policy fills a pipeline of n devices in about n micro-batches: probe long enough to see
    # its steady state
    probe = max(SEED_PROBE_MICRO_BATCHES, 4 * placement.num_devices)
    seed_cost_s = len(placement.blocks) * probe / SEED_INSTANCES_PER_S
    seeds: dict[int, Repetend] = {}
    rate_hint = None
    if task.objective != "latency" and budget.seed_fits(seed_cost_s):
        starts = policy_starts(placement, task.caps, probe_micro_batches=probe, comm=task.comm)
        if starts is not None:
            seeds = policy_repetends(placement, task.res, task.caps, max_window=3, probe_micro_batches=probe,
                                     starts=starts)
            if 1 not in seeds:
                rate_hint = policy_rate_repetend(placement, task.res, starts, probe)
        if window_micro_batches is not None:
            seeds = {r: rep for r, rep in seeds.items() if r == window_micro_batches}
    search.check_seeds(seeds)
    if rate_hint is not None and window_micro_batches in (None, 1):
        search.check_rate_hint(rate_hint)


def _period_phase(task: _Task, budget: SearchBudget, search: PeriodSearch, window_micro_batches: int | None,
                  max_window_micro_batches: int) -> _Found:
    """(1, 2) The shortest period: windows bisected and refined, then the best one polished for least
    latency and memory (:class:`~engine.tessel.period_search.PeriodSearch`)."""
    clock = budget.clock
    if window_micro_batches is not None:
        # a user-fixed window: only that many micro-batches per repetend, bisected like r = 1
        w = search.window(window_micro_batches)
        search.best_w = w
        search.bisect(w, budget.step_cap_s)
    else:
        search.bisect(search.window(1), budget.step_cap_s)
        search.refine(list(range(2, max_window_micro_batches + 1)))
    if time.perf_counter() >= budget.deadline:
        clock.timed_out = clock.wall_hit = True
    c = search.best_w
    # optimal in the solver's ticks; with durations rounded up to ticks that says nothing exact
    optimal_at_resolution = search.at_bound() or c.best.period <= c.proven_lo
    # at the best window: least latency, then least memory (bounded effort: a polish)
    search.polish(c, task.has_memory, critical_ticks(task.placement, search.window(1).sc))
    budget.wall_guard_hit = budget.wall_guard_hit or clock.wall_hit
    return _Found(window=c, best=c.best, optimal=optimal_at_resolution and not task.rounded,
                  optimal_at_resolution=optimal_at_resolution, timed_out=clock.timed_out)


def _deferral_phase(task: _Task, budget: SearchBudget, search: PeriodSearch, found: _Found, ms_lb: float) -> _Found:
    """(2b) Sink deferral (:mod:`engine.tessel.defer`): the best repetend, and the policy's steady
    states with the same period per micro-batch, each with its sinks (e.g. W blocks) deferred while
    the unrolled makespan does not grow and memory fits; the shortest unrolled makespan wins.
    Without a limit, memory may rise to the repetend's highest per-device peak. Not for the latency
    objective: a deferred sink lengthens its micro-batch's latency."""
    if task.objective != "throughput" or found.timed_out or task.cancelled():
        return found
    c, best = found.window, found.best
    defer_caps = task.caps_or_peak(best)
    pool = [(c, best, "search")]
    for r_s, seed_rep in sorted(search.seeds.items()):   # the ones the solver confirmed within the limit
        cs = search.windows.get(r_s)
        if cs is not None and seed_rep.period * c.r <= best.period * r_s:
            pool.append((cs, seed_rep, "policy seed"))
    defer_deadline = budget.defer_deadline()
    scored = []
    for k, (cc, rp, src) in enumerate(pool):
        d_rep, span = defer_sinks(cc.pl, rp, task.m, defer_caps, r=cc.r, deadline=defer_deadline, lags=cc.lags_s)
        budget.note_deadline(defer_deadline)
        scored.append((span, k, cc, d_rep, rp, src))
        if span <= ms_lb * (1 + 1e-9):
            break  # the makespan lower bound: nothing can be shorter
    span, _, c, d_rep, undeferred, source = min(scored, key=lambda x: (round(x[0], 9), x[1]))
    deferred = {b: d_rep.offsets[b] - undeferred.offsets[b] for b in range(len(d_rep.offsets))
                if d_rep.offsets[b] != undeferred.offsets[b]}
    if deferred or d_rep is not best:
        n_windows = max(d_rep.offsets, default=0) + 1
        _, ss_peak = unrolled_makespan(c.pl, d_rep, c.r * 3 * n_windows, c.r, lags=c.lags_s)
        best = Repetend(d_rep.period, d_rep.starts, d_rep.offsets, d_rep.resolution, ss_peak, c.r)
    return _Found(window=c, best=best, optimal=found.optimal, optimal_at_resolution=found.optimal_at_resolution,
                  timed_out=found.timed_out, source=source, deferred=deferred)


def _completion_phase(task: _Task, budget: SearchBudget, found: _Found, lb_s: float, ms_lb: float,
                      completion_stall: float | None) -> Schedule:
    """(3) Completion under the limit; without one, under the steady state's highest per-device peak
    (a device may then hold more than its own steady state, e.g. deferred W blocks): the unrolled
    repetend and, where it is worth it, the compacted warmup/cooldown; the shorter one, with its
    ``meta["tessel"]["pure_makespan"]``."""
    c, best, m = found.window, found.best, task.m
    meta = {"period": best.period_seconds, "period_lower_bound": lb_s, "optimal": found.optimal,
            "in_flight": best.in_flight, "micro_batches_per_window": c.r, "resolution": task.res,
            "rounded": task.rounded, "optimal_at_resolution": found.optimal_at_resolution,
            "repetend": best.to_dict(), "repetend_source": found.source,
            "deferred_sinks": {str(b): k for b, k in found.deferred.items()}}
    m_windows = -(-m // c.r)

    def simulated(label: str, comp) -> tuple[float, Schedule]:
        sched = to_schedule(task.placement, comp, m, name="tessel",
                            meta={"tessel": {**meta, "completion": label, "completion_status": comp.status}},
                            micro_batches_per_window=c.r)
        return task.step_makespan(sched), sched

    chosen = simulated("unrolled", unrolled(best, m_windows, len(c.pl.blocks)))
    remaining = budget.wall_left()
    at_bound = chosen[0] <= ms_lb * (1 + 1e-9)
    # the compaction solves a model over several copies of the window, then simulates once more;
    # whether it runs is decided on its own nominal budget (deterministic); the wall clock only guards
    comp_build_s = 6 * len(c.pl.blocks) / MODEL_INSTANCES_PER_S  # about six copies of the window
    comp_cap = budget.completion_cap_s
    comp_need_s = max(0.05, 2 * comp_build_s)
    wants = comp_cap > comp_need_s and max(best.offsets, default=0) > 0 and not at_bound and not task.cancelled()
    if wants and remaining <= comp_need_s:
        budget.wall_guard_hit = True
    elif wants:
        # reschedule the partial copies and two complete ones at each end (W blocks deferred
        # across the whole steady state are the deferral's job). The budget is CP-SAT
        # deterministic time (reproducible); the wall clock (WALL_GUARD_FACTOR times the budget,
        # never past the deadline) only guards a much slower or loaded machine.
        comp = complete(c.pl, c.sc, best, m_windows, memory_cap=task.caps_or_peak(best),
                        time_limit=min(remaining, budget.wall_guard_factor * comp_cap), seed=task.seed,
                        free_copies=2, stall=completion_stall,
                        deterministic_time=None if completion_stall is not None
                        else budget.completion_det_per_s * comp_cap)
        other = simulated("compacted", comp)
        if other[0] < chosen[0] - 1e-12:
            chosen = other
    schedule = chosen[1]
    schedule.meta["tessel"]["pure_makespan"] = chosen[0]
    return schedule


def _fallback(placement: Placement, m: int, caps: list[float] | None, searched: Schedule,
              step_makespan: Callable[[Schedule], float]) -> Schedule:
    """(3, ``fallback_baselines``) The searched schedule, or a policy baseline on the same placement when it is shorter.

    Candidates: the memory-aware 1F1B and the GPipe policies of :mod:`engine.baselines.generic`,
    kept only within ``caps`` (the limit the completion was held to). A baseline that wins is
    returned under the name ``"tessel"`` with ``meta["tessel"]["equals_baseline"]`` naming it and
    ``meta["tessel"]["completion"] = "baseline <name>"``; ``pure_makespan`` keeps the searched one.
    """
    meta = searched.meta
    best_span, best = meta["tessel"]["pure_makespan"], searched
    for name, build in (("1f1b", lambda: one_f_one_b_any(placement, m, memory_limit=caps)),
                        ("gpipe", lambda: gpipe_any(placement, m))):
        try:
            sched = build()
            sched.validate(caps)
        except (TesselError, ScheduleError):
            continue
        span = step_makespan(sched)
        if span < best_span - 1e-12 * max(1.0, best_span):
            tmeta = {**meta["tessel"], "completion": f"baseline {name}", "equals_baseline": name}
            best_span, best = span, Schedule(placement, m, [list(o) for o in sched.orders], "tessel",
                                             {**meta, "tessel": tmeta})
    return best


def _improvement_phase(task: _Task, budget: SearchBudget, found: _Found, schedule: Schedule, ms_lb: float,
                       improve: bool) -> tuple[Schedule, float]:
    """(4) Large-neighbourhood search on the whole schedule (:mod:`engine.tessel.improve`), on its
    own deterministic budget, unless the schedule is at the lower bound or the time left cannot
    build its models. Returns the schedule and its makespan (``step_makespan``)."""
    makespan = task.step_makespan(schedule)
    wall_left = budget.wall_left()
    # the repetend phases' nominal seconds they did not use (a window proven early, the bound
    # reached) go to the improvement: deterministic, so the schedule still does not depend on load
    improve_nominal = budget.improve_nominal_s()
    improve_s = min(improve_nominal, wall_left)
    schedule.meta["tessel"]["improve"] = "not run"
    build_s = len(task.placement.blocks) * task.m / MODEL_INSTANCES_PER_S
    wants = (improve and task.objective == "throughput" and makespan > ms_lb * (1 + 1e-9)
             and improve_nominal > budget.improve_min_s + build_s and not task.cancelled())
    if wants and improve_s <= budget.improve_min_s + build_s:
        budget.wall_guard_hit = True   # its deterministic budget would run it; the wall clock cannot
    elif wants:
        better = improve_schedule(task.placement, schedule, memory_limit=task.caps_or_peak(found.best), lags=task.lags,
                                  evaluate=task.step_makespan,
                                  deterministic_time=budget.improve_det_per_s * improve_nominal,
                                  time_limit=min(wall_left, budget.wall_guard_factor * improve_s), seed=task.seed)
        budget.wall_guard_hit = budget.wall_guard_hit or better.wall_guard_hit
        schedule.meta["tessel"]["improve"] = {"before": better.before, "after": better.makespan,
                                              "rounds": better.rounds, "stop": better.stop}
        if better.improved:
            schedule, makespan = better.schedule, better.makespan
            schedule.meta["tessel"] = {**schedule.meta["tessel"], "improved_from": schedule.meta["tessel"].get(
                "completion")}
    return schedule, makespan


def _result(task: _Task, budget: SearchBudget, search: PeriodSearch, found: _Found, schedule: Schedule,
            makespan: float, lb_s: float, ms_lb: float, t_completion: float) -> SearchResult:
    """The schedule validated, its makespan in the solver's own tick model, the times recorded."""
    placement, tail, res = task.placement, task.tail, task.res
    schedule.validate(task.caps)
    index = {b.key: i for i, b in enumerate(placement.blocks)}
    orders = [[(blk.micro_batch, index[blk.key]) for blk in order] for order in schedule.orders]
    one = search.window(1)
    tail_ticks = [one.sc.ticks(t) for t in tail] if tail else None
    solver_makespan = asap_makespan(placement, orders, one.sc.durations, one.sc.lags, tail_ticks) * res
    t_end = time.perf_counter()
    repetend_time = t_completion - budget.t_start
    completion_time, elapsed = t_end - t_completion, t_end - budget.t_start
    schedule.meta["tessel"].update(search_time=repetend_time, completion_time=completion_time, total_time=elapsed,
                                   wall_guard_hit=budget.wall_guard_hit, makespan=makespan,
                                   solver_makespan=solver_makespan)
    best = found.best
    return SearchResult(
        schedule=schedule, repetend=best, period=best.period_seconds, period_lower_bound=lb_s,
        makespan_lower_bound=ms_lb, critical_path=critical_path(placement, task.lags),
        optimal=found.optimal, search_time=repetend_time, steps=budget.clock.steps, timed_out=found.timed_out,
        resolution=res, memory_floor=task.floor, total_time=elapsed, completion_time=completion_time,
        rounded=task.rounded, optimal_at_resolution=found.optimal_at_resolution,
        wall_guard_hit=budget.wall_guard_hit, makespan=makespan, solver_makespan=solver_makespan,
    )
