"""The time budget of one Tessel search: the wall-clock limit, the nominal clock, each phase's share.

:func:`engine.tessel.search.tessel_search` gets one ``time_limit`` (wall seconds) for all of its
phases. A :class:`SearchBudget` splits it: the seconds kept at the end to build and check the
schedule (:data:`FINISH_INSTANCES_PER_S`), the repetend phases' *nominal* seconds
(:data:`NOMINAL_SHARE`, counted on CP-SAT's deterministic clock, :class:`~engine.tessel.period_search.Clock`),
the completion's and the improvement's shares (also on deterministic budgets), and the wall-clock
deadline that only guards a much slower or loaded machine. Every solve ends on its deterministic
budget, so a fixed seed gives the same schedule whatever the load; where the wall clock ends a
solve or a phase first, :attr:`SearchBudget.wall_guard_hit` says so.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from engine.errors import TesselError
from engine.placement import Placement
from engine.tessel.period_search import STEP_SHARE, WALL_GUARD_FACTOR, Clock

__all__ = ["SearchBudget"]

#: CP-SAT deterministic seconds the completion may spend per wall-clock second of its budget
#: (``COMPLETION_SHARE * time_limit`` s). Measured on the benchmark's completions on a 2-core x86
#: machine: 0.06-0.2 deterministic s per wall s (NN on 4 devices, limit 9: 0.07 in 1.1 s), so the
#: budget usually ends before the wall time the completion was given (ten times it stays a guard),
#: and the result does not depend on the machine's load.
COMPLETION_DET_PER_S = 0.1

#: Share of ``time_limit`` (less the time kept for building the schedule) the repetend phases may
#: use in nominal seconds (their deterministic clock, :mod:`engine.tessel.period_search`), the
#: completion's share, and (below) the improvement's. Together 60% of the limit in nominal seconds,
#: which an idle 2-core x86 machine runs in 40-50% of it (NN on 4 devices, limit 18, m=16, 10 s:
#: 4.0-4.9 s). A machine up to about 1.7x slower still ends every solve on its deterministic budget,
#: not on the wall clock, and gives the same schedule; two busy processes on the same two cores slow
#: it 1.3-2.3x, so ``tests/engine/test_tessel_exact.py::test_same_seed_same_schedule_under_load``
#: gives the search a ``wall_limit`` of three times its ``time_limit``.
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


@dataclass
class SearchBudget:
    """The time of one :func:`~engine.tessel.search.tessel_search` call, split among its phases.

    Made by :meth:`for_search`; the phases read their shares off it and record a wall-clock guard
    that ended one of them (:attr:`wall_guard_hit`). Seconds are wall-clock seconds
    (``time.perf_counter``) unless called nominal (the repetend phases' deterministic clock) or
    deterministic (CP-SAT's ``max_deterministic_time``).
    """

    time_limit: float
    """Seconds the phases' shares are of (``tessel_search``'s ``time_limit``); also the wall-clock
    limit of the whole search unless :attr:`wall_limit` is longer."""

    t_start: float
    """``time.perf_counter()`` when the search started."""

    finish_s: float
    """Seconds kept at the end to build, simulate and validate the schedule (and the fallback
    policies): blocks x ``m`` / :data:`FINISH_INSTANCES_PER_S` (+ / :data:`FALLBACK_INSTANCES_PER_S`)."""

    deadline: float
    """``time.perf_counter()`` value the phases before the finish stop at, ``t_start + time_limit -
    finish_s``: the wall-clock guard of every solve and phase."""

    clock: Clock
    """The repetend phases' nominal clock (deterministic): ``nominal_share x (time_limit - finish_s)``
    nominal seconds, the solver calls and whether a solve ended on the wall clock."""

    nominal_share: float = NOMINAL_SHARE
    """Share of ``time_limit - finish_s`` the repetend phases may use in nominal seconds."""

    bound_share: float = 0.05
    """Share of ``time_limit`` the memory-aware bounds may take at least (the rate bound, Little's
    law on memory for one micro-batch; the makespan lower bound for ``m``): their terms grow
    quadratically with the blocks."""

    bound_left_share: float = 0.1
    """Share of the wall time left before :attr:`deadline` the makespan lower bound may take, where
    that is more than :attr:`bound_share` of ``time_limit``."""

    seed_share: float = SEED_SHARE
    """Share of ``time_limit`` the seed phase's policy probe may take (estimated from its size,
    :data:`SEED_INSTANCES_PER_S`): it is skipped where it would not fit."""

    step_share: float = STEP_SHARE
    """Share of ``time_limit`` (nominal seconds) one bisection solve of the period search may take."""

    defer_share: float = 0.08
    """Share of ``time_limit`` (wall seconds, at least :attr:`defer_min_s`, never past
    :attr:`deadline`) the sink deferral may take."""

    defer_min_s: float = 0.3
    """Wall seconds the sink deferral may take at least (within :attr:`deadline`)."""

    completion_share: float = COMPLETION_SHARE
    """Share of ``time_limit`` the completion (the compacted warmup and cooldown) gets, on a
    deterministic budget of :attr:`completion_det_per_s` per second of it."""

    completion_det_per_s: float = COMPLETION_DET_PER_S
    """CP-SAT deterministic seconds the completion may spend per second of its share."""

    improve_share: float = IMPROVE_SHARE
    """Share of ``time_limit`` the large-neighbourhood search on the whole schedule gets (plus the
    nominal seconds the repetend phases left unused), on :attr:`improve_det_per_s` deterministic
    seconds per second."""

    improve_det_per_s: float = IMPROVE_DET_PER_S
    """CP-SAT deterministic seconds the improvement may spend per second of its budget."""

    improve_min_s: float = IMPROVE_MIN_S
    """Wall seconds the improvement needs at least (beyond building its models) to run at all."""

    wall_limit: float | None = None
    """Wall-clock seconds for the whole search, every phase included; ``None``: :attr:`time_limit`.
    Longer than :attr:`time_limit`, it leaves a loaded or slower machine room to end every phase
    on its deterministic budget (the same schedule as an idle machine gives)."""

    wall_guard_factor: float = WALL_GUARD_FACTOR
    """A solve's wall-clock guard is this many times its budget (never past :attr:`deadline`)."""

    wall_guard_hit: bool = False
    """A solve or phase ended on the wall-clock guard rather than on its deterministic budget: the
    result may then differ between runs with the same seed."""

    @classmethod
    def for_search(cls, placement: Placement, m: int, time_limit: float, *, fallback_baselines: bool,
                   wall_limit: float | None = None) -> SearchBudget:
        """The budget of a search of ``m`` micro-batches of ``placement`` starting now: phases on
        their shares of ``time_limit`` seconds, guarded by a wall clock of ``wall_limit`` seconds
        (``None``: ``time_limit``).

        Raises:
            TesselError: building and checking the schedule alone would take longer than
                ``time_limit`` (the message gives the least limit that would do).
        """
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
        deadline = t_start + (wall_limit or time_limit) - finish_s
        return cls(time_limit=time_limit, t_start=t_start, finish_s=finish_s, deadline=deadline,
                   clock=Clock(total_s=NOMINAL_SHARE * (time_limit - finish_s), deadline=deadline),
                   wall_limit=wall_limit)

    @property
    def wall_scale(self) -> float:
        """:attr:`wall_limit` / :attr:`time_limit` (1 without a :attr:`wall_limit`): the wall-clock
        deadlines of the bounds and the deferral stretch by it."""
        return (self.wall_limit or self.time_limit) / self.time_limit

    # ---- wall clock
    def wall_left(self) -> float:
        """Wall seconds left before :attr:`deadline` (negative once past it)."""
        return self.deadline - time.perf_counter()

    def note_deadline(self, deadline: float) -> None:
        """Record a wall-clock ``deadline`` (a ``time.perf_counter()`` value) that a phase was given
        and may have been cut by: if it has passed, :attr:`wall_guard_hit` is set (a bound or a
        deferral cut short by the clock may differ between runs)."""
        if time.perf_counter() >= deadline:
            self.wall_guard_hit = True

    def rate_bound_deadline(self) -> float:
        """``time.perf_counter()`` value the rate bound (one micro-batch) must be done by."""
        return time.perf_counter() + self.bound_share * self.time_limit * self.wall_scale

    def makespan_bound_deadline(self) -> float:
        """``time.perf_counter()`` value the makespan lower bound for ``m`` must be done by."""
        return time.perf_counter() + max(self.bound_share * self.time_limit * self.wall_scale,
                                         self.bound_left_share * (self.deadline - time.perf_counter()))

    def defer_deadline(self) -> float:
        """``time.perf_counter()`` value the sink deferral must be done by."""
        share_s = self.defer_share * self.time_limit * self.wall_scale
        return min(self.deadline, time.perf_counter() + max(self.defer_min_s, share_s))

    # ---- shares
    def seed_fits(self, cost_s: float) -> bool:
        """The seed phase's estimated ``cost_s`` seconds fit its share."""
        return cost_s <= self.seed_share * self.time_limit

    @property
    def step_cap_s(self) -> float:
        """Nominal seconds one bisection solve of the period search may take."""
        return self.step_share * self.time_limit

    @property
    def completion_cap_s(self) -> float:
        """The completion's share of ``time_limit`` (seconds)."""
        return self.completion_share * self.time_limit

    def nominal_left_s(self) -> float:
        """Nominal seconds the repetend phases left unused (0 when they timed out)."""
        return max(0.0, self.clock.left_s()) if not self.clock.timed_out else 0.0

    def improve_nominal_s(self) -> float:
        """The improvement's seconds: its share of ``time_limit`` plus :meth:`nominal_left_s`."""
        return self.improve_share * self.time_limit + self.nominal_left_s()
