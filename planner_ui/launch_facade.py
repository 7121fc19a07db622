"""The planner UI's only door to :mod:`runtime`: run a plan on Ray in a background thread.

``planner_ui`` may import ``runtime`` only through this module (docs/ARCHITECTURE.md), and only
lazily, inside functions: importing ``planner_ui`` never imports Ray or the runtime, so the
planner works on a laptop with neither.

:class:`LaunchJob` wraps :func:`runtime.launcher.launch` (no progress display; a per-step
``runtime.session.StepCallback`` feeds :attr:`LaunchJob.losses`) in a daemon thread. The thread
only appends to plain Python lists and sets plain attributes; a UI reads them from its own
thread (a Panel periodic callback), never the other way round.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from engine.errors import TesselError
from engine.io.plan import Plan

#: Shown when an abstract placement (no model) is launched.
NO_MODEL_MESSAGE = "this plan has no model; plan a model with make_plan or the CLI first"


class LaunchNotPossible(TesselError):
    """The plan cannot be launched (no model, no sequence length, Ray not installed)."""


def check_launchable(plan: Plan | None) -> None:
    """Raise :class:`LaunchNotPossible` with a one-sentence reason if ``plan`` cannot be launched.

    A plan needs a model (``plan.model.name``, not an abstract placement) and a sequence length
    (the runtime trains language models on token sequences).
    """
    if plan is None:
        raise LaunchNotPossible("no plan is loaded; plan a model with make_plan or the CLI first")
    if plan.meta.get("abstract") or not plan.segments or not plan.model.name:
        raise LaunchNotPossible(NO_MODEL_MESSAGE)
    if not plan.model.seq_len:
        raise LaunchNotPossible("the plan's model has no seq_len; the runtime trains language models on token "
                                "sequences")


class LaunchJob:
    """One launch of a plan on the local Ray cluster (or ``address``), in a background thread.

    Args:
        plan: an :class:`engine.io.Plan` of a model (abstract placements cannot be launched).
        steps: training steps to run (>= 1).
        keep_ray: start Ray (when this process has not) before launching and leave it running
            afterwards, so the next launch skips the start-up (seconds); stop it with
            :func:`shutdown_ray`. By default the launcher starts an embedded cluster and shuts
            it down at the end (an already running Ray is always reused and left running).
        **launch_kw: fields of :class:`runtime.config.LaunchConfig` (``address``, ``device``,
            ``step_timeout``, ``seed``, ``lr``, ``checkpoint_dir``...) besides ``steps``; the
            job's per-step callback feeds :attr:`losses` (``progress`` and ``on_step``, the
            launcher's former arguments, are ignored). Any other name stops the run with
            :class:`LaunchNotPossible` in :attr:`error` (checked in the job's thread, before Ray starts).

    Attributes (written by the job's thread, read by anyone):
        losses: ``[(step, loss)]`` as each step finishes (loss in nats per token).
        done: the thread has finished (successfully or not).
        error: the exception that stopped the launch (``runtime.LaunchError``, ...), or ``None``.
        result: the :class:`runtime.launcher.LaunchResult` (measured ``timeline``,
            ``tokens_per_second``, ``predicted_makespan``, ``measured_makespan`` in seconds), or
            ``None`` until done / on error.
        started_at, finished_at: ``time.perf_counter()`` stamps (``None`` until then).

    Raises:
        LaunchNotPossible: at construction, for a plan without a model or ``steps < 1``.
    """

    def __init__(self, plan: Plan, *, steps: int = 10, keep_ray: bool = False, **launch_kw: Any):
        check_launchable(plan)
        if int(steps) < 1:
            raise LaunchNotPossible(f"steps must be at least 1, got {steps}")
        self.plan = plan
        self.steps = int(steps)
        self.keep_ray = bool(keep_ray)
        self.launch_kw = {k: v for k, v in launch_kw.items() if k not in ("progress", "on_step", "steps")}
        self.losses: list[tuple[int, float]] = []
        self.done = False
        self.error: BaseException | None = None
        self.result = None
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ running
    def _on_step(self, step: int, loss: float) -> None:
        self.losses.append((int(step), float(loss)))  # list.append is atomic under the GIL

    def _run(self) -> None:
        try:
            # lazy: Ray and the torch workers are imported only when a launch runs
            from runtime.config import LaunchConfig
            from runtime.launcher import launch
            from runtime.session import StepCallback

            known = sorted(f.name for f in dataclasses.fields(LaunchConfig) if f.name != "steps")
            unknown = sorted(set(self.launch_kw) - set(known))
            if unknown:
                raise LaunchNotPossible(f"unknown launch setting {unknown[0]!r}; use one of {', '.join(known)}")
            config = LaunchConfig(steps=self.steps, **self.launch_kw)
            if self.keep_ray:
                ensure_ray(config.address)
            self.result = launch(self.plan, config, callbacks=[StepCallback(lambda r: self._on_step(r.step, r.loss))])
        except BaseException as e:  # noqa: BLE001 - reported to the UI, never raised in the thread
            self.error = e
        finally:
            self.finished_at = time.perf_counter()
            self.done = True

    def start(self) -> LaunchJob:
        """Start the launch in a daemon thread; returns ``self`` at once.

        Everything slow (starting Ray, creating the actors, training) happens in the thread, so a
        served page or a notebook stays responsive. Ray started from a thread other than the
        main one only skips installing its SIGTERM handler (Ray logs a warning).

        Raises:
            LaunchNotPossible: already started.
        """
        if self._thread is not None:
            raise LaunchNotPossible("this launch job has already been started")
        self.started_at = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="tessel-launch", daemon=True)
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (``None``: forever); ``True`` when the job is done."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.done

    @property
    def running(self) -> bool:
        return self._thread is not None and not self.done

    @property
    def elapsed(self) -> float:
        """Seconds since :meth:`start` (until the end once done)."""
        if self.started_at is None:
            return 0.0
        return (self.finished_at or time.perf_counter()) - self.started_at

    def error_message(self) -> str:
        """The error as one user-facing sentence (``""`` when there is none)."""
        e = self.error
        if e is None:
            return ""
        if isinstance(e, TesselError):
            return str(e)
        return f"launch failed: {type(e).__name__}: {e}"


def ensure_ray(address: str | None = None) -> bool:
    """Initialise Ray in this process if it is not yet (``runtime.cluster.init_ray``).

    Returns ``True`` when this call started it.

    Raises:
        LaunchNotPossible: Ray is not installed, or the cluster could not start / be reached.
    """
    try:
        from runtime import cluster
    except ImportError as e:  # ray (or torch) missing
        raise LaunchNotPossible(f"the runtime is not available ({e}); install ray to launch plans") from None
    try:
        return cluster.init_ray(address)
    except cluster.ClusterError as e:
        raise LaunchNotPossible(str(e)) from None


def shutdown_ray() -> None:
    """Stop the Ray connection/cluster this process started (no-op when Ray is not running)."""
    try:
        import ray
    except ImportError:
        return
    if ray.is_initialized():
        from runtime import cluster

        cluster.shutdown_ray(True)


__all__ = ["NO_MODEL_MESSAGE", "LaunchJob", "LaunchNotPossible", "check_launchable", "ensure_ray", "shutdown_ray"]
