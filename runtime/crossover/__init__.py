"""CrossoverScheduler: co-located data-parallel jobs that fill each other's communication.

Several data-parallel plans share the same Ray actors (one per device). While one job
synchronises its gradients (all-reduce after backward) another computes, through a per-device
compute token passed between the jobs at their synchronisation points
(docs/ARCHITECTURE.md, Sources). Each job keeps its own process group, optimizer, data stream and
checkpoints; only timing changes.

- :mod:`runtime.crossover.token`: :class:`ComputeToken` (fair FIFO token, recorded intervals).
- :mod:`runtime.crossover.actor`: :class:`CrossoverActor` (one device, one StageWorker per job).
- :mod:`runtime.crossover.launcher`: :func:`launch_crossover` (modes ``"crossover"``,
  ``"uncoordinated"``, ``"sequential"``), configured by :class:`runtime.config.CrossoverConfig`.
- :mod:`runtime.crossover.result`: its :class:`CrossoverResult` / :class:`CrossoverJobResult`.

``MODES`` and ``CrossoverError`` are :mod:`engine.crossover`'s (one definition for planner and
runtime); a failed co-located launch raises its subclass ``CrossoverLaunchError``
(:mod:`runtime.runner`, also a ``LaunchError``). The launcher's names are loaded lazily
(importing the token does not import Ray).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.crossover import MODES, CrossoverError
from runtime.config import CrossoverConfig
from runtime.crossover.token import (
    ComputeToken,
    TokenError,
    TokenInterval,
    overlapping_intervals,
)
from runtime.runner import CrossoverLaunchError

__all__ = [
    "MODES",
    "ComputeToken",
    "CrossoverConfig",
    "CrossoverError",
    "CrossoverLaunchError",
    "CrossoverJobResult",
    "CrossoverResult",
    "TokenError",
    "TokenInterval",
    "launch_crossover",
    "overlapping_intervals",
]

_LAZY = {"launch_crossover", "CrossoverResult", "CrossoverJobResult"}

if TYPE_CHECKING:  # pragma: no cover
    from runtime.crossover.launcher import launch_crossover
    from runtime.crossover.result import CrossoverJobResult, CrossoverResult


def __getattr__(name: str):
    if name in _LAZY:
        from runtime.crossover import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module 'runtime.crossover' has no attribute {name!r}")
