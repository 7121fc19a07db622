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
  (data-parallel replicas are symmetric, so one replica is simulated; the group is the device
  ids of the rank's data-parallel group in the plan's layout, :mod:`engine.layout`); ``OPTIM``
  waits for all of the rank's all-reduces and then runs for ``cost.optimizer_time(nbytes)``; the
  gradient buffers are freed at its end. A bucket of ``overlap-grad-sync`` (``ready < 1``) may
  start once that fraction of the rank's last compute block has run: its all-reduce overlaps
  the rest of the backward.
- ``REDUCESCATTER`` (``sharded-update``): like a data-parallel ALLREDUCE, timed as a
  reduce-scatter. ``ALLGATHER`` of a segment's parameters (``sharded-update``, after ``OPTIM``):
  asynchronous on the collective stream; the step ends when it has finished. ``ALLGATHER`` of a
  received block (``scatter-send``): blocking on the compute path, like ``ALLTOALL``, over the
  tensor group (``group`` ranks on the same link).
- ``ALLTOALL`` (MoE expert parallelism over the data-parallel ranks): blocking on the compute
  path. It starts when the rank's compute stream reaches it (``runtime.worker`` runs it on its
  own process group, so it does not queue behind a pending data-parallel all-reduce; link
  contention between the two is not modelled), lasts
  ``cost.collective_time("alltoall", nbytes, group)`` (its data-parallel group's devices) and
  advances the rank's clock.
- Tied-weight ``ALLREDUCE`` (``ranks`` set): synchronous across the holding pipeline ranks, a
  barrier like a multi-device block. Each holder is ready once its compute stream reaches it AND
  its pending data-parallel all-reduces have finished (``runtime.worker`` waits for them first,
  then sums the tied gradients, then steps); it starts at the latest holder's ready time, lasts
  ``cost.collective_time("allreduce", nbytes, ranks)`` and advances every holder's clock.

**Device ids.** A stream is one pipeline rank ``r`` of data-parallel replica 0 with its ``tp``
tensor ranks folded into it (a block's duration includes its tensor-parallel collectives). Every
transfer and collective is timed between the DEVICE ids of the ranks taking part
(:meth:`engine.dependency.ExecutionPlan.device_of` / ``device_group``, from the plan's
:mod:`engine.layout`: Megatron's ``tp-dp-pp`` puts rank ``r`` on device ``tp * dp * r``; the
``legacy`` layout of older plans on device ``r``), so the cost model, which puts device ``i`` on
node ``i // devices_per_node``, picks the link the real ranks share.

Tensor-parallel collectives inside a block (``ExecutionPlan.tp_collectives``: Megatron's all-reduces,
or CoCoNet's ``tp-split`` reduce-scatters and all-gathers) are drawn within the block's span
(``"tp <kind> <block>"``; the block's duration already includes them).

- ``UNSHARD`` (fully sharded data parallelism, :mod:`engine.dependency.fsdp`): kept until the
  compute block it precedes, which then runs unit by unit, each unit's all-gather (over the shard
  group, on a gather stream of its own) issued when the previous unit starts computing (FSDP2's
  prefetch) and the unit's compute waiting for it (:meth:`SimState.run_units`); its memory
  allocated at the gather's start, freed at the unit's end when ``transient``. ``RESHARD``
  frees a segment's gathered parameters. FSDP's ``REDUCESCATTER`` of a unit (``block`` set) over
  the shard group, and HSDP's ``ALLREDUCE`` of its shard over the replicate group, are posted on
  the collective stream when the unit's share of the block has run; ``OPTIM`` waits for them.

Collective events (stream ``"collective"``): ``"allreduce s<segment>"`` (``"allreduce s<segment>
b<bucket>"``), ``"reducescatter s<segment>"``, ``"allgather s<segment>"``, ``"allgather <block>"``,
``"a2a <block>"``, ``"allreduce tied"``, ``"unshard s<segment> u<unit> <block>"``,
``"reducescatter s<segment> u<unit> <block>"``.

Each op has one handler (:data:`HANDLERS`, keyed by :class:`~engine.dependency.Op` like the
runtime's ``runtime.worker.interpreter.HANDLERS``) over a :class:`SimState` holding the clocks,
the streams' free times and the memory; a handler returns whether its instruction ran or the
rank must wait.

The result is a :class:`~engine.timeline.Timeline`, the same structure the runtime measures.
A rank that can never proceed raises :class:`~engine.errors.DeadlockError` naming every
waiting rank and instruction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, cast

from engine.dependency import COMPUTE_OPS, ExecutionPlan, Instruction, Op
from engine.errors import DeadlockError
from engine.layout import LEGACY
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


@dataclass(slots=True)
class SimState:
    """The simulator's state while it runs one step (seconds from the step's start, bytes).

    Attributes:
        plan: the instruction streams simulated.
        cost: the cost model.
        pc: per rank, the index of its next instruction.
        clock: per rank, when its compute stream is free.
        send_free: per rank, when its send stream is free.
        coll_free: per rank, when its collective stream is free.
        coll_pending: per rank, when its last posted data-parallel collective ends (``OPTIM`` waits for it).
        mem: per rank, the bytes allocated now; ``mem_curve`` their ``(time, bytes)`` steps.
        arrivals: ``(block, src, dst)`` -> ``(start, end)`` of each posted transfer.
        barrier: a multi-device block (or a tied all-reduce's key) -> the ranks that reached it.
        tied_seen: per rank, ``{ranks: tied all-reduces passed}``.
        last_block: per rank, ``(start, end)`` of its latest compute block.
        span: a compute block -> the number of ranks whose stream holds it.
        events: the timeline's events so far.
        dp_groups, devices: per rank, its data-parallel group's device ids and its device id
            (:mod:`engine.layout`, cached).
        gather_free: per rank, when its FSDP all-gather stream is free (FSDP2 all-gathers on a
            stream of their own, apart from its reduce-scatters).
        pending_unshard: per rank, the ``UNSHARD`` s read but not yet run: they run with the
            compute block they precede (:meth:`run_units`).
        unit_end: ``(rank, block, unit)`` -> when that FSDP unit's share of the block ended (its
            reduce-scatter's ready time).
    """

    plan: ExecutionPlan
    cost: CommCost
    pc: list[int]
    clock: list[float]
    send_free: list[float]
    coll_free: list[float]
    coll_pending: list[float]
    mem: list[int]
    mem_curve: list[list[tuple[float, int]]]
    last_block: list[tuple[float, float]]
    tied_seen: list[dict[tuple[int, ...], int]]
    span: dict
    arrivals: dict[tuple, tuple[float, float]] = field(default_factory=dict)
    barrier: dict = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    dp_groups: dict[int, list[int]] = field(default_factory=dict)
    devices: dict[int, int] = field(default_factory=dict)
    gather_free: dict[int, float] = field(default_factory=dict)
    pending_unshard: dict[int, list[Instruction]] = field(default_factory=dict)
    unit_end: dict[tuple, float] = field(default_factory=dict)

    @classmethod
    def start(cls, plan: ExecutionPlan, cost: CommCost) -> "SimState":
        """Every rank at time 0 with its static memory."""
        n = plan.num_ranks
        mem = list(plan.static_memory) if plan.static_memory else [0] * n
        span: dict = {}
        for stream in plan.streams:
            for ins in stream:
                if ins.op in COMPUTE_OPS:
                    span[ins.block] = span.get(ins.block, 0) + 1
        return cls(plan, cost, pc=[0] * n, clock=[0.0] * n, send_free=[0.0] * n, coll_free=[0.0] * n,
                   coll_pending=[0.0] * n, mem=mem, mem_curve=[[(0.0, mem[r])] for r in range(n)],
                   last_block=[(0.0, 0.0)] * n, tied_seen=[dict() for _ in range(n)], span=span)

    def dp_group(self, r: int) -> list[int]:
        """The device ids of rank ``r``'s data-parallel group
        (:meth:`~engine.dependency.ExecutionPlan.device_group`: in the default layout
        ``[t + tp*d + tp*dp*r for d in range(dp)]`` with ``t = 0``; legacy ``[r, r + n, ...]``)."""
        g = self.dp_groups.get(r)
        if g is None:
            g = self.dp_groups[r] = self.plan.device_group("data", r)
        return g

    def device(self, r: int) -> int:
        """The device id of pipeline rank ``r``'s stream (:meth:`~engine.dependency.ExecutionPlan.device_of`)."""
        d = self.devices.get(r)
        if d is None:
            d = self.devices[r] = self.plan.device_of(r)
        return d

    def run_units(self, r: int, ins: Instruction, start: float) -> tuple[float, list[tuple[float, int]]]:
        """Compute block ``ins`` on rank ``r`` from ``start`` unit by unit with its pending
        ``UNSHARD`` s (fully sharded data parallelism, :mod:`engine.dependency.fsdp`): unit ``k``
        computes for its share (``ready``) of the block's duration once its all-gather has ended;
        the all-gather runs on the rank's gather stream, issued when unit ``k - 1`` starts
        computing (FSDP2's prefetch of one unit; the first when the block is reached), so it
        overlaps the previous unit's compute. Returns when the last pending unit ends and the memory
        changes ``(time, bytes)``: each gather's bytes at its start, freed at its unit's end when
        ``transient``. The share no pending unit covers (a backward's root, still gathered) runs
        after them: :meth:`run_compute` ends the block no earlier than its full duration."""
        pending = self.pending_unshard.pop(r, [])
        blk = ins.block
        group = self.plan.shard_group(r)
        mem: list[tuple[float, int]] = []
        t = issue = start
        for u in pending:
            g0 = max(issue, self.gather_free.get(r, 0.0))
            g1 = g0 + (self.cost.collective_time("allgather", u.nbytes, group) if u.nbytes else 0.0)
            self.gather_free[r] = g1
            if u.nbytes:
                self.events.append(Event(r, "collective", "ALLGATHER", f"unshard s{u.segment} u{u.bucket} {blk}",
                                         g0, g1, u.nbytes, blk.micro_batch if blk is not None else -1,
                                         u.segment if u.segment is not None else -1))
            if u.memory:
                mem.append((g0, u.memory))
            us = max(t, g1)
            t = us + u.ready * ins.duration
            issue = us
            self.unit_end[(r, blk, u.bucket)] = t
            if u.transient:
                mem.append((t, -u.transient))
        return t, mem

    def run_compute(self, ranks: list[int], ins: Instruction) -> None:
        """Run compute block ``ins`` on ``ranks`` together: its event, the tensor-parallel
        collectives drawn inside it, its memory, and each rank's clock and ``pc``. A rank with
        pending ``UNSHARD`` s runs it unit by unit (:meth:`run_units`)."""
        start = max(self.clock[r] for r in ranks)
        end = start + ins.duration
        units = {r: self.run_units(r, ins, start) for r in ranks if self.pending_unshard.get(r)}
        if units:
            end = max(end, *(e for e, _ in units.values()))
        blk = ins.block
        assert blk is not None
        name = str(blk)
        inner = self.plan.tp_collectives.get(blk.segment, ()) if ins.op in (Op.F, Op.B, Op.I) else ()
        if ins.op != Op.F:
            inner = tuple(reversed(inner))
        gap = max(0.0, ins.duration - sum(c[2] for c in inner)) / len(inner) if inner else 0.0
        up = max(ins.memory, 0) + ins.hold + ins.transient
        down = min(ins.memory, 0) - ins.transient
        for r in ranks:
            self.events.append(Event(r, "compute", ins.op, name, start, end, 0, blk.micro_batch, blk.segment))
            self.clock[r] = end
            self.last_block[r] = (start, end)
            t = start
            for kind, nb, sec in inner:   # tensor-parallel collectives inside the block (its duration has them)
                t += gap
                self.events.append(Event(r, "collective", kind.upper(), f"tp {kind} {name}", t, t + sec, nb,
                                         blk.micro_batch, blk.segment))
                t += sec
            changes = [(start, up), (end, down)]
            if r in units:   # the gathered units' memory, in time order (a unit freed before the next is gathered)
                changes = sorted([changes[0], *units[r][1], changes[1]], key=lambda c: (c[0], c[1] > 0))
            for when, delta in (c for c in changes if c[1]):
                self.mem[r] += delta
                self.mem_curve[r].append((when, self.mem[r]))
            self.pc[r] += 1


#: A handler runs rank ``r``'s next instruction and returns ``True``, or returns ``False`` when
#: the rank must wait (a transfer not yet posted, a multi-rank barrier not yet complete).
Handler = Callable[[SimState, int, Instruction], bool]


def _compute(s: SimState, r: int, ins: Instruction) -> bool:
    """``F``/``B``/``I``/``W``: a block on several ranks starts when all of them reach it."""
    k = s.span.get(ins.block, 1)
    if k == 1:
        s.run_compute([r], ins)
        return True
    arrived = s.barrier.setdefault(ins.block, [])
    if r not in arrived:
        arrived.append(r)
    if len(arrived) < k:
        return False
    del s.barrier[ins.block]
    s.run_compute(arrived, ins)
    return True


def _send(s: SimState, r: int, ins: Instruction) -> bool:
    """``SEND``: posted on the send stream once it is free; the compute stream does not wait."""
    blk = ins.block
    assert blk is not None
    start = max(s.clock[r], s.send_free[r])
    end = start + s.cost.p2p_time(ins.nbytes, s.device(r), s.device(cast(int, ins.peer)))
    s.send_free[r] = end
    s.arrivals[(blk, r, ins.peer)] = (start, end)
    s.events.append(Event(r, "send", "SEND", f"{blk}>{ins.peer}", start, end, ins.nbytes, blk.micro_batch,
                          blk.segment))
    s.pc[r] += 1
    return True


def _recv(s: SimState, r: int, ins: Instruction) -> bool:
    """``RECV``: waits until the matching transfer has been posted, then until it has arrived."""
    a = s.arrivals.get((ins.block, ins.peer, r))
    if a is None:
        return False
    blk = ins.block
    assert blk is not None
    s.events.append(Event(r, "recv", "RECV", f"{blk}<{ins.peer}", a[0], a[1], ins.nbytes, blk.micro_batch,
                          blk.segment))
    if a[1] > s.clock[r]:
        s.clock[r] = a[1]
    s.pc[r] += 1
    return True


def _tied_allreduce(s: SimState, r: int, ins: Instruction) -> bool:
    """A tied-weight ``ALLREDUCE``: a barrier of its holders, each ready once its compute stream
    reached it and its data-parallel collectives finished; advances every holder."""
    key = ("tied", ins.ranks, s.tied_seen[r].get(ins.ranks, 0))
    arrived = s.barrier.setdefault(key, [])
    if r not in arrived:
        arrived.append(r)
    holders = sorted({h for h in ins.ranks if 0 <= h < s.plan.num_ranks} | {r})
    if any(h not in arrived for h in holders):
        return False
    del s.barrier[key]
    start = max(max(s.clock[h], s.coll_pending[h]) for h in holders)
    end = start + s.cost.collective_time("allreduce", ins.nbytes, [s.device(h) if 0 <= h < s.plan.num_ranks else h
                                                                   for h in ins.ranks])
    for h in holders:
        s.events.append(Event(h, "collective", "ALLREDUCE", "allreduce tied", start, end, ins.nbytes, -1, -1))
        s.clock[h] = end
        s.coll_free[h] = max(s.coll_free[h], end)
        s.tied_seen[h][ins.ranks] = s.tied_seen[h].get(ins.ranks, 0) + 1
        s.pc[h] += 1
    return True


def _dp_collective(s: SimState, r: int, ins: Instruction) -> bool:
    """A data-parallel ``ALLREDUCE`` / ``REDUCESCATTER`` / parameter ``ALLGATHER``: posted on the
    collective stream (a bucket with ``ready < 1`` once that fraction of the last block ran)."""
    ready = s.clock[r]
    if ins.ready < 1.0:   # a gradient bucket: final part-way through the last backward
        b0, b1 = s.last_block[r]
        ready = b0 + ins.ready * (b1 - b0)
    start = max(ready, s.coll_free[r])
    kind = str(ins.op).lower()
    end = start + s.cost.collective_time(kind, ins.nbytes, s.dp_group(r))
    s.coll_free[r] = end
    s.coll_pending[r] = max(s.coll_pending[r], end)
    label = f"{kind} s{ins.segment}" + (f" b{ins.bucket}" if ins.bucket is not None else "")
    s.events.append(Event(r, "collective", str(ins.op), label, start, end, ins.nbytes, -1,
                          ins.segment if ins.segment is not None else -1))
    s.pc[r] += 1
    return True


def _allreduce(s: SimState, r: int, ins: Instruction) -> bool:
    """``ALLREDUCE``: tied weights (``ranks`` set), HSDP's shard (``block`` set) or data-parallel gradients."""
    if ins.ranks:
        return _tied_allreduce(s, r, ins)
    return _fsdp_collective(s, r, ins) if ins.block is not None else _dp_collective(s, r, ins)


def _reducescatter(s: SimState, r: int, ins: Instruction) -> bool:
    """``REDUCESCATTER``: FSDP's per unit (``block`` set) or the sharded update's."""
    return _fsdp_collective(s, r, ins) if ins.block is not None else _dp_collective(s, r, ins)


def _alltoall(s: SimState, r: int, ins: Instruction) -> bool:
    """``ALLTOALL``: blocking on the compute path over the rank's expert-parallel group."""
    start = s.clock[r]
    group = s.dp_group(r)
    if ins.group != s.plan.dp:   # a hand-built stream's group: the first ``group`` replicas' devices
        n = s.plan.num_ranks
        group = [r + k * n for k in range(max(1, ins.group))] if s.plan.layout == LEGACY \
            else [s.plan.rank_layout().device(0, k, r) for k in range(min(max(1, ins.group), s.plan.dp))]
    end = start + s.cost.collective_time("alltoall", ins.nbytes, group)
    s.clock[r] = end
    blk = ins.block
    s.events.append(Event(r, "collective", "ALLTOALL", f"a2a {blk}", start, end, ins.nbytes,
                          blk.micro_batch if blk is not None else -1, ins.segment if ins.segment is not None else -1))
    s.pc[r] += 1
    return True


def _allgather(s: SimState, r: int, ins: Instruction) -> bool:
    """``ALLGATHER``: of a received block (scatter-send: blocking, over the tensor group) or of a
    segment's parameters (sharded-update: a data-parallel collective)."""
    blk = ins.block
    if blk is None:
        return _dp_collective(s, r, ins)
    start = s.clock[r]
    n = s.plan.num_ranks
    group = [r + k * n for k in range(ins.group)] if s.plan.layout == LEGACY \
        else s.plan.device_group("tensor", r)[:max(1, ins.group)]
    end = start + s.cost.collective_time("allgather", ins.nbytes, group)
    s.clock[r] = end
    s.events.append(Event(r, "collective", "ALLGATHER", f"allgather {blk}", start, end, ins.nbytes, blk.micro_batch,
                          blk.segment))
    s.pc[r] += 1
    return True


def _unshard(s: SimState, r: int, ins: Instruction) -> bool:
    """``UNSHARD``: kept for the compute block it precedes, which runs it (:meth:`SimState.run_units`)."""
    s.pending_unshard.setdefault(r, []).append(ins)
    s.pc[r] += 1
    return True


def _reshard(s: SimState, r: int, ins: Instruction) -> bool:
    """``RESHARD``: frees a segment's gathered parameters when the rank's compute stream reaches it."""
    if ins.memory:
        s.mem[r] += ins.memory
        s.mem_curve[r].append((s.clock[r], s.mem[r]))
    s.pc[r] += 1
    return True


def _fsdp_collective(s: SimState, r: int, ins: Instruction) -> bool:
    """FSDP's ``REDUCESCATTER`` of one unit's gradients over the shard group, or HSDP's
    ``ALLREDUCE`` of its shard over the replicate group (``block`` set): posted on the collective
    stream once the unit's share of ``block`` has run."""
    ready = s.unit_end.get((r, ins.block, ins.bucket))
    if ready is None:
        b0, b1 = s.last_block[r]
        ready = b0 + ins.ready * (b1 - b0)
    start = max(ready, s.coll_free[r])
    kind = str(ins.op).lower()
    group = s.plan.shard_group(r) if ins.op == Op.REDUCESCATTER else s.plan.replicate_group(r)
    end = start + s.cost.collective_time(kind, ins.nbytes, group)
    s.coll_free[r] = end
    s.coll_pending[r] = max(s.coll_pending[r], end)
    blk = ins.block
    assert blk is not None
    s.events.append(Event(r, "collective", str(ins.op), f"{kind} s{ins.segment} u{ins.bucket} {blk}", start, end,
                          ins.nbytes, blk.micro_batch, ins.segment if ins.segment is not None else -1))
    s.pc[r] += 1
    return True


def _optim(s: SimState, r: int, ins: Instruction) -> bool:
    """``OPTIM``: after the rank's data-parallel collectives; frees the gradient buffers at its end."""
    start = max(s.clock[r], s.coll_pending[r])
    end = start + s.cost.optimizer_time(ins.nbytes)
    s.events.append(Event(r, "compute", "OPTIM", "optimizer", start, end, ins.nbytes, -1, -1))
    s.clock[r] = end
    if ins.memory:
        s.mem[r] += ins.memory
        s.mem_curve[r].append((end, s.mem[r]))
    s.pc[r] += 1
    return True


#: The handler of each op (:class:`Op` is a ``StrEnum``: a plain-string op finds its handler too);
#: an op missing here runs as a compute block.
HANDLERS: dict[str, Handler] = {
    Op.F: _compute, Op.B: _compute, Op.I: _compute, Op.W: _compute,
    Op.SEND: _send, Op.RECV: _recv, Op.ALLREDUCE: _allreduce, Op.ALLTOALL: _alltoall,
    Op.REDUCESCATTER: _reducescatter, Op.ALLGATHER: _allgather, Op.OPTIM: _optim,
    Op.UNSHARD: _unshard, Op.RESHARD: _reshard,
}


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
    s = SimState.start(plan, cost or FreeComm())
    n = plan.num_ranks
    streams = plan.streams
    done = [len(streams[r]) == 0 for r in range(n)]
    remaining = n - sum(done)
    while remaining:
        progressed = False
        for r in range(n):
            if done[r]:
                continue
            stream = streams[r]
            while s.pc[r] < len(stream):
                ins = stream[s.pc[r]]
                if not HANDLERS.get(ins.op, _compute)(s, r, ins):
                    break
                progressed = True
            if s.pc[r] >= len(stream):
                done[r] = True
                remaining -= 1
                progressed = True
        if not progressed and remaining:
            remaining = _check_deadlock(s, done, remaining)
    return Timeline(s.events, s.mem_curve, n, list(plan.static_memory))


def _check_deadlock(s: SimState, done: list[bool], remaining: int) -> int:
    """After a round without progress: ranks finished by another rank's multi-device block are
    done (returns the ranks still running, 0 when none); any other waiting rank is a deadlock.

    Raises:
        DeadlockError: naming every waiting rank and its instruction.
    """
    streams = s.plan.streams
    for r in range(len(streams)):
        if not done[r] and s.pc[r] >= len(streams[r]):
            done[r] = True
            remaining -= 1
    if not remaining:
        return 0
    waiting = {r: str(streams[r][s.pc[r]]) for r in range(len(streams)) if not done[r]}
    detail = "; ".join(f"rank {r} waits at {w}" for r, w in waiting.items())
    raise DeadlockError(f"the instruction streams deadlock: {detail}", waiting)
