"""CoCoNet's transformations of a plan: computation and communication rewritten together.

CoCoNet (Jangda et al., "Breaking the Computation and Communication Abstraction Barrier in
Distributed Machine Learning Workloads", ASPLOS 2022) treats a collective and the computation
around it as one program and rewrites them: split, reorder, fuse, overlap. Each transformation
here is a named option of a plan (``ParallelConfig.transforms``; ``tessel plan --transform a,b``;
the app's plan form; ``make_plan(transforms=...)``) that the data-dependency phase lowers
(:func:`engine.dependency.lower`), the simulator times, the Gantt draws in its communication lane
and the runtime executes, leaving the numerics of training unchanged:

- ``sharded-update`` (CoCoNet section 6.1, its Adam/LAMB example; ZeRO stage 1/2, Rajbhandari
  et al., SC 2020): the data-parallel gradient all-reduce becomes a reduce-scatter, the optimizer
  (Adam, AdamA) updates only this rank's ``1/dp`` shard of the parameters and keeps only that
  shard's states, and an all-gather of the updated parameters follows. Optimizer state memory and
  optimizer time drop by ``dp``. Instructions: ``REDUCESCATTER`` per segment, ``OPTIM`` on the
  shard, ``ALLGATHER`` per segment after it.
- ``overlap-grad-sync`` (CoCoNet section 4, overlap; PyTorch DDP's bucketed gradient hooks, Li et
  al., VLDB 2020): a segment's data-parallel all-reduce is split into buckets of
  ``ParallelConfig.grad_bucket_bytes`` (the flat gradient buffer in reverse parameter order, as
  DDP) posted during the segment's last backward block of the step, each as soon as its
  gradients are final, so communication overlaps the rest of that backward. Instructions:
  ``ALLREDUCE`` with ``bucket`` and ``ready`` (the fraction of the block after which it may start).
  With ``sharded-update`` (ZeRO-2 with overlap, ZeRO's stage 2 as DeepSpeed runs it with
  ``overlap_comm``): the same buckets are reduce-scattered instead, each to the replicas' shards as
  soon as it is ready; ``REDUCESCATTER`` with ``bucket`` and ``ready``, then ``OPTIM`` on the shard
  and ``ALLGATHER`` as without buckets.
- ``tp-split`` (CoCoNet section 6.2, its Megatron-LM example; Megatron sequence parallelism,
  Korthikanti et al., 2022): in a tensor-parallel block the row-parallel all-reduce followed by
  dropout and the residual add becomes a reduce-scatter, dropout and add on the ``1/tp`` shard of
  the sequence, then an all-gather before the next column-parallel layer (DTensor's
  ``SequenceParallel`` with ``RowwiseParallel(output_layouts=Shard(1))``, as torchtitan applies
  it). Norms, dropout and residual adds run on ``1/tp`` of the tokens and keep ``1/tp`` of their
  activations.
- ``scatter-send`` (CoCoNet section 6.3, its pipeline example): with ``tp > 1`` and ``pp > 1`` a
  stage sends only its ``1/tp`` slice (of the sequence) of the boundary activation to the same
  tensor rank of the next stage, which all-gathers it from its tensor group. Instructions:
  ``SEND``/``RECV`` of ``1/tp`` of the bytes, and an ``ALLGATHER`` of the group after the receive.
- ``chunked-overlap`` (CoCoNet section 4, overlapping a matmul with the collective that consumes
  it): a row-parallel matmul and its all-reduce are split into ``ParallelConfig.overlap_chunks``
  chunks of the sequence and pipelined, the all-reduce of chunk ``i`` running while chunk
  ``i + 1`` is multiplied (on GPUs ``torch.distributed._symmetric_memory``'s fused
  matmul-reduce-scatter is the library for it).

:func:`check_transforms` validates a plan's transformations against its configuration and refuses
one in one sentence naming it and the precondition it lacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from engine.errors import CoCoNetError

__all__ = ["TRANSFORMS", "TransformSpec", "check_transforms", "parse_transforms",
           "DEFAULT_GRAD_BUCKET_BYTES", "DEFAULT_OVERLAP_CHUNKS", "gradient_buckets"]

#: PyTorch DDP's default bucket size (``bucket_cap_mb=25``).
DEFAULT_GRAD_BUCKET_BYTES = 25 * 2**20
DEFAULT_OVERLAP_CHUNKS = 4


@dataclass(frozen=True)
class TransformSpec:
    """One transformation.

    Attributes:
        name: the option's name (``"sharded-update"``).
        summary: one line for ``--help`` and the app.
        needs: the precondition in words (shown when it is refused).
    """

    name: str
    summary: str
    needs: str


TRANSFORMS: dict[str, TransformSpec] = {t.name: t for t in (
    TransformSpec("sharded-update", "DP all-reduce -> reduce-scatter, the optimizer updates this rank's 1/dp shard "
                  "(Adam, AdamA), all-gather of the parameters (ZeRO-1/2)", "dp > 1 and optimizer adam or adama"),
    TransformSpec("overlap-grad-sync", "each segment's gradient all-reduce in buckets posted during its last backward "
                  "(DDP's hooks), overlapping the rest of it", "dp > 1"),
    TransformSpec("tp-split", "row-parallel all-reduce + dropout + residual add -> reduce-scatter, dropout and add on "
                  "the 1/tp shard, all-gather (Megatron sequence parallelism)",
                  "tp > 1 and the layer split (Llama-family models, tessel-gpt)"),
    TransformSpec("scatter-send", "a stage sends its 1/tp slice of the boundary activation, the next stage "
                  "all-gathers it", "tp > 1 and pp > 1"),
    TransformSpec("chunked-overlap", "a row-parallel matmul and its all-reduce split into chunks and pipelined",
                  "tp > 1 and the layer split"),
)}


def parse_transforms(names: str | Iterable[str] | None) -> tuple[str, ...]:
    """The transformations ``names`` (``"a,b"`` or a list), each once, in :data:`TRANSFORMS` order.

    Raises:
        CoCoNetError: an unknown name; the message lists the valid ones.
    """
    if names is None:
        return ()
    items = [x.strip() for x in (names.split(",") if isinstance(names, str) else names)]
    items = [x for x in items if x]
    unknown = [x for x in items if x not in TRANSFORMS]
    if unknown:
        raise CoCoNetError(f"unknown transformation {unknown[0]!r}; valid ones: {', '.join(TRANSFORMS)}")
    return tuple(t for t in TRANSFORMS if t in items)


def check_transforms(transforms: Sequence[str], *, dp: int, tp: int, pp: int, optimizer: str = "adam",
                     split: str | None = None, expert_parallel: bool = False, seq_len: int | None = None) -> None:
    """Refuse transformations whose preconditions the plan lacks.

    Args:
        transforms: names (:func:`parse_transforms` order).
        dp, tp, pp: the plan's degrees.
        optimizer: ``adam``, ``adama`` or ``sgd``.
        split: the plan's stage split (``"layers"`` for eager decoder stages).
        expert_parallel: the model has expert-parallel MoE layers (experts are owned by one
            replica and not all-reduced).
        seq_len: tokens per sample (``tp-split`` and ``scatter-send`` cut the sequence into ``tp``
            equal shards); ``None``: not checked.

    Raises:
        CoCoNetError: the first transformation refused, in one sentence naming it and why.
    """
    names = parse_transforms(transforms)
    for name in names:
        why = _refusal(name, dp=dp, tp=tp, pp=pp, optimizer=optimizer, split=split, expert_parallel=expert_parallel)
        if why:
            raise CoCoNetError(f"transformation {name!r} needs {TRANSFORMS[name].needs}, but {why}")
    if "tp-split" in names and "chunked-overlap" in names:
        raise CoCoNetError("transformation 'chunked-overlap' cannot be combined with 'tp-split', whose row-parallel "
                           "layers end in a reduce-scatter, not the all-reduce chunked-overlap pipelines; choose one "
                           "of them")
    for name in ("tp-split", "scatter-send"):
        if name in names and tp > 1 and seq_len and seq_len % tp:
            raise CoCoNetError(f"transformation {name!r} cuts the sequence into tp = {tp} equal shards, but the "
                               f"sequence length {seq_len} is not divisible by {tp}; "
                               f"use --seq-len {seq_len - seq_len % tp}")
    if "overlap-grad-sync" in names and optimizer == "adama":
        raise CoCoNetError("transformation 'overlap-grad-sync' needs dp > 1 and gradients to all-reduce, but with "
                           "optimizer 'adama' the replicas reduce Adam's states once per step, after the last fold; "
                           "use optimizer adam, or leave it out")


def _refusal(name: str, *, dp: int, tp: int, pp: int, optimizer: str, split: str | None,
             expert_parallel: bool) -> str | None:
    if name in ("sharded-update", "overlap-grad-sync"):
        if dp < 2:
            return (f"this plan has dp = {dp}: there is no data-parallel gradient to synchronise; plan with --dp 2 "
                    "or more")
        if name == "sharded-update" and optimizer not in ("adam", "adama"):
            return f"its optimizer is {optimizer!r}; use adam or adama"
        if expert_parallel:
            return ("its MoE experts are expert-parallel (each replica owns its experts, which are not all-reduced); "
                    "leave this transformation out for MoE models")
    if name in ("tp-split", "scatter-send", "chunked-overlap"):
        if tp < 2:
            return f"this plan has tp = {tp}: there is no tensor-parallel collective to rewrite; plan with --tp 2"
        if split != "layers":
            return (f"its stages are built with the {split!r} split, which tensor parallelism cannot shard; use a "
                    "Llama-family model or tessel-gpt")
    if name == "scatter-send" and pp < 2:
        return f"this plan has pp = {pp}: no stage sends an activation to another; plan with more devices than dp * tp"
    return None


def gradient_buckets(nbytes: int, bucket_bytes: int = DEFAULT_GRAD_BUCKET_BYTES) -> list[int]:
    """The buckets of a segment's flat gradient buffer of ``nbytes`` (reverse parameter order, as
    PyTorch DDP): ``bucket_bytes`` each, the last one the remainder; ``[]`` for an empty segment.
    The engine's lowering and the runtime's hooks cut the buffer the same way.

    Raises:
        CoCoNetError: ``bucket_bytes < 1``.
    """
    if bucket_bytes < 1:
        raise CoCoNetError(f"the gradient bucket size must be at least 1 byte, got {bucket_bytes}")
    if nbytes <= 0:
        return []
    full, rest = divmod(int(nbytes), int(bucket_bytes))
    return [int(bucket_bytes)] * full + ([rest] if rest else [])
