"""Launch several data-parallel plans on the same Ray actors (CrossoverScheduler).

``launch_crossover([a, b], CrossoverConfig(steps=20, mode="crossover"))`` (``runtime.config``)
starts (or connects to) Ray, creates ONE
:class:`runtime.crossover.actor.CrossoverActor` per device (``world_size`` = every job's ``dp``;
the plans must be pure data parallel, ``pp == 1``, and all of the same world size), sets up one
:class:`runtime.worker.StageWorker` per job inside every actor (one default process group per
actor, each job its own ``new_group``), and then runs every job's step loop from its own driver
thread; inside the actor each job's step runs in its own thread (a threaded actor,
``max_concurrency = jobs + 2``).

Modes (:data:`engine.crossover.MODES`, the one definition planner and runtime share):

- ``"crossover"``: a per-device compute token (:class:`runtime.crossover.token.ComputeToken`) is
  acquired before a job's step's first forward and released once the step has posted its
  gradient all-reduce, so one job computes while the other synchronises (fair FIFO; deadlock-free
  because nothing inside a compute section waits on another rank).
- ``"uncoordinated"``: no token; the jobs free-run concurrently on the same devices (compute
  sections are still recorded).
- ``"sequential"``: job 0 runs all its steps, then job 1, ... on the same actors.

Each job keeps its own optimizer (its own worker), its own data stream
(``ByteCorpus(seq_len, seed=data_seeds[j])``; ``data_seeds`` defaults to the job index, so job 0
sees exactly the batches :func:`runtime.launch` would), its own checkpoints (``checkpoint_dirs[j]``,
written with :mod:`runtime.checkpoint`; without RNG states, since the jobs share each actor's
global RNG) and its own ``resume``. Only timing changes between modes: a job's losses and
parameters are those of the job run alone.

Throughput. Each job reports ``tokens_per_second`` over its timed steps (``warmup_steps`` first
steps excluded). The aggregate is the tokens of every job's timed steps divided by the timed wall
time: in the concurrent modes from the moment every job has finished its warm-up steps (the job
threads meet at a barrier) to the end of the last job's last step; in ``"sequential"`` the sum of
the jobs' own timed walls (job ``j``'s warm-up runs while no other job runs, and is not counted).

Faults. A job whose rank raises, dies or hangs (``step_timeout``) is stopped and reported (job,
rank, step, instruction); the other jobs keep running to their end (a failed job holds no token:
a step releases it in ``finally``, and the failed job's surviving ranks wait in their own
all-reduce, on their own process group, without it). A rank that HANGS inside its compute
section keeps its device's token: the other jobs' steps on that device then fail with a token
timeout after ``step_timeout`` instead of waiting forever. An actor that dies takes every job's
rank on it down. At the end every actor is killed, the placement group removed and Ray shut down
(when this call started it); then :class:`runtime.runner.CrossoverLaunchError` (a ``LaunchError``
and the planner's :class:`engine.crossover.CrossoverError`) is raised naming the failed job(s),
with the partial :class:`CrossoverResult` attached (or, with ``raise_on_failure=False``, the
result is returned with each failed job's ``error``).

Each job trains through its own :class:`runtime.session.TrainingSession` (the single-plan
launcher's steps, evaluation, checkpoints and resume checks); progress goes to the ``callbacks``
(:class:`runtime.session.TrainingCallback`, called from the job's thread) and to ``logging``.

Sources: CrossoverScheduler (docs/ARCHITECTURE.md, Sources), Ray threaded actors
(https://docs.ray.io/en/latest/ray-core/actors/async_api.html), ``torch.distributed.new_group``
(https://pytorch.org/docs/stable/distributed.html).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from runtime import checkpoint as _ckpt
from runtime import cluster as _cluster
from runtime.config import CrossoverConfig, check_optimizer, per_job
from runtime.crossover.actor import CrossoverActor
from runtime.crossover.result import CrossoverJobResult, CrossoverResult, job_label, job_timeline, run_timeline
from runtime.crossover.token import TokenInterval
from runtime.data import ByteCorpus
from runtime.interrupt import StopRequest, stop_on_sigint
from runtime.runner import (
    CrossoverLaunchError,
    CrossoverLaunchFailure,
    LaunchError,
    LaunchFailure,
    LaunchInterrupted,
    Runner,
    as_plan,
)
from runtime.session import StepReport, TrainingCallback, TrainingSession, restore_checkpoint, resume_point
from runtime.stages import check_executable

__all__ = ["CrossoverJobResult", "CrossoverResult", "launch_crossover"]

logger = logging.getLogger(__name__)

def _job_name(plan_arg: Any, plan, j: int) -> str:
    if isinstance(plan_arg, (str, os.PathLike)):
        return Path(plan_arg).name
    return f"{plan.model.name or 'plan'} #{j}"


@dataclass
class _Jobs:
    """The co-located jobs' plans and per-job settings, checked before Ray starts."""

    loaded: list
    names: list[str]
    ws: int
    steps: list[int]
    seeds: list[int]
    lrs: list[float]
    data_seeds: list[int]
    optimizers: list[str]
    ckdirs: list[Path | None]
    fail_at: dict[int, tuple[int, int, int]]

    @property
    def n(self) -> int:
        return len(self.loaded)


def _check_plans(loaded: list, names: list[str]) -> int:
    """The common world size (every job's ``dp``) of pure data-parallel plans.

    Raises:
        CrossoverLaunchError: a pipeline plan, different world sizes, a model without ``seq_len``.
        runtime.stages.RuntimeNotSupported: a plan the runtime cannot execute.
    """
    ws = None
    for j, plan in enumerate(loaded):
        check_executable(plan)
        par = plan.parallel
        pp, dp = par.pp, par.dp
        if par.tp > 1:
            raise CrossoverLaunchError(
                f"job {j} ({names[j]}) has tp = {par.tp}; co-location runs pure data-parallel plans (tp = 1, "
                "pp = 1) only. Plan it with dp = devices", job=j, kind="setup")
        pp = max(pp, plan.schedule.placement.num_devices)
        if pp != 1:
            raise CrossoverLaunchError(
                f"job {j} ({names[j]}) has pp = {pp}; co-location runs pure data-parallel plans (pp = 1) only, "
                "because a pipeline stage waits for its neighbours inside its compute, which a per-device "
                "compute token could deadlock. Plan it with dp = devices", job=j, kind="setup")
        if ws is None:
            ws = dp
        elif dp != ws:
            raise CrossoverLaunchError(
                f"co-located jobs must use the same devices: job 0 ({names[0]}) has dp = {ws} but job {j} "
                f"({names[j]}) has dp = {dp}; plan them for the same number of devices", job=j, kind="setup")
        if (plan.model.seq_len or 0) <= 0:
            raise CrossoverLaunchError(f"job {j} ({names[j]}): the plan's model has no seq_len; the runtime trains "
                                 "language models on token sequences", job=j, kind="setup")
    assert ws is not None
    return ws


def _resolve(plans: Sequence[Any], config: CrossoverConfig) -> _Jobs:
    """Load and check the plans and resolve every per-job setting of ``config``.

    Raises:
        CrossoverLaunchError: (``kind="setup"``) see :func:`launch_crossover`.
    """
    config.validate()
    plans_in = list(plans)
    n = len(plans_in)
    if n < 1:
        raise CrossoverLaunchError("launch_crossover needs at least one plan", kind="setup")
    loaded = [as_plan(p, caller="launch_crossover") for p in plans_in]
    names = [str(x) for x in per_job(list(config.names), n, "names")] if config.names is not None else \
        [_job_name(a, p, j) for j, (a, p) in enumerate(zip(plans_in, loaded))]
    ws = _check_plans(loaded, names)
    steps_j = config.steps_per_job(n)
    seeds = [int(s) for s in per_job(config.seed, n, "seed")]
    lrs = [float(x) for x in per_job(config.lr, n, "lr")]
    dseeds = list(range(n)) if config.data_seeds is None else \
        [int(s) for s in per_job(list(config.data_seeds), n, "data_seeds")]
    opts = []
    for j, (o, plan) in enumerate(zip(per_job(config.optimizer, n, "optimizer"), loaded)):
        try:
            opts.append(check_optimizer(str(o or plan.parallel.optimizer)))
        except LaunchError as e:
            raise CrossoverLaunchError(f"job {j}: {e}", job=j, kind="setup") from None
    return _Jobs(loaded=loaded, names=names, ws=ws, steps=steps_j, seeds=seeds, lrs=lrs, data_seeds=dseeds,
                 optimizers=opts, ckdirs=config.checkpoint_dirs_per_job(n), fail_at=config.fail_at_per_job(n))


def _resume_all(js: _Jobs, resume: bool) -> tuple[list[CrossoverJobResult], list[_ckpt.Checkpoint | None]]:
    """Every job's result record (start step, last checkpoint) and checkpoint to resume from."""
    jobs = [CrossoverJobResult(index=j, name=js.names[j], steps=js.steps[j], label=job_label(j),
                               optimizer=js.optimizers[j], dp=js.ws) for j in range(js.n)]
    cks: list[_ckpt.Checkpoint | None] = [None] * js.n
    for j in range(js.n):
        def error(msg: str, *, _j: int = j, **kw: Any) -> CrossoverLaunchError:
            return CrossoverLaunchError(msg, job=_j, kind="setup", **kw)

        cks[j], jobs[j].checkpoint = resume_point(
            js.ckdirs[j], resume=resume, plan=js.loaded[j], world_size=js.ws, steps=js.steps[j],
            optimizer=js.optimizers[j], error=error, prefix=f"job {j} ({js.names[j]}): ", optimizer_hint=False)
        ck = cks[j]
        jobs[j].start_step = ck.step if ck is not None else 0
    return jobs, cks


def _start_actors(js: _Jobs, config: CrossoverConfig) -> tuple[_cluster.ActorPool, _cluster.Backend]:
    """One :class:`CrossoverActor` per device, each with every job's worker spec.

    Raises:
        CrossoverLaunchError: (``kind="cluster"``) the cluster cannot host the jobs.
    """
    ws, step_timeout, fail_at = js.ws, config.step_timeout, js.fail_at
    job_specs = [{"plan": js.loaded[j].to_dict(), "seed": js.seeds[j], "lr": js.lrs[j],
                  "optimizer": js.optimizers[j]} for j in range(js.n)]

    def make_args(backend: _cluster.Backend):
        def args_for_rank(r: int, addr: str, port: int):
            specs = []
            for j, s in enumerate(job_specs):
                fa = fail_at.get(j)
                specs.append(dict(s, fail_at=(int(fa[1]), int(fa[2])) if fa is not None and int(fa[0]) == r
                                  else None))
            return ((r, ws, addr, port, specs),
                    {"mode": config.mode, "backend": backend.name, "timeout_s": step_timeout,
                     "token_timeout": step_timeout})
        return args_for_rank

    actor_cls = ray.remote(max_concurrency=js.n + 2)(CrossoverActor)  # type: ignore[call-overload]
    return _cluster.start_actors(actor_cls, ws, config.device, make_args, step_timeout=step_timeout,
                                 error=CrossoverLaunchError)


class _TimedPhase:
    """Where the jobs' timed phase begins: concurrent jobs meet at a barrier after their warm-up."""

    def __init__(self, n: int, concurrent: bool, timeout: float):
        self.barrier = threading.Barrier(n) if concurrent else None
        self.timeout = timeout
        self.starts: list[float] = []
        self._lock = threading.Lock()

    def begin(self) -> None:
        if self.barrier is not None:
            try:
                self.barrier.wait(timeout=self.timeout)
            except threading.BrokenBarrierError:
                pass
        with self._lock:
            self.starts.append(time.perf_counter())

    def abort(self) -> None:
        """Never keep the other jobs waiting for a job that stopped before its timed phase."""
        if self.barrier is not None:
            self.barrier.abort()


def _job_session(j: int, js: _Jobs, job: CrossoverJobResult, runner: Runner, ck: _ckpt.Checkpoint | None,
                 config: CrossoverConfig, backend: str) -> TrainingSession:
    """Job ``j``'s :class:`TrainingSession`; its losses, validation losses and step times are the
    lists of its :class:`CrossoverJobResult` (so a failed job keeps its progress)."""
    plan = js.loaded[j]
    par = plan.parallel
    m = par.micro_batches
    mbs = plan.model.micro_batch_size
    seq_len = int(plan.model.seq_len or 0)
    job.tokens_per_step = js.ws * m * mbs * seq_len
    return TrainingSession(
        runner=runner, plan=plan, world_size=js.ws, corpus=ByteCorpus(seq_len=seq_len, seed=js.data_seeds[j]),
        global_batch=js.ws * m * mbs, steps=job.steps, start_step=job.start_step, step_timeout=config.step_timeout,
        job=j, checkpoint_dir=js.ckdirs[j], checkpoint_every=config.checkpoint_every, eval_every=config.eval_every,
        keep_checkpoints=config.keep_checkpoints, seed=js.seeds[j], rng=False,
        meta={"lr": js.lrs[j], "optimizer": js.optimizers[j], "backend": backend, "data_seed": js.data_seeds[j],
              "crossover": {"mode": config.mode, "job": j, "jobs": js.n, "name": js.names[j]}},
        history=list(ck.meta.get("losses", [])) if ck is not None else [],
        val_history=list(ck.meta.get("val_losses", [])) if ck is not None else [],
        losses=job.losses, val_losses=job.val_losses, step_times=job.step_times)


def _run_job(session: TrainingSession, job: CrossoverJobResult, phase: _TimedPhase, warmup_steps: int,
             callbacks: Sequence[TrainingCallback], stop: StopRequest | None = None) -> None:
    """Job ``session.job``'s step loop (in its driver thread); failures are recorded in ``job``.
    When ``stop`` is requested (Ctrl-C) the loop ends after the current step, whose checkpoint is
    written first (unless the cadence just wrote it); ``job.interrupted_at`` records the steps done."""
    j = job.index
    began = False
    try:
        for cb in callbacks:
            cb.on_start(start_step=job.start_step, steps=job.steps, job=j)
        for k, step in enumerate(range(job.start_step, job.steps)):
            if k == min(warmup_steps, job.steps - job.start_step - 1):
                phase.begin()
                began = True
            out = session.run_step(step)
            results = out.results
            job.token_wait += sum(float(res.get("token_wait", 0.0)) for res in results) / len(results)
            if began:
                job.timed_steps += 1
                if job._t_first is None:
                    job._t_first = out.t0
                job._t_last = out.t1
                for res in results:
                    job._events.append((float(res.get("start", out.t0)),
                                        {"rank": res["rank"], "events": res.get("events", [])}))
            job.timeline = job_timeline(results, session.world_size)
            report = StepReport(step=step, steps=job.steps, loss=out.loss, seconds=out.seconds,
                                tokens_per_step=job.tokens_per_step, job=j, name=job.name, token_wait=job.token_wait)
            for cb in callbacks:
                cb.on_step(report)
            session.after_step(step + 1)
            if stop is not None and stop.requested and step + 1 < job.steps:
                session.checkpoint_done(step + 1)
                job.interrupted_at = step + 1
                break
    except LaunchError as e:
        job.error, job.failed_rank, job.failed_step, job.kind = str(e), e.rank, e.step, e.kind
    except Exception as e:  # noqa: BLE001 - checkpoint I/O, Ray errors outside a call: the job's error
        job.error, job.kind = f"{type(e).__name__}: {e}", "raised"
    finally:
        job.checkpoint = session.checkpoint
        if not began:
            phase.abort()
        for cb in callbacks:
            cb.on_end(job=j)
        if job.error is not None:
            # INFO: the failure is also raised (or returned in the result), where the caller reports it
            logger.info("job %d (%s) failed: %s", j, job.name, job.error)


def _interrupted(jobs: Sequence[CrossoverJobResult]) -> LaunchInterrupted:
    """The :class:`LaunchInterrupted` of a co-located launch stopped by Ctrl-C: each job's steps
    done and its checkpoint (the first job's is the one ``--resume`` names first)."""
    def done(j: CrossoverJobResult) -> int:
        return j.interrupted_at if j.interrupted_at is not None else j.start_step + len(j.losses)

    parts = [f"job {j.index} ({j.name}) after {done(j)} of {j.steps} steps, "
             + (f"checkpoint {j.checkpoint}" if j.checkpoint else "no checkpoint") for j in jobs]
    return LaunchInterrupted("co-located launch interrupted: " + "; ".join(parts),
                             checkpoint=jobs[0].checkpoint, steps_done=done(jobs[0]), steps=jobs[0].steps)


def _token_records(pool: _cluster.ActorPool) -> tuple[list[TokenInterval], list[int]]:
    """Every device's compute sections (sorted by device, then acquisition) and most holders."""
    intervals: list[TokenInterval] = []
    max_holders: list[int] = []
    for a in pool.actors:
        try:
            ivs = ray.get(a.intervals.remote(), timeout=30)
            stats = ray.get(a.token_stats.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - an actor that died with a job: its intervals are lost
            max_holders.append(-1)
            continue
        intervals.extend(TokenInterval(*iv) for iv in ivs)
        max_holders.append(int(stats["max_holders"]))
    intervals.sort(key=lambda x: (x.device, x.acquire))
    return intervals, max_holders


def _throughput(jobs: list[CrossoverJobResult], concurrent: bool, phase_starts: list[float],
                t_start: float) -> tuple[int, float, float]:
    """Per job ``tokens_per_second`` and ``timed_wall`` (set in place); returns ``(total_tokens,
    wall seconds of the timed phase, its origin on the perf_counter clock)``."""
    for job in jobs:
        timed = job.step_times[len(job.step_times) - job.timed_steps:] if job.timed_steps else []
        job.tokens_per_second = job.tokens_per_step * len(timed) / sum(timed) if timed and sum(timed) > 0 else 0.0
        job.timed_wall = (job._t_last - job._t_first) if job._t_first is not None and job._t_last is not None else 0.0
    total_tokens = sum(job.tokens_per_step * job.timed_steps for job in jobs)
    if concurrent:
        lasts = [job._t_last for job in jobs if job._t_last is not None]
        origin = max(phase_starts) if phase_starts else t_start
        wall = (max(lasts) - origin) if lasts else 0.0
    else:
        origin = min((job._t_first for job in jobs if job._t_first is not None), default=t_start)
        wall = sum(job.timed_wall for job in jobs)
    return total_tokens, wall, origin


def _failure(result: CrossoverResult) -> CrossoverLaunchError | None:
    """The error naming the failed jobs (and the completed ones), or ``None`` when all completed: a
    :class:`CrossoverLaunchFailure` (exit status 3), since the plans were checked before Ray started."""
    jobs = result.jobs
    failed = [job for job in jobs if not job.ok]
    if not failed:
        return None
    first = failed[0]
    done_jobs = [f"job {job.index} ({job.name}) completed {len(job.losses)} steps" for job in jobs if job.ok]
    msg = "; ".join(f"job {job.index} ({job.name}) failed: {job.error}" for job in failed)
    if done_jobs:
        msg += "; " + ", ".join(done_jobs)
    # the jobs passed the checks before Ray started: a job that fails now failed at run time
    return CrossoverLaunchFailure(msg, job=first.index, result=result, rank=first.failed_rank, step=first.failed_step,
                                  kind=first.kind or "raised", checkpoint=first.checkpoint)


def _setup(pool: _cluster.ActorPool, js: _Jobs, cks: list[_ckpt.Checkpoint | None], timeout: float) -> None:
    """Every actor's ``setup()``, then each resumed job's checkpoint.

    Raises:
        CrossoverLaunchFailure: a rank failed or hung (exit status 3); CrossoverLaunchError: a refused setting.
    """
    try:
        Runner(pool).call("setup", [()] * js.ws, timeout=timeout, step=None, what="setup")
        for j, ck in enumerate(cks):
            if ck is not None:
                restore_checkpoint(Runner(pool), ck, js.ws, timeout=timeout, job=j, rng=False)
    except LaunchError as e:
        cls = CrossoverLaunchFailure if isinstance(e, LaunchFailure) else CrossoverLaunchError
        raise cls(f"setting up the co-located jobs failed: {e}", rank=e.rank, kind=e.kind) from e


def launch_crossover(
    plans: Sequence[Any],
    config: CrossoverConfig | None = None,
    *,
    callbacks: Sequence[TrainingCallback] = (),
) -> CrossoverResult:
    """Train several data-parallel plans on the same actors, co-located (see the module docstring).

    Args:
        plans: ``engine.io.Plan`` objects, their dicts, or paths to plan JSON; one or more. Every
            plan must be pure data parallel (``pp == 1``, ``tp == 1``) with the same ``dp``.
        config: the :class:`runtime.config.CrossoverConfig` (steps, mode, per-job seeds, learning
            rates, optimizers, checkpoint folders, ...); ``None``: its defaults.
        callbacks: :class:`runtime.session.TrainingCallback` objects; each job calls them from its
            own driver thread (:class:`runtime.session.StepReport` with ``job`` and ``name``).

    Returns:
        the :class:`CrossoverResult`.

    Raises:
        CrossoverLaunchError: invalid plans or configuration (before Ray starts: ``pp > 1``, different
            world sizes, an unknown mode/optimizer, shared checkpoint folders...), a setup failure,
            or a failed job (after the other jobs finished; ``.job``, ``.rank`` and ``.result``
            set) unless ``config.raise_on_failure`` is off.
        runtime.checkpoint.CheckpointError: ``resume`` from a checkpoint of another plan.
        runtime.stages.RuntimeNotSupported: a plan the runtime cannot execute.
    """
    config = config if config is not None else CrossoverConfig()
    t_start = time.perf_counter()
    js = _resolve(plans, config)
    jobs, cks = _resume_all(js, config.resume)
    owned = False
    pool = None
    clean = False
    try:
        owned = _cluster.init_ray(config.address)
        pool, backend = _start_actors(js, config)
        slow = max(config.step_timeout, 60.0)
        _setup(pool, js, cks, slow)
        setup_time = time.perf_counter() - t_start
        concurrent = config.mode != "sequential"
        phase = _TimedPhase(js.n, concurrent, slow * 2)
        sessions = []
        for j in range(js.n):
            runner = Runner(pool)
            runner.checkpoint = jobs[j].checkpoint
            sessions.append(_job_session(j, js, jobs[j], runner, cks[j], config, backend.name))
        with stop_on_sigint() as stop:
            run_args = [(sessions[j], jobs[j], phase, config.warmup_steps, callbacks, stop) for j in range(js.n)]
            if concurrent:
                threads = [threading.Thread(target=_run_job, args=run_args[j], name=f"tessel-crossover-job{j}",
                                            daemon=True) for j in range(js.n)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            else:
                for j in range(js.n):
                    if stop.requested:   # sequential: a job not yet started is not started
                        break
                    _run_job(*run_args[j])
        if stop.requested:
            clean = all(j.error is None for j in jobs)
            raise _interrupted(jobs)
        total_tokens, wall, origin = _throughput(jobs, concurrent, phase.starts, t_start)
        intervals, max_holders = _token_records(pool)
        result = CrossoverResult(
            mode=config.mode, jobs=jobs, world_size=js.ws, backend=backend.name, warmup_steps=config.warmup_steps,
            total_tokens=total_tokens, wall_time=wall, aggregate_tokens_per_second=total_tokens / wall if wall > 0
            else 0.0, intervals=intervals, max_holders=max_holders, timeline=run_timeline(jobs, origin, js.ws),
            elapsed=time.perf_counter() - t_start, setup_time=setup_time)
        clean = result.ok
        err = _failure(result)
        if err is not None and config.raise_on_failure:
            raise err
        return result
    finally:
        if pool is not None:
            pool.close(graceful=clean)
        _cluster.shutdown_ray(owned)
