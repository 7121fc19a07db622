"""Execution of plans on Ray-managed actors (imports engine, torch, ray; never panel/bokeh).

``from runtime import launch`` trains a plan on one stage-worker actor per rank
(:mod:`runtime.launcher`); :mod:`runtime.cluster` holds the Ray plumbing and
:mod:`runtime.checkpoint` the atomic checkpoints. The names are loaded lazily, so importing a
submodule such as ``runtime.data`` does not import Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["launch", "LaunchResult", "LaunchError"]

if TYPE_CHECKING:  # pragma: no cover
    from runtime.launcher import LaunchError, LaunchResult, launch


def __getattr__(name: str):
    if name in __all__:
        from runtime import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
