"""A stage worker's instrumentation: process RSS, saved-activation accounting, per-step memory
curves and MoE routing metrics (``docs/runtime-worker.md``, "Instrumentation")."""

from __future__ import annotations

import math
import os
from typing import Any

import psutil
import torch

from runtime.host_memory import peak_rss, reset_peak_rss

__all__ = ["ActivationMeter", "MemorySampler", "mean_metrics", "metric_floats", "rss"]

_PROC: Any = None
_STATM: tuple[int, int] | None = None   # (pid, fd of /proc/<pid>/statm)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss() -> int:
    """Resident set size of this process in bytes, 0 if unavailable.

    Sampled after every instruction, so it must be cheap: on Linux one ``pread`` of
    ``/proc/self/statm`` (about 2 us; the second field is resident pages, proc(5)), else psutil
    (about 13 us).
    """
    global _PROC, _STATM
    pid = os.getpid()
    try:
        if _STATM is None or _STATM[0] != pid:
            _STATM = (pid, os.open(f"/proc/{pid}/statm", os.O_RDONLY))
        return int(os.pread(_STATM[1], 128, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError, AttributeError):   # no /proc (macOS) or no os.pread
        pass
    try:
        if _PROC is None or _PROC.pid != pid:
            _PROC = psutil.Process(pid)
        return int(_PROC.memory_info().rss)
    except Exception:  # pragma: no cover - psutil is a dependency
        return 0


class ActivationMeter:
    """Bytes of distinct non-parameter storages saved for backward, per (segment, micro-batch).

    Counting runs a Python hook per saved tensor, which costs a few per cent of a CPU step, so
    only the first forward of each segment in a step is counted (:attr:`per_segment`): the
    shapes are static (the plan's), so every micro-batch of a segment saves the same bytes
    within a step (an MoE gate changes its capacity only between steps).

    Args:
        static_ptrs: ``data_ptr`` of storages never counted (parameters, receive buffers).
            Parameters and their views are never counted either, wherever they live (FSDP's gathered
            parameters are allocated during the step; the plan counts them with its ``UNSHARD`` s).
    """

    def __init__(self, static_ptrs: set[int]):
        self.static = static_ptrs
        self.live = 0
        self.held: dict[tuple[int, int], int] = {}
        self.per_segment: dict[int, int] = {}
        self._seen: dict[int, int] = {}

    def reset(self) -> None:
        """Start a step: nothing held, every segment counted afresh."""
        self.live, self.held, self.per_segment = 0, {}, {}

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """A ``saved_tensors_hooks`` context recording the storages saved inside it."""
        seen: dict[int, int] = {}
        self._seen = seen

        def pack(t: torch.Tensor) -> torch.Tensor:
            try:
                if isinstance(t if t._base is None else t._base, torch.nn.Parameter):
                    return t   # a parameter (FSDP's gathered one, allocated after set-up), or a view of one
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr and ptr not in self.static and ptr not in seen:
                    seen[ptr] = st.nbytes()
            except Exception:
                pass
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def add(self, key: tuple[int, int], *, nbytes: int | None = None, segment: int | None = None) -> None:
        """Hold ``nbytes`` (default: what the last :meth:`hooks` context saw) for ``key``;
        with ``segment``, remember them as that segment's bytes per micro-batch this step."""
        n = sum(self._seen.values()) if nbytes is None else int(nbytes)
        self.held[key] = n
        self.live += n
        if segment is not None:
            self.per_segment[segment] = n

    def free(self, key: tuple[int, int]) -> None:
        """Release what :meth:`add` held for ``key`` (nothing if it held nothing)."""
        self.live -= self.held.pop(key, 0)


class MemorySampler:
    """A step's memory curves, ``[[t, bytes], ...]`` with ``t`` in seconds from the step start:
    process RSS, live saved activations, CUDA ``memory_allocated`` (``device`` given), and the
    peak bytes of parameter gradients."""

    def __init__(self, meter: ActivationMeter, device: torch.device | None):
        self.meter = meter
        self.device = device
        self._hwm = reset_peak_rss()   # the step's own peak, transients inside an instruction included
        self.mem: list[list[float]] = [[0.0, rss()]]
        self.act: list[list[float]] = [[0.0, 0]]
        self.dev: list[list[float]] | None = (
            [[0.0, torch.cuda.memory_allocated(device)]] if device is not None else None)
        self.grad_peak = 0

    def sample(self, t: float) -> None:
        """Sample every curve at step time ``t`` (after an instruction)."""
        self.mem.append([t, rss()])
        self.act.append([t, self.meter.live])
        if self.dev is not None:
            self.dev.append([t, torch.cuda.memory_allocated(self.device)])

    def sample_grads(self, nbytes: int) -> None:
        """Note ``nbytes`` of parameter gradients held now."""
        self.grad_peak = max(self.grad_peak, nbytes)

    def result(self) -> dict:
        """The step result's memory keys (``docs/runtime-worker.md``, "Instrumentation")."""
        peak = int(max(v for _, v in self.mem))
        if self._hwm:
            try:
                peak = max(peak, peak_rss())
            except OSError:
                pass
        out: dict[str, Any] = {
            "peak_memory": peak, "memory": self.mem,
            "activation_memory": self.act, "peak_activation_memory": int(max(v for _, v in self.act)),
            "peak_grad_memory": int(self.grad_peak),
        }
        if self.dev is not None:   # CUDA: the caching allocator's live tensor bytes on this rank's GPU
            out["device_memory"] = self.dev
            out["peak_device_memory"] = int(max(v for _, v in self.dev))
        return out


_METRIC_KEYS = ("temperature", "experts_per_token", "load_cv", "dropped_fraction", "balance_loss")


def metric_floats(metrics: dict) -> dict:
    """One MoE layer's ``last_metrics`` (detached tensors) as floats; ``load`` as a list."""
    out: dict[str, Any] = {k: float(metrics[k]) for k in _METRIC_KEYS if k in metrics}
    if "load" in metrics:
        out["load"] = [float(v) for v in metrics["load"]]
    return out


def mean_metrics(items: list[dict]) -> dict:
    """Mean over layers and micro-batches of :func:`metric_floats` dicts; ``temperature`` only
    where finite (DTS-Gate), ``count`` = items averaged (for weighted means across ranks)."""
    out: dict[str, Any] = {"count": len(items)}
    for k in _METRIC_KEYS:
        vals = [d[k] for d in items if k in d and math.isfinite(d[k])]
        if vals:
            out[k] = sum(vals) / len(vals)
    loads = [d["load"] for d in items if "load" in d]
    if loads and all(len(x) == len(loads[0]) for x in loads):
        out["load"] = [sum(col) / len(loads) for col in zip(*loads)]
    return out
