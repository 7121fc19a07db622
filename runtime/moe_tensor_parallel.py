"""Tensor parallelism of Hugging Face MoE experts: transformers' ``moe_tp_experts`` style, with DTensor.

transformers 5 stores all ``E`` experts of a sparse MoE block in two 3-D parameters of
``block.experts``: ``gate_up_proj [E, 2I, H]`` (the gate and up projections concatenated along dim
1) and ``down_proj [E, H, I]``, called as ``experts(x [N, H], top_k_index [N, k], top_k_weights
[N, k]) -> [N, H]``. Mixtral's and Qwen2-MoE's published plans (``config.base_model_tp_plan``) shard
them Megatron-style, every expert at once:

- ``experts.gate_up_proj: packed_colwise``: each rank holds ``I/tp`` features of the gate and
  ``I/tp`` of the up projection of every expert (:func:`runtime.conv1d_parallel.distribute_parameter`
  with two parts, so the local ``[E, 2I/tp, H]`` still splits into gate and up with ``chunk(2, -1)``);
- ``experts.down_proj: rowwise``: each rank holds the matching ``I/tp`` input features, ``[E, H, I/tp]``;
- ``experts: moe_tp_experts``: the experts' forward runs on the local shards (the model's own code,
  any of its experts implementations), so each rank computes a partial ``[N, H]`` output over its
  features; the partials are all-reduced (Megatron's ``g``, :mod:`runtime.tensor_parallel_regions`). The
  hidden states and the routing weights enter through Megatron's ``f`` (identity forward, gradient
  all-reduced), since each rank's features give a partial gradient of both.

The router (``block.gate``), Qwen2-MoE's shared expert and its gate stay replicated. With expert
parallelism over the data-parallel replicas as well (``dp > 1``, :mod:`runtime.expert_parallel_hf`),
replica ``d`` keeps experts ``[d*E/dp, (d+1)*E/dp)`` of its tensor shards and exchanges tokens with the
same tensor rank of the other replicas (:func:`expert_parallel_shards`).

The sharded parameters stay DTensors (``Shard(1)`` / ``Shard(2)``) so checkpoints, the optimizer and
the merge of the ranks' states treat them like every tensor-parallel parameter; the packed one
carries :data:`runtime.conv1d_parallel.PACKED_ATTR`.

Sources: transformers' ``distributed/tensor_parallel.py`` (``PackedColwiseParallel``,
``MoeExpertsParallel``) and ``integrations/moe.py``; Shoeybi et al., "Megatron-LM" (2019), section 3
(the ``f`` and ``g`` operators).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from runtime.conv1d_parallel import PACKED_ATTR, distribute_parameter
from runtime.tensor_parallel_regions import CopyToTensorParallel, ReduceFromTensorParallel

__all__ = ["ExpertsTensorParallel", "expert_parallel_shards", "experts_shard_spec", "is_tensor_parallel_experts",
           "local_parameters"]

#: Attribute set on an experts module sharded by :class:`ExpertsTensorParallel`: ``(mesh, spec)``.
TP_EXPERTS_ATTR = "_tessel_experts_tp"


def experts_shard_spec(entries: Mapping[str, str], *, transposed: bool = False) -> dict[str, tuple[int, int]]:
    """``{parameter: (sharded dim, packed parts)}`` of an experts module from its plan entries
    ``{parameter name: style}`` (``packed_colwise``: the output dim in two parts, ``colwise``: the
    output dim, ``rowwise``: the input dim). The output features are dim 1 of ``[E, out, in]``
    (dim 2 when the weights are stored ``transposed``, ``[E, in, out]``).

    Raises:
        ValueError: a style other than those three (one sentence naming the entry).
    """
    out_dim, in_dim = (2, 1) if transposed else (1, 2)
    spec: dict[str, tuple[int, int]] = {}
    for name, style in entries.items():
        if style == "packed_colwise":
            spec[name] = (out_dim, 2)
        elif style == "colwise":
            spec[name] = (out_dim, 1)
        elif style == "rowwise":
            spec[name] = (in_dim, 1)
        else:
            raise ValueError(f"the experts' parameter {name!r} is sharded as {style!r}; moe_tp_experts shards "
                             "packed_colwise, colwise and rowwise expert weights")
    return spec


@contextlib.contextmanager
def local_parameters(module: nn.Module) -> Iterator[None]:
    """Within the block, ``module``'s own DTensor parameters are replaced by their local shards
    (``to_local()``, differentiable: the gradient reaches the DTensor); restored after."""
    originals = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    params: Any = module._parameters   # plain tensors for the forward's duration (transformers does the same)
    params.update({n: p.to_local() for n, p in originals.items()})
    try:
        yield
    finally:
        module._parameters.update(originals)


def is_tensor_parallel_experts(module: nn.Module) -> bool:
    """Whether ``module`` was sharded by :class:`ExpertsTensorParallel`."""
    return getattr(module, TP_EXPERTS_ATTR, None) is not None


def _install_forward(module: nn.Module, mesh: DeviceMesh, spec: Mapping[str, tuple[int, int]]) -> None:
    """Wrap ``module.forward``: ``f`` on the hidden states and routing weights, the model's forward
    on the local shards, ``g`` on the output (module docstring)."""
    group = mesh.get_group()
    inner = module.forward

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden_states = CopyToTensorParallel.apply(hidden_states, group)
        top_k_weights = CopyToTensorParallel.apply(top_k_weights, group)
        with local_parameters(module):
            out = inner(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        return ReduceFromTensorParallel.apply(out, group)

    module.forward = forward
    setattr(module, TP_EXPERTS_ATTR, (mesh, dict(spec)))


class ExpertsTensorParallel(ParallelStyle):
    """transformers' ``moe_tp_experts`` for an experts module (module docstring), as a
    ``parallelize_module`` style.

    Args:
        spec: ``{parameter name: (sharded dim, packed parts)}`` (:func:`experts_shard_spec`).

    Raises (when applied):
        ValueError: a parameter of ``spec`` is missing, or its dim does not divide into ``parts`` x
            ``tp`` equal slices (one sentence).
    """

    def __init__(self, spec: Mapping[str, tuple[int, int]]):
        super().__init__()
        self.spec = dict(spec)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        for name, (dim, parts) in self.spec.items():
            p = module._parameters.get(name)
            if p is None:
                raise ValueError(f"{type(module).__name__} has no parameter {name!r} to shard")
            if p.shape[dim] % (tp * parts):
                raise ValueError(f"{type(module).__name__}.{name} {tuple(p.shape)} cannot be cut into {parts} part(s) "
                                 f"of {tp} equal slices along dim {dim}")
            module.register_parameter(name, distribute_parameter(p, device_mesh, Shard(dim), parts))
        _install_forward(module, device_mesh, self.spec)
        return module


def expert_parallel_shards(experts: nn.Module, replacement: nn.Module) -> None:
    """After expert parallelism replaced a tensor-parallel ``experts`` module by ``replacement`` (an
    :class:`runtime.expert_parallel_hf.HFExpertParallel` built from its local shards, so holding this
    replica's experts of this rank's features as plain parameters): make those parameters DTensors
    sharded as before (their global shape is this replica's ``[E/dp, ...]`` experts), keeping their
    expert marker, and install the same forward (module docstring)."""
    mesh, spec = getattr(experts, TP_EXPERTS_ATTR)
    for name, (dim, parts) in spec.items():
        p = replacement._parameters[name]
        assert p is not None
        d = nn.Parameter(DTensor.from_local(p.detach(), mesh, [Shard(dim)], run_check=False),
                         requires_grad=p.requires_grad)
        for attr, value in vars(p).items():   # the expert marker (runtime.expert_parallel.is_expert_param)
            setattr(d, attr, value)
        if parts > 1:
            setattr(d, PACKED_ATTR, parts)
        replacement.register_parameter(name, d)
    _install_forward(replacement, mesh, spec)
