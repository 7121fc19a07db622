"""Plan I/O: versioned plan JSON, Chrome/Perfetto traces, torch pipelining CSV."""

from engine.io.atomic import atomic_write_text
from engine.io.plan import PLAN_FORMAT, PLAN_VERSION, Plan, load_plan, save_plan
from engine.io.torch_csv import read_torch_csv, read_torch_csv_text, schedule_to_csv_text, write_torch_csv
from engine.io.trace import timeline_to_trace, write_trace

__all__ = [
    "atomic_write_text", "Plan", "load_plan", "save_plan", "PLAN_FORMAT", "PLAN_VERSION",
    "timeline_to_trace", "write_trace", "read_torch_csv", "read_torch_csv_text", "schedule_to_csv_text", "write_torch_csv",
]
