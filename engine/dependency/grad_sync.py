"""Lowering pass: data-parallel gradient synchronisation (the ``_add_reduce_grad`` of
torch.distributed.pipelining): a plain ``ALLREDUCE`` per segment, CoCoNet's
``overlap-grad-sync`` buckets, or ``sharded-update``'s ``REDUCESCATTER``."""

from __future__ import annotations

from engine.coconet import DEFAULT_GRAD_BUCKET_BYTES, gradient_buckets
from engine.dependency.context import LowerContext, block_tail_end
from engine.dependency.instructions import Instruction, Op
from engine.precision import get_policy

__all__ = ["add_grad_sync", "dp_reduce_bytes"]


def dp_reduce_bytes(ctx: LowerContext) -> dict[int, int]:
    """Bytes each segment's data-parallel reduction carries: the gradients of its replicated
    parameters (``options.segment_allreduce_bytes``, default ``segment_param_bytes``; weight
    bytes) in the precision policy's gradient dtype (``bytes x grad_bytes / weight_bytes``:
    ``32-true`` and ``bf16-mixed`` fp32, ``16-mixed`` and ``bf16-true`` half; Megatron-LM
    all-reduces its fp32 ``main_grad`` under bf16 and the fp16 gradients under fp16); with AdamA
    Adam's ``m`` and ``v`` of the folded gradients in the states' dtype and the tied copies'
    unfolded gradients once (``32-true``: ``2 x (bytes - tied) + tied``).

    Raises:
        TransformError: an unknown precision in the options.
    """
    opts = ctx.options
    pol = get_policy(opts.precision)
    ar = opts.segment_allreduce_bytes if opts.segment_allreduce_bytes is not None else opts.segment_param_bytes
    ar = dict(ar or {})
    if opts.optimizer_kind != "adama":
        return {seg: pol.scale(b, pol.grad_bytes) for seg, b in ar.items()}
    tied_in_seg: dict[int, int] = {}
    for g in opts.tied or ():
        for s in g.segments():
            tied_in_seg[s] = tied_in_seg.get(s, 0) + g.nbytes
    out = {}
    for seg, b in ar.items():
        t = min(tied_in_seg.get(seg, 0), b)
        out[seg] = pol.scale(b - t, pol.state_bytes) + pol.scale(t, pol.grad_bytes)
    return out


def _sync(ctx: LowerContext, seg: int, nbytes: int) -> list[Instruction]:
    """The instructions reducing segment ``seg``'s ``nbytes`` of gradients over the dp replicas."""
    opts = ctx.options
    dp = opts.dp
    sharded = "sharded-update" in opts.transforms
    if "overlap-grad-sync" in opts.transforms:
        # DDP's buckets, each posted once its share of the block has run; with the sharded update
        # (ZeRO-2 with overlap) each bucket is reduce-scattered to the replicas' shards instead
        op = Op.REDUCESCATTER if sharded else Op.ALLREDUCE
        sizes = gradient_buckets(nbytes, opts.grad_bucket_bytes or DEFAULT_GRAD_BUCKET_BYTES)
        total, done, out = sum(sizes), 0, []
        for k, nb in enumerate(sizes):
            done += nb
            out.append(Instruction(op, None, nbytes=nb, segment=seg, group=dp, bucket=k, ready=done / total))
        return out
    if sharded:
        # the gradient buffers are released at OPTIM, as without it (the runtime frees them a
        # little earlier, at the reduce-scatter); the static memory holds the saving
        return [Instruction(Op.REDUCESCATTER, None, nbytes=nbytes, segment=seg, group=dp)]
    return [Instruction(Op.ALLREDUCE, None, nbytes=nbytes, segment=seg, group=dp)]


def add_grad_sync(ctx: LowerContext) -> None:
    """With ``dp > 1``, after each segment's last weight-gradient block (``B``, or ``W`` with a
    split backward) on a rank, and after that block's all-to-alls and sends, reduce the segment's
    gradients over the replicas: one ``ALLREDUCE`` of :func:`dp_reduce_bytes`; with
    ``overlap-grad-sync`` one per bucket (:func:`engine.coconet.gradient_buckets`, posting
    order), each ``ready`` once its share of the block has run; with ``sharded-update`` one
    ``REDUCESCATTER`` of the same bytes, or with both one ``REDUCESCATTER`` per bucket (ZeRO-2 with
    overlap)."""
    if ctx.options.dp <= 1 or ctx.options.dp_shard > 1:   # fully sharded: engine.dependency.fsdp reduces them
        return
    nbytes = dp_reduce_bytes(ctx)
    for d, stream in enumerate(ctx.streams):
        last: dict[int, int] = {}   # segment -> stream index of its last weight-gradient block
        for i, ins in enumerate(stream):
            if ins.op in ("B", "W") and ins.block is not None:
                last[ins.block.segment] = i
        if not last:
            continue
        after = {block_tail_end(stream, i): seg for seg, i in last.items()}
        out: list[Instruction] = []
        for i, ins in enumerate(stream):
            if i in after:
                out.extend(_sync(ctx, after[i], nbytes.get(after[i], 0)))
            out.append(ins)
        if len(stream) in after:
            out.extend(_sync(ctx, after[len(stream)], nbytes.get(after[len(stream)], 0)))
        ctx.streams[d] = out
