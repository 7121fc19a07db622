"""Predict co-located data-parallel jobs (CrossoverScheduler) and draw them as one Timeline.

Several data-parallel jobs share the same devices. With the CrossoverScheduler, while job A
synchronises its gradients (all-reduce after backward), job B computes, and vice versa: a
per-device **compute token** is passed between the jobs at the synchronisation points. Each
job's numerics are unchanged; only timing changes. For two identical jobs with compute ``C``
and communication ``M`` per step, the ideal pair cycle (both jobs one step) is
``2·max(C, M)`` instead of ``2·(C + M)`` when they run one after the other.

:func:`predict_colocated` takes the jobs' own plans (``engine.io.Plan``; ``pp=1``, ``tp=1``,
``dp=N``, every job on the same ``N`` devices), reads each job's step from the plan's own
simulation (:func:`engine.plan.calibrate.resimulate`: its F/B/I/W compute blocks, its ALLREDUCE
events and its OPTIM step, seconds) and predicts how the jobs interleave in one of three modes:

``"crossover"``
    Per-device compute token. A job requests it before its step's first forward and holds it
    for all its F/B/I/W blocks; it releases it when it starts its gradient all-reduce (when it
    starts its optimizer step if it has no all-reduce). The optimizer step runs **without** the
    token. Hand-over is fair FIFO: the waiting jobs get the token in the order they asked for
    it (ties at the same instant: job order), so with more than two jobs it rotates A, B, C, A...
``"uncoordinated"``
    Every job runs its steps back to back from time 0 with no coordination.
``"sequential"``
    Job 0's steps, then job 1's, and so on.

Contention model (all modes): each device has one **compute** resource (F/B/I/W/OPTIM of all
jobs) and one **link** (the all-reduces of all jobs, which use the same network). Both are
*processor sharing*: when ``k`` jobs' tasks are active on a resource at once, each progresses at
``1/k`` of its solo speed (two overlapping blocks each run at half speed; two overlapping
all-reduces each get half the bandwidth). An all-reduce that needs the processor too (gloo on
CPU ranks: :data:`COMM_CPU_SHARE`, ``StepTask.cpu_share``) adds its share to the compute demand;
when the demand exceeds one processor, compute and that all-reduce slow down alike (so on a CPU
machine crossover gains less than the ideal ``2*max(C, M)`` cycle). Within a job, tasks run in order (compute blocks,
then its all-reduces one after the other on its collective stream, then OPTIM), so a job has
at most one active task. The model has no interference penalty beyond sharing (no context
switch or cache cost), so it is optimistic about uncoordinated co-location; the token of the
crossover mode makes F/B/I/W of different jobs mutually exclusive, so only an OPTIM step (run
without the token) can share the compute resource there. Data-parallel replicas are
symmetric, so one device is simulated and its events are repeated on every device (rank
``0..N-1``). A plan with several segments on its device (virtual stages) whose all-reduces
overlapped its backward in its own simulation has them serialised after its compute here
(conservative).

Memory: each job's parameters and optimizer states stay resident for the whole run (also
while it waits in ``"sequential"`` mode); its activation and gradient memory follow its own
predicted curve, stretched onto the co-located times. The device curve is the sum over jobs;
a peak above the smallest device capacity of the plans gives a warning.

Units: seconds, bytes, tokens (``batch_size * seq_len`` of a step).

Source: the CrossoverScheduler technique (docs/ARCHITECTURE.md, Sources): co-located jobs fill
each other's communication with computation through a compute token passed at the
synchronisation points.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

from engine.errors import CrossoverError
from engine.plan.calibrate import resimulate
from engine.timeline import Event, Timeline

#: How co-located jobs share the devices: ``"crossover"`` (a compute token passed at the
#: synchronisation points), ``"uncoordinated"`` (the OS and the backend interleave them) or
#: ``"sequential"`` (one job after the other).
Mode = Literal["crossover", "uncoordinated", "sequential"]
#: The modes :func:`predict_colocated` understands, in the order :func:`compare_modes` returns them.
MODES: tuple[str, ...] = get_args(Mode)
_TOKEN_OPS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class StepTask:
    """One task of a job's step, in the order the job runs them.

    Attributes:
        op: ``F``/``B``/``I``/``W`` (compute, needs the token in crossover mode), ``ALLREDUCE``
            (link) or ``OPTIM`` (compute, no token).
        name: label within the job, e.g. ``"0F0"``, ``"allreduce s0"``, ``"optimizer"``.
        duration: seconds when the job runs alone.
        micro_batch, segment: as in :class:`engine.timeline.Event` (-1 where none).
        nbytes: bytes reduced (ALLREDUCE) or updated (OPTIM).
        orig_start, orig_end: the task's interval in the job's own (solo) step timeline,
            seconds; used to stretch its memory curve onto the co-located times.
        cpu_share: for an ALLREDUCE, the fraction of its solo time the device's processor is busy
            with it (:data:`COMM_CPU_SHARE`; 0 for NCCL on GPUs). While it overlaps compute, the
            processor is shared: both slow down when compute + cpu shares exceed one.
    """

    op: str
    name: str
    duration: float
    micro_batch: int = -1
    segment: int = -1
    nbytes: int = 0
    orig_start: float = 0.0
    orig_end: float = 0.0
    cpu_share: float = 0.0

    @property
    def resource(self) -> str:
        """``"link"`` for an all-reduce, ``"compute"`` otherwise."""
        return "link" if self.op == "ALLREDUCE" else "compute"


@dataclass(frozen=True)
class JobProfile:
    """What the co-location model needs of one job's training step.

    Attributes:
        name: job name (prefix of its event names, ``Event.job``).
        num_devices: devices the job's data-parallel replicas use (= ``dp``).
        tasks: the step's tasks in order: F/B/I/W blocks, ALLREDUCEs, OPTIM.
        tokens_per_step: tokens one step trains (``batch_size * seq_len``).
        memory: the job's solo memory curve on one device, ``(time_s, bytes)`` step points.
        static_memory: resident bytes per device (parameters, optimizer states).
        memory_capacity: bytes per device, or ``None`` when unknown.
    """

    name: str
    num_devices: int
    tasks: tuple[StepTask, ...]
    tokens_per_step: int = 0
    memory: tuple[tuple[float, int], ...] = ()
    static_memory: int = 0
    memory_capacity: float | None = None

    @property
    def compute_time(self) -> float:
        """``C``: seconds of F/B/I/W per step (solo)."""
        return sum(t.duration for t in self.tasks if t.op in _TOKEN_OPS)

    @property
    def comm_time(self) -> float:
        """``M``: seconds of gradient all-reduce per step (solo, serialised)."""
        return sum(t.duration for t in self.tasks if t.op == "ALLREDUCE")

    @property
    def optim_time(self) -> float:
        """Seconds of the optimizer step (solo)."""
        return sum(t.duration for t in self.tasks if t.op == "OPTIM")

    @property
    def step_time(self) -> float:
        """Seconds of one solo step in this model (``C + M + optimizer``)."""
        return sum(t.duration for t in self.tasks)

    @classmethod
    def synthetic(cls, name: str, compute: float, comm: float, optim: float = 0.0, *, num_devices: int = 2,
                  tokens_per_step: int = 1, forward_fraction: float = 1.0 / 3.0) -> JobProfile:
        """A job with one F (``forward_fraction * compute``) and one B block, one all-reduce of
        ``comm`` seconds and an optimizer step of ``optim`` seconds; no memory. For tests and
        what-if questions ("what if communication took as long as compute?").

        Raises:
            CrossoverError: a negative duration or a non-positive device count.
        """
        if min(compute, comm, optim) < 0 or not 0.0 <= forward_fraction <= 1.0:
            raise CrossoverError(f"job {name}: durations must be >= 0 and forward_fraction in [0, 1]")
        if num_devices < 1:
            raise CrossoverError(f"job {name}: num_devices must be >= 1, got {num_devices}")
        compute, comm, optim = float(compute), float(comm), float(optim)
        f = compute * forward_fraction
        tasks = [StepTask("F", "0F0", f, 0, 0, 0, 0.0, f),
                 StepTask("B", "0B0", compute - f, 0, 0, 0, f, compute)]
        if comm > 0:
            tasks.append(StepTask("ALLREDUCE", "allreduce s0", comm, -1, 0, 0, compute, compute + comm))
        tasks.append(StepTask("OPTIM", "optimizer", optim, -1, -1, 0, compute + comm, compute + comm + optim))
        return cls(name, num_devices, tuple(tasks), tokens_per_step)


@dataclass
class ColocatedPrediction:
    """Predicted run of co-located jobs.

    Attributes:
        mode: ``"crossover"``, ``"uncoordinated"`` or ``"sequential"``.
        jobs: job names in job order.
        steps: steps each job runs.
        timeline: events of all jobs on every device (``Event.job`` = job name, ``Event.name`` =
            ``"<job> <block>"`` e.g. ``"A 0F0"``; ops F/B/I/W/OPTIM on stream ``compute``,
            ALLREDUCE on ``collective``), the summed memory curve per device.
        step_times: per job (by name), seconds per step while it runs:
            ``(end of its last step - start of its first task) / steps``.
        makespan: seconds from the first start to the last end, all steps of all jobs.
        tokens_per_step: per job, tokens one step trains (``batch_size * seq_len``).
        aggregate_tokens_per_second: ``sum(tokens_per_step * steps) / makespan``.
        per_job_tokens_per_second: per job, ``tokens_per_step * steps / makespan`` (the job's
            share of the aggregate over the shared run; they sum to the aggregate).
        cycle_time: seconds per round in which every job completes one step, in steady state:
            interleaved modes: the largest interval between a job's last two step ends
            (``steps >= 2``; the makespan when ``steps == 1``); sequential: the sum of the jobs'
            last step intervals.
        compute_times, comm_times, optim_times: per job, solo ``C``, ``M`` and optimizer seconds.
        warnings: e.g. the co-located memory peak above the device capacity.
    """

    mode: str
    jobs: list[str]
    steps: int
    timeline: Timeline
    step_times: dict[str, float]
    makespan: float
    tokens_per_step: dict[str, int]
    aggregate_tokens_per_second: float
    per_job_tokens_per_second: dict[str, float]
    cycle_time: float = 0.0
    compute_times: dict[str, float] = field(default_factory=dict)
    comm_times: dict[str, float] = field(default_factory=dict)
    optim_times: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def num_devices(self) -> int:
        return self.timeline.num_devices

    def summary(self) -> dict:
        """JSON-able numbers without the timeline (seconds, tokens/s, bytes)."""
        return {"mode": self.mode, "jobs": list(self.jobs), "steps": self.steps, "num_devices": self.num_devices,
                "makespan": self.makespan, "cycle_time": self.cycle_time, "step_times": dict(self.step_times),
                "tokens_per_step": dict(self.tokens_per_step),
                "aggregate_tokens_per_second": self.aggregate_tokens_per_second,
                "per_job_tokens_per_second": dict(self.per_job_tokens_per_second),
                "compute_times": dict(self.compute_times), "comm_times": dict(self.comm_times),
                "optim_times": dict(self.optim_times), "peak_memory": self.timeline.peak_memory(),
                "warnings": list(self.warnings)}

    def to_dict(self) -> dict:
        """:meth:`summary` plus ``"timeline"`` (:meth:`engine.timeline.Timeline.to_dict`)."""
        return {**self.summary(), "timeline": self.timeline.to_dict()}


# ---------------------------------------------------------------------------- profiles from plans
def default_job_names(n: int) -> list[str]:
    """``A``, ``B``, ``C``, ... (``J26``, ``J27``... after ``Z``)."""
    return [chr(ord("A") + i) if i < 26 else f"J{i}" for i in range(n)]


#: Fraction of an all-reduce's time its process spends on the CPU, per link. ``loopback`` (gloo
#: over TCP between CPU ranks of one machine): a 2-rank all-reduce of 4.9M float32 takes 12.6 ms
#: of which 8.2 ms is CPU time, measured on the 2-core development machine
#: (``benchmarks/crossover_bench.py``). GPU links (NCCL) are treated as not using the processor.
COMM_CPU_SHARE = {"loopback": 0.65}


def job_profile(plan, name: str = "A") -> JobProfile:
    """The step of a data-parallel ``plan`` (an :class:`engine.io.plan.Plan`) as a :class:`JobProfile`.

    Durations come from the plan's own simulation (:func:`engine.plan.calibrate.resimulate`, i.e. its
    stored cost model): the F/B/I/W events of device 0 in start order, its ALLREDUCE events,
    its OPTIM step; the memory curve and static memory of device 0; tokens per step =
    ``plan.model.batch_size * plan.model.seq_len`` (0 when the plan records no batch size).

    Raises:
        CrossoverError: a pipeline (``pp > 1``) or tensor-parallel (``tp > 1``) plan.
    """
    par = plan.parallel
    pp = max(par.pp, plan.placement.num_devices)   # pipeline ranks: a placement on several devices is one
    tp, dp = par.tp, par.dp
    if pp != 1:
        raise CrossoverError(
            f"job {name}: its plan has pp={pp} (a pipeline); co-located crossover jobs must be purely "
            f"data-parallel: plan it with pp=1 (devices = dp)")
    if tp != 1:
        raise CrossoverError(
            f"job {name}: its plan has tp={tp}; co-located crossover jobs must be purely data-parallel "
            "(tp=1, pp=1, devices = dp)")
    tl = resimulate(plan)
    evs = [e for e in tl.events if e.rank == 0]
    comp = _compute_with_all_to_alls(evs)
    coll = sorted((e for e in evs if e.op == "ALLREDUCE"), key=lambda e: (e.start, e.end))
    opt = [e for e in evs if e.op == "OPTIM"]
    link = ((plan.cost or {}).get("intra_link") or {}).get("name", "")
    share = COMM_CPU_SHARE.get(link, 0.0)
    tasks = [StepTask(e.op, e.name, e.duration, e.micro_batch, e.segment, e.nbytes, e.start, e.end,
                      share if e.op == "ALLREDUCE" else 0.0)
             for e in comp + coll + opt]
    tokens = (plan.model.batch_size or 0) * (plan.model.seq_len or 1)
    cap = (plan.metrics or {}).get("memory_capacity")
    if cap is None and plan.cost:
        cap = (plan.cost.get("device") or {}).get("mem_capacity")
    curve = tuple((float(t), int(v)) for t, v in (tl.memory[0] if tl.memory else []))
    static = int(tl.static_memory[0]) if tl.static_memory else (curve[0][1] if curve else 0)
    return JobProfile(name, dp, tuple(tasks), tokens, curve, static, float(cap) if cap else None)


def _compute_with_all_to_alls(evs: list[Event]) -> list[Event]:
    """Device 0's F/B/I/W events in start order, each extended by the MoE all-to-alls after it.

    An expert-parallel ``ALLTOALL`` blocks the compute path right after the block that runs it
    (:mod:`engine.simulate`), and the runtime runs it inside that block's compute, i.e. while the
    job holds the compute token; so its time belongs to the block's token-holding task.
    """
    path = sorted((e for e in evs if (e.stream == "compute" and e.op in _TOKEN_OPS) or e.op == "ALLTOALL"),
                  key=lambda e: (e.start, e.end))
    out: list[Event] = []
    for e in path:
        if e.op != "ALLTOALL":
            out.append(e)
        elif out:   # extend the block it follows (its duration and end)
            last = out[-1]
            out[-1] = dataclasses.replace(last, end=max(last.end, e.end))
    return out


# ---------------------------------------------------------------------------- the simulation
@dataclass
class _Record:
    job: int
    step: int
    task: StepTask
    start: float
    end: float


def _check_same_devices(profiles: list[JobProfile]) -> None:
    """Raise :class:`CrossoverError` unless every job uses as many devices as the first."""
    n0 = profiles[0].num_devices
    for p in profiles[1:]:
        if p.num_devices != n0:
            raise CrossoverError(
                f"job {p.name} uses {p.num_devices} devices but job {profiles[0].name} uses {n0}; "
                "co-located jobs must share the same devices (same dp)")


def _check(profiles: list[JobProfile], mode: str, steps: int) -> None:
    if mode not in MODES:
        raise CrossoverError(f"unknown co-location mode {mode!r}; use one of {', '.join(MODES)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise CrossoverError(f"steps must be a positive integer, got {steps!r}")
    if not profiles:
        raise CrossoverError("no jobs to co-locate: pass at least one plan")
    names = [p.name for p in profiles]
    if len(set(names)) != len(names) or any(not n for n in names):
        raise CrossoverError(f"job names must be unique and non-empty, got {names}")
    _check_same_devices(profiles)


def _simulate(profiles: list[JobProfile], mode: str, steps: int) -> list[_Record]:
    """Processor-sharing discrete-event simulation of one device (see the module doc)."""
    nj = len(profiles)
    tasks = [p.tasks for p in profiles]
    step = [0] * nj
    idx = [0] * nj
    rem = [0.0] * nj
    active = [False] * nj
    begun = [0.0] * nj
    done = [steps == 0 or not tasks[j] for j in range(nj)]
    queue: deque[int] = deque()
    holder: int | None = None
    records: list[_Record] = []
    t = 0.0

    def finish(j: int, now: float) -> None:
        records.append(_Record(j, step[j], tasks[j][idx[j]], begun[j], now))
        active[j] = False
        idx[j] += 1
        if idx[j] >= len(tasks[j]):
            idx[j] = 0
            step[j] += 1
            if step[j] >= steps:
                done[j] = True

    def admit() -> None:
        nonlocal holder
        changed = True
        while changed:
            changed = False
            for j in range(nj):
                if done[j] or active[j]:
                    continue
                if mode == "sequential" and j > 0 and not done[j - 1]:
                    continue
                task = tasks[j][idx[j]]
                if mode == "crossover":
                    if task.op in _TOKEN_OPS and holder != j:
                        if j not in queue:
                            queue.append(j)
                        if holder is None and queue[0] == j:
                            holder = queue.popleft()
                        else:
                            continue
                    elif task.op not in _TOKEN_OPS and holder == j:
                        holder = None  # released at the start of the all-reduce (or OPTIM)
                active[j] = True
                begun[j] = t
                rem[j] = task.duration
                changed = True
                if rem[j] <= 0.0:
                    finish(j, t)

    admit()
    guard = 0
    limit = 10 * (steps + 1) * sum(len(ts) + 1 for ts in tasks) + 100
    while not all(done):
        guard += 1
        act = [j for j in range(nj) if active[j]]
        if not act or guard > limit:  # cannot happen with the rules above; never loop forever
            raise CrossoverError(f"co-location simulation stalled at t={t:.6g} s in mode {mode!r}")
        share = {"compute": 0, "link": 0}
        cpu = 0.0   # processor demand: 1 per compute task, cpu_share per all-reduce
        for j in act:
            task = tasks[j][idx[j]]
            share[task.resource] += 1
            cpu += 1.0 if task.resource == "compute" else task.cpu_share
        slow = max(1.0, cpu)
        rate = {}
        for j in act:
            task = tasks[j][idx[j]]
            if task.resource == "compute":
                rate[j] = 1.0 / slow
            else:
                rate[j] = min(1.0 / share["link"], 1.0 / slow if task.cpu_share > 0 else 1.0)
        dt = min(rem[j] / rate[j] for j in act)
        t += dt
        eps = 1e-12 * max(1.0, t)
        for j in act:
            rem[j] -= dt * rate[j]
        for j in act:
            if rem[j] <= eps:
                finish(j, t)
        admit()
    return records


def _stretch_memory(profile: JobProfile, recs: list[_Record], steps: int) -> list[tuple[float, int]]:
    """The job's memory curve on the co-located time axis (static before its first step)."""
    pts: list[tuple[float, int]] = [(0.0, profile.static_memory)]
    if not profile.memory:
        return pts
    by_step: dict[int, list[_Record]] = {}
    for r in recs:
        by_step.setdefault(r.step, []).append(r)
    mt = np.array([t for t, _ in profile.memory], dtype=np.float64)
    mv = [v for _, v in profile.memory]
    for k in range(steps):
        rs = by_step.get(k, [])
        if not rs:
            continue
        pairs = sorted([(r.task.orig_start, r.start) for r in rs] + [(r.task.orig_end, r.end) for r in rs])
        xo = np.array([p[0] for p in pairs], dtype=np.float64)
        xn = np.maximum.accumulate(np.array([p[1] for p in pairs], dtype=np.float64))
        new_t = np.interp(mt, xo, xn)
        pts.extend((float(a), int(v)) for a, v in zip(new_t, mv))
    return pts


def _sum_curves(curves: list[list[tuple[float, int]]]) -> list[tuple[float, int]]:
    """Pointwise sum of step curves (each value holds until its next point)."""
    times = sorted({t for c in curves for t, _ in c})
    keyed = [([t for t, _ in c], [v for _, v in c]) for c in curves]
    out: list[tuple[float, int]] = []
    for t in times:
        total = 0
        for ts, vs in keyed:
            i = bisect.bisect_right(ts, t) - 1
            if i >= 0:
                total += vs[i]
        out.append((t, total))
    return out


def predict_profiles(profiles: list[JobProfile], mode: str = "crossover", steps: int = 2) -> ColocatedPrediction:
    """:func:`predict_colocated` on prepared (or :meth:`JobProfile.synthetic`) job profiles.

    Raises:
        CrossoverError: an unknown mode, ``steps < 1``, no jobs, duplicate names, different
            device counts.
    """
    _check(profiles, mode, steps)
    records = _simulate(profiles, mode, steps)
    n = profiles[0].num_devices
    names = [p.name for p in profiles]
    events: list[Event] = []
    for r in sorted(records, key=lambda r: (r.start, r.end, r.job)):
        tk = r.task
        stream = "collective" if tk.op == "ALLREDUCE" else "compute"
        job = names[r.job]
        for d in range(n):
            events.append(Event(d, stream, tk.op, f"{job} {tk.name}", r.start, r.end, tk.nbytes,
                                tk.micro_batch, tk.segment, job))
    per_job: list[list[_Record]] = [[] for _ in profiles]
    for r in records:
        per_job[r.job].append(r)
    curves = [_stretch_memory(p, per_job[j], steps) for j, p in enumerate(profiles)]
    total = _sum_curves(curves)
    static = sum(p.static_memory for p in profiles)
    timeline = Timeline(events, [list(total) for _ in range(n)], n, [static] * n, "predicted")

    makespan = timeline.makespan
    step_times: dict[str, float] = {}
    intervals: dict[str, float] = {}
    for j, p in enumerate(profiles):
        rs = per_job[j]
        if not rs:
            step_times[p.name] = intervals[p.name] = 0.0
            continue
        start = min(r.start for r in rs)
        ends = [max(r.end for r in rs if r.step == k) for k in range(steps)]
        step_times[p.name] = (ends[-1] - start) / steps
        intervals[p.name] = ends[-1] - (ends[-2] if steps >= 2 else start)
    if mode == "sequential":
        cycle = sum(intervals.values())
    else:
        cycle = max(intervals.values()) if steps >= 2 else makespan
    tokens = {p.name: int(p.tokens_per_step) for p in profiles}
    per_job_tps = {k: (v * steps / makespan if makespan > 0 else 0.0) for k, v in tokens.items()}
    warnings: list[str] = []
    caps = [p.memory_capacity for p in profiles if p.memory_capacity]
    peak = max((v for _, v in total), default=0)
    if caps and peak > min(caps):
        warnings.append(f"the co-located jobs need {peak / 2**30:.2f} GiB per device at peak, above the device "
                        f"capacity of {min(caps) / 2**30:.2f} GiB")
    return ColocatedPrediction(
        mode=mode, jobs=names, steps=steps, timeline=timeline, step_times=step_times, makespan=makespan,
        tokens_per_step=tokens, aggregate_tokens_per_second=sum(per_job_tps.values()),
        per_job_tokens_per_second=per_job_tps, cycle_time=cycle,
        compute_times={p.name: p.compute_time for p in profiles},
        comm_times={p.name: p.comm_time for p in profiles},
        optim_times={p.name: p.optim_time for p in profiles}, warnings=warnings)


def _profiles(plans: list, names: list[str] | None) -> list[JobProfile]:
    if not isinstance(plans, (list, tuple)) or not plans:
        raise CrossoverError("no jobs to co-locate: pass a non-empty list of plans")
    names = list(names) if names is not None else default_job_names(len(plans))
    if len(names) != len(plans):
        raise CrossoverError(f"got {len(names)} job names for {len(plans)} plans")
    profiles = [job_profile(p, nm) for p, nm in zip(plans, names)]
    _check_same_devices(profiles)
    return profiles


def predict_colocated(plans: list, mode: str = "crossover", steps: int = 2, *,
                      names: list[str] | None = None) -> ColocatedPrediction:
    """Predict data-parallel jobs sharing the same devices (see the module doc for the model).

    Args:
        plans: one :class:`engine.io.plan.Plan` per job, each ``pp=1``, ``tp=1``, all with the
            same ``dp`` (= devices); e.g. ``make_plan("gpt2-tiny", devices=2, dp=2,
            micro_batches=1, device_type="cpu").plan``.
        mode: ``"crossover"`` (compute token), ``"uncoordinated"`` or ``"sequential"``.
        steps: training steps of every job.
        names: job names (default ``A``, ``B``, ``C``...).

    Returns:
        A :class:`ColocatedPrediction` (seconds, tokens/s, bytes).

    Raises:
        CrossoverError (a :class:`~engine.errors.TesselError`): no plans, a pipeline or
            tensor-parallel plan, different device counts, an unknown mode, ``steps < 1``.
    """
    return predict_profiles(_profiles(plans, names), mode, steps)


def compare_modes(plans: list, steps: int = 2, *, names: list[str] | None = None) -> dict[str, ColocatedPrediction]:
    """``{mode: predict_colocated(plans, mode, steps)}`` for every mode of :data:`MODES`
    (the plans are simulated once).

    Raises:
        CrossoverError: as :func:`predict_colocated`.
    """
    profiles = _profiles(plans, names)
    return {m: predict_profiles(profiles, m, steps) for m in MODES}


def compare_profiles(profiles: list[JobProfile], steps: int = 2) -> dict[str, ColocatedPrediction]:
    """:func:`compare_modes` on prepared job profiles."""
    return {m: predict_profiles(profiles, m, steps) for m in MODES}


def ideal_pair_cycle(compute: float, comm: float) -> dict[str, float]:
    """The textbook cycle of two identical jobs (seconds): ``{"crossover": 2*max(C, M),
    "sequential": 2*(C + M)}`` (optimizer time ignored)."""
    return {"crossover": 2.0 * max(compute, comm), "sequential": 2.0 * (compute + comm)}


__all__ = [
    "MODES",
    "ColocatedPrediction",
    "JobProfile",
    "StepTask",
    "compare_modes",
    "compare_profiles",
    "default_job_names",
    "ideal_pair_cycle",
    "job_profile",
    "predict_colocated",
    "predict_profiles",
]
