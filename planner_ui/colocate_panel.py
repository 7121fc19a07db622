"""The "Co-locate" tab: predict two (or more) data-parallel jobs sharing the same devices.

CrossoverScheduler (docs/ARCHITECTURE.md, Sources): while one job all-reduces its gradients the
other computes, through a per-device compute token. The tab co-locates the current plan with
copies of itself, or with plans added to the Compare tab that have the same devices, predicts
crossover, uncoordinated and sequential execution (:func:`engine.crossover.compare_modes`) and
shows both jobs interleaved on each device (:class:`~planner_ui.crossover_view.CrossoverView`).

The link selector predicts on another link than the plan's own: the plan's cost model gets that
link between every pair of ranks (:func:`plan_on_link`), so its all-reduce and point-to-point
times follow it (the link spellings of :func:`engine.cost.parse_link`: a table name,
``emulated:RATE`` for the shaped loopback of ``benchmarks/emulated_network.py``, ``RATE@LATENCY``).

CSS hooks for browser tests: ``tessel-colocate`` (the tab), ``tessel-colocate-note``,
``tessel-colocate-run`` (the predict button), ``tessel-colocate-link`` (the link Select),
``tessel-colocate-link-text`` (the free link TextInput).
"""

from __future__ import annotations

import dataclasses

import panel as pn
import param

from engine.cost import CostModel, LinkSpec, parse_link
from engine.crossover import compare_modes
from engine.errors import TesselError
from engine.io.plan import Plan
from planner_ui.crossover_view import CrossoverView
from planner_ui.state import PlanState

#: The link selector's choices: label -> :func:`engine.cost.parse_link` spelling (``""``: each
#: plan's own link, as it was planned).
LINK_CHOICES: dict[str, str] = {
    "plan's own link": "",
    "unshaped loopback": "loopback",
    "emulated 1 Gbit/s": "emulated:1gbit",
    "emulated 10 Gbit/s": "emulated:10gbit",
}
_CUSTOM = "custom: "


def plan_on_link(plan: Plan, link: str | LinkSpec) -> Plan:
    """A copy of ``plan`` whose cost model has ``link`` within and across nodes.

    Its simulation (:func:`engine.plan.calibrate.resimulate`, what :func:`engine.crossover.job_profile`
    reads) then times the all-reduces and point-to-point transfers on ``link``; compute times
    are unchanged. ``plan.meta["link"]`` records the link's name.

    Raises:
        CostModelError (a :class:`~engine.errors.TesselError`): an unknown link spelling, or a
            plan without a cost model.
    """
    spec = parse_link(link)
    cost = dataclasses.replace(CostModel.from_dict(plan.cost), intra_link=spec, inter_link=spec)
    return dataclasses.replace(plan, cost=cost.to_dict(), meta={**plan.meta, "link": spec.name})


def fmt_bits(bytes_per_second: float) -> str:
    """A link's bandwidth (bytes/s) in bits per second for display (``1 Gbit/s``, ``800 Mbit/s``)."""
    bits = bytes_per_second * 8.0
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def describe_link(spec: LinkSpec) -> str:
    """``"emulated:1gbit (1 Gbit/s shared by all ranks, 75 us)"``: name, rate, latency."""
    per = "shared by all ranks" if spec.shared else "per rank"
    return f"{spec.name} ({fmt_bits(spec.bandwidth)} {per}, {spec.latency * 1e6:.3g} us)"


def plan_link_text(plan: Plan) -> str:
    """The link(s) a plan was costed with, for the header: ``"plan's own link: loopback (...)"``,
    or both links when they differ (``nvlink ... within a node, infiniband ... across``)."""
    try:
        cost = CostModel.from_dict(plan.cost)
    except TesselError:
        return "plan's own link"
    if cost.intra_link == cost.inter_link:
        return f"plan's own link: {describe_link(cost.intra_link)}"
    return (f"plan's own links: {describe_link(cost.intra_link)} within a node, "
            f"{describe_link(cost.inter_link)} across")


class ColocatePanel(pn.viewable.Viewer):
    """Predict co-located copies of the current plan (``jobs`` of them), on a chosen ``link``.

    Only data-parallel plans (pp = 1) can be co-located; others get a message saying how to
    plan one (``DP degree`` = devices in the plan form). Errors go to ``state.message``.
    Changing ``link`` (the selector, the text box or :meth:`set_link`) re-predicts; a spelling
    :func:`engine.cost.parse_link` refuses leaves ``link`` and the prediction unchanged and says so.
    """

    state = param.ClassSelector(class_=PlanState)
    jobs = param.Integer(default=2, bounds=(2, 8), doc="co-located copies of the current plan")
    steps = param.Integer(default=4, bounds=(1, 100), doc="steps simulated per job")
    link = param.String(default="", doc="the link predicted on (a parse_link spelling); '' = the plan's own")

    def __init__(self, **params):
        super().__init__(**params)
        self._syncing = False
        self.view = CrossoverView()
        self.button = pn.widgets.Button(name="Predict co-location", button_type="primary",
                                        css_classes=["tessel-colocate-run"])
        self.button.on_click(lambda _e: self.predict())
        self.link_select = pn.widgets.Select(label="Link", options=dict(LINK_CHOICES), value="",
                                             width=190, css_classes=["tessel-colocate-link"])
        self._sync_select(self.link)
        self.link_text = pn.widgets.TextInput(label="or any link", placeholder="e.g. emulated:100mbit, 10gbit@5us",
                                              width=220, css_classes=["tessel-colocate-link-text"])
        self.link_select.param.watch(self._on_select, ["value"])
        self.link_text.param.watch(self._on_text, ["value"])
        self.param.watch(self._on_link, ["link"])
        self.note = pn.pane.Markdown(
            "Co-locate copies of the current **data-parallel** plan (pp = 1) on the same devices: "
            "crossover hands a compute token between the jobs at their gradient all-reduce. "
            "The link sets what the all-reduces cost (`emulated:RATE`: the loopback shaped to RATE, "
            "one medium all ranks share).",
            css_classes=["tessel-colocate-note"], sizing_mode="stretch_width")

    # ------------------------------------------------------------------ the link
    def set_link(self, text: str) -> bool:
        """Predict on link ``text`` (a :func:`engine.cost.parse_link` spelling; ``""``: the plan's own).

        Returns ``False`` and says so in ``state.message`` (one sentence) for a spelling it
        refuses; ``link`` and the prediction are then unchanged.
        """
        text = str(text).strip().lower()   # parse_link's spellings are case-insensitive
        if text:
            try:
                parse_link(text)
            except TesselError as e:
                return self._error(f"{e}; the co-location prediction is unchanged")
        if text == self.link:
            return self.predict()
        self.link = text   # the watcher re-predicts
        return self.state.message_kind != "error"

    def _on_select(self, event) -> None:
        if self._syncing:
            return
        if event.new is not None and event.new != self.link:
            self.link_text.value = ""
            self.set_link(event.new)

    def _on_text(self, event) -> None:
        if event.new.strip():
            self.set_link(event.new)

    def _on_link(self, event) -> None:
        self._sync_select(event.new)
        self.predict()

    def _sync_select(self, link: str) -> None:
        """Show ``link`` in the selector: its preset, else a ``custom: ...`` entry."""
        options = {k: v for k, v in self.link_select.options.items() if not k.startswith(_CUSTOM)}
        if link not in options.values():
            options[_CUSTOM + link] = link
        self._syncing = True
        try:
            if options != self.link_select.options:
                self.link_select.options = options
            self.link_select.value = link
        finally:
            self._syncing = False

    # ------------------------------------------------------------------ predicting
    def predict(self) -> bool:
        """Predict the co-location of ``jobs`` copies of the current plan on ``link``; ``False`` on a mistake."""
        plan = self.state.plan
        if plan is None:
            return self._error("no plan is loaded; plan a data-parallel model first")
        if self.state.abstract:
            return self._error("co-location needs a model plan (real compute and all-reduce times); "
                               "plan a model with DP degree = devices")
        try:
            if self.link:
                plan = plan_on_link(plan, self.link)
                where = describe_link(parse_link(self.link))
            else:
                where = plan_link_text(plan)
            preds = compare_modes([plan] * self.jobs, steps=self.steps,
                                  names=[chr(ord("A") + i) for i in range(self.jobs)])
        except TesselError as e:
            return self._error(f"cannot co-locate this plan: {e}")
        self.view.param.update(predictions=preds, prediction=preds[self.view.mode], link=where)
        c, s = preds["crossover"], preds["sequential"]
        self.state.message_kind = "success"
        on = self.link or "the plan's own link"
        self.state.message = (f"co-location of {self.jobs} jobs on {on} predicted: crossover "
                              f"{c.aggregate_tokens_per_second:,.0f} tokens/s vs sequential "
                              f"{s.aggregate_tokens_per_second:,.0f} "
                              f"({c.aggregate_tokens_per_second / s.aggregate_tokens_per_second:.2f}x)")
        return True

    def _error(self, text: str) -> bool:
        self.state.message_kind = "error"
        self.state.message = text
        return False

    def __panel__(self):
        return pn.Column(self.note, pn.Row(pn.widgets.IntInput.from_param(self.param.jobs, width=120),
                                           pn.widgets.IntInput.from_param(self.param.steps, width=120),
                                           self.link_select, self.link_text, self.button, align="end"),
                         self.view, sizing_mode="stretch_width", css_classes=["tessel-colocate"])


__all__ = ["LINK_CHOICES", "ColocatePanel", "describe_link", "fmt_bits", "plan_link_text", "plan_on_link"]
