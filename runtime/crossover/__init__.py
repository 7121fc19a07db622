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
(:mod:`runtime.runner`, also a ``LaunchError``). The launcher's names, ``CrossoverConfig`` and
``CrossoverLaunchError`` are loaded lazily (importing the token imports neither Ray nor torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from engine.crossover import MODES
from engine.errors import CrossoverError
from runtime.crossover.token import (
    ComputeToken,
    TokenError,
    TokenInterval,
    overlapping_intervals,
)

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

#: Lazily loaded names and their modules (``runtime.config`` imports ``runtime.worker``, i.e. torch).
_LAZY = {
    "launch_crossover": "runtime.crossover.launcher",
    "CrossoverResult": "runtime.crossover.result",
    "CrossoverJobResult": "runtime.crossover.result",
    "CrossoverConfig": "runtime.config",
    "CrossoverLaunchError": "runtime.runner",
}

if TYPE_CHECKING:  # pragma: no cover
    from runtime.config import CrossoverConfig
    from runtime.crossover.launcher import launch_crossover
    from runtime.crossover.result import CrossoverJobResult, CrossoverResult
    from runtime.runner import CrossoverLaunchError


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'runtime.crossover' has no attribute {name!r}")
