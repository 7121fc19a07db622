"""Megatron-LM's ``f`` and ``g``: where a replicated activation enters or leaves tensor-parallel work.

A module whose parameters are sharded over the ``tp`` ranks of a group, computing on a replicated
input, produces a partial result on each rank (row-parallel) and receives only a partial gradient
of its input. ``f`` (:class:`CopyToTensorParallel`) marks the input: identity forward, the gradient
summed over the group in the backward. ``g`` (:class:`ReduceFromTensorParallel`) marks the output:
the partial results summed over the group in the forward, identity backward. DTensor's
``ColwiseParallel``/``RowwiseParallel`` do this for ``nn.Linear``; these serve code that computes on
local shards itself (MoE experts' 3-D weights, :mod:`runtime.moe_tensor_parallel`; T5's position
bias sliced per head, :mod:`runtime.stages.seq2seq_split`). Shapes are unchanged; ``group`` is a
``torch.distributed`` process group.

Source: Shoeybi et al., "Megatron-LM" (2019), section 3, figure 3 (the ``f`` and ``g`` operators).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CopyToTensorParallel", "ReduceFromTensorParallel"]


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's ``f``: identity forward; backward all-reduces (sums) the gradient over ``group``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's ``g``: forward all-reduces (sums) the partial outputs over ``group``; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None
