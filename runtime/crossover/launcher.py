"""Launch several data-parallel plans on the same Ray actors (CrossoverScheduler).

``launch_crossover([a, b], steps=20, mode="crossover")`` starts (or connects to) Ray, creates ONE
:class:`runtime.crossover.actor.CrossoverActor` per device (``world_size`` = every job's ``dp``;
the plans must be pure data parallel, ``pp == 1``, and all of the same world size), sets up one
:class:`runtime.worker.StageWorker` per job inside every actor (one default process group per
actor, each job its own ``new_group``), and then runs every job's step loop from its own driver
thread; inside the actor each job's step runs in its own thread (a threaded actor,
``max_concurrency = jobs + 2``).

Modes (:data:`MODES`):

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
rank on it down. At the end every actor is killed, the
placement group removed and Ray shut down (when this call started it); then
:class:`CrossoverError` is raised naming the failed job(s), with the partial
:class:`CrossoverResult` attached (or, with ``raise_on_failure=False``, the result is returned
with each failed job's ``error``).

Sources: CrossoverScheduler (``../shared/TECHNIQUES.md``), Ray threaded actors
(https://docs.ray.io/en/latest/ray-core/actors/async_api.html), ``torch.distributed.new_group``
(https://pytorch.org/docs/stable/distributed.html).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.timeline import Event, Timeline
from runtime import checkpoint as _ckpt
from runtime import cluster as _cluster
from runtime.crossover.actor import MODES, CrossoverActor
from runtime.crossover.token import TokenInterval, overlapping_intervals
from runtime.launcher import LaunchError, _as_plan, _Runner

__all__ = ["MODES", "CrossoverError", "CrossoverJobResult", "CrossoverResult", "launch_crossover"]

#: ``engine.timeline.Event`` carries the job's name (co-located timelines) where it has the field.
_EVENT_HAS_JOB = "job" in getattr(Event, "__dataclass_fields__", {})


def job_label(j: int) -> str:
    """The short label of job ``j`` on co-located timelines: ``A``, ``B``, ... (``J26``... after ``Z``),
    as ``engine.crossover`` names predicted jobs."""
    return chr(ord("A") + j) if j < 26 else f"J{j}"


class CrossoverError(LaunchError):
    """A co-located launch failed: bad plans (before Ray starts), setup, or one or more jobs.

    Attributes (besides :class:`runtime.launcher.LaunchError`'s ``rank``, ``step``,
    ``instruction``, ``kind``, ``checkpoint``, which describe the first failed job):
        job: index of the (first) failed job, or ``None`` when not job-specific.
        result: the partial :class:`CrossoverResult` (every job's progress and error), or ``None``.
    """

    def __init__(self, message: str, *, job: int | None = None, result: CrossoverResult | None = None, **kw):
        super().__init__(message, **kw)
        self.job = job
        self.result = result


@dataclass
class CrossoverJobResult:
    """One job of a co-located launch.

    Attributes:
        index, name: the job's position and label (the plan file's name, or ``"<model> #<index>"``).
        steps: the step index it was to stop at; ``start_step``: its first step (resume).
        losses: training loss per step run (nats/token, mean over the global batch).
        val_losses: ``[(steps_completed, loss)]``.
        step_times: seconds per step, dispatch to the last rank's result (driver clock; a step's
            wait for the compute token is included).
        token_wait: seconds the job's ranks waited for the token, summed over steps, mean over ranks.
        tokens_per_step: ``dp * micro_batches * micro_batch_size * seq_len``.
        timed_steps, timed_wall: steps after the warm-up and the seconds from the dispatch of the
            first of them to the end of the last.
        tokens_per_second: ``tokens_per_step * timed_steps / sum(timed step_times)``.
        checkpoint: its newest checkpoint directory, or ``None``.
        error: why it failed (one sentence naming the rank), or ``None``; ``failed_rank``,
            ``failed_step``, ``kind`` as in :class:`runtime.launcher.LaunchError`.
        timeline: the measured Timeline of its last step over all devices (``rank`` = device), or ``None``.
        optimizer, dp: the workers' optimizer and the job's data-parallel degree.
        label: its short label on the run's timeline (``A``, ``B``, ...; :func:`job_label`).
    """

    index: int
    name: str
    steps: int
    label: str = ""
    start_step: int = 0
    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    token_wait: float = 0.0
    tokens_per_step: int = 0
    timed_steps: int = 0
    timed_wall: float = 0.0
    tokens_per_second: float = 0.0
    checkpoint: str | None = None
    error: str | None = None
    failed_rank: int | None = None
    failed_step: int | None = None
    kind: str | None = None
    timeline: Timeline | None = None
    optimizer: str = "adam"
    dp: int = 1
    # internal: perf_counter stamps of the timed phase, step results kept for the run's timeline
    _t_first: float | None = field(default=None, repr=False)
    _t_last: float | None = field(default=None, repr=False)
    _events: list[tuple[float, dict, int]] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict:
        """JSON-able summary (the timeline as its metrics)."""
        return {
            "index": self.index, "name": self.name, "label": self.label, "ok": self.ok, "steps": self.steps, "start_step": self.start_step,
            "losses": list(self.losses), "val_losses": [[s, v] for s, v in self.val_losses],
            "step_times": list(self.step_times), "token_wait": self.token_wait,
            "tokens_per_step": self.tokens_per_step, "timed_steps": self.timed_steps, "timed_wall": self.timed_wall,
            "tokens_per_second": self.tokens_per_second, "checkpoint": self.checkpoint, "error": self.error,
            "failed_rank": self.failed_rank, "failed_step": self.failed_step, "kind": self.kind,
            "optimizer": self.optimizer, "dp": self.dp,
            "timeline_metrics": self.timeline.metrics() if self.timeline is not None else None,
        }


@dataclass
class CrossoverResult:
    """What :func:`launch_crossover` measured.

    Attributes:
        mode: ``"crossover"``, ``"uncoordinated"`` or ``"sequential"``.
        jobs: per job, a :class:`CrossoverJobResult`.
        world_size: actors (devices); every job's ``dp``.
        backend: ``"gloo"``.
        warmup_steps: steps per job excluded from the throughput.
        total_tokens: tokens of every job's timed steps.
        wall_time: seconds of the timed phase (see the module docstring).
        aggregate_tokens_per_second: ``total_tokens / wall_time``.
        intervals: every compute section of every device (:class:`TokenInterval`, perf_counter s).
        max_holders: per device, the most jobs that were inside a compute section at once (-1 for
            an actor that could not be asked, e.g. one that died).
        timeline: all jobs' measured events of the timed phase on one Timeline (``rank`` = device,
            names prefixed with the job's label, ``"A 0F0"``, and ``Event.job`` = the label where
            the Event has that field; seconds from the timed phase's start), or ``None``.
        elapsed: seconds of the whole call; ``setup_time``: until every worker was set up.
    """

    mode: str
    jobs: list[CrossoverJobResult]
    world_size: int
    backend: str
    warmup_steps: int
    total_tokens: int
    wall_time: float
    aggregate_tokens_per_second: float
    intervals: list[TokenInterval]
    max_holders: list[int]
    timeline: Timeline | None
    elapsed: float = 0.0
    setup_time: float = 0.0

    @property
    def ok(self) -> bool:
        """Every job completed."""
        return all(j.ok for j in self.jobs)

    def overlaps(self) -> list[tuple[TokenInterval, TokenInterval]]:
        """Compute sections of different jobs on one device that overlap in time (none in
        ``"crossover"`` mode; see :func:`runtime.crossover.token.overlapping_intervals`)."""
        return overlapping_intervals(self.intervals)

    def to_dict(self) -> dict:
        """JSON-able summary (intervals as ``[device, job, acquire, release, step]``)."""
        return {
            "mode": self.mode, "ok": self.ok, "world_size": self.world_size, "backend": self.backend,
            "warmup_steps": self.warmup_steps, "total_tokens": self.total_tokens, "wall_time": self.wall_time,
            "aggregate_tokens_per_second": self.aggregate_tokens_per_second,
            "jobs": [j.to_dict() for j in self.jobs], "intervals": [iv.to_list() for iv in self.intervals],
            "overlapping_sections": len(self.overlaps()), "max_holders": list(self.max_holders),
            "elapsed": self.elapsed, "setup_time": self.setup_time,
            "timeline_metrics": self.timeline.metrics() if self.timeline is not None else None,
        }


def _per_job(value: Any, n: int, what: str) -> list:
    """``value`` for each of ``n`` jobs: a scalar repeated, or a sequence of exactly ``n``."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise CrossoverError(f"{what} has {len(value)} entries but there are {n} jobs", kind="setup")
        return list(value)
    return [value] * n


def _job_name(plan_arg: Any, plan, j: int) -> str:
    if isinstance(plan_arg, (str, os.PathLike)):
        return Path(plan_arg).name
    return f"{plan.model.name or 'plan'} #{j}"


def _job_timeline(results: Sequence[dict], world_size: int) -> Timeline:
    """One step's events of every rank (``rank`` = device), aligned on the ranks' step starts."""
    t0 = min(float(r.get("start", 0.0)) for r in results)
    events = []
    for res in results:
        off = float(res.get("start", t0)) - t0
        for e in res.get("events", []):
            events.append(Event(int(res["rank"]), e["stream"], e["op"], e["name"], e["start"] + off,
                                max(e["end"], e["start"]) + off, e.get("nbytes", 0), e.get("micro_batch", -1),
                                e.get("segment", -1)))
    memory = [[(0.0, 0)] for _ in range(world_size)]
    for res in results:
        memory[int(res["rank"])] = [(0.0, int(res.get("peak_memory", 0) or 0))]
    return Timeline(events, memory, world_size, [], source="measured")


def launch_crossover(
    plans: Sequence[Any],
    *,
    steps: int | Sequence[int],
    mode: str = "crossover",
    address: str | None = None,
    checkpoint_dirs: Sequence[str | os.PathLike | None] | None = None,
    checkpoint_every: int = 0,
    eval_every: int | None = 0,
    resume: bool = False,
    seed: int | Sequence[int] = 0,
    data_seeds: Sequence[int] | None = None,
    lr: float | Sequence[float] = 1e-3,
    optimizer: str | None | Sequence[str | None] = None,
    warmup_steps: int = 0,
    step_timeout: float = 120.0,
    fail_at: dict[int, tuple[int, int, int]] | None = None,
    device: str = "auto",
    keep_checkpoints: int | None = 2,
    progress: bool = False,
    raise_on_failure: bool = True,
    on_step: Callable[[int, int, float], None] | None = None,
    names: Sequence[str] | None = None,
) -> CrossoverResult:
    """Train several data-parallel plans on the same actors, co-located (see the module docstring).

    Args:
        plans: ``engine.io.Plan`` objects, their dicts, or paths to plan JSON; one or more. Every
            plan must be pure data parallel (``pp == 1``, ``tp == 1``) with the same ``dp``.
        steps: steps per job (one number for all, or one per job); with ``resume`` the steps in a
            job's checkpoint count.
        mode: ``"crossover"``, ``"uncoordinated"`` or ``"sequential"``.
        address: Ray address; ``None`` starts a local cluster (an existing connection is kept).
        checkpoint_dirs: one folder per job (``None`` entries: no checkpoints for that job); the
            folders must differ.
        checkpoint_every: checkpoint every this many steps (0: only at the end).
        eval_every: validation loss every this many steps (0: only at the end; ``None``: never).
        resume: each job continues from the newest checkpoint in its folder (from step 0 if none).
        seed: model initialisation seed (one, or one per job).
        data_seeds: per job, the ``ByteCorpus`` seed of its data stream (default: the job index).
        lr: learning rate (one, or one per job).
        optimizer: ``"adam"``, ``"adama"``, ``"sgd"`` or ``None`` (the plan's), one or one per job.
        warmup_steps: first steps of each job left out of the throughput (still trained).
        step_timeout: seconds a rank may take for one call before its job counts as hung; also the
            process-group timeout and the longest a step may wait for the token.
        fail_at: deliberate faults for tests: ``{job: (rank, step, instruction_index)}``.
        device: ``"auto"``/``"cpu"`` (gloo; the worker does not run CUDA tensors yet).
        keep_checkpoints: newest checkpoints kept per job (``None``: all).
        progress: print one line per step to stderr.
        raise_on_failure: raise :class:`CrossoverError` when a job failed (else return the result
            with the job's ``error`` set).
        on_step: called as ``on_step(job, step, loss)`` from the job's driver thread.
        names: the jobs' names in messages and results (default: the plan file's name, or
            ``"<model> #<index>"``).

    Returns:
        the :class:`CrossoverResult`.

    Raises:
        CrossoverError: invalid plans or arguments (before Ray starts: ``pp > 1``, different world
            sizes, an unknown mode/optimizer, shared checkpoint folders...), a setup failure, or a
            failed job (after the other jobs finished; ``.job``, ``.rank`` and ``.result`` set).
        runtime.checkpoint.CheckpointError: ``resume`` from a checkpoint of another plan.
        runtime.stage.RuntimeNotSupported: a plan the runtime cannot execute (``tp > 1``).
    """
    import ray

    t_start = time.perf_counter()
    if mode not in MODES:
        raise CrossoverError(f"unknown co-location mode {mode!r}; use one of {', '.join(MODES)}", kind="setup")
    plans_in = list(plans)
    n = len(plans_in)
    if n < 1:
        raise CrossoverError("launch_crossover needs at least one plan", kind="setup")
    loaded = [_as_plan(p) for p in plans_in]
    names = [str(x) for x in _per_job(list(names), n, "names")] if names is not None else \
        [_job_name(a, p, j) for j, (a, p) in enumerate(zip(plans_in, loaded))]
    from runtime.stage import check_executable
    from runtime.worker import OPTIMIZERS

    ws = None
    for j, plan in enumerate(loaded):
        check_executable(plan)
        par = plan.parallel
        pp, dp = par.pp, par.dp
        pp = max(pp, plan.schedule.placement.num_devices)
        if pp != 1:
            raise CrossoverError(
                f"job {j} ({names[j]}) has pp = {pp}; co-location runs pure data-parallel plans (pp = 1) only, "
                "because a pipeline stage waits for its neighbours inside its compute, which a per-device "
                "compute token could deadlock. Plan it with dp = devices", job=j, kind="setup")
        if ws is None:
            ws = dp
        elif dp != ws:
            raise CrossoverError(
                f"co-located jobs must use the same devices: job 0 ({names[0]}) has dp = {ws} but job {j} "
                f"({names[j]}) has dp = {dp}; plan them for the same number of devices", job=j, kind="setup")
        if (plan.model.seq_len or 0) <= 0:
            raise CrossoverError(f"job {j} ({names[j]}): the plan's model has no seq_len; the runtime trains "
                                 "language models on token sequences", job=j, kind="setup")
    steps_j = [int(s) for s in _per_job(steps, n, "steps")]
    if any(s < 1 for s in steps_j):
        raise CrossoverError(f"steps must be at least 1, got {steps}", kind="setup")
    if warmup_steps < 0:
        raise CrossoverError(f"warmup_steps must be >= 0, got {warmup_steps}", kind="setup")
    seeds = [int(s) for s in _per_job(seed, n, "seed")]
    lrs = [float(x) for x in _per_job(lr, n, "lr")]
    dseeds = list(range(n)) if data_seeds is None else [int(s) for s in _per_job(list(data_seeds), n, "data_seeds")]
    opts = []
    for j, (o, plan) in enumerate(zip(_per_job(optimizer, n, "optimizer"), loaded)):
        o = str(o or plan.parallel.optimizer)
        if o not in OPTIMIZERS:
            raise CrossoverError(f"job {j}: unknown optimizer {o!r}; use one of {', '.join(map(repr, OPTIMIZERS))}",
                                 job=j, kind="setup")
        opts.append(o)
    ckdirs = [None] * n if checkpoint_dirs is None else _per_job(list(checkpoint_dirs), n, "checkpoint_dirs")
    ckdirs = [Path(d) if d is not None else None for d in ckdirs]
    resolved = [d.resolve() for d in ckdirs if d is not None]
    if len(set(resolved)) != len(resolved):
        raise CrossoverError("every job needs its own checkpoint folder; checkpoint_dirs repeats one", kind="setup")
    fail_at = dict(fail_at or {})
    for j in fail_at:
        if not 0 <= int(j) < n:
            raise CrossoverError(f"fail_at names job {j}, but there are {n} jobs", kind="setup")

    # ---- per-job checkpoint to resume from (before Ray starts)
    jobs = [CrossoverJobResult(index=j, name=names[j], steps=steps_j[j], label=job_label(j), optimizer=opts[j], dp=ws)
            for j in range(n)]
    cks: list = [None] * n
    for j in range(n):
        d = ckdirs[j]
        if d is None:
            continue
        if resume:
            newest = _ckpt.latest_checkpoint(d)
            if newest is not None:
                c = _ckpt.load_checkpoint(newest, plan=loaded[j], world_size=ws)
                if c.step >= steps_j[j]:
                    raise CrossoverError(f"job {j} ({names[j]}): the checkpoint {c.path} has already reached step "
                                         f"{c.step} (steps={steps_j[j]}); ask for more steps to continue it",
                                         job=j, kind="setup", checkpoint=str(c.path))
                c_opt = c.meta.get("optimizer")
                if c_opt is not None and c_opt != opts[j]:
                    raise CrossoverError(f"job {j} ({names[j]}): the checkpoint {c.path} was written with optimizer "
                                         f"{c_opt!r} but this launch uses {opts[j]!r}", job=j, kind="setup",
                                         checkpoint=str(c.path))
                cks[j] = c
        newest = _ckpt.latest_checkpoint(d)
        jobs[j].checkpoint = str(cks[j].path) if cks[j] is not None else (str(newest) if newest else None)
        jobs[j].start_step = cks[j].step if cks[j] is not None else 0

    from runtime.data import ByteCorpus

    corpora, gbs = [], []
    for j, plan in enumerate(loaded):
        par = plan.parallel
        m = par.micro_batches
        mbs = plan.model.micro_batch_size
        seq_len = int(plan.model.seq_len or 0)
        gbs.append(ws * m * mbs)
        jobs[j].tokens_per_step = ws * m * mbs * seq_len
        corpora.append(ByteCorpus(seq_len=seq_len, seed=dseeds[j]))

    owned = False
    pool = None
    clean = False
    try:
        owned = _cluster.init_ray(address)
        try:
            backend = _cluster.choose_backend(ws, device)
            job_specs = [{"plan": loaded[j].to_dict(), "seed": seeds[j], "lr": lrs[j], "optimizer": opts[j]}
                         for j in range(n)]

            def args_for_rank(r: int, addr: str, port: int):
                specs = []
                for j, s in enumerate(job_specs):
                    fa = fail_at.get(j)
                    specs.append(dict(s, fail_at=(int(fa[1]), int(fa[2])) if fa is not None and int(fa[0]) == r
                                      else None))
                return ((r, ws, addr, port, specs),
                        {"mode": mode, "backend": backend.name, "timeout_s": step_timeout,
                         "token_timeout": step_timeout})

            actor_cls = ray.remote(max_concurrency=n + 2)(CrossoverActor)
            pool = _cluster.create_actors(actor_cls, ws, backend, args_for_rank, timeout=max(step_timeout, 60.0))
        except _cluster.ClusterError as e:
            raise CrossoverError(str(e), kind="cluster") from e
        slow = max(step_timeout, 60.0)
        try:
            _Runner(pool).call("setup", [()] * ws, timeout=slow, step=None, what="setup")
            for j in range(n):
                if cks[j] is None:
                    continue
                r0 = _Runner(pool)
                for r in range(ws):
                    r0.call("load_state_dict", [(j, ray.put(cks[j].rank_state(r)))], ranks=[r], timeout=slow,
                            step=None, what=f"loading job {j}'s checkpoint")
        except LaunchError as e:
            raise CrossoverError(f"setting up the co-located jobs failed: {e}", rank=e.rank, kind=e.kind) from e
        setup_time = time.perf_counter() - t_start

        concurrent = mode != "sequential"
        barrier = threading.Barrier(n) if concurrent else None
        phase_start: list[float] = []
        lock = threading.Lock()

        def timed_begin(j: int) -> None:
            if barrier is not None:
                try:
                    barrier.wait(timeout=max(step_timeout, 60.0) * 2)
                except threading.BrokenBarrierError:
                    pass
            with lock:
                phase_start.append(time.perf_counter())

        def run_job(j: int) -> None:
            job = jobs[j]
            runner = _Runner(pool)
            runner.checkpoint = job.checkpoint
            history = list(cks[j].meta.get("losses", [])) if cks[j] is not None else []
            val_history = list(cks[j].meta.get("val_losses", [])) if cks[j] is not None else []
            val_ref = None
            began = False
            try:
                def evaluate(done: int) -> None:
                    nonlocal val_ref
                    if val_ref is None:
                        val_ref = ray.put(corpora[j].val_batch(0, gbs[j]))
                    vals = runner.call("evaluate", [(j, val_ref)] * ws, timeout=step_timeout, step=done,
                                       what="evaluation")
                    got = [float(v) for v in vals if v is not None]
                    if got:
                        v = sum(got) / len(got)
                        job.val_losses.append((done, v))
                        val_history.append([done, v])

                def save(done: int) -> None:
                    d = ckdirs[j]

                    def state_of(r: int):
                        return runner.call("state_dict", [(j,)], ranks=[r], timeout=slow, step=done,
                                           what="checkpointing")[0]

                    path = _ckpt.save_checkpoint(
                        d, done, state_of, None, plan=loaded[j], world_size=ws, seed=seeds[j],
                        extra={"losses": history, "val_losses": val_history, "lr": lrs[j], "optimizer": opts[j],
                               "backend": backend.name, "data_seed": dseeds[j],
                               "crossover": {"mode": mode, "job": j, "jobs": n, "name": names[j]}},
                        keep=keep_checkpoints)
                    runner.checkpoint = job.checkpoint = str(path)
                    for old in _ckpt.list_checkpoints(d):
                        if int(old.name.split("_")[1]) > done:
                            shutil.rmtree(old, ignore_errors=True)

                for k, step in enumerate(range(job.start_step, job.steps)):
                    if k == min(warmup_steps, job.steps - job.start_step - 1):
                        timed_begin(j)
                        began = True
                    batch_ref = ray.put(corpora[j].train_batch(step, gbs[j]))
                    t0 = time.perf_counter()
                    results = runner.call("step", [(j, step, batch_ref)] * ws, timeout=step_timeout, step=step,
                                          what="step")
                    t1 = time.perf_counter()
                    mb = [float(x) for res in results for x in (res.get("losses") or [])]
                    loss = sum(mb) / len(mb) if mb else math.nan
                    job.losses.append(loss)
                    job.step_times.append(t1 - t0)
                    job.token_wait += sum(float(res.get("token_wait", 0.0)) for res in results) / len(results)
                    history.append([step, loss])
                    if began:
                        job.timed_steps += 1
                        if job._t_first is None:
                            job._t_first = t0
                        job._t_last = t1
                        for res in results:
                            job._events.append((float(res.get("start", t0)),
                                                {"rank": res["rank"], "events": res.get("events", [])}, step))
                    job.timeline = _job_timeline(results, ws)
                    done = step + 1
                    if on_step is not None:
                        on_step(j, step, loss)
                    if progress:
                        print(f"[tessel crossover] job {j} ({names[j]}) step {step}: loss {loss:.4f}, "
                              f"{t1 - t0:.3f} s (token wait {job.token_wait:.3f} s so far)", file=sys.stderr)
                    if eval_every is not None and (done == job.steps or (eval_every and done % eval_every == 0)):
                        evaluate(done)
                    if ckdirs[j] is not None and (done == job.steps or (checkpoint_every and done % checkpoint_every == 0)):
                        save(done)
            except LaunchError as e:
                job.error, job.failed_rank, job.failed_step, job.kind = str(e), e.rank, e.step, e.kind
                job.checkpoint = runner.checkpoint
            except Exception as e:  # noqa: BLE001 - checkpoint I/O, Ray errors outside a call: the job's error
                job.error, job.kind = f"{type(e).__name__}: {e}", "raised"
            finally:
                if not began and barrier is not None:
                    barrier.abort()   # never keep the other jobs waiting for a job that stopped

        if concurrent:
            threads = [threading.Thread(target=run_job, args=(j,), name=f"tessel-crossover-job{j}", daemon=True)
                       for j in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for j in range(n):
                run_job(j)

        # ---- throughput, intervals, timeline
        for job in jobs:
            timed = job.step_times[len(job.step_times) - job.timed_steps:] if job.timed_steps else []
            job.tokens_per_second = job.tokens_per_step * len(timed) / sum(timed) if timed and sum(timed) > 0 else 0.0
            job.timed_wall = (job._t_last - job._t_first) if job._t_first is not None else 0.0
        total_tokens = sum(job.tokens_per_step * job.timed_steps for job in jobs)
        if concurrent:
            lasts = [job._t_last for job in jobs if job._t_last is not None]
            origin = max(phase_start) if phase_start else t_start
            wall = (max(lasts) - origin) if lasts else 0.0
        else:
            origin = min((job._t_first for job in jobs if job._t_first is not None), default=t_start)
            wall = sum(job.timed_wall for job in jobs)
        agg = total_tokens / wall if wall > 0 else 0.0
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
        events = []
        for job in jobs:
            for start, res, _step in job._events:
                off = start - origin
                for e in res.get("events", []):
                    ev = Event(int(res["rank"]), e["stream"], e["op"], f"{job.label} {e['name']}",
                               e["start"] + off, max(e["end"], e["start"]) + off, e.get("nbytes", 0),
                               e.get("micro_batch", -1), e.get("segment", -1))
                    if _EVENT_HAS_JOB:
                        ev.job = job.label
                    events.append(ev)
            job._events = []
        timeline = Timeline(events, [[(0.0, 0)] for _ in range(ws)], ws, [], source="measured") if events else None
        result = CrossoverResult(mode=mode, jobs=jobs, world_size=ws, backend=backend.name, warmup_steps=warmup_steps,
                                 total_tokens=total_tokens, wall_time=wall, aggregate_tokens_per_second=agg,
                                 intervals=intervals, max_holders=max_holders, timeline=timeline,
                                 elapsed=time.perf_counter() - t_start, setup_time=setup_time)
        clean = result.ok
        failed = [job for job in jobs if not job.ok]
        if failed and raise_on_failure:
            first = failed[0]
            done_jobs = [f"job {job.index} ({job.name}) completed {len(job.losses)} steps" for job in jobs if job.ok]
            msg = "; ".join(f"job {job.index} ({job.name}) failed: {job.error}" for job in failed)
            if done_jobs:
                msg += "; " + ", ".join(done_jobs)
            raise CrossoverError(msg, job=first.index, result=result, rank=first.failed_rank, step=first.failed_step,
                                 kind=first.kind or "raised", checkpoint=first.checkpoint)
        return result
    finally:
        if pool is not None:
            pool.close(graceful=clean)
        _cluster.shutdown_ray(owned)
