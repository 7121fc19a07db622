"""The error raised for a malformed GNN model, layer or graph (issue 19)."""

from __future__ import annotations

from engine.errors import TesselError


class GNNError(TesselError, ValueError):
    """A GNN config, layer argument or graph is malformed; ``str(err)`` is one sentence naming the fix."""
