"""Tessel phase 1: the shortest repetend period, over windows of one or more micro-batches.

A :class:`Window` is the search state for repetends of ``r`` micro-batches per window (the
placement expanded ``r`` times, :func:`engine.tessel.repetend.expand`); :class:`PeriodSearch` runs
CP-SAT feasibility solves (:func:`engine.tessel.repetend.solve_period`) over window lengths:

1. the memory-aware 1F1B policy's periodic steady states (:mod:`engine.tessel.seed`) are checked
   at their own window length (a strong upper bound in one solve);
2. ``r = 1`` (or the user's fixed ``r``) bisects its window length between the lower bound and
   the best found (feasibility is monotone in the window length: idle time can be added);
3. larger windows ``r = 2 .. max_window`` are a refinement in rounds of growing per-solve
   budgets (iterative deepening, x4 a round): in each round, every size first tries the longest
   window that beats the best period per micro-batch so far, then bisects below a feasible one.
   A size whose solve runs out of its budget is retried in the next round with a larger one;
   one proven infeasible is done. Window lengths below the per-micro-batch rate bound (the
   busiest device's work, and under a memory limit Little's law on memory,
   :func:`engine.tessel.bounds.memory_time_bound` for one micro-batch) are never tried;
4. at the best window, a polish solve minimises the micro-batch latency (per weakly connected
   component of the chain: it sets the warmup and cooldown) and then the peak memory, never
   accepting a longer latency than the solution it starts from.

Every solve and phase switch runs on CP-SAT's deterministic clock (``max_deterministic_time``,
:data:`REPETEND_DET_PER_S` units per second of the time limit), so a fixed seed gives the same
result under any machine load; the wall clock only guards.

Source: Tessel (Lin et al., HPCA 2024), section IV-A (repetend construction, several micro-batches
per repetend); the reference implementation binary-searches the objective with Z3.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import networkx as nx

from engine.placement import Placement
from engine.tessel.repetend import (
    Repetend,
    expand,
    repetend_latency,
    retime,
    scale,
    sequential_repetend,
    solve_period,
)

#: CP-SAT deterministic time units (``max_deterministic_time``) the repetend phases get per second
#: of ``time_limit``. Measured on the benchmark's solves (``benchmarks/tessel_bench.py``, 4-16
#: devices) on a 2-core x86 machine: 0.1-0.15 units per wall second on short solves, 0.05-0.07 on
#: the memory-bound solves of windows of 2-3 micro-batches that take most of the time, down to
#: 0.03 on the slowest (the wall-clock guard ends those).
REPETEND_DET_PER_S = 0.07

#: A solve's wall-clock guard is this many times its nominal seconds (deterministic budget /
#: :data:`REPETEND_DET_PER_S`), and never past ``time_limit``.
WALL_GUARD_FACTOR = 10.0

#: Block instances (placement blocks x micro-batches) per second CP-SAT models are built at least
#: (in Python). Measured on a 2-core x86 machine: the repetend model of 10,000 blocks in about 1 s.
MODEL_INSTANCES_PER_S = 10_000

#: Memory-order pairs per second the repetend model is built at least: with a memory limit it holds
#: one boolean per (allocating block, other memory block) pair on each device. Measured on a 2-core
#: x86 machine: 125,000 pairs (a 1,000-block pipeline on 4 devices) in 5.3 s, about 24,000 per second.
MODEL_PAIRS_PER_S = 20_000

#: Nominal seconds every solve costs beyond its deterministic time and its model-building estimate
#: (Python model building, CP-SAT's presolve and start-up). Measured on a 2-core x86 machine on the
#: 4-device benchmark cases: 0.01-0.05 s per solve.
SOLVE_OVERHEAD_S = 0.03

#: Share of ``time_limit`` one ``r = 1`` solve may take.
STEP_SHARE = 0.15

#: Share of ``time_limit`` each solve hinted by the policy's average rate may take (two at most).
RATE_HINT_SHARE = 0.04

#: Share of ``time_limit`` the ``r = 1`` probe at the lower bound itself may take (it is tried
#: first: often feasible, or quickly refuted; when neither, the bisection goes on without it).
BOUND_PROBE_SHARE = 0.04

#: Nominal seconds per ``time_limit`` second of the first refinement round's solves (windows of
#: several micro-batches); each later round quadruples it.
REFINE_FIRST_SHARE = 0.02

#: Share of ``time_limit`` all refinement rounds together may take (nominal seconds).
REFINE_SHARE = 0.4

#: Share of ``time_limit`` the polish may take where the repetend's latency is more than
#: :data:`POLISH_SLACK` above its critical path (a long warmup and cooldown to win back), and the
#: share otherwise.
POLISH_SHARE_LONG, POLISH_SHARE = 0.25, 0.05
POLISH_SLACK = 1.1


@dataclass
class Clock:
    """The search's deterministic clock and counters.

    Attributes:
        total_s: nominal seconds the repetend phases may use.
        deadline: ``time.perf_counter()`` value the wall-clock guard ends at.
        det: CP-SAT deterministic time used so far.
        built_s: estimated model-building seconds so far (deterministic estimates).
        steps: solver calls.
        timed_out: the budget, the wall clock or a cancellation cut the search short.
        wall_hit: a solve ended on the wall clock before its deterministic budget.
    """

    total_s: float
    deadline: float
    det: float = 0.0
    built_s: float = 0.0
    steps: int = 0
    timed_out: bool = False
    wall_hit: bool = False
    stats: dict = field(default_factory=lambda: {"det": 0.0})

    def used_s(self) -> float:
        """Nominal seconds used: deterministic time / :data:`REPETEND_DET_PER_S` + model building."""
        return self.stats["det"] / REPETEND_DET_PER_S + self.built_s

    def left_s(self) -> float:
        return self.total_s - self.used_s()


class Window:
    """The search state for repetends of ``r`` micro-batches per window.

    Attributes:
        r: micro-batches per window.
        pl: the placement expanded ``r`` times; ``lags_s``: its dependency lags (seconds); ``sc``: its
            integer view (ticks, memory quanta).
        lb: the shortest window any repetend of this size can have (the busiest device's ticks, and
            the rate bound).
        best: the best repetend found (the sequential one to start with).
        proven_lo: every window shorter than this is proven infeasible.
    """

    def __init__(self, placement: Placement, r: int, res: float, lags: dict | None, objective: str,
                 rate_ticks: float = 0.0):
        self.r = r
        self.pl = expand(placement, r)
        K = len(placement.blocks)
        self.lags_s = {(k * K + a, k * K + b): v for k in range(r) for (a, b), v in lags.items()} if lags else None
        self.sc = scale(self.pl, res, self.lags_s)
        if placement.forward_only:
            # inference: a forward block's activation is released once the next block has
            # consumed it, so only static memory persists; the limit bounds static memory alone
            self.sc.memory = [0] * len(self.sc.memory)
        busy = max(sum(self.sc.durations[i] for i in self.pl.blocks_on(d)) for d in range(self.pl.num_devices))
        # the rate bound is in exact time; durations are rounded up to ticks, so it holds in ticks too
        self.lb = max(1, busy, math.ceil(rate_ticks * r - 1e-9))
        self.best = sequential_repetend(self.pl, self.sc)
        self.best.micro_batches = r
        self.proven_lo = self.lb
        mem = [sum(1 for i in self.pl.blocks_on(d) if self.sc.memory[i]) for d in range(self.pl.num_devices)]
        alloc = [sum(1 for i in self.pl.blocks_on(d) if self.sc.memory[i] > 0) for d in range(self.pl.num_devices)]
        self.memory_pairs = sum(a * b for a, b in zip(alloc, mem))
        self.max_latency = critical_ticks(self.pl, self.sc) if objective == "latency" else None

    def build_seconds(self, memory: bool) -> float:
        """Estimated seconds to build this window's CP-SAT model (with its memory part or not)."""
        pairs = self.memory_pairs / MODEL_PAIRS_PER_S if memory else 0.0
        return len(self.pl.blocks) / MODEL_INSTANCES_PER_S + pairs

    @property
    def per_mb(self) -> float:
        """Ticks per micro-batch of the best repetend."""
        return self.best.period / self.r


class PeriodSearch:
    """Phases 1 and 2 of :func:`engine.tessel.search.tessel_search` (see the module docstring).

    Args:
        placement: the placement searched; ``caps``: per-device memory limits (or ``None``);
        res: seconds per tick; ``lags``: seconds per cross-device dependency (or ``None``);
        objective: ``"throughput"`` or ``"latency"``; ``rate_ticks``: ticks per micro-batch no
        repetend can beat (the rate bound); ``clock``: the deterministic clock; ``time_limit``:
        seconds, which the shares of the module's constants are of; ``seed``, ``workers``: CP-SAT's;
        ``control``: a :class:`~engine.tessel.control.SearchControl` or ``None``; ``on_step``:
        ``(window, period_tried, status) -> None`` after every solve (progress reporting).
    """

    def __init__(self, placement: Placement, caps: list[float] | None, res: float, lags: dict | None,
                 objective: str, rate_ticks: float, clock: Clock, time_limit: float, seed: int, workers: int,
                 control=None, on_step: Callable[["Window", int, str], None] | None = None):
        self.placement = placement
        self.caps = caps
        self.res = res
        self.lags = lags
        self.objective = objective
        self.rate_ticks = rate_ticks
        self.clock = clock
        self.time_limit = time_limit
        self.seed = seed
        self.workers = workers
        self.control = control
        self.on_step = on_step
        self.windows: dict[int, Window] = {}
        #: the policy steady states the solver confirmed, as the repetends it returned (by ``r``)
        self.seeds: dict[int, Repetend] = {}
        self.best_w = self.window(1)
        #: ticks per micro-batch no repetend beats (busiest device, rate bound), unrounded
        self.bound_ticks = max(float(max(sum(self.best_w.sc.durations[i] for i in placement.blocks_on(d))
                                         for d in range(placement.num_devices))), rate_ticks)

    # ------------------------------------------------------------------ plumbing
    def window(self, r: int) -> Window:
        """The search state of windows of ``r`` micro-batches (made on first use)."""
        if r not in self.windows:
            self.windows[r] = Window(self.placement, r, self.res, self.lags, self.objective, self.rate_ticks)
        return self.windows[r]

    def cancelled(self) -> bool:
        return self.control is not None and self.control.cancelled

    def attempt(self, w: Window, period: int, objective: str | None, share: float, cap_s: float | None = None,
                hint: Repetend | None = None, hinted_share: float = 0.0,
                latency_cap: int | None = None) -> tuple[str, Repetend | None]:
        """One solve of ``w`` at window length ``period`` (ticks) with at most ``share`` of the nominal
        seconds left and at most ``cap_s``; ``("unknown", None)`` without a solve when the time left
        cannot build the model."""
        clock = self.clock
        remaining = clock.left_s()
        wall_left = clock.deadline - time.perf_counter()
        memory = self.caps is not None or objective in ("memory", "latency+memory")
        build_s = w.build_seconds(memory)
        if wall_left <= 0.02:
            clock.wall_hit = True
        if remaining <= max(0.02, build_s) or wall_left <= 0.02 or self.cancelled():
            clock.timed_out = True
            return "unknown", None
        budget = remaining * share if cap_s is None else min(remaining * share, cap_s)
        clock.built_s += build_s + SOLVE_OVERHEAD_S
        status, rep = solve_period(w.pl, w.sc, period, self.caps,
                                   time_limit=min(wall_left, WALL_GUARD_FACTOR * budget + build_s), seed=self.seed,
                                   workers=self.workers, objective=objective, max_latency=w.max_latency,
                                   hint=hint or w.best, replicas=w.r,
                                   should_stop=self.cancelled if self.control is not None else None,
                                   on_solver=self.control._attach if self.control is not None else None,
                                   hinted_share=hinted_share, det_limit=REPETEND_DET_PER_S * budget,
                                   stats=clock.stats, latency_cap=latency_cap)
        if clock.stats.pop("wall_hit", False):
            clock.wall_hit = True
        if rep is not None:
            rep.micro_batches = w.r
        clock.steps += 1
        return status, rep

    def _found(self, w: Window, rep: Repetend) -> None:
        w.best = rep
        if w.per_mb < self.best_w.per_mb:
            self.best_w = w

    def _step(self, w: Window, period: int, status: str) -> None:
        if self.on_step is not None:
            self.on_step(w, period, status)

    def at_bound(self) -> bool:
        """The best period per micro-batch equals :attr:`bound_ticks` (nothing can be shorter)."""
        return self.best_w.per_mb <= self.bound_ticks + 1e-9

    # ------------------------------------------------------------------ phases
    def check_seeds(self, seeds: dict[int, Repetend]) -> None:
        """Check each policy steady state at its own window length (one hinted solve each)."""
        for r, seed_rep in sorted(seeds.items()):
            w = self.window(r)
            if seed_rep.period < w.best.period and seed_rep.period / r < self.best_w.per_mb:
                status, rep = self.attempt(w, seed_rep.period, None, 0.5, STEP_SHARE * self.time_limit, hint=seed_rep)
                if rep is not None:
                    self.seeds[r] = rep
                    self._found(w, rep)
                self._step(w, seed_rep.period, f"seed {status}")

    def check_rate_hint(self, hint: Repetend) -> None:
        """One micro-batch per window at the policy's average rate (and one tick more), hinted by its
        schedule read off at that window (:func:`engine.tessel.seed.policy_rate_repetend`)."""
        w = self.window(1)
        for period in (hint.period, hint.period + 1):
            if period >= w.best.period or period < w.lb:
                continue
            guess = Repetend(period, [s % period for s in hint.starts], hint.offsets, hint.resolution)
            status, rep = self.attempt(w, period, None, 0.5, RATE_HINT_SHARE * self.time_limit, hint=guess,
                                       hinted_share=0.5)
            self._step(w, period, f"policy rate {status}")
            if rep is not None:
                self._found(w, rep)
                return

    def bisect(self, w: Window, cap_s: float, *, until_s: float | None = None) -> str:
        """Bisect ``w``'s window length below its best (feasible) one.

        A solve that runs out of its budget counts as "not found" (the window grows, but is not
        proven infeasible). Returns ``"unknown"`` when some window below the best one was left
        undecided (worth a retry with a larger budget), else ``"done"``.
        """
        lo, hi = w.proven_lo, w.best.period
        undecided = False
        while lo < hi and not self.clock.timed_out:
            if until_s is not None and self.clock.used_s() >= until_s:
                return "unknown"
            # one micro-batch per window: the bound first (often feasible, or quickly proven
            # infeasible), then halves; larger windows halve at once (their bound is rarely feasible
            # and slow to refute)
            probe = lo == w.lb and w.r == 1
            mid = lo if probe else (lo + hi) // 2
            status, rep = self.attempt(w, mid, None, 0.5,
                                       min(cap_s, BOUND_PROBE_SHARE * self.time_limit) if probe else cap_s)
            if rep is not None:
                self._found(w, rep)
                hi = mid
            else:
                lo = mid + 1
                if status == "infeasible":
                    w.proven_lo = max(w.proven_lo, lo)
                else:
                    undecided = True
            self._step(w, mid, status)
        return "unknown" if undecided else "done"

    def refine(self, sizes: list[int]) -> None:
        """Windows of several micro-batches, in rounds of growing budgets (module docstring, step 3)."""
        if not sizes:
            return
        until = min(self.clock.total_s, self.clock.used_s() + REFINE_SHARE * self.time_limit)
        cap = REFINE_FIRST_SHARE * self.time_limit
        open_sizes = list(sizes)
        while open_sizes and not self.clock.timed_out and not self.at_bound():
            retry = []
            for r in open_sizes:
                if self.clock.used_s() >= until or self.clock.timed_out:
                    return
                w = self.window(r)
                # only windows that beat the best period per micro-batch so far are worth a solve
                hi = w.best.period if w is self.best_w else min(w.best.period,
                                                                math.ceil(self.best_w.per_mb * r) - 1)
                if w.proven_lo > hi:
                    continue   # proven: nothing of this size beats the best
                if hi < w.best.period:
                    # hinted by the best repetend so far, retimed to this window: often nearly a solution
                    guess = retime(self.best_w.best, len(self.placement.blocks), r, hi)
                    status, rep = self.attempt(w, hi, None, 0.5, cap, hint=guess, hinted_share=0.5)
                    self._step(w, hi, status)
                    if rep is None:
                        if status == "infeasible":
                            w.proven_lo = max(w.proven_lo, hi + 1)
                        else:
                            retry.append(r)
                        continue
                    self._found(w, rep)
                if self.bisect(w, cap, until_s=until) == "unknown":
                    retry.append(r)
            open_sizes = retry
            cap *= 4

    def polish(self, w: Window, has_memory: bool, critical: int) -> None:
        """At ``w``'s best window: least latency (never longer than now), then least memory."""
        if self.clock.timed_out:
            return
        current = repetend_latency(w.pl, w.sc, w.best)
        share = POLISH_SHARE_LONG if current > POLISH_SLACK * critical * w.r else POLISH_SHARE
        status, rep = self.attempt(w, w.best.period, "latency+memory" if has_memory else "latency", 0.5,
                                   share * self.time_limit, hint=w.best, latency_cap=current)
        if rep is not None and repetend_latency(w.pl, w.sc, rep) <= current:
            w.best = rep
        self._step(w, w.best.period, "polish")


def critical_ticks(placement: Placement, sc) -> int:
    """The critical path of one micro-batch in solver ticks (durations and lags)."""
    g = placement.dependency_graph()
    longest: dict[int, int] = {}
    for i in nx.topological_sort(g):
        longest[i] = sc.durations[i] + max((longest[a] + sc.lags.get((a, i), 0) for a in g.predecessors(i)), default=0)
    return max(longest.values(), default=0)
