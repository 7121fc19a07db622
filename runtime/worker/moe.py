"""Expert parallelism of a stage worker's MoE layers (``docs/runtime-worker.md``, "Mixture of experts").

Two kinds of MoE layer are split over the EP group (this pipeline rank's ``dp`` replicas):
the project's :class:`~engine.models.moe.layer.MoEFeedForward` (replaced whole by
:class:`~runtime.expert_parallel.ExpertParallelMoE`) and Hugging Face sparse MoE blocks
(:func:`engine.models.moe.hf_moe.is_hf_moe_block`, e.g. ``MixtralSparseMoeBlock``), whose
``experts`` child is replaced by :class:`~runtime.expert_parallel_hf.HFExpertParallel` (the block
and its router stay). Both mark their expert parameters with
:func:`~runtime.expert_parallel.is_expert_param` and share the gradient convention: no DP
all-reduce, the optimizer divides their gradient by ``ep = dp``. With tensor parallelism the experts
arrive sharded over the tensor group (:mod:`runtime.moe_tensor_parallel`); each replica keeps its
experts of this rank's shards, and the EP group holds the same tensor rank of every replica.
"""

from __future__ import annotations

from typing import Any, Mapping, cast

import torch

from engine.models.moe.hf_moe import is_hf_moe_block
from engine.models.moe.layer import MoEFeedForward
from runtime.expert_parallel import ExpertParallelMoE
from runtime.expert_parallel_hf import HFExpertParallel, HFExpertParallelError
from runtime.moe_tensor_parallel import expert_parallel_shards, is_tensor_parallel_experts, local_parameters
from runtime.worker.errors import WorkerError

__all__ = ["expert_parallel_layers", "expert_parallelize", "has_moe"]


def _hf_blocks(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in module.named_modules() if is_hf_moe_block(m)]


def has_moe(modules: Mapping[int, torch.nn.Module]) -> bool:
    """Whether any stage module holds an MoE layer that :func:`expert_parallelize` splits (a
    :class:`MoEFeedForward` or an HF sparse MoE block)."""
    return any(isinstance(x, MoEFeedForward) or is_hf_moe_block(x) for m in modules.values() for x in m.modules())


def expert_parallel_layers(modules: Mapping[int, torch.nn.Module]) -> list[ExpertParallelMoE | HFExpertParallel]:
    """The expert-parallel layers of the stage ``modules`` in segment and module order (each has
    a ``comm_log`` list of its all-to-alls: the worker turns them into ``ALLTOALL`` events and
    clears them)."""
    return [x for _, m in sorted(modules.items()) for x in m.modules()
            if isinstance(x, (ExpertParallelMoE, HFExpertParallel))]


def _split_error(name: str, e: int, dp: int) -> WorkerError:
    return WorkerError(
        f"the MoE layer {name} has {e} experts, which cannot be split over dp={dp} replicas "
        f"(expert parallelism keeps E/dp experts per replica); choose dp dividing {e}")


def expert_parallelize(modules: Mapping[int, torch.nn.Module], dp: int, ep_group: Any) -> None:
    """Split every MoE layer of the local stage ``modules`` (segment -> module) over ``ep_group``
    (this pipeline rank's ``dp`` replicas; replica ``d`` keeps experts ``[d*E/dp, (d+1)*E/dp)``),
    in place: a :class:`MoEFeedForward` becomes an :class:`ExpertParallelMoE`, an HF sparse MoE
    block's ``experts`` becomes an :class:`HFExpertParallel` (the block keeps its path, e.g.
    ``model.layers.1.mlp``, and its replicated router ``gate``). Every replica must call it
    with identically initialised modules.

    Raises:
        WorkerError: a layer's expert count ``E`` is not divisible by ``dp``, or an HF block's
            experts use a layout :class:`HFExpertParallel` does not implement.
    """
    for module in modules.values():
        for name, layer in [(n, m) for n, m in module.named_modules() if type(m) is MoEFeedForward]:
            e = layer.gate.num_experts
            if e % dp:
                raise _split_error(name, e, dp)
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            # check_shapes=False: every replica runs the plan's static micro-batch shape
            ep = ExpertParallelMoE.from_dense(layer, ep_group, check_shapes=False)
            setattr(parent, attr, ep)
            if not parent_name:
                setattr(module.inner, attr, ep)
        for name, block in _hf_blocks(module):
            experts = cast(torch.nn.Module, block.experts)
            if isinstance(experts, HFExpertParallel):
                continue
            e = int(cast(torch.Tensor, experts.gate_up_proj).shape[0])
            if e % dp:
                raise _split_error(name, e, dp)
            try:
                with local_parameters(experts):   # tensor-parallel experts: this rank's features of them
                    hf_ep = HFExpertParallel.from_experts(experts, ep_group, where=name)
            except HFExpertParallelError as err:
                raise WorkerError(str(err)) from err
            if is_tensor_parallel_experts(experts):
                expert_parallel_shards(experts, hf_ep)
            block.experts = hf_ep
