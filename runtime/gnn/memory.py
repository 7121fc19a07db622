"""The peak memory of running a function, measured in a fresh subprocess.

:func:`measure_peak_bytes` runs ``fn(*args)`` in a new Python process (``multiprocessing``'s
``spawn`` context, so nothing of the caller's heap is shared) and returns how far the process's
peak resident set grew while ``fn`` ran, over its baseline taken right before the call (after the
imports, the unpickling of ``args`` and the optional ``setup``). This is the number a memory
budget for chunk-streamed GNN execution (NGra, USENIX ATC'19, section 4) is checked against.

How the peak is read (CPU):

- On Linux the process's high-water mark is reset to its current resident size right before the
  call (``/proc/self/clear_refs`` ``5``, proc(5)) and read back after it from ``VmHWM`` in
  ``/proc/self/status``: the same counter ``getrusage(RUSAGE_SELF).ru_maxrss`` reports, but
  resettable. Plain ``ru_maxrss`` is not usable in a spawned child: at ``exec`` Linux folds the
  parent's high-water mark into the child's (``exec_mmap`` -> ``setmax_mm_hiwater_rss``), so a
  224 MB child of a 1.4 GB parent reports 1.4 GB (measured here), and any transient peak of the
  set-up would also hide the function's own.
- Elsewhere (no ``/proc``): ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` after the call minus the
  same before it (kB on Linux, bytes on macOS), which under-reports when the set-up peaked higher.

Allocator retention: glibc raises its mmap threshold each time a large block is freed, so later
blocks of that size come from the heap and stay resident after they are freed; the same streamed
run then measured anywhere between 195 and 232 MiB (three runs, GAT on 432k edges, P = 16). The
child therefore fixes the threshold first (``mallopt(M_MMAP_THRESHOLD, mmap_threshold)`` through
``ctypes``, default 2 MiB, ``None`` to leave glibc alone): blocks above it are returned to the
system when freed, and the peak follows the live tensors (the same run: 169 to 174 MiB). A lower
threshold is as stable but slower (128 KiB: ten times the run time, every block page-faulted).

CUDA (``device="cuda..."``): ``torch.cuda.max_memory_allocated`` after
``torch.cuda.reset_peak_memory_stats``, minus ``torch.cuda.memory_allocated`` before the call (the
caching allocator's live tensors, not the driver's reservation). Untested here (no GPU).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import resource
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

from engine.errors import TesselError
from runtime.host_memory import fix_mmap_threshold, peak_rss, reset_peak_rss

__all__ = ["MemoryMeasurementError", "PeakMemory", "measure_peak", "measure_peak_bytes"]

log = logging.getLogger(__name__)


class MemoryMeasurementError(TesselError, RuntimeError):
    """The measured function failed in its subprocess, or the subprocess died or timed out."""


@dataclass(frozen=True)
class PeakMemory:
    """One measurement.

    Attributes:
        peak_bytes: how far the peak grew over the baseline while the function ran (bytes).
        baseline_bytes: the resident size (CPU) or allocated bytes (CUDA) right before the call.
        seconds: the wall time of the call.
        method: ``"vmhwm"`` (Linux, resettable high-water mark), ``"ru_maxrss"`` or
            ``"cuda_max_memory_allocated"``.
    """

    peak_bytes: int
    baseline_bytes: int
    seconds: float
    method: str


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


#: the default fixed mmap threshold of the measuring child (bytes)
DEFAULT_MMAP_THRESHOLD = 2 * 2**20


def _ru_maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024


def _child(conn: Connection, fn: Callable[..., Any], setup: Callable[..., Any] | None,
           args: tuple[Any, ...], device: str, mmap_threshold: int | None) -> None:
    """Subprocess entry: set up, take the baseline, run ``fn``, send ``("ok", PeakMemory)`` or ``("error", str)``."""
    try:
        if mmap_threshold is not None and not fix_mmap_threshold(mmap_threshold):
            log.debug("could not fix the mmap threshold (not glibc?); measuring with the allocator's defaults")
        call_args = tuple(setup(*args)) if setup is not None else args
        gc.collect()
        if device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            fn(*call_args)
            torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated(device)
            result = PeakMemory(peak - base, base, seconds, "cuda_max_memory_allocated")
        elif reset_peak_rss():
            base = peak_rss()
            t0 = time.perf_counter()
            fn(*call_args)
            seconds = time.perf_counter() - t0
            result = PeakMemory(max(0, peak_rss() - base), base, seconds, "vmhwm")
        else:
            base = _ru_maxrss_bytes()
            t0 = time.perf_counter()
            fn(*call_args)
            seconds = time.perf_counter() - t0
            result = PeakMemory(max(0, _ru_maxrss_bytes() - base), base, seconds, "ru_maxrss")
        conn.send(("ok", result))
    except BaseException as err:  # noqa: BLE001 - every failure is reported to the parent as one sentence
        message = str(err).strip().rstrip(".") or "no message"
        conn.send(("error", f"{type(err).__name__}: {message}"))
    finally:
        conn.close()


def measure_peak(
    fn: Callable[..., Any],
    *args: Any,
    setup: Callable[..., Any] | None = None,
    device: str = "cpu",
    timeout_s: float = 600.0,
    mmap_threshold: int | None = DEFAULT_MMAP_THRESHOLD,
) -> PeakMemory:
    """Run ``fn(*setup(*args))`` (or ``fn(*args)``) in a fresh ``spawn`` subprocess and measure its peak.

    Args:
        fn: a picklable (module-level) function; its return value is discarded.
        *args: picklable arguments; they are unpickled in the child before the baseline.
        setup: optional picklable function run in the child before the baseline; its return value
            (a tuple) becomes ``fn``'s arguments. Use it to build the data there, so that loading
            is not counted, and to run a small warm-up call of the same kind: a process's first
            training step creates about 40 MiB of one-time state (autograd engine, thread pools,
            kernel caches; measured) that would otherwise be counted as ``fn``'s.
        device: ``"cpu"`` (peak resident set) or a CUDA device (peak allocated tensors).
        timeout_s: seconds to wait for the child (seconds).
        mmap_threshold: bytes; the child's fixed glibc mmap threshold (see the module docstring),
            ``None`` to keep glibc's dynamic one.

    Returns:
        :class:`PeakMemory` (bytes, seconds).

    Raises:
        MemoryMeasurementError: ``fn`` or ``setup`` raised in the child (one sentence with its
            type and message), the child died without reporting, or it ran past ``timeout_s``.
    """
    name = _name(fn)
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, setup, args, device, mmap_threshold), daemon=True)
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout_s):
            proc.kill()
            proc.join(5)
            raise MemoryMeasurementError(
                f"measuring the peak memory of {name} timed out after {timeout_s} s; "
                f"give it more time or a smaller input."
            )
        status, payload = recv.recv()
    except EOFError:
        proc.join(5)
        raise MemoryMeasurementError(
            f"the subprocess measuring the peak memory of {name} exited with code {proc.exitcode} before reporting "
            f"(killed for memory or crashed)."
        ) from None
    finally:
        recv.close()
    proc.join(30)
    if status != "ok":
        raise MemoryMeasurementError(f"measuring the peak memory of {name} failed in its subprocess with {payload}.")
    assert isinstance(payload, PeakMemory)
    log.debug("peak of %s: %d bytes over a %d-byte baseline (%s)", name, payload.peak_bytes,
              payload.baseline_bytes, payload.method)
    return payload


def measure_peak_bytes(
    fn: Callable[..., Any],
    *args: Any,
    setup: Callable[..., Any] | None = None,
    device: str = "cpu",
    timeout_s: float = 600.0,
    mmap_threshold: int | None = DEFAULT_MMAP_THRESHOLD,
) -> int:
    """The peak memory (bytes) of ``fn(*args)`` over its subprocess's baseline; see :func:`measure_peak`.

    Raises:
        MemoryMeasurementError: as :func:`measure_peak`.
    """
    return measure_peak(fn, *args, setup=setup, device=device, timeout_s=timeout_s,
                        mmap_threshold=mmap_threshold).peak_bytes
