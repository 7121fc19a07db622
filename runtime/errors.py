"""Errors of the stage worker (kept apart so the worker's helper modules can raise them)."""

from __future__ import annotations

from engine.errors import TesselError

__all__ = ["WorkerError"]


class WorkerError(TesselError):
    """A worker was used wrongly (not set up, a batch of the wrong shape, a bad world size)."""
