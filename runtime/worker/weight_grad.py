"""A split backward's weight half (``W`` of ZB-H1) in one autograd pass.

``torch.distributed.pipelining``'s ``stage_backward_weight`` runs one ``torch.autograd.grad`` per
parameter group that ``stage_backward_input`` found. Each call is a new graph task, and
``torch.utils.checkpoint`` (non-reentrant) recomputes a checkpointed region once per graph task
that unpacks it. On a segment under full recomputation ``W`` therefore recomputed the segment's
forward once per group: 12 times for four checkpointed two-linear blocks, measured in
``tests/runtime/test_weight_grad.py``. :func:`backward_weight` does the same work in a single
``torch.autograd.grad`` over every group's intermediates, so the region is recomputed once.

The worker uses it only on segments with recomputation (``runtime.worker.compute``): one merged
pass also runs, once more, the nodes that lie between two groups' intermediates (their result
is discarded by the clamp below), which on an MoE layer are all-to-alls; torch's per-group passes
run only each group's own nodes.

Correctness is the same argument as torch's: each intermediate's incoming gradient is replaced
by the one ``I`` saved for it (a pre-hook), so a gradient that reaches an intermediate through a
descendant intermediate is not counted twice; each weight then receives the sum over its paths.

Source: Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), section 2 (the B/W split);
``torch/distributed/pipelining/_backward.py`` (``stage_backward_input``, ``stage_backward_weight``).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc
from torch.nn import Parameter

__all__ = ["backward_weight"]


def backward_weight(weights: Iterator[Parameter], param_groups: list[dict[str, Any]]) -> None:
    """Accumulate into each weight's ``.grad`` its gradient from the ``param_groups`` of
    ``stage_backward_input`` (each: ``params`` (their gradient edges), ``intermediates`` (autograd
    nodes) and ``grads`` (the gradients ``I`` computed for each intermediate's outputs)), with one
    ``torch.autograd.grad`` call. The groups' entries are consumed (released) as torch's
    ``stage_backward_weight`` does. Gradients have each weight's shape and dtype.
    """
    by_edge = {}
    for w in weights:
        by_edge[_get_grad_fn_or_grad_acc(w)] = w
    edges: list[GradientEdge] = []
    grad_outputs: list[torch.Tensor] = []
    targets: list = []
    hooks = []
    try:
        for group in param_groups:
            for saved, node in zip(group.pop("grads"), group.pop("intermediates"), strict=True):
                hooks.append(node.register_prehook(lambda _incoming, s=saved: s))
                for i, g in enumerate(saved):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grad_outputs.append(g)
            targets.extend(t for t in group["params"] if t not in targets)
        if not edges or not targets:
            return
        grads = torch.autograd.grad(edges, tuple(GradientEdge(t, 0) for t in targets), grad_outputs=grad_outputs,
                                    allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    for t, g in zip(targets, grads):
        if g is None:
            continue
        w = by_edge[t]
        if w.grad is None:
            w.grad = g
        else:
            w.grad += g
