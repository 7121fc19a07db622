"""Calling methods on a pool of rank actors, and turning their failures into :class:`LaunchFailure`.

Both launchers (:func:`runtime.launcher.launch`, :func:`runtime.crossover.launch_crossover`) call
their actors through a :class:`Runner`: ``Runner(pool).call("step", args_per_rank, timeout=...,
step=..., what="step")`` dispatches ``actor.step(*args)`` on every rank and waits (Ray
``wait``) until every rank answered, one raised or died, or ``timeout`` seconds passed. The
primary failure is chosen as: an actor death, then a raised error that is not a communication
error, then the rest (a peer of a dead rank typically sees "connection closed" from gloo).

The errors: :class:`LaunchError` (a :class:`~engine.errors.TesselError`, exit status 2) refuses a
launch that cannot start as asked (bad settings, a task that does not fit, a cluster without the
GPUs it needs); :class:`LaunchFailure`, a :class:`LaunchError` that is also an
:class:`~engine.errors.RunError` (exit status 3), is a run that failed through no mistake in its
input: a rank raised, died or hung, or a checkpoint could not be written.
:class:`LaunchInterrupted` (a :class:`KeyboardInterrupt`) is a launch stopped by Ctrl-C after
saving the last completed step.

:func:`as_plan` accepts a Plan, its dict or a path, as both launchers do.

Sources: Ray actor fault tolerance and ``ray.wait`` (https://docs.ray.io/en/latest/ray-core/).
"""

from __future__ import annotations

import os
import re
import time
from typing import TYPE_CHECKING, Any, Sequence

from engine.errors import CrossoverError, RunError, TesselError
from engine.io import Plan, load_plan
from runtime.node_placement import nodes_of_ranks

if TYPE_CHECKING:  # pragma: no cover
    from runtime.cluster import ActorPool

__all__ = ["CrossoverLaunchError", "CrossoverLaunchFailure", "LaunchError", "LaunchFailure", "LaunchInterrupted",
           "Runner", "as_plan"]


class LaunchError(TesselError):
    """A launch was refused or failed: settings out of range, a task that does not fit, a cluster
    that cannot host the plan (these are user mistakes, exit status 2), or, as the subclass
    :class:`LaunchFailure` (a :class:`~engine.errors.RunError`, exit status 3), a rank that raised,
    died or hung.

    Attributes:
        rank: the failing rank (world rank), or ``None`` when not rank-specific.
        step: the step being run, or ``None``.
        instruction: the instruction the rank was executing (from its exception), or ``None``.
        kind: ``"raised"``, ``"died"``, ``"hung"``, ``"node lost"`` (a cluster node the ranks were placed on
            died or stopped answering), ``"checkpoint"`` (a :class:`LaunchFailure`),
            ``"setup"`` (a refused setting, or a :class:`LaunchFailure` when a rank failed in its
            ``setup()``) or ``"cluster"``.
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


class LaunchFailure(LaunchError, RunError):
    """A launch that started failed through no mistake in its input: a rank raised, died or hung
    (``kind`` ``"raised"``, ``"died"``, ``"hung"``, or ``"setup"`` for a rank's ``setup()``), or a
    checkpoint could not be written (``kind="checkpoint"``). A :class:`LaunchError` (same attributes)
    and an :class:`engine.errors.RunError`: the CLI exits with status 3. The last complete
    checkpoint is kept and named by ``checkpoint``."""


class LaunchInterrupted(KeyboardInterrupt):
    """A launch stopped by SIGINT (Ctrl-C) after its last completed step was checkpointed.

    A :class:`KeyboardInterrupt`, so callers that only know Ctrl-C stop as before (the CLI exits
    with status 130); ``str()`` is one sentence naming the checkpoint.

    Attributes:
        checkpoint: the checkpoint directory to resume from (``step_N``), or ``None`` when the
            launch has no checkpoint folder or no step completed (then nothing new was saved).
        steps_done: steps completed (the step a resumed run starts at).
        steps: the step index the launch was to stop at.
    """

    def __init__(self, message: str, *, checkpoint: str | None, steps_done: int, steps: int):
        super().__init__(message)
        self.checkpoint = checkpoint
        self.steps_done = steps_done
        self.steps = steps

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "interrupted"


class CrossoverLaunchError(LaunchError, CrossoverError):
    """A co-located launch failed (:func:`runtime.crossover.launch_crossover`): bad plans (before
    Ray starts), setup, or one or more jobs. Both a :class:`LaunchError` and the planner's
    :class:`engine.crossover.CrossoverError`.

    Attributes (besides :class:`LaunchError`'s ``rank``, ``step``, ``instruction``, ``kind``,
    ``checkpoint``, which describe the first failed job):
        job: index of the (first) failed job, or ``None`` when not job-specific.
        result: the partial ``runtime.crossover.CrossoverResult`` (every job's progress and
            error), or ``None``.
    """

    def __init__(self, message: str, *, job: int | None = None, result: Any = None, **kw: Any):
        super().__init__(message, **kw)
        self.job = job
        self.result = result


class CrossoverLaunchFailure(CrossoverLaunchError, LaunchFailure):
    """A co-located launch whose job failed through no mistake in its input (a rank raised, died
    or hung): a :class:`CrossoverLaunchError` (same attributes) and a :class:`LaunchFailure`, so an
    :class:`engine.errors.RunError` (exit status 3). For ``runtime.crossover.launch_crossover`` to
    raise where a job failed (refusals of the plans stay :class:`CrossoverLaunchError`, status 2)."""


def as_plan(plan: Any, *, caller: str = "launch") -> Plan:
    """An ``engine.io.Plan`` from a Plan, its dict, or a path to plan JSON.

    Raises:
        TypeError: ``plan`` is none of these (the message names ``caller``).
        engine.errors.PlanFormatError: a malformed plan dict or file.
    """
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    if isinstance(plan, (str, os.PathLike)):
        return load_plan(os.fspath(plan))
    raise TypeError(f"{caller}() takes a Plan, a plan dict or a path, got {type(plan).__name__}")


#: StageWorker.step's error message (runtime/worker/errors.py).
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
    """Whether a failure's text reads like a communication error (a peer's closed connection...)."""
    t = text.lower()
    return any(w in t for w in _COMM_WORDS)


def _where(step: int | None, what: str) -> str:
    """``"step 3"``, ``"checkpoint at step 3"`` or ``"setup"``."""
    return f"step {step}" if what == "step" else (f"{what} at step {step}" if step is not None else what)


class Runner:
    """Calls a method on ranks and turns failures into :class:`LaunchFailure`."""

    def __init__(self, pool: ActorPool, grace: float = 2.0):
        self.pool = pool
        self.grace = grace  # seconds to collect further failures after the first one
        self.checkpoint: str | None = None

    def call(self, method: str, args_per_rank: Sequence[tuple], *, timeout: float, step: int | None,
             what: str, ranks: Sequence[int] | None = None) -> list:
        """``actor.method(*args)`` on ``ranks`` (default all), results in rank order.

        Raises:
            LaunchFailure: a rank raised or died (the primary failure is named), or some rank gave
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
        if failures or pending:
            lost = self._node_loss(step, what)
            if lost is not None:
                raise lost
        if failures:
            raise self._failure_error(failures, step, what)
        if pending:
            hung = sorted(pending.values())
            where = _where(step, what)
            raise LaunchFailure(
                f"rank{'s' if len(hung) > 1 else ''} {', '.join(map(str, hung))} gave no result for {where} "
                f"within {timeout:g} s (hung, or waiting on a peer that hung){self._ck_note()}",
                rank=hung[0], step=step, kind="hung", checkpoint=self.checkpoint)
        return [results[r] for r in ranks]

    def _ck_note(self) -> str:
        return f"; the last checkpoint {self.checkpoint} is kept" if self.checkpoint else ""

    def _node_loss(self, step: int | None, what: str) -> LaunchFailure | None:
        """Where ranks were placed by node (a cluster launch) and a node is lost (dead, or not
        answering a pinned task: :func:`runtime.cluster.lost_nodes`), the failure that names it and
        the ranks that ran there (``kind="node lost"``); else ``None``."""
        rows = getattr(self.pool, "rank_nodes", None) or []
        nodes = nodes_of_ranks(rows)
        if not nodes:
            return None
        from runtime.cluster import lost_nodes

        lost = lost_nodes(rows)
        if not lost:
            return None
        k = lost[0]
        _, addr, ranks = nodes[k]
        others = f"; node(s) {', '.join(map(str, lost[1:]))} too" if len(lost) > 1 else ""
        return LaunchFailure(
            f"node {k} ({addr}) was lost during {_where(step, what)}: rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))} ran there (its Ray node died or stopped answering){others}"
            f"{self._ck_note()}", rank=ranks[0], step=step, kind="node lost", checkpoint=self.checkpoint)

    def _failure_error(self, failures: list[tuple[int, BaseException]], step: int | None,
                       what: str) -> LaunchFailure:
        described = [(r, *_describe_failure(e)) for r, e in failures]

        def priority(item: tuple[int, str, str | None, str]) -> tuple[int, int]:
            r, kind, instr, text = item
            if kind == "died":
                return (0, r)
            if instr is not None or not _is_comm_error(text):
                return (1, r)
            return (2, r)

        r, kind, instr, text = min(described, key=priority)
        where = _where(step, what)
        if kind == "died":
            head = f"rank {r} died during {where} (its actor process exited: {text})"
        else:
            ins = f" in instruction {instr}" if instr else ""
            head = f"rank {r} failed during {where}{ins}: {text}"
        others = sorted({x[0] for x in described} - {r})
        tail = f"; rank(s) {', '.join(map(str, others))} failed after it" if others else ""
        return LaunchFailure(head + tail + self._ck_note(), rank=r, step=step, instruction=instr,
                           kind="setup" if what == "setup" and kind != "died" else kind,
                           checkpoint=self.checkpoint)
