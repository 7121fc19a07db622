"""Chunk-streamed execution of a GNN on one device (NGra, USENIX ATC'19, section 4; docs/gnn.md).

A :class:`~engine.gnn.models.GNNModel` is run on a :class:`~engine.gnn.partition.GraphPartition`
so that beyond the per-vertex data only one edge chunk, its edge tensors and one accumulator are
alive at a time. Per layer (``h``, ``agg`` and ``out`` are ``[N, ...]`` vertex data, the rest is
per chunk):

forward
    ``h = apply_vertex_pre(x)`` interval by interval; then for every destination interval ``j``:
    ``acc = gather_init``; for every source interval ``i`` whose chunk ``(i, j)`` has edges: load
    the chunk, ``scatter`` -> ``apply_edge`` -> ``acc = gather_update(acc, ...)``; then
    ``agg_j = gather_finalize(acc)`` and ``out_j = apply_vertex(h_j, x_j, agg_j)``.
backward
    the Scatter/ApplyEdge/Gather part of a layer is one :class:`torch.autograd.Function`
    (:class:`StreamedGather`) that saves only its input ``h``, its output ``agg`` and the
    per-vertex final accumulators (for the softmax the running max and sum), never a per-edge
    tensor. Its backward walks the SOURCE intervals ``i``: for every ``j`` it recomputes chunk
    ``(i, j)`` (``scatter`` -> ``apply_edge``) and back-propagates the layer's
    ``chunk_grads`` (the chunk's exact share of the full-graph gradient of its messages and
    logits: the gradients of its ``chunk_surrogate``, passed as ``grad_outputs``) into ``grad_h_i``
    (a resident accumulator), ``grad_h_j`` and the parameters that ``scatter`` /
    ``apply_edge`` use. The per-vertex stages (``apply_vertex_pre``, ``apply_vertex``, ReLU) are
    ordinary autograd.

Prefetch: while chunk ``k`` computes, a loader thread (``concurrent.futures.ThreadPoolExecutor(1)``)
loads chunk ``k + 1``: it materialises the chunk's local index tensors as int64 on the compute
device and takes the source and destination rows of ``h`` (and, in the backward, of the gradient)
that the chunk reads. On the CPU the rows are views of the resident vertex data and the indices
an int32 -> int64 copy; on CUDA the indices are copied host -> device on a side stream from
pinned memory (that path has not been run here: no GPU).

Every load and every compute is recorded as a :class:`ChunkRecord` (``time.perf_counter``
seconds) so that the planner's predicted timeline (``engine/gnn/cost.py``, ``engine/gnn/simulate.py``)
can be compared with the measured one. Empty chunks are neither loaded nor computed.

The result equals full-graph execution (``model(x, edge_index)``) up to floating-point
summation order: outputs and gradients (tested in float64 for P in 1, 2, 4, 8 and every layer kind).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from engine.errors import GNNError
from engine.gnn.models import GNNModel
from engine.gnn.partition import GraphPartition
from engine.gnn.saga import GatherAcc, SAGALayer

__all__ = ["ChunkRecord", "StepResult", "StreamedGNN", "StreamedGather", "predict", "train_step"]

log = logging.getLogger(__name__)

#: ``ChunkRecord.i`` of a dense per-vertex stage of destination interval ``j`` (as ``engine/gnn/cost.py`` reads it)
APPLY_VERTEX = -1
APPLY_VERTEX_PRE = -2


@dataclass(frozen=True)
class ChunkRecord:
    """One measured load or compute of the streamed executor.

    Attributes:
        layer: the layer index (0 = first).
        phase: ``"F"`` (forward) or ``"B"`` (backward: recompute + back-propagate).
        i: the source interval of the chunk, or :data:`APPLY_VERTEX` (-1) / :data:`APPLY_VERTEX_PRE`
            (-2) for a dense per-vertex stage of interval ``j`` (forward only).
        j: the destination interval.
        kind: ``"load"`` (loader thread) or ``"compute"`` (main thread).
        start, end: ``time.perf_counter()`` seconds.
        bytes: load: the chunk's int64 index bytes plus the vertex rows it reads (``h`` of intervals
            ``i`` and ``j``; backward also the gradient rows of ``j``), i.e. what a device would
            bring in; compute: the bytes of the chunk's messages (dense stage: of its output).
    """

    layer: int
    phase: str
    i: int
    j: int
    kind: str
    start: float
    end: float
    bytes: int


@dataclass
class _Loaded:
    """A loaded chunk: int64 local indices and the vertex rows it reads (on the compute device)."""

    i: int
    j: int
    src: Tensor
    dst: Tensor
    h_src: Tensor
    h_dst: Tensor
    vattr_src: Tensor
    vattr_dst: Tensor
    grad_dst: Tensor | None
    event: Any  # torch.cuda.Event on CUDA, else None


def _nbytes(t: Tensor) -> int:
    return int(t.numel() * t.element_size())


def _ready(loaded: _Loaded) -> _Loaded:
    """On CUDA: order the compute stream after the side-stream copies and keep their memory until it is done."""
    if loaded.event is not None:
        stream = torch.cuda.current_stream(loaded.src.device)
        stream.wait_event(loaded.event)
        loaded.src.record_stream(stream)
        loaded.dst.record_stream(stream)
    return loaded


#: Per gather kind, the accumulator entries ``SAGALayer.chunk_grads`` reads in the backward.
_BACKWARD_STATS = {"sum": (), "mean": (), "max": ("max", "count"), "softmax": ("max", "sum")}


class _LayerStream:
    """Streams one layer's Scatter / ApplyEdge / Gather over a partition (forward and backward)."""

    def __init__(self, owner: StreamedGNN, index: int, layer: SAGALayer, vattr: Tensor):
        self.owner = owner
        self.index = index
        self.layer = layer
        self.vattr = vattr
        self.part = owner.partition
        nonempty = (self.part.chunk_edges() > 0).tolist()  # [i][j]
        p = self.part.num_parts
        #: per destination interval, the source intervals with edges into it (and per source, the destinations)
        self.sources = [[i for i in range(p) if nonempty[i][j]] for j in range(p)]
        self.targets = [[j for j in range(p) if nonempty[i][j]] for i in range(p)]

    # ---------------------------------------------------------------------------- loading
    def _load(self, ij: tuple[int, int], h: Tensor, grad_agg: Tensor | None, phase: str) -> _Loaded:
        i, j = ij
        start = time.perf_counter()
        part = self.part
        src_i, dst_j = part.interval(i), part.interval(j)
        lo, hi = part.chunk_range(i, j)
        src_all, dst_all = self.owner._index_tensors()
        event = None
        with torch.no_grad():
            if h.is_cuda:
                stream = self.owner._side_stream(h.device)
                with torch.cuda.stream(stream):
                    src = src_all[lo:hi].to(h.device, non_blocking=True).long()
                    dst = dst_all[lo:hi].to(h.device, non_blocking=True).long()
                    event = torch.cuda.Event()
                    event.record(stream)
                event.synchronize()  # blocks the loader only, so that the record's end is the copy's end
            else:
                src = src_all[lo:hi].long()
                dst = dst_all[lo:hi].long()
            hd = h.detach()
            loaded = _Loaded(i, j, src, dst, hd[src_i], hd[dst_j], self.vattr[src_i], self.vattr[dst_j],
                             None if grad_agg is None else grad_agg[dst_j], event)
        nbytes = 16 * (hi - lo) + _nbytes(loaded.h_src) + _nbytes(loaded.h_dst)
        if loaded.grad_dst is not None:
            nbytes += _nbytes(loaded.grad_dst)
        self.owner._record(self.index, phase, i, j, "load", start, time.perf_counter(), nbytes)
        return loaded

    def _stream(self, items: list[tuple[int, int]],
                load: Callable[[tuple[int, int]], _Loaded]) -> Generator[_Loaded, None, None]:
        """Yield the loaded chunks of ``items`` in order, loading the next one on the loader thread."""
        if not items:
            return
        if not self.owner.prefetch:
            for ij in items:
                yield _ready(load(ij))
            return
        with ThreadPoolExecutor(1, thread_name_prefix="gnn-chunk-loader") as pool:
            future = pool.submit(load, items[0])
            for k in range(len(items)):
                loaded = future.result()
                if k + 1 < len(items):
                    future = pool.submit(load, items[k + 1])
                yield _ready(loaded)

    # ---------------------------------------------------------------------------- forward
    def forward(self, h: Tensor) -> tuple[Tensor, list[GatherAcc]]:
        """``h [N, D_h]`` -> ``agg [N, *message_shape]`` and every destination interval's final accumulator."""
        layer, part = self.layer, self.part
        p = part.num_parts
        sources = self.sources
        items = [(i, j) for j in range(p) for i in sources[j]]
        agg = h.new_empty((part.num_nodes,) + layer.message_shape)
        accs: list[GatherAcc] = []
        with contextlib.closing(self._stream(items, lambda ij: self._load(ij, h, None, "F"))) as stream:
            for j in range(p):
                rows = part.interval(j)
                acc = layer.gather_init(rows.stop - rows.start, h)
                for _ in sources[j]:
                    ld = next(stream)
                    start = time.perf_counter()
                    edata = layer.scatter(ld.h_src, ld.h_dst, ld.src, ld.dst, ld.vattr_src, ld.vattr_dst)
                    msg, logit = layer.apply_edge(edata)
                    acc = layer.gather_update(acc, msg, logit, ld.dst)
                    self.owner._sync(h)
                    self.owner._record(self.index, "F", ld.i, j, "compute", start, time.perf_counter(), _nbytes(msg))
                    del edata, msg, logit, ld
                agg[rows] = layer.gather_finalize(acc, self.vattr[rows])
                # keep only the per-vertex statistics the backward's chunk_grads reads (a sum's accumulator
                # is the aggregate again, a softmax's running weighted sum too): N x width bytes less per layer
                accs.append({k: acc[k] for k in _BACKWARD_STATS[layer.gather_kind]})
        return agg, accs

    # ---------------------------------------------------------------------------- backward
    def backward(self, h: Tensor, agg: Tensor, accs: list[GatherAcc], grad_agg: Tensor,
                 params: list[Tensor]) -> tuple[Tensor, list[Tensor | None]]:
        """``dL/d agg`` -> ``dL/d h`` and ``dL/d`` each of ``params``, by source interval with recomputation."""
        layer, part = self.layer, self.part
        p = part.num_parts
        targets = self.targets
        items = [(i, j) for i in range(p) for j in targets[i]]
        grad_h = torch.zeros_like(h)
        grad_params: list[Tensor | None] = [None] * len(params)
        agg = agg.detach()
        grad_agg = grad_agg.detach()
        with contextlib.closing(self._stream(items, lambda ij: self._load(ij, h, grad_agg, "B"))) as stream:
            for i in range(p):
                grad_h_i = grad_h[part.interval(i)]  # the source-gradient accumulator (a view, added in place)
                for j in targets[i]:
                    ld = next(stream)
                    assert ld.grad_dst is not None
                    rows_j = part.interval(j)
                    start = time.perf_counter()
                    with torch.enable_grad():
                        h_src = ld.h_src.detach().requires_grad_()
                        h_dst = ld.h_dst.detach().requires_grad_()
                        edata = layer.scatter(h_src, h_dst, ld.src, ld.dst, ld.vattr_src, ld.vattr_dst)
                        msg, logit = layer.apply_edge(edata)
                        g_msg, g_logit = layer.chunk_grads(msg, logit, ld.dst, agg[rows_j], ld.grad_dst, accs[j],
                                                           ld.vattr_dst)
                        outs, grad_outs = [msg], [g_msg]
                        if logit is not None and g_logit is not None:
                            outs.append(logit)
                            grad_outs.append(g_logit)
                        grads = torch.autograd.grad(outs, [h_src, h_dst, *params], grad_outs, allow_unused=True)
                    if grads[0] is not None:
                        grad_h_i += grads[0]
                    if grads[1] is not None:
                        grad_h[rows_j] += grads[1]
                    for k, g in enumerate(grads[2:]):
                        if g is not None:
                            prev = grad_params[k]
                            grad_params[k] = g if prev is None else prev + g
                    self.owner._sync(h)
                    self.owner._record(self.index, "B", i, j, "compute", start, time.perf_counter(), _nbytes(msg))
                    del edata, msg, logit, g_msg, g_logit, outs, grad_outs, grads, h_src, h_dst, ld
        return grad_h, grad_params


class StreamedGather(torch.autograd.Function):
    """A layer's Scatter / ApplyEdge / Gather over all chunks: ``h [N, D_h] -> agg [N, *message_shape]``.

    Saves ``h``, ``agg`` and the per-vertex final accumulators only (no per-edge tensor); the
    backward recomputes every chunk by source interval and back-propagates the layer's
    ``chunk_grads`` (the gradients of its ``chunk_surrogate``) through Scatter and ApplyEdge
    (NGra section 4; docs/gnn.md "The SAGA-NN layer and its chunk API").
    ``params`` are the layer's trainable parameters, passed so that their gradients (from
    ``scatter`` / ``apply_edge``) flow back; gradients are not differentiable twice.
    """

    @staticmethod
    def forward(ctx: Any, stream: _LayerStream, h: Tensor, *params: Tensor) -> Tensor:
        agg, accs = stream.forward(h)
        ctx.stream = stream
        ctx.accs = accs
        ctx.save_for_backward(h, agg, *params)
        return agg

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_agg: Tensor) -> tuple[Any, ...]:
        h, agg, *params = ctx.saved_tensors
        grad_h, grad_params = ctx.stream.backward(h, agg, ctx.accs, grad_agg, list(params))
        ctx.accs = None
        return (None, grad_h, *grad_params)


class StreamedGNN:
    """Run a :class:`GNNModel` chunk by chunk on a :class:`GraphPartition` (NGra, ATC'19, section 4).

    ``StreamedGNN(model, partition)(x)`` equals ``model(x, edge_index)`` (output and, through
    autograd, the gradients of ``x`` and every parameter) for the graph the partition was built
    from, with the per-edge memory of one chunk instead of the whole graph.

    Args:
        model: the model; its parameters are used (and trained) in place.
        partition: built from the model's PREPARED edges (``model.layers[0].prepare_edges``; see
            :func:`engine.gnn.partition.partition_for_model`).
        prefetch: load the next chunk on a loader thread while the current one computes.

    Attributes:
        records: the :class:`ChunkRecord` s of every load and compute since the last
            :meth:`reset_records` (the loader thread appends too; sort by ``start`` to read them
            in time order).

    Raises:
        GNNError: the model is not a ``GNNModel``, its layers disagree on self-loops (they would
            need different partitions), or the partition is not a ``GraphPartition``.
    """

    def __init__(self, model: GNNModel, partition: GraphPartition, *, prefetch: bool = True):
        if not isinstance(model, GNNModel):
            raise GNNError(f"StreamedGNN needs a GNNModel (engine.gnn.models.build_gnn), got {type(model).__name__}.")
        if not isinstance(partition, GraphPartition):
            raise GNNError(f"StreamedGNN needs a GraphPartition, got {type(partition).__name__}.")
        loops = {bool(layer.self_loops) for layer in model.layers}
        if len(loops) > 1:
            raise GNNError("StreamedGNN needs layers that all add self-loops or all do not; "
                           "their prepared graphs differ, so one partition cannot serve them.")
        self.model = model
        self.layers: list[SAGALayer] = [cast(SAGALayer, layer) for layer in model.layers]
        self.partition = partition
        self.prefetch = bool(prefetch)
        self.records: list[ChunkRecord] = []
        self._vattr: dict[tuple[torch.dtype, torch.device], Tensor] = {}
        self._pinned: tuple[Tensor, Tensor] | None = None
        self._streams: dict[torch.device, Any] = {}
        self._cuda_sync = False  # set by forward: the input is on CUDA (pinned index copies, synchronised records)

    # ---------------------------------------------------------------------------- helpers
    def _record(self, layer: int, phase: str, i: int, j: int, kind: str, start: float, end: float,
                nbytes: int) -> None:
        self.records.append(ChunkRecord(layer, phase, i, j, kind, start, end, int(nbytes)))

    def _sync(self, like: Tensor) -> None:
        if like.is_cuda:  # so that the compute record's end is the kernels' end
            torch.cuda.current_stream(like.device).synchronize()

    def _index_tensors(self) -> tuple[Tensor, Tensor]:
        """The chunk index arrays; for a CUDA input pinned copies (made once, for asynchronous copies).

        Only loads call it, and loads run one at a time (on the loader thread, or inline without prefetch).
        """
        part = self.partition
        if self._cuda_sync:
            if self._pinned is None:
                self._pinned = (part.src_local.pin_memory(), part.dst_local.pin_memory())
            return self._pinned
        return part.src_local, part.dst_local

    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def vertex_attrs(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``[N, 2]`` in/out-degrees of the whole partitioned graph in the NEW numbering (cached)."""
        key = (dtype, device)
        if key not in self._vattr:
            part = self.partition
            vattr = self.layers[0].vertex_attrs(part.edge_index(), part.num_nodes, dtype=dtype)
            self._vattr[key] = vattr.to(device)
        return self._vattr[key]

    def reset_records(self) -> list[ChunkRecord]:
        """Return the records so far, sorted by start time, and start a new list."""
        out = sorted(self.records, key=lambda r: (r.start, r.end))
        self.records = []
        return out

    # ---------------------------------------------------------------------------- forward
    def forward(self, x: Tensor) -> Tensor:
        """``x [N, in_dim]`` (original vertex numbering) -> ``[N, out_dim]`` (original numbering).

        Differentiable with respect to ``x`` and the model's parameters.

        Raises:
            GNNError: ``x`` is not ``[N, in_dim]`` for the partition's ``N``.
        """
        part = self.partition
        in_dim = self.layers[0].in_dim
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape != (part.num_nodes, in_dim):
            shape = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise GNNError(f"x must be [{part.num_nodes}, {in_dim}] (one row per vertex of the partition), "
                           f"got {shape}.")
        self._cuda_sync = x.is_cuda
        vattr = self.vertex_attrs(x.dtype, x.device)
        xp = part.permute(x)
        layers = self.layers
        for index, layer in enumerate(layers):
            xp = self._layer(index, layer, xp, vattr)
            if index < len(layers) - 1:
                xp = torch.relu(xp)
        return part.unpermute(xp)

    __call__ = forward

    def _dense(self, index: int, j: int, stage: int, fn: Callable[..., Tensor], *args: Tensor) -> Tensor:
        start = time.perf_counter()
        out = fn(*args)
        self._sync(out)
        self._record(index, "F", stage, j, "compute", start, time.perf_counter(), _nbytes(out))
        return out

    def _layer(self, index: int, layer: SAGALayer, x: Tensor, vattr: Tensor) -> Tensor:
        part = self.partition
        rows = [part.interval(j) for j in range(part.num_parts)]
        h_parts = [self._dense(index, j, APPLY_VERTEX_PRE, layer.apply_vertex_pre, x[r]) for j, r in enumerate(rows)]
        h = h_parts[0] if len(h_parts) == 1 else torch.cat(h_parts)
        del h_parts
        params = [q for q in layer.parameters() if q.requires_grad]
        agg = StreamedGather.apply(_LayerStream(self, index, layer, vattr), h, *params)
        outs = [self._dense(index, j, APPLY_VERTEX, layer.apply_vertex, h[r], x[r], agg[r]) for j, r in enumerate(rows)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


@dataclass(frozen=True)
class StepResult:
    """One streamed training step.

    Attributes:
        loss: the loss value before the update.
        seconds: the step's wall time (forward, backward, optimizer step).
        records: the step's :class:`ChunkRecord` s, sorted by start time.
    """

    loss: float
    seconds: float
    records: list[ChunkRecord]


def _check_targets(y: Tensor, mask: Tensor, n: int) -> None:
    if not isinstance(y, Tensor) or y.shape[:1] != (n,):
        got = list(y.shape) if isinstance(y, Tensor) else y
        raise GNNError(f"y must have one entry per vertex ({n}), got {got!r}.")
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != (n,):
        raise GNNError(f"mask must be a bool tensor of shape [{n}], got "
                       f"{(mask.dtype, list(mask.shape)) if isinstance(mask, Tensor) else mask!r}.")
    if not bool(mask.any()):
        raise GNNError("mask selects no vertex, so the loss is undefined; select at least one training vertex.")


def train_step(
    model: GNNModel | StreamedGNN,
    partition: GraphPartition | None,
    x: Tensor,
    y: Tensor,
    mask: Tensor,
    optimizer: torch.optim.Optimizer,
    *,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
    prefetch: bool = True,
) -> StepResult:
    """One chunk-streamed training step: ``loss_fn(out[mask], y[mask])``, backward, ``optimizer.step()``.

    Args:
        model: a ``GNNModel`` (then ``partition`` is required) or a :class:`StreamedGNN` (then
            ``partition`` must be ``None`` or its own).
        partition: the partition of the model's prepared graph.
        x: ``[N, in_dim]`` features, original numbering.
        y: ``[N]`` targets (class indices for the default cross-entropy), original numbering.
        mask: ``[N]`` bool, the vertices the loss is taken over.
        optimizer: over the model's parameters.
        loss_fn: ``(logits [M, out_dim], targets [M]) -> scalar``.
        prefetch: as :class:`StreamedGNN`.

    Returns:
        :class:`StepResult` (loss, seconds, the step's chunk records).

    Raises:
        GNNError: bad ``y`` / ``mask`` / ``x``, or a partition that does not belong to the StreamedGNN.
    """
    streamed = _streamed(model, partition, prefetch)
    _check_targets(y, mask, streamed.partition.num_nodes)
    start = time.perf_counter()
    streamed.reset_records()
    optimizer.zero_grad(set_to_none=True)
    out = streamed(x)
    loss = loss_fn(out[mask], y[mask])
    loss.backward()
    optimizer.step()
    return StepResult(float(loss.detach()), time.perf_counter() - start, streamed.reset_records())


def predict(model: GNNModel | StreamedGNN, partition: GraphPartition | None, x: Tensor, *,
            prefetch: bool = True) -> Tensor:
    """Chunk-streamed inference: ``[N, in_dim] -> [N, out_dim]`` (original numbering), without autograd.

    Raises:
        GNNError: as :func:`train_step`.
    """
    streamed = _streamed(model, partition, prefetch)
    with torch.no_grad():
        return streamed(x)


def _streamed(model: GNNModel | StreamedGNN, partition: GraphPartition | None, prefetch: bool) -> StreamedGNN:
    if isinstance(model, StreamedGNN):
        if partition is not None and partition is not model.partition:
            raise GNNError("pass partition=None with a StreamedGNN (it already has its partition), or pass the model.")
        return model
    if partition is None:
        raise GNNError("a GNNModel needs its GraphPartition; build one with engine.gnn.partition.partition_for_model.")
    return StreamedGNN(model, partition, prefetch=prefetch)
