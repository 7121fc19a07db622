"""The planner's shared state: the current plan, its predicted timeline, edits and undo/redo.

Every view (graph, Gantt, compare, search, launch, export) reads and writes one
:class:`PlanState`. It is a ``param.Parameterized`` with no Bokeh or Panel objects inside, so
its logic is tested without a browser and it works the same in ``panel serve`` and Jupyter.

An edit moves one block within its device's order (a :class:`~engine.schedule.Schedule` is an
order per device, not fixed start times). The engine validates the edited schedule
(dependency, deadlock, memory: :func:`engine.schedule.validate.validate`); a valid edit is
applied and the timeline re-simulated (:func:`engine.plan.calibrate.resimulate`), an invalid one is
rejected and the message names the broken rule. Undo/redo keep the applied edits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import param

from engine.config import ModelRef, ParallelConfig
from engine.errors import ScheduleError, TesselError
from engine.io.plan import Plan
from engine.plan import resimulate
from engine.schedule import Schedule, parse_action
from engine.timeline import Timeline


@dataclass(frozen=True)
class EditResult:
    """Outcome of one edit.

    Attributes:
        ok: the edit was applied.
        message: what happened, for the user (the broken rule when rejected).
        rule: the violated rule (``"dependency"``, ``"deadlock"``, ``"memory"``, ``"device"``...)
            when rejected, else ``""``.
        seconds: wall-clock seconds spent validating and re-simulating.
    """

    ok: bool
    message: str
    rule: str = ""
    seconds: float = 0.0


def abstract_plan(schedule: Schedule, *, name: str | None = None, cost: dict | None = None) -> Plan:
    """Wrap a bare :class:`Schedule` (e.g. from a Tessel search on an abstract placement) in a
    :class:`Plan` so it can be viewed, edited, compared and exported like a planned model.

    The plan has no segments or model; with ``cost=None`` communication is free in simulation.
    """
    pl = schedule.placement
    return Plan(
        model=ModelRef.from_dict({"name": name or pl.name or "abstract"}),
        parallel=ParallelConfig.from_dict({"dp": 1, "tp": 1, "pp": pl.num_devices, "devices": pl.num_devices,
                                           "micro_batches": schedule.num_micro_batches, "virtual_stages": 1,
                                           "optimizer": "adam"}),
        segments=[],
        schedule=schedule,
        cost=dict(cost or {}),
        metrics={},
        meta={"abstract": True},
    )


class PlanState(param.Parameterized):
    """The plan shown by the planner, its predicted timeline and its edit history.

    Parameters (``param``; views ``param.watch`` them):
        plan: the current :class:`~engine.io.Plan`.
        timeline: the predicted :class:`~engine.timeline.Timeline` of ``plan`` (seconds, bytes).
        memory_limit: per-device memory limit in bytes (abstract units for abstract placements);
            ``None`` means no limit is enforced (the plan's ``memory_capacity`` is used when set).
        message: the last user-facing message (an applied edit, a rejection, a load error).
        message_kind: ``"info"``, ``"success"`` or ``"error"``.
        selected_segment: the segment selected in the graph view (``None``: none); the Gantt
            highlights its blocks.
        selected_block: the action string of the block selected in the Gantt (``"1B3"``) or ``""``.
        revision: increases on every change of ``plan`` (undo/redo included).
        measured: the measured Timeline of a launch of the current plan, or ``None``; cleared
            when the plan changes.
        graph: the captured ``engine.graph.OpGraph`` of the plan's model (``None`` for abstract
            placements); set by whoever captured it (``make_plan`` returns it).

    Raises (from methods): nothing for a rejected edit (see :class:`EditResult`);
    :class:`~engine.errors.TesselError` for a plan that cannot be simulated at load time.
    """

    plan = param.ClassSelector(class_=Plan, allow_None=True, doc="the current plan")
    timeline = param.ClassSelector(class_=Timeline, allow_None=True, doc="predicted timeline of the plan")
    memory_limit = param.Number(default=None, allow_None=True, bounds=(0, None), doc="per-device limit, bytes")
    message = param.String(default="", doc="last user-facing message")
    message_kind = param.Selector(default="info", objects=["info", "success", "error"])
    selected_segment = param.Integer(default=None, allow_None=True, doc="segment selected in the graph view")
    selected_block = param.String(default="", doc="block selected in the Gantt, e.g. '1B3'")
    revision = param.Integer(default=0, doc="bumped on every plan change")
    measured = param.ClassSelector(class_=Timeline, allow_None=True,
                                   doc="measured timeline of a launch of this plan (drawn over the prediction)")
    graph = param.Parameter(default=None, doc="the engine.graph.OpGraph of the plan's model, or None")

    def __init__(self, plan: Plan | None = None, **params):
        super().__init__(**params)
        self._undo: list[Plan] = []
        self._redo: list[Plan] = []
        if plan is not None:
            self.load(plan)

    # ------------------------------------------------------------------ loading
    def load(self, plan: Plan | Schedule, *, message: str | None = None, keep_history: bool = False,
             graph=None, timeline: Timeline | None = None) -> None:
        """Show ``plan`` (a Plan, or a bare Schedule wrapped with :func:`abstract_plan`).

        ``graph``: the model's OpGraph for the graph view (``None`` hides it).
        ``timeline``: ``resimulate(plan)`` when the caller already has it (a cached first plan);
        ``None``: the timeline is re-simulated from the plan's orders and cost model. The memory limit
        becomes the plan's ``metrics["memory_capacity"]`` when the plan states one.
        """
        if isinstance(plan, Schedule):
            plan = abstract_plan(plan)
        tl = timeline if timeline is not None else resimulate(plan)
        self.graph = graph
        if not keep_history:
            self._undo.clear()
            self._redo.clear()
        cap = plan.metrics.get("memory_capacity") if plan.metrics else None
        if plan.schedule.meta.get("memory_limit") is not None:
            cap = plan.schedule.meta["memory_limit"]
        with param.parameterized.batch_call_watchers(self):
            self.memory_limit = float(cap) if cap else None
            self._set(plan, tl)
            self.selected_block = ""
            self._say(message or f"loaded {plan.schedule.name} plan of {plan.model.name or '?'}: "
                      f"{plan.schedule.num_devices} devices x {plan.schedule.num_micro_batches} micro-batches", "info")

    def _set(self, plan: Plan, tl: Timeline) -> None:
        metrics = dict(plan.metrics)
        metrics.update(tl.metrics())
        plan = replace(plan, metrics=metrics)
        with param.parameterized.batch_call_watchers(self):
            self.plan = plan
            self.timeline = tl
            self.measured = None
            self.revision += 1

    def _say(self, text: str, kind: str) -> None:
        self.message_kind = kind
        self.message = text

    # ------------------------------------------------------------------ metrics
    @property
    def schedule(self) -> Schedule | None:
        """The current schedule (``None`` before a plan is loaded)."""
        return self.plan.schedule if self.plan is not None else None

    @property
    def abstract(self) -> bool:
        """The plan times are abstract units (a placement without a model), not seconds."""
        return bool(self.plan is not None and self.plan.meta.get("abstract"))

    @property
    def time_scale(self) -> tuple[float, str]:
        """``(factor, unit)`` to display times: ``(1e3, "ms")``, or ``(1, "units")`` when abstract."""
        return (1.0, "units") if self.abstract else (1e3, "ms")

    def fmt_time(self, seconds: float) -> str:
        """A time for display, e.g. ``"12.50 ms"`` or ``"34 units"``."""
        f, unit = self.time_scale
        return f"{seconds * f:.2f} {unit}" if unit == "ms" else f"{seconds:.4g} {unit}"

    def metrics(self) -> dict:
        """``makespan`` (s), ``bubble_ratio``, ``peak_memory`` (per device), ``memory_limit``."""
        if self.timeline is None:
            return {}
        m = self.timeline.metrics()
        m["memory_limit"] = self.memory_limit
        return m

    # ------------------------------------------------------------------ editing
    def position_of(self, device: int, block: str) -> int:
        """Index of ``block`` (action string) in ``device``'s order.

        Raises:
            ScheduleError: the block is not on that device (rule ``"device"``).
        """
        b = parse_action(block)
        order = self.schedule.orders[device]
        try:
            return order.index(b)
        except ValueError:
            pl = self.schedule.placement
            devs = list(pl.spec(b.kind, b.segment).devices) if pl.has(b.kind, b.segment) else []
            raise ScheduleError("device",
                                f"block {block} is not on device {device}; its placement runs it on device(s) {devs}",
                                device, block) from None

    def move_block(self, device: int, src: int, dst: int) -> EditResult:
        """Move the block at position ``src`` of ``device``'s order to position ``dst``.

        The edited schedule is validated (all rules, memory against ``memory_limit``); when
        valid it replaces the plan (undoable) and the timeline is re-simulated; otherwise the
        plan is unchanged and the result names the rule. Never raises for a bad edit.
        """
        t0 = time.perf_counter()
        if self.plan is None:
            return self._reject("no plan is loaded; plan a model or run a search first", "", t0)
        s = self.schedule
        if not 0 <= device < s.num_devices:
            return self._reject(f"device {device} does not exist; this plan has devices 0..{s.num_devices - 1}",
                                "device", t0)
        if src == dst:
            return EditResult(True, "nothing to move", "", time.perf_counter() - t0)
        try:
            moved = s.move(device, src, dst)
        except ScheduleError as e:
            return self._reject(str(e), e.rule, t0)
        blk = s.orders[device][src]
        # a multi-device block keeps its relative position on every device of its set
        moved.name = s.name if s.name.endswith("(edited)") else f"{s.name} (edited)"
        try:
            moved.validate(self.memory_limit)
            new_plan = replace(self.plan, schedule=moved)
            tl = resimulate(new_plan)
        except ScheduleError as e:
            return self._reject(f"cannot move {blk} on device {device}: {e}", e.rule, t0)
        except TesselError as e:
            return self._reject(f"cannot move {blk} on device {device}: {e}", "deadlock", t0)
        before = self.timeline.makespan if self.timeline is not None else None
        self._undo.append(self.plan)
        self._redo.clear()
        self._set(new_plan, tl)
        self.selected_block = str(blk)
        after = tl.makespan
        delta = "" if before is None else f"; makespan {self.fmt_time(before)} -> {self.fmt_time(after)}"
        self._say(f"moved {blk} on device {device} from position {src} to {dst}{delta}", "success")
        return EditResult(True, self.message, "", time.perf_counter() - t0)

    def move_block_named(self, block: str, device: int, dst: int) -> EditResult:
        """Move the block with action string ``block`` on ``device`` to position ``dst``."""
        t0 = time.perf_counter()
        try:
            src = self.position_of(device, block)
        except (ScheduleError, TesselError) as e:
            return self._reject(str(e), getattr(e, "rule", "device"), t0)
        return self.move_block(device, src, dst)

    def drop_block(self, block: str, device: int, x: float) -> EditResult:
        """A drag-and-drop edit: ``block`` dropped on ``device``'s row, centred at time ``x`` (seconds).

        A user lines blocks up by their left edges: when the dropped block's left edge
        ``x - width / 2`` (its width in the current timeline) lies within :data:`SNAP_FRACTION` of its
        width of another block's start, the block takes that block's place (before it when dragged
        left, after it when dragged right); otherwise it goes after every other block of the device
        that starts before ``x``. A drop that leaves the order as it was is reported in the
        message (``ok`` is ``False``, rule ``"position"``) instead of being silently put back.
        Dropping on a device outside the block's placement device set is rejected (the placement
        fixes where each block runs).
        """
        t0 = time.perf_counter()
        if self.plan is None:
            return self._reject("no plan is loaded", "", t0)
        try:
            b = parse_action(block)
        except TesselError as e:
            return self._reject(str(e), "device", t0)
        s = self.schedule
        if not s.placement.has(b.kind, b.segment):
            return self._reject(f"block {block} is not in this plan's placement", "device", t0)
        devs = list(s.placement.spec(b.kind, b.segment).devices)
        if device not in devs:
            return self._reject(f"cannot move {block} to device {device}: its placement runs it on device(s) {devs}; "
                                "change the placement to move it across devices", "device", t0)
        order = s.orders[device]
        src = order.index(b)
        dst = drop_position(block_spans(self.timeline, device), [str(o) for o in order], src, x)
        if dst == src:
            where = (f"between {order[src - 1]} and {order[src + 1]}" if 0 < src < len(order) - 1
                     else "first" if src == 0 else "last")
            text = (f"{block} stays at position {src} on device {device} ({where}): it was dropped where it already "
                    "runs; to move it, drop its left edge on the left edge of the block it should replace")
            self._say(text, "info")
            return EditResult(False, text, "position", time.perf_counter() - t0)
        return self.move_block(device, src, dst)

    def _reject(self, text: str, rule: str, t0: float) -> EditResult:
        self._say(text, "error")
        return EditResult(False, text, rule, time.perf_counter() - t0)

    # ------------------------------------------------------------------ history
    @property
    def can_undo(self) -> bool:
        return bool(self._undo)

    @property
    def can_redo(self) -> bool:
        return bool(self._redo)

    def undo(self) -> bool:
        """Revert the last applied edit; ``False`` when there is none."""
        if not self._undo:
            self._say("nothing to undo", "info")
            return False
        self._redo.append(self.plan)
        plan = self._undo.pop()
        self._set(plan, resimulate(plan))
        self._say(f"undone; makespan {self.fmt_time(self.timeline.makespan)}", "info")
        return True

    def redo(self) -> bool:
        """Re-apply the last undone edit; ``False`` when there is none."""
        if not self._redo:
            self._say("nothing to redo", "info")
            return False
        self._undo.append(self.plan)
        plan = self._redo.pop()
        self._set(plan, resimulate(plan))
        self._say(f"redone; makespan {self.fmt_time(self.timeline.makespan)}", "info")
        return True


def block_starts(timeline: Timeline | None, device: int) -> dict[str, float]:
    """``{action string: start seconds}`` of the compute blocks on ``device`` in ``timeline``."""
    if timeline is None:
        return {}
    return {e.name: e.start for e in timeline.events
            if e.rank == device and e.stream == "compute" and e.op in ("F", "B", "I", "W")}


#: A drop snaps to another block's place when the dropped left edge is within this fraction of
#: the dropped block's width of that block's start.
SNAP_FRACTION = 0.35


def block_spans(timeline: Timeline | None, device: int) -> dict[str, tuple[float, float]]:
    """``{action string: (start, end) seconds}`` of the compute blocks on ``device`` in ``timeline``."""
    if timeline is None:
        return {}
    return {e.name: (e.start, e.end) for e in timeline.events
            if e.rank == device and e.stream == "compute" and e.op in ("F", "B", "I", "W")}


def drop_position(spans: dict[str, tuple[float, float]], order: list[str], src: int, x: float) -> int:
    """The new position of ``order[src]`` dropped centred at ``x`` seconds (see :meth:`PlanState.drop_block`).

    Args:
        spans: ``{block: (start, end)}`` seconds on the device (:func:`block_spans`).
        order: the device's order as action strings; ``src``: the dropped block's index in it.
        x: the dropped block's centre, seconds.

    Returns the destination index for :meth:`engine.schedule.Schedule.move` (``src`` when the order
    would not change).
    """
    start, end = spans.get(order[src], (x, x))
    width = max(end - start, 0.0)
    left = x - width / 2
    tol = SNAP_FRACTION * width
    near = [(abs(spans[o][0] - left), pos) for pos, o in enumerate(order) if pos != src and o in spans]
    if near and width > 0:
        dist, pos = min(near)
        if dist <= tol:
            return pos
    return sum(1 for pos, o in enumerate(order) if pos != src and o in spans and spans[o][0] < x)


__all__ = ["PlanState", "EditResult", "abstract_plan", "block_starts", "block_spans", "drop_position", "SNAP_FRACTION"]
