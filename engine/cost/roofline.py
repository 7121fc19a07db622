"""Roofline time of one operator.

An op is bound either by compute or by memory traffic (Williams, Waterman, Patterson,
"Roofline: an insightful visual performance model for multicore architectures", CACM 2009):

    time = max(flops / (peak(dtype) * flop_efficiency), bytes / (mem_bandwidth * bw_efficiency))
           + launch_overhead

The ridge point, where both terms are equal, is at an arithmetic intensity (FLOP/byte) of
``ridge_intensity(device, dtype)``; below it the op is memory-bound, above it compute-bound.
"""

from __future__ import annotations

from engine.cost.devices import DeviceSpec
from engine.errors import CostModelError


def compute_time(flops: float, device: DeviceSpec, dtype: str) -> float:
    """Seconds to execute ``flops`` FLOPs at the device's effective peak for ``dtype``.

    Raises:
        CostModelError (a ValueError): unknown dtype for this device.
    """
    return float(flops) / (device.peak(dtype) * device.flop_efficiency)


def memory_time(bytes_moved: float, device: DeviceSpec) -> float:
    """Seconds to move ``bytes_moved`` bytes at the device's effective memory bandwidth."""
    return float(bytes_moved) / (device.mem_bandwidth * device.bw_efficiency)


def ridge_intensity(device: DeviceSpec, dtype: str) -> float:
    """Arithmetic intensity (FLOP/byte) at which an op turns from memory- to compute-bound."""
    return (device.peak(dtype) * device.flop_efficiency) / (device.mem_bandwidth * device.bw_efficiency)


def op_time(flops: float, bytes_moved: float, device: DeviceSpec, dtype: str = "float32",
            launch_overhead: float | None = None) -> float:
    """Roofline time of one op, seconds.

    Args:
        flops: floating-point operations (FLOP).
        bytes_moved: bytes read plus written in device memory.
        device: the device it runs on.
        dtype: compute dtype (aliases like ``"bf16"`` or ``"torch.float32"`` accepted).
        launch_overhead: fixed per-op seconds; ``None`` uses ``device.launch_overhead``.

    Returns:
        ``max(compute_time, memory_time) + launch_overhead`` in seconds.

    Raises:
        CostModelError (a ValueError): negative ``flops``/``bytes_moved`` or unknown dtype.
    """
    if flops < 0 or bytes_moved < 0:
        raise CostModelError(f"flops and bytes_moved must be >= 0, got flops={flops}, bytes_moved={bytes_moved}")
    overhead = device.launch_overhead if launch_overhead is None else launch_overhead
    return max(compute_time(flops, device, dtype), memory_time(bytes_moved, device)) + overhead
