"""SuperScaler phase 3: lower a schedule into per-rank instruction streams.

Every tensor that crosses devices gets a ``SEND`` right after its producer and a ``RECV``
right before its consumer; data-parallel gradients get an ``ALLREDUCE`` after a segment's
last backward on a rank; every training stream ends with an ``OPTIM`` step.

Collectives beyond data parallelism:

- ``ALLTOALL`` (mixture-of-experts expert parallelism, :mod:`engine.models.moe.comm`): one
  instruction per all-to-all, right after the compute instruction of the ``F``/``B``/``I`` block
  that runs it (before the block's SENDs), in execution order: forward in layer order (dispatch,
  combine), backward in reverse (combine-grad, dispatch-grad). ``group`` is the expert-parallel
  group size (= ``dp``), ``nbytes`` one rank's whole send buffer.
- Tied-weight ``ALLREDUCE`` (e.g. GPT-2's ``wte`` / ``lm_head`` on the first and last pipeline
  rank): on each rank holding a copy, just before ``OPTIM``, ``segment=None`` and
  ``ranks`` = the pipeline ranks of all holders (``group = len(ranks)``); Megatron-LM's embedding
  all-reduce, as ``runtime.worker`` does it at the optimizer step.

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
from enum import StrEnum
from typing import Mapping, Sequence

from engine.placement import TensorSpec
from engine.schedule import Block, Schedule, gradient_events


class Op(StrEnum):
    """The instruction ops of a lowered stream (:attr:`Instruction.op`).

    A ``str``-valued enum: ``Op.SEND == "SEND"``, ``str(Op.SEND) == "SEND"`` and JSON writes
    ``"SEND"``, so streams built from plain strings, saved plans and string comparisons are
    unchanged. Shared by the simulator (:mod:`engine.simulate`) and the runtime's instruction
    interpreter (:mod:`runtime.worker.interpreter`), which dispatch on it.
    """

    F = "F"                   #: stage forward of one micro-batch
    B = "B"                   #: full backward (input and weight gradients)
    I = "I"                   # noqa: E741 - the zero-bubble input-gradient backward's block kind
    W = "W"                   #: zero-bubble weight-gradient backward
    SEND = "SEND"             #: post a point-to-point send of a block's boundary tensors
    RECV = "RECV"             #: wait for a block's boundary tensors from a peer
    ALLREDUCE = "ALLREDUCE"   #: data-parallel (``segment``, ``bucket``) or tied-weight (``ranks``) gradient all-reduce
    ALLTOALL = "ALLTOALL"     #: expert-parallel all-to-all marker (runs inside its block's compute)
    REDUCESCATTER = "REDUCESCATTER"   #: sharded update: a segment's gradients reduced to each replica's 1/dp shard
    ALLGATHER = "ALLGATHER"   #: sharded update: a segment's updated parameter shards gathered (after OPTIM);
    #: scatter-send: a received 1/tp boundary slice gathered from the tensor group (``block`` set)
    OPTIM = "OPTIM"           #: optimizer step


COMPUTE_OPS = (Op.F, Op.B, Op.I, Op.W)


@dataclass(frozen=True, slots=True)
class Instruction:
    """One step of a rank's instruction stream.

    Attributes:
        op: ``F``/``B``/``I``/``W`` (compute), ``SEND``, ``RECV``, ``ALLREDUCE``, ``ALLTOALL`` or ``OPTIM``.
        block: the block computed, or whose output is sent/received, or (``ALLTOALL``) the
            F/B/I block that runs the all-to-all; ``None`` for OPTIM and ALLREDUCE.
        peer: destination rank of a SEND, source rank of a RECV.
        tensor: static shape and dtype of the transferred tensor (SEND/RECV).
        nbytes: bytes transferred (SEND/RECV), reduced (ALLREDUCE), one rank's whole send buffer
            of an all-to-all (ALLTOALL, ``E*C*hidden*element_size``) or updated (OPTIM).
        duration: compute seconds (F/B/I/W), 0 otherwise (communication time comes from the cost model).
        memory: bytes allocated (+) / freed (-) by a compute block on this rank; for ``OPTIM``,
            minus the gradient buffers it releases (``zero_grad`` after the update).
        hold: gradient-buffer bytes a compute block allocates at its start and that stay until
            the ``OPTIM`` step.
        transient: bytes a compute block holds only while it runs (a micro-batch gradient).
        segment: the segment whose gradients an ALLREDUCE reduces, or whose block runs an
            ALLTOALL; ``None`` for a tied-weight ALLREDUCE.
        group: size of the data-parallel group of an ALLREDUCE, of the expert-parallel group
            (= dp) of an ALLTOALL, or the number of holders of a tied-weight ALLREDUCE.
        ranks: pipeline ranks taking part in a cross-rank collective (tied-weight ALLREDUCE:
            every rank holding a copy, this one included); ``()`` for data-parallel collectives,
            whose group is this rank's replicas.
        bucket: ``overlap-grad-sync``: the index of a data-parallel ALLREDUCE's gradient bucket
            (:func:`engine.coconet.gradient_buckets`, posting order); ``None`` for a whole segment.
        ready: ``overlap-grad-sync``: the fraction of the preceding compute block (the segment's
            last backward) after which the bucket's gradients are final and its all-reduce may
            start; ``1.0`` (after the block) otherwise.
    """

    op: Op | str   # lower() emits Op; hand-built streams (tests) may pass the plain string, which compares equal
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
    ranks: tuple[int, ...] = ()
    bucket: int | None = None
    ready: float = 1.0

    def __str__(self) -> str:
        if self.op == Op.SEND:
            return f"SEND {self.block} to {self.peer}"
        if self.op == Op.RECV:
            return f"RECV {self.block} from {self.peer}"
        if self.op == Op.ALLREDUCE:
            if self.ranks:
                return f"ALLREDUCE tied weights with ranks {','.join(map(str, self.ranks))}"
            if self.bucket is not None:
                return f"ALLREDUCE grads of segment {self.segment} bucket {self.bucket}"
            return f"ALLREDUCE grads of segment {self.segment}"
        if self.op == Op.REDUCESCATTER:
            return f"REDUCESCATTER grads of segment {self.segment}"
        if self.op == Op.ALLGATHER:
            if self.block is not None:
                return f"ALLGATHER {self.block} from the tensor group of {self.group}"
            return f"ALLGATHER params of segment {self.segment}"
        if self.op == Op.ALLTOALL:
            return f"ALLTOALL {self.block} (expert-parallel group of {self.group})"
        if self.op == Op.OPTIM:
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
        if self.ranks:
            d["ranks"] = list(self.ranks)
        if self.bucket is not None:
            d["bucket"] = self.bucket
        if self.ready != 1.0:
            d["ready"] = self.ready
        return d


@dataclass(frozen=True)
class TiedGroup:
    """Parameters shared by several segments (one copy per segment), whose gradients are summed
    across the copies at the optimizer step (``runtime.stage.PipelineStages.tied``).

    Attributes:
        members: ``(segment, parameter name)`` of every copy, sorted, e.g.
            ``((0, "transformer.wte.weight"), (3, "lm_head.weight"))``.
        nbytes: bytes of ONE copy (the all-reduced gradient).
    """

    members: tuple[tuple[int, str], ...]
    nbytes: int

    def segments(self) -> list[int]:
        """Distinct segments holding a copy, ascending."""
        return sorted({s for s, _ in self.members})

    def to_dict(self) -> dict:
        return {"members": [[s, n] for s, n in self.members], "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, d: dict) -> "TiedGroup":
        """Inverse of :meth:`to_dict`. Raises KeyError/TypeError/ValueError on a malformed dict."""
        members = tuple(sorted((int(s), str(n)) for s, n in d["members"]))
        return cls(members, int(d["nbytes"]))


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
        tp_collectives: per segment, the tensor-parallel collectives inside its forward block, in
            order, ``(kind, bytes, seconds)`` (included in the block's duration; the backward runs
            as many in reverse); the simulator draws them in the communication lane.
    """

    streams: list[list[Instruction]]
    static_memory: list[int]
    dp: int = 1
    param_bytes: list[int] = field(default_factory=list)
    schedule_name: str = "custom"
    tp_collectives: dict[int, tuple[tuple[str, int, float], ...]] = field(default_factory=dict)

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
    alltoalls: Mapping[int, Sequence[int]] | None = None,
    tied: Sequence[TiedGroup] | None = None,
    segment_allreduce_bytes: Mapping[int, int] | None = None,
    transforms: Sequence[str] = (),
    tp: int = 1,
    grad_bucket_bytes: int | None = None,
    segment_tp_collectives: Mapping[int, Sequence[tuple[str, int, float]]] | None = None,
) -> ExecutionPlan:
    """Lower a schedule into per-rank instruction streams (SuperScaler phase 3).

    Args:
        schedule: a schedule that passes ``validate`` (this function does not re-validate).
        dp: data-parallel degree; with ``dp > 1`` each segment's gradients (``segment_param_bytes``)
            are all-reduced after its last backward block (B, or W with split backward) on a rank.
        segment_param_bytes: parameter bytes of each segment on one rank (after TP/EP split).
        optimizer: append an ``OPTIM`` step to every rank of a training schedule.
        optimizer_kind: ``"adam"`` (gradient accumulation: each ALLREDUCE reduces the segment's
            gradients) or ``"adama"`` (AdamA: gradients are folded into Adam's states locally and
            ``m`` and ``v`` are averaged once per step, so each ALLREDUCE carries 2x the segment's
            parameter bytes; ``runtime.adama.AdamA.sync_states``; the tied copies' gradients
            are not folded and ride along once: ``2 x (bytes - tied) + tied``, as
            ``runtime.worker``'s flat ``[m | v | tied gradients]`` buffer).
        alltoalls: per segment, the bytes of each all-to-all its FORWARD block runs, in execution
            order (:func:`engine.models.moe.comm.moe_segment_collectives` with kind ``"F"``);
            its ``B`` or ``I`` blocks run the same list reversed, ``W`` none (a segment fed only by
            the model's input runs them in ``W``: its ``I`` has no input gradient). Emitted only with
            ``dp > 1`` (the expert-parallel group is the data-parallel group, ``group = dp``).
        tied: tied-parameter groups; a group whose copies sit on 2+ pipeline ranks gets one
            tied ``ALLREDUCE`` (``ranks`` = those ranks, ``nbytes`` = one copy) on each of them
            just before ``OPTIM`` (training streams only).
        segment_allreduce_bytes: bytes each segment's data-parallel ALLREDUCE reduces (before
            the AdamA factor), when not all of ``segment_param_bytes`` is replicated (experts
            under expert parallelism are owned by one replica and not all-reduced); default
            ``segment_param_bytes``.
        transforms: CoCoNet's transformations (:mod:`engine.coconet`) that change the streams:
            ``sharded-update`` (with ``dp > 1``: each segment's ALLREDUCE becomes a REDUCESCATTER of
            the same bytes, OPTIM updates ``1/dp`` of the parameters, an ALLGATHER of the
            segment's parameters follows OPTIM; the static memory loses ``(1 - 1/dp)`` of Adam's
            two moments), ``overlap-grad-sync`` (each segment's ALLREDUCE split into the buckets of
            :func:`engine.coconet.gradient_buckets`, each ``ready`` when its share of the last
            backward block has run) and ``scatter-send`` (with ``tp > 1``: SEND/RECV carry
            ``1/tp`` of the boundary bytes; without ``tp-split`` the receiver all-gathers them
            from its tensor group: ALLGATHER with the block, ``group = tp``). ``tp-split`` keeps
            the boundary sequence-sharded (SEND/RECV of ``1/tp``, no gather) and, like
            ``chunked-overlap``, changes block durations (:func:`engine.transform.layer_costs`).
        tp: tensor-parallel degree (for ``scatter-send`` and ``tp-split``).
        grad_bucket_bytes: bucket size of ``overlap-grad-sync`` (default
            :data:`engine.coconet.DEFAULT_GRAD_BUCKET_BYTES`).
        segment_tp_collectives: per segment, the tensor-parallel collectives inside its forward
            block (``Segment.tp_collectives``), kept in :attr:`ExecutionPlan.tp_collectives`.

    Returns:
        The :class:`ExecutionPlan`. A producer block whose output goes to ``k`` other ranks gets
        ``k`` SENDs; a multi-device producer sends from the first device of its set.

    Raises:
        ValueError: an unknown ``optimizer_kind``.
    """
    if optimizer_kind not in ("adam", "adama"):
        raise ValueError(f"unknown optimizer {optimizer_kind!r}; use 'adam' or 'adama'")
    from engine.coconet import DEFAULT_GRAD_BUCKET_BYTES, gradient_buckets, parse_transforms

    adama = optimizer_kind == "adama"
    tf = set(parse_transforms(transforms))
    sharded = "sharded-update" in tf and dp > 1
    bucketed = "overlap-grad-sync" in tf and dp > 1
    scatter = "scatter-send" in tf and tp > 1
    seq_sharded = "tp-split" in tf and tp > 1   # the boundary is already the 1/tp sequence shard
    bucket_bytes = grad_bucket_bytes or DEFAULT_GRAD_BUCKET_BYTES
    pl = schedule.placement
    n = pl.num_devices
    seg_bytes = dict(segment_param_bytes or {})
    ar_bytes = dict(segment_allreduce_bytes) if segment_allreduce_bytes is not None else seg_bytes
    a2a = {int(k): [int(x) for x in v] for k, v in (alltoalls or {}).items()} if dp > 1 else {}
    # segments fed by the model's input (token ids) only: with a split backward their I has no
    # input gradient to compute, so the whole backward, all-to-alls included, runs in W
    input_segments = {blk.segment for blk in pl.blocks
                      if blk.kind == "F" and not any(pl.blocks[i].kind == "F" for i in blk.deps)}
    tied_groups = list(tied or [])
    tied_in_seg: dict[int, int] = {}
    for g in tied_groups:
        for s in g.segments():
            tied_in_seg[s] = tied_in_seg.get(s, 0) + g.nbytes

    def dp_bytes(seg: int) -> int:
        b = ar_bytes.get(seg, 0)
        if not adama:
            return b
        t = min(tied_in_seg.get(seg, 0), b)
        return 2 * (b - t) + t

    def holder_ranks(g: TiedGroup) -> tuple[int, ...]:
        ranks: set[int] = set()
        for s in g.segments():
            if pl.has("F", s):  # a segment this placement lacks holds no copy here
                ranks.update(pl.spec("F", s).devices)
        return tuple(sorted(ranks))

    tied_at: dict[int, list[tuple[TiedGroup, tuple[int, ...]]]] = {}
    for g in tied_groups:
        ranks = holder_ranks(g)
        if len(ranks) > 1:
            for r in ranks:
                tied_at.setdefault(r, []).append((g, ranks))
    # consumers of each placement block, on other devices: producer idx -> [(consumer idx, dst)]
    consumers: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(pl.blocks))}
    # consumer idx -> [(producer idx, src, dst)]
    sources: dict[int, list[tuple[int, int, int]]] = {i: [] for i in range(len(pl.blocks))}
    for ci, c in enumerate(pl.blocks):
        for pi in c.deps:
            p = pl.blocks[pi]
            for d in c.devices:
                if d not in p.devices:
                    consumers[pi].append((ci, d))
                    sources[ci].append((pi, p.devices[0], d))
    # dedupe: a producer sends once per destination rank
    dests: dict[int, list[int]] = {k: sorted({d for _, d in v}) for k, v in consumers.items()}
    index = {b.key: i for i, b in enumerate(pl.blocks)}

    # last backward (weight-gradient producing) block of each segment per rank
    last_grad_pos: list[dict[int, int]] = []
    for order in schedule.orders:
        last: dict[int, int] = {}
        for pos, b in enumerate(order):
            if b.kind in ("B", "W"):
                last[b.segment] = pos
        last_grad_pos.append(last)

    streams: list[list[Instruction]] = []
    static = [pl.static_bytes(d) for d in range(n)]
    param_bytes = [0] * n
    segs_on: list[list[int]] = []
    for d in range(n):
        segs_here = sorted({pl.blocks[i].segment for i in pl.blocks_on(d) if pl.blocks[i].kind == "F"})
        segs_on.append(segs_here)
        param_bytes[d] = sum(seg_bytes.get(s, 0) for s in segs_here)
        if sharded:   # Adam's m and v of the other replicas' shards are not kept
            static[d] = max(0, static[d] - 2 * (param_bytes[d] - param_bytes[d] // dp))

    def sent_bytes(t: TensorSpec | None) -> int:
        nb = t.nbytes if t else 0
        return -(-nb // tp) if scatter or seq_sharded else nb
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
                    out.append(Instruction(Op.RECV, pb, peer=src, tensor=t, nbytes=sent_bytes(t)))
                    if scatter and "tp-split" not in tf and t is not None:
                        out.append(Instruction(Op.ALLGATHER, pb, nbytes=t.nbytes, group=tp))
            hold, trans = grad_ev[pos]
            held += hold
            out.append(Instruction(Op(spec.kind), b, duration=spec.duration, memory=spec.memory, hold=hold,
                                   transient=trans))
            fwd_a2a = a2a.get(b.segment)
            if fwd_a2a and spec.kind in ("F", "B", "W" if b.segment in input_segments else "I"):
                for nb in (fwd_a2a if spec.kind == "F" else reversed(fwd_a2a)):
                    out.append(Instruction(Op.ALLTOALL, b, nbytes=nb, segment=b.segment, group=dp))
            if spec.devices[0] == d:
                for dst in dests[bi]:
                    t = spec.output
                    out.append(Instruction(Op.SEND, b, peer=dst, tensor=t, nbytes=sent_bytes(t)))
            if dp > 1 and pos in grad_at:
                seg = grad_at[pos]
                if sharded:   # (the gradient buffers are released at OPTIM, as without it: the runtime frees
                    # them a little earlier, at the reduce-scatter; the static memory holds the saving)
                    out.append(Instruction(Op.REDUCESCATTER, None, nbytes=dp_bytes(seg), segment=seg, group=dp))
                elif bucketed:
                    sizes = gradient_buckets(dp_bytes(seg), bucket_bytes)
                    total, done = sum(sizes), 0
                    for k, nb in enumerate(sizes):
                        done += nb
                        out.append(Instruction(Op.ALLREDUCE, None, nbytes=nb, segment=seg, group=dp, bucket=k,
                                               ready=done / total))
                else:
                    out.append(Instruction(Op.ALLREDUCE, None, nbytes=dp_bytes(seg), segment=seg, group=dp))
        if optimizer and not pl.forward_only:
            for g, ranks in tied_at.get(d, []):
                out.append(Instruction(Op.ALLREDUCE, None, nbytes=g.nbytes, group=len(ranks), ranks=ranks))
            out.append(Instruction(Op.OPTIM, None, nbytes=param_bytes[d] // dp if sharded else param_bytes[d],
                                   memory=-held))
            if sharded:
                for seg in segs_on[d]:
                    if seg_bytes.get(seg, 0):
                        out.append(Instruction(Op.ALLGATHER, None, nbytes=seg_bytes[seg], segment=seg, group=dp))
        streams.append(out)
    inner = {int(s): tuple((str(k), int(b), float(t)) for k, b, t in v)
             for s, v in (segment_tp_collectives or {}).items() if v}
    return ExecutionPlan(streams, static, dp=dp, param_bytes=param_bytes, schedule_name=schedule.name,
                         tp_collectives=inner)
