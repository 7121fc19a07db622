"""SuperScaler phase 3: lower a schedule into per-rank instruction streams.

Every tensor that crosses devices gets a ``SEND`` right after its producer and a ``RECV``
right before its consumer; data-parallel gradients get an ``ALLREDUCE`` after a segment's
last backward on a rank; every training stream ends with an ``OPTIM`` step.

Gradient memory: a weight-gradient block (``B``/``W``) carries the gradient buffer it allocates
(``hold``, Adam with gradient accumulation: the segment's first weight-gradient block on the
rank) and its transient micro-batch gradient (``transient``, see
:func:`engine.schedule.gradient_events`); ``OPTIM`` frees the held buffers (``memory``).

Deadlock freedom. ``SEND`` is asynchronous (an ``isend`` whose completion is awaited at the
end of the step) and ``RECV`` blocks until its tensor has arrived, so a rank only ever waits
for a block that some rank has already ordered. If the schedule's orders plus the
placement's dependencies form no cycle (``engine.schedule.validate`` rule ``deadlock``),
every wait is eventually satisfied: the instruction streams cannot deadlock. The simulator
re-checks this and names the waiting ranks if a hand-built stream breaks it. (With NCCL,
whose p2p kernels serialise on one stream, the runtime must post each rank's sends and recvs
for one step boundary together (``batch_isend_irecv``), as torch.distributed.pipelining does.)

Source: Lin et al., "SuperScaler: Supporting Flexible DNN Parallelization via a Unified
Abstraction" (2023), section 3 ("data dependency preserving").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from engine.placement import TensorSpec
from engine.schedule import Block, Schedule, gradient_events

COMPUTE_OPS = ("F", "B", "I", "W")
INSTRUCTION_OPS = COMPUTE_OPS + ("SEND", "RECV", "ALLREDUCE", "OPTIM")


@dataclass(frozen=True, slots=True)
class Instruction:
    """One step of a rank's instruction stream.

    Attributes:
        op: ``F``/``B``/``I``/``W`` (compute), ``SEND``, ``RECV``, ``ALLREDUCE`` or ``OPTIM``.
        block: the block computed, or whose output is sent/received; ``None`` for OPTIM.
        peer: destination rank of a SEND, source rank of a RECV.
        tensor: static shape and dtype of the transferred tensor (SEND/RECV).
        nbytes: bytes transferred (SEND/RECV) or reduced (ALLREDUCE) or updated (OPTIM).
        duration: compute seconds (F/B/I/W), 0 otherwise (communication time comes from the cost model).
        memory: bytes allocated (+) / freed (-) by a compute block on this rank; for ``OPTIM``,
            minus the gradient buffers it releases (``zero_grad`` after the update).
        hold: gradient-buffer bytes a compute block allocates at its start and that stay until
            the ``OPTIM`` step.
        transient: bytes a compute block holds only while it runs (a micro-batch gradient).
        segment: the segment whose gradients an ALLREDUCE reduces.
        group: size of the data-parallel group of an ALLREDUCE.
    """

    op: str
    block: Block | None = None
    peer: int | None = None
    tensor: TensorSpec | None = None
    nbytes: int = 0
    duration: float = 0.0
    memory: int = 0
    segment: int | None = None
    group: int = 1
    hold: int = 0
    transient: int = 0

    def __str__(self) -> str:
        if self.op == "SEND":
            return f"SEND {self.block} to {self.peer}"
        if self.op == "RECV":
            return f"RECV {self.block} from {self.peer}"
        if self.op == "ALLREDUCE":
            return f"ALLREDUCE grads of segment {self.segment}"
        if self.op == "OPTIM":
            return "OPTIM step"
        return str(self.block)

    def to_dict(self) -> dict:
        d: dict = {"op": self.op}
        if self.block is not None:
            d["block"] = str(self.block)
        if self.peer is not None:
            d["peer"] = self.peer
        if self.tensor is not None:
            d["tensor"] = self.tensor.to_dict()
        if self.nbytes:
            d["nbytes"] = self.nbytes
        if self.segment is not None:
            d["segment"] = self.segment
        if self.group != 1:
            d["group"] = self.group
        if self.hold:
            d["hold"] = self.hold
        if self.transient:
            d["transient"] = self.transient
        return d


@dataclass
class ExecutionPlan:
    """Per-rank instruction streams of one pipeline replica for one step.

    Attributes:
        streams: ``streams[rank]`` is the ordered instruction list of pipeline rank ``rank``.
        static_memory: resident bytes per rank for the whole step (parameters, optimizer states,
            buffers; gradient buffers come and go with the instructions' ``hold``/``OPTIM``).
        dp: data-parallel degree (replicas of this pipeline; their ALLREDUCEs are symmetric).
        param_bytes: parameter bytes per rank (for the optimizer step).
        schedule_name: the schedule it was lowered from.
    """

    streams: list[list[Instruction]]
    static_memory: list[int]
    dp: int = 1
    param_bytes: list[int] = field(default_factory=list)
    schedule_name: str = "custom"

    @property
    def num_ranks(self) -> int:
        return len(self.streams)

    def num_instructions(self) -> int:
        return sum(len(s) for s in self.streams)

    def to_dict(self) -> dict:
        return {"dp": self.dp, "static_memory": self.static_memory, "param_bytes": self.param_bytes,
                "streams": [[i.to_dict() for i in s] for s in self.streams]}


def lower(
    schedule: Schedule,
    *,
    dp: int = 1,
    segment_param_bytes: Mapping[int, int] | None = None,
    optimizer: bool = True,
    optimizer_kind: str = "adam",
) -> ExecutionPlan:
    """Lower a schedule into per-rank instruction streams (SuperScaler phase 3).

    Args:
        schedule: a schedule that passes ``validate`` (this function does not re-validate).
        dp: data-parallel degree; with ``dp > 1`` each segment's gradients (``segment_param_bytes``)
            are all-reduced after its last backward block (B, or W with split backward) on a rank.
        segment_param_bytes: parameter bytes of each segment on one rank (after TP split).
        optimizer: append an ``OPTIM`` step to every rank of a training schedule.
        optimizer_kind: ``"adam"`` (gradient accumulation: each ALLREDUCE reduces the segment's
            gradients) or ``"adama"`` (AdamA: gradients are folded into Adam's states locally and
            ``m`` and ``v`` are averaged once per step, so each ALLREDUCE carries 2x the segment's
            parameter bytes; ``runtime.adama.AdamA.sync_states``).

    Returns:
        The :class:`ExecutionPlan`. A producer block whose output goes to ``k`` other ranks gets
        ``k`` SENDs; a multi-device producer sends from the first device of its set.

    Raises:
        ValueError: an unknown ``optimizer_kind``.
    """
    if optimizer_kind not in ("adam", "adama"):
        raise ValueError(f"unknown optimizer {optimizer_kind!r}; use 'adam' or 'adama'")
    sync_factor = 2 if optimizer_kind == "adama" else 1
    pl = schedule.placement
    n = pl.num_devices
    seg_bytes = dict(segment_param_bytes or {})
    # consumers of each placement block, on other devices: producer idx -> [(consumer idx, dst)]
    consumers: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(pl.blocks))}
    sources: dict[int, list[tuple[int, int, int]]] = {i: [] for i in range(len(pl.blocks))}  # consumer idx -> [(producer idx, src, dst)]
    for ci, c in enumerate(pl.blocks):
        for pi in c.deps:
            p = pl.blocks[pi]
            for d in c.devices:
                if d not in p.devices:
                    consumers[pi].append((ci, d))
                    sources[ci].append((pi, p.devices[0], d))
    # dedupe: a producer sends once per destination rank
    for k in consumers:
        consumers[k] = sorted({d for _, d in consumers[k]})  # type: ignore[assignment]
    index = {b.key: i for i, b in enumerate(pl.blocks)}

    # last backward (weight-gradient producing) block of each segment per rank
    last_grad_pos: list[dict[int, int]] = []
    for d, order in enumerate(schedule.orders):
        last: dict[int, int] = {}
        for pos, b in enumerate(order):
            if b.kind in ("B", "W"):
                last[b.segment] = pos
        last_grad_pos.append(last)

    streams: list[list[Instruction]] = []
    static = [pl.static_bytes(d) for d in range(n)]
    param_bytes = [0] * n
    for d in range(n):
        segs_here = {pl.blocks[i].segment for i in pl.blocks_on(d) if pl.blocks[i].kind == "F"}
        param_bytes[d] = sum(seg_bytes.get(s, 0) for s in segs_here)
    for d, order in enumerate(schedule.orders):
        out: list[Instruction] = []
        grad_at = {pos: seg for seg, pos in last_grad_pos[d].items()}
        grad_ev = gradient_events(pl, order)
        held = 0
        received: set[Block] = set()
        for pos, b in enumerate(order):
            bi = index[b.key]
            spec = pl.blocks[bi]
            for pi, src, dst in sources[bi]:
                if dst != d:
                    continue
                p = pl.blocks[pi]
                pb = Block(p.segment, p.kind, b.micro_batch)
                if pb not in received:
                    received.add(pb)
                    t = p.output
                    out.append(Instruction("RECV", pb, peer=src, tensor=t, nbytes=t.nbytes if t else 0))
            hold, trans = grad_ev[pos]
            held += hold
            out.append(Instruction(spec.kind, b, duration=spec.duration, memory=spec.memory, hold=hold, transient=trans))
            if spec.devices[0] == d:
                for dst in consumers[bi]:  # type: ignore[union-attr]
                    t = spec.output
                    out.append(Instruction("SEND", b, peer=dst, tensor=t, nbytes=t.nbytes if t else 0))
            if dp > 1 and pos in grad_at:
                seg = grad_at[pos]
                out.append(Instruction("ALLREDUCE", None, nbytes=sync_factor * seg_bytes.get(seg, 0), segment=seg, group=dp))
        if optimizer and not pl.forward_only:
            out.append(Instruction("OPTIM", None, nbytes=param_bytes[d], memory=-held))
        streams.append(out)
    return ExecutionPlan(streams, static, dp=dp, param_bytes=param_bytes, schedule_name=schedule.name)
