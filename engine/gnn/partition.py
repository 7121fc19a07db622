"""Graph partitioning for chunk-streamed GNN execution (NGra, USENIX ATC'19, section 4).

NGra streams a graph that does not fit a device through it chunk by chunk: the vertices are
renumbered for locality and cut into ``P`` equal vertex intervals, the edges into ``P x P`` edge
chunks, chunk ``(i, j)`` holding the edges whose source lies in interval ``i`` and whose
destination lies in interval ``j``. The forward of a layer walks the destination intervals ``j``
and, for each, the chunks ``(0..P-1, j)``; the backward walks the source intervals. Only the
vertex data, one chunk's edge tensors and one accumulator are resident at a time.

:class:`GraphPartition` holds that layout: the permutation (reverse Cuthill-McKee from
``scipy.sparse.csgraph``, which keeps neighbours close so that most edges fall into a few chunks
near the diagonal), the interval boundaries, and every chunk's edges as local indices into its
source and destination intervals, sorted by ``(destination interval, source interval,
destination)`` so that a chunk is one contiguous, CSR-like (destination-sorted) slice. It is built
in ``O(E log E)`` with one ``torch.sort``.

:func:`choose_partitions` picks the smallest power-of-two ``P`` whose predicted peak memory
(:func:`predict_streamed_peak`) fits a budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse
import torch
from scipy.sparse.csgraph import reverse_cuthill_mckee

from engine.errors import PartitionError

__all__ = [
    "EdgeChunk",
    "GraphPartition",
    "LayerWidths",
    "MemoryEstimate",
    "PartitionError",
    "PartitionStats",
    "choose_partitions",
    "layer_widths",
    "locality_order",
    "max_chunk_edges",
    "partition_for_model",
    "predict_streamed_peak",
]

#: the largest partition count :func:`choose_partitions` tries (powers of two from 1)
MAX_PARTITIONS = 1024

ORDERS = ("rcm", "identity")


@dataclass(frozen=True)
class EdgeChunk:
    """The edges from source interval ``i`` to destination interval ``j``.

    Attributes:
        i: the source interval.
        j: the destination interval.
        src: ``[E_ij]`` local source indices (into interval ``i``), int32 or int64.
        dst: ``[E_ij]`` local destination indices (into interval ``j``), ascending.
        edge_ids: ``[E_ij]`` int64 column of each edge in the ``edge_index`` the partition was
            built from (for per-edge attributes).
    """

    i: int
    j: int
    src: torch.Tensor
    dst: torch.Tensor
    edge_ids: torch.Tensor

    @property
    def num_edges(self) -> int:
        """The number of edges in the chunk."""
        return int(self.src.numel())

    @property
    def nbytes(self) -> int:
        """Bytes of the chunk's local index tensors (``src`` and ``dst``)."""
        return int(self.src.numel() * self.src.element_size() + self.dst.numel() * self.dst.element_size())


@dataclass(frozen=True)
class PartitionStats:
    """Size statistics of a :class:`GraphPartition`.

    Attributes:
        num_nodes, num_edges, num_parts: the graph and ``P``.
        max_interval_nodes: vertices in the largest interval.
        max_chunk_edges: edges in the largest chunk.
        empty_chunks: chunks without edges (of ``P * P``).
        diagonal_edges: edges in the chunks ``(i, i)`` (a measure of the ordering's locality).
        index_bytes: bytes of the stored chunk index tensors (local ``src``/``dst``, ``edge_ids``,
            chunk pointers) and the permutation.
    """

    num_nodes: int
    num_edges: int
    num_parts: int
    max_interval_nodes: int
    max_chunk_edges: int
    empty_chunks: int
    diagonal_edges: int
    index_bytes: int


def _check_edge_index(edge_index: torch.Tensor, num_nodes: int) -> None:
    if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
        raise PartitionError(f"num_nodes must be a positive int, got {num_nodes!r}.")
    if not isinstance(edge_index, torch.Tensor) or edge_index.dim() != 2 or edge_index.shape[0] != 2:
        shape = tuple(edge_index.shape) if isinstance(edge_index, torch.Tensor) else type(edge_index).__name__
        raise PartitionError(f"edge_index must be a [2, E] tensor (row 0 sources, row 1 destinations), got {shape}.")
    if edge_index.dtype not in (torch.int32, torch.int64):
        raise PartitionError(f"edge_index must hold int32 or int64 vertex ids, got {edge_index.dtype}.")
    if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= num_nodes):
        raise PartitionError(
            f"edge_index holds vertex ids in [{int(edge_index.min())}, {int(edge_index.max())}], "
            f"outside [0, {num_nodes}) for num_nodes={num_nodes}."
        )


def _check_parts(num_parts: int, num_nodes: int) -> None:
    if not isinstance(num_parts, int) or isinstance(num_parts, bool) or not 1 <= num_parts <= num_nodes:
        raise PartitionError(
            f"num_parts must be an int in [1, num_nodes={num_nodes}] (each interval needs a vertex), got {num_parts!r}."
        )


def locality_order(edge_index: torch.Tensor, num_nodes: int, order: str = "rcm") -> torch.Tensor:
    """A vertex permutation that keeps neighbours close (NGra section 4's renumbering).

    Args:
        edge_index: ``[2, E]`` integer edges (directions are ignored: the order is computed on the
            symmetrised adjacency).
        num_nodes: ``N``.
        order: ``"rcm"`` (reverse Cuthill-McKee, ``scipy.sparse.csgraph.reverse_cuthill_mckee``) or
            ``"identity"``.

    Returns:
        ``perm``: ``[N]`` int64, ``perm[new] = old``.

    Raises:
        PartitionError: bad edges or an unknown ``order``.
    """
    _check_edge_index(edge_index, num_nodes)
    if order == "identity":
        return torch.arange(num_nodes, dtype=torch.int64)
    if order != "rcm":
        raise PartitionError(f"order must be one of {ORDERS}, got {order!r}.")
    ei = edge_index.detach().cpu().numpy()
    ones = np.ones(ei.shape[1], dtype=np.int8)
    adj = scipy.sparse.csr_matrix((ones, (ei[0], ei[1])), shape=(num_nodes, num_nodes))
    adj = (adj + adj.T).tocsr()
    perm = reverse_cuthill_mckee(adj, symmetric_mode=True)
    return torch.from_numpy(np.ascontiguousarray(perm, dtype=np.int64))


def _boundaries(num_nodes: int, num_parts: int) -> torch.Tensor:
    """``[P + 1]`` int64 boundaries of ``P`` equal intervals: ``b[k] = k * N // P``."""
    return torch.arange(num_parts + 1, dtype=torch.int64) * num_nodes // num_parts


def _chunk_ids(
    new_src: torch.Tensor, new_dst: torch.Tensor, boundaries: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Source interval, destination interval and chunk id ``j * P + i`` of each edge (renumbered ids)."""
    num_parts = boundaries.numel() - 1
    inner = boundaries[1:-1]
    si = torch.bucketize(new_src, inner, right=True)
    dj = torch.bucketize(new_dst, inner, right=True)
    return si, dj, dj * num_parts + si


def max_chunk_edges(
    edge_index: torch.Tensor, num_nodes: int, num_parts: int, perm: torch.Tensor | None = None
) -> int:
    """Edges in the largest chunk of a ``num_parts``-way partition, without building it (``O(E)``).

    Args:
        edge_index: ``[2, E]`` integer edges.
        num_nodes: ``N``.
        num_parts: ``P`` (``1 <= P <= N``).
        perm: ``[N]`` ``perm[new] = old`` (e.g. :func:`locality_order`); ``None``: the identity.

    Raises:
        PartitionError: bad edges or ``P``.
    """
    _check_edge_index(edge_index, num_nodes)
    _check_parts(num_parts, num_nodes)
    if edge_index.shape[1] == 0:
        return 0
    ei = edge_index.to(torch.int64)
    if perm is not None:
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(num_nodes, dtype=perm.dtype)
        ei = inv[ei]
    _, _, cid = _chunk_ids(ei[0], ei[1], _boundaries(num_nodes, num_parts))
    return int(torch.bincount(cid, minlength=num_parts * num_parts).max())


@dataclass
class GraphPartition:
    """A graph renumbered for locality and cut into ``P`` vertex intervals and ``P x P`` edge chunks.

    Source: NGra (Ma et al., USENIX ATC'19), section 4 (vertex intervals, edge chunks, streaming).
    Build it with :meth:`build`; all vertex ids below are in the NEW numbering unless noted.

    Attributes:
        num_nodes: ``N``.
        num_parts: ``P``.
        perm: ``[N]`` int64, ``perm[new] = old`` vertex id.
        inv_perm: ``[N]`` int64, ``inv_perm[old] = new``.
        boundaries: ``[P + 1]`` int64; interval ``k`` is ``[boundaries[k], boundaries[k + 1])``.
        chunk_ptr: ``[P * P + 1]`` int64; chunk ``(i, j)`` is the slice
            ``chunk_ptr[j * P + i] : chunk_ptr[j * P + i + 1]`` of the edge arrays.
        src_local: ``[E]`` local source index of each edge (into its source interval), int32 when
            the largest interval has fewer than ``2**31`` vertices, else int64.
        dst_local: ``[E]`` local destination index (into its destination interval), same dtype.
        edge_ids: ``[E]`` int64 column of each edge in the ``edge_index`` given to :meth:`build`.
    """

    num_nodes: int
    num_parts: int
    perm: torch.Tensor
    inv_perm: torch.Tensor
    boundaries: torch.Tensor
    chunk_ptr: torch.Tensor
    src_local: torch.Tensor
    dst_local: torch.Tensor
    edge_ids: torch.Tensor
    _ptr: list[int] = field(init=False, repr=False)
    _bounds: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._ptr = [int(v) for v in self.chunk_ptr.tolist()]
        self._bounds = [int(v) for v in self.boundaries.tolist()]

    @classmethod
    def build(
        cls, edge_index: torch.Tensor, num_nodes: int, num_parts: int, order: str | torch.Tensor = "rcm"
    ) -> GraphPartition:
        """Partition a graph.

        Args:
            edge_index: ``[2, E]`` int32/int64 edges (row 0 sources, row 1 destinations), already
                prepared for the layer (self-loops added or removed as the layer wants): every
                column becomes one chunk edge.
            num_nodes: ``N``.
            num_parts: ``P``, ``1 <= P <= N``.
            order: ``"rcm"`` (reverse Cuthill-McKee), ``"identity"``, or an ``[N]`` permutation
                tensor ``perm[new] = old``.

        Cost: one ``O(E log E)`` sort by ``(destination interval, source interval, destination)``
        plus the ordering (RCM is ``O(E)``-ish in scipy).

        Raises:
            PartitionError: malformed edges, ``P`` out of range, or a malformed permutation.
        """
        _check_edge_index(edge_index, num_nodes)
        _check_parts(num_parts, num_nodes)
        if isinstance(order, torch.Tensor):
            perm = order.to(torch.int64).cpu()
            if perm.shape != (num_nodes,) or not torch.equal(torch.sort(perm).values, torch.arange(num_nodes)):
                raise PartitionError(f"order must be a permutation of range({num_nodes}) (perm[new] = old).")
        else:
            perm = locality_order(edge_index, num_nodes, order)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(num_nodes, dtype=torch.int64)

        ei = edge_index.detach().cpu().to(torch.int64)
        new_src = inv_perm[ei[0]]
        new_dst = inv_perm[ei[1]]
        bounds = _boundaries(num_nodes, num_parts)
        si, dj, cid = _chunk_ids(new_src, new_dst, bounds)
        # one sort: chunk id major (destination interval, then source interval), destination minor
        key = cid * num_nodes + new_dst
        key, order_idx = torch.sort(key, stable=True)
        counts = torch.bincount(cid, minlength=num_parts * num_parts)
        chunk_ptr = torch.zeros(num_parts * num_parts + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=chunk_ptr[1:])
        widest = int((bounds[1:] - bounds[:-1]).max())
        idx_dtype = torch.int32 if widest < 2**31 else torch.int64
        src_local = (new_src[order_idx] - bounds[si[order_idx]]).to(idx_dtype)
        dst_local = (new_dst[order_idx] - bounds[dj[order_idx]]).to(idx_dtype)
        return cls(
            num_nodes=num_nodes,
            num_parts=num_parts,
            perm=perm,
            inv_perm=inv_perm,
            boundaries=bounds,
            chunk_ptr=chunk_ptr,
            src_local=src_local,
            dst_local=dst_local,
            edge_ids=order_idx,
        )

    # --- structure -------------------------------------------------------------------------------

    @property
    def num_edges(self) -> int:
        """``E``, the number of edges over all chunks."""
        return int(self.src_local.numel())

    def _check_interval(self, k: int, name: str) -> None:
        if not isinstance(k, int) or not 0 <= k < self.num_parts:
            raise PartitionError(f"{name} must be an interval index in [0, {self.num_parts}), got {k!r}.")

    def interval(self, k: int) -> slice:
        """The vertex rows of interval ``k`` in the new numbering, as a ``slice``.

        Raises:
            PartitionError: ``k`` outside ``[0, P)``.
        """
        self._check_interval(k, "k")
        return slice(self._bounds[k], self._bounds[k + 1])

    def interval_size(self, k: int) -> int:
        """Vertices in interval ``k``."""
        self._check_interval(k, "k")
        return self._bounds[k + 1] - self._bounds[k]

    def chunk_range(self, i: int, j: int) -> tuple[int, int]:
        """``(start, stop)`` of chunk ``(i, j)`` in the edge arrays."""
        self._check_interval(i, "i")
        self._check_interval(j, "j")
        c = j * self.num_parts + i
        return self._ptr[c], self._ptr[c + 1]

    def chunk(self, i: int, j: int) -> EdgeChunk:
        """Chunk ``(i, j)``: the edges from source interval ``i`` to destination interval ``j``.

        The tensors are views of the partition's arrays (no copy).

        Raises:
            PartitionError: ``i`` or ``j`` outside ``[0, P)``.
        """
        lo, hi = self.chunk_range(i, j)
        return EdgeChunk(i, j, self.src_local[lo:hi], self.dst_local[lo:hi], self.edge_ids[lo:hi])

    def chunk_edges(self) -> torch.Tensor:
        """``[P, P]`` int64 edge counts, entry ``[i, j]`` for chunk ``(i, j)``."""
        counts = self.chunk_ptr[1:] - self.chunk_ptr[:-1]
        return counts.view(self.num_parts, self.num_parts).t().contiguous()

    def edge_index(self) -> torch.Tensor:
        """``[2, E]`` int64 edges in the new numbering, in chunk order (what the chunks hold, globally)."""
        counts = self.chunk_ptr[1:] - self.chunk_ptr[:-1]
        p = self.num_parts
        src_off = self.boundaries[:-1].repeat(p)  # chunk c = j * P + i -> boundaries[i]
        dst_off = self.boundaries[:-1].repeat_interleave(p)  # -> boundaries[j]
        src = self.src_local.to(torch.int64) + src_off.repeat_interleave(counts)
        dst = self.dst_local.to(torch.int64) + dst_off.repeat_interleave(counts)
        return torch.stack([src, dst])

    # --- vertex data ----------------------------------------------------------------------------

    def _check_rows(self, x: torch.Tensor, name: str) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != self.num_nodes:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise PartitionError(f"{name} must have num_nodes={self.num_nodes} rows, got shape {shape}.")

    def permute(self, x: torch.Tensor) -> torch.Tensor:
        """Vertex data ``[N, ...]`` in the original numbering -> the new numbering (``x[perm]``).

        Raises:
            PartitionError: ``x`` does not have ``N`` rows.
        """
        self._check_rows(x, "x")
        return x.index_select(0, self.perm.to(x.device))

    def unpermute(self, y: torch.Tensor) -> torch.Tensor:
        """Vertex data ``[N, ...]`` in the new numbering -> the original numbering (``y[inv_perm]``).

        Raises:
            PartitionError: ``y`` does not have ``N`` rows.
        """
        self._check_rows(y, "y")
        return y.index_select(0, self.inv_perm.to(y.device))

    # --- statistics -----------------------------------------------------------------------------

    @property
    def max_chunk_edges(self) -> int:
        """Edges in the largest chunk."""
        counts = self.chunk_ptr[1:] - self.chunk_ptr[:-1]
        return int(counts.max()) if counts.numel() else 0

    @property
    def index_bytes(self) -> int:
        """Bytes of the stored index tensors (chunk indices, edge ids, pointers, permutations)."""
        tensors = (self.src_local, self.dst_local, self.edge_ids, self.chunk_ptr, self.perm, self.inv_perm)
        return int(sum(t.numel() * t.element_size() for t in tensors))

    def stats(self) -> PartitionStats:
        """Size statistics (see :class:`PartitionStats`)."""
        counts = self.chunk_edges()
        sizes = self.boundaries[1:] - self.boundaries[:-1]
        return PartitionStats(
            num_nodes=self.num_nodes,
            num_edges=self.num_edges,
            num_parts=self.num_parts,
            max_interval_nodes=int(sizes.max()),
            max_chunk_edges=int(counts.max()),
            empty_chunks=int((counts == 0).sum()),
            diagonal_edges=int(counts.diagonal().sum()),
            index_bytes=self.index_bytes,
        )


def partition_for_model(
    model: Any, edge_index: torch.Tensor, num_nodes: int, num_parts: int, order: str | torch.Tensor = "rcm"
) -> GraphPartition:
    """The partition a ``GNNModel`` streams on: its first layer's prepared edges (self-loops per the layer).

    Args:
        model: a ``GNNModel`` (its ``layers[0].prepare_edges`` is used).
        edge_index: ``[2, E]`` int64 raw edges.
        num_nodes: ``N``.
        num_parts: ``P``.
        order: as :meth:`GraphPartition.build`.

    Raises:
        PartitionError: ``model`` has no SAGA layers, or bad ``P`` / ``order``.
        GNNError: malformed ``edge_index`` (from ``prepare_edges``).
    """
    layers = list(getattr(model, "layers", []))
    if not layers or not hasattr(layers[0], "prepare_edges"):
        raise PartitionError(f"partition_for_model needs a GNNModel with SAGA layers, got {type(model).__name__}.")
    prepared = layers[0].prepare_edges(edge_index, num_nodes)
    return GraphPartition.build(prepared, num_nodes, num_parts, order)


# --- memory prediction and the choice of P ---------------------------------------------------------

#: Floats per edge alive while the largest chunk is recomputed and back-propagated (the peak phase
#: of a streamed training step), in units of the layer's message width ``M``: the gathered rows,
#: the message, the surrogate's temporaries and their gradients. Measured: the slope of the peak
#: over the largest chunk's edges (``runtime.gnn.memory.measure_peak``, float32, 432k-edge R-MAT,
#: P = 1, 4, 16) was 6.2 M (gat), 4.1 M (gcn), 2.7 M (sage, gin), 9.1 M (gated-gcn); rounded up here.
EDGE_FLOATS_PER_MESSAGE = {"gcn": 4.5, "gat": 7.0, "sage": 3.2, "gin": 3.2, "gated-gcn": 10.0}
#: Bytes of the per-process state a first training step creates (autograd engine, thread pools,
#: kernel caches; measured about 40 MiB after a cold step), not part of the prediction: the budget
#: is checked after a warm-up step.
FIRST_STEP_RUNTIME_BYTES = 40 * 2**20


@dataclass(frozen=True)
class LayerWidths:
    """Per-vertex and per-edge widths (elements) of one layer as the streamed executor holds them.

    Attributes:
        in_dim: ``F_in``.
        h_dim: ``D_h``, the width of ``apply_vertex_pre``'s output (GAT ``heads * head_dim + 2 * heads``,
            gated GCN ``3 * out``, SAGE and GIN ``in``: identity).
        msg: ``M``, elements of one message (GAT ``heads * head_dim``; SAGE and GIN ``in``).
        stats: per-vertex accumulator statistics beside the message sum (softmax: max and sum per head).
        out_dim: ``F_out``.
        extra: per-vertex elements ``apply_vertex`` keeps beyond its output (GIN's MLP: its input
            and hidden layer, ``F_in + 2 F_out``; SAGE: the second linear's output, ``F_out``).
    """

    in_dim: int
    h_dim: int
    msg: int
    stats: int
    out_dim: int
    extra: int = 0


def layer_widths(model: Any) -> tuple[str, list[LayerWidths]]:
    """``(kind, widths of every layer)`` of a ``GNNConfig`` or ``GNNModel`` (``engine.gnn.models``' layers).

    Raises:
        PartitionError: ``model`` is neither.
    """
    from engine.gnn.models import GNNConfig, GNNModel

    config = model.config if isinstance(model, GNNModel) else model
    if not isinstance(config, GNNConfig):
        raise PartitionError(f"model must be a GNNConfig or a GNNModel, got {type(model).__name__}.")
    out: list[LayerWidths] = []
    last = config.layers - 1
    for index, (a, c) in enumerate(config.widths()):
        if config.kind == "gat":
            heads = config.heads
            w = heads * c if index == last else c  # the last layer averages heads of c channels
            out.append(LayerWidths(a, w + 2 * heads, w, 2 * heads, c))
        elif config.kind == "gcn":
            out.append(LayerWidths(a, c, c, 0, c))
        elif config.kind == "gated-gcn":
            out.append(LayerWidths(a, 3 * c, c, 0, c))
        elif config.kind == "gin":  # messages are the input rows; apply_vertex is an MLP
            out.append(LayerWidths(a, a, a, 0, c, a + 2 * c))
        else:  # sage: messages are the input rows; apply_vertex is lin_l(agg) + lin_r(x)
            out.append(LayerWidths(a, a, a, 0, c, c))
    return config.kind, out


@dataclass(frozen=True)
class MemoryEstimate:
    """The predicted peak of a streamed training step, in bytes, by part (see :func:`predict_streamed_peak`)."""

    num_parts: int
    vertex_bytes: int
    chunk_bytes: int
    accumulator_bytes: int
    prefetch_bytes: int

    @property
    def total_bytes(self) -> int:
        """The predicted peak: the sum of the parts."""
        return self.vertex_bytes + self.chunk_bytes + self.accumulator_bytes + self.prefetch_bytes


def predict_streamed_peak(
    num_nodes: int,
    max_chunk_edges: int,
    model: Any,
    num_parts: int,
    dtype_bytes: int = 4,
    index_bytes: int = 8,
) -> MemoryEstimate:
    """The predicted peak memory of one streamed training step (forward + backward), in bytes.

    NGra section 4: only the vertex data, one chunk and one accumulator are resident. With
    ``b = dtype_bytes``, ``n = ceil(N / P)`` (the largest interval), ``E_c`` the largest chunk's
    edges and per layer ``l`` the :class:`LayerWidths` ``(F_in, D_h, M, S, F_out, X)``:

    - resident vertex data (the permuted input, and per layer ``h``, the aggregate and the final
      accumulator kept for the backward, ``apply_vertex``'s own tensors, the output before and
      after the ReLU), plus the backward's vertex gradients of the widest layer:
      ``N * b * (F_in_0 + sum_l (D_h + 2 M + S + X + 2 F_out) + max_l (2 D_h + M + F_out))``;
    - the largest chunk's edge tensors for the widest layer (its int64 indices and
      ``EDGE_FLOATS_PER_MESSAGE[kind] * M`` floats per edge): ``E_c * (2 * index_bytes + max_l k M * b)``;
    - one accumulator (the old and the new one while a chunk is folded in) and the backward's
      source and destination row gradients of a chunk: ``n * b * max_l (2 (M + S) + 2 D_h)``;
    - the prefetch buffer, the next chunk's indices and the source and destination rows it reads
      (rows are views on the CPU, a copy on a device): ``E_c * 2 * index_bytes + 2 * n * max_l D_h * b``.

    The one-time state of a process's first step (:data:`FIRST_STEP_RUNTIME_BYTES`) is not included.

    Args:
        num_nodes: ``N``.
        max_chunk_edges: ``E_c`` for this ``P`` (see :func:`max_chunk_edges`).
        model: a ``GNNConfig`` or ``GNNModel``.
        num_parts: ``P``.
        dtype_bytes: bytes of a feature element (4 for float32).
        index_bytes: bytes of an index element the executor works with (8: int64).

    Raises:
        PartitionError: ``model`` is neither a ``GNNConfig`` nor a ``GNNModel``.
    """
    kind, widths = layer_widths(model)
    b = dtype_bytes
    n = math.ceil(num_nodes / num_parts)
    k = EDGE_FLOATS_PER_MESSAGE[kind]
    resident = widths[0].in_dim + sum(w.h_dim + 2 * w.msg + w.stats + w.extra + 2 * w.out_dim for w in widths)
    grads = max(2 * w.h_dim + w.msg + w.out_dim for w in widths)
    vertex = num_nodes * b * (resident + grads)
    chunk = max_chunk_edges * (2 * index_bytes + max(k * w.msg for w in widths) * b)
    acc = n * b * max(2 * (w.msg + w.stats) + 2 * w.h_dim for w in widths)
    prefetch = max_chunk_edges * 2 * index_bytes + 2 * n * max(w.h_dim for w in widths) * b
    return MemoryEstimate(num_parts, int(vertex), int(math.ceil(chunk)), int(acc), int(prefetch))


def choose_partitions(
    num_nodes: int,
    num_edges: int,
    model: Any,
    budget_bytes: int,
    *,
    edge_index: torch.Tensor | None = None,
    order: str = "rcm",
    dtype_bytes: int = 4,
    max_parts: int = MAX_PARTITIONS,
) -> int:
    """The smallest power-of-two ``P`` (``1 .. max_parts``, at most ``N``) whose predicted peak fits.

    The peak is :func:`predict_streamed_peak`'s. The largest chunk's edge count is counted exactly
    on ``edge_index`` in the locality ``order`` when it is given, else assumed uniform,
    ``ceil(E / P**2)`` (optimistic on skewed, power-law graphs: pass the edges there).

    Args:
        num_nodes: ``N``.
        num_edges: ``E`` (of the prepared edge index, self-loops included).
        model: a ``GNNConfig`` or ``GNNModel``.
        budget_bytes: the memory budget in bytes.
        edge_index: optional ``[2, E]`` prepared edges, for the exact largest chunk.
        order: the vertex order the partition will use (``"rcm"`` or ``"identity"``).
        dtype_bytes: bytes per feature element.
        max_parts: the largest ``P`` tried.

    Returns:
        ``P``.

    Raises:
        PartitionError: a non-positive budget or sizes, ``edge_index`` not matching ``num_edges``, or
            no ``P`` fitting (the message names the budget and the smallest predicted peak).
    """
    for name, value in (("num_nodes", num_nodes), ("budget_bytes", budget_bytes), ("max_parts", max_parts)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PartitionError(f"{name} must be a positive int, got {value!r}.")
    if not isinstance(num_edges, int) or isinstance(num_edges, bool) or num_edges < 0:
        raise PartitionError(f"num_edges must be a non-negative int, got {num_edges!r}.")
    perm = None
    if edge_index is not None:
        _check_edge_index(edge_index, num_nodes)
        if edge_index.shape[1] != num_edges:
            raise PartitionError(
                f"edge_index has {edge_index.shape[1]} edges but num_edges={num_edges}; pass the same prepared graph."
            )
        perm = locality_order(edge_index, num_nodes, order)
    best: MemoryEstimate | None = None
    p = 1
    while p <= min(max_parts, num_nodes):
        if edge_index is not None:
            e_c = max_chunk_edges(edge_index, num_nodes, p, perm)
        else:
            e_c = math.ceil(num_edges / (p * p))
        est = predict_streamed_peak(num_nodes, e_c, model, p, dtype_bytes=dtype_bytes)
        if est.total_bytes <= budget_bytes:
            return p
        if best is None or est.total_bytes < best.total_bytes:
            best = est
        p *= 2
    assert best is not None
    raise PartitionError(
        f"no partition count P in 1..{min(max_parts, num_nodes)} fits the memory budget of {budget_bytes} bytes "
        f"({budget_bytes / 2**20:.1f} MiB): the smallest predicted peak is {best.total_bytes} bytes "
        f"({best.total_bytes / 2**20:.1f} MiB, at P={best.num_parts}, of which {best.vertex_bytes} bytes of "
        f"resident vertex data), so raise the budget to at least that."
    )
