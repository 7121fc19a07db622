"""GNN models: a stack of SAGA-NN layers with ReLU between (docs/gnn.md, issue 19).

``build_gnn(GNNConfig(kind, in_dim, hidden, out_dim, layers, heads))`` returns a :class:`GNNModel`
whose ``layers`` are :class:`engine.gnn.saga.SAGALayer` s: ``in_dim -> hidden -> ... -> hidden ->
out_dim`` (``layers`` of them), ``torch.relu`` after every layer but the last. The kinds and their
layers (the models of the GNN characterization study):

- ``gcn``: :class:`GCNLayer` (``GCNConv``).
- ``gat``: :class:`GATLayer` (``GATConv``); hidden layers have ``heads`` heads of ``hidden // heads``
  channels concatenated (width ``hidden``); the last layer has ``heads`` heads of ``out_dim``
  channels AVERAGED (``concat=False``), as in the GAT paper's output layer.
- ``sage``: :class:`SAGELayer` (``SAGEConv``, mean aggregation).
- ``gin``: :class:`GINLayer` (``GINConv``) with the MLP ``Linear(d_in, d_out), ReLU, Linear(d_out, d_out)``.
- ``gated-gcn``: :class:`GatedGCNLayer` (``ResGatedGraphConv``).

Initialisation follows the global torch RNG: call ``torch.manual_seed`` before ``build_gnn`` for a
reproducible model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from engine.errors import GNNError
from engine.gnn.saga import GatedGCNLayer, GATLayer, GCNLayer, GINLayer, SAGALayer, SAGELayer

GNN_KINDS = ("gcn", "gat", "sage", "gin", "gated-gcn")
"""The model kinds :func:`build_gnn` builds."""


@dataclass(frozen=True)
class GNNConfig:
    """What GNN to build.

    Attributes:
        kind: one of :data:`GNN_KINDS`.
        in_dim: input feature width.
        hidden: width of every hidden layer's output.
        out_dim: output width (e.g. the number of classes).
        layers: number of graph layers (>= 1; with 1 the layer maps ``in_dim -> out_dim``).
        heads: attention heads, ``gat`` only (1 for the other kinds); must divide ``hidden``.

    Raises:
        GNNError: (on construction) any field is out of range, in one sentence.
    """

    kind: str
    in_dim: int
    hidden: int
    out_dim: int
    layers: int = 2
    heads: int = 1

    def __post_init__(self) -> None:
        if self.kind not in GNN_KINDS:
            raise GNNError(f"Unknown GNN kind {self.kind!r}; use one of {', '.join(GNN_KINDS)}.")
        for name in ("in_dim", "hidden", "out_dim", "layers", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise GNNError(f"GNNConfig.{name} must be a positive integer, got {value!r}.")
        if self.kind != "gat" and self.heads != 1:
            raise GNNError(f"GNNConfig.heads is for kind 'gat' only; set heads=1 for kind {self.kind!r}.")
        if self.kind == "gat" and self.hidden % self.heads:
            raise GNNError(f"GNNConfig.hidden ({self.hidden}) must be a multiple of heads ({self.heads}) for 'gat'.")

    def widths(self) -> list[tuple[int, int]]:
        """``(d_in, d_out)`` of every layer, first to last."""
        dims = [self.in_dim] + [self.hidden] * (self.layers - 1) + [self.out_dim]
        return list(zip(dims[:-1], dims[1:]))


class GNNModel(nn.Module):
    """A stack of SAGA-NN layers with ReLU between them (none after the last).

    Attributes:
        config: the :class:`GNNConfig` it was built from.
        layers: the :class:`SAGALayer` s, first to last.
    """

    def __init__(self, config: GNNConfig, layers: list[SAGALayer]):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        """Full-graph forward: ``x [N, in_dim]``, ``edge_index [2, E]`` -> ``[N, out_dim]``.

        Raises:
            GNNError: ``x`` or ``edge_index`` is malformed (see :meth:`SAGALayer.forward`).
        """
        last = len(self.layers) - 1
        n = x.size(0)
        prepared: dict[bool, tuple[Tensor, Tensor]] = {}  # self_loops -> (edges, vertex attributes), once per graph
        for i, module in enumerate(self.layers):
            layer: SAGALayer = module  # type: ignore[assignment]
            if layer.self_loops not in prepared:
                edges = layer.prepare_edges(edge_index, n)
                prepared[layer.self_loops] = (edges, layer.vertex_attrs(edges, n, dtype=x.dtype))
            x = layer(x, edge_index, prepared[layer.self_loops])
            if i < last:
                x = torch.relu(x)
        return x

    def parameter_bytes(self) -> int:
        """Bytes held by the parameters (``numel * element_size``; buffers such as GIN's fixed eps excluded)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())


def _layer(config: GNNConfig, index: int, d_in: int, d_out: int) -> SAGALayer:
    last = index == config.layers - 1
    if config.kind == "gcn":
        return GCNLayer(d_in, d_out)
    if config.kind == "gat":
        if last:
            return GATLayer(d_in, d_out, heads=config.heads, concat=False)
        return GATLayer(d_in, d_out // config.heads, heads=config.heads, concat=True)
    if config.kind == "sage":
        return SAGELayer(d_in, d_out, aggr="mean")
    if config.kind == "gin":
        mlp = nn.Sequential(nn.Linear(d_in, d_out), nn.ReLU(), nn.Linear(d_out, d_out))
        return GINLayer(mlp, in_dim=d_in, out_dim=d_out)
    return GatedGCNLayer(d_in, d_out)


def build_gnn(config: GNNConfig) -> GNNModel:
    """Build the model ``config`` describes (initialised from the global torch RNG).

    Raises:
        GNNError: ``config`` is not a :class:`GNNConfig`.
    """
    if not isinstance(config, GNNConfig):
        raise GNNError(f"build_gnn needs a GNNConfig, got {type(config).__name__}.")
    return GNNModel(config, [_layer(config, i, a, b) for i, (a, b) in enumerate(config.widths())])
