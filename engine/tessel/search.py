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
from engine.tessel.bounds import critical_path, makespan_lower_bound, memory_floor, period_lower_bound
from engine.tessel.comm import asap_makespan, transfer_lags
from engine.tessel.completion import complete, to_schedule, unrolled
from engine.tessel.defer import defer_sinks, unrolled_makespan
from engine.tessel.repetend import (
    Repetend,
    auto_resolution,
    expand,
    is_exact,
    retime,
    scale,
    sequential_repetend,
    solve_period,
)
from engine.tessel.seed import policy_repetends

if TYPE_CHECKING:
    from engine.simulate import CommCost

#: CP-SAT deterministic seconds the completion may spend per wall-clock second of its budget
#: (``max(1, 0.3 * time_limit)`` s). Measured on the benchmark's completions on a 2-core x86
#: machine: 0.08-0.2 deterministic s per wall s, so the budget usually ends before the wall time
#: the completion was given (whose double stays a guard), and the result does not depend on the
#: machine's load. ``benchmarks/tessel_bench.py``: slowest 4-device total 4.1 s -> 2.7 s,
#: makespans within 2% of the wall-clock version (some shorter, some longer).
COMPLETION_DET_PER_S = 0.1

#: CP-SAT deterministic time units (``max_deterministic_time``) the repetend phases get per second
#: of ``time_limit``. Their solves, the shares of the budget, and the phase switches all run on
#: this deterministic clock (the deterministic time CP-SAT reports, plus the model-building
#: estimates of :data:`MODEL_INSTANCES_PER_S`), so a fixed seed gives the same schedule under any
#: machine load; the wall clock (``time_limit``, and :data:`WALL_GUARD_FACTOR` x each solve's
#: nominal seconds) is only a guard, reported as ``wall_guard_hit`` when it ends a solve. Measured
#: on the repetend solves that ran to their limit in ``benchmarks/tessel_bench.py`` (M, NN, X, K on
#: 4 and 8 devices, m=64, 10 s) on a 2-core x86 machine: see the calibration in the issue 21 notes.
REPETEND_DET_PER_S = 0.15

#: A solve's wall-clock guard is this many times its nominal seconds (deterministic budget /
#: :data:`REPETEND_DET_PER_S`), and never past ``time_limit``.
WALL_GUARD_FACTOR = 10.0

#: Block instances (placement blocks x micro-batches) per second the seed phase's probe (the
#: memory-aware 1F1B policy on 48 micro-batches, lowered and simulated) handles at least. Measured
#: on a 2-core x86 machine: 2,000 blocks x 48 micro-batches (96,000 instances) in about 8 s, so
#: about 12,000 per second; the seed phase runs only when its estimate fits :data:`SEED_SHARE` of
#: ``time_limit``. An estimate from the size, not the clock, so the search stays deterministic.
SEED_INSTANCES_PER_S = 10_000

#: Share of ``time_limit`` the seed phase may take (estimated, see :data:`SEED_INSTANCES_PER_S`).
SEED_SHARE = 0.2

#: Micro-batches the seed phase's policy probe schedules (:func:`engine.tessel.seed.policy_repetends`).
SEED_PROBE_MICRO_BATCHES = 48

#: Block instances (placement blocks x micro-batches) per second that turning a repetend into the
#: returned schedule handles at least: unrolling it, lowering and simulating the schedule, and
#: validating it. Measured on a 2-core x86 machine, inside ``tessel_search``: 10,000 blocks x 16
#: micro-batches in 14 s (about 11,500 per second). The search phases before it stop that long
#: before ``time_limit``; where it alone would exceed ``time_limit`` the search refuses at once.
FINISH_INSTANCES_PER_S = 10_000

#: Block instances per second CP-SAT models are built at least (the repetend's and the
#: completion's, in Python). Measured on a 2-core x86 machine: the repetend model of 10,000 blocks
#: in about 1 s. A solve is not started when what is left of the time cannot even build its model.
MODEL_INSTANCES_PER_S = 10_000

#: Memory-order pairs per second the repetend model is built at least: with a memory limit (or a
#: memory objective) it holds one boolean per (allocating block, other memory block) pair on each
#: device, quadratic in the blocks per device. Measured on a 2-core x86 machine: 125,000 pairs (a
#: 1,000-block pipeline on 4 devices) in 5.3 s, about 24,000 per second.
MODEL_PAIRS_PER_S = 20_000

#: Share of ``time_limit`` one repetend solve for a window of several micro-batches may take
#: (all of them together at most 30%): larger windows are a refinement after ``r = 1``.
REFINE_SOLVE_SHARE = 0.03


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
        period_lower_bound: max per-device busy time per micro-batch (seconds).
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
    max_window_micro_batches: int = 2,
    fallback_baselines: bool = False,
    completion_stall: float | None = None,
) -> SearchResult:
    """Find a repetend of minimal period and complete it into a schedule of ``m`` micro-batches.

    Phases: (1) the memory-aware 1F1B policy's periodic steady states seed the windows of their
    size; then for windows of ``r = 1, 2, ...`` micro-batches a search on the window length, a
    CP-SAT feasibility solve per step: ``r = 1`` bisects from the lower bound; a larger window
    first tries the longest window that beats the best period per micro-batch so far (it stops
    at that size when that one is not found, and stops refining altogether when the solver runs
    out of its per-solve cap, since larger windows are harder), then the bound, then steps down;
    (2) at the best period, a CP-SAT solve for the least micro-batch latency (which sets the
    warmup + cooldown length) and then the least memory; (2b) sink deferral
    (:mod:`engine.tessel.defer`): the best repetend and the policy steady states of the same
    period get their sinks (e.g. ``W`` blocks) deferred by whole windows while the unrolled
    makespan for ``m`` does not grow and memory fits, and the shortest wins (on the split V
    placement this yields ZB-H1's schedule); (3) completion: the unrolled repetend and, unless
    it already reaches the makespan lower bound, a CP-SAT-compacted warmup/cooldown, keeping the
    one with the shorter simulated makespan.

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
            the search refines; ``r > 1`` reaches fractional periods per micro-batch (e.g. 17 units
            per 2 micro-batches). The memory-aware 1F1B policy's periodic steady state (windows of
            up to 3 micro-batches) always competes as found, so the result may hold up to
            ``max(3, max_window_micro_batches)`` micro-batches per window. 3-4 with a ``time_limit``
            of about 60 s can shorten the period on M-like shapes (M on 4 devices, limit 10: 7 ->
            6.33 units per micro-batch).
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

    Returns:
        :class:`SearchResult`.

    Raises:
        InfeasibleMemoryError: the limit is below the memory floor (the message gives the
            smallest feasible limit).
        SearchCancelled: cancelled before the search started.
        TesselError: ``m < 1``, a bad objective, ``max_window_micro_batches < 1``, a time limit that
            is not a positive number, or one shorter than building and checking the schedule alone
            takes (blocks x ``m`` / :data:`FINISH_INSTANCES_PER_S` seconds).
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
                          f"default 2), got {max_window_micro_batches!r}")
    if control is not None and control.cancelled:
        raise SearchCancelled("the search was cancelled before it started")
    if not (isinstance(time_limit, (int, float)) and math.isfinite(time_limit) and time_limit > 0):
        raise TesselError(f"the time limit must be a positive number of seconds, got {time_limit!r}")
    t_start = time.perf_counter()
    # the schedule is built, simulated and validated after the search phases: keep time for it
    finish_s = len(placement.blocks) * m / FINISH_INSTANCES_PER_S
    if finish_s > time_limit:
        raise TesselError(
            f"a schedule of {len(placement.blocks):,} blocks x {m} micro-batches takes about {finish_s:.0f} s to build "
            f"and check, more than the time limit of {time_limit:g} s; give a time limit of at least "
            f"{math.ceil(2 * finish_s)} s or fewer micro-batches")
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
    should_stop = (lambda: control.cancelled) if control is not None else None
    steps = 0
    timed_out = False
    # the deterministic clock of the repetend phases (nominal seconds = deterministic time / rate)
    solver_stats: dict = {"det": 0.0}
    built = {"s": 0.0}   # estimated model-building seconds, a deterministic estimate
    wall_guard = {"hit": False}
    det_total_s = time_limit - finish_s

    def det_used_s() -> float:
        return solver_stats["det"] / REPETEND_DET_PER_S + built["s"]

    class Candidate:  # the search state for one window size r (micro-batches per window)
        def __init__(self, r: int):
            self.r = r
            self.pl = expand(placement, r)
            self.lags_s = _expand_lags(lags, len(placement.blocks), r)   # seconds, over the expanded placement
            self.sc = scale(self.pl, res, self.lags_s)
            if placement.forward_only:
                # inference: a forward block's activation is released once the next block has
                # consumed it, so only static memory persists; the limit bounds static memory alone
                self.sc.memory = [0] * len(self.sc.memory)
            self.lb = max(1, max(sum(self.sc.durations[i] for i in self.pl.blocks_on(d))
                                 for d in range(self.pl.num_devices)))
            self.best = sequential_repetend(self.pl, self.sc)
            self.best.micro_batches = r
            self.proven_lo = self.lb
            mem = [sum(1 for i in self.pl.blocks_on(d) if self.sc.memory[i]) for d in range(self.pl.num_devices)]
            alloc = [sum(1 for i in self.pl.blocks_on(d) if self.sc.memory[i] > 0) for d in range(self.pl.num_devices)]
            self.memory_pairs = sum(a * b for a, b in zip(alloc, mem))
            self.max_latency = _critical_ticks(self.pl, self.sc) if objective == "latency" else None

        def build_seconds(self, memory: bool) -> float:
            """Estimated seconds to build this window's CP-SAT model (with its memory part or not)."""
            pairs = self.memory_pairs / MODEL_PAIRS_PER_S if memory else 0.0
            return len(self.pl.blocks) / MODEL_INSTANCES_PER_S + pairs

        @property
        def per_mb(self) -> float:
            return self.best.period / self.r

    has_memory = any(x.memory for x in placement.blocks) and not placement.forward_only
    one = Candidate(1)
    lb = one.lb
    bar = None
    if progress_bar:
        from tqdm.auto import tqdm

        bar = tqdm(total=2 * max(1, math.ceil(math.log2(max(2, one.best.period - lb + 1)))) + 2, desc="tessel search",
                   unit="solve", leave=False)
    best_c = one

    def report(c: Candidate, window: int, status: str) -> None:
        if bar is not None:
            bar.update(1)
            bar.set_postfix(best=f"{best_c.per_mb * res:.4g}", lb=f"{lb * res:.4g}")
        if progress is not None:
            progress(SearchProgress(steps, window * res / c.r, status, best_c.per_mb * res, lb_s,
                                    time.perf_counter() - t_start))

    def attempt(c: Candidate, window: int, objective_: str | None, budget_share: float, cap_s: float | None = None,
                hint: Repetend | None = None, hinted_share: float = 0.0):
        nonlocal steps, timed_out
        remaining = det_total_s - det_used_s()   # nominal seconds on the deterministic clock
        wall_left = deadline - time.perf_counter()
        # a solve cannot end sooner than building its model: on thousands of blocks, seconds
        memory = caps is not None or objective_ in ("memory", "latency+memory")
        build_s = c.build_seconds(memory)
        if wall_left <= 0.02:
            wall_guard["hit"] = True
        if remaining <= max(0.02, build_s) or wall_left <= 0.02 or (control is not None and control.cancelled):
            timed_out = True
            return "unknown", None
        budget = remaining * budget_share if cap_s is None else min(remaining * budget_share, cap_s)
        built["s"] += build_s
        status, rep = solve_period(c.pl, c.sc, window, caps,
                                   time_limit=min(wall_left, WALL_GUARD_FACTOR * budget + build_s), seed=seed,
                                   workers=workers, objective=objective_, max_latency=c.max_latency,
                                   hint=hint or c.best, replicas=c.r, should_stop=should_stop,
                                   on_solver=control._attach if control is not None else None,
                                   hinted_share=hinted_share, det_limit=REPETEND_DET_PER_S * budget,
                                   stats=solver_stats)
        if solver_stats.pop("wall_hit", False):
            wall_guard["hit"] = True
        if rep is not None:
            rep.micro_batches = c.r
        steps += 1
        return status, rep

    # (1) for r = 1, 2, ...: binary search on the window length; a solve that runs out of its share
    # of time counts as "not found" (the window grows, but is not proven infeasible). Feasibility
    # is monotone in the window (idle time can be added), so an infeasible window proves all shorter.
    step_cap = 0.15 * time_limit
    # the memory-aware 1F1B policy's steady state, where periodic, seeds the window of its size;
    # skipped where its probe would not fit its share of the time (placements of many blocks)
    seed_cost_s = len(placement.blocks) * SEED_PROBE_MICRO_BATCHES / SEED_INSTANCES_PER_S
    seeds = {}
    if objective != "latency" and seed_cost_s <= SEED_SHARE * time_limit:
        seeds = policy_repetends(placement, res, caps, max_window=3, probe_micro_batches=SEED_PROBE_MICRO_BATCHES,
                                 comm=comm)
    cands: dict[int, Candidate] = {1: one}
    for r, seed_rep in sorted(seeds.items()):  # seeds first: each is a strong upper bound, checked in one solve
        c = cands.setdefault(r, one if r == 1 else Candidate(r))
        if seed_rep.period < c.best.period and seed_rep.period / r < best_c.per_mb:
            status, rep = attempt(c, seed_rep.period, None, 0.5, step_cap, hint=seed_rep)
            if rep is not None:
                c.best = rep
                if c.per_mb < best_c.per_mb:
                    best_c = c
            report(c, seed_rep.period, f"seed {status}")
    # refine windows up to the maximum; a policy seed of a larger window competes as it is (its
    # refinement rarely finishes within its share of the time, e.g. M4 tight: 0.3 s for nothing)
    windows = sorted(set(range(1, max_window_micro_batches + 1)))
    refine_until = None
    for r in windows:
        if r > 1:
            # a larger window is a refinement: its solves get a small cap, all of them together
            # at most 30% of the time limit, so the polish and the completion keep their time
            refine_until = refine_until or min(det_total_s, det_used_s() + 0.3 * time_limit)
            if refine_until - det_used_s() < 0.05 * time_limit:
                break
        c = cands.setdefault(r, Candidate(r))
        cap = step_cap if r == 1 else REFINE_SOLVE_SHARE * time_limit
        lo = c.lb
        # only windows that beat the best period per micro-batch so far are worth a solve
        hi = c.best.period if c is best_c else min(c.best.period, math.ceil(best_c.per_mb * r) - 1)
        if lo > hi:  # cannot beat the best period per micro-batch found so far
            continue
        if hi < c.best.period and not timed_out:
            # hi is not known to be feasible: try it first. Feasibility is monotone in the window
            # (idle time can be added), so if the largest window that would improve is not found,
            # no shorter window of this size will be: move on to the next size
            # then hinted by the best repetend so far, retimed to this window: a solution is often nearby
            guess = retime(best_c.best, len(placement.blocks), r, hi)
            status, rep = attempt(c, hi, None, 0.5, cap, hint=guess, hinted_share=0.5)
            report(c, hi, status)
            if rep is None:
                if status == "infeasible":
                    c.proven_lo = max(c.proven_lo, hi + 1)
                    continue
                if r > 1:
                    break  # the solver ran out of time at this size: larger windows are harder still
                continue
            c.best = rep
            if c.per_mb < best_c.per_mb:
                best_c = c
        while lo < hi and not timed_out:  # hi is feasible: search below it
            # the bound first (often feasible, or quickly proven infeasible); then r = 1 bisects
            # (its solves are fast) and larger windows step down from hi (one solve near a
            # feasible window usually settles it: feasible, or infeasible and so optimal)
            mid = lo if lo == c.lb else ((lo + hi) // 2 if r == 1 else hi - 1)
            if refine_until is not None and det_used_s() >= refine_until:
                break
            status, rep = attempt(c, mid, None, 0.5, cap)
            if rep is not None:
                c.best, hi = rep, mid
            else:
                lo = mid + 1
                if status == "infeasible":
                    c.proven_lo = max(c.proven_lo, lo)
            if c.per_mb < best_c.per_mb:
                best_c = c
            report(c, mid, status)
        if best_c.per_mb <= lb or timed_out:
            break
    if time.perf_counter() >= deadline:
        timed_out = wall_guard["hit"] = True
    c = best_c
    # optimal in the solver's ticks; with durations rounded up to ticks that says nothing exact
    optimal_at_resolution = c.per_mb <= lb or c.best.period <= c.proven_lo
    optimal = optimal_at_resolution and not rounded
    # (2) at the best window: least latency, then least memory (bounded effort: a polish)
    if not timed_out:
        polish_cap = 0.1 * max(1, placement.num_devices / 4) * max(1, len(c.pl.blocks) / 16)
        status, rep = attempt(c, c.best.period, "latency+memory" if has_memory else "latency", 0.5, polish_cap)
        if rep is not None:
            c.best = rep
        report(c, c.best.period, "polish")
    if bar is not None:
        bar.close()
    best = c.best
    # the memory-time term of the bound is quadratic in the blocks: a share of what time is left
    ms_lb = makespan_lower_bound(placement, m, memory_limit=caps, lags=lags, tail=list(tail) if tail else None,
                                 deadline=time.perf_counter() + max(0.0, 0.1 * (deadline - time.perf_counter())))
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
        for r_s, seed_rep in sorted(seeds.items()):
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
    # whether the completion runs is decided on the deterministic clock; the wall clock only guards
    det_remaining = det_total_s - det_used_s()
    if remaining <= 0.05 + finish_s:
        wall_guard["hit"] = True
    at_bound = chosen[0] <= ms_lb * (1 + 1e-9)
    # the compaction solves a model over several copies of the window, then simulates once more
    comp_build_s = 6 * len(c.pl.blocks) / MODEL_INSTANCES_PER_S  # about six copies of the window
    if (min(remaining, det_remaining) > max(0.05, 2 * comp_build_s + finish_s) and max(best.offsets, default=0) > 0
            and not at_bound
            and not (control is not None and control.cancelled)):
        comp_cap = max(1.0, 0.3 * time_limit)
        # reschedule the partial copies and two complete ones at each end (W blocks deferred
        # across the whole steady state are the deferral's job, above). The budget is CP-SAT
        # deterministic time (reproducible); the wall clock (twice the budget's usual duration,
        # never past the deadline) only guards a much slower or loaded machine.
        comp = complete(c.pl, c.sc, best, m_windows, memory_cap=comp_caps,
                        time_limit=min(remaining - finish_s, WALL_GUARD_FACTOR * comp_cap), seed=seed, free_copies=2,
                        stall=completion_stall,
                        deterministic_time=None if completion_stall is not None else COMPLETION_DET_PER_S * comp_cap)
        other = simulated("compacted", comp)
        if other[0] < chosen[0] - 1e-12:
            chosen = other
    schedule = chosen[1]
    schedule.meta["tessel"]["pure_makespan"] = chosen[0]
    if fallback_baselines and not (control is not None and control.cancelled):
        schedule = _fallback(placement, m, comp_caps, chosen, schedule.meta, step_makespan)
    schedule.validate(caps)
    makespan = step_makespan(schedule)
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


def _expand_lags(lags, K: int, r: int):
    if not lags:
        return None
    return {(k * K + a, k * K + b): v for k in range(r) for (a, b), v in lags.items()}


def _critical_ticks(placement: Placement, sc) -> int:
    """The critical path of one micro-batch in solver ticks (durations and lags)."""
    import networkx as nx

    g = placement.dependency_graph()
    longest: dict[int, int] = {}
    for i in nx.topological_sort(g):
        longest[i] = sc.durations[i] + max((longest[a] + sc.lags.get((a, i), 0) for a in g.predecessors(i)), default=0)
    return max(longest.values(), default=0)
