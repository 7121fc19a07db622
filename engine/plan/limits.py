"""The one check of a per-device memory limit, shared by ``tessel plan``/``search``/``show``
(``apps.arg_types.memory_limit``), the app's Search tab and the planning functions."""

from __future__ import annotations

import math
from typing import Any

from engine.errors import TesselError

__all__ = ["MemoryLimitError", "check_memory_limit"]


class MemoryLimitError(TesselError, ValueError):
    """A memory limit that is not a finite number above 0 (a user error, exit status 2; also a
    ``ValueError``, as numbers refused by a parser are)."""


def check_memory_limit(value: Any, *, what: str = "the memory limit") -> float:
    """``value`` as a memory limit: a finite number above 0 (GiB, bytes or activation units: the
    caller's unit), from a number or its text.

    Raises:
        MemoryLimitError: anything else (0, negatives, NaN, infinity, not a number), in one sentence.
    """
    try:
        limit = float(value)
    except (TypeError, ValueError):
        raise MemoryLimitError(f"{what} must be a number, got {value!r}") from None
    if not (math.isfinite(limit) and limit > 0):
        raise MemoryLimitError(f"{what} must be a finite number above 0, got {value!r}")
    return limit
