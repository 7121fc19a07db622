"""Column- and row-parallel styles for transformers' ``Conv1D`` (GPT-2's projections), with DTensor.

``transformers.pytorch_utils.Conv1D`` is a linear layer whose weight is stored transposed:
``weight [in, out]``, ``y = x @ weight + bias`` (``torch.addmm``). torch's ``ColwiseParallel`` and
``RowwiseParallel`` shard only ``nn.Linear`` (``weight [out, in]``) and ``nn.Embedding``; these
subclasses shard a ``Conv1D`` the same way, Megatron-LM style (Shoeybi et al., 2019, section 3),
with the dims swapped:

- :class:`Conv1DColwiseParallel`: ``weight`` ``Shard(1)`` and ``bias`` ``Shard(0)``, so each rank
  computes ``out/tp`` output features, ``[B, T, in] -> [B, T, out/tp]``. ``packed=k`` shards an
  output made of ``k`` equal parts (GPT-2's fused ``c_attn``: query, key and value, ``[H, 3H]``) part
  by part, so that rank ``r`` holds the ``r``-th slice of each part (whole heads of all three) and
  the module's own ``split`` of its output into the ``k`` parts still works on the local tensor.
  The DTensor's global tensor is then the parts' slices regrouped by rank; :func:`packed_parts`
  names such parameters and :func:`unpack` restores the original layout from the ranks' shards.
- :class:`Conv1DRowwiseParallel`: ``weight`` ``Shard(0)`` and ``bias`` ``Replicate()``: each rank
  multiplies its ``in/tp`` input features, the partial sums are all-reduced (``[B, T, in/tp] ->
  [B, T, out]``) and the bias is added once.

The input and output handling are torch's own (``_prepare_input_fn``, ``_prepare_output_fn``), so
the styles take the same ``input_layouts``/``output_layouts``/``use_local_output`` arguments.
Sources: PyTorch, "Tensor Parallelism" (``torch.distributed.tensor.parallel.ColwiseParallel``,
``RowwiseParallel``, ``distribute_module``); transformers' ``packed_colwise`` style (its
``tensor_parallel`` integration) for the packed layout.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

__all__ = ["Conv1DColwiseParallel", "Conv1DRowwiseParallel", "distribute_parameter", "is_conv1d", "pack",
           "packed_parts", "unpack"]

#: Attribute set on a parameter sharded part by part: the number of parts.
PACKED_ATTR = "_tessel_packed_parts"


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (``weight [in, out]``, attributes ``nf``, ``nx``)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def pack(full: torch.Tensor, parts: int, tp: int, dim: int) -> torch.Tensor:
    """``full`` with its ``dim`` cut into ``parts`` equal parts, each into ``tp`` equal slices,
    regrouped by slice: ``[p0 s0, p1 s0, ..., p0 s1, p1 s1, ...]``, so that ``torch.chunk(tp, dim)``
    gives rank ``r`` the ``r``-th slice of every part."""
    slices = [part.chunk(tp, dim) for part in full.chunk(parts, dim)]
    return torch.cat([slices[p][r] for r in range(tp) for p in range(parts)], dim)


def unpack(shards: list[torch.Tensor], parts: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack` from the ranks' local shards (in tensor-rank order)."""
    pieces = [s.chunk(parts, dim) for s in shards]
    return torch.cat([pieces[r][p] for p in range(parts) for r in range(len(shards))], dim)


def packed_parts(module: nn.Module) -> dict[str, int]:
    """``{state_dict key: parts}`` of ``module``'s parameters sharded part by part (``packed > 1``)."""
    return {k: int(getattr(v, PACKED_ATTR)) for k, v in module.state_dict(keep_vars=True).items()
            if getattr(v, PACKED_ATTR, 1) > 1}


def distribute_parameter(param: torch.Tensor, mesh: DeviceMesh, placement, parts: int = 1) -> nn.Parameter:
    """``param`` as an ``nn.Parameter`` DTensor over ``mesh`` placed as ``placement``
    (``distribute_tensor``); with ``parts > 1`` (a ``Shard``) cut part by part (:func:`pack`) and marked
    with :data:`PACKED_ATTR`, so :func:`unpack` restores it from the ranks' shards."""
    if parts > 1:
        full = pack(param.detach(), parts, mesh.size(), placement.dim)
        out = nn.Parameter(distribute_tensor(full, mesh, [placement]), requires_grad=param.requires_grad)
        setattr(out, PACKED_ATTR, parts)
        return out
    return nn.Parameter(distribute_tensor(param.detach(), mesh, [placement]), requires_grad=param.requires_grad)


class Conv1DColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a ``Conv1D`` (see the module docstring); ``packed``: parts of the output."""

    def __init__(self, *, packed: int = 1, **kw) -> None:
        super().__init__(**kw)
        if packed < 1:
            raise ValueError(f"packed must be a positive number of parts, got {packed}")
        self.packed = packed

    def _partition_conv1d_fn(self, name, module, device_mesh) -> None:
        module.register_parameter("weight", distribute_parameter(module.weight, device_mesh, Shard(1), self.packed))
        if module.bias is not None:
            module.register_parameter("bias", distribute_parameter(module.bias, device_mesh, Shard(0), self.packed))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        conv: Any = module
        nf = int(conv.nf)
        if nf % (device_mesh.size() * self.packed):
            raise ValueError(f"a Conv1D of {nf} output features cannot be cut into {self.packed} part(s) of "
                             f"{device_mesh.size()} equal slices")
        return distribute_module(
            module, device_mesh, self._partition_conv1d_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for a ``Conv1D`` (see the module docstring)."""

    def _partition_conv1d_fn(self, name, module, device_mesh) -> None:
        module.register_parameter("weight", distribute_parameter(module.weight, device_mesh, Shard(0)))
        if module.bias is not None:
            module.register_parameter("bias", distribute_parameter(module.bias, device_mesh, Replicate()))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)   # each rank multiplies its in/tp input features
        return distribute_module(
            module, device_mesh, self._partition_conv1d_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))
