"""Errors of stage construction: a plan the runtime does not execute, a model it cannot cut."""

from __future__ import annotations

from engine.errors import TesselError

__all__ = ["RuntimeNotSupported", "StageSplitError"]


class RuntimeNotSupported(TesselError, NotImplementedError):
    """The plan uses something the runtime does not execute (multi-device blocks, non-chain
    placements, tensor parallelism on a model without the layer split, a CoCoNet transformation
    it does not run); the message says what in one sentence (:mod:`runtime.stages.checks`)."""


class StageSplitError(TesselError, RuntimeError):
    """The model cannot be cut into the plan's stages; the message (one sentence) names the layer
    (module path and class) that failed and what to do."""
