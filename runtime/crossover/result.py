"""What a co-located launch measured: :class:`CrossoverResult` with one :class:`CrossoverJobResult`
per job, and the measured timelines (one job's step; every job's timed phase on one Timeline).

Filled in by :func:`runtime.crossover.launch_crossover`; see its module for the meaning of the
timed phase and of the modes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.timeline import Event, Timeline
from runtime.crossover.token import TokenInterval, overlapping_intervals

__all__ = ["CrossoverJobResult", "CrossoverResult", "job_label", "job_timeline", "run_timeline"]


def job_label(j: int) -> str:
    """The short label of job ``j`` on co-located timelines: ``A``, ``B``, ... (``J26``... after ``Z``),
    as ``engine.crossover`` names predicted jobs."""
    return chr(ord("A") + j) if j < 26 else f"J{j}"


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
        interrupted_at: the steps done when Ctrl-C stopped it (its checkpoint written), or ``None``.
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
    interrupted_at: int | None = None
    timeline: Timeline | None = None
    optimizer: str = "adam"
    dp: int = 1
    # internal: perf_counter stamps of the timed phase, step results kept for the run's timeline
    _t_first: float | None = field(default=None, repr=False)
    _t_last: float | None = field(default=None, repr=False)
    _events: list[tuple[float, dict]] = field(default_factory=list, repr=False)  # (rank's step start, result)

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict:
        """JSON-able summary (the timeline as its metrics)."""
        return {
            "index": self.index, "name": self.name, "label": self.label, "ok": self.ok, "steps": self.steps,
            "start_step": self.start_step,
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
            names prefixed with the job's label, ``"A 0F0"``, and ``Event.job`` = the label;
            seconds from the timed phase's start), or ``None``.
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


def job_timeline(results: Sequence[dict], world_size: int) -> Timeline:
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


def run_timeline(jobs: list[CrossoverJobResult], origin: float, ws: int) -> Timeline | None:
    """Every job's timed events on one Timeline (``rank`` = device, names prefixed with the label)."""
    events = []
    for job in jobs:
        for start, res in job._events:
            off = start - origin
            for e in res.get("events", []):
                events.append(Event(int(res["rank"]), e["stream"], e["op"], f"{job.label} {e['name']}",
                                    e["start"] + off, max(e["end"], e["start"]) + off, e.get("nbytes", 0),
                                    e.get("micro_batch", -1), e.get("segment", -1), job=job.label))
        job._events = []
    return Timeline(events, [[(0.0, 0)] for _ in range(ws)], ws, [], source="measured") if events else None
