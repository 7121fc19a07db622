"""Chunk-streamed GNN execution on several ranks (NGra, USENIX ATC'19, sections 4-5; docs/gnn.md "Several devices").

Data parallelism over vertices: the ``P`` destination intervals of a
:class:`~engine.gnn.partition.GraphPartition` are spread over the ranks of a ``torch.distributed``
process group, each rank owning a CONTIGUOUS run of them (a GNN plan's ``assignment``, balanced by
edges, see :func:`engine.gnn.plan.balance_intervals`), so rank ``r`` owns the vertex rows
``[lo_r, hi_r)`` of the locality numbering and the ranks' rows, in rank order, tile ``0..N``. Per
layer ``l`` (``x_own``: this rank's rows of the layer input, ``[n_own, F_in]``):

1. ``h_own = apply_vertex_pre(x_own)`` interval by interval (identity for layers without one);
2. all-gather ``h`` (``[N, D_h]``; the features ``x`` themselves for a first layer without
   ``apply_vertex_pre``, which every rank has, so no collective) with an autograd-aware
   functional collective (``torch.distributed._functional_collectives.all_gather_single_autograd``,
   which torch 2.13 names as the successor of the deprecated
   ``torch.distributed.nn.functional.all_gather``), whose backward sums the ranks' gradients of
   ``h`` and hands each rank its rows (a reduce-scatter);
3. the Scatter / ApplyEdge / Gather of the rank's own destination intervals, streamed chunk by
   chunk by :mod:`runtime.gnn.streaming` (its ``StreamedGather`` with recomputation and the
   next-chunk prefetch thread) over a partition restricted to the edges INTO the rank's intervals
   (:func:`restrict_partition`), so the backward's source gradients are this rank's share of
   ``dL/dh`` for every source vertex;
4. ``apply_vertex`` on the own intervals, then ReLU (but after the last layer).

The loss is the cross-entropy of the masked vertices: each rank sums it over its own masked rows
and divides by the number of masked vertices of the WHOLE graph, so the ranks' losses add up to
the single-process mean and their parameter gradients add up to its gradient; the gradients are
all-reduced (one flat ``all_reduce``) before the optimizer step, and the loss and the per-split
correct counts are all-reduced once per step. 2 ranks compute what 1 rank computes (outputs,
gradients, training; tested in float64 against full-graph execution).

Every collective is measured as a :class:`CollectiveRecord` (a :class:`ChunkRecord` with
``kind="collective"`` and the ``op``: ``allgather``, ``reducescatter`` or ``allreduce``) next to
the streamed executor's load and compute records, and the optimizer step as a compute record
with ``i == OPTIMIZER``. The backward reduce-scatter runs inside autograd; it is timed by identity
autograd functions around the all-gather whose backward stamps the clock.

Memory note: the streamed gather of a rank allocates its aggregate for all ``N`` rows (the rows of
other ranks' intervals stay zero) and keeps an empty accumulator for each interval it does not own,
``O(N * message width)`` more than the plan's memory model counts (``n_own * acc width``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import _functional_collectives as fc

from engine.errors import GNNError
from engine.gnn.models import GNNModel
from engine.gnn.partition import GraphPartition
from engine.gnn.saga import SAGALayer
from runtime.gnn.streaming import (
    APPLY_VERTEX,
    APPLY_VERTEX_PRE,
    ChunkRecord,
    StreamedGather,
    StreamedGNN,
    _LayerStream,
)

__all__ = [
    "COLLECTIVE_OPS",
    "OPTIMIZER",
    "CollectiveRecord",
    "DistStepResult",
    "DistributedStreamedGNN",
    "owned_rows",
    "restrict_partition",
]

log = logging.getLogger(__name__)

#: ``ChunkRecord.i`` of the optimizer step (``layer == -1``, ``j == -1``, ``kind == "compute"``)
OPTIMIZER = -3
#: The ``op`` of a :class:`CollectiveRecord`.
COLLECTIVE_OPS = ("allgather", "reducescatter", "allreduce")
#: The evaluation splits whose correct predictions a training step counts.
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class CollectiveRecord(ChunkRecord):
    """One measured collective of a rank: a :class:`ChunkRecord` with ``kind == "collective"``,
    ``i == j == -1`` and the collective's ``op``.

    Attributes:
        layer: the layer whose vertex data it moves (``allgather`` in the forward, ``reducescatter``
            in the backward), or -1 for the step's ``allreduce`` of the parameter gradients
            (``phase == "B"``) and of the loss and accuracy counts (``phase == "F"``).
        bytes: the bytes of the whole gathered / reduced tensor (``N x width x element size`` for the
            vertex data, as :meth:`engine.gnn.cost.GNNCostModel.collective_time` takes them).
        op: ``"allgather"``, ``"reducescatter"`` or ``"allreduce"``.
    """

    op: str = "allgather"


@dataclass(frozen=True)
class DistStepResult:
    """One training step of one rank (see :meth:`DistributedStreamedGNN.train_step`).

    Attributes:
        loss: the loss of the whole graph (the mean cross-entropy over every masked vertex), before
            the update; the same on every rank.
        accuracy: ``{"train", "val", "test"}`` -> share of the split's vertices whose arg-max output
            (of this step's forward, before the update) is the label; ``nan`` for an empty split.
        seconds: wall time of the step on this rank (forward, backward, collectives, optimizer).
        records: the step's load, compute and collective records of this rank, sorted by start.
    """

    loss: float
    accuracy: dict[str, float]
    seconds: float
    records: list[ChunkRecord] = field(default_factory=list)


# ------------------------------------------------------------------------------------------ layout
def owned_rows(boundaries: Sequence[int], assignment: Sequence[int], world_size: int) -> list[tuple[int, int]]:
    """Per rank, the vertex rows ``(lo, hi)`` (locality numbering) of the destination intervals it owns.

    Args:
        boundaries: ``[P + 1]`` interval boundaries (``GraphPartition.boundaries``).
        assignment: ``assignment[j]``: the rank that owns destination interval ``j`` (``P`` entries).
        world_size: ranks.

    Returns:
        ``rows[r] = (lo, hi)``; a rank without intervals gets an empty ``(lo, lo)``. The ranges
        tile ``[0, N)`` in rank order.

    Raises:
        GNNError: ``assignment`` does not have ``P`` entries, names a rank outside ``[0, world_size)``,
            or is not non-decreasing (a rank's intervals must be contiguous and in rank order).
    """
    bounds = [int(b) for b in boundaries]
    p = len(bounds) - 1
    if len(assignment) != p:
        raise GNNError(f"the interval assignment has {len(assignment)} entries but the partition has P={p} intervals; "
                       "give one rank per destination interval.")
    ranks = [int(a) for a in assignment]
    for j, r in enumerate(ranks):
        if not 0 <= r < world_size:
            raise GNNError(f"destination interval {j} is assigned to rank {r}, outside the {world_size} ranks 0.."
                           f"{world_size - 1}; re-plan with as many devices as ranks.")
    for j in range(1, p):
        if ranks[j] < ranks[j - 1]:
            raise GNNError(f"destination interval {j} goes to rank {ranks[j]} after interval {j - 1} went to rank "
                           f"{ranks[j - 1]}; each rank must own a contiguous run of intervals in rank order, as "
                           "engine.gnn.plan.balance_intervals assigns them.")
    rows = []
    for r in range(world_size):
        own = [j for j in range(p) if ranks[j] == r]
        if own:
            rows.append((bounds[own[0]], bounds[own[-1] + 1]))
        else:
            lo = bounds[next((j for j in range(p) if ranks[j] > r), p)]
            rows.append((lo, lo))
    return rows


def restrict_partition(partition: GraphPartition, intervals: Sequence[int]) -> GraphPartition:
    """The partition with only the edges INTO ``intervals`` (a contiguous run of destination intervals).

    The same vertices, permutation, intervals and ``P``; chunk ``(i, j)`` keeps its edges when ``j``
    is in ``intervals`` and is empty otherwise. Since a partition's edge arrays are sorted by
    ``(destination interval, source interval)`` (:class:`GraphPartition`), this is one slice of them
    (views, no copy) with the chunk pointers shifted.

    Raises:
        GNNError: ``intervals`` is not a contiguous ascending run inside ``[0, P)``.
    """
    p = partition.num_parts
    js = [int(j) for j in intervals]
    if js and (js != list(range(js[0], js[0] + len(js))) or not 0 <= js[0] <= js[-1] < p):
        raise GNNError(f"intervals {js} are not a contiguous ascending run of destination intervals in [0, {p}).")
    if js:
        lo, hi = int(partition.chunk_ptr[js[0] * p]), int(partition.chunk_ptr[(js[-1] + 1) * p])
    else:
        lo = hi = 0
    ptr = (partition.chunk_ptr - lo).clamp(0, hi - lo)
    return GraphPartition(num_nodes=partition.num_nodes, num_parts=p, perm=partition.perm, inv_perm=partition.inv_perm,
                          boundaries=partition.boundaries, chunk_ptr=ptr, src_local=partition.src_local[lo:hi],
                          dst_local=partition.dst_local[lo:hi], edge_ids=partition.edge_ids[lo:hi])


def _has_pre(layer: SAGALayer) -> bool:
    """Whether the layer's ``apply_vertex_pre`` is not the identity (it overrides ``_apply_vertex_pre``)."""
    return type(layer)._apply_vertex_pre is not SAGALayer._apply_vertex_pre


class _Stamp(torch.autograd.Function):
    """Identity on tensors whose BACKWARD calls ``callback()`` (to time a collective inside autograd)."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: Tensor) -> Any:
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        ctx.callback()
        return (None, *grads)


# ------------------------------------------------------------------------------------------ executor
class DistributedStreamedGNN:
    """One rank of the vertex-parallel, chunk-streamed execution of a :class:`GNNModel` (module docstring).

    Every rank of ``group`` builds one with the same model parameters, partition and assignment.

    Args:
        model: the model (its parameters are used and trained in place; the same values on every rank).
        partition: the partition of the model's PREPARED graph
            (:func:`engine.gnn.partition.partition_for_model`), the same on every rank.
        assignment: ``assignment[j]``: the rank owning destination interval ``j`` (non-decreasing,
            e.g. ``GNNPlan.assignment``).
        group: the process group (``None``: the default group, which must be initialised).
        prefetch: load the next chunk on a loader thread while the current one computes.

    Attributes:
        rank, world_size: this rank and the group's size.
        intervals: the destination intervals this rank owns, ascending.
        rows: ``slice`` of this rank's vertex rows in the locality numbering.
        vertex_ids: ``[n_own]`` int64 original ids of those rows (``partition.perm[rows]``).
        streamed: the :class:`~runtime.gnn.streaming.StreamedGNN` over the restricted partition whose
            chunk machinery and ``records`` this rank uses.

    Raises:
        GNNError: no initialised process group, a bad assignment (see :func:`owned_rows`), or a model /
            partition :class:`StreamedGNN` refuses.
    """

    def __init__(self, model: GNNModel, partition: GraphPartition, assignment: Sequence[int], *,
                 group: Any = None, prefetch: bool = True):
        if not (dist.is_available() and dist.is_initialized()):
            raise GNNError("DistributedStreamedGNN needs an initialised torch.distributed process group; call "
                           "torch.distributed.init_process_group first.")
        if not isinstance(partition, GraphPartition):
            raise GNNError(f"DistributedStreamedGNN needs a GraphPartition, got {type(partition).__name__}.")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.assignment = [int(a) for a in assignment]
        self.row_ranges = owned_rows(partition.boundaries.tolist(), self.assignment, self.world_size)
        self.intervals = [j for j, r in enumerate(self.assignment) if r == self.rank]
        lo, hi = self.row_ranges[self.rank]
        self.rows = slice(lo, hi)
        self.partition = partition
        self.model = model
        self.streamed = StreamedGNN(model, restrict_partition(partition, self.intervals), prefetch=prefetch)
        self.vertex_ids = partition.perm[lo:hi].clone()
        self._vattr: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    # ---------------------------------------------------------------------------- helpers
    @property
    def records(self) -> list[ChunkRecord]:
        """This rank's records since the last :meth:`reset_records` (unsorted)."""
        return self.streamed.records

    def reset_records(self) -> list[ChunkRecord]:
        """Return the records so far, sorted by start time, and start a new list."""
        return self.streamed.reset_records()

    def vertex_attrs(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``[N, 2]`` in/out-degrees of the WHOLE partitioned graph, locality numbering (cached)."""
        key = (dtype, device)
        if key not in self._vattr:
            part = self.partition
            vattr = self._layers()[0].vertex_attrs(part.edge_index(), part.num_nodes, dtype=dtype)
            self._vattr[key] = vattr.to(device)
        return self._vattr[key]

    def _layers(self) -> list[SAGALayer]:
        return [cast(SAGALayer, layer) for layer in self.model.layers]

    def _sync(self, like: Tensor) -> None:
        if like.is_cuda:
            torch.cuda.current_stream(like.device).synchronize()

    def _record(self, rec: ChunkRecord) -> None:
        self.streamed.records.append(rec)

    def _dense(self, index: int, j: int, stage: int, fn: Callable[[], Tensor], like: Tensor) -> Tensor:
        start = time.perf_counter()
        out = fn()
        self._sync(like)
        self._record(ChunkRecord(index, "F", stage, j, "compute", start, time.perf_counter(),
                                 int(out.numel() * out.element_size())))
        return out

    def _local(self, j: int) -> slice:
        """Rows of interval ``j`` inside this rank's rows."""
        r = self.partition.interval(j)
        return slice(r.start - self.rows.start, r.stop - self.rows.start)

    # ---------------------------------------------------------------------------- collectives
    def _all_gather_rows(self, own: Tensor, index: int, *, record: bool = True) -> Tensor:
        """``[n_own, ...]`` of every rank -> ``[N, ...]`` (rank order, so the locality numbering),
        differentiable: the autograd-aware functional all-gather of the rows padded to the largest
        rank's count (``torch.distributed._functional_collectives.all_gather_single_autograd``, the
        successor torch 2.13 names for ``torch.distributed.nn.functional.all_gather``); its backward
        is a sum reduce-scatter of the ranks' gradients (recorded as ``reducescatter`` of ``index``;
        the forward as ``allgather``)."""
        counts = [hi - lo for lo, hi in self.row_ranges]
        width = max(counts)
        nbytes = self.partition.num_nodes * math.prod(own.shape[1:]) * own.element_size()
        if own.shape[0] < width:
            own = F.pad(own, (0, 0) * (own.dim() - 1) + (0, width - own.shape[0]))
        clock: dict[str, float] = {}

        def started() -> None:
            clock["start"] = time.perf_counter()

        def ended() -> None:
            self._sync(own)
            self._record(CollectiveRecord(index, "B", -1, -1, "collective", clock.get("start", time.perf_counter()),
                                          time.perf_counter(), nbytes, op="reducescatter"))

        if record:
            (own,) = _Stamp.apply(ended, own)
        start = time.perf_counter()
        group: Any = self.group if self.group is not None else dist.group.WORLD
        gathered = fc.wait_tensor(fc.all_gather_single_autograd(own, 0, group))
        self._sync(own)
        if record:
            self._record(CollectiveRecord(index, "F", -1, -1, "collective", start, time.perf_counter(), nbytes,
                                          op="allgather"))
            (gathered,) = _Stamp.apply(started, gathered)
        if min(counts) == width:
            return gathered
        return torch.cat([gathered[r * width:r * width + c] for r, c in enumerate(counts)])

    def _all_reduce(self, flat: Tensor, phase: str) -> None:
        """Sum ``flat`` over the ranks in place (recorded as ``allreduce`` of layer -1)."""
        start = time.perf_counter()
        dist.all_reduce(flat, group=self.group)
        self._sync(flat)
        self._record(CollectiveRecord(-1, phase, -1, -1, "collective", start, time.perf_counter(),
                                      int(flat.numel() * flat.element_size()), op="allreduce"))

    # ---------------------------------------------------------------------------- forward
    def forward(self, x: Tensor) -> Tensor:
        """This rank's rows of the model output: ``x [N, in_dim]`` (original numbering, every rank
        the whole features) -> ``[n_own, out_dim]`` for the vertices :attr:`vertex_ids`.

        Differentiable with respect to ``x`` and the parameters; the gradients a rank gets are its
        share (sum them over the ranks, as :meth:`train_step` does for the parameters).

        Raises:
            GNNError: ``x`` is not ``[N, in_dim]``.
        """
        part = self.partition
        layers = self._layers()
        in_dim = layers[0].in_dim
        if not isinstance(x, Tensor) or x.dim() != 2 or tuple(x.shape) != (part.num_nodes, in_dim):
            shape = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise GNNError(f"x must be [{part.num_nodes}, {in_dim}] (one row per vertex of the partition), "
                           f"got {shape}.")
        self.streamed._cuda_sync = x.is_cuda
        vattr = self.vertex_attrs(x.dtype, x.device)
        x_full: Tensor | None = part.permute(x)
        assert x_full is not None
        x_own = x_full[self.rows]
        for index, layer in enumerate(layers):
            x_own = self._layer(index, layer, x_own, x_full, vattr)
            x_full = None
            if index < len(layers) - 1:
                x_own = torch.relu(x_own)
        return x_own

    __call__ = forward

    def _layer(self, index: int, layer: SAGALayer, x_own: Tensor, x_full: Tensor | None, vattr: Tensor) -> Tensor:
        if _has_pre(layer):
            pieces = []
            for j in self.intervals:
                loc = self._local(j)
                pre = partial(layer.apply_vertex_pre, x_own[loc])
                pieces.append(self._dense(index, j, APPLY_VERTEX_PRE, pre, x_own))
            h_own = torch.cat(pieces) if pieces else layer.apply_vertex_pre(x_own)
            h_full = self._all_gather_rows(h_own, index)
        else:
            h_own = x_own
            h_full = x_full if x_full is not None else self._all_gather_rows(x_own, index)
        params = [q for q in layer.parameters() if q.requires_grad]
        agg = StreamedGather.apply(_LayerStream(self.streamed, index, layer, vattr), h_full, *params)
        outs = []
        for j in self.intervals:
            r, loc = self.partition.interval(j), self._local(j)
            outs.append(self._dense(index, j, APPLY_VERTEX, partial(layer.apply_vertex, h_own[loc], x_own[loc], agg[r]),
                                    x_own))
        if not outs:   # a rank without intervals: an empty [0, out_dim] that still joins the collectives
            return layer.apply_vertex(h_own, x_own, agg[self.rows])
        return torch.cat(outs)

    # ---------------------------------------------------------------------------- outputs and training
    def gather_output(self, out_own: Tensor) -> Tensor:
        """Every rank's rows of an output -> ``[N, ...]`` in the ORIGINAL numbering, on every rank
        (not differentiable; a collective: every rank must call it)."""
        with torch.no_grad():
            full = self._all_gather_rows(out_own.detach(), -1, record=False)
        return self.partition.unpermute(full)

    def all_reduce_gradients(self, params: Sequence[Tensor]) -> None:
        """Sum the parameters' gradients over the ranks in place (one flat ``all_reduce``; a missing
        gradient counts as zeros and is set)."""
        params = list(params)
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._all_reduce(flat, "B")
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n

    def _local_targets(self, y: Tensor, masks: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        ids = self.vertex_ids.to(y.device)
        return y.index_select(0, ids), {k: m.to(y.device).index_select(0, ids) for k, m in masks.items()}

    def train_step(self, x: Tensor, y: Tensor, masks: dict[str, Tensor], optimizer: torch.optim.Optimizer) \
            -> DistStepResult:
        """One full-graph training step on every rank (a collective): the mean cross-entropy over the
        ``masks["train"]`` vertices, backward, gradient all-reduce, ``optimizer.step()``.

        Args:
            x: ``[N, in_dim]`` features, original numbering.
            y: ``[N]`` int64 class labels, original numbering.
            masks: ``{"train": [N] bool, optionally "val", "test"}``; accuracy is counted on each.
            optimizer: over the model's parameters (the same kind and state on every rank).

        Returns:
            :class:`DistStepResult` (the global loss and accuracies, this rank's seconds and records).

        Raises:
            GNNError: ``y`` or a mask is malformed, or the training mask selects no vertex.
        """
        n = self.partition.num_nodes
        if not isinstance(y, Tensor) or tuple(y.shape) != (n,):
            raise GNNError(f"y must be a [{n}] tensor of class labels, got "
                           f"{list(y.shape) if isinstance(y, Tensor) else type(y).__name__}.")
        for k, m in masks.items():
            if not isinstance(m, Tensor) or m.dtype != torch.bool or tuple(m.shape) != (n,):
                raise GNNError(f"masks[{k!r}] must be a bool tensor of shape [{n}].")
        if "train" not in masks or not bool(masks["train"].any()):
            raise GNNError("masks['train'] selects no vertex, so the loss is undefined; select at least one "
                           "training vertex.")
        start = time.perf_counter()
        self.reset_records()
        optimizer.zero_grad(set_to_none=True)
        total = int(masks["train"].sum())
        y_own, m_own = self._local_targets(y, masks)
        out = self(x)
        train = m_own["train"]
        loss = F.cross_entropy(out[train], y_own[train], reduction="sum") / total
        loss.backward()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.all_reduce_gradients(params)
        t0 = time.perf_counter()
        optimizer.step()
        self._sync(out)
        self._record(ChunkRecord(-1, "B", OPTIMIZER, -1, "compute", t0, time.perf_counter(),
                                 sum(p.numel() * p.element_size() for p in params)))
        accuracy, global_loss = self._reduce_metrics(out.detach(), y_own, m_own, masks, loss.detach())
        return DistStepResult(global_loss, accuracy, time.perf_counter() - start, self.reset_records())

    def _reduce_metrics(self, out: Tensor, y_own: Tensor, m_own: dict[str, Tensor], masks: dict[str, Tensor],
                        loss: Tensor | None) -> tuple[dict[str, float], float]:
        """All-reduce ``[loss, correct per split]`` once; returns (accuracy per split, global loss)."""
        splits = [s for s in SPLITS if s in masks]
        pred = out.argmax(dim=1) if out.shape[0] else y_own
        vals = [loss.to(torch.float64) if loss is not None else torch.zeros((), dtype=torch.float64, device=out.device)]
        vals += [((pred == y_own) & m_own[s]).sum().to(torch.float64) for s in splits]
        flat = torch.stack(vals)
        self._all_reduce(flat, "F")
        acc = {}
        for k, s in enumerate(splits):
            size = int(masks[s].sum())
            acc[s] = float(flat[k + 1]) / size if size else math.nan
        return acc, float(flat[0])

    def evaluate(self, x: Tensor, y: Tensor, masks: dict[str, Tensor]) -> dict[str, float]:
        """Accuracy per split of a forward without autograd (a collective: every rank must call it).

        Raises:
            GNNError: ``x`` malformed (see :meth:`forward`).
        """
        with torch.no_grad():
            out = self(x)
        y_own, m_own = self._local_targets(y, masks)
        acc, _ = self._reduce_metrics(out, y_own, m_own, masks, None)
        return acc
