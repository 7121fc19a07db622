"""CrossoverScheduler: co-located data-parallel jobs that fill each other's communication.

Several data-parallel plans share the same Ray actors (one per device). While one job
synchronises its gradients (all-reduce after backward) another computes, through a per-device
compute token passed between the jobs at their synchronisation points
(``../shared/TECHNIQUES.md``). Each job keeps its own process group, optimizer, data stream and
checkpoints; only timing changes.

- :mod:`runtime.crossover.token`: :class:`ComputeToken` (fair FIFO token, recorded intervals).
- :mod:`runtime.crossover.actor`: :class:`CrossoverActor` (one device, one StageWorker per job).
- :mod:`runtime.crossover.launcher`: :func:`launch_crossover` (modes ``"crossover"``,
  ``"uncoordinated"``, ``"sequential"``) and its :class:`CrossoverResult`.

The launcher's names are loaded lazily (importing the token does not import Ray).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.crossover.token import (
    ComputeToken,
    TokenError,
    TokenInterval,
    overlapping_intervals,
)

__all__ = [
    "MODES",
    "ComputeToken",
    "CrossoverError",
    "CrossoverJobResult",
    "CrossoverResult",
    "TokenError",
    "TokenInterval",
    "launch_crossover",
    "overlapping_intervals",
]

_LAZY = {"launch_crossover", "CrossoverResult", "CrossoverJobResult", "CrossoverError", "MODES"}

if TYPE_CHECKING:  # pragma: no cover
    from runtime.crossover.launcher import (
        MODES,
        CrossoverError,
        CrossoverJobResult,
        CrossoverResult,
        launch_crossover,
    )


def __getattr__(name: str):
    if name in _LAZY:
        from runtime.crossover import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module 'runtime.crossover' has no attribute {name!r}")
