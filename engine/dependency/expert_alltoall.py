"""Lowering pass: the expert-parallel all-to-alls of mixture-of-experts segments
(:mod:`engine.models.moe.comm`), one ``ALLTOALL`` marker per all-to-all a block runs."""

from __future__ import annotations

from engine.dependency.context import LowerContext
from engine.dependency.instructions import Instruction, Op

__all__ = ["add_alltoalls"]


def add_alltoalls(ctx: LowerContext) -> None:
    """With ``dp > 1``, insert right after each compute instruction of a segment that has
    all-to-alls (``options.alltoalls``; before the block's SENDs) one ``ALLTOALL`` per all-to-all
    it runs, in execution order: a forward in layer order (dispatch, combine), ``B`` or ``I`` in
    reverse (combine-grad, dispatch-grad), ``W`` none, except for a segment fed only by the model's
    input, whose ``I`` has no input gradient, so its whole backward, all-to-alls included, runs in
    ``W``. ``group`` is the expert-parallel group (= ``dp``), ``nbytes`` one rank's whole send
    buffer."""
    opts = ctx.options
    if opts.dp <= 1 or not opts.alltoalls:
        return
    a2a = {int(k): [int(x) for x in v] for k, v in opts.alltoalls.items()}
    pl = ctx.placement
    input_segments = {blk.segment for blk in pl.blocks
                      if blk.kind == "F" and not any(pl.blocks[i].kind == "F" for i in blk.deps)}
    for d, stream in enumerate(ctx.streams):
        out: list[Instruction] = []
        for ins in stream:
            out.append(ins)
            b = ins.block
            if b is None or ins.op not in (Op.F, Op.B, Op.I, Op.W):
                continue
            fwd = a2a.get(b.segment)
            if fwd and ins.op in ("F", "B", "W" if b.segment in input_segments else "I"):
                for nb in (fwd if ins.op == Op.F else reversed(fwd)):
                    out.append(Instruction(Op.ALLTOALL, b, nbytes=nb, segment=b.segment, group=opts.dp))
        ctx.streams[d] = out
