"""The tracer split's ``split_policy``: cut an exported graph into exactly the plan's segments.

``torch.distributed.pipelining.pipeline(model, mb_args, split_policy=policy)`` exports the model
(``torch.export``), hands ``exported_program.module()`` (one flat ``GraphModule``, parameters as
``get_attr`` nodes, every op with its ``nn_module_stack`` meta) to ``policy`` and then cuts the
returned graph at every ``torch.ops.pippy._pipe_split`` node (``Pipe._from_traced``:
``split_callback`` starts a new stage at each such node), so a policy decides the stages
completely. :func:`segment_split_policy` returns one that

1. **inlines no-grad and disabled-autocast higher-order ops.** ``torch.export`` wraps code that
   runs under ``torch.no_grad()`` (Hugging Face rotary embeddings, ``@torch.no_grad`` helpers) in
   ``torch.ops.higher_order.wrap_with_set_grad_enabled(False, body, *args)`` and code under
   ``torch.autocast(enabled=False)`` in ``wrap_with_autocast``; ``pipeline()``'s submodule
   outlining cannot call such a node's body (it loses the body's arguments). The body's nodes are
   copied in place of the call; every output of a no-grad body goes through ``aten.detach``, which
   is exactly what ``no_grad`` gives the caller (values equal, no gradient flows into the body);
2. **assigns every op to a segment** by the planner's node -> layer attribution
   (:func:`engine.graph.layering.fx_layers`, the one :func:`engine.graph.capture.capture` uses)
   and the plan's ``segments[i]["layers"]``; ops of layers the plan does not list take their
   producers' (else consumers') segment. The assignment is then made monotone along data
   dependencies: an op never sits in an earlier segment than any of its inputs (it moves later);
3. **stably reorders** the graph by segment (a topological order, since the assignment is
   monotone) and inserts one ``_pipe_split`` before the first op of segments ``1 .. S-1``, so
   ``pipeline()`` produces exactly ``S`` stages.

Source: torch.distributed.pipelining (``pipeline``, ``_IR.Pipe._from_traced``, ``pipe_split``);
torch.export higher-order ops (``torch/_higher_order_ops/wrap.py``).
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable, Sequence

import torch
from torch import fx, nn
from torch.distributed.pipelining._IR import aten_pipe_split_alias

from engine.graph.layering import fx_layers, is_assertion
from runtime.stages.errors import StageSplitError

__all__ = ["inline_wrapped_regions", "segment_of_nodes", "segment_split_policy"]

log = logging.getLogger(__name__)


def _hop(name: str):
    return getattr(torch.ops.higher_order, name, None)


def inline_wrapped_regions(gm: fx.GraphModule) -> int:
    """Inline ``wrap_with_set_grad_enabled`` and disabled ``wrap_with_autocast`` calls of ``gm``
    (recursively), see the module docstring; returns how many calls were inlined.

    The inlined nodes carry the call's ``nn_module_stack`` (so they belong to the layer the
    capture attributed the whole call to). Enabled autocast regions and other higher-order ops
    stay as they are.
    """
    set_grad, autocast = _hop("wrap_with_set_grad_enabled"), _hop("wrap_with_autocast")
    n_inlined = 0
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        if set_grad is not None and node.target is set_grad:
            enabled, body_node, *args = node.args
            detach = not enabled
        elif autocast is not None and node.target is autocast and len(node.args) >= 5 and not node.args[2]:
            body_node, args, detach = node.args[4], list(node.args[5:]), False
        else:
            continue
        if not (isinstance(body_node, fx.Node) and body_node.op == "get_attr"):
            continue
        body = getattr(gm, str(body_node.target))
        if not isinstance(body, fx.GraphModule):
            continue
        n_inlined += inline_wrapped_regions(body)
        if _inline_call(gm, node, body_node, body, list(args), detach):
            n_inlined += 1
    if n_inlined:
        g.lint()
        gm.recompile()
    return n_inlined


def _inline_call(gm: fx.GraphModule, node: fx.Node, body_node: fx.Node, body: fx.GraphModule,
                 args: list, detach: bool) -> bool:
    """Copy ``body``'s nodes in place of the call ``node`` (see :func:`inline_wrapped_regions`)."""
    g = gm.graph
    placeholders = [b for b in body.graph.nodes if b.op == "placeholder"]
    if len(placeholders) != len(args):
        return False
    stack = node.meta.get("nn_module_stack")
    env: dict[fx.Node, Any] = dict(zip(placeholders, args))

    def lookup(x: fx.Node) -> Any:
        return env[x]

    def detached(v: Any) -> Any:
        if detach and isinstance(v, fx.Node) and isinstance(v.meta.get("val"), torch.Tensor):
            d = g.call_function(torch.ops.aten.detach.default, (v,))
            d.meta = {"val": v.meta["val"], **({"nn_module_stack": dict(stack)} if stack else {})}
            return d
        return v

    outs: Any = None
    with g.inserting_before(node):
        for b in body.graph.nodes:
            if b.op == "placeholder":
                continue
            if b.op == "output":
                outs = fx.node.map_aggregate(fx.node.map_arg(b.args[0], lookup), detached)
                break
            if b.op == "get_attr":   # a constant of the body: hoist it onto gm
                attr = _unique_attr(gm, str(b.target))
                setattr(gm, attr, getattr(body, str(b.target)))
                new = g.get_attr(attr)
            else:
                new = g.node_copy(b, lookup)
            new.meta = dict(b.meta)
            if stack is not None:
                new.meta["nn_module_stack"] = dict(stack)
            env[b] = new
    for user in list(node.users):
        if (user.op == "call_function" and user.target is operator.getitem and isinstance(outs, (list, tuple))
                and isinstance(user.args[1], int)):
            user.replace_all_uses_with(outs[user.args[1]])
            g.erase_node(user)
    if node.users:
        node.replace_all_uses_with(outs)
    g.erase_node(node)
    if not body_node.users:
        g.erase_node(body_node)
        if hasattr(gm, str(body_node.target)):
            delattr(gm, str(body_node.target))
    return True


def _unique_attr(gm: nn.Module, base: str) -> str:
    name, k = base.replace(".", "_"), 0
    while hasattr(gm, name):
        k += 1
        name = f"{base.replace('.', '_')}_{k}"
    return name


def segment_of_nodes(graph: fx.Graph, model: nn.Module, segment_layers: Sequence[Sequence[str]]) -> dict[fx.Node, int]:
    """Segment index of every computing node of an exported graph (see the module docstring).

    Args:
        graph: ``ExportedProgram.module().graph`` (after :func:`inline_wrapped_regions`).
        model: the exported model (its module tree gives the layers).
        segment_layers: ``segment_layers[i]`` = the layer names of segment ``i`` (plan order).

    Returns:
        ``call_function`` / ``call_module`` node -> segment, monotone along data dependencies.
    """
    seg_of_layer: dict[str, int] = {}
    for i, layers in enumerate(segment_layers):
        for lay in layers:
            seg_of_layer.setdefault(str(lay), i)
    layer = fx_layers(graph, model)
    nodes = [n for n in graph.nodes if n.op in ("call_function", "call_module")]
    seg: dict[fx.Node, int | None] = {n: seg_of_layer.get(layer[n]) if n in layer else None for n in nodes}
    unknown = sorted({layer[n] for n in nodes if n in layer and seg[n] is None})
    if unknown:
        log.debug("layers not in the plan, placed with their neighbours: %s", unknown)
    for n in nodes:                        # producers' segment
        if seg[n] is None:
            cands = [s for a in n.all_input_nodes if (s := seg.get(a)) is not None]
            if cands:
                seg[n] = max(cands)
    for n in reversed(nodes):              # else consumers' segment
        if seg[n] is None:
            cands = [s for u in n.users if (s := seg.get(u)) is not None]
            seg[n] = min(cands) if cands else 0
    out: dict[fx.Node, int] = {}
    for n in nodes:                        # monotone: never before an input
        s = seg[n]
        assert s is not None
        out[n] = max([s] + [out[a] for a in n.all_input_nodes if a in out])
    return out


def segment_split_policy(model: nn.Module, segment_layers: Sequence[Sequence[str]],
                         report: dict | None = None) -> Callable[[fx.GraphModule], fx.GraphModule]:
    """A ``split_policy`` for ``torch.distributed.pipelining.pipeline`` that cuts the exported graph
    into ``len(segment_layers)`` stages at the plan's layers (see the module docstring).

    Args:
        model: the model ``pipeline()`` exports.
        segment_layers: per segment, its layer names.
        report: if given, filled with ``inlined`` (number of inlined regions) and ``segment``
            (node name -> segment) for inspection.

    Raises (from the policy):
        StageSplitError: a segment gets no op (its layers compute nothing in the traced forward).
    """
    S = len(segment_layers)

    def policy(gm: fx.GraphModule) -> fx.GraphModule:
        g = gm.graph
        for n in list(g.nodes):   # export's input guard: no users, checks nothing we rely on
            if n.op == "call_module" and str(n.target).startswith("_guards_fn") and not n.users:
                g.erase_node(n)
        inlined = inline_wrapped_regions(gm)
        seg = segment_of_nodes(g, model, segment_layers)
        for n in g.nodes:         # assertions follow the value they check
            if n in seg and n.op == "call_function" and is_assertion(n):
                seg[n] = max([seg[a] for a in n.all_input_nodes if a in seg], default=seg[n])
        empty = [i for i in range(S) if i not in set(seg.values())]
        if empty:
            raise StageSplitError(
                f"segment {empty[0]} (layers {list(segment_layers[empty[0]])}) gets no op of the traced forward, "
                "so it cannot be a pipeline stage; plan with fewer devices or put those layers with a neighbour")
        head = [n for n in g.nodes if n.op in ("placeholder", "get_attr")]
        output = next(n for n in g.nodes if n.op == "output")
        body = sorted(seg, key=lambda n: seg[n])   # stable: original (topological) order within a segment
        for n in head + body:
            output.prepend(n)
        for i in range(1, S):
            first = next(n for n in body if seg[n] == i)
            with g.inserting_before(first):
                g.call_function(aten_pipe_split_alias, ())
        g.lint()
        gm.recompile()
        if report is not None:
            report["inlined"] = inlined
            report["segment"] = {n.name: s for n, s in seg.items()}
        return gm

    return policy
