"""Checkpoint state of stage workers: one rank's ``state_dict``/``load_state_dict`` and the
unsplit model's state merged from every rank (``docs/runtime-worker.md``, "Checkpoints")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from runtime.conv1d_parallel import packed_parts, unpack
from runtime.expert_parallel_hf import HFExpertParallel
from runtime.tensor_parallel import from_local_state, local_tensor
from runtime.worker.device import cpu_copy
from runtime.worker.errors import WorkerError

__all__ = ["CheckpointSource", "expert_slices", "load_worker_state", "merge_model_state", "worker_state"]


@dataclass
class CheckpointSource:
    """What one rank's checkpoint is made of (:func:`worker_state`, :func:`load_worker_state`)."""

    rank: int
    """The global rank."""
    pp_rank: int
    """Its pipeline rank."""
    dp_index: int
    """Its data-parallel replica."""
    segments: list[int]
    """The segments it runs, ascending."""
    modules: dict[int, nn.Module]
    """Segment -> stage module."""
    opt: Any
    """The optimizer (:class:`~runtime.worker.optimizer.WorkerOptimizer`: ``state_dict(compact)``,
    ``load_state_dict``, ``params_changed``)."""
    aliases: list[list[str]]
    """The unsplit model's names of each shared parameter (:attr:`runtime.stages.PipelineStages.aliases`)."""
    tp_dims: dict[int, dict[str, int]] = field(default_factory=dict)
    """Segment -> ``{state_dict key: sharded dim}`` of its tensor-parallel parameters."""
    seg_shard: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Segment -> ``(shard index, shards)`` of its tensor-parallel parameters."""
    fsdp: set[int] = field(default_factory=set)
    """The segments sharded with FSDP2 (:mod:`runtime.fsdp`)."""
    fsdp_shards: tuple[int, int] = (0, 1)
    """``(shard index, dp_shard)`` of the FSDP-sharded parameters (dim 0 of each tensor-parallel shard)."""


def expert_slices(module: torch.nn.Module) -> dict[str, list[int]]:
    """``{state_dict key: [first expert, end expert, E]}`` for each expert-sliced parameter of
    ``module`` (the 3-D weights of :class:`~runtime.expert_parallel_hf.HFExpertParallel`), under
    every key ``module.state_dict()`` gives it; ``{}`` without such parameters."""
    owned: dict[int, list[int]] = {}
    for m in module.modules():
        if isinstance(m, HFExpertParallel):
            for name, (lo, hi, e) in m.shard_info().items():
                owned[id(getattr(m, name))] = [lo, hi, e]
    if not owned:
        return {}
    return {k: owned[id(v)] for k, v in module.state_dict(keep_vars=True).items() if id(v) in owned}


def worker_state(w: CheckpointSource, *, compact: bool = False) -> dict:
    """:meth:`StageWorker.state_dict`: ``{"rank", "pp_rank", "dp_index", "segments": {segment:
    {param name: CPU tensor}}, "optimizer": CPU state_dict or None, "expert_slices": {param name:
    [first expert, end expert, E]}}``; ``expert_slices`` names the entries that hold only this
    replica's rows ``[first, end)`` of an ``[E, ...]`` expert parameter (HF MoE blocks under
    expert parallelism; empty otherwise); ``tp_shards`` ``{param name: [dim, shard index, shards]}``
    (``[dim, shard index, shards, parts]`` for a parameter sharded part by part,
    :mod:`runtime.conv1d_parallel`)
    names the entries that hold only this rank's shard (tensor rank of ``tp``, or the rank's place in
    a multi-device block's device set) (tensor parallelism saves each rank's local shard,
    no collective); ``aliases``: the unsplit model's names of each shared
    parameter (:attr:`runtime.stages.PipelineStages.aliases`), for :func:`merge_model_state`.
    ``loss_scaler``: ``16-mixed``'s loss scale state (:meth:`runtime.precision.LossScaler.state_dict`:
    ``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``_growth_tracker``,
    ``skipped``), ``None`` otherwise; :func:`load_worker_state` restores it, so a resumed run
    continues with the same scale.
    ``fsdp_shards`` ``{param name: [0, shard index, dp_shard]}`` names the entries of FSDP-sharded
    segments that hold only this rank's dim-0 shard (``torch.chunk`` of the tensor-parallel shard,
    FSDP2's layout; no collective).
    ``compact``: the optimizer state as :meth:`WorkerOptimizer.state_dict
    <runtime.worker.optimizer.WorkerOptimizer.state_dict>` compacts it (on CUDA)."""
    segs = {s: {k: cpu_copy(local_tensor(v)) for k, v in w.modules[s].state_dict().items()} for s in w.segments}
    opt = w.opt.state_dict(compact=compact)
    slices = {k: v for s in w.segments for k, v in expert_slices(w.modules[s]).items()}
    tp_dims = getattr(w, "tp_dims", {})   # absent on stand-ins built without tensor parallelism (test stubs)
    shards = {}
    for s in w.segments:
        parts = packed_parts(w.modules[s])   # GPT-2's c_attn: query, key and value sharded part by part
        for k, dim in tp_dims.get(s, {}).items():
            shards[k] = [dim, *w.seg_shard[s], *([parts[k]] if k in parts else [])]
    fsdp: set[int] = getattr(w, "fsdp", set())   # absent on stand-ins (test stubs)
    fsdp_shards = {k: [0, *w.fsdp_shards] for s in w.segments if s in fsdp
                   for k, v in w.modules[s].state_dict(keep_vars=True).items() if isinstance(v, DTensor)}
    scaler = getattr(w.opt, "scaler", None)   # 16-mixed: the loss scale and its growth tracker
    return {"rank": w.rank, "pp_rank": w.pp_rank, "dp_index": w.dp_index, "segments": segs, "optimizer": opt,
            "expert_slices": slices, "tp_shards": shards, "fsdp_shards": fsdp_shards,
            "aliases": [list(g) for g in w.aliases],
            "loss_scaler": scaler.state_dict() if scaler is not None else None}


def load_worker_state(w: CheckpointSource, sd: dict) -> None:
    """:meth:`StageWorker.load_state_dict`. Raises :class:`WorkerError` when the checkpoint holds
    other segments than this rank runs."""
    segs = {int(k): v for k, v in sd["segments"].items()}
    if sorted(segs) != w.segments:
        raise WorkerError(f"the checkpoint holds segments {sorted(segs)}, but rank {w.rank} runs "
                          f"{w.segments}")
    for s in w.segments:
        mod = w.modules[s]
        mod.load_state_dict(from_local_state(segs[s], mod.state_dict(keep_vars=True)))
    w.opt.params_changed()
    w.opt.load_state_dict(sd.get("optimizer"))
    scaler = getattr(w.opt, "scaler", None)
    if scaler is not None and sd.get("loss_scaler") is not None:   # resume with the saved loss scale
        scaler.load_state_dict(sd["loss_scaler"])


def merge_model_state(states: Iterable[dict]) -> dict[str, torch.Tensor]:
    """The unsplit model's ``state_dict`` from every rank's :meth:`StageWorker.state_dict`.

    Args:
        states: the ranks' state dicts (any order; all ranks of one replica at least, and with
            expert parallelism all replicas, so that every expert is present).

    Returns:
        ``{name: tensor}``, the union of the ranks' segment entries, in the first holder's key
        order. Entries held by several ranks (replicated parameters of the replicas, tied copies
        such as ``wte``/``lm_head`` under their own names) are taken from the lowest rank;
        replicas hold identical values. Expert-sliced entries (a state's ``expert_slices``: HF MoE
        experts ``[E/dp, ...]`` per replica) are concatenated along dim 0 in expert order into the
        full ``[E, ...]`` tensor. Tensor-parallel entries (a state's ``tp_shards``: ``[dim, tp_rank,
        tp]``) are concatenated along ``dim`` in tensor-rank order (DTensor's ``Shard(dim)`` layout,
        even shards); ``[dim, tp_rank, tp, parts]`` entries were sharded part by part (GPT-2's fused
        query/key/value, :func:`runtime.conv1d_parallel.unpack` restores the unsplit layout); an
        expert-sliced entry that is also tensor-parallel (MoE experts under dp and tp,
        :mod:`runtime.moe_tensor_parallel`) is merged over the tensor ranks per replica first. Fully sharded
        entries (``fsdp_shards``: ``[0, shard index, dp_shard]``) are first concatenated along dim 0 in
        shard order, per tensor rank (FSDP2 shards each tensor-parallel shard; replicas of HSDP hold the
        same shards, the lowest rank's are taken). A parameter the unsplit model shares under several names
        (a state's ``aliases``: T5's ``shared.weight`` and its embeddings, BERT's head bias) appears under
        every one of them, so ``model.load_state_dict(state)`` (strict) loads it into the plan's model.

    Raises:
        WorkerError: the states miss some rows of an expert-sliced entry (not every replica given)
            or hold overlapping slices of it, or miss a tensor rank's shard of a tensor-parallel entry
            or a shard of a fully sharded one.
    """
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[int, tuple[int, int, torch.Tensor]]] = {}
    alias_groups: list[list[str]] = []
    # (name, first expert of a replica's expert slice or -1) -> (dim, tp, tensor rank -> shard)
    shards: dict[tuple[str, int], tuple[int, int, dict[int, torch.Tensor]]] = {}
    fsdp: dict[str, tuple[int, dict[tuple[int, int], torch.Tensor]]] = {}
    packed: dict[str, int] = {}
    for sd in sorted(states, key=lambda d: int(d.get("rank", 0))):
        alias_groups += [list(g) for g in sd.get("aliases") or [] if list(g) not in alias_groups]
        sliced = sd.get("expert_slices") or {}
        tp_sharded = sd.get("tp_shards") or {}
        fully = sd.get("fsdp_shards") or {}
        for _seg, entries in sorted(sd["segments"].items(), key=lambda kv: int(kv[0])):
            for k, v in entries.items():
                out.setdefault(k, v)
                if k in fully:
                    _, i, count = (int(x) for x in fully[k])
                    t = int(tp_sharded[k][1]) if k in tp_sharded else 0
                    fsdp.setdefault(k, (count, {}))[1].setdefault((t, i), v)
                lo = -1
                if k in sliced:
                    lo, hi, e = (int(x) for x in sliced[k])
                    pieces.setdefault(k, {}).setdefault(lo, (hi, e, v))
                if k in tp_sharded:   # MoE experts under both: each replica's slice is sharded over the tensor ranks
                    dim, t, tp = (int(x) for x in tp_sharded[k][:3])
                    shards.setdefault((k, lo), (dim, tp, {}))[2].setdefault(t, v)
                    if len(tp_sharded[k]) > 3:   # sharded part by part (runtime.conv1d_parallel.pack)
                        packed[k] = int(tp_sharded[k][3])
    for k, (count, pieces_of) in fsdp.items():   # FSDP's dim-0 shards first: each tensor rank's local tensor
        for t in sorted({t for t, _ in pieces_of}):
            if any((t, i) not in pieces_of for i in range(count)):
                raise WorkerError(f"cannot merge {k}: the states hold fully sharded pieces "
                                  f"{sorted(i for tt, i in pieces_of if tt == t)} of {count}; pass the states of "
                                  "every rank of the shard group")
            whole = torch.cat([pieces_of[(t, i)] for i in range(count)], dim=0)
            if (k, -1) in shards:
                shards[(k, -1)][2][t] = whole
            else:
                out[k] = whole
    for (k, lo), (dim, tp, by_rank) in shards.items():
        if sorted(by_rank) != list(range(tp)):
            raise WorkerError(f"cannot merge {k}: the states hold tensor-parallel shards {sorted(by_rank)} of "
                              f"{tp}; pass the states of every tensor rank")
        ordered = [by_rank[t] for t in range(tp)]
        whole = unpack(ordered, packed[k], dim) if k in packed else torch.cat(ordered, dim=dim)
        if lo >= 0:   # this replica's experts, whole: joined with the other replicas' below
            hi, e, _ = pieces[k][lo]
            pieces[k][lo] = (hi, e, whole)
        else:
            out[k] = whole
    for k, by_lo in pieces.items():
        e = next(iter(by_lo.values()))[1]
        at, parts = 0, []
        for lo in sorted(by_lo):
            hi, _, v = by_lo[lo]
            if lo != at:
                raise WorkerError(f"cannot merge {k}: the states hold experts {_ranges(by_lo)} of {e}, not a "
                                  f"partition of 0..{e - 1}; pass the states of every replica")
            parts.append(v)
            at = hi
        if at != e:
            raise WorkerError(f"cannot merge {k}: the states hold experts {_ranges(by_lo)} of {e}; pass the "
                              f"states of every replica")
        out[k] = torch.cat(parts, dim=0)
    for names in alias_groups:
        held = next((n for n in names if n in out), None)
        if held is not None:
            for n in names:
                out.setdefault(n, out[held])
    return out


def _ranges(by_lo: dict[int, tuple[int, int, torch.Tensor]]) -> str:
    return ", ".join(f"{lo}..{by_lo[lo][0] - 1}" for lo in sorted(by_lo))
