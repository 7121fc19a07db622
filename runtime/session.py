"""One job's training session on a pool of rank actors, shared by both launchers.

:func:`runtime.launcher.launch` (one plan, one job) and :func:`runtime.crossover.launch_crossover`
(several co-located jobs, one session each) both train through a :class:`TrainingSession`, the
role of the trainer in nanotron / torchtitan:

- :func:`resume_point`: the checkpoint to resume from (validated against the plan, world size,
  step count and optimizer before Ray starts) and the last checkpoint on disk;
- :func:`restore_checkpoint`: every rank's state (and RNG) loaded from it, one rank at a time;
- :meth:`TrainingSession.run_step`: one step on every rank: the global batch is the data
  source's ``train_batch(step, global_batch)`` (the plan's task, :class:`tasks.base.Task`, or a
  ``ByteCorpus``); the loss is the mean of the per-micro-batch losses the ranks report = the mean
  over the global batch; the step's throughput counts the task's unit (tokens or samples);
- :meth:`TrainingSession.evaluate` / :meth:`TrainingSession.save` on their cadence
  (:meth:`TrainingSession.after_step`): the fixed validation batch, and atomic checkpoints
  (``runtime.checkpoint``) with the pruning of stale ones;
- progress: :class:`StepReport` to every :class:`TrainingCallback` and ``logging`` (never
  ``print``; the CLI shows its progress bar through a callback, ``apps.launch_progress``).

A co-located job passes its index (``job``) as the first argument of every actor call
(``runtime.crossover.actor.CrossoverActor``); a single-plan launch passes none
(``runtime.worker.StageWorker``).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from runtime import checkpoint as _ckpt
from runtime.runner import LaunchFailure

if TYPE_CHECKING:  # pragma: no cover
    from runtime.runner import Runner

logger = logging.getLogger(__name__)

__all__ = ["DataSource", "StepCallback", "StepOutcome", "StepReport", "TrainingCallback", "TrainingSession",
           "batch_units", "resume_point", "restore_checkpoint"]


class DataSource(Protocol):
    """Where a session's batches come from: a :class:`tasks.base.Task` (tuples ``(*inputs,
    *targets)``) or a ``ByteCorpus`` (legacy causal-lm tensors ``[rows, seq_len + 1]``)."""

    def train_batch(self, step: int, rows: int) -> Any: ...

    def val_batch(self, index: int, rows: int) -> Any: ...


def batch_units(data: Any, batch: Any) -> tuple[str, int]:
    """``(unit, count)`` of a global batch drawn from ``data``: a task's ``unit`` and
    ``count(*targets)``; for a legacy ``[rows, seq_len + 1]`` tensor ``("tokens", rows * seq_len)``."""
    if hasattr(data, "count") and hasattr(data, "num_inputs") and not hasattr(batch, "shape"):
        return str(data.unit), int(data.count(*tuple(batch)[data.num_inputs:]))
    return "tokens", int(batch.shape[0] * (batch.shape[1] - 1))


@dataclass
class StepReport:
    """What a launcher reports after each training step.

    Attributes:
        step: the step index just run (0-based; ``step + 1`` steps are done).
        steps: the step index the job stops at.
        loss: training loss (the task's; nats per token for text), mean over the global batch (NaN
            when no rank reported).
        seconds: the step's seconds, dispatch to the last rank's result (driver clock).
        tokens_per_step: tokens in one global batch (0 for a task counted in samples).
        job: the co-located job's index, or ``None`` for a single-plan launch.
        name: the co-located job's name, or ``None``.
        gates: the step's MoE gate metrics (``runtime.launch_result.merge_moe_metrics``), or ``None``.
        token_wait: co-located jobs: seconds the job's ranks waited for the compute token so far
            (summed over steps, mean over ranks); 0 otherwise.
        unit: what the task's throughput counts, ``"tokens"`` or ``"samples"``.
        units_per_step: units in this step's global batch (``None``: ``tokens_per_step``).
    """

    step: int
    steps: int
    loss: float
    seconds: float
    tokens_per_step: int
    job: int | None = None
    name: str | None = None
    gates: dict | None = None
    token_wait: float = 0.0
    unit: str = "tokens"
    units_per_step: int | None = None

    @property
    def tokens_per_second(self) -> float:
        """Tokens per second of this step (0 when it took no time)."""
        return self.tokens_per_step / self.seconds if self.seconds > 0 else 0.0

    @property
    def units_per_second(self) -> float:
        """Units (:attr:`unit`) per second of this step (0 when it took no time)."""
        n = self.units_per_step if self.units_per_step is not None else self.tokens_per_step
        return n / self.seconds if self.seconds > 0 else 0.0


class TrainingCallback:
    """Receives a launch's progress; subclass and override what you need (every method is a no-op).

    Co-located launches call these from each job's driver thread (one thread per job), so an
    implementation shared by several jobs must be thread-safe.
    """

    def on_start(self, *, start_step: int, steps: int, job: int | None = None) -> None:
        """The job is set up and about to run steps ``start_step .. steps - 1``."""

    def on_notice(self, message: str) -> None:
        """A one-sentence note for the user (e.g. resuming found no checkpoint)."""

    def on_step(self, report: StepReport) -> None:
        """A step finished (before its evaluation / checkpoint)."""

    def on_end(self, *, job: int | None = None) -> None:
        """The job stopped (finished or failed); called at most once per :meth:`on_start`."""


class StepCallback(TrainingCallback):
    """A :class:`TrainingCallback` that calls ``fn(report)`` after each step."""

    def __init__(self, fn: Callable[[StepReport], None]):
        self.fn = fn

    def on_step(self, report: StepReport) -> None:
        self.fn(report)


@dataclass
class StepOutcome:
    """One step as :meth:`TrainingSession.run_step` ran it: the ranks' results (rank order), the
    loss (nats/token for text), the ``time.perf_counter`` stamps of its dispatch and last result,
    and the units (tokens or samples, ``unit``) its global batch held."""

    results: list[dict]
    loss: float
    t0: float
    t1: float
    units: int = 0
    unit: str = "tokens"

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


def resume_point(checkpoint_dir: str | os.PathLike | None, *, resume: bool, plan: Any, world_size: int,
                 steps: int, optimizer: str, error: Callable[..., Exception], prefix: str = "",
                 optimizer_hint: bool = True) -> tuple[_ckpt.Checkpoint | None, str | None]:
    """The checkpoint to resume from, and the newest checkpoint on disk (kept on failure).

    Args:
        checkpoint_dir: the job's checkpoint folder, or ``None`` (then ``(None, None)``).
        resume: whether to resume at all.
        plan, world_size: what the checkpoint must have been written for.
        steps: the step index the run stops at.
        optimizer: the run's optimizer.
        error: builds the launcher's exception, ``error(message, checkpoint=path)``.
        prefix: put before every message (``"job 0 (a.json): "``).
        optimizer_hint: end the optimizer message with ``"; resume with --optimizer X ..."``.

    Resuming takes the newest intact checkpoint: one whose files fail their check
    (:class:`runtime.checkpoint.CheckpointDamaged`: truncated, empty, changed) is skipped with a
    ``logging`` warning naming the damaged file, and the next older one is tried.

    Returns:
        ``(checkpoint or None, newest checkpoint directory or None)``; with ``resume`` the second
        is the checkpoint resumed from.

    Raises:
        the ``error`` exception: ``resume`` without a checkpoint folder, with a folder that does
            not exist or holds no checkpoint; the checkpoint has already reached ``steps``, or was
            written with another optimizer.
        runtime.checkpoint.CheckpointError: a checkpoint of another plan or world size, or every
            checkpoint in the folder is damaged (the sentence names each damaged file; exit
            status 2: the folder given cannot be resumed from, start without resuming).
    """
    if checkpoint_dir is None:
        if resume:
            raise error(f"{prefix}cannot resume without a checkpoint folder; give the folder the run wrote its "
                        "checkpoints to", checkpoint=None)
        return None, None
    ck = None
    if resume:
        ck = _intact_checkpoint(Path(checkpoint_dir), plan=plan, world_size=world_size, error=error, prefix=prefix)
        if ck is not None:
            if ck.step >= steps:
                raise error(f"{prefix}the checkpoint {ck.path} has already reached step {ck.step} (steps={steps}); "
                            "ask for more steps to continue it", checkpoint=str(ck.path))
            ck_opt = ck.meta.get("optimizer")
            if ck_opt is not None and ck_opt != optimizer:
                hint = f"; resume with --optimizer {ck_opt} (optimizer states differ)" if optimizer_hint else ""
                raise error(f"{prefix}the checkpoint {ck.path} was written with optimizer {ck_opt!r} but this "
                            f"launch uses {optimizer!r}{hint}", checkpoint=str(ck.path))
    if ck is not None:
        return ck, str(ck.path)
    newest = _ckpt.latest_checkpoint(checkpoint_dir)
    return None, (str(newest) if newest is not None else None)


def _intact_checkpoint(root: Path, *, plan: Any, world_size: int, error: Callable[..., Exception],
                       prefix: str) -> _ckpt.Checkpoint:
    """The newest intact checkpoint in ``root`` for ``plan`` (see :func:`resume_point`)."""
    if not root.exists():
        raise error(f"{prefix}cannot resume: the checkpoint folder {root} does not exist; give the folder the "
                    "run wrote its checkpoints to (--checkpoint-dir), or start from step 0 without --resume",
                    checkpoint=None)
    found = _ckpt.list_checkpoints(root)
    if not found:
        raise error(f"{prefix}cannot resume: {root} holds no checkpoint (no step_N folder with a meta.json); give "
                    "the folder the run wrote its checkpoints to (--checkpoint-dir), or start from step 0 without "
                    "--resume", checkpoint=None)
    damaged: list[_ckpt.CheckpointDamaged] = []
    for path in reversed(found):
        try:
            ck = _ckpt.load_checkpoint(path, plan=plan, world_size=world_size)
        except _ckpt.CheckpointDamaged as e:
            damaged.append(e)
            logger.warning("%s%s; trying the previous checkpoint", prefix, e)
            continue
        if damaged:
            logger.warning("%sresuming from %s (step %d) instead: %s damaged", prefix, ck.path, ck.step,
                           ", ".join(f"{d.path.name}/{d.file}" for d in damaged))
        return ck
    raise _ckpt.CheckpointError(
        f"{prefix}cannot resume: every checkpoint in {root} is damaged ("
        + "; ".join(f"{d.path.name}: {d.file}" for d in damaged)
        + "); start from step 0 without --resume, or with another --checkpoint-dir")


def restore_checkpoint(runner: Runner, ck: _ckpt.Checkpoint, world_size: int, *, timeout: float,
                       job: int | None = None, rng: bool = True) -> None:
    """Load every rank's state from ``ck``, one rank at a time (one rank's state in driver memory).

    Args:
        job: the co-located job (its index goes first in the actor calls), or ``None``.
        rng: restore the ranks' and the driver's RNG states too (single-plan launches; co-located
            jobs share each actor's global RNG and checkpoint none).

    Raises:
        LaunchError: a rank failed or hung while loading.
    """
    import ray

    prefix = () if job is None else (job,)
    what = "loading the checkpoint" if job is None else f"loading job {job}'s checkpoint"
    for r in range(world_size):
        runner.call("load_state_dict", [(*prefix, ray.put(ck.rank_state(r)))], ranks=[r], timeout=timeout,
                    step=None, what=what)
        if rng:
            runner.call("__ray_call__", [(_ckpt.restore_rng, ck.rank_rng(r))], ranks=[r], timeout=timeout,
                        step=None, what="restoring RNG states")
    if rng:
        ck.restore_rng()


@dataclass
class TrainingSession:
    """One job's step loop state: data, evaluation, checkpoints, and the losses so far.

    Attributes (inputs):
        runner: calls the job's actors (its ``checkpoint`` is kept current, for failure messages).
        plan: the job's plan (checkpoints record its hash); ``world_size``: ranks.
        corpus: the job's data (:class:`DataSource`: the plan's task, or a ``ByteCorpus``);
            ``global_batch``: samples per step (all replicas).
        steps: the step index to stop at; ``start_step``: the first step (resume).
        step_timeout: seconds per call; checkpoint calls get at least 60 s.
        job: the co-located job's index (first argument of every actor call), or ``None``.
        checkpoint_dir: the folder, or ``None`` (no checkpoints).
        checkpoint_every, eval_every, keep_checkpoints, seed: as in ``runtime.config``
            (``eval_every=None``: never evaluate).
        meta: more facts for each checkpoint's ``meta.json`` (after ``losses`` and ``val_losses``).
        rng: capture the ranks' RNG states into the checkpoints.
        history, val_history: ``[step, loss]`` / ``[done, loss]`` of the whole run (a resumed
            checkpoint's included), written into each checkpoint.

    Attributes (outputs):
        losses, step_times, step_units: per step run by this session (the task's loss, nats/token
            for text; seconds; units of the global batch, :attr:`unit`).
        val_losses: ``[(steps_completed, loss)]``.
    """

    runner: Runner
    plan: Any
    world_size: int
    corpus: DataSource
    global_batch: int
    steps: int
    start_step: int = 0
    step_timeout: float = 120.0
    job: int | None = None
    checkpoint_dir: str | os.PathLike | None = None
    checkpoint_every: int = 0
    eval_every: int | None = 0
    keep_checkpoints: int | None = 2
    seed: int = 0
    meta: dict = field(default_factory=dict)
    rng: bool = True
    history: list = field(default_factory=list)
    val_history: list = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    step_units: list[int] = field(default_factory=list)
    unit: str = "tokens"
    _val_ref: Any = field(default=None, repr=False)
    _written: set[int] = field(default_factory=set, repr=False)  # steps this session checkpointed

    @property
    def _prefix(self) -> tuple:
        return () if self.job is None else (self.job,)

    @property
    def checkpoint(self) -> str | None:
        """The newest complete checkpoint directory of the job, or ``None``."""
        return self.runner.checkpoint

    def run_step(self, step: int) -> StepOutcome:
        """Run ``step`` on every rank: the global batch ``corpus.train_batch(step, global_batch)``
        (one ``ray.put``; each replica slices its rows of every tensor) to every rank, and wait for all.

        Raises:
            LaunchError: a rank raised, died or hung.
        """
        import ray

        batch = self.corpus.train_batch(step, self.global_batch)
        self.unit, units = batch_units(self.corpus, batch)
        batch_ref = ray.put(batch)  # every rank gets the global batch
        t0 = time.perf_counter()
        results = self.runner.call("step", [(*self._prefix, step, batch_ref)] * self.world_size,
                                   timeout=self.step_timeout, step=step, what="step")
        t1 = time.perf_counter()
        mb_losses = [float(x) for res in results for x in (res.get("losses") or [])]
        loss = sum(mb_losses) / len(mb_losses) if mb_losses else math.nan
        self.losses.append(loss)
        self.history.append([step, loss])
        self.step_times.append(t1 - t0)
        self.step_units.append(units)
        logger.debug("%sstep %d: loss %.4f, %.3f s", "" if self.job is None else f"job {self.job} ", step, loss,
                     t1 - t0)
        return StepOutcome(results, loss, t0, t1, units, self.unit)

    def after_step(self, done: int) -> None:
        """Evaluate and checkpoint after ``done`` completed steps when the cadence (or the last
        step) asks for it.

        Raises:
            LaunchFailure: a rank failed during evaluation or checkpointing, or the checkpoint
                folder cannot be written (``kind="checkpoint"``).
        """
        last = done == self.steps
        if self.eval_every is not None and (last or (self.eval_every and done % self.eval_every == 0)):
            self.evaluate(done)
        if self.checkpoint_dir is not None and (last or (self.checkpoint_every and done % self.checkpoint_every == 0)):
            self.save(done)

    def evaluate(self, done: int) -> None:
        """The fixed validation batch on every rank; the mean of the ranks' losses (the last
        pipeline stages report one) goes into :attr:`val_losses`."""
        import ray

        if self._val_ref is None:
            self._val_ref = ray.put(self.corpus.val_batch(0, self.global_batch))
        vals = self.runner.call("evaluate", [(*self._prefix, self._val_ref)] * self.world_size,
                                timeout=self.step_timeout, step=done, what="evaluation")
        got = [float(v) for v in vals if v is not None]
        if got:
            v = sum(got) / len(got)
            self.val_losses.append((done, v))
            self.val_history.append([done, v])
            logger.info("%svalidation loss %.4f after %d steps", "" if self.job is None else f"job {self.job}: ",
                        v, done)

    def checkpoint_done(self, done: int) -> str | None:
        """The checkpoint of ``done`` steps, written now unless the cadence just wrote it (an
        interrupted launch's, before it stops); ``None`` without a checkpoint folder.

        Raises:
            LaunchFailure: as :meth:`save`.
        """
        if self.checkpoint_dir is None:
            return None
        path = self.checkpoint
        if path is None or Path(path).name != _ckpt.step_dir_name(done):
            path = self.save(done)
        return path

    def save(self, done: int) -> str:
        """Write the checkpoint of ``done`` steps atomically (``runtime.checkpoint.save_checkpoint``,
        keeping ``keep_checkpoints``) after removing the checkpoints after :attr:`start_step` that
        this session did not write (stale: left by an earlier run in the same folder, or damaged
        ones a resume skipped). Returns its directory.

        Raises:
            LaunchFailure: a rank failed to give its state, or (``kind="checkpoint"``) the folder
                cannot be written (``OSError``: no space, no permission); the last checkpoint is kept.
        """
        assert self.checkpoint_dir is not None
        slow = max(self.step_timeout, 60.0)
        # checkpoints after the start that this session did not write belong to another history (an
        # earlier run, or damaged ones a resume skipped): removed before the new one is written, so
        # keeping the newest ``keep_checkpoints`` never keeps them in place of this run's own
        for old in _ckpt.list_checkpoints(self.checkpoint_dir):
            step = _ckpt.checkpoint_step(old) or 0
            if step != done and step > self.start_step and step not in self._written:
                shutil.rmtree(old, ignore_errors=True)

        def state_of(r: int) -> Any:
            return self.runner.call("state_dict", [self._prefix], ranks=[r], timeout=slow, step=done,
                                    what="checkpointing")[0]

        def rng_of(r: int) -> dict:
            return self.runner.call("__ray_call__", [(_ckpt.capture_rng,)], ranks=[r], timeout=slow, step=done,
                                    what="checkpointing")[0]

        try:
            path = _ckpt.save_checkpoint(self.checkpoint_dir, done, state_of, rng_of if self.rng else None,
                                         plan=self.plan, world_size=self.world_size, seed=self.seed,
                                         extra={"losses": self.history, "val_losses": self.val_history, **self.meta},
                                         keep=self.keep_checkpoints)
        except OSError as e:
            kept = f"; the last checkpoint {self.checkpoint} is kept" if self.checkpoint else ""
            raise LaunchFailure(f"the checkpoint after {done} steps could not be written to {self.checkpoint_dir} "
                                f"({e.strerror or e}){kept}; free space or fix the folder's permissions and resume",
                                step=done, kind="checkpoint", checkpoint=self.checkpoint) from e
        self.runner.checkpoint = str(path)
        self._written.add(done)
        logger.info("checkpoint %s", path)
        return str(path)
