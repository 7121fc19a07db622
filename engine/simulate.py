"""Discrete-event simulation of instruction streams with a cost model.

Each rank has a compute stream that runs its instructions in order, a send stream that
serialises its outgoing transfers, and a collective stream for data-parallel all-reduces:

- ``F``/``B``/``I``/``W``: run for their duration on the compute stream; a block on several
  devices starts when all of them reach it. Memory: a positive delta is allocated at the
  block's start, a negative one freed at its end; a gradient buffer the block allocates
  (``hold``) is added at its start and kept until ``OPTIM``; its transient gradient is added at
  its start and freed at its end.
- ``SEND``: posts an asynchronous transfer; it starts when the send stream is free and
  lasts ``cost.p2p_time(nbytes, src, dst)``. The compute stream does not wait.
- ``RECV``: the compute stream waits until the matching transfer has arrived (receive
  buffers are pre-allocated, so no memory changes).
- ``ALLREDUCE`` (data-parallel, ``ranks`` empty): asynchronous on the collective stream
  (data-parallel replicas are symmetric, so one replica is simulated; the group is
  ``[r, r + n, ..., r + (dp-1) n]``); ``OPTIM`` waits for all of the rank's all-reduces and then
  runs for ``cost.optimizer_time(nbytes)``; the gradient buffers are freed at its end. A bucket of
  ``overlap-grad-sync`` (``ready < 1``) may start once that fraction of the rank's last compute
  block has run: its all-reduce overlaps the rest of the backward.
- ``REDUCESCATTER`` (``sharded-update``): like a data-parallel ALLREDUCE, timed as a
  reduce-scatter. ``ALLGATHER`` of a segment's parameters (``sharded-update``, after ``OPTIM``):
  asynchronous on the collective stream; the step ends when it has finished. ``ALLGATHER`` of a
  received block (``scatter-send``): blocking on the compute path, like ``ALLTOALL``, over the
  tensor group (``group`` ranks on the same link).
- ``ALLTOALL`` (MoE expert parallelism over the data-parallel ranks): blocking on the compute
  path. It starts when the rank's compute stream reaches it (``runtime.worker`` runs it on its
  own process group, so it does not queue behind a pending data-parallel all-reduce; link
  contention between the two is not modelled), lasts
  ``cost.collective_time("alltoall", nbytes, group)`` (the rank's ``group`` replicas
  ``[r, r + n, ...]``, i.e. its data-parallel group) and advances the rank's clock.
- Tied-weight ``ALLREDUCE`` (``ranks`` set): synchronous across the holding pipeline ranks, a
  barrier like a multi-device block. Each holder is ready once its compute stream reaches it AND
  its pending data-parallel all-reduces have finished (``runtime.worker`` waits for them first,
  then sums the tied gradients, then steps); it starts at the latest holder's ready time, lasts
  ``cost.collective_time("allreduce", nbytes, ranks)`` and advances every holder's clock.

Tensor-parallel collectives inside a block (``ExecutionPlan.tp_collectives``: Megatron's all-reduces,
or CoCoNet's ``tp-split`` reduce-scatters and all-gathers) are drawn within the block's span
(``"tp <kind> <block>"``; the block's duration already includes them).

Collective events (stream ``"collective"``): ``"allreduce s<segment>"`` (``"allreduce s<segment>
b<bucket>"``), ``"reducescatter s<segment>"``, ``"allgather s<segment>"``, ``"allgather <block>"``,
``"a2a <block>"``, ``"allreduce tied"``.

The result is a :class:`~engine.timeline.Timeline`, the same structure the runtime measures.
A rank that can never proceed raises :class:`~engine.errors.DeadlockError` naming every
waiting rank and instruction.
"""

from __future__ import annotations

from typing import Protocol, cast

from engine.dependency import COMPUTE_OPS, ExecutionPlan, Op
from engine.errors import DeadlockError
from engine.timeline import Event, Timeline


class CommCost(Protocol):
    """What the simulator needs from a cost model (``engine.cost.CostModel`` provides it)."""

    def p2p_time(self, nbytes: int, src: int, dst: int) -> float: ...

    def collective_time(self, kind: str, nbytes: int, ranks: list[int]) -> float: ...

    def optimizer_time(self, param_bytes: int) -> float: ...


class FreeComm:
    """A cost model in which communication and the optimizer take no time (abstract units)."""

    def p2p_time(self, nbytes: int, src: int, dst: int) -> float:
        return 0.0

    def collective_time(self, kind: str, nbytes: int, ranks: list[int]) -> float:
        return 0.0

    def optimizer_time(self, param_bytes: int) -> float:
        return 0.0


def simulate(plan: ExecutionPlan, cost: CommCost | None = None) -> Timeline:
    """Simulate one step of an execution plan.

    Args:
        plan: per-rank instruction streams from :func:`engine.dependency.lower`.
        cost: communication/optimizer costs (seconds); ``None`` means all free.

    Returns:
        The predicted :class:`Timeline` (events in seconds, memory in bytes).

    Raises:
        DeadlockError: some ranks wait forever; ``err.waiting`` maps rank -> instruction.
    """
    cost = cost or FreeComm()
    n = plan.num_ranks
    streams = plan.streams
    pc = [0] * n
    clock = [0.0] * n
    send_free = [0.0] * n
    coll_free = [0.0] * n
    coll_pending = [0.0] * n
    mem = list(plan.static_memory) if plan.static_memory else [0] * n
    mem_curve: list[list[tuple[float, int]]] = [[(0.0, mem[r])] for r in range(n)]
    arrivals: dict[tuple, tuple[float, float]] = {}  # (block, src, dst) -> (start, end)
    barrier: dict = {}  # multi-device block / tied all-reduce key -> ranks arrived
    # rank -> {ranks tuple: tied all-reduces passed}
    tied_seen: list[dict[tuple[int, ...], int]] = [dict() for _ in range(n)]
    events: list[Event] = []
    p2p = cost.p2p_time
    dp_ranks_cache: dict[int, list[int]] = {}
    last_block = [(0.0, 0.0)] * n   # (start, end) of each rank's latest compute block

    def dp_group(r: int) -> list[int]:
        g = dp_ranks_cache.get(r)
        if g is None:
            g = dp_ranks_cache[r] = [r + k * n for k in range(plan.dp)]
        return g

    def run_compute(ranks: list[int], ins) -> None:
        start = max(clock[r] for r in ranks)
        end = start + ins.duration
        name = str(ins.block)
        inner = plan.tp_collectives.get(ins.block.segment, ()) if ins.op in (Op.F, Op.B, Op.I) else ()
        if ins.op != Op.F:
            inner = tuple(reversed(inner))
        gap = max(0.0, ins.duration - sum(c[2] for c in inner)) / len(inner) if inner else 0.0
        for r in ranks:
            events.append(Event(r, "compute", ins.op, name, start, end, 0, ins.block.micro_batch, ins.block.segment))
            clock[r] = end
            last_block[r] = (start, end)
            t = start
            for kind, nb, sec in inner:   # tensor-parallel collectives inside the block (its duration has them)
                t += gap
                events.append(Event(r, "collective", kind.upper(), f"tp {kind} {name}", t, t + sec, nb,
                                    ins.block.micro_batch, ins.block.segment))
                t += sec
            up = max(ins.memory, 0) + ins.hold + ins.transient
            if up:
                mem[r] += up
                mem_curve[r].append((start, mem[r]))
            down = min(ins.memory, 0) - ins.transient
            if down:
                mem[r] += down
                mem_curve[r].append((end, mem[r]))
            pc[r] += 1

    # span of each compute block instance = number of ranks whose stream holds it
    span: dict = {}
    for r in range(n):
        for ins in streams[r]:
            if ins.op in COMPUTE_OPS:
                span[ins.block] = span.get(ins.block, 0) + 1

    remaining = n
    done = [len(streams[r]) == 0 for r in range(n)]
    remaining -= sum(done)
    while remaining:
        progressed = False
        for r in range(n):
            if done[r]:
                continue
            stream = streams[r]
            while pc[r] < len(stream):
                ins = stream[pc[r]]
                op = ins.op
                if op == Op.SEND:
                    assert ins.block is not None
                    start = max(clock[r], send_free[r])
                    end = start + p2p(ins.nbytes, r, cast(int, ins.peer))
                    send_free[r] = end
                    arrivals[(ins.block, r, ins.peer)] = (start, end)
                    events.append(Event(r, "send", "SEND", f"{ins.block}>{ins.peer}", start, end, ins.nbytes,
                                        ins.block.micro_batch, ins.block.segment))
                    pc[r] += 1
                elif op == Op.RECV:
                    a = arrivals.get((ins.block, ins.peer, r))
                    if a is None:
                        break
                    assert ins.block is not None
                    events.append(Event(r, "recv", "RECV", f"{ins.block}<{ins.peer}", a[0], a[1], ins.nbytes,
                                        ins.block.micro_batch, ins.block.segment))
                    if a[1] > clock[r]:
                        clock[r] = a[1]
                    pc[r] += 1
                elif op == Op.ALLREDUCE and ins.ranks:
                    key = ("tied", ins.ranks, tied_seen[r].get(ins.ranks, 0))
                    arrived = barrier.setdefault(key, [])
                    if r not in arrived:
                        arrived.append(r)
                    holders = sorted({h for h in ins.ranks if 0 <= h < n} | {r})
                    if any(h not in arrived for h in holders):
                        break
                    del barrier[key]
                    start = max(max(clock[h], coll_pending[h]) for h in holders)
                    end = start + cost.collective_time("allreduce", ins.nbytes, list(ins.ranks))
                    for h in holders:
                        events.append(Event(h, "collective", "ALLREDUCE", "allreduce tied", start, end, ins.nbytes,
                                            -1, -1))
                        clock[h] = end
                        coll_free[h] = max(coll_free[h], end)
                        tied_seen[h][ins.ranks] = tied_seen[h].get(ins.ranks, 0) + 1
                        pc[h] += 1
                elif op == Op.ALLTOALL:
                    start = clock[r]
                    group = dp_group(r) if ins.group == plan.dp else [r + k * n for k in range(max(1, ins.group))]
                    end = start + cost.collective_time("alltoall", ins.nbytes, group)
                    clock[r] = end
                    blk = ins.block
                    events.append(Event(r, "collective", "ALLTOALL", f"a2a {blk}", start, end, ins.nbytes,
                                        blk.micro_batch if blk is not None else -1,
                                        ins.segment if ins.segment is not None else -1))
                    pc[r] += 1
                elif op == Op.ALLGATHER and ins.block is not None:   # scatter-send: the tensor group's gather
                    start = clock[r]
                    end = start + cost.collective_time("allgather", ins.nbytes, [r + k * n for k in range(ins.group)])
                    clock[r] = end
                    events.append(Event(r, "collective", "ALLGATHER", f"allgather {ins.block}", start, end,
                                        ins.nbytes, ins.block.micro_batch, ins.block.segment))
                    pc[r] += 1
                elif op in (Op.ALLREDUCE, Op.REDUCESCATTER, Op.ALLGATHER):
                    ready = clock[r]
                    if ins.ready < 1.0:   # a gradient bucket: final part-way through the last backward
                        b0, b1 = last_block[r]
                        ready = b0 + ins.ready * (b1 - b0)
                    start = max(ready, coll_free[r])
                    kind = str(op).lower()
                    end = start + cost.collective_time(kind, ins.nbytes, dp_group(r))
                    coll_free[r] = end
                    coll_pending[r] = max(coll_pending[r], end)
                    label = f"{kind} s{ins.segment}" + (f" b{ins.bucket}" if ins.bucket is not None else "")
                    events.append(Event(r, "collective", str(op), label, start, end,
                                        ins.nbytes, -1, ins.segment if ins.segment is not None else -1))
                    pc[r] += 1
                elif op == Op.OPTIM:
                    start = max(clock[r], coll_pending[r])
                    end = start + cost.optimizer_time(ins.nbytes)
                    events.append(Event(r, "compute", "OPTIM", "optimizer", start, end, ins.nbytes, -1, -1))
                    clock[r] = end
                    if ins.memory:
                        mem[r] += ins.memory
                        mem_curve[r].append((end, mem[r]))
                    pc[r] += 1
                else:  # compute
                    k = span.get(ins.block, 1)
                    if k == 1:
                        run_compute([r], ins)
                    else:
                        arrived = barrier.setdefault(ins.block, [])
                        if r not in arrived:
                            arrived.append(r)
                        if len(arrived) < k:
                            break
                        del barrier[ins.block]
                        run_compute(arrived, ins)
                progressed = True
            if pc[r] >= len(stream) and not done[r]:
                done[r] = True
                remaining -= 1
                progressed = True
        if not progressed and remaining:
            # ranks finished by another rank's multi-device block are not deadlocked
            for r in range(n):
                if not done[r] and pc[r] >= len(streams[r]):
                    done[r] = True
                    remaining -= 1
            if not remaining:
                break
            waiting = {r: str(streams[r][pc[r]]) for r in range(n) if not done[r]}
            detail = "; ".join(f"rank {r} waits at {w}" for r, w in waiting.items())
            raise DeadlockError(f"the instruction streams deadlock: {detail}", waiting)
    return Timeline(events, mem_curve, n, list(plan.static_memory))
