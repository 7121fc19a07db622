"""Blocks and schedules: a schedule is a per-device ORDER of blocks for all micro-batches.

See ``docs/ARCHITECTURE.md``: start times are derived by the simulator, never stored here.
"""

from engine.schedule.block import Block, parse_action
from engine.schedule.schedule import Schedule
from engine.schedule.validate import gradient_events, memory_profile, peak_memory, validate

__all__ = ["Block", "parse_action", "Schedule", "validate", "peak_memory", "memory_profile", "gradient_events"]
