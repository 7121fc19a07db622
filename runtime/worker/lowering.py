"""A stage worker's own instruction stream, lowered from what it built (parameter bytes, expert
parallelism, tied groups); ``docs/runtime-worker.md``, "What a rank does in setup"."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.dependency import Instruction, lower
from runtime.tensor_parallel import local_tensor

if TYPE_CHECKING:
    from runtime.worker.stage_worker import StageWorker

__all__ = ["local_stream"]


def local_stream(w: StageWorker, plan: Any, tied_bytes: list[int]) -> list[Instruction]:
    """This pipeline rank's instruction stream (``engine.dependency.lower``), from what this
    worker actually built: the local segments' parameter bytes (experts: this replica's
    share), the bytes their DP ``ALLREDUCE`` reduces (experts excluded), the expert-parallel
    all-to-alls of each local segment (``ALLTOALL`` markers with the engine's byte formula,
    ``engine.models.moe.comm.moe_segment_collectives``), the tied groups (a tied
    ``ALLREDUCE`` before ``OPTIM`` where their copies span pipeline ranks); a tensor-parallel parameter
    counts its local shard; the plan's CoCoNet transformations (``plan.parallel.transforms``). For a fresh plan
    this equals ``engine.planner.lower_plan(plan)``'s stream of this rank."""
    from engine.dependency import TiedGroup
    from engine.models.moe.comm import find_moe_layers, moe_segment_collectives

    seg_bytes = {s: sum(local_tensor(p).numel() * p.element_size() for p in w.seg_params[s]) for s in w.segments}
    ar_bytes = {s: sum(local_tensor(p).numel() * p.element_size() for p in w.dp_params[s]) for s in w.segments}
    tokens = w.mbs * w.seq_len
    alltoalls = {s: moe_segment_collectives(find_moe_layers(w.modules[s], tokens), w.ep, "F")
                 for s in w.segments if w.moe_layers[s]} if w.ep > 1 else {}
    tied = [TiedGroup(tuple(sorted((int(s), str(n)) for s, n in group)), int(nb))
            for group, nb in zip(w.tied, tied_bytes)]
    par = plan.parallel
    ex = lower(plan.schedule, dp=w.dp, segment_param_bytes=seg_bytes, segment_allreduce_bytes=ar_bytes,
               optimizer_kind="adama" if w.optimizer_name == "adama" else "adam", alltoalls=alltoalls,
               tied=tied, transforms=par.transforms, tp=w.tp, grad_bucket_bytes=par.grad_bucket_bytes)
    return ex.streams[w.pp_rank]
