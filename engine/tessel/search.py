"""Tessel search: the shortest repetend under a memory limit, completed into a schedule.

``tessel_search(placement, m, memory_limit=...)`` returns a :class:`SearchResult` whose
``schedule`` is an ordinary :class:`~engine.schedule.Schedule` (the simulator, plan I/O, UI and
runtime treat it like a baseline), with the repetend, the bounds and the gap to them.

Search control: a wall-clock ``time_limit`` (the best solution found so far is returned when it
hits), a ``progress`` callback receiving :class:`SearchProgress` after every solver call, a tqdm
bar (``progress_bar=True``), cancellation through :class:`SearchControl` (from another thread,
e.g. a UI), and deterministic results for a fixed ``seed`` (one CP-SAT worker by default).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from engine.errors import TesselError
from engine.placement import Placement
from engine.schedule import Schedule
from engine.tessel.bounds import (
    critical_path,
    makespan_lower_bound,
    memory_floor,
    memory_time_bound,
    period_lower_bound,
)
from engine.tessel.comm import asap_makespan, transfer_lags
from engine.tessel.completion import complete, to_schedule, unrolled
from engine.tessel.defer import defer_sinks, unrolled_makespan
from engine.tessel.improve import improve_schedule
from engine.tessel.period_search import (
    MODEL_INSTANCES_PER_S,
    STEP_SHARE,
    WALL_GUARD_FACTOR,
    Clock,
    PeriodSearch,
    Window,
    critical_ticks,
)
from engine.tessel.repetend import (
    Repetend,
    auto_resolution,
    is_exact,
)
from engine.tessel.seed import policy_rate_repetend, policy_repetends, policy_starts

if TYPE_CHECKING:
    from engine.simulate import CommCost

#: CP-SAT deterministic seconds the completion may spend per wall-clock second of its budget
#: (``COMPLETION_SHARE * time_limit`` s). Measured on the benchmark's completions on a 2-core x86
#: machine: 0.06-0.2 deterministic s per wall s (NN on 4 devices, limit 9: 0.07 in 1.1 s), so the
#: budget usually ends before the wall time the completion was given (ten times it stays a guard),
#: and the result does not depend on the machine's load.
COMPLETION_DET_PER_S = 0.1

#: Share of ``time_limit`` (less the time kept for building the schedule) the repetend phases may
#: use in nominal seconds (their deterministic clock, :mod:`engine.tessel.period_search`), the
#: completion's share, and (below) the improvement's. Together about 60% of the limit, so a machine
#: about 1.5x slower than the calibration (two busy processes on two cores:
#: ``tests/engine/test_tessel_exact.py::test_same_seed_same_schedule_under_load``) still ends every
#: solve on its deterministic budget, not on the wall clock, and gives the same schedule.
NOMINAL_SHARE = 0.3
COMPLETION_SHARE = 0.08

#: Share of ``time_limit`` (wall seconds) the large-neighbourhood search on the whole schedule
#: (:func:`engine.tessel.improve.improve_schedule`) may take, on a deterministic budget of
#: :data:`IMPROVE_DET_PER_S` per second of it (plus the nominal seconds the repetend phases left
#: unused, also deterministic: X on 16 devices, loose limit, 436 -> 428); it runs only where at
#: least :data:`IMPROVE_MIN_S` seconds (plus the time to build its models) are left. Measured on a
#: 2-core x86 machine: 0.06-0.12 deterministic s per wall second (NN on 4 devices, limit 9, m=16:
#: 0.128 in 2.0 s); 0.3 deterministic s takes M on 4 devices, limit 6, m=16 from 140 to 127 units,
#: 1.0 takes m=64 from 540 to 499 and X on 8 devices, limit 6, m=64 from 464 to 399 (bound 393).
IMPROVE_SHARE = 0.22
IMPROVE_DET_PER_S = 0.08
IMPROVE_MIN_S = 0.2

#: Block instances (placement blocks x micro-batches) per second the seed phase's probe (the
#: memory-aware 1F1B policy on 48 micro-batches, lowered and simulated) handles at least. Measured
#: on a 2-core x86 machine: 2,000 blocks x 48 micro-batches (96,000 instances) in about 8 s, so
#: about 12,000 per second; the seed phase runs only when its estimate fits :data:`SEED_SHARE` of
#: ``time_limit``. An estimate from the size, not the clock, so the search stays deterministic.
SEED_INSTANCES_PER_S = 10_000

#: Share of ``time_limit`` the seed phase may take (estimated, see :data:`SEED_INSTANCES_PER_S`).
SEED_SHARE = 0.2

#: Micro-batches the seed phase's policy probe schedules at least (:func:`engine.tessel.seed.policy_starts`);
#: four per device where that is more.
SEED_PROBE_MICRO_BATCHES = 48

#: Block instances (placement blocks x micro-batches) per second that turning a repetend into the
#: returned schedule handles at least: unrolling it, lowering and simulating the unrolled and the
#: compacted schedules, validating and simulating the result. Measured on a 2-core x86 machine:
#: 10,000 blocks x 16 micro-batches in 14 s (about 11,500 per second). The search phases before it
#: stop that long before ``time_limit``; where it alone would exceed ``time_limit`` the search
#: refuses at once.
FINISH_INSTANCES_PER_S = 10_000

#: Block instances per second the fallback policies (``fallback_baselines``: the memory-aware 1F1B
#: and GPipe schedules, each built, validated and simulated) add to that. Measured on a 2-core x86
#: machine: M on 4 devices, m=64 (640 instances) in 0.13 s, X on 32 devices (8,192) in 1.7 s.
FALLBACK_INSTANCES_PER_S = 5_000

class InfeasibleMemoryError(TesselError):
    """The memory limit is below what one micro-batch at a time needs.

    Attributes:
        smallest: the smallest feasible limit (bytes or the placement's memory units).
        device: the device that needs it.
    """

    def __init__(self, message: str, smallest: float, device: int):
        super().__init__(message)
        self.smallest = smallest
        self.device = device


class SearchCancelled(TesselError):
    """The search was cancelled before any solution was found."""


class SearchControl:
    """Cancel a running search from another thread: ``control.cancel()``.

    The running CP-SAT solve is stopped at once (``CpSolver.stop_search``); the search then
    returns the best schedule found so far.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._solver = None
        self._lock = threading.Lock()

    def cancel(self) -> None:
        self._event.set()
        with self._lock:
            if self._solver is not None:
                self._solver.stop_search()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def _attach(self, solver) -> None:
        with self._lock:
            self._solver = solver
            if solver is not None and self._event.is_set():
                solver.stop_search()


@dataclass
class SearchProgress:
    """What the progress callback receives.

    Attributes:
        step: solver calls so far.
        period_tried: the period (seconds) just tried; ``status`` its outcome.
        best_period: the shortest feasible period found so far (seconds).
        lower_bound: the period lower bound (seconds).
        elapsed: seconds since the search started.
    """

    step: int
    period_tried: float
    status: str
    best_period: float
    lower_bound: float
    elapsed: float


@dataclass
class SearchResult:
    """Outcome of :func:`tessel_search`.

    Attributes:
        schedule: the complete schedule for ``m`` micro-batches. ``schedule.meta["tessel"]`` holds
            the search's details, among them ``completion`` (``"unrolled"``: the repetend copied
            ``m`` times; ``"compacted"``: warmup/cooldown re-solved; ``"baseline <name>"``: the
            fallback) and ``completion_status`` (``"optimal"``, ``"feasible"``: ended on its
            budget, ``"hint"``: nothing better than the unrolled repetend, ``"unrolled"``).
        repetend: the steady-state window.
        period: seconds per micro-batch in steady state.
        period_lower_bound: seconds per micro-batch no repetend can beat: the busiest device's work
            per micro-batch and, under a memory limit, Little's law on memory for one micro-batch
            (:func:`engine.tessel.bounds.memory_time_bound` with ``m = 1``), the larger.
        makespan_lower_bound: bound for ``m`` micro-batches (seconds), under the memory limit
            when one is given (:func:`engine.tessel.bounds.makespan_lower_bound`).
        critical_path: one micro-batch's longest dependency chain (seconds).
        optimal: the period equals the lower bound, or every shorter window of the chosen size
            (micro-batches per window) was proven infeasible, with exact durations (never when
            ``rounded``).
        search_time: wall-clock seconds spent finding the repetend (phases 1, 2 and 2b), measured
            with ``time.perf_counter``.
        total_time: wall-clock seconds of the whole call, completion included.
        steps: solver calls.
        timed_out: the time limit or a cancellation cut the search short.
        resolution: seconds (or abstract units) per solver tick.
        memory_floor: per device, the least memory any schedule needs (bytes).
        completion_time: wall-clock seconds of phase 3: the warmup/cooldown completion and
            building, simulating and validating the schedule.
        rounded: block durations (or lags) are not whole ticks and were rounded up to them; the
            period is then an upper bound in exact time and ``optimal`` is ``False``.
        optimal_at_resolution: what ``optimal`` would say of the durations rounded up to ticks.
        wall_guard_hit: a solve or phase ended on the wall-clock guard (``time_limit``) rather than
            on its deterministic budget: the result may then differ between runs with the same seed.
        makespan: seconds (or units): the returned schedule simulated (:func:`engine.simulate.simulate`)
            with the search's ``comm`` cost model (communication free without one); no optimizer step.
        solver_makespan: seconds (or units): the same schedule's makespan in the search's own model:
            every device runs its order as soon as possible with block durations and transfer lags
            in solver ticks (:func:`engine.tessel.comm.asap_makespan`). Equal to ``makespan`` up to
            the tick's rounding (``rounded``) unless one device's sends queue behind each other.
    """

    schedule: Schedule
    repetend: Repetend
    period: float
    period_lower_bound: float
    makespan_lower_bound: float
    critical_path: float
    optimal: bool
    search_time: float
    steps: int
    timed_out: bool
    resolution: float
    memory_floor: list[int] = field(default_factory=list)
    total_time: float = 0.0
    completion_time: float = 0.0
    rounded: bool = False
    optimal_at_resolution: bool = False
    wall_guard_hit: bool = False
    makespan: float = 0.0
    solver_makespan: float = 0.0

    @property
    def period_gap(self) -> float:
        """``period / period_lower_bound - 1`` (0 when the bound is reached)."""
        return self.period / self.period_lower_bound - 1 if self.period_lower_bound > 0 else 0.0

    def summary(self) -> dict:
        return {
            "period": self.period, "period_lower_bound": self.period_lower_bound, "period_gap": self.period_gap,
            "makespan_lower_bound": self.makespan_lower_bound, "critical_path": self.critical_path,
            "in_flight": self.repetend.in_flight, "optimal": self.optimal,
            "optimal_at_resolution": self.optimal_at_resolution, "rounded": self.rounded,
            "search_time": self.search_time, "completion_time": self.completion_time, "total_time": self.total_time,
            "steps": self.steps, "timed_out": self.timed_out, "wall_guard_hit": self.wall_guard_hit,
            "resolution": self.resolution, "search_makespan": self.makespan, "solver_makespan": self.solver_makespan,
        }


def _limits(placement: Placement, memory_limit) -> list[float] | None:
    if memory_limit is None:
        return None
    if isinstance(memory_limit, (int, float)):
        return [float(memory_limit)] * placement.num_devices
    lim = [float(x) for x in memory_limit]
    if len(lim) != placement.num_devices:
        raise TesselError(f"memory_limit has {len(lim)} values for {placement.num_devices} devices")
    return lim


def tessel_search(
    placement: Placement,
    m: int,
    *,
    memory_limit: float | list[float] | None = None,
    time_limit: float = 10.0,
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

    Phases (1 and 2: :mod:`engine.tessel.period_search`): (1) the memory-aware 1F1B policy's
    periodic steady states seed the windows of their size; ``r = 1`` micro-batch per window (or
    the fixed ``window_micro_batches``) bisects its window length from the lower bound, a CP-SAT
    feasibility solve per step; windows of ``r = 2 .. max_window_micro_batches`` refine it in rounds
    of growing per-solve budgets, each size trying the longest window that beats the best period
    per micro-batch so far and bisecting below it, no window tried below the rate bound (busiest
    device, Little's law on memory); (2) at the best window, a CP-SAT solve for the least
    micro-batch latency (which sets the warmup + cooldown length; never longer than before) and
    then the least memory; (2b) sink deferral
    (:mod:`engine.tessel.defer`): the best repetend and the policy steady states of the same
    period get their sinks (e.g. ``W`` blocks) deferred by whole windows while the unrolled
    makespan for ``m`` does not grow and memory fits, and the shortest wins (on the split V
    placement this yields ZB-H1's schedule); (3) completion: the unrolled repetend and, unless
    it already reaches the makespan lower bound, a CP-SAT-compacted warmup/cooldown, keeping the
    one with the shorter simulated makespan; (4) a large-neighbourhood search on the whole schedule
    (``improve``).

    Args:
        placement: the blocks of one micro-batch (training or forward-only).
        m: micro-batches per step (placement instances).
        memory_limit: per-device limit in the placement's memory units (bytes for a captured
            model, abstract units for unit placements), static memory included; ``None`` = no limit.
        time_limit: wall-clock seconds for the whole search, every phase included; when it hits,
            the best solution so far is completed and returned (``timed_out`` set; the sequential
            repetend, one micro-batch at a time, when nothing better was found). The phases before
            the completion stop early enough to leave it its estimated time
            (:data:`FINISH_INSTANCES_PER_S`), a solve is not started when the time left cannot
            build its model (:data:`MODEL_INSTANCES_PER_S`), and the seed phase is skipped where it
            would not fit :data:`SEED_SHARE` of the limit.
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
            will predict it (e.g. :func:`engine.plan_metrics.predicted_metrics` of the plan, optimizer
            step included); the completions and fallbacks are compared by it and it is the result's
            ``makespan``. Default: the schedule simulated with ``comm``.
        objective: ``"throughput"`` (shortest period) or, for inference, ``"latency"`` (the
            repetend's micro-batch latency equals the critical path, at the shortest period that
            allows it). The schedule is an order per device executed as soon as inputs arrive, so
            with unequal stage times a fast first stage still runs ahead and later micro-batches
            queue before the slow stage: the steady-state latency then exceeds the repetend's.
        workers: CP-SAT workers (1 keeps results deterministic).
        progress: called after every solver call with a :class:`SearchProgress`.
        progress_bar: show a tqdm bar with the best period so far.
        control: a :class:`SearchControl` to cancel from another thread.
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
            :data:`IMPROVE_SHARE` of ``time_limit`` plus the nominal seconds phase 1 left unused;
            ``schedule.meta["tessel"]["improve"]`` says what it did. ``False``: phases 1-3 only.

    Returns:
        :class:`SearchResult`.

    Raises:
        InfeasibleMemoryError: the limit is below the memory floor (the message gives the
            smallest feasible limit).
        SearchCancelled: cancelled before the search started.
        TesselError: ``m < 1``, a bad objective, ``max_window_micro_batches < 1``, a
            ``window_micro_batches`` that is not a positive integer, a time limit that
            is not a positive number, or one shorter than building and checking the schedule alone
            takes (blocks x ``m`` / :data:`FINISH_INSTANCES_PER_S` seconds, and
            :data:`FALLBACK_INSTANCES_PER_S` with ``fallback_baselines``).
    """
    from engine.dependency import lower
    from engine.simulate import simulate

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
    t_start = time.perf_counter()
    # the schedule is built, simulated and validated after the search phases: keep time for it
    finish_s = len(placement.blocks) * m * (1 / FINISH_INSTANCES_PER_S
                                            + (1 / FALLBACK_INSTANCES_PER_S if fallback_baselines else 0.0))
    if finish_s > time_limit:
        need = float(f"{2 * finish_s:.2g}") if finish_s < 0.5 else math.ceil(2 * finish_s)
        raise TesselError(
            f"a schedule of {len(placement.blocks):,} blocks x {m} micro-batches takes about {finish_s:.2g} s to "
            f"build and check, more than the time limit of {time_limit:g} s; give a time limit of at least "
            f"{need:g} s or fewer micro-batches")
    deadline = t_start + time_limit - finish_s
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

    def step_makespan(sched: Schedule) -> float:
        return evaluate(sched) if evaluate is not None else simulate(lower(sched), comm).makespan
    if resolution is None:
        res, rounded = auto_resolution(placement, lags=lags)
    elif isinstance(resolution, (int, float)) and math.isfinite(resolution) and resolution > 0:
        res = float(resolution)
        rounded = not is_exact([b.duration for b in placement.blocks] + list((lags or {}).values()), res)
    else:
        raise TesselError(f"the resolution must be a positive number of seconds per tick (or None for the durations' "
                          f"common divisor), got {resolution!r}")
    lb_s = period_lower_bound(placement)
    clock = Clock(total_s=NOMINAL_SHARE * (time_limit - finish_s), deadline=deadline)
    has_memory = any(x.memory for x in placement.blocks) and not placement.forward_only
    # per micro-batch, no repetend beats the busiest device's work nor (under a limit) Little's law
    # on memory; its term is quadratic in the blocks: a small share of the time
    rate_s = 0.0
    if caps is not None and has_memory:
        rate_s = memory_time_bound(placement, 1, caps, deadline=time.perf_counter() + 0.05 * time_limit)
    bar = None
    if progress_bar:
        from tqdm.auto import tqdm

        bar = tqdm(desc="tessel search", unit="solve", leave=False)

    def on_step(w: Window, window: int, status: str) -> None:
        best_per_mb = search.best_w.per_mb * res
        if bar is not None:
            bar.update(1)
            bar.set_postfix(best=f"{best_per_mb:.4g}", lb=f"{lb_s:.4g}")
        if progress is not None:
            progress(SearchProgress(clock.steps, window * res / w.r, status, best_per_mb, lb_s,
                                    time.perf_counter() - t_start))

    search = PeriodSearch(placement, caps, res, lags, objective, rate_s / res, clock, time_limit, seed, workers,
                          control=control, on_step=on_step)
    lb_s = max(lb_s, rate_s)
    # (1) the memory-aware 1F1B policy's steady state, where periodic, seeds the window of its size;
    # skipped where its probe would not fit its share of the time (placements of many blocks)
    # the policy fills a pipeline of n devices in about n micro-batches: probe long enough to see
    # its steady state
    probe = max(SEED_PROBE_MICRO_BATCHES, 4 * placement.num_devices)
    seed_cost_s = len(placement.blocks) * probe / SEED_INSTANCES_PER_S
    seeds = {}
    rate_hint = None
    if objective != "latency" and seed_cost_s <= SEED_SHARE * time_limit:
        starts = policy_starts(placement, caps, probe_micro_batches=probe, comm=comm)
        if starts is not None:
            seeds = policy_repetends(placement, res, caps, max_window=3, probe_micro_batches=probe, starts=starts)
            if 1 not in seeds:
                rate_hint = policy_rate_repetend(placement, res, starts, probe)
        if window_micro_batches is not None:
            seeds = {r: rep for r, rep in seeds.items() if r == window_micro_batches}
    search.check_seeds(seeds)
    if rate_hint is not None and window_micro_batches in (None, 1):
        search.check_rate_hint(rate_hint)
    if window_micro_batches is not None:
        # a user-fixed window: only that many micro-batches per repetend, bisected like r = 1
        w = search.window(window_micro_batches)
        search.best_w = w
        search.bisect(w, STEP_SHARE * time_limit)
    else:
        search.bisect(search.window(1), STEP_SHARE * time_limit)
        search.refine(list(range(2, max_window_micro_batches + 1)))
    if time.perf_counter() >= deadline:
        clock.timed_out = clock.wall_hit = True
    c = search.best_w
    # optimal in the solver's ticks; with durations rounded up to ticks that says nothing exact
    optimal_at_resolution = search.at_bound() or c.best.period <= c.proven_lo
    optimal = optimal_at_resolution and not rounded
    # (2) at the best window: least latency, then least memory (bounded effort: a polish)
    search.polish(c, has_memory, critical_ticks(placement, search.window(1).sc))
    if bar is not None:
        bar.close()
    timed_out = clock.timed_out
    wall_guard = {"hit": clock.wall_hit}
    cands = search.windows
    one = search.window(1)
    steps = clock.steps
    best = c.best
    # the memory-time term of the bound is quadratic in the blocks: a share of what time is left
    # the memory-aware terms grow with the blocks (quadratic) and m: a share of what time is left
    ms_lb = max(makespan_lower_bound(placement, m, memory_limit=caps, lags=lags, tail=list(tail) if tail else None,
                                     deadline=time.perf_counter() + max(0.05 * time_limit,
                                                                        0.1 * (deadline - time.perf_counter()))),
                m * rate_s)
    # (2b) sink deferral (defer.py): the best repetend, and the policy's steady states with the
    # same period per micro-batch, each with its sinks (e.g. W blocks) deferred while the
    # unrolled makespan does not grow and memory fits; the shortest unrolled makespan wins.
    # Without a limit, memory may rise to the repetend's highest per-device peak. Not for the
    # latency objective: a deferred sink lengthens its micro-batch's latency.
    defer_caps = caps
    if has_memory and best.peak and caps is None:
        defer_caps = [max(best.peak)] * placement.num_devices
    source = "search"
    deferred: dict[int, int] = {}
    if objective == "throughput" and not timed_out and not (control is not None and control.cancelled):
        pool = [(c, best, "search")]
        for r_s, seed_rep in sorted(search.seeds.items()):   # the ones the solver confirmed within the limit
            cs = cands.get(r_s)
            if cs is not None and seed_rep.period * c.r <= best.period * r_s:
                pool.append((cs, seed_rep, "policy seed"))
        defer_deadline = min(deadline, time.perf_counter() + max(0.3, 0.08 * time_limit))
        scored = []
        for k, (cc, rp, src) in enumerate(pool):
            d_rep, span = defer_sinks(cc.pl, rp, m, defer_caps, r=cc.r, deadline=defer_deadline, lags=cc.lags_s)
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

    t_completion = time.perf_counter()
    repetend_time = t_completion - t_start
    # (3) completion under the limit; without one, under the steady state's highest per-device
    # peak (a device may then hold more than its own steady state, e.g. deferred W blocks)
    comp_caps = caps
    if has_memory and best.peak and caps is None:
        comp_caps = [max(best.peak)] * placement.num_devices
    meta = {"period": best.period_seconds, "period_lower_bound": lb_s, "optimal": optimal, "in_flight": best.in_flight,
            "micro_batches_per_window": c.r, "resolution": res, "rounded": rounded,
            "optimal_at_resolution": optimal_at_resolution, "repetend": best.to_dict(),
            "repetend_source": source, "deferred_sinks": {str(b): k for b, k in deferred.items()}}
    m_windows = -(-m // c.r)

    def simulated(label: str, comp) -> tuple[float, Schedule]:
        sched = to_schedule(placement, comp, m, name="tessel",
                            meta={"tessel": {**meta, "completion": label, "completion_status": comp.status}},
                            micro_batches_per_window=c.r)
        return step_makespan(sched), sched

    chosen = simulated("unrolled", unrolled(best, m_windows, len(c.pl.blocks)))
    remaining = deadline - time.perf_counter()
    at_bound = chosen[0] <= ms_lb * (1 + 1e-9)
    # the compaction solves a model over several copies of the window, then simulates once more;
    # whether it runs is decided on its own nominal budget (deterministic); the wall clock only guards
    comp_build_s = 6 * len(c.pl.blocks) / MODEL_INSTANCES_PER_S  # about six copies of the window
    comp_cap = COMPLETION_SHARE * time_limit
    comp_need_s = max(0.05, 2 * comp_build_s)
    wants = (comp_cap > comp_need_s and max(best.offsets, default=0) > 0 and not at_bound
             and not (control is not None and control.cancelled))
    if wants and remaining <= comp_need_s:
        wall_guard["hit"] = True
    elif wants:
        # reschedule the partial copies and two complete ones at each end (W blocks deferred
        # across the whole steady state are the deferral's job, above). The budget is CP-SAT
        # deterministic time (reproducible); the wall clock (WALL_GUARD_FACTOR times the budget,
        # never past the deadline) only guards a much slower or loaded machine.
        comp = complete(c.pl, c.sc, best, m_windows, memory_cap=comp_caps,
                        time_limit=min(remaining, WALL_GUARD_FACTOR * comp_cap), seed=seed, free_copies=2,
                        stall=completion_stall,
                        deterministic_time=None if completion_stall is not None else COMPLETION_DET_PER_S * comp_cap)
        other = simulated("compacted", comp)
        if other[0] < chosen[0] - 1e-12:
            chosen = other
    schedule = chosen[1]
    schedule.meta["tessel"]["pure_makespan"] = chosen[0]
    if fallback_baselines and not (control is not None and control.cancelled):
        schedule = _fallback(placement, m, comp_caps, chosen, schedule.meta, step_makespan)
    # (4) large-neighbourhood search on the whole schedule (improve.py), on its own deterministic
    # budget, unless the schedule is at the lower bound or the time left cannot build its models
    makespan = step_makespan(schedule)
    wall_left = deadline - time.perf_counter()
    # the repetend phases' nominal seconds they did not use (a window proven early, the bound
    # reached) go to the improvement: deterministic, so the schedule still does not depend on load
    spare_s = max(0.0, clock.left_s()) if not clock.timed_out else 0.0
    improve_nominal = IMPROVE_SHARE * time_limit + spare_s
    improve_s = min(improve_nominal, wall_left)
    schedule.meta["tessel"]["improve"] = "not run"
    if (improve and objective == "throughput" and makespan > ms_lb * (1 + 1e-9)
            and improve_s > IMPROVE_MIN_S + len(placement.blocks) * m / MODEL_INSTANCES_PER_S
            and not (control is not None and control.cancelled)):
        better = improve_schedule(placement, schedule, memory_limit=comp_caps, lags=lags, evaluate=step_makespan,
                                  deterministic_time=IMPROVE_DET_PER_S * improve_nominal,
                                  time_limit=min(wall_left, WALL_GUARD_FACTOR * improve_s), seed=seed)
        wall_guard["hit"] = wall_guard["hit"] or better.wall_guard_hit
        schedule.meta["tessel"]["improve"] = {"before": better.before, "after": better.makespan,
                                              "rounds": better.rounds, "stop": better.stop}
        if better.improved:
            schedule, makespan = better.schedule, better.makespan
            schedule.meta["tessel"] = {**schedule.meta["tessel"], "improved_from": schedule.meta["tessel"].get(
                "completion")}
    schedule.validate(caps)
    index = {b.key: i for i, b in enumerate(placement.blocks)}
    orders = [[(blk.micro_batch, index[blk.key]) for blk in order] for order in schedule.orders]
    tail_ticks = [one.sc.ticks(t) for t in tail] if tail else None
    solver_makespan = asap_makespan(placement, orders, one.sc.durations, one.sc.lags, tail_ticks) * res
    t_end = time.perf_counter()
    completion_time, elapsed = t_end - t_completion, t_end - t_start
    schedule.meta["tessel"].update(search_time=repetend_time, completion_time=completion_time, total_time=elapsed,
                                   wall_guard_hit=wall_guard["hit"], makespan=makespan, solver_makespan=solver_makespan)
    return SearchResult(
        schedule=schedule, repetend=best, period=best.period_seconds, period_lower_bound=lb_s,
        makespan_lower_bound=ms_lb, critical_path=critical_path(placement, lags),
        optimal=optimal, search_time=repetend_time, steps=steps, timed_out=timed_out, resolution=res,
        memory_floor=floor, total_time=elapsed, completion_time=completion_time, rounded=rounded,
        optimal_at_resolution=optimal_at_resolution, wall_guard_hit=wall_guard["hit"],
        makespan=makespan, solver_makespan=solver_makespan,
    )


def _fallback(placement: Placement, m: int, caps: list[float] | None, chosen: tuple[float, Schedule],
              meta: dict, step_makespan: Callable[[Schedule], float]) -> Schedule:
    """The searched schedule, or a policy baseline on the same placement when it is shorter.

    Candidates: the memory-aware 1F1B and the GPipe policies of :mod:`engine.baselines.generic`,
    kept only within ``caps`` (the limit the completion was held to). A baseline that wins is
    returned under the name ``"tessel"`` with ``meta["tessel"]["equals_baseline"]`` naming it and
    ``meta["tessel"]["completion"] = "baseline <name>"``; ``pure_makespan`` keeps the searched one.
    """
    from engine.baselines.generic import gpipe_any, one_f_one_b_any
    from engine.errors import ScheduleError

    best_span, best = chosen
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
