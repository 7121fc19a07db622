"""Launch a plan on Ray: one stage-worker actor per rank, train for some steps, measure.

``launch(plan, LaunchConfig(steps=50, checkpoint_dir="out/ckpt"))`` (``runtime.config``) starts
(or connects to) Ray, reserves a
placement group with one bundle per rank (``runtime.cluster``), starts a
``runtime.worker.StageWorker`` per rank, and then for every step:

1. builds the global batch ``task.train_batch(step, dp * m * micro_batch_size)`` of the plan's
   task (:mod:`tasks`; ``LaunchConfig.task`` overrides ``plan.model.task``; causal-lm reads
   the CPython sources as bytes), a tuple ``(*inputs, *targets)`` that is a pure function of
   ``(data_seed, step)``, so the step is the data position, and hands the same tuple (one
   ``ray.put``) to every rank; DP replica ``d`` (ranks ``d*tp*pp .. (d+1)*tp*pp-1``; rank r is
   pipeline rank ``r % pp`` and tensor rank ``(r // pp) % tp``) trains on rows
   ``[d*m*mbs, (d+1)*m*mbs)`` of every tensor (the worker slices);
2. calls ``step(step, batch)`` on every rank and waits for all of them (at most ``step_timeout``
   seconds): the step's loss is the mean of the per-micro-batch losses reported by the last
   pipeline stage of every replica (= the mean over the global batch, since micro-batches are
   equal-sized);
3. every ``eval_every`` steps evaluates a fixed validation batch (``task.val_batch(0, ...)``),
   and every ``checkpoint_every`` steps writes an atomic checkpoint (``runtime.checkpoint``).

Throughput is counted in the task's unit (``task.count``): tokens for the text tasks
(``tokens_per_second``), samples for image classification (``units_per_second`` with
``unit="samples"``; ``tokens_per_second`` is then 0).

Steps, evaluation, checkpoints and resuming are the job's :class:`runtime.session.TrainingSession`
(shared with the co-located launcher); the actor calls go through :class:`runtime.runner.Runner`.
Progress goes to the ``callbacks`` (:class:`runtime.session.TrainingCallback`; the CLI's tqdm bar
is one) and to ``logging``.

The measured :class:`~engine.timeline.Timeline` of the last step merges the events of replica 0's
ranks (ranks ``0..pp-1``; replicas are symmetric, as in the simulator) with ``source="measured"``.
Each worker times its events from the moment its own ``step()`` call began
(``time.perf_counter``), so ranks are aligned on the step's start; the skew of Ray's dispatch
(typically under a millisecond locally) is not corrected. Its memory curves are the workers'
process RSS samples (bytes; interpreter and torch included), one after every instruction.

Mixture-of-experts models. With ``dp > 1`` the workers run the MoE layers expert-parallel
(``runtime.worker``: replica ``d`` of a pipeline rank keeps experts ``[d*E/dp, (d+1)*E/dp)``, the
all-to-alls run over the replicas and appear in the measured timeline as ``ALLTOALL`` events on
the collective stream). Every worker reports its MoE layers' routing metrics per step (averaged
over its micro-batches and layers); the launcher averages them over ranks (weighted by the layer
and micro-batch count) into :attr:`LaunchResult.moe`, one dict per step: ``temperature`` (DTS-Gate
only), ``experts_per_token``, ``load_cv`` (coefficient of variation of the per-expert load),
``dropped_fraction``, ``balance_loss``, ``load`` (per expert) and ``aux_loss`` (the weighted
load-balancing loss of the whole model, mean over micro-batches; the reported training loss
stays the cross-entropy alone). Each step's :class:`runtime.session.StepReport` carries them too.

Before any Ray work. :func:`check_launchable` validates the plan as ``tessel show`` does (the
schedule's completeness, same-device dependencies and deadlocks: ``Schedule.validate``) and the
plan's own consistency (``parallel.micro_batches`` and ``parallel.pp`` against the schedule), so
a plan that could only hang, fail in a worker or report made-up numbers is refused with one
sentence (a ``ScheduleError``, exit status 2) before Ray starts.

Faults. A rank that raises (e.g. the deliberate ``fail_at``), dies (actor process exits) or
hangs (no result within ``step_timeout``) stops the job: the launcher raises
:class:`runtime.runner.LaunchFailure` (a ``LaunchError`` and an ``engine.errors.RunError``, exit
status 3) naming the rank, the step and, where the worker's exception says so, the
instruction; it keeps the last checkpoint, kills every actor, removes the placement group and
shuts Ray down (when it started it). When several ranks fail, the primary failure is chosen
as: an actor death, then a raised error that is not a communication error, then the rest
(a peer of a dead rank typically sees "connection closed" from gloo).

Ctrl-C. While steps run (in the main thread), the first SIGINT asks the launcher to stop after
the current step: the step finishes (within ``step_timeout``), its checkpoint is written (when
there is a checkpoint folder) and :class:`runtime.runner.LaunchInterrupted` (a
``KeyboardInterrupt``) is raised naming it; a second SIGINT stops at once (a plain
``KeyboardInterrupt``; the last checkpoint written is kept). Ray's worker processes block SIGINT,
so a terminal's Ctrl-C reaches only this driver.

Sources: Ray placement groups and actor fault tolerance (https://docs.ray.io/en/latest/ray-core/),
``torch.distributed`` (https://pytorch.org/docs/stable/distributed.html).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence, cast

import torch

from engine.errors import TaskError, TesselError
from engine.io import Plan, write_trace
from engine.layout import LEGACY, world_devices
from engine.models import check_model_name, task_for_plan
from engine.plan.check import check_plan
from engine.plan.metrics import predict
from runtime import cluster as _cluster
from runtime import worker as _worker
from runtime.config import LaunchConfig, check_optimizer
from runtime.interrupt import StopRequest, stop_on_sigint
from runtime.launch_result import LaunchResult, finish_times, merge_moe_metrics, merge_timeline
from runtime.node_placement import ranks_by_node_text
from runtime.runner import LaunchError, LaunchFailure, LaunchInterrupted, Runner, as_plan
from runtime.session import StepReport, TrainingCallback, TrainingSession, restore_checkpoint, resume_point
from runtime.stages import check_executable, check_transforms
from runtime.stages.checks import check_model_parallelism
from runtime.user_code import user_code_runtime_env
from runtime.worker.config import OptimizerName, WorkerConfig

logger = logging.getLogger(__name__)


def shared_cores(world_size: int, config: LaunchConfig, cores: int | None = None) -> int | None:
    """This machine's cores (``cores``, default ``os.cpu_count()``) when a local launch's CPU ranks
    outnumber them, else ``None``. Not for a cluster (``config.address``: its nodes' cores are not
    this machine's) nor for GPU ranks."""
    if config.address is not None or config.device == "cuda":
        return None
    if config.device == "auto":
        if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
            return None
    cores = cores or os.cpu_count() or 1
    return cores if world_size > cores else None


def shared_cores_warning(world_size: int, config: LaunchConfig, cores: int | None = None) -> str | None:
    """The warning for a local launch whose CPU ranks outnumber this machine's cores
    (:func:`shared_cores`), else ``None``. The plan gives every rank a device of its own, so
    there each step is measured slower than predicted (4 ranks on 2 cores measured 3-7x the
    prediction here; ``tessel tune --host-cores`` and ``tessel launch --calibrate`` model it)."""
    got = shared_cores(world_size, config, cores)
    if got is None:
        return None
    return (f"{world_size} CPU ranks share this machine's {got} cores: each step will be measured slower than "
            "predicted, since the plan gives every rank a device of its own (use at most "
            f"{got} ranks here, or a cluster: --address)")


def _fail_at_for(fail_at: Any, rank: int) -> tuple[int, int] | None:
    """``fail_at`` of one rank from ``(rank, step, instruction_index)`` or ``{rank: (step, index)}``."""
    if fail_at is None:
        return None
    if isinstance(fail_at, dict):
        v = fail_at.get(rank)
        return None if v is None else (int(v[0]), int(v[1]))
    r, s, i = fail_at
    return (int(s), int(i)) if int(r) == rank else None


def check_launchable(plan: Plan, *, name: str = "the plan") -> None:
    """Refuse a plan that cannot train correctly, before any Ray work (no cluster, no actors).

    Checks the plan's own consistency, then its schedule as ``tessel show`` does
    (:meth:`engine.schedule.Schedule.validate`: every block of every micro-batch once on its
    devices, each block after the blocks it depends on on the same device, no cross-device
    deadlock). Without it a deadlocking plan hangs until the step timeout, a backward before its
    forward fails inside a worker, and a plan declaring more micro-batches than its orders hold
    trains the orders' micro-batches but counts (and reports the throughput of) the declared ones.

    Args:
        plan: the loaded ``engine.io.Plan``.
        name: how the messages name the plan (e.g. its path).

    Raises:
        engine.errors.ScheduleError: ``parallel.micro_batches`` differs from
            ``schedule.num_micro_batches`` (rule ``"micro-batches"``), ``parallel.pp`` differs from
            the schedule's device count (rule ``"device"``), or the schedule breaks a rule of
            ``Schedule.validate``; the sentence names the plan and says how to fix it.
        engine.errors.TesselError: a parallel degree that is not a positive integer
            (``ParallelConfig.check``).
    """
    check_plan(plan, name=name)


def _start_workers(worker_cls: type, plan_dict: dict, ws: int, config: LaunchConfig,
                   optimizer: str) -> tuple[_cluster.ActorPool, _cluster.Backend]:
    """Choose the backend and start one ``worker_cls`` actor per rank (``runtime.cluster``), world
    rank ``w`` on the bundle of device ``engine.layout.world_devices(...)[w]`` (the plan's layout:
    tensor groups inside a node); on a cluster (``config.address``) device ``i`` on the
    ``i // devices_per_node``-th node (the plan's cost model, :mod:`runtime.node_placement`).

    Raises:
        LaunchError: (``kind="cluster"``) the cluster cannot host the plan.
    """
    seed, lr, fail_at, p2p = config.seed, config.lr, config.fail_at, config.p2p_matching
    release = bool(config.release_freed_memory)

    def make_args(backend: _cluster.Backend):
        def args_for_rank(r: int, addr: str, port: int):
            wc = WorkerConfig(backend=backend.name, seed=seed, lr=lr,
                              optimizer=cast(OptimizerName, optimizer), fail_at=_fail_at_for(fail_at, r),
                              # NCCL: CUDA tensors (the actor sees its one GPU as cuda:0)
                              device="cuda" if backend.use_gpu else None, p2p_matching=p2p or "auto",
                              release_freed_memory=release)
            return ((plan_dict, r, ws, addr, port), {"config": wc})
        return args_for_rank

    par = plan_dict["parallel"]
    devices = world_devices(par.get("tp", 1), par.get("dp", 1), par.get("pp", 1), par.get("layout", LEGACY))
    # default: rank r on device r
    placed: dict[str, Any] = {"device_of": devices} if devices != list(range(ws)) else {}
    if config.address is not None:   # a cluster: each rank on the node the plan put its device on
        placed["devices_per_node"] = int((plan_dict.get("cost") or {}).get("devices_per_node") or ws)
    return _cluster.start_actors(worker_cls, ws, config.device, make_args, step_timeout=config.step_timeout,
                                 error=LaunchError, **placed)


@dataclass
class _Loop:
    """What the step loop collected besides the session's losses."""

    moe: list[dict] = field(default_factory=list)
    last_results: list[dict] = field(default_factory=list)
    recent: list[list[dict]] = field(default_factory=list)  # the ranks' results of the last keep_timelines steps


def _interrupted(session: TrainingSession, done: int) -> LaunchInterrupted:
    """The :class:`LaunchInterrupted` after ``done`` completed steps, their checkpoint written first
    (unless the cadence just wrote it, or the session has no checkpoint folder)."""
    path = session.checkpoint_done(done)
    if path is None:
        msg = (f"launch interrupted after {done} of {session.steps} steps; it had no checkpoint folder, so nothing "
               "was saved")
    else:
        msg = f"launch interrupted after {done} of {session.steps} steps; their checkpoint is {path}"
    return LaunchInterrupted(msg, checkpoint=path, steps_done=done, steps=session.steps)


def _train(session: TrainingSession, callbacks: Sequence[TrainingCallback], *, dp: int, keep_timelines: int,
           stop: StopRequest | None = None) -> _Loop:
    """Run the session's steps, reporting each to ``callbacks``, evaluating and checkpointing.

    Raises:
        LaunchInterrupted: ``stop`` was requested (SIGINT) while steps remained: raised after the
            current step and its checkpoint.
        LaunchFailure: a rank failed, or a checkpoint could not be written.
    """
    loop = _Loop()
    for step in range(session.start_step, session.steps):
        out = session.run_step(step)
        results = out.results
        loop.last_results = results
        if keep_timelines > 0:
            loop.recent.append(results)
            del loop.recent[:-keep_timelines]
        gates = merge_moe_metrics(results, dp)
        if gates is not None:
            loop.moe.append({"step": step, **gates})
        report = StepReport(step=step, steps=session.steps, loss=out.loss, seconds=out.seconds,
                            tokens_per_step=out.units if out.unit == "tokens" else 0, gates=gates,
                            unit=out.unit, units_per_step=out.units)
        for cb in callbacks:
            cb.on_step(report)
        session.after_step(step + 1)
        if stop is not None and stop.requested and step + 1 < session.steps:
            if session.checkpoint_dir is not None:
                _notice(callbacks, f"interrupted: checkpointing the {step + 1} steps done (Ctrl-C again stops at "
                                   "once, keeping the last checkpoint)")
            raise _interrupted(session, step + 1)
    return loop


def predicted_rate(plan: Plan, metrics: dict | None, *, unit: str, units_per_step: int) -> float | None:
    """The throughput ``plan`` predicts for a launch, in the launch's ``unit`` per second, or
    ``None`` when there is no prediction (never ``0``).

    ``metrics`` is the plan's freshly predicted metrics (``engine.plan.metrics.predict``, the numbers
    ``tessel plan``/``search``/``show`` print), or ``None`` when the prediction failed; then the
    plan's saved ``plan.metrics`` are read instead. Their ``tokens_per_second`` is the prediction when
    the launch counts tokens of the batch the plan was made for (its ``tokens_per_step``, where
    recorded, equals ``units_per_step``); otherwise ``units_per_step`` over their ``makespan``
    (seconds; a task override counting samples, or another batch); ``None`` for a plan without a
    positive, finite prediction (an abstract plan, one saved without metrics).
    """
    m = metrics if metrics is not None else plan.metrics
    if m.get("time_unit", "s") != "s":
        return None
    tps, per_step, mk = m.get("tokens_per_second"), m.get("tokens_per_step"), m.get("makespan")

    def usable(x: Any) -> bool:
        return isinstance(x, (int, float)) and math.isfinite(x) and x > 0

    if unit == "tokens" and usable(tps) and (per_step is None or per_step == units_per_step):
        return float(cast(float, tps))
    if usable(mk) and units_per_step > 0:
        return units_per_step / float(cast(float, mk))
    return None


def _measure(plan: Plan, loop: _Loop, *, ws: int, pp: int, steps: int, backend: str, trace_path: Any,
             unit: str, units_per_step: int, rank_nodes: list[dict] | None = None) -> dict:
    """The measured and predicted timelines' figures for :class:`LaunchResult` (and the trace); the
    prediction is ``engine.plan.metrics.predict``'s, the one every command prints."""
    timelines = [merge_timeline(r, pp) for r in loop.recent]
    timeline = (timelines[-1] if timelines else merge_timeline(loop.last_results, pp)) if loop.last_results else None
    trace_paths: dict[str, str] = {}
    if timeline is not None and trace_path is not None:
        trace_paths["measured"] = str(write_trace(timeline, os.fspath(trace_path), metadata={
            "schedule": plan.schedule.name, "backend": backend, "step": steps - 1,
            "world_size": ws, "measured": True, "rank_nodes": rank_nodes or []}))
    predicted: Any = None
    metrics: dict | None = None
    try:
        predicted, metrics = predict(plan)
    except TesselError:
        pass
    nan = [math.nan] * pp
    return dict(
        predicted_units_per_second=predicted_rate(plan, metrics, unit=unit, units_per_step=units_per_step),
        timeline=timeline, timelines=timelines, trace_paths=trace_paths,
        predicted_step_time=finish_times(predicted, pp) if predicted is not None else nan,
        predicted_busy=[predicted.busy_time(r) for r in range(pp)] if predicted is not None else nan,
        measured_step_time=finish_times(timeline, pp) if timeline is not None else nan,
        measured_busy=[timeline.busy_time(r) for r in range(pp)] if timeline is not None else nan,
        predicted_makespan=predicted.makespan if predicted is not None else math.nan,
        measured_makespan=timeline.makespan if timeline is not None else math.nan,
        peak_memory=[int(res.get("peak_memory", 0) or 0) for res in loop.last_results],
        optimizer_state_bytes=[int(res.get("optimizer_state_bytes", 0) or 0) for res in loop.last_results],
    )


def launch(
    plan: Any,
    config: LaunchConfig | None = None,
    *,
    callbacks: Sequence[TrainingCallback] = (),
    worker_cls: type | None = None,
) -> LaunchResult:
    """Train ``plan`` on Ray actors for ``config.steps`` steps and measure it.

    Args:
        plan: an ``engine.io.Plan``, its ``to_dict()``, or a path to ``plan.json``.
        config: the :class:`runtime.config.LaunchConfig` (steps, cluster, checkpoints, optimizer,
            ...); ``None``: its defaults.
        callbacks: :class:`runtime.session.TrainingCallback` objects told of the start, each
            step (a :class:`runtime.session.StepReport`), notices and the end; e.g. the CLI's
            progress bar (``apps.launch_progress.TqdmProgress``).
        worker_cls: the per-rank worker class (default ``runtime.worker.StageWorker``).

    Returns:
        the :class:`LaunchResult`.

    Raises:
        LaunchFailure: (a ``LaunchError`` and an ``engine.errors.RunError``) a rank raised, died or
            hung, or a checkpoint could not be written (message names rank, step and instruction;
            the last checkpoint is kept; actors are killed and Ray shut down).
        LaunchInterrupted: SIGINT during the steps: raised after the current step and its
            checkpoint (a ``KeyboardInterrupt``; a second SIGINT raises a plain one at once).
        LaunchError: (``kind="setup"``, before Ray starts) ``steps < 1``, an unknown optimizer or
            p2p matching, an unknown task or one that does not fit the model (``engine.errors.TaskError``'s
            sentence), ``resume`` without a checkpoint folder holding a checkpoint, or ``resume``
            from a checkpoint written with another optimizer.
        engine.errors.ScheduleError: the plan fails :func:`check_launchable` (before Ray starts).
        CheckpointError: ``resume`` with a checkpoint of another plan or world size, or with no
            intact checkpoint (each damaged one is skipped with a warning naming the damaged file).
        runtime.stages.RuntimeNotSupported: the plan uses multi-device blocks, a non-chain placement,
            tensor parallelism on a model without the layer split, or a CoCoNet transformation the
            runtime does not execute.
        engine.errors.PlanFormatError: a malformed plan file.
    """
    config = config if config is not None else LaunchConfig()
    t_start = time.perf_counter()
    plan = as_plan(plan)
    check_launchable(plan)  # a deadlock, a backward before its forward, ... refused before any Ray work
    par = plan.parallel
    dp, pp = par.dp, par.pp
    check_executable(plan)  # RuntimeNotSupported (a TesselError) before any Ray work: multi-device blocks, ...
    check_transforms(par.transforms)
    ws = dp * par.tp * pp   # one actor per (replica, tensor rank, pipeline rank)
    m = par.micro_batches
    mbs = plan.model.micro_batch_size
    config.validate()
    plan, task = _plan_task(plan, config)
    steps = config.steps
    global_bs = dp * m * mbs * plan.schedule.placement.data_per_instance   # X: two micro-batches per instance
    # config.optimizer was checked by config.validate(); the plan's optimizer is checked here
    optimizer: str = config.optimizer or check_optimizer(str(par.optimizer))
    ck, last_ck = resume_point(config.checkpoint_dir, resume=config.resume, plan=plan, world_size=ws, steps=steps,
                               optimizer=optimizer, error=lambda msg, **kw: LaunchError(msg, kind="setup", **kw))
    if worker_cls is None:
        worker_cls = _worker.StageWorker   # looked up now: tests substitute runtime.worker.StageWorker
    check_model_name(plan.model.name)   # a model no rank could build: one sentence now, not one per rank in Ray
    check_model_parallelism(plan)   # a model whose tensor-parallel plan no rank could execute, likewise
    shared = shared_cores_warning(ws, config)
    if shared:
        logger.warning(shared)
    owned = False
    pool = None
    started = False
    clean = False  # True once every step ran: actors get a graceful shutdown() first
    try:
        # the user's model code, to every rank on every node (a job-level runtime_env: Ray uploads
        # local code only there)
        owned = _cluster.init_ray(config.address, runtime_env=user_code_runtime_env(plan.model.name))
        pool, backend = _start_workers(worker_cls, plan.to_dict(), ws, config, optimizer)
        placed = ranks_by_node_text(pool.rank_nodes)
        if placed:
            logger.warning("%s", placed)
        runner = Runner(pool)
        runner.checkpoint = last_ck
        slow = max(config.step_timeout, 60.0)
        infos = runner.call("setup", [()] * ws, timeout=slow, step=None, what="setup")
        if ck is not None:
            restore_checkpoint(runner, ck, ws, timeout=slow)
        setup_time = time.perf_counter() - t_start
        session = TrainingSession(
            runner=runner, plan=plan, world_size=ws, corpus=task, global_batch=global_bs,
            steps=steps, start_step=ck.step if ck is not None else 0, step_timeout=config.step_timeout,
            checkpoint_dir=config.checkpoint_dir, checkpoint_every=config.checkpoint_every,
            eval_every=config.eval_every, keep_checkpoints=config.keep_checkpoints, seed=config.seed,
            meta={"lr": config.lr, "optimizer": optimizer, "backend": backend.name},
            history=list(ck.meta.get("losses", [])) if ck is not None else [],
            val_history=list(ck.meta.get("val_losses", [])) if ck is not None else [])
        for cb in callbacks:
            cb.on_start(start_step=session.start_step, steps=steps)
        started = True
        with stop_on_sigint() as stop:
            loop = _train(session, callbacks, dp=dp, keep_timelines=config.keep_timelines, stop=stop)
        started = False
        _end(callbacks)
        per_step = session.step_units[-1] if session.step_units else 0
        measured = _measure(plan, loop, ws=ws, pp=pp, steps=steps, backend=backend.name, trace_path=config.trace_path,
                            unit=session.unit, units_per_step=per_step, rank_nodes=pool.rank_nodes)
        clean = True
        skip = 1 if len(session.step_times) > 1 else 0   # the first step warms up
        timed, units = session.step_times[skip:], session.step_units[skip:]
        ups = sum(units) / sum(timed) if timed and sum(timed) > 0 else 0.0
        tokens = session.unit == "tokens"
        return LaunchResult(
            steps=steps, start_step=session.start_step, losses=session.losses, val_losses=session.val_losses,
            step_times=session.step_times, tokens_per_step=per_step if tokens else 0,
            tokens_per_second=ups if tokens else 0.0, task=task.name, unit=session.unit,
            units_per_step=per_step, units_per_second=ups,
            checkpoint=runner.checkpoint, backend=backend.name, optimizer=optimizer, world_size=ws, dp=dp, pp=pp,
            elapsed=time.perf_counter() - t_start, setup_time=setup_time, moe=loop.moe,
            memory_baseline=[int(i.get("memory_baseline", 0) or 0) if isinstance(i, dict) else 0 for i in infos],
            rank_nodes=pool.rank_nodes, **measured)
    finally:
        if started:
            _end(callbacks)
        if pool is not None:
            pool.close(graceful=clean)
        _cluster.shutdown_ray(owned)


def _plan_task(plan: Plan, config: LaunchConfig) -> tuple[Plan, Any]:
    """The plan the workers get (``model.task`` set to ``config.task`` when it overrides the plan's)
    and its task (:func:`engine.models.bundle.task_for_plan`, data seed ``config.data_seed``).

    Raises:
        LaunchError: (``kind="setup"``) the task is unknown or does not fit the model.
    """
    if config.task is not None and config.task != plan.model.task:
        plan = replace(plan, model=replace(plan.model, task=config.task))
    try:
        return plan, task_for_plan(plan, seed=config.data_seed)
    except TaskError as e:
        raise LaunchError(str(e), kind="setup") from e


def _notice(callbacks: Sequence[TrainingCallback], message: str) -> None:
    """``message`` to every callback's ``on_notice`` (the CLI prints it there; logged at DEBUG only, so
    a verbose CLI does not show it twice)."""
    logger.debug("%s", message)
    for cb in callbacks:
        cb.on_notice(message)


def _end(callbacks: Sequence[TrainingCallback]) -> None:
    for cb in callbacks:
        cb.on_end(job=None)


__all__ = ["check_launchable", "launch", "predicted_rate", "LaunchResult", "LaunchError", "LaunchFailure",
           "LaunchInterrupted", "merge_moe_metrics"]
