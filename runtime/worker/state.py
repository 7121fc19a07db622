"""Checkpoint state of stage workers: one rank's ``state_dict``/``load_state_dict`` and the
unsplit model's state merged from every rank (``docs/runtime-worker.md``, "Checkpoints")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from runtime.worker.device import cpu_copy
from runtime.worker.errors import WorkerError

if TYPE_CHECKING:
    from runtime.worker.stage_worker import StageWorker

__all__ = ["load_worker_state", "merge_model_state", "worker_state"]


def worker_state(w: StageWorker) -> dict:
    """:meth:`StageWorker.state_dict`: ``{"rank", "pp_rank", "dp_index", "segments": {segment:
    {param name: CPU tensor}}, "optimizer": CPU state_dict or None}``."""
    segs = {s: {k: cpu_copy(v) for k, v in w.modules[s].state_dict().items()} for s in w.segments}
    opt = w.opt.state_dict(compact=w._cuda)
    return {"rank": w.rank, "pp_rank": w.pp_rank, "dp_index": w.dp_index, "segments": segs, "optimizer": opt}


def load_worker_state(w: StageWorker, sd: dict) -> None:
    """:meth:`StageWorker.load_state_dict`. Raises :class:`WorkerError` when the checkpoint holds
    other segments than this rank runs."""
    segs = {int(k): v for k, v in sd["segments"].items()}
    if sorted(segs) != w.segments:
        raise WorkerError(f"the checkpoint holds segments {sorted(segs)}, but rank {w.rank} runs "
                          f"{w.segments}")
    for s in w.segments:
        w.modules[s].load_state_dict(segs[s])
    w.opt.load_state_dict(sd.get("optimizer"))


def merge_model_state(states: Iterable[dict]) -> dict[str, torch.Tensor]:
    """The unsplit model's ``state_dict`` from every rank's :meth:`StageWorker.state_dict`.

    Args:
        states: the ranks' state dicts (any order; all ranks of one replica at least, and with
            expert parallelism all replicas, so that every expert is present).

    Returns:
        ``{name: tensor}``, the union of the ranks' segment entries. Entries held by several
        ranks (replicated parameters of the replicas, tied copies such as ``wte``/``lm_head``
        under their own names) are taken from the lowest rank; replicas hold identical values.
        Load it with ``model.load_state_dict(state)`` into the plan's model.
    """
    out: dict[str, torch.Tensor] = {}
    for sd in sorted(states, key=lambda d: int(d.get("rank", 0))):
        for _seg, entries in sorted(sd["segments"].items(), key=lambda kv: int(kv[0])):
            for k, v in entries.items():
                out.setdefault(k, v)
    return out
