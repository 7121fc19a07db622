"""SAGA-NN graph layers and their chunk API (NGra, USENIX ATC'19, section 3; docs/gnn.md).

A layer maps vertex features ``x: [N, F_in]`` and ``edge_index: [2, E]`` (row 0 source, row 1
destination, PyG's ``flow="source_to_target"``) to ``[N, F_out]`` through five stages, each run
inside ``torch.profiler.record_function("saga.<stage>")``:

``prepare_edges(edge_index, num_nodes) -> edge_index``
    ``[2, E] -> [2, E']``: where ``layer.self_loops`` is true, removes the self-loops and adds one
    per vertex (``torch_geometric.utils.remove_self_loops`` / ``add_self_loops``, as ``GCNConv`` and
    ``GATConv`` do); otherwise returns the edges unchanged. Raises :class:`GNNError` on a malformed
    or out-of-range ``edge_index``. Every other method takes PREPARED edges.
``vertex_attrs(edge_index, num_nodes, dtype=None) -> vattr``
    ``[N, 2]`` float: column :data:`IN_DEGREE` is the in-degree, :data:`OUT_DEGREE` the out-degree,
    both counted on the WHOLE prepared graph (``torch_geometric.utils.degree``), so that a chunk
    computes exactly what the full graph does (GCN's normalisation, the mean).
``apply_vertex_pre(x) -> h`` (``saga.apply_vertex``)
    ``[n, F_in] -> [n, D_h]``, row-wise, so it may run on one vertex interval at a time. The layout
    of ``h`` is the layer's own (e.g. GAT packs ``W x`` and its two attention scores per head).
``scatter(h_src, h_dst, src, dst, vattr_src, vattr_dst) -> EdgeData`` (``saga.scatter``)
    ``h_src: [n_src, D_h]``, ``h_dst: [n_dst, D_h]``, ``src, dst: [E]`` (int64 indices into
    ``h_src`` / ``h_dst``: global with P = 1, local to the intervals for a chunk), ``vattr_src:
    [n_src, 2]``, ``vattr_dst: [n_dst, 2]``; returns :class:`EdgeData` (``index_select`` of the rows
    each edge needs, ``[E, ...]``).
``apply_edge(edata) -> (msg, logit)`` (``saga.apply_edge``)
    ``msg: [E, *layer.message_shape]``; ``logit: [E, *message_shape[:-1]]`` for the ``softmax``
    gather, else ``None``.
``gather(msg, logit, dst, n_dst) -> agg`` (``saga.gather``, full graph)
    ``[n_dst, *message_shape]`` by ``torch_geometric.utils.scatter`` / ``softmax``; a destination
    without in-edges gets 0 (PyG's convention).
``apply_vertex(h_dst, x_dst, agg) -> out`` (``saga.apply_vertex``)
    ``[n, D_h], [n, F_in], [n, *message_shape] -> [n, F_out]``, row-wise (one interval at a time).

``layer(x, edge_index)`` composes these with P = 1.

The chunk API (for the streamed executor, ``runtime/gnn/streaming.py``; an edge chunk holds the
edges from source interval i to destination interval j with local indices; ``GatherAcc`` is a
``dict[str, Tensor]`` whose entries are ``[n_dst, ...]``):

``gather_init(n_dst, like) -> acc``
    an empty accumulator with ``like``'s dtype and device (any tensor, e.g. the layer input).
``gather_update(acc, msg, logit, dst_local) -> acc``
    folds one chunk in and RETURNS A NEW accumulator (``acc`` is not modified in place; drop it).
    Exact: sum and mean add (``index_add``); max keeps the running ``amax`` and the running count
    of edges that attain it (per feature, for the backward's even split of ties); softmax keeps
    the running max of the logits, the running sum of ``exp(logit - max)`` and the running
    weighted sum of messages, rescaling both when the max grows (online softmax, as
    FlashAttention does). Meant to run under ``torch.no_grad()``; the softmax and sum/mean folds
    are also differentiable.
``gather_finalize(acc, vattr_dst) -> agg``
    ``[n_dst, *message_shape]``, equal to the full-graph ``gather`` over the destination interval
    once every chunk of the interval is folded in (mean divides by the in-degree from
    ``vattr_dst``; softmax divides by the sum of exponentials plus PyG's ``1e-16``; max puts 0
    where a destination has no in-edge).
``chunk_surrogate(msg, logit, dst_local, agg_dst, grad_agg_dst, acc_dst, vattr_dst) -> scalar``
    a 0-d tensor whose autograd gradient with respect to the chunk's ``msg`` and ``logit`` (and so,
    through the recomputed ``scatter`` / ``apply_edge``, to ``h`` and the layer's parameters) is
    exactly that chunk's share of the full-graph gradient, given the destination interval's
    final (detached) ``agg_dst = gather_finalize(acc_dst, vattr_dst)``, its final accumulator
    ``acc_dst`` and the upstream gradient ``grad_agg_dst = dL/d agg_dst``. Its VALUE is not the
    loss. sum: ``sum_e g[dst_e] . msg_e``; mean: the same with ``g / in_degree``; max: only the
    edges that attain the max, each weighted ``1 / count`` (ties split evenly, as the backward of
    ``scatter_reduce(reduce="amax")`` does; like that backward, which PyG's scatter max runs on a
    zero tensor with ``include_self=False``, ``count`` is one more where the max is exactly 0, the
    zero scattered into counting as a tie, so the gradient equals PyG's); softmax:
    ``sum_e alpha_e g[dst_e] . (v_e - out[dst_e])``
    with ``alpha_e = exp(logit_e - M[dst_e]) / S[dst_e]`` from the detached final max ``M`` and sum
    ``S``.

The built-in layers equal PyTorch Geometric's (outputs and gradients, tested): :class:`GCNLayer`
(``GCNConv``), :class:`GATLayer` (``GATConv``), :class:`SAGELayer` (``SAGEConv``),
:class:`GINLayer` (``GINConv``), :class:`GatedGCNLayer` (``ResGatedGraphConv``). Each has the same
parameter names as the PyG layer and ``from_pyg(conv)`` copies one.
"""

from __future__ import annotations

import copy
import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function
from torch_geometric.nn import GATConv, GCNConv, GINConv, ResGatedGraphConv, SAGEConv
from torch_geometric.utils import add_self_loops, degree, remove_self_loops, scatter, softmax

from engine.errors import GNNError

GATHER_KINDS = ("sum", "mean", "max", "softmax")
"""The gather (reduce) kinds a :class:`SAGALayer` may use."""

IN_DEGREE = 0
"""Column of ``vertex_attrs`` holding the in-degree (edges whose destination is the vertex)."""
OUT_DEGREE = 1
"""Column of ``vertex_attrs`` holding the out-degree (edges whose source is the vertex)."""

SOFTMAX_EPS = 1e-16
"""Added to the softmax denominator, exactly as ``torch_geometric.utils.softmax`` does."""

GatherAcc = dict[str, Tensor]
"""A destination interval's gather accumulator: named ``[n_dst, ...]`` tensors (see the module docstring)."""


class EdgeData(NamedTuple):
    """Vertex data copied onto edges by :meth:`SAGALayer.scatter`; every tensor is ``[E, ...]``.

    Attributes:
        src: rows of ``h_src`` at the edges' sources (the columns the layer needs).
        dst: rows of ``h_dst`` at the edges' destinations, or ``None`` where the layer needs none.
        vattr_src: ``vertex_attrs`` rows at the sources ``[E, 2]``, or ``None``.
        vattr_dst: ``vertex_attrs`` rows at the destinations ``[E, 2]``, or ``None``.
        src_extra: a second block of source columns gathered on its own (GAT's attention term
            ``[E, heads]`` next to its values in ``src``), or ``None``. Gathering column blocks separately
            rather than slicing one wide gather keeps the backward from materialising edge-sized
            zero-filled slices.
    """

    src: Tensor
    dst: Tensor | None = None
    vattr_src: Tensor | None = None
    vattr_dst: Tensor | None = None
    src_extra: Tensor | None = None


def _rows(t: Tensor, like: Tensor) -> Tensor:
    """View ``t: [n]`` as ``[n, 1, ..., 1]`` so that it broadcasts against ``like: [n, ...]``."""
    return t.view((-1,) + (1,) * (like.dim() - 1))


def _expand_index(index: Tensor, like: Tensor) -> Tensor:
    """Broadcast an edge index ``[E]`` to ``like``'s shape ``[E, ...]`` (for ``scatter_reduce``)."""
    return _rows(index, like).expand_as(like)


class SAGALayer(nn.Module):
    """A SAGA-NN graph layer (NGra, ATC'19, section 3): Scatter, ApplyEdge, Gather, ApplyVertex.

    Subclasses set the stages by overriding ``_apply_vertex_pre``, ``_scatter``, ``_apply_edge``
    and ``_apply_vertex`` (defaults: identity, ``h_src[src]``, the message is the source row, the
    aggregate); the public methods wrap them in the ``saga.*`` profiler ranges. The exact
    signatures and shapes are in the module docstring.

    Args:
        in_dim: input feature width ``F_in``.
        out_dim: output feature width ``F_out``.
        message_shape: trailing shape of a message (``(D,)``; GAT ``(heads, D / heads)``).
        gather: one of :data:`GATHER_KINDS`.
        self_loops: whether :meth:`prepare_edges` replaces the self-loops by one per vertex.

    Raises:
        GNNError: a width is not positive or ``gather`` is not a known kind.
    """

    def __init__(self, in_dim: int, out_dim: int, message_shape: tuple[int, ...], gather: str, self_loops: bool):
        super().__init__()
        for name, value in (("in_dim", in_dim), ("out_dim", out_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise GNNError(f"{type(self).__name__} {name} must be a positive integer, got {value!r}.")
        if not message_shape or any(not isinstance(d, int) or d < 1 for d in message_shape):
            raise GNNError(f"{type(self).__name__} message_shape must be a non-empty tuple of positive ints, "
                           f"got {message_shape!r}.")
        if gather not in GATHER_KINDS:
            raise GNNError(f"Unknown gather kind {gather!r}; use one of {', '.join(GATHER_KINDS)}.")
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.message_shape = tuple(message_shape)
        self.gather_kind = gather
        self.self_loops = bool(self_loops)

    # ----------------------------------------------------------------- graph preparation
    def prepare_edges(self, edge_index: Tensor, num_nodes: int) -> Tensor:
        """The edges this layer runs on: ``[2, E] -> [2, E']`` (see the module docstring).

        Raises:
            GNNError: ``edge_index`` is not an int64 ``[2, E]`` tensor with entries in ``[0, num_nodes)``.
        """
        _check_edge_index(edge_index, num_nodes)
        if not self.self_loops:
            return edge_index
        edge_index, _ = remove_self_loops(edge_index)
        edge_index, _ = add_self_loops(edge_index, num_nodes=num_nodes)
        return edge_index

    def vertex_attrs(self, edge_index: Tensor, num_nodes: int, dtype: torch.dtype | None = None) -> Tensor:
        """In- and out-degree of every vertex of the PREPARED graph: ``[num_nodes, 2]`` of ``dtype``.

        Column :data:`IN_DEGREE` counts edges into the vertex, :data:`OUT_DEGREE` edges out of it
        (``torch_geometric.utils.degree``); duplicate edges count every time.
        """
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        deg_in = degree(edge_index[1], num_nodes, dtype=dtype)
        deg_out = degree(edge_index[0], num_nodes, dtype=dtype)
        return torch.stack([deg_in, deg_out], dim=1)

    # ----------------------------------------------------------------- the stages
    def apply_vertex_pre(self, x: Tensor) -> Tensor:
        """Per-vertex network before the scatter: ``[n, F_in] -> [n, D_h]`` (range ``saga.apply_vertex``)."""
        with record_function("saga.apply_vertex"):
            return self._apply_vertex_pre(x)

    def scatter(self, h_src: Tensor, h_dst: Tensor, src: Tensor, dst: Tensor,
                vattr_src: Tensor, vattr_dst: Tensor) -> EdgeData:
        """Copy vertex data onto edges (range ``saga.scatter``); shapes in the module docstring."""
        with record_function("saga.scatter"):
            return self._scatter(h_src, h_dst, src, dst, vattr_src, vattr_dst)

    def apply_edge(self, edata: EdgeData) -> tuple[Tensor, Tensor | None]:
        """Per-edge network (range ``saga.apply_edge``): ``(msg [E, *message_shape], logit or None)``."""
        with record_function("saga.apply_edge"):
            return self._apply_edge(edata)

    def apply_vertex(self, h_dst: Tensor, x_dst: Tensor, agg: Tensor) -> Tensor:
        """Per-vertex network after the gather (range ``saga.apply_vertex``): ``-> [n, F_out]``."""
        with record_function("saga.apply_vertex"):
            return self._apply_vertex(h_dst, x_dst, agg)

    def gather(self, msg: Tensor, logit: Tensor | None, dst: Tensor, n_dst: int) -> Tensor:
        """Full-graph gather (range ``saga.gather``): ``[E, *S] -> [n_dst, *S]``.

        sum / mean / max by ``torch_geometric.utils.scatter``; softmax weights each message by
        ``torch_geometric.utils.softmax(logit, dst)`` and sums. A destination without in-edges gets 0.

        Raises:
            GNNError: the softmax gather got no logits.
        """
        with record_function("saga.gather"):
            kind = self.gather_kind
            if kind != "softmax":
                return scatter(msg, dst, 0, dim_size=n_dst, reduce=kind)
            logit = self._need_logit(logit)
            alpha = softmax(logit, dst, num_nodes=n_dst)
            return scatter(alpha.unsqueeze(-1) * msg, dst, 0, dim_size=n_dst, reduce="sum")

    def forward(self, x: Tensor, edge_index: Tensor, prepared: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Full-graph (P = 1) layer: ``x [N, F_in]``, ``edge_index [2, E]`` -> ``[N, F_out]``.

        Args:
            prepared: ``(prepare_edges(edge_index, N), vertex_attrs(...))`` computed once per graph by the
                caller (:meth:`engine.gnn.models.GNNModel.forward` shares them between layers with the
                same ``self_loops``); ``None`` computes them here.

        Raises:
            GNNError: ``x`` is not ``[N, in_dim]`` or ``edge_index`` is malformed.
        """
        if x.dim() != 2 or x.size(1) != self.in_dim:
            raise GNNError(f"{type(self).__name__} expects x of shape [N, {self.in_dim}], got {list(x.shape)}.")
        n = x.size(0)
        if prepared is None:
            edge_index = self.prepare_edges(edge_index, n)
            vattr = self.vertex_attrs(edge_index, n, dtype=x.dtype)
        else:
            edge_index, vattr = prepared
        src, dst = edge_index[0], edge_index[1]
        h = self.apply_vertex_pre(x)
        edata = self.scatter(h, h, src, dst, vattr, vattr)
        msg, logit = self.apply_edge(edata)
        agg = self.gather(msg, logit, dst, n)
        return self.apply_vertex(h, x, agg)

    # ----------------------------------------------------------------- chunk API
    def gather_init(self, n_dst: int, like: Tensor) -> GatherAcc:
        """An empty accumulator for a destination interval of ``n_dst`` vertices (``like``: dtype, device).

        Entries: sum / mean ``{"sum": [n_dst, *S]}``; max ``{"max": -inf, "count": 0}`` both
        ``[n_dst, *S]``; softmax ``{"max": [n_dst, *S[:-1]] of -inf, "sum": [n_dst, *S[:-1]],
        "out": [n_dst, *S]}``, where ``S = message_shape``.
        """
        shape = (n_dst,) + self.message_shape
        dtype, device = like.dtype, like.device
        kind = self.gather_kind
        if kind in ("sum", "mean"):
            return {"sum": torch.zeros(shape, dtype=dtype, device=device)}
        if kind == "max":
            return {"max": torch.full(shape, -math.inf, dtype=dtype, device=device),
                    "count": torch.zeros(shape, dtype=dtype, device=device)}
        return {
            "max": torch.full(shape[:-1], -math.inf, dtype=dtype, device=device),
            "sum": torch.zeros(shape[:-1], dtype=dtype, device=device),
            "out": torch.zeros(shape, dtype=dtype, device=device),
        }

    def gather_update(self, acc: GatherAcc, msg: Tensor, logit: Tensor | None, dst_local: Tensor) -> GatherAcc:
        """Fold one chunk's messages ``[E_c, *S]`` into ``acc``; returns a NEW accumulator (range ``saga.gather``).

        ``dst_local: [E_c]`` indexes the destination interval. Exact (see the module docstring).

        Raises:
            GNNError: the softmax gather got no logits.
        """
        with record_function("saga.gather"):
            kind = self.gather_kind
            if kind in ("sum", "mean"):
                return {"sum": acc["sum"].index_add(0, dst_local, msg)}
            if kind == "max":
                old = acc["max"]
                new = old.scatter_reduce(0, _expand_index(dst_local, msg), msg, reduce="amax", include_self=True)
                hits = (msg == new.index_select(0, dst_local)).to(msg.dtype)
                count = acc["count"] * (old == new).to(msg.dtype) + torch.zeros_like(new).index_add(0, dst_local, hits)
                return {"max": new, "count": count}
            logit = self._need_logit(logit)
            m_old = acc["max"]
            m_new = m_old.scatter_reduce(0, _expand_index(dst_local, logit), logit.detach(), reduce="amax",
                                         include_self=True)
            m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            scale = torch.exp(m_old - m_safe)  # 0 where nothing was folded yet (exp(-inf))
            p = torch.exp(logit - m_safe.index_select(0, dst_local))
            s = acc["sum"] * scale + torch.zeros_like(scale).index_add(0, dst_local, p)
            out = acc["out"] * scale.unsqueeze(-1) + torch.zeros_like(acc["out"]).index_add(
                0, dst_local, p.unsqueeze(-1) * msg)
            return {"max": m_new, "sum": s, "out": out}

    def gather_finalize(self, acc: GatherAcc, vattr_dst: Tensor) -> Tensor:
        """The gathered ``[n_dst, *S]`` of a destination interval once all its chunks are folded (``saga.gather``).

        ``vattr_dst: [n_dst, 2]`` are the interval's rows of :meth:`vertex_attrs` (whole graph).
        """
        with record_function("saga.gather"):
            kind = self.gather_kind
            if kind == "sum":
                return acc["sum"]
            if kind == "mean":
                total = acc["sum"]
                return total / _rows(vattr_dst[:, IN_DEGREE].clamp(min=1), total)
            if kind == "max":
                return torch.where(acc["count"] > 0, acc["max"], torch.zeros_like(acc["max"]))
            return acc["out"] / (acc["sum"] + SOFTMAX_EPS).unsqueeze(-1)

    def chunk_surrogate(self, msg: Tensor, logit: Tensor | None, dst_local: Tensor, agg_dst: Tensor,
                        grad_agg_dst: Tensor, acc_dst: GatherAcc, vattr_dst: Tensor) -> Tensor:
        """A 0-d tensor whose gradient is the chunk's exact share of the full-graph gradient (``saga.gather``).

        Args:
            msg: the chunk's recomputed messages ``[E_c, *S]`` (attached to the autograd graph).
            logit: the chunk's recomputed logits ``[E_c, *S[:-1]]`` (softmax) or ``None``.
            dst_local: ``[E_c]`` indices into the destination interval.
            agg_dst: the interval's final aggregate ``[n_dst, *S]`` (detached here).
            grad_agg_dst: ``dL/d agg_dst``, ``[n_dst, *S]`` (detached here).
            acc_dst: the interval's final accumulator (after every chunk was folded).
            vattr_dst: ``[n_dst, 2]`` interval rows of :meth:`vertex_attrs`.

        Returns:
            ``s`` such that ``autograd.grad(s, (msg, logit))`` is the chunk's gradient share (the
            formulas are in the module docstring); its value is not the loss. For the max gather the
            recomputed ``msg`` must be bitwise equal to the forward's (recompute the same chunk
            with the same ops; SAGE's and GIN's messages are plain copies of ``h``).

        Raises:
            GNNError: the softmax gather got no logits.
        """
        with record_function("saga.gather"):
            g = grad_agg_dst.detach()
            kind = self.gather_kind
            if kind == "sum":
                return (g.index_select(0, dst_local) * msg).sum()
            if kind == "mean":
                g = g / _rows(vattr_dst[:, IN_DEGREE].clamp(min=1), g)
                return (g.index_select(0, dst_local) * msg).sum()
            if kind == "max":
                top = acc_dst["max"].index_select(0, dst_local)
                # torch's amax backward (``scatter_reduce(include_self=False)`` into zeros, what PyG's
                # scatter max runs) also counts the zero it scattered into as a tie where the max is 0.
                count = acc_dst["count"] + (acc_dst["max"] == 0).to(msg.dtype)
                count = count.index_select(0, dst_local).clamp(min=1)
                weight = (msg.detach() == top).to(msg.dtype) / count
                return (g.index_select(0, dst_local) * weight * msg).sum()
            logit = self._need_logit(logit)
            m = acc_dst["max"]
            m = torch.where(torch.isneginf(m), torch.zeros_like(m), m).index_select(0, dst_local)
            denom = (acc_dst["sum"] + SOFTMAX_EPS).index_select(0, dst_local)
            alpha = torch.exp(logit - m) / denom
            centred = msg - agg_dst.detach().index_select(0, dst_local)
            return (alpha.unsqueeze(-1) * g.index_select(0, dst_local) * centred).sum()

    def chunk_grads(self, msg: Tensor, logit: Tensor | None, dst_local: Tensor, agg_dst: Tensor,
                    grad_agg_dst: Tensor, acc_dst: GatherAcc, vattr_dst: Tensor) -> tuple[Tensor, Tensor | None]:
        """The chunk's share of ``dL/d msg`` (``[E_c, *S]``) and ``dL/d logit`` (``[E_c, *S[:-1]]``, softmax
        only, else ``None``): exactly the gradients of :meth:`chunk_surrogate` (same arguments), computed
        directly so that the streamed backward runs one ``autograd.grad(..., grad_outputs=...)`` through
        Scatter and ApplyEdge instead of back-propagating the surrogate's products (fewer edge-sized
        temporaries). Detached tensors.

        Raises:
            GNNError: the softmax gather got no logits.
        """
        with record_function("saga.gather"):
            g = grad_agg_dst.detach()
            kind = self.gather_kind
            if kind == "sum":
                return g.index_select(0, dst_local), None
            if kind == "mean":
                g = g / _rows(vattr_dst[:, IN_DEGREE].clamp(min=1), g)
                return g.index_select(0, dst_local), None
            m_det = msg.detach()
            if kind == "max":
                top = acc_dst["max"].index_select(0, dst_local)
                count = acc_dst["count"] + (acc_dst["max"] == 0).to(m_det.dtype)  # as in chunk_surrogate
                count = count.index_select(0, dst_local).clamp(min=1)
                return g.index_select(0, dst_local) * (m_det == top).to(m_det.dtype) / count, None
            lg = self._need_logit(logit).detach()
            m = acc_dst["max"]
            m = torch.where(torch.isneginf(m), torch.zeros_like(m), m).index_select(0, dst_local)
            denom = (acc_dst["sum"] + SOFTMAX_EPS).index_select(0, dst_local)
            alpha = torch.exp(lg - m) / denom
            g_e = g.index_select(0, dst_local)
            centred = m_det - agg_dst.detach().index_select(0, dst_local)
            return alpha.unsqueeze(-1) * g_e, alpha * (g_e * centred).sum(-1)

    # ----------------------------------------------------------------- defaults for subclasses
    def _apply_vertex_pre(self, x: Tensor) -> Tensor:
        return x

    def _scatter(self, h_src: Tensor, h_dst: Tensor, src: Tensor, dst: Tensor,
                 vattr_src: Tensor, vattr_dst: Tensor) -> EdgeData:
        return EdgeData(h_src.index_select(0, src))

    def _apply_edge(self, edata: EdgeData) -> tuple[Tensor, Tensor | None]:
        return edata.src, None

    def _apply_vertex(self, h_dst: Tensor, x_dst: Tensor, agg: Tensor) -> Tensor:
        return agg

    def _need_logit(self, logit: Tensor | None) -> Tensor:
        if logit is None:
            raise GNNError(f"{type(self).__name__} uses the softmax gather, so apply_edge must return logits.")
        return logit

    def extra_repr(self) -> str:
        return (f"in_dim={self.in_dim}, out_dim={self.out_dim}, gather={self.gather_kind!r}, "
                f"self_loops={self.self_loops}")


def _check_edge_index(edge_index: Tensor, num_nodes: int) -> None:
    """Raise :class:`GNNError` unless ``edge_index`` is an int64 ``[2, E]`` tensor within ``[0, num_nodes)``."""
    if not isinstance(edge_index, Tensor) or edge_index.dim() != 2 or edge_index.size(0) != 2:
        shape = list(edge_index.shape) if isinstance(edge_index, Tensor) else type(edge_index).__name__
        raise GNNError(f"edge_index must be a [2, E] tensor (row 0 source, row 1 destination), got {shape}.")
    if edge_index.dtype != torch.long:
        raise GNNError(f"edge_index must have dtype torch.int64, got {edge_index.dtype}; convert it with .long().")
    if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= num_nodes):
        raise GNNError(f"edge_index holds vertex ids outside [0, {num_nodes}); "
                       f"pass x with one row per vertex or fix the edges.")


def _copy_pyg_state(layer: nn.Module, conv: nn.Module) -> None:
    """Give ``layer`` the dtype and device of ``conv``'s parameters, then load ``conv``'s state (same names)."""
    ref = next(conv.parameters(), None)
    if ref is not None:
        layer.to(device=ref.device, dtype=ref.dtype)
    layer.load_state_dict(conv.state_dict())


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise GNNError(message)


# =============================================================================== GCN
class GCNLayer(SAGALayer):
    """Graph convolution (Kipf & Welling, ICLR'17), equal to ``torch_geometric.nn.GCNConv`` (normalize=True).

    ``h = W x`` (apply_vertex_pre); message ``deg_in(src)^-1/2 deg_in(dst)^-1/2 h[src]`` (apply_edge,
    degrees from ``vertex_attrs`` with the self-loops); ``sum`` gather; ``+ bias`` (apply_vertex).
    Parameters ``lin.weight [out_dim, in_dim]`` and ``bias [out_dim]``, PyG's names.

    Args:
        in_dim, out_dim: feature widths.
        bias: whether a bias is added.
        add_self_loops: whether one self-loop per vertex replaces the graph's own (PyG's default).
    """

    def __init__(self, in_dim: int, out_dim: int, bias: bool = True, add_self_loops: bool = True):
        super().__init__(in_dim, out_dim, (out_dim,), "sum", add_self_loops)
        self.lin = nn.Linear(in_dim, out_dim, bias=False)
        nn.init.xavier_uniform_(self.lin.weight)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_dim))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_pyg(cls, conv: Any) -> GCNLayer:
        """A copy of a ``GCNConv`` (weights, dtype, device).

        Raises:
            GNNError: the conv is not a ``GCNConv`` with ``normalize=True`` and ``improved=False``.
        """
        _require(isinstance(conv, GCNConv), f"GCNLayer.from_pyg needs a GCNConv, got {type(conv).__name__}.")
        _require(conv.normalize and not conv.improved,
                 "GCNLayer.from_pyg supports GCNConv with normalize=True and improved=False only.")
        layer = cls(conv.in_channels, conv.out_channels, bias=conv.bias is not None,
                    add_self_loops=conv.add_self_loops)
        _copy_pyg_state(layer, conv)
        return layer

    def _apply_vertex_pre(self, x: Tensor) -> Tensor:
        return self.lin(x)

    def _scatter(self, h_src: Tensor, h_dst: Tensor, src: Tensor, dst: Tensor,
                 vattr_src: Tensor, vattr_dst: Tensor) -> EdgeData:
        return EdgeData(h_src.index_select(0, src), None,
                        vattr_src.index_select(0, src), vattr_dst.index_select(0, dst))

    def _apply_edge(self, edata: EdgeData) -> tuple[Tensor, Tensor | None]:
        assert edata.vattr_src is not None and edata.vattr_dst is not None
        dinv_src = edata.vattr_src[:, IN_DEGREE].pow(-0.5)
        dinv_src = dinv_src.masked_fill(torch.isinf(dinv_src), 0.0)
        dinv_dst = edata.vattr_dst[:, IN_DEGREE].pow(-0.5)
        dinv_dst = dinv_dst.masked_fill(torch.isinf(dinv_dst), 0.0)
        return (dinv_src * dinv_dst).view(-1, 1) * edata.src, None

    def _apply_vertex(self, h_dst: Tensor, x_dst: Tensor, agg: Tensor) -> Tensor:
        return agg if self.bias is None else agg + self.bias


# =============================================================================== GAT
class GATLayer(SAGALayer):
    """Graph attention (Velickovic et al., ICLR'18), equal to ``torch_geometric.nn.GATConv`` (dropout 0).

    apply_vertex_pre: ``h = [W x (heads * head_dim) | a_src (heads) | a_dst (heads)]`` with
    ``a_src = <W x, att_src>`` per head; apply_edge: message ``(W x)[src]`` as ``[E, heads, head_dim]``
    and logit ``leaky_relu(a_src[src] + a_dst[dst])`` ``[E, heads]``; ``softmax`` gather;
    apply_vertex: heads concatenated (``concat=True``, ``out_dim = heads * head_dim``) or averaged
    (``out_dim = head_dim``), ``+ bias``. Parameters ``lin.weight``, ``att_src``, ``att_dst``, ``bias``.

    Args:
        in_dim: input width.
        head_dim: channels per head (PyG's ``out_channels``).
        heads: number of attention heads.
        concat: concatenate the heads (else average them).
        negative_slope: the LeakyReLU slope of the logits.
        add_self_loops: whether one self-loop per vertex replaces the graph's own.
        bias: whether a bias is added.
    """

    def __init__(self, in_dim: int, head_dim: int, heads: int = 1, concat: bool = True,
                 negative_slope: float = 0.2, add_self_loops: bool = True, bias: bool = True):
        if not isinstance(heads, int) or heads < 1:
            raise GNNError(f"GATLayer heads must be a positive integer, got {heads!r}.")
        if not isinstance(head_dim, int) or head_dim < 1:
            raise GNNError(f"GATLayer head_dim must be a positive integer, got {head_dim!r}.")
        out_dim = heads * head_dim if concat else head_dim
        super().__init__(in_dim, out_dim, (heads, head_dim), "softmax", add_self_loops)
        self.heads = heads
        self.head_dim = head_dim
        self.concat = concat
        self.negative_slope = float(negative_slope)
        self.lin = nn.Linear(in_dim, heads * head_dim, bias=False)
        self.att_src = nn.Parameter(torch.empty(1, heads, head_dim))
        self.att_dst = nn.Parameter(torch.empty(1, heads, head_dim))
        for p in (self.lin.weight, self.att_src, self.att_dst):
            nn.init.xavier_uniform_(p)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_dim))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_pyg(cls, conv: Any) -> GATLayer:
        """A copy of a ``GATConv`` (weights, dtype, device).

        Raises:
            GNNError: the conv has edge features, a residual, separate source/destination weights
                (bipartite) or a non-zero dropout, which this layer does not implement.
        """
        _require(isinstance(conv, GATConv), f"GATLayer.from_pyg needs a GATConv, got {type(conv).__name__}.")
        _require(isinstance(conv.in_channels, int) and conv.lin is not None,
                 "GATLayer.from_pyg supports a GATConv with one in_channels (not bipartite) only.")
        _require(conv.edge_dim is None and not conv.residual,
                 "GATLayer.from_pyg supports a GATConv without edge_dim and without residual only.")
        _require(conv.dropout == 0.0, f"GATLayer.from_pyg needs a GATConv with dropout=0, got {conv.dropout}.")
        layer = cls(conv.in_channels, conv.out_channels, heads=conv.heads, concat=conv.concat,
                    negative_slope=conv.negative_slope, add_self_loops=conv.add_self_loops,
                    bias=conv.bias is not None)
        _copy_pyg_state(layer, conv)
        return layer

    def _apply_vertex_pre(self, x: Tensor) -> Tensor:
        hw = self.lin(x)
        heads_view = hw.view(-1, self.heads, self.head_dim)
        a_src = (heads_view * self.att_src).sum(dim=-1)
        a_dst = (heads_view * self.att_dst).sum(dim=-1)
        return torch.cat([hw, a_src, a_dst], dim=-1)

    def _scatter(self, h_src: Tensor, h_dst: Tensor, src: Tensor, dst: Tensor,
                 vattr_src: Tensor, vattr_dst: Tensor) -> EdgeData:
        width = self.heads * self.head_dim
        return EdgeData(h_src[:, :width].index_select(0, src), h_dst[:, width + self.heads:].index_select(0, dst),
                        src_extra=h_src[:, width:width + self.heads].index_select(0, src))

    def _apply_edge(self, edata: EdgeData) -> tuple[Tensor, Tensor | None]:
        assert edata.dst is not None and edata.src_extra is not None
        msg = edata.src.reshape(-1, self.heads, self.head_dim)
        logit = F.leaky_relu(edata.src_extra + edata.dst, self.negative_slope)
        return msg, logit

    def _apply_vertex(self, h_dst: Tensor, x_dst: Tensor, agg: Tensor) -> Tensor:
        out = agg.reshape(-1, self.heads * self.head_dim) if self.concat else agg.mean(dim=1)
        return out if self.bias is None else out + self.bias


# =============================================================================== GraphSAGE
class SAGELayer(SAGALayer):
    """GraphSAGE (Hamilton et al., NeurIPS'17), equal to ``torch_geometric.nn.SAGEConv``.

    Message ``x[src]``; gather ``aggr`` (``mean``, ``max`` or ``sum``); apply_vertex
    ``lin_l(agg) + lin_r(x_dst)``. Parameters ``lin_l.weight``, ``lin_l.bias``, ``lin_r.weight``.

    Args:
        in_dim, out_dim: feature widths.
        aggr: ``"mean"``, ``"max"`` or ``"sum"``.
        root_weight: whether ``lin_r(x_dst)`` is added.
        bias: whether ``lin_l`` has a bias.

    Raises:
        GNNError: ``aggr`` is not one of those.
    """

    def __init__(self, in_dim: int, out_dim: int, aggr: str = "mean", root_weight: bool = True, bias: bool = True):
        if aggr not in ("mean", "max", "sum"):
            raise GNNError(f"SAGELayer aggr must be 'mean', 'max' or 'sum', got {aggr!r}.")
        super().__init__(in_dim, out_dim, (in_dim,), aggr, False)
        self.lin_l = nn.Linear(in_dim, out_dim, bias=bias)
        self.lin_r = nn.Linear(in_dim, out_dim, bias=False) if root_weight else None

    @classmethod
    def from_pyg(cls, conv: Any) -> SAGELayer:
        """A copy of a ``SAGEConv`` (weights, dtype, device).

        Raises:
            GNNError: the conv projects or normalises, or its aggregation is not mean, max or sum.
        """
        _require(isinstance(conv, SAGEConv), f"SAGELayer.from_pyg needs a SAGEConv, got {type(conv).__name__}.")
        aggr = {"add": "sum"}.get(conv.aggr, conv.aggr) if isinstance(conv.aggr, str) else conv.aggr
        _require(aggr in ("mean", "max", "sum"),
                 f"SAGELayer.from_pyg supports aggr mean, max or sum, got {conv.aggr!r}.")
        _require(isinstance(conv.in_channels, int) and not conv.project and not conv.normalize,
                 "SAGELayer.from_pyg supports a SAGEConv with one in_channels, project=False, normalize=False only.")
        layer = cls(conv.in_channels, conv.out_channels, aggr=aggr, root_weight=conv.root_weight,
                    bias=conv.lin_l.bias is not None)
        _copy_pyg_state(layer, conv)
        return layer

    def _apply_vertex(self, h_dst: Tensor, x_dst: Tensor, agg: Tensor) -> Tensor:
        out = self.lin_l(agg)
        return out if self.lin_r is None else out + self.lin_r(x_dst)


# =============================================================================== GIN
def _module_width(module: nn.Module, attr: str, first: bool) -> int | None:
    """``in_features`` of the first / ``out_features`` of the last submodule that has it, else ``None``."""
    mods = [m for m in module.modules() if isinstance(getattr(m, attr, None), int)]
    if not mods:
        return None
    value = getattr(mods[0] if first else mods[-1], attr)
    return int(value)


class GINLayer(SAGALayer):
    """Graph isomorphism network (Xu et al., ICLR'19), equal to ``torch_geometric.nn.GINConv``.

    Message ``x[src]``; ``sum`` gather; apply_vertex ``nn(agg + (1 + eps) x_dst)``. Parameters
    ``nn.*`` and ``eps`` (a parameter with ``train_eps``, else a buffer), PyG's names.

    Args:
        nn: the per-vertex network ``[n, in_dim] -> [n, out_dim]`` (e.g. an MLP).
        eps: the initial epsilon.
        train_eps: whether epsilon is learned.
        in_dim, out_dim: feature widths; inferred from the first ``in_features`` / last
            ``out_features`` inside ``nn`` when omitted.

    Raises:
        GNNError: the widths are omitted and cannot be inferred from ``nn``.
    """

    def __init__(self, nn: torch.nn.Module, eps: float = 0.0, train_eps: bool = False,
                 in_dim: int | None = None, out_dim: int | None = None):
        in_dim = in_dim if in_dim is not None else _module_width(nn, "in_features", True)
        out_dim = out_dim if out_dim is not None else _module_width(nn, "out_features", False)
        if in_dim is None or out_dim is None:
            raise GNNError("GINLayer cannot infer its widths from nn; pass in_dim= and out_dim=.")
        super().__init__(in_dim, out_dim, (in_dim,), "sum", False)
        self.nn = nn
        self.initial_eps = float(eps)
        if train_eps:
            self.eps = torch.nn.Parameter(torch.full((1,), float(eps)))
        else:
            self.register_buffer("eps", torch.full((1,), float(eps)))

    @classmethod
    def from_pyg(cls, conv: Any) -> GINLayer:
        """A copy of a ``GINConv`` (a deep copy of its ``nn``, its ``eps``).

        Raises:
            GNNError: the conv is not a ``GINConv`` or its widths cannot be inferred from its ``nn``.
        """
        _require(isinstance(conv, GINConv), f"GINLayer.from_pyg needs a GINConv, got {type(conv).__name__}.")
        layer = cls(copy.deepcopy(conv.nn), eps=conv.initial_eps,
                    train_eps=isinstance(conv.eps, torch.nn.Parameter))
        _copy_pyg_state(layer, conv)
        return layer

    def _apply_vertex(self, h_dst: Tensor, x_dst: Tensor, agg: Tensor) -> Tensor:
        return self.nn(agg + (1 + self.eps) * x_dst)


# =============================================================================== gated GCN
class GatedGCNLayer(SAGALayer):
    """Residual gated graph convolution (Bresson & Laurent, 2017), equal to ``torch_geometric.nn.ResGatedGraphConv``.

    apply_vertex_pre: ``h = [K x | Q x | V x]`` (``lin_key``, ``lin_query``, ``lin_value``, each
    with a bias); apply_edge: ``sigmoid(K x_dst + Q x_src) * V x_src``; ``sum`` gather;
    apply_vertex: ``agg + lin_skip(x_dst) + bias``.

    Args:
        in_dim, out_dim: feature widths.
        root_weight: whether ``lin_skip(x_dst)`` is added.
        bias: whether a bias is added.
    """

    def __init__(self, in_dim: int, out_dim: int, root_weight: bool = True, bias: bool = True):
        super().__init__(in_dim, out_dim, (out_dim,), "sum", False)
        self.lin_key = nn.Linear(in_dim, out_dim)
        self.lin_query = nn.Linear(in_dim, out_dim)
        self.lin_value = nn.Linear(in_dim, out_dim)
        self.lin_skip = nn.Linear(in_dim, out_dim, bias=False) if root_weight else None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_dim))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_pyg(cls, conv: Any) -> GatedGCNLayer:
        """A copy of a ``ResGatedGraphConv`` (weights, dtype, device).

        Raises:
            GNNError: the conv has edge features, a gate other than the sigmoid, or two input widths.
        """
        _require(isinstance(conv, ResGatedGraphConv),
                 f"GatedGCNLayer.from_pyg needs a ResGatedGraphConv, got {type(conv).__name__}.")
        _require(conv.edge_dim is None and isinstance(conv.act, nn.Sigmoid) and isinstance(conv.in_channels, int),
                 "GatedGCNLayer.from_pyg supports a ResGatedGraphConv with one in_channels, a Sigmoid gate "
                 "and no edge_dim only.")
        layer = cls(conv.in_channels, conv.out_channels, root_weight=conv.root_weight, bias=conv.bias is not None)
        _copy_pyg_state(layer, conv)
        return layer

    def _apply_vertex_pre(self, x: Tensor) -> Tensor:
        return torch.cat([self.lin_key(x), self.lin_query(x), self.lin_value(x)], dim=-1)

    def _scatter(self, h_src: Tensor, h_dst: Tensor, src: Tensor, dst: Tensor,
                 vattr_src: Tensor, vattr_dst: Tensor) -> EdgeData:
        d = self.out_dim
        return EdgeData(h_src[:, d:].index_select(0, src), h_dst[:, :d].index_select(0, dst))

    def _apply_edge(self, edata: EdgeData) -> tuple[Tensor, Tensor | None]:
        assert edata.dst is not None
        d = self.out_dim
        return torch.sigmoid(edata.dst + edata.src[:, :d]) * edata.src[:, d:], None

    def _apply_vertex(self, h_dst: Tensor, x_dst: Tensor, agg: Tensor) -> Tensor:
        out = agg if self.lin_skip is None else agg + self.lin_skip(x_dst)
        return out if self.bias is None else out + self.bias
