"""Lowering pass: the optimizer step ending every training stream, with CoCoNet's
``sharded-update`` (each replica updates ``1/dp`` of the parameters, gathers them afterwards,
and keeps Adam's moments of its shard only)."""

from __future__ import annotations

from engine.dependency.context import LowerContext
from engine.dependency.instructions import COMPUTE_OPS, Instruction, Op
from engine.precision import get_policy

__all__ = ["add_optimizer_step"]


def add_optimizer_step(ctx: LowerContext) -> None:
    """With ``sharded-update`` and ``dp > 1`` (Megatron-LM's distributed optimizer, ZeRO-1), take
    the sharded part of the other replicas' shards off each rank's static memory: master weights,
    Adam's ``m`` and ``v`` and the fp32 gradient copy of the precision policy
    (:meth:`engine.precision.PrecisionPolicy.sharded_saving`; ``32-true``: ``2 x (p - p // dp)``
    of its parameter bytes ``p``). On a
    training stream (:attr:`LowerContext.training`), append ``OPTIM``: ``nbytes`` the rank's
    parameter bytes (``1/dp`` of them when sharded), ``memory`` minus the gradient buffers its
    blocks held (``zero_grad`` after the update); sharded, then one ``ALLGATHER`` of each local
    segment's parameters (``group = dp``). Fully sharded (``dp_shard > 1``,
    :mod:`engine.dependency.fsdp`): ``OPTIM`` on ``1/dp_shard`` of the parameters, no all-gather
    (the next forward's ``UNSHARD`` s gather them)."""
    opts = ctx.options
    dp = opts.dp
    sharded = "sharded-update" in opts.transforms and dp > 1
    if sharded:   # master weights and Adam's m and v of the other replicas' shards are not kept
        pol = get_policy(opts.precision)
        for d, pb in enumerate(ctx.param_bytes):
            ctx.static_memory[d] = max(0, ctx.static_memory[d] - pol.sharded_saving(pb, dp))
    if not ctx.training:
        return
    seg_bytes = opts.segment_param_bytes or {}
    shards = dp if sharded else max(1, opts.dp_shard)   # FSDP: each rank steps its shard (engine.dependency.fsdp)
    for d, stream in enumerate(ctx.streams):
        held = sum(ins.hold for ins in stream if ins.op in COMPUTE_OPS)
        pb = ctx.param_bytes[d]
        stream.append(Instruction(Op.OPTIM, None, nbytes=pb // shards, memory=-held))
        if sharded:
            stream.extend(Instruction(Op.ALLGATHER, None, nbytes=seg_bytes[seg], segment=seg, group=dp)
                          for seg in ctx.segments_on[d] if seg_bytes.get(seg, 0))
