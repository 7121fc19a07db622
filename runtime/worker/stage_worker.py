"""StageWorker: one rank of a pipelined (and data-parallel) training run, composed of the
package's parts (groups, p2p, buffers, optimizer, interpreter, metrics). Design and lifecycle:
``docs/runtime-worker.md``."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.dependency import COMPUTE_OPS, Instruction, Op, lower
from engine.models.moe.layer import MoEFeedForward
from runtime.expert_parallel import ExpertParallelMoE, is_expert_param
from runtime.tensor_parallel import apply_tensor_parallel, coconet_tp_refusal, has_lm_head, local_tensor
from runtime.worker.batches import MicroBatch, split_batch
from runtime.worker.buffers import ReceiveBuffers
from runtime.worker.config import EXECUTED_TRANSFORMS, OPTIMIZERS, WorkerConfig
from runtime.worker.device import module_to, resolve_device
from runtime.worker.errors import WorkerError
from runtime.worker.evaluation import evaluate_loss
from runtime.worker.grad_sync import GradientSync, TiedCopies, transform_refusal
from runtime.worker.groups import ProcessGroups, build_groups, connect_pairs, init_default_group
from runtime.worker.lowering import local_stream
from runtime.worker.metrics import ActivationMeter, rss
from runtime.worker.moe import expert_parallel_layers, expert_parallelize, has_moe
from runtime.worker.optimizer import WorkerOptimizer
from runtime.worker.p2p import OrderedMatching, P2PMatcher, TagMatching
from runtime.worker.p2p_order import check_own_stream, pair_send_orders
from runtime.worker.state import load_worker_state, worker_state
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

    # ------------------------------------------------------------------ views kept for callers and tests
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
        self.task = self._resolve_task(plan)
        init_default_group(self.config.backend, self.master_addr, self.master_port, self.rank, self.world_size,
                           float(self.config.timeout_s), self.device if self._cuda else None)
        tied_bytes, removed = self._build_stages(plan)
        self.moe_layers = {s: [(n, m) for n, m in self.modules[s].named_modules() if isinstance(m, MoEFeedForward)]
                           for s in self.segments}
        # ExpertParallelMoE layers and the HFExpertParallel experts of HF MoE blocks (their comm_log)
        self.ep_layers: list[Any] = expert_parallel_layers(self.modules)
        if self._cuda:
            from runtime.stage import retarget_device
            for s in self.segments:
                module_to(self.modules[s], self.device)
                retarget_device(self.modules[s], self.device)   # traced factory calls say device=cpu
        self.seg_params = {s: [p for p in self.modules[s].parameters()] for s in self.segments}
        # this rank's bytes: a tensor-parallel parameter (DTensor) counts its local shard
        self._local_params = [local_tensor(p) for s in self.segments for p in self.seg_params[s]]
        # expert parameters (each owned by one replica) stay out of the data-parallel all-reduce
        self.dp_params = {s: [p for p in self.seg_params[s] if not is_expert_param(p)] for s in self.segments}
        self.expert_params = [p for s in self.segments for p in self.seg_params[s] if is_expert_param(p)]
        # loss scale of a micro-batch (CE and MoE aux): the optimizer sees sum_j grad(loss_j / m)
        # averaged over replicas (Adam/SGD), or AdamA's folded grad(loss_j / (dp * m))
        n_data = self.m * len(self.chains)   # data micro-batches per replica and step (X: two per instance)
        self.loss_scale = 1.0 / (self.dp * n_data) if self.optimizer_name == "adama" else 1.0 / n_data
        self._build_stream(plan, tied_bytes)
        if self.p2p_mode == "ordered":   # after this rank's checks: a rank whose stream fails them raises, not blocks
            connect_pairs(self.rank, self.groups.pairs, self.device, self.timeout)
        self._build_exchange()
        self._build_optimizer()
        static_ptrs = {p.untyped_storage().data_ptr() for p in self._local_params} | self.buffers.storage_ptrs()
        self.meter = ActivationMeter(static_ptrs)
        self._ready = True
        return {
            "rank": self.rank, "pp_rank": self.pp_rank, "dp_index": self.dp_index, "tp_rank": self.tp_rank,
            "segments": list(self.segments), "params": sum(p.numel() for p in self._local_params),
            "param_bytes": sum(p.numel() * p.element_size() for p in self._local_params),
            "tensor_parallel": {s: dict(d) for s, d in self.tp_dims.items()},
            "loss_parallel": sorted(self.loss_parallel_segments),
            "buffer_bytes": self.buffers.nbytes, "num_buffers": self.buffers.count,
            "stream_length": len(self.stream), "tied": [[list(x) for x in g] for g in self.tied],
            "removed": removed, "boundaries": [[m.to_dict() for m in b] for b in self.boundaries],
            "optimizer": self.optimizer_name, "setup_time": time.perf_counter() - t0, "rss": rss(),
            "device": str(self.device), "backend": self.config.backend, "p2p_matching": self.p2p_mode,
            "p2p_pairs": [list(k) for k in sorted(self.groups.pairs)],
            "moe_layers": {s: [n for n, _ in self.moe_layers[s]] for s in self.segments if self.moe_layers[s]},
            "expert_parallel": self.ep,
            "experts": {n: (m.global_expert_ids() if isinstance(m, ExpertParallelMoE) else list(range(len(m.experts))))
                        for s in self.segments for n, m in self.moe_layers[s]},
        }

    def _check_plan(self) -> Any:
        """Rebuild and check the plan, the world size, the rank, the device/matching options and the
        optimizer name; set the rank's coordinates. Returns the plan."""
        from engine.io.plan import Plan
        from runtime.stage import check_executable

        plan = Plan.from_dict(self.plan_dict, source="plan_dict")
        check_executable(plan)
        self.plan = plan
        pl = plan.schedule.placement
        self.pp = pl.num_devices
        self.dp = plan.parallel.dp
        self.tp = plan.parallel.tp
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
        missing = [t for t in plan.parallel.transforms if t not in EXECUTED_TRANSFORMS]
        if missing:
            from runtime.stage import RuntimeNotSupported

            raise RuntimeNotSupported(f"the runtime does not execute the transformation {missing[0]!r} yet; plan "
                                      f"without it (executed: {', '.join(sorted(EXECUTED_TRANSFORMS)) or 'none'})")
        # CoCoNet's tensor-parallel transformations (runtime.tensor_parallel, runtime.worker.tp_comm)
        tf = set(plan.parallel.transforms) if self.tp > 1 else set()
        why = coconet_tp_refusal(tf, tp=self.tp, seq_len=int(plan.model.seq_len or 0))
        if why:
            from runtime.stage import RuntimeNotSupported

            raise RuntimeNotSupported(why)
        self.sequence_parallel = "tp-split" in tf   # boundaries are [B, T/tp, H] sequence shards
        self.scatter_send = "scatter-send" in tf and not self.sequence_parallel   # 1/tp slices + all-gather
        self.overlap_chunks = int(plan.parallel.overlap_chunks) if "chunked-overlap" in tf else 0
        self.pp_rank = self.rank % self.pp
        self.replica = self.rank // self.pp   # pipeline replica: the ranks exchanging p2p (groups.py)
        self.dp_index = self.replica // self.tp
        self.tp_rank = self.replica % self.tp
        self.m = int(plan.schedule.num_micro_batches)
        self.S = pl.num_segments
        if self._cuda:
            torch.cuda.set_device(self.device)
        return plan

    def _resolve_task(self, plan: Any) -> Any:
        """The plan's task (``plan.model.task``, :func:`tasks.task_for_plan`): its ``loss`` is the last
        segment's loss and its ``num_inputs`` how many leading batch tensors are model inputs. The
        data seed does not matter here (the driver draws the batches). Raises ``tasks.TaskError``."""
        from engine.models import task_for_plan

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

    def _build_stages(self, plan: Any) -> tuple[list[int], list]:
        """Build the stage modules (``runtime.stage.build_stages``), keep this rank's, create every
        process group (:func:`runtime.worker.groups.build_groups`; the ordered pair groups are
        connected later, after :meth:`_build_stream`'s checks) and split the MoE layers over the
        EP group. Returns the tied groups' bytes per copy and the pruned parameters."""
        from runtime.stage import build_stages

        pl = plan.schedule.placement
        stages = build_stages(plan, seed=int(self.config.seed))
        self.mbs = stages.micro_batch_size
        self.seq_len = stages.seq_len
        # tp-split: a boundary tensor is this tensor rank's sequence shard [B, T/tp, H]
        self.boundaries = ([[m.sequence_shard(self.tp) for m in b] for b in stages.boundaries]
                           if self.sequence_parallel else stages.boundaries)
        # tensors crossing each boundary forward / with a gradient back (one message each)
        self._counts = [(len(b), sum(1 for m in b if m.requires_grad)) for b in self.boundaries]
        ordered = self.p2p_mode == "ordered"
        # every rank checks every pair alike, before any collective call
        self._pair_orders = pair_send_orders(self._peer_streams(plan), self._counts) if ordered else {}
        self.tied = stages.tied
        self._dataflow(plan)
        self.aliases = stages.aliases
        removed = [list(x) for x in stages.removed]
        # a segment runs on its forward's device set: several pipeline ranks = a tensor-parallel block
        self.seg_devices = {s: tuple(pl.spec("F", s).devices) for s in range(self.S)}
        self.seg_rank = {s: d[0] for s, d in self.seg_devices.items()}
        self.segments = sorted(s for s in range(self.S) if self.pp_rank in self.seg_devices[s])
        self.modules = {s: stages.modules[s] for s in self.segments}
        model_has_moe = has_moe(stages.modules)   # MoEFeedForward layers or HF sparse MoE blocks
        tied_bytes = []   # bytes of one copy of each tied group (for the tied ALLREDUCE instructions)
        for group in self.tied:
            s0, n0 = group[0]
            p0 = dict(stages.modules[s0].named_parameters())[n0]
            tied_bytes.append(p0.numel() * p0.element_size())
        del stages
        expert_parallel = self.dp > 1 and model_has_moe
        if expert_parallel and self.optimizer_name == "adama":
            raise WorkerError(
                "optimizer 'adama' with expert parallelism (an MoE model with dp > 1) is not supported: "
                "AdamA folds each micro-batch gradient, but an expert's gradient mixes the replicas' "
                "micro-batches through the all-to-all; use optimizer 'adam' or 'sgd', or dp = 1")
        self.groups: ProcessGroups = build_groups(
            rank=self.rank, pp=self.pp, dp=self.dp, expert_parallel=expert_parallel, tied=self.tied,
            seg_rank=self.seg_rank, pair_orders=self._pair_orders if ordered else None, tp=self.tp,
            device_type=self.device.type, seg_devices=self.seg_devices)
        # tensor parallelism: shard each local stage over this rank's TP group, or a multi-device
        # segment over the mesh of its device set (DTensor)
        self.tp_dims: dict[int, dict[str, int]] = {}
        # loss parallel: a sharded LM head keeps its logits vocab-sharded when the task's loss takes them
        self.loss_parallel_segments: set[int] = set()
        for s in self.segments:
            mesh = self.groups.block_meshes.get(self.seg_devices[s], self.groups.tp_mesh)
            # a multi-device segment without parameters (K's contrastive head) runs replicated
            if mesh is not None and any(True for _ in self.modules[s].parameters()):
                lp = bool(self.task.vocab_parallel_loss) and s in self.loss_segments and has_lm_head(self.modules[s])
                tp_mesh = mesh is self.groups.tp_mesh   # CoCoNet's transformations: the plan's TP groups only
                self.tp_dims[s] = apply_tensor_parallel(
                    self.modules[s], mesh, loss_parallel=lp, sequence_parallel=self.sequence_parallel and tp_mesh,
                    overlap_chunks=self.overlap_chunks if tp_mesh else 0)
                if lp:
                    self.loss_parallel_segments.add(s)
        # per local segment: (this rank's shard index, shards) of its tensor-parallel parameters
        self.seg_shard = {s: ((self.seg_devices[s].index(self.pp_rank), len(self.seg_devices[s]))
                              if len(self.seg_devices[s]) > 1 else (self.tp_rank, self.tp)) for s in self.segments}
        self.ep = self.dp if expert_parallel else 1
        if expert_parallel:
            expert_parallelize(self.modules, self.dp, self.groups.ep)
        return tied_bytes, removed

    def _dataflow(self, plan: Any) -> None:
        """The placement's forward DAG between segments: ``preds[s]`` (the segments whose outputs
        ``s`` takes, in order), ``succ[s]`` (the one segment taking ``s``'s outputs, ``None`` for a
        loss segment), the input and loss segments, the model inputs of each input segment
        (``seg_inputs``: the plan segment's ``inputs`` indices, e.g. one tower's ids in K; default
        all), each segment's input metas and, per consumer, which slice of its input gradients
        belongs to which producer (``grad_slices``). A chain has ``preds[s] == [s - 1]``. Model
        replicas (X) are chains too: ``chains``/``chain_of`` say which data micro-batch each carries."""
        pl = plan.schedule.placement
        self.preds = {s: [pl.blocks[i].segment for i in pl.spec("F", s).deps] for s in range(self.S)}
        self.succ: dict[int, int | None] = {s: None for s in range(self.S)}
        for c, ps in self.preds.items():
            for p in ps:
                self.succ[p] = c
        self.input_segments = {s for s, ps in self.preds.items() if not ps}
        self.loss_segments = {s for s, c in self.succ.items() if c is None}
        self.chains = pl.replica_chains()
        self.chain_of = {s: c for c, chain in enumerate(self.chains) for s in chain}
        self.seg_inputs = {int(g["index"]): [int(k) for k in g["inputs"]] for g in plan.segments
                           if g.get("inputs") is not None}
        self.in_metas = {c: [m for p in ps for m in self.boundaries[p]] for c, ps in self.preds.items()}
        self.grad_slices: dict[int, dict[int, tuple[int, int]]] = {}
        for c, ps in self.preds.items():
            at, sl = 0, {}
            for p in ps:
                k = sum(1 for m in self.boundaries[p] if m.requires_grad)
                sl[p] = (at, at + k)
                at += k
            self.grad_slices[c] = sl

    def grad_producer(self, c: int, pp_rank: int | None = None) -> int:
        """The producer of segment ``c`` whose backward runs on pipeline rank ``pp_rank`` (this rank by
        default): where ``c``'s backward sends, or from where this rank receives, input gradients.
        Raises :class:`WorkerError` when none does."""
        rank = self.pp_rank if pp_rank is None else pp_rank
        for p in self.preds[c]:
            if rank in self.seg_devices[p]:
                return p
        raise WorkerError(f"segment {c}'s backward sends input gradients to pipeline rank {rank}, which runs none "
                          f"of its producers {self.preds[c]}")

    def _peer_streams(self, plan: Any) -> list[list[Instruction]]:
        """Every pipeline rank's stream as far as point-to-point goes: the order in which each rank
        posts its SENDs (and the RECVs it expects), ``engine.dependency.lower(plan.schedule, dp=dp)``.
        The byte arguments :func:`~runtime.worker.lowering.local_stream` adds change no SEND or RECV,
        only costs and the collectives between them (:func:`check_own_stream` verifies this rank's). Every rank
        computes the same list, which is what lets it post receives in its peers' send order."""
        return lower(plan.schedule, dp=self.dp).streams

    def _build_stream(self, plan: Any, tied_bytes: list[int]) -> None:
        """This rank's stream (:func:`~runtime.worker.lowering.local_stream`), checked; the index
        after which ``on_sync_start`` fires; the receive buffers."""
        self.stream: list[Instruction] = local_stream(self, plan, tied_bytes)
        for ins in self.stream:
            if ins.op in COMPUTE_OPS and (ins.block is None or ins.block.segment not in self.modules):
                seg = ins.block.segment if ins.block is not None else None
                raise WorkerError(f"pipeline rank {self.pp_rank}'s stream runs {ins} but segment "
                                  f"{seg} is not placed here")
        # on_sync_start fires after this instruction: the ALLREDUCE after the last compute (or that compute)
        last_compute = max((i for i, ins in enumerate(self.stream) if ins.op in COMPUTE_OPS), default=-1)
        self._sync_index = next((i for i in range(last_compute + 1, len(self.stream))
                                 if self.stream[i].op in (Op.ALLREDUCE, Op.REDUCESCATTER)), last_compute)
        if self.p2p_mode == "ordered":   # the real stream sends in the order its peers were told
            check_own_stream(self.stream, self.pp_rank, self._pair_orders, self._counts)
        self.buffers = ReceiveBuffers(self.stream, self.boundaries, self._empty, grad_boundary=self.grad_producer,
                                      wire_parts=self.tp if self.scatter_send else 1)
        self._max_tensors = max([len(x) for x in self.boundaries] + [1])

    def _build_exchange(self) -> None:
        """The point-to-point matcher and the local tied groups' copies and gradient buffers."""
        if self.p2p_mode == "ordered":
            self.p2p: P2PMatcher = OrderedMatching(self.rank, self.pp, self.buffers, self.m, self._max_tensors,
                                                   self.groups.pairs, self._pair_orders)
        else:
            self.p2p = TagMatching(self.rank, self.pp, self.buffers, self.m, self._max_tensors)
        self.p2p.grad_boundary = self.grad_producer
        if self.scatter_send:   # each tensor rank sends its 1/tp slice; the receivers all-gather (tp_comm)
            self.p2p.wire_slice = (self.tp, self.tp_rank)
        named = {(s, n): p for s in self.segments for n, p in self.modules[s].named_parameters()}
        self.tied_local: list[TiedCopies] = []
        for i, g, pranks in self.groups.tied:
            group = self.tied[i]
            mine = [named[(s, n)] for s, n in group if (s, n) in named]
            label = "+".join(f"s{s}:{n}" for s, n in group)
            full = torch.zeros(mine[0].shape, dtype=mine[0].dtype, device=self.device)   # global shape
            self.tied_local.append(TiedCopies(g, mine, full, label, pranks))

    def _build_optimizer(self) -> None:
        """The optimizer (:class:`~runtime.worker.optimizer.WorkerOptimizer`) and the gradient
        collectives (:class:`~runtime.worker.grad_sync.GradientSync`)."""
        assert self.optimizer_name is not None
        par = self.plan.parallel   # CoCoNet's sharded-update / overlap-grad-sync (runtime.worker.grad_sync)
        why = transform_refusal(par.transforms, optimizer=self.optimizer_name, dp=self.dp, expert_parallel=self.ep > 1)
        if why:
            from runtime.stage import RuntimeNotSupported

            raise RuntimeNotSupported(why)
        tied_ids = {id(p) for tc in self.tied_local for p in tc.params}
        self.opt = WorkerOptimizer(self.optimizer_name, float(self.config.lr), self.seg_params, tied_ids, self.dp,
                                   self.device, sharded="sharded-update" in par.transforms, shard_index=self.dp_index)
        self.grad_sync = GradientSync(self.rank, self.dp, self.groups.dp, self.opt, self.dp_params, self.tied_local,
                                      self.device, self._sync, self.timeout, stream=self.stream,
                                      bucket_bytes=par.grad_bucket_bytes)

    def _empty(self, meta: Any) -> torch.Tensor:
        """An uninitialised tensor of ``meta``'s shape and dtype on this worker's device."""
        if not self._cuda:
            return meta.empty()
        return torch.empty(meta.shape, dtype=meta.dtype, device=self.device)

    @property
    def last_segment(self) -> int:
        """The first chain's last segment (it computes the loss; every chain's last segment does,
        :attr:`loss_segments`)."""
        return self.chains[0][-1]

    @property
    def has_loss(self) -> bool:
        """This rank runs the last segment."""
        return any(s in self.modules for s in self.loss_segments)

    def data_index(self, s: int, j: int) -> int:
        """The data micro-batch that placement instance ``j`` carries through segment ``s``: ``j`` on the
        first chain, ``c * m + j`` on chain ``c`` (the X shape's second model replica)."""
        return self.chain_of[s] * self.m + j

    def receive_buffers(self) -> dict[str, torch.Tensor]:
        """The pre-allocated receive buffers by name (``"act b1 mb0 t0"``, ``"grad b1 mb0 t0"``);
        the same tensor objects every step (tests compare their ``data_ptr``)."""
        return self.buffers.by_name()

    def _grad_bytes(self) -> int:
        return sum(local_tensor(p.grad).numel() * p.grad.element_size() for ps in self.seg_params.values()
                   for p in ps if p.grad is not None)

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
        model_inputs, targets = self._split_batch(batch, per_replica=self.m * len(self.chains))
        return run_step(self, step, model_inputs, targets)

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
        total = evaluate_loss(self, model_inputs, targets)
        if self.config.on_sync_start is not None:
            self.config.on_sync_start(None)
        if not self.has_loss:
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
        return worker_state(self)

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict` output (strict: every parameter of every local segment),
        copying CPU tensors onto this worker's device.

        Raises:
            WorkerError: not set up, or the checkpoint belongs to other segments.
        """
        if not self._ready:
            raise WorkerError("call setup() before load_state_dict()")
        load_worker_state(self, sd)

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
