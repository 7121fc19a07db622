"""Lowering pass: a ``SEND`` after each block whose output another rank consumes and a ``RECV``
before the consumer (SuperScaler's data-dependency preservation), with CoCoNet's
``scatter-send`` and ``tp-split`` boundaries (``1/tp`` of the bytes; ``scatter-send`` alone
all-gathers the slices on the receiver)."""

from __future__ import annotations

from engine.dependency.context import LowerContext
from engine.dependency.instructions import COMPUTE_OPS, Instruction, Op
from engine.placement import TensorSpec
from engine.schedule import Block

__all__ = ["add_send_recv"]


def _links(ctx: LowerContext) -> tuple[dict[int, list[int]], dict[int, list[tuple[int, int, int]]]]:
    """``(destinations, sources)``: per producer placement block the other ranks its output goes
    to (ascending, once each), and per consumer block ``(producer, src rank, dst rank)`` of every
    input that crosses ranks (a multi-device producer sends from the first device of its set)."""
    pl = ctx.placement
    consumers: dict[int, set[int]] = {i: set() for i in range(len(pl.blocks))}
    sources: dict[int, list[tuple[int, int, int]]] = {i: [] for i in range(len(pl.blocks))}
    for ci, c in enumerate(pl.blocks):
        for pi in c.deps:
            p = pl.blocks[pi]
            for d in c.devices:
                if d not in p.devices:
                    consumers[pi].add(d)
                    sources[ci].append((pi, p.devices[0], d))
    return {k: sorted(v) for k, v in consumers.items()}, sources


def add_send_recv(ctx: LowerContext) -> None:
    """Insert the point-to-point transfers around every compute block: before it, one ``RECV``
    per input produced on another rank (once per producer block and micro-batch on a rank; with
    ``scatter-send`` and no ``tp-split`` followed by the ``ALLGATHER`` of the slices over the
    tensor group, ``group = tp``); after it, when this rank is the first of the block's devices,
    one ``SEND`` per other rank consuming its output. ``nbytes`` is the boundary tensor's bytes,
    ``1/tp`` of them (rounded up) with ``scatter-send`` or ``tp-split`` and ``tp > 1``."""
    opts = ctx.options
    tp = opts.tp
    scatter = "scatter-send" in opts.transforms and tp > 1
    seq_sharded = "tp-split" in opts.transforms and tp > 1   # the boundary is already the 1/tp sequence shard
    gather = scatter and "tp-split" not in opts.transforms
    pl = ctx.placement
    dests, sources = _links(ctx)

    def sent_bytes(t: TensorSpec | None) -> int:
        nb = t.nbytes if t else 0
        return -(-nb // tp) if scatter or seq_sharded else nb

    for d, stream in enumerate(ctx.streams):
        out: list[Instruction] = []
        received: set[Block] = set()
        for ins in stream:
            if ins.op not in COMPUTE_OPS:
                out.append(ins)
                continue
            b = ins.block
            assert b is not None
            bi = ctx.index[b.key]
            for pi, src, dst in sources[bi]:
                if dst != d:
                    continue
                p = pl.blocks[pi]
                pb = Block(p.segment, p.kind, b.micro_batch)
                if pb not in received:
                    received.add(pb)
                    t = p.output
                    out.append(Instruction(Op.RECV, pb, peer=src, tensor=t, nbytes=sent_bytes(t)))
                    if gather and t is not None:
                        out.append(Instruction(Op.ALLGATHER, pb, nbytes=t.nbytes, group=tp))
            out.append(ins)
            spec = pl.blocks[bi]
            if spec.devices[0] == d:
                t = spec.output
                out.extend(Instruction(Op.SEND, b, peer=dst, tensor=t, nbytes=sent_bytes(t)) for dst in dests[bi])
        ctx.streams[d] = out
