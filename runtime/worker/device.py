"""A stage worker's device: resolving backend/device/matching options, and moving tensors
between devices (CPU checkpoints, CUDA stages). Design: ``docs/runtime-worker.md`` ("Backends and
point-to-point matching").

Source: ``torch.nn.Module.to`` / ``Module._apply`` semantics (buffers are replaced, not moved in
place), https://pytorch.org/docs/stable/generated/torch.nn.Module.html.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from runtime.stages import RuntimeNotSupported
from runtime.worker.config import P2P_MATCHING
from runtime.worker.errors import WorkerError

__all__ = ["ResolvedDevice", "cpu_copy", "module_to", "resolve_device"]


@dataclass(frozen=True)
class ResolvedDevice:
    """What :func:`resolve_device` decided for one worker."""

    device: torch.device
    """The tensors' device (with an index on CUDA)."""

    p2p_mode: str
    """``"tags"`` or ``"ordered"``."""

    sync: Callable[[], None] | None
    """``torch.cuda.synchronize`` of the device before stamping an instruction's end, or ``None``
    (nothing extra per instruction; always on CPU)."""


def resolve_device(backend: str, device_name: str, p2p_matching: str, sync_timing: bool | None) -> ResolvedDevice:
    """Check a worker's ``backend``/``device``/``p2p_matching``/``sync_timing`` options.

    ``p2p_matching="auto"`` reads the environment variable ``TESSEL_P2P`` (``tags``/``ordered``),
    else picks ``"ordered"`` with nccl and ``"tags"`` with gloo; ``"cuda"`` picks GPU ``LOCAL_RANK``.

    Raises:
        RuntimeNotSupported: a backend other than gloo and nccl.
        WorkerError: an unknown device or matching mode, nccl without CUDA, gloo with CUDA,
            tags with nccl, no usable GPU.
    """
    if backend not in ("gloo", "nccl"):
        raise RuntimeNotSupported(f"backend {backend!r}: the stage worker runs 'gloo' (CPU tensors) or "
                                  "'nccl' (CUDA tensors)")
    name = str(device_name)
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError, ValueError) as e:
        raise WorkerError(f"unknown device {name!r}; use 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type not in ("cpu", "cuda"):
        raise WorkerError(f"device {name!r}: the stage worker runs on 'cpu' (gloo) or 'cuda' (nccl)")
    if backend == "nccl" and dev.type != "cuda":
        raise WorkerError(f"backend 'nccl' moves CUDA tensors only, but device is {name!r}; use device 'cuda' "
                          "(or backend 'gloo' on CPU)")
    if backend == "gloo" and dev.type != "cpu":
        raise WorkerError(f"backend 'gloo' with device {name!r}: gloo's point-to-point needs CPU tensors; "
                          "use backend 'nccl' for CUDA")
    mode = p2p_matching
    if mode == "auto":
        env = os.environ.get("TESSEL_P2P", "").strip()
        if env and env not in ("tags", "ordered"):
            raise WorkerError(f"TESSEL_P2P={env!r}: use 'tags' or 'ordered' (or unset it)")
        mode = env or ("ordered" if backend == "nccl" else "tags")
    if mode not in ("tags", "ordered"):
        raise WorkerError(f"unknown p2p_matching {mode!r}; use one of {', '.join(map(repr, P2P_MATCHING))}")
    if mode == "tags" and backend == "nccl":
        raise WorkerError("p2p_matching 'tags' needs gloo: NCCL ignores tags and matches sends and receives by "
                          "their posting order; use 'ordered' (or 'auto')")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        idx = dev.index if dev.index is not None else int(os.environ.get("LOCAL_RANK", "0") or 0)
        if not 0 <= idx < n:
            raise WorkerError(f"device {name!r} needs GPU {idx}, but this process sees {n} CUDA device(s) "
                              f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
                              f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use device 'cpu' "
                              "with backend 'gloo'")
        dev = torch.device("cuda", idx)
    on = True if sync_timing is None else bool(sync_timing)
    sync: Callable[[], None] | None = None
    if dev.type == "cuda" and on:
        def sync(d: torch.device = dev) -> None:
            torch.cuda.synchronize(d)
    return ResolvedDevice(dev, mode, sync)


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy (a clone on CPU, a device-to-host copy on CUDA)."""
    t = t.detach()
    return t.clone() if t.device.type == "cpu" else t.to("cpu")


def module_to(module: torch.nn.Module, device: torch.device) -> None:
    """Move a stage module to ``device``, including its traced ``inner`` graph module.

    A :class:`runtime.stages.StageModule` registers ``inner``'s own parameters and buffers on
    itself too (names stay unprefixed), so ``module.to()`` alone would leave ``inner``'s buffer
    slots on the old device (``Module._apply`` replaces buffers by new tensors); this moves both
    and re-links the outer slots to ``inner``'s tensors, and moves plain tensor attributes (traced
    constants) as well, so no tensor of the stage stays behind.
    """
    inner = getattr(module, "inner", None)
    roots = [module]
    if isinstance(inner, torch.nn.Module):
        inner.to(device)
        roots.append(inner)
    module.to(device)
    if isinstance(inner, torch.nn.Module):
        for name, p in inner._parameters.items():
            if p is not None and name in module._parameters:
                module._parameters[name] = p
        for name, b in inner._buffers.items():
            if b is not None and name in module._buffers:
                module._buffers[name] = b
    for root in roots:
        for sub in root.modules():
            for k, v in list(vars(sub).items()):
                if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and v.device != device:
                    sub.__dict__[k] = v.to(device)
