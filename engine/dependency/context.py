"""The state the lowering passes share: the schedule, the options, the per-rank streams being
built and what every pass reads off the placement (which block each placement index is, the
segments on each rank, their parameter bytes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.dependency.instructions import COMPUTE_OPS, ExecutionPlan, Instruction
from engine.dependency.options import LowerOptions
from engine.placement import Placement
from engine.schedule import Schedule

__all__ = ["LowerContext", "block_tail_end"]


@dataclass
class LowerContext:
    """One lowering in progress (:func:`engine.dependency.lower`).

    Attributes:
        schedule: the schedule lowered (``validate`` already passed).
        options: the :class:`LowerOptions`.
        streams: ``streams[rank]``, the instructions so far; each pass rewrites them.
        static_memory: resident bytes per rank (the placement's; ``sharded-update`` lowers it).
        param_bytes: parameter bytes per rank (``options.segment_param_bytes`` of its segments).
        segments_on: per rank, the segments whose forward block runs there, ascending.
        index: a block's key (segment, kind) -> its index in ``placement.blocks``.
    """

    schedule: Schedule
    options: LowerOptions
    streams: list[list[Instruction]] = field(default_factory=list)
    static_memory: list[int] = field(default_factory=list)
    param_bytes: list[int] = field(default_factory=list)
    segments_on: list[list[int]] = field(default_factory=list)
    index: dict = field(default_factory=dict)

    @classmethod
    def start(cls, schedule: Schedule, options: LowerOptions) -> "LowerContext":
        """A context with empty streams and the placement's facts."""
        pl = schedule.placement
        n = pl.num_devices
        seg_bytes = options.segment_param_bytes or {}
        segments_on = [sorted({pl.blocks[i].segment for i in pl.blocks_on(d) if pl.blocks[i].kind == "F"})
                       for d in range(n)]
        return cls(schedule, options, streams=[[] for _ in range(n)],
                   static_memory=[pl.static_bytes(d) for d in range(n)],
                   param_bytes=[sum(seg_bytes.get(s, 0) for s in segs) for segs in segments_on],
                   segments_on=segments_on, index={b.key: i for i, b in enumerate(pl.blocks)})

    @property
    def placement(self) -> Placement:
        return self.schedule.placement

    @property
    def training(self) -> bool:
        """Whether the streams end with an optimizer step (``options.optimizer`` on a training placement)."""
        return self.options.optimizer and not self.placement.forward_only

    def result(self) -> ExecutionPlan:
        """The :class:`ExecutionPlan` of the streams built."""
        opts = self.options
        inner = {int(s): tuple((str(k), int(b), float(t)) for k, b, t in v)
                 for s, v in (opts.segment_tp_collectives or {}).items() if v}
        return ExecutionPlan(self.streams, self.static_memory, dp=opts.dp, param_bytes=self.param_bytes,
                             schedule_name=self.schedule.name, tp_collectives=inner, tp=opts.tp,
                             layout=opts.layout, dp_shard=opts.dp_shard)


def block_tail_end(stream: list[Instruction], i: int) -> int:
    """The index just after compute instruction ``stream[i]`` and what belongs to its block: the
    all-to-alls it runs and the sends of its output (same ``block``, ``op`` not a compute op)."""
    b = stream[i].block
    j = i + 1
    while j < len(stream) and stream[j].block == b and stream[j].op not in COMPUTE_OPS:
        j += 1
    return j
