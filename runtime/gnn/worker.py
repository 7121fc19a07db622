"""One rank of a GNN launch: a Ray actor class that trains its share of a GNN plan (docs/gnn.md).

:class:`GNNWorker` is a plain class; :func:`runtime.cluster.create_actors` wraps it with
``ray.remote`` (one actor per plan device). ``setup()`` joins the default process group over TCP
(gloo on CPU; NCCL with the actor's one GPU, which Ray exposes as ``cuda:0``), builds the model
(``torch.manual_seed(plan.seed)`` then :func:`engine.gnn.models.build_gnn`, so every rank starts
from the same parameters), an Adam optimizer and a
:class:`~runtime.gnn.distributed.DistributedStreamedGNN` over the partition the launcher built;
``train_epoch(epoch)`` runs one full-graph training step (an epoch) and reports the loss, the
accuracies, the seconds and, on request, the measured records. Sources: Ray actors
(https://docs.ray.io/en/latest/ray-core/actors.html), ``torch.distributed``.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist

from engine.errors import GNNError
from engine.gnn.models import build_gnn
from engine.gnn.plan import GNNPlan
from runtime.gnn.distributed import CollectiveRecord, DistributedStreamedGNN

__all__ = ["DTYPES", "GNNWorker", "record_tuple"]

log = logging.getLogger(__name__)

#: The parameter / feature dtypes a GNN launch accepts.
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def record_tuple(rec: Any, t0: float) -> tuple:
    """A record as JSON-able ``(layer, phase, i, j, kind, start, end, bytes, op)`` with times in
    seconds from ``t0`` (``op`` is ``""`` but for a :class:`CollectiveRecord`)."""
    op = rec.op if isinstance(rec, CollectiveRecord) else ""
    return (rec.layer, rec.phase, rec.i, rec.j, rec.kind, rec.start - t0, rec.end - t0, rec.bytes, op)


def _rss_bytes() -> int:
    """Resident bytes of this process (``psutil``)."""
    try:
        return int(psutil.Process(os.getpid()).memory_info().rss)
    except Exception:  # pragma: no cover - the process table cannot be read
        return 0


class GNNWorker:
    """The GNN training rank (see the module docstring).

    Args:
        plan: the plan's JSON document (``GNNPlan.to_dict()``).
        graph: ``{"x": [N, F] float, "y": [N] int64, "train_mask" / "val_mask" / "test_mask": [N] bool}``.
        partition: the :class:`~engine.gnn.partition.GraphPartition` every rank streams on.
        rank, world_size: this rank and the number of ranks (the plan's devices).
        master_addr, master_port: rank 0's TCP store for ``init_process_group``.
        backend: ``"gloo"`` or ``"nccl"`` (then the tensors live on ``cuda:0``).
        dtype: ``"float32"`` or ``"float64"`` (parameters and features).
        weight_decay: Adam's L2 penalty.
        prefetch: the streamed executor's next-chunk prefetch.
        timeout_s: the process group's timeout, seconds.
        fail_at: raise at the start of this epoch (fault tests), or ``None``.
    """

    def __init__(self, plan: dict, graph: dict, partition: Any, rank: int, world_size: int, master_addr: str,
                 master_port: int, *, backend: str = "gloo", dtype: str = "float32", weight_decay: float = 5e-4,
                 prefetch: bool = True, timeout_s: float = 120.0, fail_at: int | None = None):
        self.plan_dict = plan
        self.graph = graph
        self.partition = partition
        self.rank = rank
        self.world_size = world_size
        self.master_addr = master_addr
        self.master_port = master_port
        self.backend = backend
        self.dtype = dtype
        self.weight_decay = weight_decay
        self.prefetch = prefetch
        self.timeout_s = timeout_s
        self.fail_at = fail_at
        self.dsg: DistributedStreamedGNN | None = None

    def setup(self) -> dict:
        """Join the process group and build the model, optimizer and executor.

        Returns:
            ``{"rank", "intervals", "rows": [lo, hi], "device"}``.

        Raises:
            GNNError: an unknown dtype, or the plan / partition the executor refuses.
        """
        if self.dtype not in DTYPES:
            raise GNNError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}.")
        dtype = DTYPES[self.dtype]
        torch.set_num_threads(1)
        if self.backend == "nccl":   # one GPU per actor: Ray's CUDA_VISIBLE_DEVICES shows it as cuda:0
            torch.cuda.set_device(0)
            device = torch.device("cuda", 0)
        else:
            device = torch.device("cpu")
        if not dist.is_initialized():
            kw: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(self.backend, init_method=f"tcp://{self.master_addr}:{self.master_port}",
                                    rank=self.rank, world_size=self.world_size,
                                    timeout=timedelta(seconds=self.timeout_s), **kw)
        plan = GNNPlan.from_dict(self.plan_dict)
        torch.manual_seed(plan.seed)
        model = build_gnn(plan.model).to(device=device, dtype=dtype)
        g = self.graph
        self.x = g["x"].to(device=device, dtype=dtype)
        self.y = g["y"].to(device)
        self.masks = {s: g[f"{s}_mask"].to(device) for s in ("train", "val", "test")}
        self.model = model
        self.dsg = DistributedStreamedGNN(model, self.partition, plan.assignment, prefetch=self.prefetch)
        self.opt = torch.optim.Adam(model.parameters(), lr=plan.lr, weight_decay=self.weight_decay)
        self.device = device
        return {"rank": self.rank, "intervals": self.dsg.intervals, "rows": [self.dsg.rows.start, self.dsg.rows.stop],
                "device": str(device)}

    def _ready(self) -> DistributedStreamedGNN:
        if self.dsg is None:
            raise GNNError(f"rank {self.rank} was not set up; call setup() first.")
        return self.dsg

    def train_epoch(self, epoch: int, keep_records: bool = False) -> dict:
        """One full-graph training step (a collective: every rank runs it).

        Returns:
            ``{"loss", "accuracy": {"train", "val", "test"}, "seconds", "records": [record_tuple, ...]
            (with ``keep_records``, seconds from the step's start), "memory_bytes"}`` (process RSS
            on CPU, ``torch.cuda.max_memory_allocated`` on a GPU).

        Raises:
            RuntimeError: ``fail_at`` is this epoch (a deliberate failure for the fault tests).
        """
        dsg = self._ready()
        if self.fail_at is not None and epoch == self.fail_at:
            raise RuntimeError(f"deliberate failure at epoch {epoch} (fail_at)")
        t0 = time.perf_counter()
        step = dsg.train_step(self.x, self.y, self.masks, self.opt)
        mem = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else _rss_bytes()
        return {"loss": step.loss, "accuracy": step.accuracy, "seconds": step.seconds,
                "records": [record_tuple(r, t0) for r in step.records] if keep_records else [],
                "memory_bytes": int(mem)}

    def evaluate(self) -> dict:
        """``{"train", "val", "test"}`` accuracies of the current parameters (a collective)."""
        return self._ready().evaluate(self.x, self.y, self.masks)

    def state(self) -> dict:
        """The model's parameters and buffers (``state_dict``, CPU copies)."""
        self._ready()
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def shutdown(self) -> None:
        """Destroy the process group (idempotent)."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
