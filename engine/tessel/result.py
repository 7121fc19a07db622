"""The outcome of a Tessel search: the schedule, its repetend, the bounds and the search's times."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.schedule import Schedule
from engine.tessel.repetend import Repetend

__all__ = ["SearchResult"]


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
        """The result's numbers as a flat dict (the searched plan's ``metrics``)."""
        return {
            "period": self.period, "period_lower_bound": self.period_lower_bound, "period_gap": self.period_gap,
            "makespan_lower_bound": self.makespan_lower_bound, "critical_path": self.critical_path,
            "in_flight": self.repetend.in_flight, "optimal": self.optimal,
            "optimal_at_resolution": self.optimal_at_resolution, "rounded": self.rounded,
            "search_time": self.search_time, "completion_time": self.completion_time, "total_time": self.total_time,
            "steps": self.steps, "timed_out": self.timed_out, "wall_guard_hit": self.wall_guard_hit,
            "resolution": self.resolution, "search_makespan": self.makespan, "solver_makespan": self.solver_makespan,
        }
