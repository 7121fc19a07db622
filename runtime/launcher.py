"""Launch a plan on Ray: one stage-worker actor per rank, train for some steps, measure.

``launch(plan, steps=50, checkpoint_dir="out/ckpt")`` starts (or connects to) Ray, reserves a
placement group with one bundle per rank (``runtime.cluster``), starts a
``runtime.worker.StageWorker`` per rank, and then for every step:

1. builds the global batch ``ByteCorpus(seq_len).train_batch(step, dp * m * micro_batch_size)``
   (a pure function of the step, so the step is the data position) and hands the same tensor
   (one ``ray.put``) to every rank; DP replica ``d`` (ranks ``d*pp .. d*pp+pp-1``; rank r is
   pipeline rank ``r % pp``) trains on rows ``[d*m*mbs, (d+1)*m*mbs)`` of it (the worker slices);
2. calls ``step(step, batch)`` on every rank and waits for all of them (at most ``step_timeout``
   seconds): the step's loss is the mean of the per-micro-batch losses reported by the last
   pipeline stage of every replica (= the mean over the global batch, since micro-batches are
   equal-sized);
3. every ``eval_every`` steps evaluates a fixed validation batch, and every ``checkpoint_every``
   steps writes an atomic checkpoint (``runtime.checkpoint``).

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
stays the cross-entropy alone). The progress bar shows them too.

Faults. A rank that raises (e.g. the deliberate ``fail_at``), dies (actor process exits) or
hangs (no result within ``step_timeout``) stops the job: the launcher raises
:class:`LaunchError` naming the rank, the step and, where the worker's exception says so, the
instruction; it keeps the last checkpoint, kills every actor, removes the placement group and
shuts Ray down (when it started it). When several ranks fail, the primary failure is chosen
as: an actor death, then a raised error that is not a communication error, then the rest
(a peer of a dead rank typically sees "connection closed" from gloo).

Sources: Ray placement groups and actor fault tolerance (https://docs.ray.io/en/latest/ray-core/),
``torch.distributed`` (https://pytorch.org/docs/stable/distributed.html).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from engine.errors import TesselError
from engine.timeline import Event, Timeline
from runtime import checkpoint as _ckpt
from runtime import cluster as _cluster


class LaunchError(TesselError):
    """A launch failed: a rank raised, died or hung, or the cluster could not host the plan.

    Attributes:
        rank: the failing rank (world rank), or ``None`` when not rank-specific.
        step: the step being run, or ``None``.
        instruction: the instruction the rank was executing (from its exception), or ``None``.
        kind: ``"raised"``, ``"died"``, ``"hung"``, ``"setup"`` or ``"cluster"``.
        checkpoint: the last complete checkpoint directory (kept), or ``None``.
    """

    def __init__(self, message: str, *, rank: int | None = None, step: int | None = None,
                 instruction: str | None = None, kind: str = "raised", checkpoint: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.instruction = instruction
        self.kind = kind
        self.checkpoint = checkpoint


@dataclass
class LaunchResult:
    """What :func:`launch` measured.

    Attributes:
        steps: steps completed in total (the final data position; a resumed launch counts the
            steps done before it too).
        start_step: the first step run by this launch (0, or the resumed checkpoint's step).
        losses: training loss of each step run by this launch (``losses[i]`` is step
            ``start_step + i``), nats per token, mean over the global batch.
        val_losses: ``[(steps_completed, loss)]`` on the fixed validation batch.
        step_times: seconds of each step, dispatch to the last rank's result (driver clock).
        tokens_per_step: tokens in one global batch (dp * micro_batches * micro_batch_size * seq_len).
        tokens_per_second: tokens / second over this launch's steps, the first one excluded
            (warm-up) when more than one ran.
        timeline: the measured Timeline of the last step (``source="measured"``), or ``None``.
        timelines: the measured Timelines of the last ``keep_timelines`` steps, oldest first (the
            input of ``engine.cost.calibrate.calibrate``); not in :meth:`to_dict`.
        predicted_step_time: per pipeline rank, seconds from the step's start to the rank's last
            event in the simulator's prediction.
        measured_step_time: the same in the measured timeline.
        predicted_busy, measured_busy: per pipeline rank, seconds of compute (F/B/I/W/optimizer).
        predicted_makespan, measured_makespan: seconds of one step, predicted and measured
            (timeline makespan of the last step).
        peak_memory: bytes per world rank reported by the workers (last step).
        trace_paths: ``{"measured": path}`` (and whatever the caller adds).
        checkpoint: the last checkpoint directory, or ``None``.
        backend: ``"gloo"`` or ``"nccl"``.
        optimizer: the workers' optimizer (``"adam"``, ``"adama"`` or ``"sgd"``).
        world_size, dp, pp: ranks and degrees.
        elapsed: seconds of the whole launch (Ray start to shutdown).
        setup_time: seconds from Ray start until every rank finished ``setup()``.
        moe: per step of this launch, the MoE gate metrics (see the module docstring) with
            ``step``; empty for models without MoE layers (and then left out of :meth:`to_dict`).
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


def _as_plan(plan: Any):
    """An ``engine.io.Plan`` from a Plan, its dict, or a path to plan JSON."""
    from engine.io import Plan, load_plan

    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    if isinstance(plan, (str, os.PathLike)):
        return load_plan(plan)
    raise TypeError(f"launch() takes a Plan, a plan dict or a path, got {type(plan).__name__}")


def _fail_at_for(fail_at: Any, rank: int) -> tuple[int, int] | None:
    """``fail_at`` of one rank from ``(rank, step, instruction_index)`` or ``{rank: (step, index)}``."""
    if fail_at is None:
        return None
    if isinstance(fail_at, dict):
        v = fail_at.get(rank)
        return None if v is None else (int(v[0]), int(v[1]))
    r, s, i = fail_at
    return (int(s), int(i)) if int(r) == rank else None


#: StageWorker.step's error message (runtime/worker.py).
_WORKER_ERR = re.compile(r"^rank (?P<rank>\d+) \(pipeline rank (?P<pp>\d+), replica (?P<dp>\d+)\) failed at step "
                         r"(?P<step>\d+), instruction (?P<index>\d+) \((?P<ins>[^)]*)\): (?P<detail>.*)$")

_COMM_WORDS = ("connection closed", "connection reset", "gloo", "nccl", "timed out", "timeout", "broken pipe",
               "peer", "socket", "recv", "send")


def _describe_failure(exc: BaseException) -> tuple[str, str | None, str]:
    """(kind, instruction, text) of a Ray error from a rank."""
    import ray.exceptions as rex

    if isinstance(exc, rex.RayActorError):
        full = " ".join(str(getattr(exc, "error_msg", None) or exc).split())
        first = full.split(". ")[0].rstrip(".")
        m = re.search(r"Worker exit type: (\w+)", full)
        pid = re.search(r"\bpid: (\d+)", full)
        extra = "".join([f"; pid {pid.group(1)}" if pid else "", f"; exit type {m.group(1)}" if m else ""])
        return "died", None, (first or type(exc).__name__)[:300] + extra
    cause: BaseException = exc
    if isinstance(exc, rex.RayTaskError):
        c = getattr(exc, "cause", None)
        if isinstance(c, BaseException):
            cause = c
    instr = getattr(cause, "instruction", None)
    instr = str(instr) if instr is not None else None
    text = str(cause).strip()
    if isinstance(exc, rex.RayTaskError) and cause is exc:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        text = lines[-1] if lines else type(exc).__name__
    first = text.splitlines()[0] if text else ""
    m = _WORKER_ERR.match(first)
    if m:  # "rank R (pipeline rank P, replica D) failed at step S, instruction I (INS): detail"
        if instr is None:
            instr = f"{m.group('index')} ({m.group('ins')})"
        return "raised", instr, f"pipeline rank {m.group('pp')}, replica {m.group('dp')}: {m.group('detail')}"[:500]
    return "raised", instr, f"{type(cause).__name__}: {first}"[:500]


def _is_comm_error(text: str) -> bool:
    t = text.lower()
    return any(w in t for w in _COMM_WORDS)


class _Runner:
    """Calls a method on ranks and turns failures into :class:`LaunchError`."""

    def __init__(self, pool, grace: float = 2.0):
        self.pool = pool
        self.grace = grace  # seconds to collect further failures after the first one
        self.checkpoint: str | None = None

    def call(self, method: str, args_per_rank: Sequence[tuple], *, timeout: float, step: int | None,
             what: str, ranks: Sequence[int] | None = None) -> list:
        """``actor.method(*args)`` on ``ranks`` (default all), results in rank order.

        Raises:
            LaunchError: a rank raised or died (the primary failure is named), or some rank gave
                no result within ``timeout`` seconds.
        """
        import ray

        ranks = list(range(len(self.pool.actors))) if ranks is None else list(ranks)
        pending = {getattr(self.pool.actors[r], method).remote(*args): r for r, args in zip(ranks, args_per_rank)}
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        failures: list[tuple[int, BaseException]] = []
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            for ref in ready:
                r = pending.pop(ref)
                try:
                    results[r] = ray.get(ref)
                except Exception as e:  # RayTaskError, RayActorError, ...
                    if not failures:
                        deadline = min(deadline, time.monotonic() + self.grace)
                    failures.append((r, e))
        if failures:
            raise self._failure_error(failures, step, what)
        if pending:
            hung = sorted(pending.values())
            where = f"step {step}" if what == "step" else (f"{what} at step {step}" if step is not None else what)
            raise LaunchError(
                f"rank{'s' if len(hung) > 1 else ''} {', '.join(map(str, hung))} gave no result for {where} "
                f"within {timeout:g} s (hung, or waiting on a peer that hung){self._ck_note()}",
                rank=hung[0], step=step, kind="hung", checkpoint=self.checkpoint)
        return [results[r] for r in ranks]

    def _ck_note(self) -> str:
        return f"; the last checkpoint {self.checkpoint} is kept" if self.checkpoint else ""

    def _failure_error(self, failures, step, what) -> LaunchError:
        described = [(r, *_describe_failure(e)) for r, e in failures]

        def priority(item):
            r, kind, instr, text = item
            if kind == "died":
                return (0, r)
            if instr is not None or not _is_comm_error(text):
                return (1, r)
            return (2, r)

        r, kind, instr, text = min(described, key=priority)
        where = f"step {step}" if what == "step" else (f"{what} at step {step}" if step is not None else what)
        if kind == "died":
            head = f"rank {r} died during {where} (its actor process exited: {text})"
        else:
            ins = f" in instruction {instr}" if instr else ""
            head = f"rank {r} failed during {where}{ins}: {text}"
        others = sorted({x[0] for x in described} - {r})
        tail = f"; rank(s) {', '.join(map(str, others))} failed after it" if others else ""
        return LaunchError(head + tail + self._ck_note(), rank=r, step=step, instruction=instr,
                           kind="setup" if what == "setup" and kind != "died" else kind,
                           checkpoint=self.checkpoint)


def _moe_postfix(gates: dict) -> dict[str, str]:
    """Short progress-bar fields of :func:`merge_moe_metrics`' result."""
    out = {}
    if "temperature" in gates:
        out["tau"] = f"{gates['temperature']:.3f}"
    if "experts_per_token" in gates:
        out["exp/tok"] = f"{gates['experts_per_token']:.2f}"
    if "load_cv" in gates:
        out["load_cv"] = f"{gates['load_cv']:.2f}"
    if "dropped_fraction" in gates:
        out["drop"] = f"{gates['dropped_fraction']:.1%}"
    return out


def _merge_timeline(results: Sequence[dict], pp: int) -> Timeline:
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


def _finish_times(tl: Timeline, n: int) -> list[float]:
    """Per rank: seconds from the step's start (earliest event anywhere) to the rank's last event end."""
    if not tl.events:
        return [0.0] * n
    t0 = min(e.start for e in tl.events)
    out = [0.0] * n
    for e in tl.events:
        if 0 <= e.rank < n:
            out[e.rank] = max(out[e.rank], e.end - t0)
    return out


def launch(
    plan: Any,
    *,
    steps: int,
    address: str | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int = 0,
    eval_every: int = 0,
    resume: bool = False,
    seed: int = 0,
    lr: float = 1e-3,
    progress: bool = True,
    step_timeout: float = 120.0,
    fail_at: Any = None,
    trace_path: str | os.PathLike | None = None,
    device: str = "auto",
    keep_checkpoints: int | None = 2,
    optimizer: str | None = None,
    worker_cls: type | None = None,
    on_step: Callable[[int, float], None] | None = None,
    keep_timelines: int = 8,
    p2p_matching: str | None = None,
) -> LaunchResult:
    """Train ``plan`` on Ray actors for ``steps`` steps and measure it.

    Args:
        plan: an ``engine.io.Plan``, its ``to_dict()``, or a path to ``plan.json``.
        steps: the total number of steps of the run (the step index to stop at). With ``resume``
            the steps already in the checkpoint count: a run checkpointed at step 30 and
            resumed with ``steps=50`` runs steps 30..49.
        address: a Ray cluster address; ``None`` starts an embedded local cluster. A process that
            already called ``ray.init`` keeps its connection (and Ray is left running).
        checkpoint_dir: folder for ``step_N`` checkpoints; ``None`` writes none.
        checkpoint_every: write a checkpoint every this many steps (0: only at the end); the
            final step is always checkpointed when ``checkpoint_dir`` is set.
        eval_every: evaluate the fixed validation batch every this many steps (0: only at the end).
        resume: continue from the newest checkpoint in ``checkpoint_dir`` (from step 0 if none).
        seed: model initialisation / worker RNG seed.
        lr: learning rate.
        progress: show a tqdm progress bar (stderr) with loss and tokens/s.
        step_timeout: seconds a rank may take for one call (``step``, ``evaluate``, ...) before the
            job is declared hung; setup and checkpoint calls get at least 60 s.
        fail_at: deliberate fault for tests: ``(rank, step, instruction_index)`` or
            ``{rank: (step, instruction_index)}``.
        trace_path: write the measured Perfetto trace of the last step here.
        device: ``"auto"`` (NCCL on GPUs when the cluster has one per rank, else gloo on CPU),
            ``"cpu"`` or ``"cuda"``.
        keep_checkpoints: newest checkpoints to keep (``None``: all).
        optimizer: the workers' optimizer, ``"adam"``, ``"adama"`` (AdamA, Adam accumulation, see
            ``runtime.worker``) or ``"sgd"``; ``None``: the plan's ``parallel.optimizer``
            (``"adam"`` when absent). Resuming needs the optimizer the checkpoint was written with.
        worker_cls: the per-rank worker class (default ``runtime.worker.StageWorker``).
        on_step: called after each step with ``(step, loss)``.
        keep_timelines: measured timelines of the last this many steps kept in
            :attr:`LaunchResult.timelines` (for calibration, ``engine.planner.with_calibration``).
        p2p_matching: the workers' point-to-point matching, ``"auto"``, ``"tags"`` (gloo only) or
            ``"ordered"`` (``runtime.worker``), passed to the workers only when given; ``None``: the
            worker's ``"auto"`` (the environment variable ``TESSEL_P2P`` of the worker's process
            when set, which a local Ray cluster inherits from the driver; else ordered with NCCL,
            tags with gloo).

    Returns:
        the :class:`LaunchResult`.

    Raises:
        LaunchError: a rank raised, died or hung, or setup failed (message names rank, step and
            instruction; the last checkpoint is kept; actors are killed and Ray shut down); an
            unknown optimizer, or ``resume`` from a checkpoint written with another optimizer
            (both before Ray starts).
        CheckpointError: ``resume`` with a checkpoint of another plan or world size.
        runtime.stage.RuntimeNotSupported: the plan uses tensor parallelism or multi-device blocks.
        engine.errors.PlanFormatError: a malformed plan file.
    """
    import ray

    t_start = time.perf_counter()
    plan = _as_plan(plan)
    par = plan.parallel
    dp, pp = int(par.get("dp", 1)), int(par.get("pp", 1))
    from runtime.stage import check_executable

    check_executable(plan)  # RuntimeNotSupported (a TesselError) before any Ray work: tp > 1, multi-device blocks
    ws = dp * pp
    m = int(par.get("micro_batches", plan.schedule.num_micro_batches))
    mbs = int(plan.model.get("micro_batch_size", 1))
    seq_len = int(plan.model.get("seq_len") or 0)
    if seq_len <= 0:
        raise LaunchError("the plan's model has no seq_len; the runtime trains language models on token sequences", kind="setup")
    if steps < 1:
        raise LaunchError(f"steps must be at least 1, got {steps}", kind="setup")
    replica_bs = m * mbs
    global_bs = dp * replica_bs
    tokens_per_step = global_bs * seq_len
    plan_dict = plan.to_dict()
    optimizer = str(optimizer or par.get("optimizer") or "adam")
    from runtime.worker import OPTIMIZERS

    if optimizer not in OPTIMIZERS:
        raise LaunchError(f"unknown optimizer {optimizer!r}; use one of {', '.join(map(repr, OPTIMIZERS))}",
                          kind="setup")

    ck = None
    if resume and checkpoint_dir is not None:
        newest = _ckpt.latest_checkpoint(checkpoint_dir)
        if newest is not None:
            ck = _ckpt.load_checkpoint(newest, plan=plan, world_size=ws)
            if ck.step >= steps:
                raise LaunchError(f"the checkpoint {ck.path} has already reached step {ck.step} (steps={steps}); "
                                  "ask for more steps to continue it", kind="setup", checkpoint=str(ck.path))
            ck_opt = ck.meta.get("optimizer")
            if ck_opt is not None and ck_opt != optimizer:
                raise LaunchError(f"the checkpoint {ck.path} was written with optimizer {ck_opt!r} but this launch "
                                  f"uses {optimizer!r}; resume with --optimizer {ck_opt} (optimizer states differ)",
                                  kind="setup", checkpoint=str(ck.path))
        elif progress:
            print(f"[tessel] no checkpoint in {checkpoint_dir}; starting from step 0", file=sys.stderr)
    start_step = ck.step if ck is not None else 0
    if ck is not None:
        last_ck: str | None = str(ck.path)
    else:
        newest = _ckpt.latest_checkpoint(checkpoint_dir) if checkpoint_dir is not None else None
        last_ck = str(newest) if newest is not None else None

    p2p = p2p_matching
    from runtime.worker import P2P_MATCHING, WorkerConfig

    if p2p is not None and p2p not in P2P_MATCHING:
        raise LaunchError(f"unknown p2p_matching {p2p!r}; use one of {', '.join(map(repr, P2P_MATCHING))}",
                          kind="setup")
    if worker_cls is None:
        from runtime.worker import StageWorker as worker_cls  # noqa: N813
    from runtime.data import ByteCorpus

    corpus = ByteCorpus(seq_len=seq_len)
    owned = False
    pool = None
    bar = None
    clean = False  # True once every step ran: actors get a graceful shutdown() first
    try:
        owned = _cluster.init_ray(address)
        try:
            backend = _cluster.choose_backend(ws, device)

            def args_for_rank(r: int, addr: str, port: int):
                kw = {"backend": backend.name, "seed": seed, "lr": lr, "optimizer": optimizer,
                      "fail_at": _fail_at_for(fail_at, r)}
                if backend.use_gpu:   # NCCL: CUDA tensors (the actor sees its one GPU as cuda:0)
                    kw["device"] = "cuda"
                if p2p:
                    kw["p2p_matching"] = p2p
                return ((plan_dict, r, ws, addr, port), {"config": WorkerConfig(**kw)})

            pool = _cluster.create_actors(worker_cls, ws, backend, args_for_rank, timeout=max(step_timeout, 60.0))
        except _cluster.ClusterError as e:
            raise LaunchError(str(e), kind="cluster") from e
        runner = _Runner(pool)
        runner.checkpoint = last_ck
        slow = max(step_timeout, 60.0)
        runner.call("setup", [()] * ws, timeout=slow, step=None, what="setup")
        if ck is not None:
            for r in range(ws):  # one rank at a time: only one rank's state in driver memory
                runner.call("load_state_dict", [(ray.put(ck.rank_state(r)),)], ranks=[r], timeout=slow,
                            step=None, what="loading the checkpoint")
                runner.call("__ray_call__", [(_ckpt.restore_rng, ck.rank_rng(r))], ranks=[r], timeout=slow,
                            step=None, what="restoring RNG states")
            ck.restore_rng()
        setup_time = time.perf_counter() - t_start

        val_ref = ray.put(corpus.val_batch(0, global_bs))

        losses: list[float] = []
        val_losses: list[tuple[int, float]] = []
        step_times: list[float] = []
        moe_history: list[dict] = []
        history = list(ck.meta.get("losses", [])) if ck is not None else []
        val_history = list(ck.meta.get("val_losses", [])) if ck is not None else []
        last_results: list[dict] = []
        recent: list[list[dict]] = []   # the ranks' results of the last keep_timelines steps, merged after the loop

        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=steps, initial=start_step, unit="step", desc="train", file=sys.stderr, dynamic_ncols=True)

        def evaluate(done: int) -> None:
            vals = runner.call("evaluate", [(val_ref,)] * ws, timeout=step_timeout, step=done, what="evaluation")
            got = [float(v) for v in vals if v is not None]
            if got:
                v = sum(got) / len(got)
                val_losses.append((done, v))
                val_history.append([done, v])

        def save(done: int) -> None:
            def state_of(r: int):
                return runner.call("state_dict", [()], ranks=[r], timeout=slow, step=done, what="checkpointing")[0]

            def rng_of(r: int):
                return runner.call("__ray_call__", [(_ckpt.capture_rng,)], ranks=[r], timeout=slow, step=done,
                                   what="checkpointing")[0]

            path = _ckpt.save_checkpoint(checkpoint_dir, done, state_of, rng_of, plan=plan, world_size=ws, seed=seed,
                                         extra={"losses": history, "val_losses": val_history, "lr": lr,
                                                "optimizer": optimizer, "backend": backend.name},
                                         keep=keep_checkpoints)
            runner.checkpoint = str(path)
            # checkpoints past this step are left from an earlier run in the same folder: stale
            for old in _ckpt.list_checkpoints(checkpoint_dir):
                if int(old.name.split("_")[1]) > done:
                    shutil.rmtree(old, ignore_errors=True)

        for step in range(start_step, steps):
            batch_ref = ray.put(corpus.train_batch(step, global_bs))  # every rank gets the global batch
            t0 = time.perf_counter()
            results = runner.call("step", [(step, batch_ref)] * ws, timeout=step_timeout, step=step, what="step")
            dt = time.perf_counter() - t0
            mb_losses = [float(x) for res in results for x in (res.get("losses") or [])]
            loss = sum(mb_losses) / len(mb_losses) if mb_losses else math.nan
            losses.append(loss)
            history.append([step, loss])
            step_times.append(dt)
            last_results = results
            if keep_timelines > 0:
                recent.append(results)
                del recent[:-keep_timelines]
            done = step + 1
            if on_step is not None:
                on_step(step, loss)
            gates = merge_moe_metrics(results, dp)
            if gates is not None:
                moe_history.append({"step": step, **gates})
            if bar is not None:
                post = {"loss": f"{loss:.4f}", "tok_s": f"{tokens_per_step / dt:,.0f}"}
                if gates is not None:
                    post.update(_moe_postfix(gates))
                bar.set_postfix(post, refresh=False)
                bar.update(1)
            if done == steps or (eval_every and done % eval_every == 0):
                evaluate(done)
            if checkpoint_dir is not None and (done == steps or (checkpoint_every and done % checkpoint_every == 0)):
                save(done)
        if bar is not None:
            bar.close()
            bar = None

        timelines = [_merge_timeline(r, pp) for r in recent]
        timeline = (timelines[-1] if timelines else _merge_timeline(last_results, pp)) if last_results else None
        trace_paths: dict[str, str] = {}
        if timeline is not None and trace_path is not None:
            from engine.io import write_trace

            trace_paths["measured"] = str(write_trace(timeline, trace_path, metadata={
                "schedule": plan.schedule.name, "backend": backend.name, "step": steps - 1,
                "world_size": ws, "measured": True}))
        from engine.planner import resimulate

        try:
            predicted = resimulate(plan)
        except TesselError:
            predicted = None
        pred_finish = _finish_times(predicted, pp) if predicted is not None else [math.nan] * pp
        pred_busy = [predicted.busy_time(r) for r in range(pp)] if predicted is not None else [math.nan] * pp
        meas_finish = _finish_times(timeline, pp) if timeline is not None else [math.nan] * pp
        meas_busy = [timeline.busy_time(r) for r in range(pp)] if timeline is not None else [math.nan] * pp
        clean = True
        timed = step_times[1:] if len(step_times) > 1 else step_times
        tps = tokens_per_step * len(timed) / sum(timed) if timed and sum(timed) > 0 else 0.0
        return LaunchResult(
            steps=steps, start_step=start_step, losses=losses, val_losses=val_losses, step_times=step_times,
            tokens_per_step=tokens_per_step, tokens_per_second=tps, timeline=timeline,
            predicted_step_time=pred_finish, measured_step_time=meas_finish,
            predicted_busy=pred_busy, measured_busy=meas_busy,
            predicted_makespan=predicted.makespan if predicted is not None else math.nan,
            measured_makespan=timeline.makespan if timeline is not None else math.nan,
            peak_memory=[int(res.get("peak_memory", 0) or 0) for res in last_results],
            trace_paths=trace_paths, checkpoint=runner.checkpoint, backend=backend.name, optimizer=optimizer,
            world_size=ws,
            dp=dp, pp=pp, elapsed=time.perf_counter() - t_start, setup_time=setup_time, moe=moe_history,
            timelines=timelines,
        )
    finally:
        if bar is not None:
            bar.close()
        if pool is not None:
            pool.close(graceful=clean)
        _cluster.shutdown_ray(owned)


__all__ = ["launch", "LaunchResult", "LaunchError", "merge_moe_metrics"]
