"""Node -> layer attribution of a traced ``torch.fx`` graph, shared by the capture and the stage split.

The planner (:func:`engine.graph.capture.capture`) cuts a model into segments of *layers*, and the
runtime (``runtime.stages``) cuts the exported graph of the same model at the same layers, so both
must attribute every op to the same layer. The rules (also in :mod:`engine.graph.capture`):

* an op's module is the innermost entry of its FX ``nn_module_stack`` meta;
* its ``layer`` is the outermost module on that path that is an element of an ``nn.ModuleList``
  or ``nn.Sequential`` (``"transformer.h.3"``, ``"model.layers.3"``); otherwise the shortest
  prefix of the path that is not a container or an ancestor of one (``"transformer.wte"``,
  ``"lm_head"``, ``"model.rotary_emb"``);
* ops that run directly in a backbone module (no module layer: position ids, attention masks)
  are attached to a neighbour: first the latest layer among their producers, else the earliest
  layer among their consumers; dead ops take the layer of the preceding op in program order
  (else the following one, else :data:`ROOT_LAYER`).

Source: ``torch.export`` (``nn_module_stack`` node meta), PyTorch docs "torch.export".
"""

from __future__ import annotations

import re
from typing import Callable, Hashable, Iterable, Mapping, Sequence, TypeVar

import torch.fx
from torch import nn

from .flops import op_name

__all__ = ["ROOT_LAYER", "Layering", "module_of", "attach_layers", "fx_layers", "is_assertion"]

ROOT_LAYER = "<root>"
CONTAINERS = (nn.ModuleList, nn.Sequential)

H = TypeVar("H", bound=Hashable)


class Layering:
    """Maps module paths of ``model`` to layer names (see the module docstring).

    Args:
        model: the traced ``nn.Module`` (only its module tree is read; meta tensors are fine).
    """

    def __init__(self, model: nn.Module):
        self.mods = dict(model.named_modules(remove_duplicate=False))
        self.backbone: set[str] = set()
        for path, m in self.mods.items():
            if isinstance(m, CONTAINERS):
                parts = path.split(".") if path else []
                self.backbone.add(path)
                self.backbone.update(".".join(parts[:i]) for i in range(len(parts)))
        self._cache: dict[str, str | None] = {}

    def norm(self, p: str) -> str:
        """A module path as ``named_modules`` spells it (``L['self'].h[3]`` -> ``h.3``)."""
        if p in self.mods:
            return p
        q = re.sub(r"@\d+$", "", p)
        q = re.sub(r"^L\['self'\]\.?|^L__self__\.?", "", q)
        q = re.sub(r"\[(\d+)\]", r".\1", q)
        q = re.sub(r"\['([^']+)'\]", r".\1", q)
        return q.replace("._modules.", ".").strip(".")

    def layer_of(self, path: str) -> str | None:
        """The layer of module ``path``; ``None`` for the root and backbone modules."""
        if path in self._cache:
            return self._cache[path]
        res = None
        if path:
            parts = path.split(".")
            prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
            for pre in prefixes:
                parent = pre.rsplit(".", 1)[0] if "." in pre else ""
                if isinstance(self.mods.get(parent), CONTAINERS):
                    res = pre
                    break
            else:
                res = next((pre for pre in prefixes if pre not in self.backbone), None)
        self._cache[path] = res
        return res


def module_of(node: torch.fx.Node, lay: Layering, model: nn.Module) -> tuple[str, str]:
    """``(module path, module class name)`` of an FX node: the innermost ``nn_module_stack``
    entry, or ``("", type(model).__name__)`` for an op of the model's top-level code."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", type(model).__name__
    path, typ = list(stack.values())[-1]
    path = lay.norm(str(path))
    mod = lay.mods.get(path)
    if mod is not None:
        return path, type(mod).__name__
    tname = typ.__name__ if isinstance(typ, type) else str(typ).rsplit(".", 1)[-1]
    return path, tname


def attach_layers(ops: Sequence[H], module_layer: Mapping[H, str | None],
                  preds: Callable[[H], Iterable[H]], succs: Callable[[H], Iterable[H]]) -> dict[H, str]:
    """Give every op a layer: its module layer, else a neighbour's (see the module docstring).

    Args:
        ops: the ops in program (topological) order.
        module_layer: op -> layer of its module (``None``: the op has no module layer).
        preds, succs: an op's activation producers / consumers (other nodes are ignored).

    Returns:
        op -> layer name for every op in ``ops``.
    """
    pos = {n: i for i, n in enumerate(ops)}
    layer: dict[H, str | None] = {n: module_layer.get(n) for n in ops}
    first: dict[str, int] = {}
    for n in ops:
        ln = layer[n]
        if ln is not None:
            first.setdefault(ln, pos[n])
    # forward: latest producer layer
    for n in ops:
        if layer[n] is None:
            cands = [lp for p in preds(n) if (lp := layer.get(p)) is not None]
            if cands:
                layer[n] = max(cands, key=lambda x: first.get(x, 1 << 60))
    # backward: earliest consumer layer
    for n in reversed(ops):
        if layer[n] is None:
            cands = [lc for c in succs(n) if (lc := layer.get(c)) is not None]
            if cands:
                layer[n] = min(cands, key=lambda x: first.get(x, 1 << 60))
    # dead code (no path to any layered op): the layer of the neighbour in program order
    prev = None
    for n in ops:
        if layer[n] is None:
            layer[n] = prev
        prev = layer[n] or prev
    nxt = None
    for n in reversed(ops):
        if layer[n] is None:
            layer[n] = nxt or ROOT_LAYER
        nxt = layer[n]
    return {n: ln for n, ln in layer.items() if ln is not None}


def is_assertion(node: torch.fx.Node) -> bool:
    """An op that computes nothing (``aten._assert_tensor_metadata``, ``_assert_scalar``,
    ``sym_constrain_range*``); the capture drops these."""
    return op_name(node.target).startswith(("_assert", "sym_constrain"))


def fx_layers(graph: torch.fx.Graph, model: nn.Module) -> dict[torch.fx.Node, str]:
    """Layer of every ``call_function`` op of an exported graph (``ExportedProgram.module()``),
    attributed exactly as :func:`engine.graph.capture.capture` does.

    Assertion ops (``aten._assert_tensor_metadata``, ``_assert_scalar``, ``sym_constrain_range*``)
    are left out, as the capture drops them; placeholders, ``get_attr`` and ``call_module`` nodes
    are not ops.

    Returns:
        node -> layer name.
    """
    lay = Layering(model)
    ops = [n for n in graph.nodes if n.op == "call_function" and not is_assertion(n)]
    opset = set(ops)
    module_layer = {n: lay.layer_of(module_of(n, lay, model)[0]) for n in ops}
    return attach_layers(ops, module_layer,
                         lambda n: [a for a in n.all_input_nodes if a in opset],
                         lambda n: [u for u in n.users if u in opset])
