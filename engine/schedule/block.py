"""A block instance: one segment's F/B/I/W for one micro-batch."""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.errors import PlanFormatError

_ACTION = re.compile(r"^\s*(\d+)([FBIW])(\d+)\s*$")


@dataclass(frozen=True, order=True)
class Block:
    """One segment's forward/backward for one micro-batch.

    Attributes:
        segment: segment (stage) index.
        kind: ``"F"``, ``"B"``, ``"I"`` or ``"W"``.
        micro_batch: micro-batch index ``0..m-1``.

    ``str(block)`` is the torch.distributed.pipelining action string ``"{stage}{kind}{mb}"``,
    e.g. ``"2F3"`` (PyTorch ``_Action.__repr__``).
    """

    segment: int
    kind: str
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.segment}{self.kind}{self.micro_batch}"

    @property
    def key(self) -> tuple[str, int]:
        """``(kind, segment)``: the placement block this instance runs."""
        return (self.kind, self.segment)


def parse_action(text: str) -> Block:
    """Parse an action string like ``"1B3"`` into a :class:`Block`.

    Raises:
        PlanFormatError: the text is not ``<stage><F|B|I|W><micro-batch>``.
    """
    m = _ACTION.match(text)
    if not m:
        raise PlanFormatError(f"cannot read action {text!r}: expected <stage><F|B|I|W><micro-batch>, e.g. '1B3'")
    return Block(int(m.group(1)), m.group(2), int(m.group(3)))
