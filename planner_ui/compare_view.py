"""Compare view: several plans side by side (makespan, bubble, peak memory per device, a chart).

Entries are named ``(Plan, Timeline)`` pairs: the current plan ("Add current plan"), the
predefined schedules of the same model or placement ("Add baselines": GPipe, 1F1B, interleaved
1F1B and ZB-H1 where they apply), or anything added from code with :meth:`CompareView.add`
(e.g. a Tessel search result). :meth:`CompareView.rows` is the table's data (plain dicts; what
the tests check); a Panel ``Tabulator`` shows it and two Bokeh bar charts draw the makespan per
plan and the peak memory per device, grouped by device.

Units: seconds and bytes inside; the table shows ms and GiB for model plans and "units" for
abstract placements (Tessel's F=1, B=2 and one activation per segment).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import panel as pn
import param
from bokeh.models import ColumnDataSource, FactorRange, HoverTool
from bokeh.plotting import figure

from engine.cost import CostModel
from engine.errors import TesselError
from engine.io.plan import Plan
from engine.plan import resimulate
from engine.plan.compare import compare_baselines
from engine.plan.make import make_plan
from engine.schedule import Schedule
from engine.timeline import Timeline
from planner_ui.background import bokeh_safe
from planner_ui.search_panel import abstract_v_variant
from planner_ui.sources import PALETTE
from planner_ui.state import PlanState, abstract_plan

_GIB = 2**30
#: Baseline schedules of a model plan, re-planned with :func:`engine.plan.make.make_plan`.
MODEL_BASELINES = ("gpipe", "1f1b", "interleaved", "zb-h1")


@dataclass
class CompareEntry:
    """One compared plan: the plan and its predicted timeline (seconds, bytes)."""

    name: str
    plan: Plan
    timeline: Timeline

    @property
    def abstract(self) -> bool:
        return bool(self.plan.meta.get("abstract"))

    @property
    def time_unit(self) -> tuple[float, str]:
        return (1.0, "units") if self.abstract else (1e3, "ms")

    @property
    def mem_unit(self) -> tuple[float, str]:
        return (1.0, "units") if self.abstract else (float(_GIB), "GiB")


#: What the Compare tab says while it has no entries (hidden once a plan is added).
EMPTY_HINT = ("**Nothing to compare yet.** Press **Add current plan** to add the plan shown on the Schedule tab, "
              "then **Add baselines** to add GPipe, 1F1B, interleaved 1F1B and ZB-H1 of the same model (or, for an "
              "abstract placement, its predefined schedules); edit or search a plan and add it again to compare "
              "the versions. Select a row and press **Show selected** to open it on the Schedule tab.")


class CompareView(pn.viewable.Viewer):
    """Plans side by side: a table (makespan, bubble ratio, peak memory, speedup) and bar charts.

    Construct with ``CompareView(state=state)``.

    Methods: :meth:`add` (``name``, a Plan or a bare Schedule), :meth:`add_current`,
    :meth:`add_baselines`, :meth:`remove`, :meth:`clear`, :meth:`rows`, :meth:`show` (load an
    entry into the state). The speedup column is relative to the ``1f1b`` entry when there is one
    (same units), else to the slowest plan of the same units.

    Bokeh data: ``makespan_source`` (one bar per plan: ``name``, ``makespan``, ``unit``, ``color``)
    and ``memory_source`` (one bar per plan and device: ``x`` = ``(device, plan)``, ``peak``).
    """

    state = param.ClassSelector(class_=PlanState, doc="the shared planner state")
    revision = param.Integer(default=0, doc="bumped whenever the entries change")

    def __init__(self, **params):
        super().__init__(**params)
        if self.state is None:
            self.state = PlanState()
        self.entries: dict[str, CompareEntry] = {}
        self.makespan_source = ColumnDataSource(data={"name": [], "makespan": [], "label": [], "unit": [], "color": []})
        self.memory_source = ColumnDataSource(data={k: [] for k in ("x", "plan", "device", "peak", "label", "color")})
        self._build()

    # ------------------------------------------------------------------ data
    def add(self, name: str | None, plan_or_schedule: Plan | Schedule, timeline: Timeline | None = None) -> str:
        """Add (or replace) an entry; returns its name.

        Args:
            name: table name (``None``: the schedule's name).
            plan_or_schedule: a Plan, or a bare Schedule (wrapped as an abstract plan).
            timeline: its predicted timeline, if already known (else it is re-simulated).

        Raises:
            TesselError: the plan cannot be simulated (e.g. a deadlocked order).
        """
        plan = abstract_plan(plan_or_schedule) if isinstance(plan_or_schedule, Schedule) else plan_or_schedule
        if timeline is None:
            timeline = resimulate(plan)
        name = str(name or plan.schedule.name or f"plan {len(self.entries) + 1}")
        self.entries[name] = CompareEntry(name, plan, timeline)
        self._changed()
        return name

    def remove(self, name: str) -> bool:
        """Remove the entry ``name``; ``False`` when there is none."""
        if self.entries.pop(name, None) is None:
            return False
        self._changed()
        return True

    def clear(self) -> None:
        """Remove every entry."""
        self.entries.clear()
        self._changed()

    def add_current(self, name: str | None = None) -> str | None:
        """Add the state's current plan (its predicted timeline); ``None`` + message when none."""
        if self.state.plan is None:
            self._say("no plan is loaded; plan a model or run a search first", "error")
            return None
        plan = self.state.plan
        name = name or plan.schedule.name
        self.add(name, plan, self.state.timeline)
        self._say(f"added {name} to the comparison", "info")
        return name

    def add_baselines(self) -> list[str]:
        """Add the predefined schedules of the current plan's model or placement.

        A model plan is re-planned with :func:`engine.plan.make.make_plan` (same model, devices,
        DP/TP, micro-batches, micro-batch size, sequence length, dtype and cost model) for each of
        GPipe, 1F1B, interleaved 1F1B and ZB-H1. An abstract plan gets
        :func:`engine.plan.compare.compare_baselines` on its placement (GPipe and 1F1B on any
        placement; ZB-H1 on the plain V). Schedules that do not apply are listed in the message.
        Returns the names added.
        """
        plan = self.state.plan
        if plan is None:
            self._say("no plan is loaded; plan a model or run a search first", "error")
            return []
        if plan.meta.get("abstract") or not plan.segments:
            added, skipped = self._abstract_baselines(plan)
        else:
            added, skipped = self._model_baselines(plan)
        text = f"added {', '.join(added) or 'no baselines'} to the comparison"
        if skipped:
            text += "; not applicable: " + "; ".join(skipped)
        self._say(text, "info" if added else "error")
        return added

    def _abstract_baselines(self, plan: Plan) -> tuple[list[str], list[str]]:
        cost = CostModel.from_dict(plan.cost) if plan.cost else None
        pl = plan.placement
        rows = compare_baselines(pl, plan.schedule.num_micro_batches, memory_limit=self.state.memory_limit, cost=cost,
                                 variant=abstract_v_variant(pl))
        added, skipped = [], []
        for r in rows:
            if r.schedule is None:
                skipped.append(f"{r.name} ({r.note})")
                continue
            p = abstract_plan(r.schedule, name=plan.model.name, cost=plan.cost)
            added.append(self.add(r.name, p))
        return added, skipped

    def _model_baselines(self, plan: Plan) -> tuple[list[str], list[str]]:
        par, model = plan.parallel, plan.model
        cost = CostModel.from_dict(plan.cost) if plan.cost else None
        cap = plan.metrics.get("memory_capacity")
        limit = cap if cap and cost is not None and cap != cost.device.mem_capacity else None
        added, skipped = [], []
        for sched in MODEL_BASELINES:
            try:
                res = make_plan(
                    model.name, devices=par.devices,
                    micro_batches=par.micro_batches, schedule=sched,
                    dp=par.dp, tp=par.tp,
                    micro_batch_size=model.micro_batch_size, seq_len=model.seq_len,
                    precision=par.precision, recompute=par.recompute, memory_limit=limit, cost=cost,
                )
            except (TesselError, ValueError) as e:
                skipped.append(f"{sched} ({e})")
                continue
            except Exception as e:  # noqa: BLE001 - a model that cannot be rebuilt from its name (user code)
                skipped.append(f"{sched} ({type(e).__name__}: {e})")
                continue
            added.append(self.add(sched, res.plan, res.timeline))
        return added, skipped

    def rows(self) -> list[dict]:
        """One dict per entry (insertion order), display units:

        ``name``, ``schedule``, ``devices``, ``micro_batches``, ``makespan`` (ms or units),
        ``time_unit``, ``makespan_s`` (seconds / units, raw), ``bubble_pct`` (%),
        ``peak_memory`` (max over devices, GiB or units), ``mem_unit``, ``peak_per_device``
        (list, display units), ``peak_bytes`` (list, raw), ``speedup`` (reference makespan /
        makespan), ``reference`` (the reference entry's name).
        """
        entries = list(self.entries.values())
        refs: dict[str, CompareEntry] = {}
        for unit in {e.time_unit[1] for e in entries}:
            same = [e for e in entries if e.time_unit[1] == unit]
            one = [e for e in same if e.name == "1f1b"] or [e for e in same if e.plan.schedule.name == "1f1b"]
            refs[unit] = one[0] if one else max(same, key=lambda e: e.timeline.makespan)
        out = []
        for e in entries:
            tf, tu = e.time_unit
            mf, mu = e.mem_unit
            tl = e.timeline
            peaks = [float(p) for p in tl.peak_memory()]
            ref = refs[tu]
            out.append({
                "name": e.name,
                "schedule": e.plan.schedule.name,
                "devices": e.plan.schedule.num_devices,
                "micro_batches": e.plan.schedule.num_micro_batches,
                "makespan": tl.makespan * tf,
                "time_unit": tu,
                "makespan_s": tl.makespan,
                "bubble_pct": 100.0 * tl.bubble_ratio(),
                "peak_memory": max(peaks) / mf if peaks else 0.0,
                "mem_unit": mu,
                "peak_per_device": [p / mf for p in peaks],
                "peak_bytes": peaks,
                "speedup": ref.timeline.makespan / tl.makespan if tl.makespan > 0 else float("nan"),
                "reference": ref.name,
            })
        return out

    def show(self, name: str) -> bool:
        """Load entry ``name`` into the state (the Gantt and the other views follow)."""
        e = self.entries.get(name)
        if e is None:
            self._say(f"no plan named {name!r} in the comparison", "error")
            return False
        try:
            self.state.load(e.plan, message=f"showing {name} from the comparison")
        except TesselError as err:
            self._say(f"cannot show {name}: {err}", "error")
            return False
        return True

    # ------------------------------------------------------------------ views
    def chart_data(self) -> tuple[dict, dict]:
        """``(makespan columns, memory columns)`` for the two bar charts (display units)."""
        rows = self.rows()
        colors = {r["name"]: PALETTE[i % len(PALETTE)] for i, r in enumerate(rows)}
        mk = {"name": [r["name"] for r in rows], "makespan": [r["makespan"] for r in rows],
              "label": [f"{r['makespan']:.4g} {r['time_unit']}" for r in rows],
              "unit": [r["time_unit"] for r in rows], "color": [colors[r["name"]] for r in rows]}
        mem = {k: [] for k in ("x", "plan", "device", "peak", "label", "color")}
        ndev = max((len(r["peak_per_device"]) for r in rows), default=0)
        for d in range(ndev):
            for r in rows:
                if d < len(r["peak_per_device"]):
                    v = r["peak_per_device"][d]
                    mem["x"].append((f"device {d}", r["name"]))
                    mem["plan"].append(r["name"])
                    mem["device"].append(d)
                    mem["peak"].append(v)
                    mem["label"].append(f"{v:.4g} {r['mem_unit']}")
                    mem["color"].append(colors[r["name"]])
        return mk, mem

    def _build(self) -> None:
        self.makespan_fig = figure(x_range=FactorRange(), height=220, sizing_mode="stretch_width",
                                   title="makespan per plan", toolbar_location=None)
        self.makespan_fig.vbar(x="name", top="makespan", width=0.7, color="color", source=self.makespan_source)
        self.makespan_fig.add_tools(HoverTool(tooltips=[("plan", "@name"), ("makespan", "@label")]))
        self.makespan_fig.y_range.start = 0
        self.memory_fig = figure(x_range=FactorRange(), height=220, sizing_mode="stretch_width",
                                 title="peak memory per device", toolbar_location=None)
        self.memory_fig.vbar(x="x", top="peak", width=0.8, color="color", source=self.memory_source)
        self.memory_fig.add_tools(HoverTool(tooltips=[("plan", "@plan"), ("device", "@device"), ("peak", "@label")]))
        self.memory_fig.y_range.start = 0
        self.memory_fig.xaxis.major_label_orientation = 0.8
        self.table = pn.widgets.Tabulator(self._frame(), disabled=True, selectable=1, show_index=False,
                                          sizing_mode="stretch_width", css_classes=["tessel-compare-table"])
        self.add_button = pn.widgets.Button(label="Add current plan", css_classes=["tessel-compare-add"])
        self.baselines_button = pn.widgets.Button(label="Add baselines", css_classes=["tessel-compare-baselines"])
        self.show_button = pn.widgets.Button(label="Show selected", css_classes=["tessel-compare-show"])
        self.remove_button = pn.widgets.Button(label="Remove selected", css_classes=["tessel-compare-remove"])
        self.clear_button = pn.widgets.Button(label="Clear", css_classes=["tessel-compare-clear"])
        self.add_button.on_click(lambda _e: self.add_current())
        self.baselines_button.on_click(lambda _e: self.add_baselines())
        self.show_button.on_click(lambda _e: self._on_selected(self.show))
        self.remove_button.on_click(lambda _e: self._on_selected(self.remove))
        self.clear_button.on_click(lambda _e: self.clear())
        self.hint = pn.pane.Markdown(EMPTY_HINT, css_classes=["tessel-compare-hint"], sizing_mode="stretch_width")
        self.makespan_pane = pn.pane.Bokeh(self.makespan_fig, css_classes=["tessel-compare-chart"])
        self.memory_pane = pn.pane.Bokeh(self.memory_fig, css_classes=["tessel-compare-memory-chart"])

    def _frame(self) -> pd.DataFrame:
        """The table shown: one row per plan, numbers rounded, units in the headers when all
        plans share them (ms/GiB for model plans, units for abstract ones)."""
        rows = self.rows()
        tu = {r["time_unit"] for r in rows}
        mu = {r["mem_unit"] for r in rows}
        t_col = f"makespan ({tu.pop()})" if len(tu) == 1 else "makespan"
        m_col = f"peak memory ({mu.pop()})" if len(mu) == 1 else "peak memory"
        ref = rows[0]["reference"] if rows else "1f1b"
        return pd.DataFrame({
            "name": [r["name"] for r in rows],
            "schedule": [r["schedule"] for r in rows],
            t_col: [round(r["makespan"], 3) for r in rows],
            "bubble (%)": [round(r["bubble_pct"], 1) for r in rows],
            m_col: [round(r["peak_memory"], 3) for r in rows],
            "peak per device": [" / ".join(f"{v:.3g}" for v in r["peak_per_device"]) for r in rows],
            f"speedup vs {ref}": [round(r["speedup"], 3) for r in rows],
        })

    @bokeh_safe
    def _changed(self) -> None:
        mk, mem = self.chart_data()
        self.makespan_fig.x_range.factors = list(mk["name"])
        self.memory_fig.x_range.factors = list(mem["x"])
        self.makespan_source.data = mk
        self.memory_source.data = mem
        units = sorted(set(mk["unit"]))
        self.makespan_fig.yaxis.axis_label = " / ".join(units)
        self.table.value = self._frame()
        self.hint.visible = not self.entries
        self.revision += 1

    def _on_selected(self, action) -> None:
        sel = self.table.selection
        if not sel:
            self._say("select a row of the comparison table first", "info")
            return
        names = list(self.entries)
        if sel[0] < len(names):
            action(names[sel[0]])

    def _say(self, text: str, kind: str) -> None:
        self.state.message_kind = kind
        self.state.message = text

    def __panel__(self):
        return pn.Column(
            pn.Row(self.add_button, self.baselines_button, self.show_button, self.remove_button, self.clear_button),
            self.hint, self.table,
            pn.Row(self.makespan_pane, self.memory_pane, sizing_mode="stretch_width"),
            css_classes=["tessel-compare-view"], sizing_mode="stretch_width",
        )


__all__ = ["MODEL_BASELINES", "CompareEntry", "CompareView", "EMPTY_HINT"]
