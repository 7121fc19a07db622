"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# profile caches of tests never touch the user's cache
os.environ.setdefault("TESSEL_CACHE_DIR", str(ROOT / ".cache" / "test-profile"))
