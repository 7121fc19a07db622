"""Launch panel: train the current plan on the local Ray cluster, live loss, measured vs predicted.

Launch runs :class:`planner_ui.launch_facade.LaunchJob` (``runtime.launcher.launch`` in a
background thread; the runtime is imported only when a launch starts). The job's thread only
appends ``(step, loss)`` to a plain list; a Panel periodic callback on the session's event loop
(``pn.state.add_periodic_callback``) copies new losses into the loss chart's Bokeh
``ColumnDataSource`` and, once the job is done, shows tokens/s and predicted vs measured makespan
and sets ``state.measured`` to the measured timeline, so the Gantt draws it over the prediction.
Without an event loop (pytest, scripts) :meth:`LaunchPanel.launch` with ``wait=True`` joins the job
and applies the result in the calling thread; :meth:`LaunchPanel.poll` applies what has arrived.
"""

from __future__ import annotations

import contextlib
import math

import panel as pn
import param
from bokeh.models import ColumnDataSource
from bokeh.plotting import figure

from planner_ui.background import bokeh_safe
from planner_ui.launch_facade import LaunchJob, LaunchNotPossible
from planner_ui.state import PlanState


class LaunchPanel(pn.viewable.Viewer):
    """Run the current plan through the runtime and compare the measured step with the prediction.

    Construct with ``LaunchPanel(state=state)``; ``launch_kw`` (a dict) holds fields of
    :class:`runtime.config.LaunchConfig` for :func:`runtime.launcher.launch` (e.g.
    ``{"device": "cpu", "step_timeout": 60}``).

    Methods: :meth:`launch` (``wait=False`` starts in the background; ``wait=True`` blocks and
    applies the result), :meth:`poll`. Attributes: :attr:`job` (the :class:`LaunchJob`),
    :attr:`result` (the ``LaunchResult``), ``loss_source`` (Bokeh data: ``step``, ``loss``),
    ``status`` (the status line). Errors (an abstract plan, a failed rank...) go to
    ``state.message`` with kind ``"error"``.
    """

    state = param.ClassSelector(class_=PlanState, doc="the shared planner state")
    steps = param.Integer(default=10, bounds=(1, 100000), doc="training steps to run")
    running = param.Boolean(default=False, doc="a launch is running")
    status = param.String(default="", doc="status line (Markdown)")
    launch_kw = param.Dict(default={}, doc="runtime.config.LaunchConfig fields of the launch (besides steps)")
    poll_period_ms = param.Integer(default=500, bounds=(20, None), doc="how often the UI polls a running launch")

    def __init__(self, **params):
        super().__init__(**params)
        if self.state is None:
            self.state = PlanState()
        self.job: LaunchJob | None = None
        self.result = None
        self._seen = 0
        self._periodic = None
        self._plan_revision = None
        self.loss_source = ColumnDataSource(data={"step": [], "loss": []})
        self._build()

    # ------------------------------------------------------------------ widgets
    def _build(self) -> None:
        self.steps_input = pn.widgets.IntInput.from_param(self.param.steps, name="Steps",
                                                          css_classes=["tessel-launch-steps"])
        self.run_button = pn.widgets.Button(label="Launch on Ray", color="primary",
                                            css_classes=["tessel-launch-run"])
        self.run_button.on_click(lambda _e: self.launch(wait=False))
        self.status_pane = pn.pane.Markdown(self.status, css_classes=["tessel-launch-status"])
        fig = figure(height=220, sizing_mode="stretch_width", title="training loss", toolbar_location=None,
                     x_axis_label="step", y_axis_label="loss (nats/token)")
        fig.line(x="step", y="loss", source=self.loss_source, line_width=2)
        fig.scatter(x="step", y="loss", source=self.loss_source, size=5)
        self.loss_fig = fig
        self.loss_pane = pn.pane.Bokeh(fig, css_classes=["tessel-launch-loss"])
        self.param.watch(self._sync_widgets, ["running", "status"])

    def _sync_widgets(self, *_events) -> None:
        self.run_button.disabled = self.running
        self.status_pane.object = self.status

    def __panel__(self):
        return pn.Column(pn.Row(self.steps_input, self.run_button), self.status_pane, self.loss_pane,
                         css_classes=["tessel-launch-panel"])

    # ------------------------------------------------------------------ running
    def launch(self, wait: bool = False, timeout: float | None = None):
        """Launch the current plan for ``steps`` steps.

        With ``wait=False`` returns the :class:`LaunchJob` at once (a periodic callback updates the
        view); with ``wait=True`` waits (``timeout`` s, ``None``: until done), applies the result
        and returns the ``LaunchResult`` (``None`` on error / timeout). Returns ``None`` and shows
        the reason when the plan cannot be launched (no plan, an abstract placement).
        """
        if self.running:
            self._error("a launch is already running")
            return None
        try:
            job = LaunchJob(self.state.plan, steps=self.steps, **dict(self.launch_kw))
        except LaunchNotPossible as e:
            self._error(f"cannot launch: {e}")
            return None
        self.job, self.result, self._seen = job, None, 0
        self._plan_revision = self.state.revision
        self.loss_source.data = {"step": [], "loss": []}
        self.param.update(running=True, status=f"launching {self.state.plan.schedule.name} for {self.steps} steps "
                                               "on the local Ray cluster (starting actors)...")
        self.state.message_kind = "info"
        self.state.message = self.status
        job.start()
        if not wait:
            try:
                self._periodic = pn.state.add_periodic_callback(self.poll, period=self.poll_period_ms)
            except Exception:  # noqa: BLE001 - no session/loop to poll from: poll() is called by hand
                self._periodic = None
            return job
        job.join(timeout)
        self.poll()
        return self.result

    @bokeh_safe
    def poll(self) -> None:
        """Copy new losses into the chart; when the job is done, show the summary and set
        ``state.measured``. Call on the UI thread (the periodic callback does)."""
        job = self.job
        if job is None or not self.running:
            return
        new = job.losses[self._seen:]
        if new:
            self._seen += len(new)
            self.loss_source.stream({"step": [s for s, _ in new], "loss": [v for _, v in new]})
            step, loss = new[-1]
            self.status = f"step {step + 1}/{job.steps}: loss {loss:.4f} ({job.elapsed:.1f} s)"
        if job.done:
            self._finish(job)

    def _finish(self, job: LaunchJob) -> None:
        cb, self._periodic = self._periodic, None
        if cb is not None:
            with contextlib.suppress(Exception):  # a session already destroyed has removed it
                cb.stop()
        self.running = False
        if job.error is not None:
            self._error(job.error_message())
            return
        res = self.result = job.result
        st = self.state
        lines = [f"**done**: {len(res.losses)} steps in {res.elapsed:.1f} s ({res.backend}, {res.world_size} ranks); "
                 f"final loss {res.final_loss:.4f}" if res.final_loss is not None else "**done**",
                 f"tokens/s: {res.tokens_per_second:,.0f}",
                 f"step time predicted {_ms(res.predicted_makespan)}, measured {_ms(res.measured_makespan)}"
                 + (f" (measured / predicted = {res.measured_makespan / res.predicted_makespan:.2f})"
                    if res.predicted_makespan and not math.isnan(res.predicted_makespan) else "")]
        if res.timeline is not None and st.revision == self._plan_revision:
            st.measured = res.timeline
        elif res.timeline is not None:
            lines.append("the plan changed during the launch; the measured timeline is not drawn over it")
        self.status = "  \n".join(lines)
        st.message_kind = "success"
        st.message = (f"launch done: {res.tokens_per_second:,.0f} tokens/s, step time predicted "
                      f"{_ms(res.predicted_makespan)} vs measured {_ms(res.measured_makespan)}")

    def _error(self, text: str) -> None:
        self.status = text
        self.state.message_kind = "error"
        self.state.message = text


def _ms(seconds: float | None) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    return f"{seconds * 1e3:.2f} ms"


__all__ = ["LaunchPanel"]
