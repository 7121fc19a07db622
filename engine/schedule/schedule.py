"""The :class:`Schedule`: per-device block orders over a placement."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from engine.errors import ScheduleError
from engine.placement import Placement
from engine.schedule.block import Block, parse_action
from engine.schedule.validate import validate as _validate


@dataclass
class Schedule:
    """Per-device ORDER of blocks for all micro-batches of one training (or inference) step.

    Attributes:
        placement: the blocks of one micro-batch and their device sets.
        num_micro_batches: ``m``, micro-batches per step.
        orders: ``orders[d]`` is the block order on device ``d``; a multi-device block appears
            in the order of every device of its set.
        name: schedule name (``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb-h1"``, ``"tessel"``...).
        meta: free-form JSON-able facts (e.g. repetend period and bounds from a search).
    """

    placement: Placement
    num_micro_batches: int
    orders: list[list[Block]]
    name: str = "custom"
    meta: dict = field(default_factory=dict)

    @property
    def num_devices(self) -> int:
        return self.placement.num_devices

    def spec(self, block: Block):
        """The placement's :class:`~engine.placement.BlockSpec` of a block instance."""
        return self.placement.spec(block.kind, block.segment)

    def duration(self, block: Block) -> float:
        """Seconds the block runs."""
        return self.spec(block).duration

    def validate(self, memory_limit: float | Sequence[float] | None = None) -> None:
        """Check every rule; raise :class:`~engine.errors.ScheduleError` naming the first violation.

        Args:
            memory_limit: bytes per device (a scalar applies to every device), or ``None``.

        See :func:`engine.schedule.validate.validate`.
        """
        _validate(self, memory_limit)

    def copy(self) -> "Schedule":
        return Schedule(self.placement, self.num_micro_batches, [list(o) for o in self.orders], self.name,
                        dict(self.meta))

    def move(self, device: int, src: int, dst: int) -> "Schedule":
        """A copy with the block at position ``src`` of ``device``'s order moved to position ``dst``.

        Raises:
            ScheduleError: positions out of range (rule ``"device"``).
        """
        order = self.orders[device]
        if not (0 <= src < len(order) and 0 <= dst < len(order)):
            raise ScheduleError("device", f"device {device} has {len(order)} blocks; cannot move position {src} "
                                          f"to {dst}", device)
        new = self.copy()
        blk = new.orders[device].pop(src)
        new.orders[device].insert(dst, blk)
        return new

    # ------------------------------------------------------------ text forms
    def to_actions(self) -> list[list[str]]:
        """Per-device action strings (``"0F3"``), as in torch pipelining CSV."""
        return [[str(b) for b in order] for order in self.orders]

    @classmethod
    def from_actions(cls, placement: Placement, num_micro_batches: int, actions: list[list[str]], name: str = "custom",
                     meta: dict | None = None) -> "Schedule":
        """Build from per-device action strings. Raises ``PlanFormatError`` on a malformed action."""
        return cls(placement, num_micro_batches, [[parse_action(a) for a in row] for row in actions], name,
                   dict(meta or {}))

    def __str__(self) -> str:
        rows = [f"{self.name}: {self.num_devices} devices x {self.num_micro_batches} micro-batches"]
        rows += [f"  rank {d}: " + " ".join(map(str, o)) for d, o in enumerate(self.orders)]
        return "\n".join(rows)
