"""Tessel: automatic repetend-based schedule search for any placement (HPCA 2024).

``tessel_search(placement, m, memory_limit=...)`` -> :class:`SearchResult` with an ordinary
:class:`~engine.schedule.Schedule`.
"""

from engine.errors import InfeasibleMemoryError, SearchCancelled
from engine.tessel.bounds import critical_path, makespan_lower_bound, memory_floor, period_lower_bound
from engine.tessel.control import SearchControl, SearchProgress
from engine.tessel.exact import ExactResult, exact_schedule
from engine.tessel.improve import ImproveResult, improve_schedule
from engine.tessel.repetend import Repetend
from engine.tessel.result import SearchResult
from engine.tessel.search import tessel_search

__all__ = [
    "tessel_search", "SearchResult", "SearchProgress", "SearchControl", "SearchCancelled", "InfeasibleMemoryError",
    "Repetend", "period_lower_bound", "critical_path", "makespan_lower_bound", "memory_floor",
    "exact_schedule", "ExactResult", "improve_schedule", "ImproveResult",
]
