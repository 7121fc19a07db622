"""StageWorker: one rank of a pipelined (and data-parallel) training run, composed of the
package's parts (groups, p2p, buffers, optimizer, interpreter, metrics), to which it hands the
narrow state each uses (:mod:`runtime.worker.context`). Design and lifecycle:
``docs/runtime-worker.md``."""

from __future__ import annotations

import gc
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from engine.dependency import COMPUTE_OPS, Instruction, Op, lower
from engine.io.plan import Plan
from engine.models import task_for_plan
from runtime.expert_parallel import ExpertParallelMoE
from runtime.fsdp import apply_fsdp, fsdp_refusal, reducing_blocks, reshard_all
from runtime.host_memory import MMAP_THRESHOLD, fix_mmap_threshold, trim_heap
from runtime.precision import LossScaler, plan_policy, precision_refusal
from runtime.stages import RuntimeNotSupported, build_stages, check_executable, check_transforms, retarget_device
from runtime.tensor_parallel import apply_tensor_parallel, coconet_tp_refusal, has_lm_head, local_tensor
from runtime.worker.batches import MicroBatch, split_batch
from runtime.worker.buffers import ReceiveBuffers
from runtime.worker.config import OPTIMIZERS, WorkerConfig
from runtime.worker.context import ExecContext, LocalStages, RankCoords, Transport, empty_on
from runtime.worker.dataflow import Dataflow
from runtime.worker.device import module_to, resolve_device
from runtime.worker.errors import WorkerError
from runtime.worker.evaluation import evaluate_loss
from runtime.worker.grad_sync import GradientSync, TiedCopies, transform_refusal
from runtime.worker.groups import ProcessGroups, build_groups, connect_pairs, init_default_group
from runtime.worker.lowering import local_stream
from runtime.worker.metrics import ActivationMeter, rss
from runtime.worker.moe import expert_parallelize, has_moe
from runtime.worker.optimizer import WorkerOptimizer, fused_adam
from runtime.worker.p2p import OrderedMatching, P2PMatcher, TagMatching
from runtime.worker.p2p_order import check_own_stream, pair_send_orders
from runtime.worker.state import CheckpointSource, load_worker_state, worker_state
from runtime.worker.training_step import run_step

__all__ = ["StageWorker"]


class StageWorker:
    """One rank: its stage modules, optimizer, instruction stream and receive buffers.

    Args:
        plan_dict: ``Plan.to_dict()`` (JSON-able; the worker rebuilds the plan in :meth:`setup`).
        rank: global rank ``0 .. world_size-1`` (= ``(dp_index * tp + tp_rank) * pp + pp_rank``,
            :mod:`runtime.worker.groups`).
        world_size: ``dp * tp * pp``.
        master_addr, master_port: TCP rendezvous of ``init_process_group``.
        config: the worker's options (:class:`~runtime.worker.config.WorkerConfig`; ``None``: defaults).

    Nothing heavy happens here; call :meth:`setup` next (in the worker's own process). Lifecycle,
    execution model, backends and failure modes: ``docs/runtime-worker.md``.
    """

    def __init__(self, plan_dict: dict, rank: int, world_size: int, master_addr: str, master_port: int,
                 config: WorkerConfig | None = None):
        cfg = config if config is not None else WorkerConfig()
        self.config = cfg
        self.plan_dict = plan_dict
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.master_addr = str(master_addr)
        self.master_port = int(master_port)
        self.optimizer_name: str | None = cfg.optimizer   # resolved against the plan in setup()
        self.timeout = timedelta(seconds=float(cfg.timeout_s))
        self._ready = False
        self.device = torch.device("cpu")
        self._cuda = False
        self._sync: Any = None
        self.p2p_mode = "tags"

    # ------------------------------------------------------------------ views kept for callers, tests and lowering
    @property
    def optimizer(self) -> Any:
        """The ``torch.optim`` optimizer (``None`` without parameters)."""
        return self.opt.optimizer

    @property
    def adama(self) -> bool:
        """The optimizer is AdamA."""
        return self.opt.adama

    @property
    def folded(self) -> dict[int, list]:
        """AdamA: segment -> parameters folded per micro-batch."""
        return self.opt.folded

    @property
    def unfolded(self) -> dict[int, list]:
        """AdamA: segment -> tied copies, folded once per step."""
        return self.opt.unfolded

    @property
    def _fold_hooks(self) -> list:
        return self.opt.fold_hooks

    @property
    def pp(self) -> int:
        """Pipeline ranks."""
        return self.coords.pp

    @property
    def dp(self) -> int:
        """Data-parallel replicas."""
        return self.coords.dp

    @property
    def tp(self) -> int:
        """Tensor-parallel ranks per pipeline rank."""
        return self.coords.tp

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline rank."""
        return self.coords.pp_rank

    @property
    def dp_index(self) -> int:
        """This rank's data-parallel replica."""
        return self.coords.dp_index

    @property
    def tp_rank(self) -> int:
        """This rank's tensor rank."""
        return self.coords.tp_rank

    @property
    def segments(self) -> list[int]:
        """The segments this rank runs."""
        return self.local.segments

    @property
    def modules(self) -> dict[int, nn.Module]:
        """Segment -> this rank's stage module."""
        return self.local.modules

    @property
    def seg_params(self) -> dict[int, list[nn.Parameter]]:
        """Segment -> its parameters."""
        return self.local.params

    @property
    def dp_params(self) -> dict[int, list[nn.Parameter]]:
        """Segment -> the parameters its data-parallel all-reduce averages."""
        return self.local.dp_params

    @property
    def moe_layers(self) -> dict[int, list[tuple[str, Any]]]:
        """Segment -> its MoE layers."""
        return self.local.moe_layers

    @property
    def ep(self) -> int:
        """Expert-parallel degree."""
        return self.local.ep

    # ------------------------------------------------------------------ setup
    def setup(self) -> dict:
        """Join the process group and build everything a step needs.

        Returns:
            ``rank``, ``pp_rank``, ``dp_index``, ``segments`` (run here), ``params`` (count),
            ``param_bytes``, ``buffer_bytes`` (pre-allocated receive buffers), ``num_buffers``,
            ``stream_length``, ``tied`` (tied groups of the whole model, ``[[segment, name], ...]``),
            ``removed`` (pruned leftover parameters, all segments), ``boundaries`` (per boundary, the
            tensors' ``shape``/``dtype``/``requires_grad``), ``optimizer`` (the name in use),
            ``setup_time`` (s), ``rss`` (bytes), ``device``, ``backend``, ``p2p_matching``
            (``"tags"`` or ``"ordered"``), ``p2p_pairs`` (ordered matching: the ``[sender,
            receiver]`` world-rank pairs with a group that include this rank), ``moe_layers``,
            ``expert_parallel`` and ``experts``.

        Raises:
            WorkerError: ``world_size != dp * pp``, a rank outside it, an unknown optimizer, a bad
                device / backend / ``p2p_matching`` combination, or (ordered matching) a pair whose
                receiver expects other messages than its sender sends.
            RuntimeNotSupported: ``tp > 1`` without the layer split, a placement the runtime cannot
                execute, or a backend other than gloo and nccl.
        """
        t0 = time.perf_counter()
        torch.set_num_threads(1)
        plan = self._check_plan()
        if self.config.release_freed_memory and not self._cuda:   # RSS follows the live tensors
            fix_mmap_threshold(MMAP_THRESHOLD)
        self.task = self._resolve_task(plan)
        init_default_group(self.config.backend, self.master_addr, self.master_port, self.rank, self.world_size,
                           float(self.config.timeout_s), self.device if self._cuda else None)
        modules, model_has_moe, tied_bytes, removed = self._build_stages(plan)
        self.local = self._parallelize(modules, model_has_moe)
        # loss scale of a micro-batch (CE and MoE aux): the optimizer sees sum_j grad(loss_j / m)
        # averaged over replicas (Adam/SGD), or AdamA's folded grad(loss_j / (dp * m))
        n_data = self.flow.num_micro_batches * len(self.flow.chains)   # per replica and step (X: two per instance)
        loss_scale = 1.0 / (self.dp * n_data) if self.optimizer_name == "adama" else 1.0 / n_data
        buffers = self._build_stream(plan, tied_bytes)
        if self.p2p_mode == "ordered":   # after this rank's checks: a rank whose stream fails them raises, not blocks
            connect_pairs(self.rank, self.groups.pairs, self.device, self.timeout)
        self.transport = self._build_exchange(buffers)
        self._build_optimizer(self._tied_copies())
        local_params = self.local.local_params()
        static_ptrs = {p.untyped_storage().data_ptr() for p in local_params} | buffers.storage_ptrs()
        self.ctx = ExecContext(coords=self.coords, flow=self.flow, local=self.local, transport=self.transport,
                               opt=self.opt, grad_sync=self.grad_sync, meter=ActivationMeter(static_ptrs),
                               loss=self.task.loss, loss_scale=loss_scale,
                               track_activations=self.config.track_activations)
        self._ready = True
        return {**self._setup_info(t0, local_params, removed), "memory_baseline": self._memory_baseline(local_params)}

    def _setup_info(self, t0: float, local_params: list[torch.Tensor], removed: list) -> dict:
        """What :meth:`setup` returns (see there)."""
        local = self.local
        return {
            "rank": self.rank, "pp_rank": self.pp_rank, "dp_index": self.dp_index, "tp_rank": self.tp_rank,
            "segments": list(local.segments), "params": sum(p.numel() for p in local_params),
            "param_bytes": sum(p.numel() * p.element_size() for p in local_params),
            "tensor_parallel": {s: dict(d) for s, d in local.tp_dims.items()},
            "loss_parallel": sorted(local.loss_parallel),
            "buffer_bytes": self.transport.buffers.nbytes, "num_buffers": self.transport.buffers.count,
            "stream_length": len(self.stream), "tied": [[list(x) for x in g] for g in self.tied],
            "removed": removed, "boundaries": [[m.to_dict() for m in b] for b in self.flow.boundaries],
            "optimizer": self.optimizer_name, "setup_time": time.perf_counter() - t0, "rss": rss(),
            "device": str(self.device), "backend": self.config.backend, "p2p_matching": self.p2p_mode,
            "p2p_pairs": [list(k) for k in sorted(self.groups.pairs)],
            "moe_layers": {s: [n for n, _ in local.moe_layers[s]] for s in local.segments if local.moe_layers[s]},
            "expert_parallel": local.ep,
            "experts": {n: (m.global_expert_ids() if isinstance(m, ExpertParallelMoE) else list(range(len(m.experts))))
                        for s in local.segments for n, m in local.moe_layers[s]},
        }

    def _memory_baseline(self, local_params: list[torch.Tensor]) -> int:
        """Bytes of this process's resident set that the plan's memory model does not count: the
        interpreter, torch, the model's libraries, traced graphs, process groups and receive
        buffers. The resident size after set-up (garbage collected, the heap trimmed:
        :func:`runtime.host_memory.trim_heap`) minus the tensors set-up allocated that the plan
        counts: parameters, the gradient buffers of the data-parallel sync and optimizer states.
        A step's ``peak_memory`` minus this is comparable with the plan's predicted peak."""
        gc.collect()
        trim_heap()
        counted = sum(p.numel() * p.element_size() for p in local_params) + self.grad_sync.buffer_bytes() \
            + self.opt.state_bytes()
        return max(0, rss() - counted)

    def _check_plan(self) -> Any:
        """Rebuild and check the plan, the world size, the rank, the device/matching options and the
        optimizer name; set the rank's coordinates. Returns the plan."""
        plan = Plan.from_dict(self.plan_dict, source="plan_dict")
        check_executable(plan)
        self.plan = plan
        self.coords = RankCoords(rank=self.rank, pp=plan.schedule.placement.num_devices, dp=plan.parallel.dp,
                                 tp=plan.parallel.tp)
        if self.world_size != self.dp * self.tp * self.pp:
            raise WorkerError(f"world_size {self.world_size} != dp * tp * pp = {self.dp} * {self.tp} * {self.pp}; "
                              "start one worker per (replica, tensor rank, pipeline rank)")
        if not 0 <= self.rank < self.world_size:
            raise WorkerError(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        self._resolve_device_and_matching()
        name = self.optimizer_name if self.optimizer_name is not None else plan.parallel.optimizer
        if name not in OPTIMIZERS:
            raise WorkerError(f"unknown optimizer {name!r}; use one of {', '.join(map(repr, OPTIMIZERS))}")
        if name == "adama" and self.tp > 1:
            raise WorkerError("optimizer 'adama' with tensor parallelism (tp > 1) is not supported; "
                              "use optimizer 'adam' or 'sgd', or tp = 1")
        self.optimizer_name = name
        check_transforms(plan.parallel.transforms)
        self.dp_shard = int(getattr(plan.parallel, "dp_shard", 1) or 1)
        if self.dp_shard > 1:   # FSDP2 (runtime.fsdp): check_executable refused the plan-level cases
            why = fsdp_refusal(precision=plan_policy(plan).name, optimizer=name, transforms=plan.parallel.transforms,
                               split=plan.model.split)
            if why:
                raise RuntimeNotSupported(why)
        why = precision_refusal(plan_policy(plan), device_type=self.device.type, optimizer=name,
                                transforms=plan.parallel.transforms)
        if why:
            raise RuntimeNotSupported(why)
        # CoCoNet's tensor-parallel transformations (runtime.tensor_parallel, runtime.worker.tp_comm)
        tf = set(plan.parallel.transforms) if self.tp > 1 else set()
        why = coconet_tp_refusal(tf, tp=self.tp, seq_len=int(plan.model.seq_len or 0))
        if why:
            raise RuntimeNotSupported(why)
        self.sequence_parallel = "tp-split" in tf   # boundaries are [B, T/tp, H] sequence shards
        self.scatter_send = "scatter-send" in tf and not self.sequence_parallel   # 1/tp slices + all-gather
        self.overlap_chunks = int(plan.parallel.overlap_chunks) if "chunked-overlap" in tf else 0
        if self._cuda:
            torch.cuda.set_device(self.device)
        return plan

    def _resolve_task(self, plan: Any) -> Any:
        """The plan's task (``plan.model.task``, :func:`engine.models.bundle.task_for_plan`): its ``loss`` is the last
        segment's loss and its ``num_inputs`` how many leading batch tensors are model inputs. The
        data seed does not matter here (the driver draws the batches). Raises ``engine.errors.TaskError``."""
        return task_for_plan(plan, seed=0)

    def _resolve_device_and_matching(self) -> None:
        """Check the config's ``backend``/``device``/``p2p_matching``/``sync_timing`` and set
        ``self.device``, ``self._cuda``, ``self.p2p_mode`` and ``self._sync``
        (:func:`runtime.worker.device.resolve_device`; its errors)."""
        cfg = self.config
        device_name = cfg.device if cfg.device is not None else ("cuda" if cfg.backend == "nccl" else "cpu")
        r = resolve_device(cfg.backend, device_name, cfg.p2p_matching, cfg.sync_timing)
        self.device = r.device
        self._cuda = r.device.type == "cuda"
        self.p2p_mode = r.p2p_mode
        self._sync = r.sync

    def _build_stages(self, plan: Any) -> tuple[dict[int, nn.Module], bool, list[int], list]:
        """Build the stage modules (:func:`runtime.stages.build_stages`), the placement's dataflow
        (:class:`~runtime.worker.dataflow.Dataflow`) and (ordered matching) every pair's send order.
        Returns this rank's stage modules, whether the model has MoE layers, the tied groups' bytes per
        copy and the pruned parameters."""
        stages = build_stages(plan, seed=int(self.config.seed))
        self.mbs = stages.micro_batch_size
        self.seq_len = stages.seq_len
        # tp-split: a boundary tensor is this tensor rank's sequence shard [B, T/tp, H]
        boundaries = ([[m.sequence_shard(self.tp) for m in b] for b in stages.boundaries]
                      if self.sequence_parallel else stages.boundaries)
        self.flow = Dataflow.from_plan(plan, boundaries)
        # tensors crossing each boundary forward / with a gradient back (one message each)
        self._counts = [(len(b), sum(1 for m in b if m.requires_grad)) for b in self.flow.boundaries]
        # every rank checks every pair alike, before any collective call
        ordered = self.p2p_mode == "ordered"
        self._pair_orders = pair_send_orders(self._peer_streams(plan), self._counts) if ordered else {}
        self.tied = stages.tied
        self.aliases = stages.aliases
        removed = [list(x) for x in stages.removed]
        # a segment runs on its forward's device set: several pipeline ranks = a tensor-parallel block
        devices = self.flow.seg_devices
        modules: dict[int, nn.Module] = {s: stages.modules[s] for s in sorted(devices) if self.pp_rank in devices[s]}
        tied_bytes = []   # bytes of one copy of each tied group (for the tied ALLREDUCE instructions)
        for group in self.tied:
            s0, n0 = group[0]
            p0 = dict(stages.modules[s0].named_parameters())[n0]
            tied_bytes.append(p0.numel() * p0.element_size())
        return modules, has_moe(stages.modules), tied_bytes, removed

    def _parallelize(self, modules: dict[int, nn.Module], model_has_moe: bool) -> LocalStages:
        """Create every process group (:func:`runtime.worker.groups.build_groups`, in the same order on
        every rank; the ordered pair groups are connected later, after :meth:`_build_stream`'s checks),
        shard each local stage over its tensor-parallel mesh, split the MoE layers over the EP group and
        move the stages to the device. Returns the rank's :class:`~runtime.worker.context.LocalStages`."""
        flow = self.flow
        expert_parallel = self.dp > 1 and model_has_moe
        if expert_parallel and self.optimizer_name == "adama":
            raise WorkerError(
                "optimizer 'adama' with expert parallelism (an MoE model with dp > 1) is not supported: "
                "AdamA folds each micro-batch gradient, but an expert's gradient mixes the replicas' "
                "micro-batches through the all-to-all; use optimizer 'adam' or 'sgd', or dp = 1")
        self.groups: ProcessGroups = build_groups(
            rank=self.rank, pp=self.pp, dp=self.dp, expert_parallel=expert_parallel, tied=self.tied,
            seg_rank={s: d[0] for s, d in flow.seg_devices.items()},
            pair_orders=self._pair_orders if self.p2p_mode == "ordered" else None, tp=self.tp,
            device_type=self.device.type, seg_devices=flow.seg_devices, dp_shard=self.dp_shard)
        # tensor parallelism: shard each local stage over this rank's TP group, or a multi-device
        # segment over the mesh of its device set (DTensor)
        tp_dims: dict[int, dict[str, int]] = {}
        # loss parallel: a sharded LM head keeps its logits vocab-sharded when the task's loss takes them
        loss_parallel: set[int] = set()
        for s, module in modules.items():
            mesh = self.groups.block_meshes.get(flow.seg_devices[s], self.groups.tp_mesh)
            # a multi-device segment without parameters (K's contrastive head) runs replicated
            if mesh is not None and any(True for _ in module.parameters()):
                lp = bool(self.task.vocab_parallel_loss) and s in flow.loss_segments and has_lm_head(module)
                tp_mesh = mesh is self.groups.tp_mesh   # CoCoNet's transformations: the plan's TP groups only
                tp_dims[s] = apply_tensor_parallel(
                    module, mesh, loss_parallel=lp, sequence_parallel=self.sequence_parallel and tp_mesh,
                    overlap_chunks=self.overlap_chunks if tp_mesh else 0,
                    tp_plan=getattr(self.plan.parallel, "tp_plan", None))
                if lp:
                    loss_parallel.add(s)
        # per local segment: (this rank's shard index, shards) of its tensor-parallel parameters
        shard = {s: ((flow.seg_devices[s].index(self.pp_rank), len(flow.seg_devices[s]))
                     if len(flow.seg_devices[s]) > 1 else (self.tp_rank, self.tp)) for s in modules}
        if expert_parallel:
            expert_parallelize(modules, self.dp, self.groups.ep)
        if self._cuda:
            for module in modules.values():
                module_to(module, self.device)
                retarget_device(module, self.device)   # traced factory calls say device=cpu
        unsharded = self._fully_shard(modules, model_has_moe)
        local = LocalStages.collect(modules, ep=self.dp if expert_parallel else 1, tp_dims=tp_dims, shard=shard,
                                    loss_parallel=loss_parallel)
        if unsharded:
            local.fsdp = set(unsharded)
            local.unsharded_bytes = unsharded
            local.fsdp_reshard = self.plan.parallel.resharded_after_forward
            local.fsdp_shards = (self.dp_index % self.dp_shard, self.dp_shard)
        return local

    def _fully_shard(self, modules: dict[int, nn.Module], model_has_moe: bool) -> dict[int, int]:
        """Fully sharded data parallelism (``dp_shard > 1``): each local stage sharded with FSDP2 over
        the data-parallel mesh (:func:`runtime.fsdp.apply_fsdp`; after tensor parallelism and the move
        to the device, as torchtitan orders them). Returns segment -> the bytes of its parameters on
        this rank before the sharding (what the rank's lowering counts, as for tensor parallelism's
        local shards); ``{}`` without FSDP. Raises :class:`RuntimeNotSupported` for MoE models."""
        if self.dp_shard <= 1:
            return {}
        why = fsdp_refusal(precision=plan_policy(self.plan).name, optimizer=str(self.optimizer_name),
                           transforms=self.plan.parallel.transforms, split=self.plan.model.split, moe=model_has_moe)
        if why:
            raise RuntimeNotSupported(why)
        out = {}
        for s, module in modules.items():
            out[s] = sum(local_tensor(p).numel() * p.element_size() for p in module.parameters())
            apply_fsdp(module, self.groups.fsdp_mesh, policy=plan_policy(self.plan),
                       reshard_after_forward=self.plan.parallel.resharded_after_forward)
        return out

    def _peer_streams(self, plan: Any) -> list[list[Instruction]]:
        """Every pipeline rank's stream as far as point-to-point goes: the order in which each rank
        posts its SENDs (and the RECVs it expects), ``engine.dependency.lower(plan.schedule, dp=dp)``.
        The byte arguments :func:`~runtime.worker.lowering.local_stream` adds change no SEND or RECV,
        only costs and the collectives between them (:func:`check_own_stream` verifies this rank's). Every rank
        computes the same list, which is what lets it post receives in its peers' send order."""
        return lower(plan.schedule, dp=self.dp).streams

    def _grad_producer(self, c: int) -> int:
        """The producer of segment ``c`` whose backward runs on this pipeline rank
        (:meth:`Dataflow.grad_producer <runtime.worker.dataflow.Dataflow.grad_producer>`)."""
        return self.flow.grad_producer(c, self.pp_rank)

    def _build_stream(self, plan: Any, tied_bytes: list[int]) -> ReceiveBuffers:
        """This rank's stream (:func:`~runtime.worker.lowering.local_stream`), checked, and the index
        after which ``on_sync_start`` fires; returns the receive buffers."""
        self.stream: list[Instruction] = local_stream(plan, local=self.local, coords=self.coords, tied=self.tied,
                                                      tied_bytes=tied_bytes, optimizer_name=self.optimizer_name,
                                                      tokens=self.mbs * self.seq_len)
        if self.local.fsdp:   # the backward blocks after which FSDP reduces each segment's gradients
            self.local.fsdp_reduce = reducing_blocks(self.stream, self.local.fsdp)
        for ins in self.stream:
            if ins.op in COMPUTE_OPS and (ins.block is None or ins.block.segment not in self.local.modules):
                seg = ins.block.segment if ins.block is not None else None
                raise WorkerError(f"pipeline rank {self.pp_rank}'s stream runs {ins} but segment "
                                  f"{seg} is not placed here")
        # on_sync_start fires after this instruction: the ALLREDUCE after the last compute (or that compute)
        last_compute = max((i for i, ins in enumerate(self.stream) if ins.op in COMPUTE_OPS), default=-1)
        self._sync_index = next((i for i in range(last_compute + 1, len(self.stream))
                                 if self.stream[i].op in (Op.ALLREDUCE, Op.REDUCESCATTER)), last_compute)
        if self.p2p_mode == "ordered":   # the real stream sends in the order its peers were told
            check_own_stream(self.stream, self.pp_rank, self._pair_orders, self._counts)
        device = self.device
        return ReceiveBuffers(self.stream, self.flow.boundaries, lambda meta: empty_on(meta, device),
                              grad_boundary=self._grad_producer, wire_parts=self.tp if self.scatter_send else 1)

    def _build_exchange(self, buffers: ReceiveBuffers) -> Transport:
        """The point-to-point matcher over ``buffers``, and the rank's :class:`~runtime.worker.context.Transport`."""
        max_tensors = max([len(x) for x in self.flow.boundaries] + [1])
        m = self.flow.num_micro_batches
        if self.p2p_mode == "ordered":
            p2p: P2PMatcher = OrderedMatching(self.rank, self.pp, buffers, m, max_tensors, self.groups.pairs,
                                              self._pair_orders)
        else:
            p2p = TagMatching(self.rank, self.pp, buffers, m, max_tensors)
        p2p.grad_boundary = self._grad_producer
        if self.scatter_send:   # each tensor rank sends its 1/tp slice; the receivers all-gather (tp_comm)
            p2p.wire_slice = (self.tp, self.tp_rank)
        return Transport(device=self.device, sync=self._sync, timeout=self.timeout, groups=self.groups,
                         buffers=buffers, p2p=p2p)

    def _tied_copies(self) -> list[TiedCopies]:
        """This rank's copies of each tied group it holds, with a zero gradient buffer of the global shape."""
        named = {(s, n): p for s in self.local.segments for n, p in self.local.modules[s].named_parameters()}
        out: list[TiedCopies] = []
        for i, g, pranks in self.groups.tied:
            group = self.tied[i]
            mine = [named[(s, n)] for s, n in group if (s, n) in named]
            label = "+".join(f"s{s}:{n}" for s, n in group)
            full = torch.zeros(mine[0].shape, dtype=mine[0].dtype, device=self.device)   # global shape
            out.append(TiedCopies(g, mine, full, label, pranks))
        return out

    def _build_optimizer(self, tied_local: list[TiedCopies]) -> None:
        """The optimizer (:attr:`opt`, a :class:`~runtime.worker.optimizer.WorkerOptimizer`) and the
        gradient collectives (:attr:`grad_sync`, a :class:`~runtime.worker.grad_sync.GradientSync`) over
        ``tied_local``."""
        assert self.optimizer_name is not None
        par = self.plan.parallel   # CoCoNet's sharded-update / overlap-grad-sync (runtime.worker.grad_sync)
        why = transform_refusal(par.transforms, optimizer=self.optimizer_name, dp=self.dp, expert_parallel=self.ep > 1)
        if why:
            raise RuntimeNotSupported(why)
        tied_ids = {id(p) for tc in tied_local for p in tc.params}
        self.opt = WorkerOptimizer(self.optimizer_name, float(self.config.lr), self.local.params, tied_ids, self.dp,
                                   self.device, sharded="sharded-update" in par.transforms, shard_index=self.dp_index,
                                   fused=fused_adam(self.tp, self.dp_shard))
        if plan_policy(self.plan).loss_scaling:   # 16-mixed: one loss scale, its skips agreed by every rank
            group = dist.new_group(list(range(self.world_size)), timeout=self.timeout)
            self.opt.scaler = LossScaler(self.device.type, group, init_scale=float(self.config.init_loss_scale))
        # FSDP reduces its segments' gradients itself: the data-parallel all-reduce leaves them out
        dp_params = {s: [] if s in self.local.fsdp else ps for s, ps in self.local.dp_params.items()}
        self.grad_sync = GradientSync(self.rank, self.dp, self.groups.dp, self.opt, dp_params, tied_local,
                                      self.device, self._sync, self.timeout, stream=self.stream,
                                      bucket_bytes=par.grad_bucket_bytes, local_tied=bool(self.local.fsdp))

    def receive_buffers(self) -> dict[str, torch.Tensor]:
        """The pre-allocated receive buffers by name (``"act b1 mb0 t0"``, ``"grad b1 mb0 t0"``);
        the same tensor objects every step (tests compare their ``data_ptr``)."""
        return self.transport.buffers.by_name()

    def _split_batch(self, batch: Any, per_replica: int | None = None
                     ) -> tuple[list[MicroBatch], list[MicroBatch]]:
        """This replica's ``(inputs, targets)`` micro-batches, tuples of tensors each
        (:func:`runtime.worker.batches.split_batch` with the task's ``num_inputs``).
        Raises :class:`WorkerError` before setup or for a batch of the wrong shape."""
        if not self._ready:
            raise WorkerError("call setup() before step()/evaluate()")
        return split_batch(batch, dp=self.dp, dp_index=self.dp_index, mbs=self.mbs, seq_len=self.seq_len,
                           per_replica=per_replica, device=self.device if self._cuda else None,
                           num_inputs=self.task.num_inputs)

    def _checkpoint_source(self) -> CheckpointSource:
        """What :meth:`state_dict` saves and :meth:`load_state_dict` restores."""
        return CheckpointSource(rank=self.rank, pp_rank=self.pp_rank, dp_index=self.dp_index,
                                segments=self.local.segments, modules=self.local.modules, opt=self.opt,
                                aliases=self.aliases, tp_dims=self.local.tp_dims, seg_shard=self.local.shard,
                                fsdp=self.local.fsdp, fsdp_shards=self.local.fsdp_shards)

    # ------------------------------------------------------------------ step, evaluate, checkpoints
    def step(self, step: int, batch: Any) -> dict:
        """Run one training step (all ``m`` micro-batches of this replica, then the optimizer).

        Args:
            step: step number (only used for ``fail_at`` and the result).
            batch: the GLOBAL batch, identical on every rank: the plan's task's tuple
                ``(*inputs, *targets)`` (``task.train_batch(step, dp * m * micro_batch_size)``), every
                tensor with first dimension ``dp * m * micro_batch_size``; or, for causal-lm, the
                legacy int64 ``[dp * m * micro_batch_size, seq_len + 1]`` (inputs ``[:, :-1]``,
                targets ``[:, 1:]``). Replica ``d`` takes rows ``d*m*mbs .. (d+1)*m*mbs - 1`` of every
                tensor and its micro-batch ``j`` the ``j``-th ``mbs`` rows of those.

        Returns:
            ``losses``: per micro-batch the task's loss (``task.loss``; mean cross-entropy in
            nats/token for the language tasks; NOT divided by ``m``) in micro-batch order on the
            rank holding the last segment, else ``[]``; ``events``:
            ``Event.to_dict()`` per executed instruction; ``rank``, ``pp_rank``, ``dp_index``,
            ``step``; ``time`` (s); ``start`` (``time.perf_counter()`` at the step's start, the
            origin of the events' times); ``peak_memory`` (bytes, max process RSS sampled after
            every instruction); ``memory`` (``[[t, rss_bytes], ...]``, ``t`` in s from ``start``);
            ``activation_memory`` (``[[t, bytes], ...]``) and ``peak_activation_memory`` (bytes,
            tensor accounting); ``peak_grad_memory`` (bytes of parameter gradients held, sampled
            with ``track_activations`` after every instruction that can grow them, ``B``/``I``/``W``/
            ``ALLREDUCE``: the whole segment with Adam/SGD, only the tied copies with AdamA).
            Ranks whose segments hold MoE layers add ``aux_losses`` (per micro-batch, the sum of
            their layers' weighted aux losses, unscaled) and ``moe`` (routing metrics); the events
            then include one ``ALLTOALL`` per all-to-all. On CUDA also ``device_memory``
            (``[[t, bytes], ...]``, ``torch.cuda.memory_allocated`` after every instruction) and
            ``peak_device_memory`` (bytes). Details: ``docs/runtime-worker.md``, "Instrumentation".

        Raises:
            StepError: (a ``RuntimeError``) ``"rank R (pipeline rank P, replica D) failed at step
                S, instruction I (INS): ..."`` chained to the cause.
            WorkerError: not set up, or a batch of the wrong shape.
        """
        per_replica = self.flow.num_micro_batches * len(self.flow.chains)   # X: two data micro-batches per instance
        model_inputs, targets = self._split_batch(batch, per_replica=per_replica)
        return run_step(self.ctx, self.stream, step, model_inputs, targets, config=self.config,
                        sync_index=self._sync_index)

    @torch.no_grad()
    def evaluate(self, batch: Any) -> float | None:
        """Forward-only loss on a global batch.

        Args:
            batch: a global batch as in :meth:`step` (a task tuple or the legacy causal-lm tensor)
                with first dimension ``dp * k * micro_batch_size`` for any ``k >= 1``, the same on
                every rank (replica ``d`` takes its ``k`` micro-batches as in :meth:`step`).

        Returns:
            On ranks holding the last segment: the mean task loss (nats/token for text) over all
            ``dp * k`` micro-batches (averaged across replicas with an all-reduce); ``None`` elsewhere.

        Raises:
            WorkerError: not set up, or a batch of the wrong shape.
            RuntimeError: the forward or a transfer failed (naming the rank).
        """
        model_inputs, targets = self._split_batch(batch)
        if self.config.on_compute_start is not None:
            self.config.on_compute_start(None)
        total = evaluate_loss(model_inputs, targets, coords=self.coords, flow=self.flow, local=self.local,
                              transport=self.transport, loss=self.task.loss)
        for s in self.local.fsdp:   # FSDP: the sharded parameters registered again (checkpoints read them)
            reshard_all(self.local.modules[s])
        if self.config.on_sync_start is not None:
            self.config.on_sync_start(None)
        if not self.ctx.has_loss:
            return None
        mean = torch.tensor([total / len(model_inputs)], dtype=torch.float64,
                            device=self.device if self._cuda else None)
        if self.dp > 1:
            dist.all_reduce(mean, group=self.groups.dp)
            mean /= self.dp
        return float(mean)

    def state_dict(self) -> dict:
        """This rank's model shards and optimizer state (plain tensors and dicts, CPU copies).

        ``{"rank", "pp_rank", "dp_index", "segments": {segment: {param name: tensor}},
        "optimizer": torch optimizer state_dict or None}``. Parameter names are the original
        model's; tied copies appear under each holder's name; with expert parallelism each replica
        saves only its own experts, under their GLOBAL names (HF MoE blocks: the rows ``[d*E/dp,
        (d+1)*E/dp)`` of each 3-D expert weight under the unsplit name, listed in ``expert_slices``), so
        :func:`~runtime.worker.state.merge_model_state` of all ranks' states is the unsplit model's
        ``state_dict``. Every tensor is a CPU tensor, also on CUDA. Raises :class:`WorkerError`
        before setup.
        """
        if not self._ready:
            raise WorkerError("call setup() before state_dict()")
        return worker_state(self._checkpoint_source(), compact=self._cuda)

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict` output (strict: every parameter of every local segment),
        copying CPU tensors onto this worker's device.

        Raises:
            WorkerError: not set up, or the checkpoint belongs to other segments.
        """
        if not self._ready:
            raise WorkerError("call setup() before load_state_dict()")
        load_worker_state(self._checkpoint_source(), sd)

    def shutdown(self) -> None:
        """Remove the AdamA fold hooks and the gradient-bucket hooks and destroy the process group
        (idempotent); with ``owns_process_group=False`` the default process group is left to its owner."""
        opt = getattr(self, "opt", None)
        if opt is not None:
            opt.remove_hooks()
        if getattr(self, "grad_sync", None) is not None:   # overlap-grad-sync's gradient hooks
            self.grad_sync.remove_hooks()
        if self.config.owns_process_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self._ready = False
