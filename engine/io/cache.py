"""Where Tessel keeps its on-disk caches (measured op profiles, the CPython code graph)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """``$TESSEL_CACHE_DIR`` if set, else ``~/.cache/tessel`` (not created here)."""
    env = os.environ.get("TESSEL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tessel"
