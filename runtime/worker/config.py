"""The stage worker's options (:class:`WorkerConfig`); design in ``docs/runtime-worker.md``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, get_args

__all__ = ["OPTIMIZERS", "P2P_MATCHING", "Backend", "OptimizerName", "P2PMatching",
           "WorkerConfig"]

Backend = Literal["gloo", "nccl"]
P2PMatching = Literal["auto", "tags", "ordered"]
OptimizerName = Literal["adam", "adama", "sgd"]

#: Optimizer names a worker accepts (``docs/runtime-worker.md``, "Optimizers and AdamA").
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)

#: ``p2p_matching`` values of :class:`WorkerConfig`
#: (``docs/runtime-worker.md``, "Backends and point-to-point matching").
P2P_MATCHING: tuple[str, ...] = get_args(P2PMatching)


@dataclass
class WorkerConfig:
    """Options of one :class:`runtime.worker.StageWorker` (picklable: Ray sends it to actors,
    provided the two hooks are picklable or ``None``). Values are checked in
    :meth:`~runtime.worker.StageWorker.setup`, not here."""

    backend: Backend = "gloo"
    """``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors). Anything else is refused by setup
    (:class:`~runtime.stages.RuntimeNotSupported`)."""

    device: str | None = None
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"``; ``None``: ``"cuda"`` with ``nccl``, else ``"cpu"``.
    ``"cuda"`` picks GPU ``LOCAL_RANK`` (0 when unset; Ray sets ``CUDA_VISIBLE_DEVICES`` to the
    actor's one GPU). ``nccl`` needs a CUDA device and gloo a CPU one (``WorkerError``)."""

    p2p_matching: P2PMatching = "auto"
    """How point-to-point messages are matched: ``"tags"`` (gloo only), ``"ordered"``
    (one-directional 2-rank groups, posting order) or ``"auto"``: the environment variable
    ``TESSEL_P2P`` when set, else ``"ordered"`` with ``nccl`` and ``"tags"`` with gloo."""

    sync_timing: bool | None = None
    """On CUDA, ``torch.cuda.synchronize()`` at the end of every compute, receive and collective
    instruction before stamping its end, so measured times are completion times (``None``: on;
    ignored on CPU)."""

    seed: int = 0
    """Model initialisation seed (the same on every rank and in the reference)."""

    lr: float = 1e-3
    """Learning rate."""

    init_loss_scale: float = 2.0 ** 16
    """``16-mixed``: the dynamic loss scaler's first scale (``torch.amp.GradScaler``'s default 2**16;
    :class:`runtime.precision.LossScaler`); ignored by the other precision policies."""

    optimizer: OptimizerName | None = None
    """``"adam"`` (``torch.optim.Adam``, default betas/eps), ``"adama"`` (:class:`runtime.adama.AdamA`)
    or ``"sgd"``; ``None``: the plan's ``parallel["optimizer"]`` (``"adam"`` when absent). Other
    names are refused by setup (``WorkerError``)."""

    timeout_s: float = 300.0
    """Process-group timeout in seconds; a rank blocked on a dead peer fails after it."""

    fail_at: tuple[int, int] | None = None
    """``(step, instruction_index)`` at which ``step()`` raises deliberately (fault-handling tests)."""

    track_activations: bool = True
    """Account saved-activation bytes and the peak gradient bytes of every step."""

    release_freed_memory: bool = False
    """CPU: fix glibc's mmap threshold (:data:`runtime.host_memory.MMAP_THRESHOLD`) at set-up, so
    freed tensors leave the resident set (``runtime.config.LaunchConfig.release_freed_memory``)."""

    on_compute_start: Callable[[int | None], object] | None = None
    """Co-location hook ``f(step)`` called before a step's first instruction (``f(None)`` at the
    start of ``evaluate``); ``None``: no-op. An exception from it fails the step."""

    on_sync_start: Callable[[int | None], object] | None = None
    """Co-location hook ``f(step)`` called once the step's last local compute has been handed off
    (``f(None)`` in ``evaluate`` before its loss all-reduce); ``None``: no-op."""

    owns_process_group: bool = True
    """``shutdown()`` destroys the default process group (``False`` when other workers of this
    process still use it)."""

    prepost_receives: bool = True
    """Post every receive of a step at the step's start into its pre-allocated buffer, so
    transfers complete while this rank computes; ``False`` posts each when its RECV is reached
    (ordered matching: together with the not yet posted messages its sender sends before it)."""
