"""The instructions of a lowered stream: the :class:`Op` enum, :class:`Instruction`, a tied-weight
group (:class:`TiedGroup`) and the per-rank streams of one step (:class:`ExecutionPlan`).

Built by the lowering passes (:mod:`engine.dependency.passes`), timed by :mod:`engine.simulate`
and executed by ``runtime.worker.interpreter``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from engine.layout import DEFAULT_ORDER, RankLayout
from engine.placement import TensorSpec
from engine.schedule import Block

__all__ = ["COMPUTE_OPS", "ExecutionPlan", "Instruction", "Op", "TiedGroup"]


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
    #: data-parallel (``segment``, ``bucket``) or tied-weight (``ranks``) gradient all-reduce; with
    #: ``block`` set, HSDP's all-reduce of one unit's gradient shard over the replicate group
    ALLREDUCE = "ALLREDUCE"
    ALLTOALL = "ALLTOALL"     #: expert-parallel all-to-all marker (runs inside its block's compute)
    #: sharded update: a segment's (or bucket's) gradients reduced to each replica's 1/dp shard; with
    #: ``block`` set, fully sharded data parallelism's reduce-scatter of one unit's gradients over
    #: the shard group after that unit's backward in ``block`` (``bucket`` = the unit)
    REDUCESCATTER = "REDUCESCATTER"
    ALLGATHER = "ALLGATHER"   #: sharded update: a segment's updated parameter shards gathered (after OPTIM);
    #: scatter-send: a received 1/tp boundary slice gathered from the tensor group (``block`` set)
    OPTIM = "OPTIM"           #: optimizer step
    #: fully sharded data parallelism (FSDP2's ``unshard``): all-gather one sharded unit's
    #: parameters (``segment``, ``bucket`` = the unit) over the shard group for ``block``
    UNSHARD = "UNSHARD"
    #: fully sharded data parallelism (FSDP2's ``reshard``): free a segment's gathered parameters
    RESHARD = "RESHARD"


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
            if self.block is not None:
                return f"ALLREDUCE grad shard of unit {self.bucket} of segment {self.segment} over the replicas"
            if self.bucket is not None:
                return f"ALLREDUCE grads of segment {self.segment} bucket {self.bucket}"
            return f"ALLREDUCE grads of segment {self.segment}"
        if self.op == Op.REDUCESCATTER:
            if self.block is not None:
                return f"REDUCESCATTER grads of unit {self.bucket} of segment {self.segment} after {self.block}"
            if self.bucket is not None:
                return f"REDUCESCATTER grads of segment {self.segment} bucket {self.bucket}"
            return f"REDUCESCATTER grads of segment {self.segment}"
        if self.op == Op.ALLGATHER:
            if self.block is not None:
                return f"ALLGATHER {self.block} from the tensor group of {self.group}"
            return f"ALLGATHER params of segment {self.segment}"
        if self.op == Op.ALLTOALL:
            return f"ALLTOALL {self.block} (expert-parallel group of {self.group})"
        if self.op == Op.OPTIM:
            return "OPTIM step"
        if self.op == Op.UNSHARD:
            return f"UNSHARD unit {self.bucket} of segment {self.segment} for {self.block}"
        if self.op == Op.RESHARD:
            return f"RESHARD segment {self.segment}"
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
    across the copies at the optimizer step (``runtime.stages.PipelineStages.tied``).

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
        tp: tensor-parallel degree (the tensor ranks of each pipeline rank are folded into its
            stream: one stream per pipeline rank of data-parallel replica 0).
        layout: the rank layout (:mod:`engine.layout`) whose device ids the streams' collectives
            and transfers run between (:meth:`device_of`, :meth:`device_group`).
        dp_shard: of ``dp``, the fully sharded degree (:mod:`engine.dependency.fsdp`): the data
            group is a ``(dp // dp_shard, dp_shard)`` mesh, shard groups contiguous
            (:meth:`shard_group`, :meth:`replicate_group`).
    """

    streams: list[list[Instruction]]
    static_memory: list[int]
    dp: int = 1
    param_bytes: list[int] = field(default_factory=list)
    schedule_name: str = "custom"
    tp_collectives: dict[int, tuple[tuple[str, int, float], ...]] = field(default_factory=dict)
    tp: int = 1
    layout: str = DEFAULT_ORDER
    dp_shard: int = 1

    @property
    def num_ranks(self) -> int:
        return len(self.streams)

    def shard_group(self, rank: int) -> list[int]:
        """Device ids of pipeline rank ``rank``'s FSDP shard group: the first ``dp_shard`` of its
        data group (torchtitan's mesh ``(dp_replicate, dp_shard)``, shard fastest)."""
        return self.device_group("data", rank)[:max(1, self.dp_shard)]

    def replicate_group(self, rank: int) -> list[int]:
        """Device ids of pipeline rank ``rank``'s HSDP replicate group: every ``dp_shard``-th of its
        data group."""
        return self.device_group("data", rank)[::max(1, self.dp_shard)]

    def rank_layout(self) -> RankLayout:
        """The :class:`~engine.layout.RankLayout` of the job: ``tp x dp x num_ranks`` devices
        (the pipeline ranks are the streams)."""
        return RankLayout(max(1, self.tp), max(1, self.dp), max(1, self.num_ranks), self.layout)

    def device_of(self, rank: int) -> int:
        """The device id of pipeline rank ``rank``'s stream: tensor rank 0 of replica 0
        (legacy: ``rank``)."""
        return self.rank_layout().device(0, 0, rank)

    def device_group(self, kind: str, rank: int) -> list[int]:
        """The device ids of the ``kind`` group (``tensor``, ``data``, ``pipeline``) of pipeline rank
        ``rank``'s device (:meth:`device_of`), ascending in that dimension's index. Legacy: the
        data group ``[r, r + n, ..., r + (dp-1) n]``, the tensor group ``[r, r + n, ...]`` of ``tp``
        ids (what the simulator timed before the layout was recorded).

        Raises:
            engine.errors.TransformError: an unknown kind.
        """
        lay = self.rank_layout()
        if lay.legacy and kind == "tensor":
            return [rank + k * self.num_ranks for k in range(max(1, self.tp))]
        return lay.group_of(kind, lay.device(0, 0, rank))

    def num_instructions(self) -> int:
        return sum(len(s) for s in self.streams)

    def to_dict(self) -> dict:
        return {"dp": self.dp, "static_memory": self.static_memory, "param_bytes": self.param_bytes,
                "streams": [[i.to_dict() for i in s] for s in self.streams]}
