"""Process (host) memory on Linux: the resettable peak resident set and glibc's heap.

What a CPU rank's memory is measured with (``docs/runtime-worker.md``, "Instrumentation") and what
:mod:`runtime.gnn.memory` measures a function's peak with:

- :func:`reset_peak_rss` / :func:`peak_rss`: the high-water mark of the resident set, reset to the
  current size (``/proc/self/clear_refs`` ``5``) and read back from ``VmHWM`` in
  ``/proc/self/status`` (proc(5)). Unlike sampling, it sees a transient peak inside one call (a
  backward's temporaries).
- :func:`trim_heap`: ``malloc_trim(0)``, glibc's return of freed heap pages to the system, so the
  resident size after a set-up that built and dropped large objects (a whole model traced before
  its stages were cut out) reflects what is still alive.
- :func:`fix_mmap_threshold`: ``mallopt(M_MMAP_THRESHOLD, n)``: blocks above ``n`` bytes are mapped
  and unmapped on their own, so freed large tensors do not stay resident in the heap.

All are no-ops returning ``False`` / raising ``OSError`` where the platform lacks them (not
Linux, not glibc). Source: proc(5), mallopt(3), malloc_trim(3).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["MMAP_THRESHOLD", "fix_mmap_threshold", "peak_rss", "reset_peak_rss", "trim_heap"]

#: bytes: the mmap threshold a CPU rank fixes. glibc's default threshold rises to the size of each
#: large block freed (up to 32 MiB), after which such blocks come from the heap and stay resident
#: once freed; fixed, every block above it is returned to the system when freed, so the resident
#: set follows the live tensors (and the plan's memory model)
MMAP_THRESHOLD = 2 * 2**20

#: glibc ``mallopt`` parameter number of ``M_MMAP_THRESHOLD`` (malloc.h)
_M_MMAP_THRESHOLD = -3


def _libc():
    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def fix_mmap_threshold(nbytes: int) -> bool:
    """``mallopt(M_MMAP_THRESHOLD, nbytes)`` in this process (glibc only); ``False`` where unavailable."""
    libc = _libc()
    try:
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes))) if libc is not None else False
    except AttributeError:
        return False


def trim_heap() -> bool:
    """``malloc_trim(0)``: return the heap's free pages to the system (glibc only); ``False`` where
    unavailable or nothing was released."""
    libc = _libc()
    try:
        return bool(libc.malloc_trim(0)) if libc is not None else False
    except AttributeError:
        return False


def reset_peak_rss() -> bool:
    """Reset the resident set's high-water mark to its current size (Linux ``clear_refs`` 5);
    ``False`` if unavailable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """The resident set's high-water mark (bytes, ``VmHWM``) since the process started or
    :func:`reset_peak_rss`.

    Raises:
        OSError: no ``/proc/self/status`` or no ``VmHWM`` line in it (not Linux).
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmHWM not in /proc/self/status")
