"""OpGraph: the operator graph produced by :func:`engine.graph.capture`.

An :class:`OpGraph` is a ``networkx.DiGraph`` with one node per aten op (FX ``call_function``
node of the ``torch.export`` graph), one node per tensor user input (``placeholder``) and one
``output`` node. Parameters and buffers are not nodes: they are folded into the ops that consume
them (``param_names`` / ``param_bytes``). Node ids are the FX node names (str).

Node attributes (all JSON-able, see :mod:`engine.graph.capture` for how they are computed):
``name, op, target, kind, module_path, module_type, layer, layer_index, shapes, dtypes,
output_bytes, input_bytes, flops, param_bytes, param_names, saved_bytes, saved, input_only,
args, kwargs``.
Edge attribute: ``bytes`` — bytes of the tensor flowing along the edge.
Graph attributes (``g.graph``): ``model_name, batch_size, seq_len, dtype, num_params,
param_bytes, buffer_bytes, tied_params, layers``.

Because every attribute is JSON-able, ``networkx.node_link_data(g)`` serialises the graph.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import networkx as nx

__all__ = ["OpGraph", "LayerSummary"]


@dataclass
class LayerSummary:
    """Aggregates of one layer (pipeline-cut unit) of an :class:`OpGraph`.

    Attributes:
        name: layer name, e.g. ``"transformer.h.3"``.
        index: position in ``OpGraph.layers()``.
        ops: node ids (``call_function`` nodes only) of the layer, in graph order.
        flops: forward FLOPs of the layer (float).
        param_bytes: bytes of parameters first used in this layer (tied weights counted once,
            in the layer that uses them first).
        saved_bytes: activation bytes the layer's ops keep for backward; a tensor saved by
            several ops of the layer (or saved through views) is counted once, at the size of
            the op output that owns its storage.
        output_bytes: bytes of the tensors produced in this layer that are consumed outside it
            (by a later layer or the graph output).
        boundary_bytes: bytes that a pipeline cut after this layer must send: the tensors
            produced in ``layers[:index+1]`` (including graph inputs) that are consumed in
            ``layers[index+1:]``, each tensor once.
        boundary_tensors: those tensors as ``{"shape": [...], "dtype": "float32"}``, ordered:
            parameter-dependent activations first, largest first (so ``boundary_tensors[0]`` is
            the hidden state of a transformer), then tensors computed from graph inputs only
            (HF attention masks, rotary cos/sin, position ids).
        boundary_nodes: the producing node id of each boundary tensor (same order); check
            ``g.nodes[n]["input_only"]`` to see which ones (attention masks, rotary tables)
            depend only on graph inputs and could be recomputed instead of sent.
        activation_bytes: bytes of all non-view op outputs of the layer (an upper bound on the
            layer's transient activation memory).
    """

    name: str
    index: int
    ops: list[str]
    flops: float
    param_bytes: int
    saved_bytes: int
    output_bytes: int
    boundary_bytes: int
    boundary_tensors: list[dict[str, Any]]
    boundary_nodes: list[str] = field(default_factory=list)
    activation_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of all fields."""
        return asdict(self)


class OpGraph(nx.DiGraph):
    """Operator graph of one model forward pass (see module docstring for attributes)."""

    def layers(self) -> list[str]:
        """Layer names in topological order (the order pipeline stages take them)."""
        return list(self.graph.get("layers", []))

    def ops_in_layer(self, layer: str) -> list[str]:
        """Node ids of the ``call_function`` nodes of ``layer``, in graph (topological) order.

        Raises:
            KeyError: ``layer`` is not one of :meth:`layers`.
        """
        if layer not in self.graph.get("layers", []):
            raise KeyError(f"unknown layer {layer!r}; layers are {self.layers()[:8]}...")
        return [n for n, d in self.nodes(data=True)
                if d.get("op") == "call_function" and d.get("layer") == layer]

    def op_nodes(self) -> list[str]:
        """All ``call_function`` node ids in graph order."""
        return [n for n, d in self.nodes(data=True) if d.get("op") == "call_function"]

    def total_flops(self) -> float:
        """Forward FLOPs of the whole graph (sum of node ``flops``)."""
        return float(sum(d.get("flops", 0.0) for _, d in self.nodes(data=True)))

    def summary(self) -> dict[str, Any]:
        """JSON-able overview: model, sizes (bytes), FLOPs, op and layer counts, op kinds."""
        kinds: dict[str, int] = {}
        for _, d in self.nodes(data=True):
            if d.get("op") == "call_function":
                kinds[d.get("kind", "?")] = kinds.get(d.get("kind", "?"), 0) + 1
        ls = self.layer_summaries()
        g = self.graph
        return {
            "model_name": g.get("model_name"), "batch_size": g.get("batch_size"),
            "seq_len": g.get("seq_len"), "dtype": g.get("dtype"),
            "num_params": g.get("num_params"), "param_bytes": g.get("param_bytes"),
            "buffer_bytes": g.get("buffer_bytes", 0),
            "num_ops": sum(kinds.values()), "num_nodes": self.number_of_nodes(),
            "num_edges": self.number_of_edges(), "num_layers": len(ls),
            "total_flops": self.total_flops(),
            "saved_bytes": int(sum(x.saved_bytes for x in ls)),
            "max_boundary_bytes": int(max((x.boundary_bytes for x in ls[:-1]), default=0)),
            "op_kinds": dict(sorted(kinds.items())),
        }

    def layer_summaries(self) -> list[LayerSummary]:
        """One :class:`LayerSummary` per layer, in :meth:`layers` order."""
        layers = self.layers()
        n_layers = len(layers)
        ops: list[list[str]] = [[] for _ in layers]
        flops = [0.0] * n_layers
        pbytes = [0] * n_layers
        act = [0] * n_layers
        saved_roots: list[dict[str, int]] = [{} for _ in layers]
        for n, d in self.nodes(data=True):
            li = d.get("layer_index", -1)
            if li < 0 or li >= n_layers or d.get("op") != "call_function":
                continue
            ops[li].append(n)
            flops[li] += d.get("flops", 0.0)
            pbytes[li] += d.get("param_bytes", 0)
            if d.get("kind") != "view":
                act[li] += d.get("output_bytes", 0)
            for root in d.get("saved", []):
                saved_roots[li][root] = self._saved_size(root, n)

        # boundary: tensor t (producer p, element e) crosses cuts i with lp <= i < max consumer
        crossing: list[list[tuple[str, Any]]] = [[] for _ in layers]
        out_bytes = [0] * n_layers
        for p, pd in self.nodes(data=True):
            lp = pd.get("layer_index", -1)
            if lp < 0:
                continue
            far: dict[Any, int] = {}
            for c in self.successors(p):
                cd = self.nodes[c]
                lc = cd.get("layer_index", -1)
                if lc <= lp:
                    continue
                key = cd.get("getitem_index") if cd.get("target") == "operator.getitem" else None
                far[key] = max(far.get(key, -1), lc)
            whole = far.get(None, -1)
            for i in range(lp, max(far.values(), default=lp)):
                if i < whole:  # the whole output crosses: do not count its elements twice
                    crossing[i].append((p, None))
                else:
                    crossing[i].extend((p, k) for k, v in far.items() if k is not None and i < v)
            if far:
                out_bytes[lp] += (self._tensor_bytes(p, None) if None in far
                                  else sum(self._tensor_bytes(p, k) for k in far))
            elif pd.get("op") != "output" and any(self.nodes[c].get("op") == "output"
                                                  for c in self.successors(p)):
                out_bytes[lp] += pd.get("output_bytes", 0)

        result = []
        for i, name in enumerate(layers):
            items = [(bool(self.nodes[p].get("input_only")), -desc["bytes"], k, p, desc)
                     for k, (p, key) in enumerate(crossing[i])
                     for desc in self._tensor_descs(p, key)]
            items.sort(key=lambda x: x[:3])
            tensors = [{"shape": d["shape"], "dtype": d["dtype"]} for *_, d in items]
            nodes_ = [p for *_, p, _d in items]
            total = sum(d["bytes"] for *_, d in items)
            result.append(LayerSummary(
                name=name, index=i, ops=ops[i], flops=flops[i], param_bytes=pbytes[i],
                saved_bytes=int(sum(saved_roots[i].values())), output_bytes=out_bytes[i],
                boundary_bytes=total, boundary_tensors=tensors, boundary_nodes=nodes_,
                activation_bytes=act[i]))
        return result

    # -- helpers ---------------------------------------------------------------------------
    def _saved_size(self, root: str, op: str) -> int:
        if root == op or root not in self:
            return int(self.nodes[op].get("saved_self_bytes", 0))
        return int(self.nodes[root].get("output_bytes", 0))

    def _tensor_descs(self, p: str, key: Any) -> list[dict[str, Any]]:
        d = self.nodes[p]
        shapes, dtypes = d.get("shapes", []), d.get("dtypes", [])
        sizes = d.get("output_sizes") or [0] * len(shapes)
        items = list(zip(shapes, dtypes, sizes))
        if key is not None and isinstance(key, int) and 0 <= key < len(items):
            items = [items[key]]
        return [{"shape": s, "dtype": t, "bytes": b} for s, t, b in items]

    def _tensor_bytes(self, p: str, key: Any) -> int:
        return sum(x["bytes"] for x in self._tensor_descs(p, key))
