"""A stage worker's own instruction stream: the plan's lowering options
(:func:`engine.plan.lowering.plan_lower_options`, passed whole) with what the worker built put in
(parameter bytes, expert parallelism, tied groups); ``docs/runtime-worker.md``, "What a rank does
in setup"."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from engine.dependency import Instruction, TiedGroup, lower
from engine.models.moe.comm import find_moe_layers, moe_segment_collectives
from engine.plan.lowering import plan_lower_options
from runtime.tensor_parallel import local_tensor

if TYPE_CHECKING:
    from runtime.worker.stage_worker import StageWorker

__all__ = ["local_stream"]


def local_stream(w: StageWorker, plan: Any, tied_bytes: list[int]) -> list[Instruction]:
    """This pipeline rank's instruction stream (``engine.dependency.lower``): the plan's
    :class:`~engine.dependency.LowerOptions` (its CoCoNet transformations and bucket size, its
    segments' tensor-parallel collectives, ...) with what this worker actually built in place of
    the plan's numbers: the local segments' parameter bytes (experts: this replica's share; a
    tensor-parallel parameter counts its local shard), the bytes their DP ``ALLREDUCE`` reduces
    (experts excluded), the expert-parallel all-to-alls of each local segment (``ALLTOALL``
    markers with the engine's byte formula, ``engine.models.moe.comm.moe_segment_collectives``),
    the tied groups (a tied ``ALLREDUCE`` before ``OPTIM`` where their copies span pipeline
    ranks), the worker's ``dp``/``tp`` and optimizer. For a fresh plan this equals
    ``engine.plan.lowering.lower_plan(plan)``'s stream of this rank."""
    seg_bytes = {s: sum(local_tensor(p).numel() * p.element_size() for p in w.seg_params[s]) for s in w.segments}
    ar_bytes = {s: sum(local_tensor(p).numel() * p.element_size() for p in w.dp_params[s]) for s in w.segments}
    tokens = w.mbs * w.seq_len
    alltoalls = {s: moe_segment_collectives(find_moe_layers(w.modules[s], tokens), w.ep, "F")
                 for s in w.segments if w.moe_layers[s]} if w.ep > 1 else {}
    tied = [TiedGroup(tuple(sorted((int(s), str(n)) for s, n in group)), int(nb))
            for group, nb in zip(w.tied, tied_bytes)]
    options = replace(plan_lower_options(plan), dp=w.dp, tp=w.tp, segment_param_bytes=seg_bytes,
                      segment_allreduce_bytes=ar_bytes, alltoalls=alltoalls, tied=tied,
                      optimizer_kind="adama" if w.optimizer_name == "adama" else "adam")
    return lower(plan.schedule, options).streams[w.pp_rank]
