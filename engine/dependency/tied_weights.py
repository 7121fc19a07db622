"""Lowering pass: the all-reduce of tied weights whose copies sit on several pipeline ranks
(e.g. GPT-2's ``wte`` / ``lm_head`` on the first and last rank; Megatron-LM's embedding
all-reduce, as ``runtime.worker`` does it at the optimizer step)."""

from __future__ import annotations

from engine.dependency.context import LowerContext
from engine.dependency.instructions import Instruction, Op, TiedGroup
from engine.placement import Placement
from engine.precision import get_policy

__all__ = ["add_tied_allreduces", "holder_ranks"]


def holder_ranks(placement: Placement, group: TiedGroup) -> tuple[int, ...]:
    """The pipeline ranks holding a copy of ``group`` (the devices of its segments' forward
    blocks; a segment this placement lacks holds no copy here), ascending."""
    ranks: set[int] = set()
    for s in group.segments():
        if placement.has("F", s):
            ranks.update(placement.spec("F", s).devices)
    return tuple(sorted(ranks))


def add_tied_allreduces(ctx: LowerContext) -> None:
    """On a training stream (:attr:`LowerContext.training`), append for every tied group whose
    copies span 2+ ranks one ``ALLREDUCE`` on each holder (``segment=None``, ``ranks`` = the
    holders, ``group = len(ranks)``, ``nbytes`` = one tensor rank's share of one copy's gradients
    in the precision policy's gradient dtype: ``g.nbytes / tp x grad_bytes / weight_bytes``, since
    the vocabulary-parallel embedding and LM head shard their tied weight over the tensor group as
    Megatron-LM does; ``g.nbytes`` under ``32-true`` with ``tp = 1``), in group order; the
    optimizer pass puts ``OPTIM`` after them.

    Raises:
        TransformError: an unknown precision in the options.
    """
    if not ctx.training or not ctx.options.tied:
        return
    pol = get_policy(ctx.options.precision)
    for g in ctx.options.tied:
        ranks = holder_ranks(ctx.placement, g)
        if len(ranks) > 1:
            nbytes = pol.scale(g.nbytes // max(1, int(ctx.options.tp)), pol.grad_bytes)
            for r in ranks:
                ctx.streams[r].append(Instruction(Op.ALLREDUCE, None, nbytes=nbytes, group=len(ranks), ranks=ranks))
