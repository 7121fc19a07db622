"""A stage worker's tensor-parallel communication outside the DTensor modules: CoCoNet's
``scatter-send``.

CoCoNet (Jangda et al., "Breaking the Computation and Communication Abstraction Barrier in
Distributed Machine Learning Workloads", ASPLOS 2022, section 6.3, its pipeline-parallel example):
with tensor parallelism inside each pipeline stage, the activation a stage sends to the next is
replicated on the ``tp`` ranks of its tensor group, and each tensor rank sends the whole tensor to
the same tensor rank of the next stage: ``tp`` copies of the same bytes cross the (slow)
inter-stage link. Instead each tensor rank sends only its ``1/tp`` slice (along the sequence,
``torch.chunk(tp, dim=1)[tp_rank]`` of ``[B, T, H]``, :meth:`runtime.worker.p2p.P2PMatcher.wire`),
and the receiving tensor group all-gathers the slices over its (fast) intra-stage link. The
runtime does this in both directions: activations after ``F`` and the input gradients sent back
after ``B``/``I`` (they are replicated over the consumer's tensor group too: DTensor all-reduces
the input gradient of the column-parallel layers). ``engine.dependency.lower`` emits, after each
such ``RECV`` (forward and backward), an ``ALLGATHER`` with ``block`` set to the received block,
``nbytes`` the whole boundary's bytes and ``group = tp``; the interpreter dispatches it here.

With ``tp-split`` the boundary is already this rank's ``[B, T/tp, H]`` sequence shard: it is sent
as is and no all-gather follows (``runtime.tensor_parallel``). Reached only for plans whose
transformations ``runtime.stages.checks.EXECUTED_TRANSFORMS`` lists.
"""

from __future__ import annotations

import torch.distributed as dist

from engine.dependency import Instruction
from engine.timeline import Event
from runtime.worker.context import RankCoords, Transport
from runtime.worker.dataflow import Dataflow
from runtime.worker.errors import WorkerError
from runtime.worker.step_state import StepState

__all__ = ["gather_boundary"]


def gather_boundary(ins: Instruction, st: StepState, *, coords: RankCoords, flow: Dataflow,
                    transport: Transport) -> None:
    """``ALLGATHER`` of a received block (``scatter-send``): all-gather the ``1/tp`` slices of its
    boundary tensors (the wire buffers ``[B, T/tp, H]`` its ``RECV`` filled) from this rank's tensor
    group (``dist.all_gather_into_tensor`` into the staging buffer ``[tp * B, T/tp, H]``, then one copy
    into the whole receive buffer ``[B, T, H]``, slice ``k`` at positions ``[k*T/tp, (k+1)*T/tp)``).
    Blocks until done; one ``collective`` event ``"allgather <block>"`` with the whole tensors' bytes.
    ``coords``: this rank; ``flow``: the placement's DAG; ``transport``: its buffers and tensor group.

    Raises:
        WorkerError: the plan does not slice boundaries (no ``scatter-send``), or nothing was received
            for the block.
    """
    pb = ins.block
    assert pb is not None
    bufs = transport.buffers
    tp_mesh = transport.groups.tp_mesh
    if bufs.wire_parts == 1 or tp_mesh is None:
        raise WorkerError(f"{ins} gathers a boundary slice, but this worker sends whole boundaries "
                          "(its plan has no 'scatter-send' with tp > 1)")
    j = pb.micro_batch
    if pb.kind == "F":
        key, whole, wire = (pb.segment, j), bufs.act, bufs.wire_act
    else:
        key, whole, wire = (flow.grad_producer(pb.segment, coords.pp_rank), j), bufs.grad, bufs.wire_grad
    if key not in wire:
        raise WorkerError(f"{ins}: pipeline rank {coords.pp_rank} received nothing for {pb}")
    group = tp_mesh.get_group()
    parts = bufs.wire_parts
    start = st.now()
    for full, piece in zip(whole[key], wire[key]):
        staging = bufs.staging(piece)
        dist.all_gather_into_tensor(staging, piece, group=group)
        b, t = piece.shape[0], piece.shape[1]
        rest = tuple(piece.shape[2:])
        # staging [parts, B, T/parts, ...] -> full [B, parts, T/parts, ...]
        full.view(b, parts, t, *rest).copy_(staging.view(parts, b, t, *rest).transpose(0, 1))
    if transport.sync is not None:
        transport.sync()
    st.events.append(Event(coords.rank, "collective", "ALLGATHER", f"allgather {pb}", start, st.now(),
                           sum(x.numel() * x.element_size() for x in whole[key]), j, pb.segment))
