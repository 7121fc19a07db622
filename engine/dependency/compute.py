"""Lowering pass: one compute instruction per scheduled block, in each rank's order."""

from __future__ import annotations

from engine.dependency.context import LowerContext
from engine.dependency.instructions import Instruction, Op
from engine.schedule import gradient_events

__all__ = ["add_compute_blocks"]


def add_compute_blocks(ctx: LowerContext) -> None:
    """Fill every rank's stream with its ``F``/``B``/``I``/``W`` blocks in schedule order: the
    placement's duration and activation memory, and the gradient buffer the block allocates
    (``hold``: Adam's accumulation buffer, at the segment's first weight-gradient block on the
    rank) and its transient micro-batch gradient (``transient``), from
    :func:`engine.schedule.gradient_events`."""
    pl = ctx.placement
    for d, order in enumerate(ctx.schedule.orders):
        events = gradient_events(pl, order)
        out = ctx.streams[d]
        for pos, b in enumerate(order):
            spec = pl.blocks[ctx.index[b.key]]
            hold, transient = events[pos]
            out.append(Instruction(Op(spec.kind), b, duration=spec.duration, memory=spec.memory, hold=hold,
                                   transient=transient))
