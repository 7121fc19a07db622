"""What a lowering is asked for: :class:`LowerOptions`, one field per option.

The planner (:func:`engine.plan.lowering.lower_plan`) builds one from a plan and the runtime's
worker (``runtime.worker.lowering``) takes that same object with its own measured bytes put in
(:func:`dataclasses.replace`), so both lower a plan the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from engine.coconet import parse_transforms
from engine.dependency.instructions import TiedGroup
from engine.layout import DEFAULT_ORDER, check_layout

__all__ = ["OPTIMIZER_KINDS", "LowerOptions"]

#: The optimizers whose memory and all-reduce bytes the lowering knows.
OPTIMIZER_KINDS = ("adam", "adama")


@dataclass(frozen=True)
class LowerOptions:
    """The options of :func:`engine.dependency.lower` (SuperScaler phase 3). Immutable: derive a
    variant with :func:`dataclasses.replace`.

    Raises (on construction):
        ValueError: ``dp`` or ``tp`` below 1, an unknown ``optimizer_kind``, a negative
            ``grad_bucket_bytes``.
        engine.coconet.CoCoNetError: an unknown name in ``transforms``.
    """

    dp: int = 1
    """Data-parallel degree. With ``dp > 1`` each segment's gradients are reduced after its last
    weight-gradient block (``B``, or ``W`` with a split backward) on a rank, and expert-parallel
    all-to-alls run over the ``dp`` replicas (the expert-parallel group is the data-parallel group)."""

    tp: int = 1
    """Tensor-parallel degree (for ``scatter-send`` and ``tp-split``: boundary tensors of ``1/tp``)."""

    segment_param_bytes: Mapping[int, int] | None = None
    """Parameter bytes of each segment on one rank (after the TP/EP split); what ``OPTIM`` updates,
    and the data-parallel reduction's bytes unless ``segment_allreduce_bytes`` is given. ``None``: none."""

    segment_allreduce_bytes: Mapping[int, int] | None = None
    """Bytes each segment's data-parallel reduction carries (before the AdamA factor) when not all of
    ``segment_param_bytes`` is replicated (experts under expert parallelism are owned by one replica
    and not all-reduced); ``None``: ``segment_param_bytes``."""

    optimizer: bool = True
    """Append an ``OPTIM`` step (and the tied-weight all-reduces before it) to every rank of a
    training schedule."""

    optimizer_kind: str = "adam"
    """``"adam"`` (gradient accumulation: each all-reduce reduces the segment's gradients) or
    ``"adama"`` (AdamA: gradients folded into Adam's states locally, ``m`` and ``v`` averaged once
    per step, so each all-reduce carries 2x the segment's parameter bytes; the tied copies'
    gradients are not folded and ride along once: ``2 x (bytes - tied) + tied``, as
    ``runtime.worker``'s flat ``[m | v | tied gradients]`` buffer; ``runtime.adama.AdamA.sync_states``)."""

    alltoalls: Mapping[int, Sequence[int]] | None = None
    """Per segment, the bytes of each all-to-all its FORWARD block runs, in execution order
    (:func:`engine.models.moe.comm.moe_segment_collectives` with kind ``"F"``); its ``B`` or ``I``
    blocks run the same list reversed, ``W`` none (a segment fed only by the model's input runs
    them in ``W``: its ``I`` has no input gradient). Emitted only with ``dp > 1``."""

    tied: Sequence[TiedGroup] | None = None
    """Tied-parameter groups; a group whose copies sit on 2+ pipeline ranks gets one tied
    ``ALLREDUCE`` (``ranks`` = those ranks, ``nbytes`` = one copy) on each of them just before
    ``OPTIM`` (training streams only)."""

    transforms: str | Sequence[str] = ()
    """CoCoNet's transformations (:mod:`engine.coconet`; a comma-separated string or a sequence,
    kept parsed as a tuple) that change the streams: ``sharded-update`` (``dp > 1``: a
    REDUCESCATTER instead of each ALLREDUCE, OPTIM on ``1/dp`` of the parameters, an ALLGATHER of
    each segment's parameters after it, ``(1 - 1/dp)`` of Adam's two moments off the static
    memory), ``overlap-grad-sync`` (``dp > 1``: each segment's ALLREDUCE split into the buckets of
    :func:`engine.coconet.gradient_buckets`, each ``ready`` when its share of the last backward
    has run), ``scatter-send`` (``tp > 1``: SEND/RECV carry ``1/tp`` of the boundary bytes, and
    without ``tp-split`` the receiver all-gathers them from its tensor group) and ``tp-split``
    (``tp > 1``: the boundary stays sequence-sharded, SEND/RECV of ``1/tp``, no gather; like
    ``chunked-overlap`` it also changes block durations, :func:`engine.transform.layer_costs`)."""

    grad_bucket_bytes: int | None = None
    """Bucket size of ``overlap-grad-sync`` in bytes; ``None`` (or 0):
    :data:`engine.coconet.DEFAULT_GRAD_BUCKET_BYTES`."""

    segment_tp_collectives: Mapping[int, Sequence[tuple[str, int, float]]] | None = None
    """Per segment, the tensor-parallel collectives inside its forward block
    (``Segment.tp_collectives``: ``(kind, bytes, seconds)``), kept in
    :attr:`engine.dependency.ExecutionPlan.tp_collectives` for the simulator to draw."""

    layout: str = DEFAULT_ORDER
    """How the ranks sit on devices (:mod:`engine.layout`; ``plan.parallel.layout``): kept in
    :attr:`engine.dependency.ExecutionPlan.layout`, whose device ids the simulator times each
    collective and transfer over."""

    precision: str = "32-true"
    """The plan's precision policy (:mod:`engine.precision`): the data-parallel and tied-weight
    all-reduces carry gradients in its gradient dtype (``param bytes x grad_bytes / weight_bytes``)
    and ``sharded-update`` takes its sharded part (master weights, Adam's states, the fp32
    gradient copy) of the other replicas' shards off the static memory. ``32-true``: the
    parameter bytes and Adam's two moments, as before policies."""

    dp_shard: int = 1
    """Of ``dp``, the fully sharded degree (FSDP2, :mod:`engine.dependency.fsdp`): with
    ``dp_shard > 1`` each unit of :attr:`fsdp_units` is all-gathered (``UNSHARD``) before the
    blocks that need it and its gradients reduce-scattered over the shard group (``REDUCESCATTER``
    with ``block`` set; then, with ``dp > dp_shard``, HSDP's ``ALLREDUCE`` of the shard over the
    replicate group) instead of the data-parallel all-reduce."""

    reshard_after_forward: bool | None = None
    """FSDP2's ``reshard_after_forward``: free each unit's gathered parameters after its forward and
    gather them again for its backward. ``None``: torchtitan's default, ``True`` without a pipeline
    and ``False`` with one (a pipeline refuses ``True``, :func:`engine.dependency.fsdp.add_fsdp`)."""

    fsdp_units: Mapping[int, Sequence[tuple[int, float]]] | None = None
    """Per segment, its FSDP units in forward order, ``(parameter bytes on one rank in the weight
    dtype, fraction of the segment's forward time)``: the segment's own parameters outside its
    transformer blocks first (the stage's root ``fully_shard`` in torchtitan, kept gathered from
    the forward to the end of the backward; ``(0, 0.0)`` when there are none), then each block.
    ``None`` (or a segment missing): the whole segment is one unit of ``segment_param_bytes``
    after an empty root (:func:`engine.dependency.fsdp.segment_units`)."""

    def __post_init__(self) -> None:
        if int(self.dp) < 1 or int(self.tp) < 1:
            raise ValueError(f"dp and tp must be at least 1, got dp={self.dp}, tp={self.tp}")
        if int(self.dp_shard) < 1 or int(self.dp) % int(self.dp_shard):
            raise ValueError(f"dp_shard must divide dp={self.dp}, got {self.dp_shard}")
        check_layout(self.layout)
        if self.optimizer_kind not in OPTIMIZER_KINDS:
            raise ValueError(f"unknown optimizer {self.optimizer_kind!r}; use 'adam' or 'adama'")
        if self.grad_bucket_bytes is not None and self.grad_bucket_bytes < 0:
            raise ValueError(f"grad_bucket_bytes must not be negative, got {self.grad_bucket_bytes}")
        object.__setattr__(self, "transforms", parse_transforms(self.transforms))
        if self.tied is not None:
            object.__setattr__(self, "tied", tuple(self.tied))
