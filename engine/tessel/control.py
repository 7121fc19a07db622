"""Watching and stopping a running Tessel search: progress reports, a tqdm bar, cancellation.

:func:`engine.tessel.search.tessel_search` takes a ``progress`` callback (a
:class:`SearchProgress` after every solver call), ``progress_bar=True`` (a tqdm bar with the best
period so far) and a :class:`SearchControl` to cancel it from another thread (e.g. a UI).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from tqdm.auto import tqdm

__all__ = ["ProgressReporter", "SearchControl", "SearchProgress"]


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
        """Stop the search: the running solve now, the phases after it before they start."""
        self._event.set()
        with self._lock:
            if self._solver is not None:
                self._solver.stop_search()

    @property
    def cancelled(self) -> bool:
        """``cancel()`` was called."""
        return self._event.is_set()

    def _attach(self, solver) -> None:
        """The solve now running (``None``: none), stopped at once if the search is cancelled."""
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


class ProgressReporter:
    """Hands every solve of the period search to the ``progress`` callback and a tqdm bar.

    Args:
        progress: called with a :class:`SearchProgress` after every solver call, or ``None``.
        progress_bar: show a tqdm bar (``tqdm.auto``) with the best period so far.
        lower_bound: the period lower bound (seconds) every report carries.
        t_start: ``time.perf_counter()`` when the search started (for ``elapsed``).
    """

    def __init__(self, progress: Callable[[SearchProgress], None] | None, progress_bar: bool, lower_bound: float,
                 t_start: float) -> None:
        self.progress = progress
        self.lower_bound = lower_bound
        self.t_start = t_start
        self.bar = tqdm(desc="tessel search", unit="solve", leave=False) if progress_bar else None

    def step(self, steps: int, period_tried: float, status: str, best_period: float) -> None:
        """One solve: ``steps`` solver calls so far, the period tried and its ``status``, the best
        period so far (seconds per micro-batch)."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(best=f"{best_period:.4g}", lb=f"{self.lower_bound:.4g}")
        if self.progress is not None:
            self.progress(SearchProgress(steps, period_tried, status, best_period, self.lower_bound,
                                         time.perf_counter() - self.t_start))

    def close(self) -> None:
        """Close the bar (the period search is over)."""
        if self.bar is not None:
            self.bar.close()
