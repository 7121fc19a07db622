"""Typed configuration of a launch: :class:`LaunchConfig` (one plan) and :class:`CrossoverConfig`
(several co-located data-parallel plans), in the style of torchtitan's ``job_config.py``.

What a launch trains on (the plan or plans) and who watches it (progress callbacks,
``runtime.session.TrainingCallback``) are per-call arguments of :func:`runtime.launcher.launch` and
:func:`runtime.crossover.launch_crossover`; everything else is here, with today's defaults::

    from runtime import launch
    from runtime.config import LaunchConfig

    res = launch("out/plan.json", LaunchConfig(steps=20, checkpoint_dir="out/ckpt", device="cpu"))

Both classes are keyword-only dataclasses. :meth:`LaunchConfig.validate` and
:meth:`CrossoverConfig.validate` check what can be checked without the plans and raise the
launcher's error (a :class:`~engine.errors.TesselError`) naming the field and how to fix it; the
launchers call them before Ray starts.

Sources: torchtitan ``torchtitan/config/job_config.py`` (https://github.com/pytorch/torchtitan).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

from engine.crossover import MODES, Mode
from engine.errors import TaskError
from runtime.runner import CrossoverLaunchError, LaunchError
from runtime.worker.config import OPTIMIZERS, P2P_MATCHING, OptimizerName, P2PMatching
from tasks import check_task_name

#: ``device``: ``"auto"`` (NCCL on GPUs when the cluster has one per rank, else gloo on CPU),
#: ``"cpu"`` or ``"cuda"``.
DeviceChoice = Literal["auto", "cpu", "cuda"]

__all__ = ["CrossoverConfig", "DeviceChoice", "LaunchConfig", "check_optimizer", "per_job"]


def _choices(values: Sequence[str]) -> str:
    return ", ".join(map(repr, values))


@dataclass(kw_only=True)
class _ClusterConfig:
    """Fields every launch has (the Ray cluster, fault timeouts, checkpoint cadence)."""

    address: str | None = None
    """Ray cluster address; ``None`` starts an embedded local cluster. A process that already
    called ``ray.init`` keeps its connection (and Ray is left running)."""

    device: DeviceChoice = "auto"
    """``"auto"`` (NCCL on GPUs when the cluster has one per rank, else gloo on CPU), ``"cpu"`` or
    ``"cuda"`` (co-located jobs: gloo only, the crossover actor runs no CUDA tensors yet)."""

    step_timeout: float = 120.0
    """Seconds (> 0) a rank may take for one call (``step``, ``evaluate``, ...) before the job is
    declared hung; setup and checkpoint calls get at least 60 s. Co-located jobs: also the
    process-group timeout and the longest a step may wait for the compute token."""

    checkpoint_every: int = 0
    """Write a checkpoint every this many steps (>= 0; 0: only at the end; the final step is always
    checkpointed when there is a checkpoint folder)."""

    keep_checkpoints: int | None = 2
    """Newest checkpoints kept (per job; >= 1); ``None``: all. With 1 a damaged newest checkpoint
    has no older one to fall back to (see :func:`runtime.checkpoint.verify_checkpoint`)."""

    resume: bool = False
    """Continue from the newest intact checkpoint in the checkpoint folder (a damaged one is
    skipped with a warning); a missing folder, or one without an intact checkpoint, is refused
    (:class:`runtime.runner.LaunchError`) rather than training from step 0. The steps already in
    the checkpoint count towards ``steps``."""

    def _check_cluster(self, error: type[LaunchError]) -> None:
        """Raise ``error(kind="setup")`` for a cluster field out of range (see :meth:`LaunchConfig.validate`)."""
        if not self.step_timeout > 0:  # also NaN
            raise error(f"step_timeout must be a positive number of seconds, got {self.step_timeout}", kind="setup")
        if self.checkpoint_every < 0:
            raise error(f"checkpoint_every must be >= 0 (0: checkpoint only at the end), got {self.checkpoint_every}",
                        kind="setup")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise error(f"keep_checkpoints must be at least 1 (None keeps every checkpoint), got "
                        f"{self.keep_checkpoints}", kind="setup")


@dataclass(kw_only=True)
class LaunchConfig(_ClusterConfig):
    """How :func:`runtime.launcher.launch` trains one plan (every field has today's default)."""

    steps: int = 50
    """Total steps of the run (the step index to stop at, >= 1). With ``resume`` the steps already in
    the checkpoint count: a run checkpointed at step 30 and resumed with ``steps=50`` runs steps
    30..49."""

    checkpoint_dir: str | os.PathLike | None = None
    """Folder for ``step_N`` checkpoints (atomic, ``runtime.checkpoint``); ``None`` writes none."""

    eval_every: int = 0
    """Evaluate the fixed validation batch every this many steps (>= 0; 0: only at the end)."""

    seed: int = 0
    """Model initialisation / worker RNG seed."""

    task: str | None = None
    """The task to train on (:mod:`tasks`: ``causal-lm``, ``masked-lm``, ``seq2seq``,
    ``image-classification`` or a user's ``package.module:callable``), overriding the plan's
    ``model.task``; ``None``: the plan's (causal-lm when it records none). The batches are the
    task's ``train_batch(step, dp * m * micro_batch_size)`` and throughput counts its unit."""

    data_seed: int = 0
    """Seed of the task's data (its file split and every batch): a batch depends only on
    ``(data_seed, step)``."""

    lr: float = 1e-3
    """Learning rate (dimensionless)."""

    optimizer: OptimizerName | None = None
    """The workers' optimizer: ``"adam"``, ``"adama"`` (AdamA, Adam accumulation) or ``"sgd"``;
    ``None``: the plan's ``parallel.optimizer`` (``"adam"`` when absent). Resuming needs the
    optimizer the checkpoint was written with."""

    p2p_matching: P2PMatching | None = None
    """The workers' point-to-point matching, ``"auto"``, ``"tags"`` (gloo only) or ``"ordered"``,
    passed to the workers only when given; ``None``: the worker's ``"auto"`` (the environment
    variable ``TESSEL_P2P`` of the worker's process when set, else ordered with NCCL, tags with
    gloo)."""

    trace_path: str | os.PathLike | None = None
    """Write the measured Perfetto trace of the last step here (``None``: none)."""

    release_freed_memory: bool = False
    """CPU ranks return freed tensors to the system (glibc's mmap threshold fixed at
    :data:`runtime.host_memory.MMAP_THRESHOLD`), so a step's measured peak resident set follows the
    live tensors and compares with the plan's predicted peak; slower (a large-vocabulary model's CPU
    step took 37% longer here: every large tensor is page-faulted anew). ``False``: glibc's default,
    which keeps freed blocks of up to 32 MiB resident for reuse."""

    keep_timelines: int = 8
    """Measured timelines of the last this many steps (>= 0; 0: none) kept in ``LaunchResult.timelines`` (the input
    of ``engine.cost.calibrate.calibrate``)."""

    fail_at: tuple[int, int, int] | dict[int, tuple[int, int]] | None = None
    """Deliberate fault for tests: ``(rank, step, instruction_index)`` or
    ``{rank: (step, instruction_index)}``."""

    def validate(self) -> None:
        """Check the fields that need no plan (the launcher calls this before Ray starts).

        Raises:
            LaunchError: (``kind="setup"``) ``steps < 1``, ``step_timeout <= 0``,
                ``checkpoint_every < 0``, ``keep_checkpoints < 1``, ``eval_every < 0``,
                ``keep_timelines < 0``, an unknown ``optimizer`` or ``p2p_matching``, a ``task`` that
                is neither a built-in task nor ``module:callable``; the message names the field and
                the accepted values.
        """
        if self.steps < 1:
            raise LaunchError(f"steps must be at least 1, got {self.steps}", kind="setup")
        self._check_cluster(LaunchError)
        if self.eval_every < 0:
            raise LaunchError(f"eval_every must be >= 0 (0: evaluate only at the end), got {self.eval_every}",
                              kind="setup")
        if self.keep_timelines < 0:
            raise LaunchError(f"keep_timelines must be >= 0 (0: keep none), got {self.keep_timelines}", kind="setup")
        if self.optimizer is not None:
            check_optimizer(self.optimizer)
        if self.p2p_matching is not None:
            if self.p2p_matching not in P2P_MATCHING:
                raise LaunchError(f"unknown p2p_matching {self.p2p_matching!r}; use one of "
                                  f"{_choices(P2P_MATCHING)}", kind="setup")
        if self.task is not None:
            try:
                check_task_name(self.task)
            except TaskError as e:
                raise LaunchError(str(e), kind="setup") from e


def check_optimizer(name: str) -> str:
    """``name`` when it is one of ``runtime.worker.OPTIMIZERS``.

    Raises:
        LaunchError: (``kind="setup"``) an unknown optimizer, naming the accepted ones.
    """
    if name not in OPTIMIZERS:
        raise LaunchError(f"unknown optimizer {name!r}; use one of {_choices(OPTIMIZERS)}", kind="setup")
    return name


def per_job(value: Any, n: int, what: str) -> list:
    """``value`` for each of ``n`` jobs: a scalar repeated, or a list/tuple of exactly ``n``.

    Raises:
        CrossoverLaunchError: (``kind="setup"``) a sequence of another length (names the field ``what``).
    """
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise CrossoverLaunchError(f"{what} has {len(value)} entries but there are {n} jobs", kind="setup")
        return list(value)
    return [value] * n


@dataclass(kw_only=True)
class CrossoverConfig(_ClusterConfig):
    """How :func:`runtime.crossover.launch_crossover` co-locates several data-parallel plans.

    It shares :class:`LaunchConfig`'s cluster fields (``address``, ``device``, ``step_timeout``,
    ``checkpoint_every``, ``keep_checkpoints``, ``resume``); the per-job fields take one value for
    every job or a list with one value per job. Every field has today's default.
    """

    steps: int | Sequence[int] = 50
    """Steps per job (one number for all, or one per job; each >= 1); with ``resume`` the steps in a
    job's checkpoint count."""

    mode: Mode = "crossover"
    """``"crossover"`` (per-device compute token), ``"uncoordinated"`` (no token) or
    ``"sequential"`` (one job after the other)."""

    checkpoint_dirs: Sequence[str | os.PathLike | None] | None = None
    """One checkpoint folder per job (``None`` entries: no checkpoints for that job); the folders
    must differ. ``None``: no checkpoints."""

    eval_every: int | None = 0
    """Validation loss every this many steps (>= 0; 0: only at the end; ``None``: never)."""

    seed: int | Sequence[int] = 0
    """Model initialisation seed (one, or one per job)."""

    data_seeds: Sequence[int] | None = None
    """Per job, the ``ByteCorpus`` seed of its data stream (default: the job index)."""

    lr: float | Sequence[float] = 1e-3
    """Learning rate (one, or one per job)."""

    optimizer: OptimizerName | None | Sequence[OptimizerName | None] = None
    """``"adam"``, ``"adama"``, ``"sgd"`` or ``None`` (the plan's), one or one per job."""

    warmup_steps: int = 0
    """First steps of each job left out of the throughput (still trained; >= 0)."""

    raise_on_failure: bool = True
    """Raise ``CrossoverLaunchError`` when a job failed (else return the result with the job's ``error``)."""

    names: Sequence[str] | None = None
    """The jobs' names in messages and results (default: the plan file's name, or
    ``"<model> #<index>"``)."""

    fail_at: dict[int, tuple[int, int, int]] | None = None
    """Deliberate faults for tests: ``{job: (rank, step, instruction_index)}``."""

    def validate(self) -> None:
        """Check the fields that need neither the plans nor their number.

        Raises:
            CrossoverLaunchError: (``kind="setup"``) an unknown ``mode``, ``warmup_steps < 0``,
                ``step_timeout <= 0``, ``checkpoint_every < 0``, ``keep_checkpoints < 1``,
                ``eval_every < 0``; the message names the field.
        """
        if self.mode not in MODES:
            raise CrossoverLaunchError(f"unknown co-location mode {self.mode!r}; use one of {', '.join(MODES)}",
                                 kind="setup")
        if self.warmup_steps < 0:
            raise CrossoverLaunchError(f"warmup_steps must be >= 0, got {self.warmup_steps}", kind="setup")
        self._check_cluster(CrossoverLaunchError)
        if self.eval_every is not None and self.eval_every < 0:
            raise CrossoverLaunchError(f"eval_every must be >= 0 (0: only at the end; None: never), got "
                                       f"{self.eval_every}", kind="setup")

    def steps_per_job(self, n: int) -> list[int]:
        """:attr:`steps` for each of ``n`` jobs.

        Raises:
            CrossoverLaunchError: a list of another length, or a value below 1.
        """
        steps = [int(s) for s in per_job(self.steps, n, "steps")]
        if any(s < 1 for s in steps):
            raise CrossoverLaunchError(f"steps must be at least 1, got {self.steps}", kind="setup")
        return steps

    def checkpoint_dirs_per_job(self, n: int) -> list[Path | None]:
        """:attr:`checkpoint_dirs` for each of ``n`` jobs.

        Raises:
            CrossoverLaunchError: a list of another length, or a folder named twice.
        """
        dirs = [None] * n if self.checkpoint_dirs is None else per_job(list(self.checkpoint_dirs), n,
                                                                      "checkpoint_dirs")
        out = [Path(d) if d is not None else None for d in dirs]
        resolved = [d.resolve() for d in out if d is not None]
        if len(set(resolved)) != len(resolved):
            raise CrossoverLaunchError("every job needs its own checkpoint folder; checkpoint_dirs repeats one",
                                 kind="setup")
        return out

    def fail_at_per_job(self, n: int) -> dict[int, tuple[int, int, int]]:
        """:attr:`fail_at` checked against ``n`` jobs.

        Raises:
            CrossoverLaunchError: a job index outside ``0..n-1``.
        """
        fail_at = dict(self.fail_at or {})
        for j in fail_at:
            if not 0 <= int(j) < n:
                raise CrossoverLaunchError(f"fail_at names job {j}, but there are {n} jobs", kind="setup")
        return fail_at
