"""Point-to-point transfers of a stage worker behind one small interface, with two matching
strategies: :class:`TagMatching` (gloo: sends and receives on the default group, matched by tag)
and :class:`OrderedMatching` (NCCL's only option: one-directional pair groups, receives posted in
the sender's order). Design: ``docs/runtime-worker.md``, "Backends and point-to-point matching"."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from engine.dependency import Instruction, Op
from runtime.worker.buffers import ReceiveBuffers
from runtime.worker.errors import WorkerError
from runtime.worker.p2p_order import Message, describe_message
from runtime.worker.step_state import StepState

__all__ = ["OrderedMatching", "P2PMatcher", "TagMatching"]

#: what a posted receive yields: (buffers, irecv works, source world rank)
Posted = tuple[list[torch.Tensor], list[Any], int]


class P2PMatcher:
    """Posts one rank's sends and receives (``docs/runtime-worker.md``, "Backends and point-to-point
    matching"); subclasses pick the matching.

    Args:
        rank: this global rank; ``pp``: pipeline ranks (peers are mapped to this replica).
        buffers: the rank's receive buffers.
        num_micro_batches: ``m``; ``max_tensors``: most tensors crossing one boundary (tags).
    """

    def __init__(self, rank: int, pp: int, buffers: ReceiveBuffers, num_micro_batches: int, max_tensors: int):
        self.rank = rank
        self.pp = pp
        self.buffers = buffers
        self.m = num_micro_batches
        self.max_tensors = max_tensors
        #: for a RECV of segment ``c``'s backward: the producer whose output gradients it carries
        #: (set by the worker from the placement's DAG; a chain's is ``c - 1``)
        self.grad_boundary: Any = lambda c: c - 1
        #: CoCoNet's ``scatter-send``: ``(parts, index)``, a message carries slice ``index`` of ``parts``
        #: equal slices (sequence dim 1) of each boundary tensor (``(tp, tp_rank)``; ``(1, 0)``: whole)
        self.wire_slice: tuple[int, int] = (1, 0)

    def wire(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What a SEND puts on the wire for ``tensors`` (one boundary message): each tensor made
        contiguous, or with ``scatter-send`` this rank's ``1/tp`` slice of it along the sequence
        (``torch.chunk(tp, dim=1)[tp_rank]``, ``[B, T/tp, H]``), which the receiver all-gathers
        from its tensor group (:func:`runtime.worker.tp_comm.gather_boundary`)."""
        parts, index = self.wire_slice
        if parts == 1:
            return [t.contiguous() for t in tensors]
        return [t.chunk(parts, dim=1)[index].contiguous() for t in tensors]

    def world(self, pp_rank: int) -> int:
        """The global rank of pipeline rank ``pp_rank`` in this rank's replica."""
        return (self.rank // self.pp) * self.pp + pp_rank

    def tag(self, boundary: int, direction: int, mb: int, k: int) -> int:
        """The tag of a message (direction 2: evaluation's forward traffic)."""
        return ((boundary * 3 + direction) * max(self.m, 1) + mb) * self.max_tensors + k

    def _recv_message(self, ins: Instruction) -> tuple[int, int, int, list[torch.Tensor]]:
        """``(boundary, direction, micro_batch, buffers)`` a RECV instruction fills (the wire buffers:
        with ``scatter-send`` the ``1/tp`` slices, :class:`~runtime.worker.buffers.ReceiveBuffers`)."""
        pb = ins.block
        assert pb is not None
        j = pb.micro_batch
        if pb.kind == "F":
            return pb.segment, 0, j, self.buffers.wire_act[(pb.segment, j)]
        b = self.grad_boundary(pb.segment)
        return b, 1, j, self.buffers.wire_grad[(b, j)]

    def post_recv(self, ins: Instruction, st: StepState) -> Posted:
        """Post the ``irecv``s of a RECV instruction into its pre-allocated buffers."""
        raise NotImplementedError

    def post_all(self, stream: Sequence[Instruction], st: StepState) -> None:
        """Post every receive of the step at its start, each into its own pre-allocated buffer: a
        transfer then completes as soon as its sender posts it, while this rank still computes."""
        raise NotImplementedError

    def take_recv(self, ins: Instruction, st: StepState) -> Posted:
        """The receive of a RECV instruction, posted early or now."""
        assert ins.peer is not None
        posted = st.recvs.pop((ins.block, ins.peer), None)
        return posted if posted is not None else self.post_recv(ins, st)

    def send(self, tensors: list[torch.Tensor], dst: int, boundary: int, direction: int, mb: int) -> list[Any]:
        """``isend`` each (contiguous) tensor of one boundary message to world rank ``dst``."""
        raise NotImplementedError

    def eval_group(self, src: int, dst: int) -> Any:
        """The group evaluation's forward traffic ``src -> dst`` uses (``None``: default, by tag)."""
        return None

    def eval_recv(self, bufs: list[torch.Tensor], src: int, boundary: int, mb: int) -> list[Any]:
        """Evaluation: receive boundary ``boundary``'s activations of micro-batch slot ``mb``."""
        group = self.eval_group(src, self.rank)
        if group is not None:   # the sender's order: micro-batch, then segment (evaluation's loop)
            return [dist.irecv(t, src, group=group, tag=0) for t in bufs]
        return [dist.irecv(t, src, tag=self.tag(boundary, 2, mb, q)) for q, t in enumerate(bufs)]

    def eval_send(self, t: torch.Tensor, dst: int, boundary: int, mb: int, q: int) -> Any:
        """Evaluation: send tensor ``q`` of boundary ``boundary``'s activations."""
        group = self.eval_group(self.rank, dst)
        if group is not None:
            return dist.isend(t, dst, group=group, tag=0)
        return dist.isend(t, dst, tag=self.tag(boundary, 2, mb, q))


class TagMatching(P2PMatcher):
    """Sends and receives on the default group, matched by tag = (boundary, direction,
    micro-batch, tensor index): any posting order works (gloo honours tags)."""

    def post_recv(self, ins: Instruction, st: StepState) -> Posted:
        assert ins.peer is not None
        boundary, direction, j, bufs = self._recv_message(ins)
        src = self.world(ins.peer)
        works = [dist.irecv(t, src, tag=self.tag(boundary, direction, j, k)) for k, t in enumerate(bufs)]
        return bufs, works, src

    def post_all(self, stream: Sequence[Instruction], st: StepState) -> None:
        for ins in stream:
            if ins.op == Op.RECV:
                st.recvs[(ins.block, ins.peer)] = self.post_recv(ins, st)

    def send(self, tensors: list[torch.Tensor], dst: int, boundary: int, direction: int, mb: int) -> list[Any]:
        return [dist.isend(t, dst, tag=self.tag(boundary, direction, mb, k)) for k, t in enumerate(tensors)]


class OrderedMatching(P2PMatcher):
    """One-directional pair groups; a receiver posts its receives from a peer in that peer's
    send order, with tag 0 (NCCL matches by posting order).

    Args:
        pairs: ``(sender, receiver)`` world ranks -> pair group (those including this rank).
        pair_orders: ``(sender, receiver)`` pipeline ranks -> the sender's messages in order.
    """

    def __init__(self, rank: int, pp: int, buffers: ReceiveBuffers, num_micro_batches: int, max_tensors: int,
                 pairs: dict[tuple[int, int], Any], pair_orders: dict[tuple[int, int], list[Message]]):
        super().__init__(rank, pp, buffers, num_micro_batches, max_tensors)
        self.pairs = pairs
        self.recv_order: dict[int, list[Message]] = {
            src: list(pair_orders.get((src % pp, dst % pp), [])) for src, dst in pairs if dst == rank}

    def post_recv(self, ins: Instruction, st: StepState) -> Posted:
        """The works of a RECV's messages, posting first whatever precedes them in the sender's order."""
        assert ins.peer is not None
        boundary, direction, j, bufs = self._recv_message(ins)
        src = self.world(ins.peer)
        works = []
        for k in range(len(bufs)):
            msg = (boundary, direction, j, k)
            self.post_until(src, msg, st)
            works.append(st.owork.pop((src, msg)))
        return bufs, works, src

    def post_until(self, src: int, msg: Message, st: StepState) -> None:
        """Post the receives from world rank ``src`` in ``src``'s send order up to and including
        ``msg``, each into its own buffer, on the ``src -> self`` pair group. A no-op when ``msg``
        is already posted. Raises :class:`WorkerError` when ``msg`` is not in that order."""
        if (src, msg) in st.owork:
            return
        order = self.recv_order.get(src, [])
        i = st.cursor.get(src, 0)
        group = self.pairs[(src, self.rank)]
        while i < len(order):
            m = order[i]
            i += 1
            st.owork[(src, m)] = dist.irecv(self.buffers.message(m), src, group=group, tag=0)
            if m == msg:
                break
        st.cursor[src] = i
        if (src, msg) not in st.owork:
            raise WorkerError(f"rank {self.rank} expects {describe_message(msg)} from rank {src}, which is not "
                              f"in rank {src}'s send order (or was received already)")

    def post_all(self, stream: Sequence[Instruction], st: StepState) -> None:
        # each pair group carries one direction only: early receives block no send
        for src, order in self.recv_order.items():
            if order:
                self.post_until(src, order[-1], st)

    def send(self, tensors: list[torch.Tensor], dst: int, boundary: int, direction: int, mb: int) -> list[Any]:
        group = self.pairs[(self.rank, dst)]   # the receiver posts its receives in this (stream) order
        return [dist.isend(t, dst, group=group, tag=0) for t in tensors]

    def eval_group(self, src: int, dst: int) -> Any:
        if src == self.rank:
            return self.pairs.get((src, dst))
        return self.pairs[(src, dst)]
