"""What a single-plan launch measured: :class:`LaunchResult`, the MoE gate metrics of a step
(:func:`merge_moe_metrics`) and the measured Timeline of a step (:func:`merge_timeline`).

Filled in by :func:`runtime.launcher.launch`; see its module for how steps are run and timed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

from engine.timeline import Event, Timeline

__all__ = ["LaunchResult", "finish_times", "merge_moe_metrics", "merge_timeline"]


@dataclass
class LaunchResult:
    """What :func:`launch` measured.

    Attributes:
        steps: steps completed in total (the final data position; a resumed launch counts the
            steps done before it too).
        start_step: the first step run by this launch (0, or the resumed checkpoint's step).
        losses: training loss of each step run by this launch (``losses[i]`` is step
            ``start_step + i``), the task's loss (nats per token for text), mean over the global batch.
        val_losses: ``[(steps_completed, loss)]`` on the fixed validation batch.
        step_times: seconds of each step, dispatch to the last rank's result (driver clock).
        tokens_per_step: tokens in one global batch (dp * micro_batches * micro_batch_size * seq_len
            for causal-lm; the task's count; 0 for a task counted in samples).
        tokens_per_second: tokens / second over this launch's steps, the first one excluded
            (warm-up) when more than one ran (0 for a task counted in samples).
        timeline: the measured Timeline of the last step (``source="measured"``), or ``None``.
        timelines: the measured Timelines of the last ``keep_timelines`` steps, oldest first (the
            input of ``engine.cost.calibrate.calibrate``); not in :meth:`to_dict`.
        predicted_step_time: per pipeline rank, seconds from the step's start to the rank's last
            event in the simulator's prediction.
        measured_step_time: the same in the measured timeline.
        predicted_busy, measured_busy: per pipeline rank, seconds of compute (F/B/I/W/optimizer).
        predicted_makespan, measured_makespan: seconds of one step, predicted and measured
            (timeline makespan of the last step).
        peak_memory: bytes per world rank reported by the workers (last step): the process's peak
            resident set during the step on CPU (its high-water mark where Linux gives one).
        memory_baseline: bytes per world rank of the resident set that the plan's memory model does
            not count (interpreter, torch, libraries, traced graphs, process groups; measured after
            set-up, see ``StageWorker._memory_baseline``): ``peak_memory[r] - memory_baseline[r]``
            is comparable with the plan's predicted peak of rank ``r``'s pipeline rank. Empty when
            the workers did not report it.
        optimizer_state_bytes: bytes of each world rank's persistent optimizer state (Adam's ``m``
            and ``v``; ``1/dp`` of them with CoCoNet's ``sharded-update``), from the last step.
        trace_paths: ``{"measured": path}`` (and whatever the caller adds).
        checkpoint: the last checkpoint directory, or ``None``.
        backend: ``"gloo"`` or ``"nccl"``.
        optimizer: the workers' optimizer (``"adam"``, ``"adama"`` or ``"sgd"``).
        world_size, dp, pp: ranks and degrees.
        elapsed: seconds of the whole launch (Ray start to shutdown).
        setup_time: seconds from Ray start until every rank finished ``setup()``.
        moe: per step of this launch, the MoE gate metrics (see the module docstring) with
            ``step``; empty for models without MoE layers (and then left out of :meth:`to_dict`).
        task: the task trained (``causal-lm``, ..., or ``module:callable``).
        unit: what the task's throughput counts, ``"tokens"`` or ``"samples"``.
        units_per_step: units (:attr:`unit`) in one global batch (the last step's).
        units_per_second: units / second, measured like ``tokens_per_second``.
        predicted_units_per_second: units / second the plan predicts
            (:func:`runtime.launcher.predicted_rate`), or ``None`` when the plan holds no prediction.
        rank_nodes: per world rank ``{"rank", "device", "node", "address", "node_id"}``: its device id and,
            where the launch placed ranks by node (a cluster, ``--address``), the node's index in
            the plan and its address (``None`` otherwise); also in the measured trace's metadata.
    """

    steps: int
    start_step: int
    losses: list[float]
    val_losses: list[tuple[int, float]]
    step_times: list[float]
    tokens_per_step: int
    tokens_per_second: float
    timeline: Timeline | None
    predicted_step_time: list[float]
    measured_step_time: list[float]
    predicted_busy: list[float]
    measured_busy: list[float]
    predicted_makespan: float
    measured_makespan: float
    peak_memory: list[int]
    optimizer_state_bytes: list[int] = field(default_factory=list)
    memory_baseline: list[int] = field(default_factory=list)
    trace_paths: dict[str, str] = field(default_factory=dict)
    checkpoint: str | None = None
    backend: str = "gloo"
    optimizer: str = "adam"
    world_size: int = 1
    dp: int = 1
    pp: int = 1
    elapsed: float = 0.0
    setup_time: float = 0.0
    moe: list[dict] = field(default_factory=list)
    timelines: list[Timeline] = field(default_factory=list)
    task: str = "causal-lm"
    unit: str = "tokens"
    units_per_step: int = 0
    units_per_second: float = 0.0
    predicted_units_per_second: float | None = None
    rank_nodes: list[dict] = field(default_factory=list)

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    def to_dict(self) -> dict:
        """JSON-able summary (the timeline as its metrics only)."""
        d = asdict(self)
        d.pop("timeline")
        d.pop("timelines")
        d["timeline_metrics"] = self.timeline.metrics() if self.timeline is not None else None
        d["val_losses"] = [[s, v] for s, v in self.val_losses]
        if not self.moe:
            d.pop("moe")
        return d


_MOE_KEYS = ("temperature", "experts_per_token", "load_cv", "dropped_fraction", "balance_loss")


def merge_moe_metrics(results: Sequence[dict], dp: int) -> dict | None:
    """The step's MoE gate metrics from every rank's ``StageWorker.step`` result, or ``None``.

    Each rank reports ``moe`` (means over its micro-batches and MoE layers, ``count`` of them)
    and ``aux_losses`` (per micro-batch, the sum of its layers' aux losses). Metrics are the
    ``count``-weighted mean over ranks (= the mean over all layers and micro-batches); ``load``
    likewise per expert; ``aux_loss`` is the model's aux loss per micro-batch (summed over the
    pipeline ranks of a replica), averaged over micro-batches and replicas.
    """
    parts = [r["moe"] for r in results if r.get("moe")]
    if not parts:
        return None
    out: dict = {}
    for k in _MOE_KEYS:
        have = [(p[k], p.get("count", 1)) for p in parts if k in p]
        if have:
            out[k] = sum(v * c for v, c in have) / sum(c for _, c in have)
    loads = [(p["load"], p.get("count", 1)) for p in parts if "load" in p]
    if loads and all(len(x) == len(loads[0][0]) for x, _ in loads):
        total = sum(c for _, c in loads)
        out["load"] = [sum(x[e] * c for x, c in loads) / total for e in range(len(loads[0][0]))]
    aux = [sum(r["aux_losses"]) / len(r["aux_losses"]) for r in results if r.get("aux_losses")]
    if aux:
        out["aux_loss"] = sum(aux) / max(1, dp)
    return out


def merge_timeline(results: Sequence[dict], pp: int) -> Timeline:
    """Replica 0's events (world ranks 0..pp-1) as one measured Timeline over pipeline ranks,
    shifted so the earliest event starts at 0 s. Memory: each rank's ``memory`` samples
    (``[[t, rss_bytes], ...]``) where the worker reports them, else its ``peak_memory`` (bytes)."""
    events: list[Event] = []
    for r in range(min(pp, len(results))):
        for e in results[r].get("events", []):
            d = dict(e)
            d["rank"] = int(d.get("rank", r)) % pp
            events.append(Event(**{k: d[k] for k in ("rank", "stream", "op", "name", "start", "end") },
                                **{k: d[k] for k in ("nbytes", "micro_batch", "segment") if k in d}))
    t0 = min((e.start for e in events), default=0.0)
    for e in events:
        e.start -= t0
        e.end -= t0
    memory = []
    for r in range(pp):
        res = results[r] if r < len(results) else {}
        curve = res.get("memory")
        if curve:
            memory.append([(float(t) - t0, int(v)) for t, v in curve])
        else:
            memory.append([(0.0, int(res.get("peak_memory", 0) or 0))])
    return Timeline(events, memory, pp, [], source="measured")


def finish_times(tl: Timeline, n: int) -> list[float]:
    """Per rank: seconds from the step's start (earliest event anywhere) to the rank's last event end."""
    if not tl.events:
        return [0.0] * n
    t0 = min(e.start for e in tl.events)
    out = [0.0] * n
    for e in tl.events:
        if 0 <= e.rank < n:
            out[e.rank] = max(out[e.rank], e.end - t0)
    return out
