"""The instruction interpreter of a stage worker: one handler per :class:`engine.dependency.Op`,
dispatched through :data:`HANDLERS` (``docs/runtime-worker.md``, "What a rank does in a step"). A handler
reads the rank's :class:`~runtime.worker.context.ExecContext`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from engine.dependency import Instruction, Op
from engine.timeline import Event
from runtime.worker import compute
from runtime.worker.context import ExecContext
from runtime.worker.errors import WorkerError
from runtime.worker.step_state import StepState
from runtime.worker.tp_comm import gather_boundary

if TYPE_CHECKING:
    from engine.schedule import Block

__all__ = ["HANDLERS", "execute"]

Handler = Callable[[ExecContext, Instruction, StepState], None]

#: The compute function of each compute op (``Op`` is a ``StrEnum``: a plain-string op finds its entry too).
_COMPUTE: dict[str, Callable[[ExecContext, int, int, StepState], None]] = {
    Op.F: compute.forward, Op.B: compute.backward, Op.I: compute.backward_input, Op.W: compute.backward_weight}


def _compute(ctx: ExecContext, ins: Instruction, st: StepState) -> None:
    """``F``/``B``/``I``/``W``: run the block, then (CUDA) wait its kernels; one compute event,
    plus one ``ALLTOALL`` event per expert-parallel all-to-all it ran."""
    b = ins.block
    assert b is not None
    s, j = b.segment, b.micro_batch
    start = st.now()
    _COMPUTE[ins.op](ctx, s, j, st)
    sync = ctx.transport.sync
    if sync is not None:   # CUDA: stamp the kernels' completion, not their launch
        sync()
    st.events.append(Event(ctx.coords.rank, "compute", ins.op, str(b), start, st.now(), 0, j, s))
    if ctx.local.ep_layers:
        _record_all_to_alls(ctx, b, st)


def _record_all_to_alls(ctx: ExecContext, block: Block, st: StepState) -> None:
    """One measured ``ALLTOALL`` event per all-to-all that ran inside ``block``'s compute
    (``ExpertParallelMoE.comm_log``, wall times on the step's clock), in start order."""
    recs = []
    for layer in ctx.local.ep_layers:
        recs.extend(layer.comm_log)
        layer.comm_log.clear()
    for r in sorted(recs, key=lambda r: r["start"]):
        st.events.append(Event(ctx.coords.rank, "collective", "ALLTOALL", f"a2a {block}", r["start"] - st.t0,
                               r["end"] - st.t0, int(r["bytes_total"]), block.micro_batch, block.segment))


def _send(ctx: ExecContext, ins: Instruction, st: StepState) -> None:
    """``SEND``: post the ``isend``s of a block's boundary tensors (activations after F, input
    gradients after B/I); the send waiter stamps their completion."""
    b = ins.block
    assert b is not None and ins.peer is not None and st.sends is not None
    s, j = b.segment, b.micro_batch
    # get, not pop: a block may send to several ranks (a multi-device consumer) and also feed a
    # local consumer, which takes the tensors after the sends (they follow the block in the stream)
    if b.kind == "F":
        tensors = [t.detach() for t in st.outputs[(s, j)]]
        boundary, direction = s, 0
    else:   # the slice of this block's input gradients that belongs to the producer on the peer
        boundary, direction = ctx.flow.grad_producer(s, ins.peer), 1
        lo, hi = ctx.flow.grad_slices[s][boundary]
        tensors = st.in_grads[(s, j)][lo:hi]
    p2p = ctx.transport.p2p
    dst = p2p.world(ins.peer)
    start = st.now()
    sent = p2p.wire(tensors)   # contiguous; scatter-send: this tensor rank's 1/tp slice
    works = p2p.send(sent, dst, boundary, direction, j)
    nbytes = sum(t.numel() * t.element_size() for t in sent)
    ev = Event(ctx.coords.rank, "send", "SEND", f"{b}>{dst}", start, -1.0, nbytes, j, s)
    st.events.append(ev)
    st.sends.add(works, sent, ev)


def _recv(ctx: ExecContext, ins: Instruction, st: StepState) -> None:
    """``RECV``: wait the receive (posted at the step's start, or now) into its buffers."""
    pb = ins.block
    assert pb is not None
    start = st.now()
    tr = ctx.transport
    bufs, works, src = tr.p2p.take_recv(ins, st)
    for wk in works:
        wk.wait(tr.timeout)
    if tr.sync is not None:   # CUDA: wait() only orders the compute stream after the transfer
        tr.sync()
    st.events.append(Event(ctx.coords.rank, "recv", "RECV", f"{pb}<{src}", start, st.now(),
                           sum(t.numel() * t.element_size() for t in bufs), pb.micro_batch, pb.segment))


def _allreduce(ctx: ExecContext, ins: Instruction, st: StepState) -> None:
    """``ALLREDUCE``: post a segment's DP all-reduce, or (``segment=None``) run the tied-weight one;
    a gradient bucket (``overlap-grad-sync``) was posted by its backward's hooks: check it was."""
    if ins.segment is None:   # the tied-weight all-reduce across pipeline ranks (wte / lm_head)
        ctx.grad_sync.finish(st)   # DP averages first: they write the tied copies' .grad
        ctx.grad_sync.tied_allreduce(st, tuple(ins.ranks))
    elif ins.block is not None:   # HSDP's all-reduce of a unit's gradient shard: ran inside FSDP's hooks
        return
    elif ins.bucket is not None:
        ctx.grad_sync.bucket_posted(ins.segment, ins.bucket, st)
    else:
        ctx.grad_sync.post_allreduce(ins.segment, st)


def _reducescatter(ctx: ExecContext, ins: Instruction, st: StepState) -> None:
    """``REDUCESCATTER``: ``sharded-update``'s reduce-scatter of a segment's gradients to the replicas'
    shards; with ``bucket`` (``sharded-update`` with ``overlap-grad-sync``, ZeRO-2) one bucket's, which
    the segment's last backward posted (checked); with ``block`` (fully sharded data parallelism) a
    marker: FSDP2's hooks reduce-scatter each unit's gradients inside the backward."""
    if ins.block is not None:
        return
    assert ins.segment is not None
    if ins.bucket is not None:
        ctx.grad_sync.bucket_posted(ins.segment, ins.bucket, st)
        return
    ctx.grad_sync.post_reduce_scatter(ins.segment, st)


def _allgather(ctx: ExecContext, ins: Instruction, st: StepState) -> None:
    """``ALLGATHER``: a segment's updated parameter shards (``sharded-update``, after ``OPTIM``), or a
    received ``1/tp`` boundary slice gathered from the tensor group (``scatter-send``, ``block`` set)."""
    if ins.block is not None:
        gather_boundary(ins, st, coords=ctx.coords, flow=ctx.flow, transport=ctx.transport)
    else:
        assert ins.segment is not None
        ctx.grad_sync.post_all_gather(ins.segment, st)


def _alltoall(ctx: ExecContext, ins: Instruction, st: StepState) -> None:
    """``ALLTOALL``: a marker; the all-to-all ran inside its block's compute, which recorded it."""


def _fsdp_marker(ctx: ExecContext, ins: Instruction, st: StepState) -> None:
    """``UNSHARD`` / ``RESHARD`` (fully sharded data parallelism): markers; FSDP2's pre-forward,
    pre-backward and post-backward hooks all-gather and free each unit's parameters inside the
    blocks' compute (:mod:`runtime.fsdp`)."""


def _optim(ctx: ExecContext, ins: Instruction, st: StepState) -> None:
    """``OPTIM``: wait the all-reduces, reduce the tied groups no instruction handled, step the
    optimizer and advance every MoE gate (DTS temperature, hard switch)."""
    local, opt = ctx.local, ctx.opt
    ctx.grad_sync.finish(st)
    ctx.grad_sync.tied_allreduce(st, None)   # groups no ALLREDUCE instruction handled (older plans)
    start = st.now()
    opt.step(local.expert_params, local.ep)
    for s in local.segments:   # gates count optimizer updates (DTS temperature, hard switch)
        for _, layer in local.moe_layers[s]:
            layer.gate.advance()
    if ctx.transport.sync is not None:
        ctx.transport.sync()
    if opt.shards:   # sharded update: the optimizer stepped this replica's chunks only
        nbytes = sum(sh.param.numel() * sh.param.element_size() for sh in opt.shards.values())
    else:
        nbytes = sum(p.numel() * p.element_size() for ps in local.params.values() for p in ps)
    st.events.append(Event(ctx.coords.rank, "compute", "OPTIM", "optimizer", start, st.now(), nbytes, -1, -1))


#: The handler of each instruction op (keyed by :class:`Op`, a ``StrEnum``: a plain-string op
#: such as ``"SEND"`` finds the same handler).
HANDLERS: dict[str, Handler] = {
    Op.F: _compute, Op.B: _compute, Op.I: _compute, Op.W: _compute,
    Op.SEND: _send, Op.RECV: _recv, Op.ALLREDUCE: _allreduce, Op.ALLTOALL: _alltoall, Op.OPTIM: _optim,
    Op.REDUCESCATTER: _reducescatter, Op.ALLGATHER: _allgather,
    Op.UNSHARD: _fsdp_marker, Op.RESHARD: _fsdp_marker,
}


def execute(ctx: ExecContext, ins: Instruction, st: StepState) -> None:
    """Run one instruction. Raises :class:`WorkerError` for an op without a handler."""
    handler = HANDLERS.get(ins.op)
    if handler is None:
        raise WorkerError(f"unknown instruction {ins.op!r}")
    handler(ctx, ins, st)
