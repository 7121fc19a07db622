"""The "Plan a model" form: capture a model, split it, schedule it, and show the result.

Runs :func:`engine.plan.make.make_plan` (torch.export capture on the meta device, SuperScaler
phase 1 split, a predefined schedule, lowering and simulation) and loads the result into the
shared :class:`~planner_ui.state.PlanState` with its operator graph.
"""

from __future__ import annotations

import panel as pn
import param

from engine.baselines import SCHEDULES
from engine.coconet import TRANSFORMS
from engine.errors import TesselError
from engine.models.registry import list_models
from engine.plan.make import make_plan
from engine.precision import PRECISIONS
from engine.recompute import RECOMPUTE
from planner_ui.background import run_in_background
from planner_ui.state import PlanState

#: Cost tables offered in the form (engine.cost device table).
DEVICE_TYPES = ["h100", "a100", "cpu"]


def model_choices() -> list[str]:
    """Built-in model names (``engine.models.registry.list_models``), without the user-code pattern."""
    return [k for k in list_models() if ":" not in k]


def describe_shown(plan) -> str:
    """One line saying what the app shows now, for the sidebar: the model, schedule, devices and
    micro-batches of ``plan`` (a :class:`~engine.io.Plan` or ``None``), or that it is an abstract
    placement without a model (a search on abstract units), in which case the form's fields are
    not what is drawn."""
    if plan is None:
        return "**Shown:** nothing yet; press Plan."
    s = plan.schedule
    size = f"{s.num_devices} devices x {s.num_micro_batches} micro-batches"
    if plan.meta.get("abstract"):
        return (f"**Shown:** the abstract plan *{s.name}* ({size}, abstract time units, no model); "
                "the fields below are not applied to it: press Plan to plan a model again.")
    device = (plan.cost.get("device") or {}).get("name", "") if isinstance(plan.cost, dict) else ""
    on = f" {device}" if device else ""
    return f"**Shown:** {plan.model.name or 'a model'}, schedule *{s.name}*, {s.num_devices}{on} devices x " \
           f"{s.num_micro_batches} micro-batches."


class PlanForm(pn.viewable.Viewer):
    """Form with model, devices, micro-batches, schedule, device type, DP/TP; "Plan" runs
    :func:`engine.plan.make.make_plan` and loads the plan and graph into ``state``.

    Parameters mirror ``tessel plan``: ``model`` (registry name or ``module:callable``),
    ``devices`` (= dp x tp x pp), ``micro_batches``, ``schedule``, ``device_type``, ``dp``,
    ``dp_shard`` (FSDP2's fully sharded degree, dividing ``dp``), ``tp``,
    ``optimizer`` (``adam`` | ``adama``: the Gantt's memory curves show AdamA's missing gradient buffer),
    ``precision`` (``default``: the device type's, ``bf16-mixed`` on GPUs and ``32-true`` on cpu; or
    one of :data:`engine.precision.PRECISIONS`), ``recompute`` (:data:`engine.recompute.RECOMPUTE`),
    ``transforms`` (CoCoNet's transformations, :mod:`engine.coconet`; one the plan cannot take is
    refused in the message bar in one sentence), ``link`` (``engine.cost.parse_link``; empty: the
    device's own).
    A mistake (unknown model, too few micro-batches for a schedule, a split that does not fit)
    is shown in ``state.message`` as an error; the current plan stays.
    """

    state = param.ClassSelector(class_=PlanState)
    model = param.String(default="gpt2", doc="built-in model name or module:callable")
    devices = param.Integer(default=4, bounds=(1, 4096), doc="total devices = dp * tp * pp")
    micro_batches = param.Integer(default=8, bounds=(1, 100_000), label="Micro-batches", doc="micro-batches per step")
    schedule = param.Selector(default="1f1b", objects=list(SCHEDULES), doc="predefined schedule")
    device_type = param.Selector(default="h100", objects=DEVICE_TYPES, label="Device type",
                                 doc="cost table of one device")
    dp = param.Integer(default=1, bounds=(1, 4096), label="DP degree",
                       doc="data-parallel degree (dp_replicate x dp_shard)")
    dp_shard = param.Integer(default=1, bounds=(1, 4096), label="DP shard (FSDP)",
                             doc="of the DP degree, the fully sharded degree (FSDP2, ZeRO-3; must divide it); "
                                 "1: replicated")
    tp = param.Integer(default=1, bounds=(1, 4096), label="TP degree", doc="tensor-parallel degree")
    optimizer = param.Selector(default="adam", objects=["adam", "adama"], label="Optimizer",
                               doc="adam (gradient buffer until the step) or adama "
                                   "(AdamA: gradients folded and freed per micro-batch)")
    precision = param.Selector(default="default", objects=["default", *PRECISIONS], label="Precision",
                               doc="precision policy (default: bf16-mixed on GPU device types, 32-true on cpu)")
    recompute = param.Selector(default="none", objects=list(RECOMPUTE), label="Recomputation",
                               doc="activation recomputation: none, selective (attention core) or full")
    transforms = param.ListSelector(default=[], objects=list(TRANSFORMS), label="CoCoNet transformations",
                                    doc="computation/communication transformations (engine.coconet)")
    link = param.String(default="", label="Link", doc="link between ranks (nvlink, emulated:1gbit, 10gbit@5us); "
                                                      "empty: the device's own")
    busy = param.Boolean(default=False, doc="a plan is being made")

    def __init__(self, **params):
        super().__init__(**params)
        self._model_w = pn.widgets.AutocompleteInput(
            name="Model", options=model_choices(), value=self.model, restrict=False, min_characters=0,
            case_sensitive=False, css_classes=["tessel-plan-model"], sizing_mode="stretch_width")
        self._model_w.link(self, value="model")
        self._button = pn.widgets.Button(name="Plan", button_type="primary", css_classes=["tessel-plan-run"],
                                         sizing_mode="stretch_width")
        self._button.on_click(lambda _e: self.run_async())
        self._spinner = pn.indicators.LoadingSpinner(value=False, size=20, visible=False)
        self.param.watch(self._on_busy, "busy")
        self._shown = pn.pane.Markdown(describe_shown(self.state.plan), css_classes=["tessel-plan-shown"],
                                       sizing_mode="stretch_width", margin=(0, 10))
        self.state.param.watch(lambda _e: setattr(self._shown, "object", describe_shown(self.state.plan)), "revision")

    @property
    def shown_text(self) -> str:
        """The sidebar's line describing the plan on screen (:func:`describe_shown`)."""
        return self._shown.object

    def _on_busy(self, event) -> None:
        self._button.disabled = event.new
        self._spinner.value = self._spinner.visible = event.new

    def _make(self):
        return make_plan(self.model.strip(), devices=self.devices, micro_batches=self.micro_batches,
                         schedule=self.schedule, device_type=self.device_type, dp=self.dp, tp=self.tp,
                         dp_shard=self.dp_shard, optimizer=self.optimizer, transforms=list(self.transforms),
                         link=self.link.strip() or None,
                         precision=None if self.precision == "default" else self.precision, recompute=self.recompute)

    def _finish(self, res, err: BaseException | None) -> bool:
        self.busy = False
        if err is not None:
            if not isinstance(err, (TesselError, ValueError)):
                raise err
            self.state.message_kind = "error"
            self.state.message = f"cannot plan {self.model}: {err}"
            return False
        warn = f" ({'; '.join(res.warnings)})" if res.warnings else ""
        self.state.load(res.plan, graph=res.graph,
                        message=f"planned {self.model}: {self.schedule} on {self.devices} {self.device_type} devices, "
                                f"{self.micro_batches} micro-batches, {self.optimizer}, "
                                + (f"FSDP over {res.plan.parallel.dp_shard}, " if res.plan.parallel.fully_sharded
                                   else "")
                                + f"{res.plan.parallel.precision}, recompute {res.plan.parallel.recompute}"
                                + (f", {', '.join(res.plan.parallel.transforms)}" if res.plan.parallel.transforms
                                   else "")
                                + f", in {sum(res.timings.values()):.1f} s{warn}")
        return True

    def plan(self) -> bool:
        """Make the plan now (blocking); returns whether it succeeded (errors go to ``state.message``)."""
        self.busy = True
        try:
            res = self._make()
        except (TesselError, ValueError) as e:
            return self._finish(None, e)
        return self._finish(res, None)

    def run_async(self) -> None:
        """Plan in a background thread so the page stays responsive (capture can take seconds)."""
        if self.busy:
            return
        self.busy = True
        self.state.message_kind = "info"
        self.state.message = f"planning {self.model} ..."
        run_in_background(self._make, self._finish, name="tessel-plan")

    def __panel__(self):
        w = pn.Param(self.param,
                     parameters=["devices", "micro_batches", "schedule", "device_type", "dp", "dp_shard", "tp",
                                 "precision",
                                 "recompute", "optimizer", "link", "transforms"],
                     widgets={"devices": pn.widgets.IntInput, "micro_batches": pn.widgets.IntInput,
                              "dp": pn.widgets.IntInput, "dp_shard": pn.widgets.IntInput,
                              "tp": pn.widgets.IntInput,
                              "transforms": {"type": pn.widgets.CheckBoxGroup, "inline": False}},
                     show_name=False, sizing_mode="stretch_width")
        return pn.Column("### Plan a model", self._shown, self._model_w, w, pn.Row(self._button, self._spinner),
                         sizing_mode="stretch_width", css_classes=["tessel-plan-form"])


__all__ = ["PlanForm", "model_choices", "describe_shown", "DEVICE_TYPES"]
