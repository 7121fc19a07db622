"""Lowering pass: fully sharded data parallelism (FSDP2's ``fully_shard``, ZeRO-3), and HSDP.

With ``dp_shard > 1`` (:attr:`LowerOptions.dp_shard`) every rank keeps ``1/dp_shard`` of each
segment's parameters, gradients and Adam states. Each sharded unit (torchtitan wraps every
transformer block in its own ``fully_shard``, and a stage's remaining parameters in the stage's
root one; :attr:`LowerOptions.fsdp_units`) is all-gathered over the shard group before the blocks
that need it (``UNSHARD``) and its gradients are reduce-scattered after its backward
(``REDUCESCATTER`` with ``block`` set); with ``dp > dp_shard`` (HSDP, a ``(dp_replicate,
dp_shard)`` mesh) the shard is then all-reduced over the replicate group (``ALLREDUCE`` with
``block`` set). When the gathers run, and when they are freed, follows what PyTorch does:

- **No pipeline** (one pipeline rank; FSDP2's defaults, torchtitan's training loop): every
  micro-batch's forward gathers each unit (``UNSHARD`` before ``F``, in forward order); with
  ``reshard_after_forward`` the unit is freed when its forward ends and gathered again, in
  reverse order, before the backward (``UNSHARD`` before ``B``/``I``, its unsharded gradient live
  with it), otherwise it stays gathered until the backward ends (``RESHARD`` after ``B``). Every
  micro-batch's backward reduce-scatters each unit's gradients (FSDP2 syncs gradients on every
  backward unless told not to), so the gradient buffer a rank accumulates is its shard, in the
  reduce dtype (:attr:`engine.precision.PrecisionPolicy.fsdp_reduce_bytes`).
- **A pipeline** (``torch.distributed.pipelining``'s ``_PipelineStageBase.backward_maybe_with_nosync``
  turns off gradient sync and reshard-after-backward for all but a stage's last backward;
  torchtitan then sets ``reshard_after_forward=False``): a stage's units are gathered once,
  before its first forward on the rank, and stay gathered; its unsharded gradients accumulate in
  the reduce dtype; after its last weight-gradient block (``B`` or ``W``) each unit is
  reduce-scattered and the stage is resharded (``RESHARD``).

The simulator (:mod:`engine.simulate`) runs a block's pending ``UNSHARD`` s unit by unit with
FSDP2's prefetch: unit ``k``'s all-gather is issued when unit ``k - 1`` starts computing (its
``ready`` is the unit's share of the block's compute time), so it runs while the previous unit
computes. The runtime executes the same instructions as markers: FSDP2's hooks do the
communication inside the blocks.

The static memory keeps only the shards (:meth:`engine.precision.PrecisionPolicy.fsdp_bytes_per_param`
less the gradient, which the blocks' ``hold`` counts); the gathered units come and go with the
``UNSHARD`` / ``RESHARD`` instructions' ``memory``.

Sources: Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel" (VLDB
2023); Rajbhandari et al., "ZeRO" (SC 2020, stage 3); PyTorch's ``torch.distributed.fsdp.fully_shard``
(FSDP2) and torchtitan's ``apply_fsdp``.
"""

from __future__ import annotations

from dataclasses import replace

from engine.dependency.context import LowerContext, block_tail_end
from engine.dependency.instructions import COMPUTE_OPS, Instruction, Op
from engine.errors import TransformError
from engine.precision import get_policy

__all__ = ["add_fsdp", "fsdp_static_memory", "segment_units"]


def segment_units(ctx: LowerContext, seg: int) -> list[tuple[int, float]]:
    """Segment ``seg``'s FSDP units in forward order, ``(parameter bytes on one rank, share of the
    segment's compute time)`` (:attr:`LowerOptions.fsdp_units`; one unit of the segment's
    parameter bytes after an empty root when it records none). The first unit is the stage's root (its parameters
    outside the transformer blocks, possibly none), which FSDP2 keeps gathered from the forward
    to the end of the backward. The shares are normalised to sum to 1."""
    opts = ctx.options
    units = list((opts.fsdp_units or {}).get(seg) or ())
    if not units:   # an empty root, then the whole segment as one unit
        units = [(0, 0.0), ((opts.segment_param_bytes or {}).get(seg, 0), 1.0)]
    total = sum(max(0.0, float(f)) for _, f in units)
    if total <= 0:
        return [(int(b), 1.0 / len(units)) for b, _ in units]
    return [(int(b), max(0.0, float(f)) / total) for b, f in units]


def fsdp_static_memory(param_bytes: int, precision: str, dp_shard: int) -> int:
    """Bytes one rank keeps for the whole step for a stage of ``param_bytes`` weight bytes fully
    sharded over ``dp_shard`` ranks: the sharded parameter in its original dtype and Adam's two
    moments (:attr:`engine.precision.PrecisionPolicy.fsdp_sharded_bytes_per_param`), divided by
    ``dp_shard`` (rounded up). The sharded gradient is the blocks' ``hold``.

    Raises:
        TransformError: an unknown precision.
    """
    pol = get_policy(precision)
    return -(-pol.scale(param_bytes, pol.fsdp_sharded_bytes_per_param) // max(1, dp_shard))


def _gradient_sync(ctx: LowerContext, blk_ins: Instruction, units: list[tuple[int, float]],
                   seg: int) -> list[Instruction]:
    """The reduce-scatters (and HSDP all-reduces) of ``seg``'s units after backward block
    ``blk_ins``: in backward order (the last unit's gradients are final first), each ``ready`` at
    the end of its unit's share of the block."""
    opts = ctx.options
    pol = get_policy(opts.precision)
    shard, replicate = opts.dp_shard, opts.dp // opts.dp_shard
    out: list[Instruction] = []
    done = 0.0
    for u in reversed(range(len(units))):
        nbytes, share = units[u]
        done += share
        if nbytes <= 0:
            continue
        grad = pol.scale(nbytes, pol.fsdp_reduce_bytes)
        ready = min(1.0, done)
        out.append(Instruction(Op.REDUCESCATTER, blk_ins.block, nbytes=grad, segment=seg, group=shard, bucket=u,
                               ready=ready))
        if replicate > 1:
            out.append(Instruction(Op.ALLREDUCE, blk_ins.block, nbytes=-(-grad // shard), segment=seg,
                                   group=replicate, bucket=u, ready=ready))
    return out


def _unshards(ctx: LowerContext, blk_ins: Instruction, units: list[tuple[int, float]], seg: int, *,
              backward: bool, free_after: bool) -> list[Instruction]:
    """The ``UNSHARD`` s before ``blk_ins``: one per unit (reverse order for a backward, whose
    root unit is still gathered), each allocating the unit's gathered parameters (a backward's
    also its unsharded gradient) and, with ``free_after``, freeing them when the unit's compute
    ends (``transient``; never the root, which FSDP2 keeps from the forward to the backward)."""
    pol = get_policy(ctx.options.precision)
    order = list(reversed(range(1, len(units)))) if backward else list(range(len(units)))
    out = []
    for u in order:
        nbytes, share = units[u]
        mem = nbytes + (pol.scale(nbytes, pol.fsdp_reduce_bytes) if backward else 0)
        free = free_after and u > 0
        out.append(Instruction(Op.UNSHARD, blk_ins.block, nbytes=nbytes, segment=seg, group=ctx.options.dp_shard,
                               bucket=u, ready=share, memory=mem, transient=mem if free else 0))
    return out


def _reshard(ctx: LowerContext, seg: int, nbytes: int) -> Instruction:
    """``RESHARD`` of ``seg``: frees ``nbytes`` of its gathered parameters."""
    return Instruction(Op.RESHARD, None, segment=seg, group=ctx.options.dp_shard, memory=-nbytes)


def _lower_rank(ctx: LowerContext, stream: list[Instruction], pipelined: bool, raf: bool) -> list[Instruction]:
    """One rank's stream with its FSDP instructions (module docstring)."""
    opts = ctx.options
    pol = get_policy(opts.precision)
    grad_scale = (pol.fsdp_reduce_bytes, pol.grad_bytes * (1 if pipelined else opts.dp_shard))
    first_f: dict[int, int] = {}
    last_grad: dict[int, int] = {}
    for i, ins in enumerate(stream):
        if ins.op in COMPUTE_OPS and ins.block is not None:
            seg = ins.block.segment
            if ins.op == Op.F:
                first_f.setdefault(seg, i)
            if ins.op in (Op.B, Op.W):
                last_grad[seg] = i
    before: dict[int, list[Instruction]] = {}
    after: dict[int, list[Instruction]] = {}
    for i, ins in enumerate(stream):
        if ins.op not in COMPUTE_OPS or ins.block is None:
            continue
        seg = ins.block.segment
        units = segment_units(ctx, seg)
        kept = units[0][0] if raf else sum(b for b, _ in units)   # what stays gathered after the forward
        if ins.op == Op.F and (not pipelined or i == first_f[seg]):
            before[i] = _unshards(ctx, ins, units, seg, backward=False, free_after=raf)
            if not ctx.training:
                after.setdefault(block_tail_end(stream, i), []).append(_reshard(ctx, seg, kept))
        elif ins.op in (Op.B, Op.I) and raf:
            before[i] = _unshards(ctx, ins, units, seg, backward=True, free_after=True)
        if ins.op in (Op.B, Op.W) and (not pipelined or i == last_grad[seg]):
            tail = _gradient_sync(ctx, ins, units, seg)
            tail.append(_reshard(ctx, seg, kept))
            after.setdefault(block_tail_end(stream, i), []).extend(tail)
    out: list[Instruction] = []
    for i, ins in enumerate(stream):
        out.extend(after.pop(i, ()))
        out.extend(before.get(i, ()))
        if ins.op in COMPUTE_OPS and (ins.hold or ins.transient):
            ins = replace(ins, hold=ins.hold * grad_scale[0] // grad_scale[1],
                          transient=ins.transient * grad_scale[0] // grad_scale[1])
        if ins.op in (Op.B, Op.I) and not pipelined and ins.block is not None:
            # the root's unsharded gradient lives through the whole backward (its post-backward runs
            # last); without resharding after the forward, also about two blocks' unsharded gradients
            # (each freed by its reduce-scatter; with it, the backward's UNSHARDs count them)
            units = segment_units(ctx, ins.block.segment)
            live = units[0][0]
            if not raf:
                live += min(sum(b for b, _ in units[1:]), 2 * max((b for b, _ in units[1:]), default=0))
            ins = replace(ins, transient=ins.transient + pol.scale(live, pol.fsdp_reduce_bytes))
        out.append(ins)
    out.extend(after.pop(len(stream), ()))
    return out


def add_fsdp(ctx: LowerContext) -> None:
    """With ``dp_shard > 1``, add fully sharded data parallelism's instructions to every rank's
    stream and keep only the shards in its static memory (module docstring). Runs after the
    all-to-alls and before :func:`engine.dependency.grad_sync.add_grad_sync`, which then adds
    nothing.

    Raises:
        TransformError: ``reshard_after_forward`` asked for with a pipeline (PyTorch's pipeline
            keeps a stage's parameters gathered between its forwards and backwards, torchtitan's
            default; leave it unset), or with the AdamA optimizer.
    """
    opts = ctx.options
    if opts.dp_shard <= 1:
        return
    if opts.optimizer_kind == "adama":
        raise TransformError("fully sharded data parallelism (dp_shard > 1) does not run with AdamA, whose "
                             "folded gradients are not sharded; use --optimizer adam")
    pipelined = ctx.placement.num_devices > 1
    if pipelined and opts.reshard_after_forward:
        raise TransformError("reshard_after_forward with a pipeline is not modelled: PyTorch's pipeline keeps a "
                             "stage's parameters gathered from its first forward to its last backward (torchtitan's "
                             "default); leave reshard_after_forward unset")
    raf = not pipelined if opts.reshard_after_forward is None else bool(opts.reshard_after_forward)
    if ctx.training:
        pol = get_policy(opts.precision)
        for d, pb in enumerate(ctx.param_bytes):
            ctx.static_memory[d] = max(0, ctx.static_memory[d] - pol.scale(pb, pol.resident_bytes_per_param)) \
                + fsdp_static_memory(pb, opts.precision, opts.dp_shard)
    else:   # inference: the weights only, sharded; each unit gathered for its forward and freed after it
        ctx.static_memory = [max(0, m - pb) + -(-pb // opts.dp_shard) for m, pb in zip(ctx.static_memory,
                                                                                  ctx.param_bytes)]
        raf = True
    for d, stream in enumerate(ctx.streams):
        ctx.streams[d] = _lower_rank(ctx, stream, pipelined and ctx.training, raf)
