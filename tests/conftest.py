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


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray cluster (dashboard off) for the tests of one module, shut down after them.

    Skips the test where Ray is not installed. Yields the ``ray`` module.
    """
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(include_dashboard=False, logging_level="WARNING")
    yield ray
    if ray.is_initialized():
        ray.shutdown()
