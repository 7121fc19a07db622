"""A stage worker's own instruction stream: the plan's lowering options
(:func:`engine.plan.lowering.plan_lower_options`, passed whole) with what the worker built put in
(parameter bytes, expert parallelism, tied groups); ``docs/runtime-worker.md``, "What a rank does
in setup"."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from engine.dependency import Instruction, TiedGroup, lower
from engine.models.moe.comm import find_moe_layers, moe_segment_collectives
from engine.plan.lowering import plan_lower_options
from runtime.tensor_parallel import local_tensor
from runtime.worker.context import LocalStages, RankCoords

__all__ = ["local_stream"]


def _local_bytes(params: Sequence[Any]) -> int:
    """Bytes of ``params`` on this rank (a tensor-parallel parameter counts its local shard)."""
    return sum(local_tensor(p).numel() * p.element_size() for p in params)


def local_stream(plan: Any, *, local: LocalStages, coords: RankCoords, tied: Sequence[Sequence[tuple[int, str]]],
                 tied_bytes: Sequence[int], optimizer_name: str | None, tokens: int) -> list[Instruction]:
    """This pipeline rank's instruction stream (``engine.dependency.lower``): the plan's
    :class:`~engine.dependency.LowerOptions` (its CoCoNet transformations and bucket size, its
    segments' tensor-parallel collectives, ...) with what this worker actually built in place of
    the plan's numbers: the local segments' parameter bytes (experts: this replica's share; a
    tensor-parallel parameter counts its local shard), the bytes their DP ``ALLREDUCE`` reduces
    (experts excluded), the expert-parallel all-to-alls of each local segment (``ALLTOALL``
    markers with the engine's byte formula, ``engine.models.moe.comm.moe_segment_collectives``),
    the tied groups (a tied ``ALLREDUCE`` before ``OPTIM`` where their copies span pipeline
    ranks), the worker's ``dp``/``tp`` and optimizer. For a fresh plan this equals
    ``engine.plan.lowering.lower_plan(plan)``'s stream of this rank.

    Args:
        plan: the loaded plan (:class:`engine.io.Plan`).
        local: this rank's stage modules and their parameters.
        coords: where this rank sits (``dp``, ``tp``, pipeline rank).
        tied: each tied group's ``(segment, parameter name)`` members.
        tied_bytes: bytes of one copy of each tied group (same order as ``tied``).
        optimizer_name: the worker's optimizer (``adama`` lowers AdamA's state all-reduce).
        tokens: tokens of one micro-batch (``micro_batch_size x seq_len``), for the all-to-all bytes.
    """
    # an FSDP segment counts its parameters as they were before FSDP sharded them (the engine's
    # lowering divides by dp_shard itself), as a tensor-parallel one counts its local shards
    seg_bytes = {s: local.unsharded_bytes.get(s, _local_bytes(local.params[s])) for s in local.segments}
    ar_bytes = {s: local.unsharded_bytes.get(s, _local_bytes(local.dp_params[s])) for s in local.segments}
    alltoalls = {s: moe_segment_collectives(find_moe_layers(local.modules[s], tokens), local.ep, "F")
                 for s in local.segments if local.moe_layers[s]} if local.ep > 1 else {}
    groups = [TiedGroup(tuple(sorted((int(s), str(n)) for s, n in group)), int(nb))
              for group, nb in zip(tied, tied_bytes)]
    options = replace(plan_lower_options(plan), dp=coords.dp, tp=coords.tp, segment_param_bytes=seg_bytes,
                      segment_allreduce_bytes=ar_bytes, alltoalls=alltoalls, tied=groups,
                      optimizer_kind="adama" if optimizer_name == "adama" else "adam",
                      # the bytes above are measured on this rank's own tensors, whose gradients are
                      # what it all-reduces (fp32 under autocast, bf16 for bf16-true): no rescaling
                      precision="32-true")
    return lower(plan.schedule, options).streams[coords.pp_rank]
