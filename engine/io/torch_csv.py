"""torch.distributed.pipelining CSV (``compute_only`` format).

One row per pipeline rank, one action per cell: ``{stage}{F|B|I|W}{micro_batch}``, e.g.
``0F3``. This is what ``_PipelineScheduleRuntime._load_csv(path, format="compute_only")``
reads (torch/distributed/pipelining/schedules.py) and what torchtitan's
``pipeline_parallel_schedule_csv`` option takes.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from engine.errors import PlanFormatError
from engine.io.atomic import atomic_write_text
from engine.placement import Placement
from engine.schedule import Schedule, parse_action


def schedule_to_csv_text(schedule: Schedule) -> str:
    """The CSV text of a schedule.

    Raises:
        PlanFormatError: a block spans several devices, which torch pipelining cannot express
            (a stage belongs to exactly one rank).
    """
    for b in schedule.placement.blocks:
        if len(b.devices) != 1:
            raise PlanFormatError(
                f"block {b.segment}{b.kind} runs on devices {list(b.devices)}; torch pipelining CSV needs every "
                "stage on one rank, so export this schedule as plan JSON instead"
            )
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for row in schedule.to_actions():
        w.writerow(row)
    return buf.getvalue()


def write_torch_csv(schedule: Schedule, path: str | Path) -> Path:
    """Write :func:`schedule_to_csv_text` atomically to ``path``."""
    return atomic_write_text(path, schedule_to_csv_text(schedule))


def read_torch_csv(path: str | Path, placement: Placement, *, name: str = "imported") -> Schedule:
    """Read a torch pipelining CSV into a :class:`Schedule` over ``placement``.

    The micro-batch count is inferred as ``1 + max micro-batch index``. The result is not
    validated; call ``schedule.validate()``.

    Raises:
        PlanFormatError: the file is missing, has a malformed action (the message gives row
            and column), or has more rows than the placement has devices.
    """
    path = Path(path)
    if not path.is_file():
        raise PlanFormatError(f"{path}: no such CSV file")
    with open(path, newline="") as f:
        text = f.read()
    return read_torch_csv_text(text, placement, name=name, source=str(path))


def read_torch_csv_text(text: str, placement: Placement, *, name: str = "imported", source: str = "CSV") -> Schedule:
    """Parse the text of a torch pipelining CSV into a :class:`Schedule` over ``placement``.

    Same rules as :func:`read_torch_csv` (which reads a file and calls this); for text that did
    not come from a file, e.g. an upload in the planner UI. ``source`` prefixes error messages.
    The result is not validated; call ``schedule.validate()``.

    Raises:
        PlanFormatError: a malformed action (the message gives row and column), or a row count
            other than the placement's number of devices.
    """
    rows: list[list[str]] = []
    for row in csv.reader(io.StringIO(text, newline="")):
        rows.append([c.strip() for c in row if c.strip()])
    # a trailing blank line is not a rank
    while rows and not rows[-1] and len(rows) > placement.num_devices:
        rows.pop()
    if len(rows) != placement.num_devices:
        raise PlanFormatError(f"{source}: has {len(rows)} rows but the placement has {placement.num_devices} ranks; "
                              "one row per rank")
    orders = []
    for r, row in enumerate(rows):
        order = []
        for c, cell in enumerate(row):
            try:
                order.append(parse_action(cell))
            except PlanFormatError as e:
                raise PlanFormatError(f"{source}: row {r + 1}, column {c + 1}: {e}") from None
        orders.append(order)
    m = 1 + max((b.micro_batch for o in orders for b in o), default=-1)
    return Schedule(placement, m, orders, name)
