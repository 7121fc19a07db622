"""The placement's forward DAG between segments, as a stage worker executes it
(``docs/runtime-worker.md``, "Ranks"): which segments feed which, where each runs, what crosses
each boundary, and which slice of a consumer's input gradients belongs to which producer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from runtime.stages import TensorMeta
from runtime.worker.errors import WorkerError

__all__ = ["Dataflow"]


@dataclass(frozen=True)
class Dataflow:
    """The forward DAG of a plan's segments (the same on every rank). A chain has
    ``preds[s] == [s - 1]``; Tessel's K joins two branches in its loss block; model replicas (X)
    are chains too, :attr:`chains` / :attr:`chain_of` say which data micro-batch each carries."""

    num_segments: int
    """``S``, the placement's segments."""
    num_micro_batches: int
    """``m``, placement instances (micro-batches) per replica and step."""
    seg_devices: dict[int, tuple[int, ...]]
    """Segment -> the pipeline ranks running it (its forward's device set; several: a tensor-parallel block)."""
    preds: dict[int, list[int]]
    """Segment -> the segments whose outputs it takes, in order (``[]``: it takes model inputs)."""
    succ: dict[int, int | None]
    """Segment -> the one segment taking its outputs (``None``: it computes a loss)."""
    input_segments: frozenset[int]
    """Segments no forward feeds: they take the model inputs."""
    loss_segments: frozenset[int]
    """Segments no forward depends on: they compute the loss."""
    chains: list[list[int]]
    """The placement's model replicas (:meth:`engine.placement.Placement.replica_chains`): one
    chain (or K's joined branches), two for X."""
    chain_of: dict[int, int]
    """Segment -> the index of its chain in :attr:`chains`."""
    seg_inputs: dict[int, list[int]]
    """Input segment -> the indices of the model inputs it takes (the plan segment's ``inputs``, e.g.
    one tower's ids in K); absent: all of them."""
    boundaries: list[list[TensorMeta]]
    """``boundaries[s]``: the tensors segment ``s`` outputs, one micro-batch (a rank's local shard
    with ``tp-split``)."""
    in_metas: dict[int, list[TensorMeta]]
    """Segment -> the metas of its inputs (its producers' outputs, in :attr:`preds` order)."""
    grad_slices: dict[int, dict[int, tuple[int, int]]]
    """Consumer -> producer -> ``(lo, hi)``: the slice of the consumer's input gradients that belongs
    to that producer (what the consumer's backward sends it)."""

    @classmethod
    def from_plan(cls, plan: Any, boundaries: Sequence[Sequence[TensorMeta]]) -> Dataflow:
        """The DAG of ``plan.schedule.placement`` with ``boundaries`` (per segment, its outputs' metas)."""
        pl = plan.schedule.placement
        S = pl.num_segments
        preds = {s: [pl.blocks[i].segment for i in pl.spec("F", s).deps] for s in range(S)}
        succ: dict[int, int | None] = {s: None for s in range(S)}
        for c, ps in preds.items():
            for p in ps:
                succ[p] = c
        chains = pl.replica_chains()
        bounds = [list(b) for b in boundaries]
        grad_slices: dict[int, dict[int, tuple[int, int]]] = {}
        for c, ps in preds.items():
            at, sl = 0, {}
            for p in ps:
                k = sum(1 for m in bounds[p] if m.requires_grad)
                sl[p] = (at, at + k)
                at += k
            grad_slices[c] = sl
        return cls(
            num_segments=S, num_micro_batches=int(plan.schedule.num_micro_batches),
            seg_devices={s: tuple(pl.spec("F", s).devices) for s in range(S)},
            preds=preds, succ=succ,
            input_segments=frozenset(s for s, ps in preds.items() if not ps),
            loss_segments=frozenset(s for s, c in succ.items() if c is None),
            chains=chains, chain_of={s: c for c, chain in enumerate(chains) for s in chain},
            seg_inputs={int(g["index"]): [int(k) for k in g["inputs"]] for g in plan.segments
                        if g.get("inputs") is not None},
            boundaries=bounds, in_metas={c: [m for p in ps for m in bounds[p]] for c, ps in preds.items()},
            grad_slices=grad_slices)

    @property
    def last_segment(self) -> int:
        """The first chain's last segment (it computes the loss; every chain's last segment does,
        :attr:`loss_segments`)."""
        return self.chains[0][-1]

    def data_index(self, s: int, j: int) -> int:
        """The data micro-batch that placement instance ``j`` carries through segment ``s``: ``j`` on the
        first chain, ``c * m + j`` on chain ``c`` (the X shape's second model replica)."""
        return self.chain_of[s] * self.num_micro_batches + j

    def grad_producer(self, c: int, pp_rank: int) -> int:
        """The producer of segment ``c`` whose backward runs on pipeline rank ``pp_rank``: where ``c``'s
        backward sends, or from where that rank receives, input gradients.

        Raises:
            WorkerError: none of ``c``'s producers runs there.
        """
        for p in self.preds[c]:
            if pp_rank in self.seg_devices[p]:
                return p
        raise WorkerError(f"segment {c}'s backward sends input gradients to pipeline rank {pp_rank}, which runs none "
                          f"of its producers {self.preds[c]}")
