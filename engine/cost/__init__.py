"""Cost model: device/link tables, roofline op times, alpha-beta communication, a
:class:`CostModel` for whole clusters, and an op profiler with a per-hardware JSON cache.

Units: seconds, bytes, FLOP/s (see ``docs/ARCHITECTURE.md``). Its error, :class:`~engine.errors.CostModelError`,
lives in :mod:`engine.errors`.
"""

from engine.cost.comm import COLLECTIVES, collective_time, p2p_time
from engine.cost.devices import (
    DEVICES,
    LINKS,
    DeviceSpec,
    LinkSpec,
    canonical_dtype,
    emulated_link,
    get_device,
    get_link,
    parse_link,
    parse_rate,
)
from engine.cost.model import CostModel
from engine.cost.profiler import ProfileTable, device_key, profile_ops, signature
from engine.cost.roofline import op_time, ridge_intensity

__all__ = [
    "COLLECTIVES", "DEVICES", "LINKS", "CostModel", "DeviceSpec", "LinkSpec",
    "ProfileTable", "canonical_dtype", "collective_time", "device_key", "emulated_link", "get_device", "get_link",
    "op_time", "p2p_time", "parse_link", "parse_rate", "profile_ops", "ridge_intensity", "signature",
]
