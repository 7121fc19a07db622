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
    from runtime.cluster import init_ray

    init_ray()   # a local cluster of its own (never the one Ray's address file names); kept if running
    yield ray
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def _no_ray_across_modules():
    """Every test module starts without a Ray connection and leaves none behind: a module that
    initialised Ray and did not shut it down has it shut down here. Under pytest-xdist a worker
    runs whichever modules it is given, in any order, so a module reusing another's cluster (one
    that may have been stopped or broken by that module's fault tests) would depend on the order."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def code_graph_cache() -> Path:
    """The cache folder of the CPython code graph (``tasks.graphs.cpython_code_graph``), shared by every
    process of the run: the test workers and the notebooks' kernels (``$TESSEL_CACHE_DIR``). The first
    process to ask builds the graph (about 20 s on two cores) under a file lock; the others wait for it
    and load the verified cache file (0.1 s) instead of building it again."""
    from filelock import FileLock

    from tasks.graphs import cpython_code_graph

    folder = Path(os.environ["TESSEL_CACHE_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder / "code-graph.lock")):
        cpython_code_graph(cache_dir=folder)
    return folder
