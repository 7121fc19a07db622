"""The narrow state a stage worker's parts receive, built once by
:meth:`runtime.worker.StageWorker.setup` and passed explicitly: where the rank sits
(:class:`RankCoords`), its segments and their parameters (:class:`LocalStages`), how its tensors
live and move (:class:`Transport`), and what the instruction handlers read (:class:`ExecContext`).
The placement's DAG is :class:`runtime.worker.dataflow.Dataflow`."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
from torch import nn

from engine.models.moe.layer import MoEFeedForward
from runtime.expert_parallel import is_expert_param
from runtime.stages import TensorMeta
from runtime.tensor_parallel import local_tensor
from runtime.worker.buffers import ReceiveBuffers
from runtime.worker.dataflow import Dataflow
from runtime.worker.grad_sync import GradientSync
from runtime.worker.groups import ProcessGroups
from runtime.worker.metrics import ActivationMeter
from runtime.worker.moe import expert_parallel_layers
from runtime.worker.optimizer import WorkerOptimizer
from runtime.worker.p2p import P2PMatcher

__all__ = ["ExecContext", "LocalStages", "RankCoords", "Transport", "empty_on"]


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits: global rank ``(dp_index * tp + tp_rank) * pp + pp_rank``
    (``docs/runtime-worker.md``, "Ranks")."""

    rank: int
    """The global rank, ``0 .. dp * tp * pp - 1``."""
    pp: int
    """Pipeline ranks (the placement's devices)."""
    dp: int
    """Data-parallel replicas."""
    tp: int
    """Tensor-parallel ranks per pipeline rank."""

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline rank, ``rank % pp``."""
        return self.rank % self.pp

    @property
    def replica(self) -> int:
        """This rank's pipeline replica (the ranks exchanging point-to-point messages), ``rank // pp``."""
        return self.rank // self.pp

    @property
    def dp_index(self) -> int:
        """This rank's data-parallel replica."""
        return self.replica // self.tp

    @property
    def tp_rank(self) -> int:
        """This rank's tensor rank within its tensor-parallel group."""
        return self.replica % self.tp

    def where(self) -> str:
        """``"rank R (pipeline rank P, replica D)"``, how errors name the rank."""
        return f"rank {self.rank} (pipeline rank {self.pp_rank}, replica {self.dp_index})"


@dataclass
class LocalStages:
    """The segments this rank runs and their parameters (after tensor and expert parallelism
    sharded them, on the worker's device)."""

    segments: list[int]
    """The local segments, ascending (those whose forward's device set holds this pipeline rank)."""
    modules: dict[int, nn.Module]
    """Segment -> its stage module (:class:`runtime.stages.StageModule`)."""
    params: dict[int, list[nn.Parameter]]
    """Segment -> its parameters, in ``parameters()`` order."""
    dp_params: dict[int, list[nn.Parameter]]
    """Segment -> the parameters its data-parallel all-reduce averages (experts excluded: each is
    owned by one replica)."""
    expert_params: list[nn.Parameter]
    """The expert parameters of every local segment."""
    moe_layers: dict[int, list[tuple[str, MoEFeedForward]]]
    """Segment -> its ``(name, MoEFeedForward)`` layers (empty without MoE)."""
    ep_layers: list[Any]
    """The expert-parallel layers (``ExpertParallelMoE``, HF blocks' ``HFExpertParallel`` experts)
    whose all-to-alls are recorded (their ``comm_log``)."""
    ep: int = 1
    """Expert-parallel degree (``dp`` for an MoE model with ``dp > 1``, else 1)."""
    tp_dims: dict[int, dict[str, int]] = field(default_factory=dict)
    """Segment -> ``{state_dict key: sharded dim}`` of its tensor-parallel parameters."""
    shard: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Segment -> ``(this rank's shard index, shards)`` of its tensor-parallel parameters."""
    loss_parallel: set[int] = field(default_factory=set)
    """Loss segments whose LM head keeps its logits vocab-sharded (the task's loss runs on the shards)."""
    recompute: set[int] = field(default_factory=set)
    """Segments with a checkpointed block (``runtime.recompute`` marks the block's class)."""
    fsdp: set[int] = field(default_factory=set)
    """Segments sharded with FSDP2 (``dp_shard > 1``, :mod:`runtime.fsdp`): their modules are FSDP
    roots and :attr:`params` the sharded ``DTensor`` parameters the optimizer steps."""
    fsdp_reduce: set[tuple[int, int, str]] = field(default_factory=set)
    """``(segment, micro-batch, kind)`` of the backward blocks after which FSDP reduces a segment's
    gradients (:func:`runtime.fsdp.reducing_blocks`)."""
    fsdp_reshard: bool = True
    """FSDP2's ``reshard_after_forward`` of the plan (resolved)."""
    fsdp_shards: tuple[int, int] = (0, 1)
    """``(this rank's shard index, dp_shard)`` of the FSDP-sharded parameters (dim 0)."""
    unsharded_bytes: dict[int, int] = field(default_factory=dict)
    """FSDP: segment -> bytes of its parameters on this rank before FSDP sharded them."""

    @classmethod
    def collect(cls, modules: dict[int, nn.Module], *, ep: int = 1, tp_dims: dict[int, dict[str, int]] | None = None,
                shard: dict[int, tuple[int, int]] | None = None, loss_parallel: set[int] | None = None) -> LocalStages:
        """The parameters, MoE and expert-parallel layers of ``modules`` (segment -> stage module)."""
        segments = sorted(modules)
        params = {s: list(modules[s].parameters()) for s in segments}
        return cls(
            segments=segments, modules=dict(modules), params=params,
            dp_params={s: [p for p in params[s] if not is_expert_param(p)] for s in segments},
            expert_params=[p for s in segments for p in params[s] if is_expert_param(p)],
            moe_layers={s: [(n, m) for n, m in modules[s].named_modules() if isinstance(m, MoEFeedForward)]
                        for s in segments},
            ep_layers=expert_parallel_layers(modules), ep=ep, tp_dims=dict(tp_dims or {}),
            shard=dict(shard or {}), loss_parallel=set(loss_parallel or ()),
            recompute={s for s in segments if any(getattr(type(m), "recompute", None) for m in modules[s].modules())})

    def compute_params(self, s: int) -> list[nn.Parameter]:
        """The parameters segment ``s``'s autograd graph uses: :attr:`params`, or for an FSDP segment
        the module's currently registered ones (the gathered, unsharded parameters during a step)."""
        if s in self.fsdp:
            return list(self.modules[s].parameters())
        return self.params[s]

    def local_params(self) -> list[torch.Tensor]:
        """Every local parameter as this rank holds it (a tensor-parallel ``DTensor``: its local shard)."""
        return [local_tensor(p) for s in self.segments for p in self.params[s]]

    def grad_bytes(self) -> int:
        """Bytes of the parameter gradients held now (local shards)."""
        return sum(local_tensor(p.grad).numel() * p.grad.element_size() for ps in self.params.values()
                   for p in ps if p.grad is not None)

    def runs_any(self, segments: Any) -> bool:
        """Whether this rank runs one of ``segments``."""
        return any(s in self.modules for s in segments)


def empty_on(meta: TensorMeta, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of ``meta``'s shape and dtype on ``device``."""
    if device.type != "cuda":
        return meta.empty()
    return torch.empty(meta.shape, dtype=meta.dtype, device=device)


@dataclass
class Transport:
    """Where this rank's tensors live and how they move between ranks."""

    device: torch.device
    """The worker's device (``cpu`` with gloo, a GPU with nccl)."""
    sync: Callable[[], None] | None
    """CUDA with ``sync_timing``: ``torch.cuda.synchronize`` of the device, called before an
    instruction's end is stamped; ``None`` otherwise."""
    timeout: timedelta
    """How long a wait on a peer may take (the process-group timeout)."""
    groups: ProcessGroups
    """Every process group of this rank."""
    buffers: ReceiveBuffers
    """The pre-allocated receive buffers."""
    p2p: P2PMatcher
    """Posts the point-to-point sends and receives (tag or ordered matching)."""

    @property
    def cuda(self) -> bool:
        """The device is a GPU."""
        return self.device.type == "cuda"

    def empty(self, meta: TensorMeta) -> torch.Tensor:
        """An uninitialised tensor of ``meta``'s shape and dtype on :attr:`device`."""
        return empty_on(meta, self.device)


@dataclass
class ExecContext:
    """What the instruction handlers (:mod:`runtime.worker.interpreter`, :mod:`runtime.worker.compute`)
    and the step loop (:mod:`runtime.worker.training_step`) read; built once at setup."""

    coords: RankCoords
    """Where this rank sits."""
    flow: Dataflow
    """The placement's forward DAG and boundary metas."""
    local: LocalStages
    """This rank's segments and parameters."""
    transport: Transport
    """Device, process groups, receive buffers, point-to-point matching."""
    opt: WorkerOptimizer
    """The optimizer (Adam, SGD or AdamA; sharded with ``sharded-update``)."""
    grad_sync: GradientSync
    """The data-parallel and tied-weight gradient collectives."""
    meter: ActivationMeter
    """Saved-activation accounting."""
    loss: Callable[..., torch.Tensor]
    """The task's loss, ``loss(output, *targets)`` (``Task.loss``)."""
    loss_scale: float
    """The factor of every micro-batch's loss: ``1 / (m * chains)``, ``1 / (dp * m * chains)`` with AdamA."""
    track_activations: bool
    """Account saved activations and gradient bytes (``WorkerConfig.track_activations``)."""

    @property
    def has_loss(self) -> bool:
        """This rank runs a loss segment."""
        return self.local.runs_any(self.flow.loss_segments)

