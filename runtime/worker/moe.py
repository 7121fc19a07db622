"""Expert parallelism of a stage worker's MoE layers (``docs/runtime-worker.md``, "Mixture of experts")."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from engine.models.moe.layer import MoEFeedForward
from runtime.expert_parallel import ExpertParallelMoE
from runtime.worker.errors import WorkerError

__all__ = ["expert_parallelize"]


def expert_parallelize(modules: Mapping[int, torch.nn.Module], dp: int, ep_group: Any) -> None:
    """Replace every MoE layer of the local stage ``modules`` (segment -> module) by an
    :class:`ExpertParallelMoE` over ``ep_group`` (this pipeline rank's ``dp`` replicas; replica
    ``d`` keeps experts ``[d*E/dp, (d+1)*E/dp)``), in place.

    Raises:
        WorkerError: a layer's expert count ``E`` is not divisible by ``dp``.
    """
    for module in modules.values():
        for name, layer in [(n, m) for n, m in module.named_modules() if type(m) is MoEFeedForward]:
            e = layer.gate.num_experts
            if e % dp:
                raise WorkerError(
                    f"the MoE layer {name} has {e} experts, which cannot be split over dp={dp} replicas "
                    f"(expert parallelism keeps E/dp experts per replica); choose dp dividing {e}")
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            # check_shapes=False: every replica runs the plan's static micro-batch shape
            ep = ExpertParallelMoE.from_dense(layer, ep_group, check_shapes=False)
            setattr(parent, attr, ep)
            if not parent_name:
                setattr(module.inner, attr, ep)
