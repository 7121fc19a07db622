"""CoCoNet's ``chunked-overlap``: a row-parallel matmul pipelined with the all-reduce of its output.

In Megatron-style tensor parallelism (:mod:`runtime.tensor_parallel`) a row-parallel linear layer
(attention output projection, MLP down projection) multiplies this rank's ``1/tp`` slice of the
input features by its ``1/tp`` slice of the weight's columns and all-reduces the partial sums::

    y = all_reduce_sum(x_r @ W_r^T) + b        x_r [B, T, K/tp], W_r [O, K/tp], y [B, T, O]

The all-reduce cannot start before the whole matmul has finished, and the next layer waits for
the all-reduce. CoCoNet (Jangda et al., "Breaking the Computation and Communication Abstraction
Barrier in Distributed Machine Learning Workloads", ASPLOS 2022, section 4 "overlapping", and its
Megatron-LM evaluation in section 6) splits the two along a dimension neither reduces -- here the
sequence ``T`` -- into ``c`` chunks and pipelines them: chunk ``i``'s all-reduce
(``dist.all_reduce(async_op=True)`` on the tensor-parallel group) runs while chunk ``i + 1`` is
multiplied, so only the last chunk's all-reduce is exposed. The result is the same tensor, summed
in the same order per element.

:class:`ChunkedRowwiseParallel` is a ``torch.distributed.tensor.parallel`` ``ParallelStyle`` that
replaces ``RowwiseParallel`` on those layers: it shards the weight exactly as ``RowwiseParallel``
does (a ``DTensor`` parameter placed ``Shard(1)``, the bias ``Replicate()``), so checkpoints, the
gradient all-reduces and ``runtime.worker.merge_model_state`` see the same parameters, and turns
the ``nn.Linear`` into a :class:`ChunkedRowwiseLinear` whose forward is
:class:`ChunkedRowwiseMatmul`: forward = per chunk the local matmul and an asynchronous
all-reduce; backward = the gradient of an all-reduce-sum, i.e. the identity on the (replicated)
output gradient, then the local matmul's gradients (input ``[B, T, K/tp]``, weight shard
``[O, K/tp]``, bias ``[O]``). The input and output layouts are those of ``RowwiseParallel``'s
defaults: a local ``[B, T, K/tp]`` tensor in (the column-parallel layer's local output), a
replicated local ``[B, T, O]`` tensor out.

On GPUs, ``torch.distributed._symmetric_memory``'s fused matmul-reduce-scatter
(``torch.ops.symm_mem.fused_matmul_reduce_scatter``, the micro-pipelined kernel PyTorch's async
tensor parallelism uses) is the library for this: it computes the reduce-scatter of the product
and an all-gather completes the all-reduce. It is taken only when asked for
(``TESSEL_SYMM_MEM=1``), on CUDA with NCCL, where the op exists and the ``B*T`` rows divide by the
group size: it has not been run on a multi-GPU machine yet, so the chunked path stays the default
everywhere. Gloo (CPU) always takes the chunked path.

Sources: CoCoNet (above); Wang et al., "Overlap Communication with Dependent Computation via
Decomposition in Large Deep Learning Models" (ASPLOS 2023), the decomposition behind PyTorch's
``_symmetric_memory`` fused ops; PyTorch ``torch.distributed.tensor.parallel.RowwiseParallel``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

try:   # registers torch.ops.symm_mem where this torch build has symmetric memory
    import torch.distributed._symmetric_memory  # noqa: F401
except (ImportError, RuntimeError):   # pragma: no cover - builds without it take the chunked path
    pass

__all__ = ["ChunkedRowwiseLinear", "ChunkedRowwiseMatmul", "ChunkedRowwiseParallel", "chunked_rowwise_matmul"]


def _fused_available(x: torch.Tensor, group: Any) -> bool:
    """Whether the fused symmetric-memory matmul-reduce-scatter applies: asked for
    (``TESSEL_SYMM_MEM=1``), CUDA, NCCL, the op exists and the ``B*T`` rows divide by the group size."""
    if not x.is_cuda or os.environ.get("TESSEL_SYMM_MEM", "0") != "1":
        return False
    try:
        if dist.get_backend(group) != "nccl":
            return False
        op = getattr(torch.ops.symm_mem, "fused_matmul_reduce_scatter", None)
    except (ImportError, RuntimeError, AttributeError):
        return False
    rows = x.numel() // x.shape[-1]
    return op is not None and rows % dist.get_world_size(group) == 0


def _fused_forward(x: torch.Tensor, weight: torch.Tensor, group: Any) -> torch.Tensor:
    """``all_reduce_sum(x @ weight^T)`` as the fused matmul-reduce-scatter (over the ``B*T`` rows)
    followed by an all-gather of the rows (CUDA, NCCL)."""
    a = x.reshape(-1, x.shape[-1])
    shard = torch.ops.symm_mem.fused_matmul_reduce_scatter(a, weight.t(), "sum", 0, group.group_name)
    full = torch.empty((a.shape[0], weight.shape[0]), dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(full, shard.contiguous(), group=group)
    return full.view(*x.shape[:-1], weight.shape[0])


class ChunkedRowwiseMatmul(torch.autograd.Function):
    """``y = all_reduce_sum(x @ weight^T) + bias`` with the matmul and the all-reduce pipelined over
    ``chunks`` chunks of the sequence dim (``x.dim() - 2``; ``torch.tensor_split`` layout).

    Args (of ``apply``):
        x: this rank's input features ``[B, T, K/tp]`` (any leading dims; the sequence is the
            second to last).
        weight: this rank's weight shard ``[O, K/tp]`` (a plain tensor: the ``DTensor``'s local part).
        bias: the replicated bias ``[O]`` or ``None``; added once, after the sum.
        group: the tensor-parallel process group.
        chunks: number of sequence chunks (at most ``T``; 1: no overlap).

    Returns ``[B, T, O]``, the same on every rank of the group. Backward: the output gradient is
    replicated, so the gradient of each rank's partial product is that gradient itself (the
    adjoint of an all-reduce-sum is the identity per rank), and the local matmul's gradients
    follow: ``dx = dy @ weight``, ``dweight = dy^T x``, ``dbias = sum dy``.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Any,
                chunks: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        if _fused_available(x, group):
            y = _fused_forward(x, weight, group)
        else:
            seq = max(x.dim() - 2, 0)
            parts = torch.tensor_split(x, max(1, min(int(chunks), x.shape[seq])), dim=seq)
            outs, works = [], []
            for xi in parts:   # chunk i's all-reduce runs (gloo: on its own thread) while i+1 is multiplied
                yi = F.linear(xi, weight).contiguous()
                works.append(dist.all_reduce(yi, op=dist.ReduceOp.SUM, group=group, async_op=True))
                outs.append(yi)
            for w in works:
                w.wait()
            y = torch.cat(outs, dim=seq) if len(outs) > 1 else outs[0]
        if bias is not None:
            y = y + bias
        return y

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        (gy,) = grads
        x, weight = ctx.saved_tensors
        gx = gy @ weight if ctx.needs_input_grad[0] else None
        g2 = gy.reshape(-1, gy.shape[-1])
        gw = g2.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None


def chunked_rowwise_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Any,
                           chunks: int) -> torch.Tensor:
    """:class:`ChunkedRowwiseMatmul` as a function (see there for shapes)."""
    out: torch.Tensor = ChunkedRowwiseMatmul.apply(x, weight, bias, group, chunks)
    return out


class ChunkedRowwiseLinear(nn.Linear):
    """A row-parallel ``nn.Linear`` (what :class:`ChunkedRowwiseParallel` turns one into): ``weight``
    is a ``DTensor`` ``[O, K]`` placed ``Shard(1)`` (local ``[O, K/tp]``), ``bias`` a ``Replicate()``
    ``DTensor`` ``[O]``; forward takes the local ``[B, T, K/tp]`` input (a ``DTensor`` input is
    laid out ``Shard(-1)`` and taken locally) and returns the replicated ``[B, T, O]`` output
    (:class:`ChunkedRowwiseMatmul`).

    Attributes:
        tp_group: the tensor-parallel process group; overlap_chunks: the sequence chunks.
    """

    tp_group: Any
    overlap_chunks: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):
            x = x.redistribute(x.device_mesh, [Shard(-1)]).to_local()
        w: Any = self.weight
        b: Any = self.bias
        return chunked_rowwise_matmul(x, w.to_local(), b.to_local() if b is not None else None, self.tp_group,
                                      self.overlap_chunks)


class ChunkedRowwiseParallel(ParallelStyle):
    """The ``ParallelStyle`` of ``chunked-overlap``: shard an ``nn.Linear`` like ``RowwiseParallel``
    (weight ``Shard(1)``, bias ``Replicate()``) and run it as :class:`ChunkedRowwiseLinear` with
    ``chunks`` sequence chunks over the mesh's (1-D) group.

    Raises (at ``parallelize_module``): ``TypeError`` for a module that is not an ``nn.Linear``.
    """

    def __init__(self, chunks: int):
        self.chunks = max(1, int(chunks))

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"chunked-overlap shards nn.Linear layers, not {type(module).__name__}")
        src = getattr(self, "src_data_rank", 0)
        module.weight = nn.Parameter(distribute_tensor(module.weight.data, device_mesh, [Shard(1)],
                                                       src_data_rank=src))
        if module.bias is not None:
            module.bias = nn.Parameter(distribute_tensor(module.bias.data, device_mesh, [Replicate()],
                                                         src_data_rank=src))
        module.__class__ = ChunkedRowwiseLinear
        lin: Any = module
        lin.tp_group = device_mesh.get_group()
        lin.overlap_chunks = self.chunks
        return module

    def __repr__(self) -> str:
        return f"ChunkedRowwiseParallel(chunks={self.chunks})"
