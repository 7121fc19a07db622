"""Plan I/O: plan and placement JSON (their envelope is :mod:`engine.envelope`), Chrome/Perfetto
traces, torch pipelining CSV."""

from engine.io.atomic import atomic_write_text
from engine.io.placement_json import (
    PLACEMENT_FORMAT,
    PLACEMENT_VERSION,
    load_placement,
    placement_from_dict,
    placement_to_dict,
    save_placement,
)
from engine.io.plan import PLAN_FORMAT, PLAN_VERSION, Plan, load_plan, save_plan
from engine.io.torch_csv import read_torch_csv, read_torch_csv_text, schedule_to_csv_text, write_torch_csv
from engine.io.trace import timeline_to_trace, write_trace

__all__ = [
    "atomic_write_text", "Plan", "load_plan", "save_plan", "PLAN_FORMAT", "PLAN_VERSION",
    "PLACEMENT_FORMAT", "PLACEMENT_VERSION", "placement_to_dict", "placement_from_dict", "load_placement",
    "save_placement", "timeline_to_trace", "write_trace", "read_torch_csv", "read_torch_csv_text",
    "schedule_to_csv_text", "write_torch_csv",
]
