"""Search panel: run a Tessel schedule search with live progress and cancel, without freezing the page.

What is searched depends on the plan loaded in :class:`~planner_ui.state.PlanState`:

* a model plan (``state.plan`` with a model and segments, not an abstract placement): the
  Tessel shapes of THIS model (:func:`model_shape_options`: V, X, M, NN and interleaved for a
  decoder LM, K only for a two-branch model such as ``two-tower-tiny``) on ``devices`` devices,
  with the memory limit in GiB. The search is
  :func:`engine.plan.model_search.model_search_plan` (capture, the shape's placement with the model's
  costs from the plan's own cost model, the Tessel search) and its result, a launchable plan of
  the same model (name, micro-batch size, sequence length, task), replaces the loaded plan: the
  Model graph tab keeps its graph, the Gantt shows the searched schedule, the Launch tab trains it;
* an abstract placement, no plan, or the ``abstract_units`` box ticked: a shape
  ``v``/``x``/``m``/``nn``/``k``/``interleaved`` in abstract units (:func:`engine.shapes.make_shape`),
  loaded as an abstract plan;
* either way, :data:`CURRENT`: the loaded plan's own placement, re-scheduled.

Every searched schedule becomes a plan through :func:`engine.plan.from_search.plan_from_search`,
the function ``tessel search`` uses, with the search options ``tessel search`` uses (the 1F1B
policy's schedule kept where it is shorter), so the app and the CLI save the same plan for the
same search. The memory limit is checked as ``--memory-limit`` is
(:func:`engine.plan.limits.check_memory_limit`: a finite number above 0).

The user picks the placement, the micro-batches, an optional per-device memory limit, a time
limit and a seed, and presses Run. The search then runs in a daemon ``threading.Thread`` and can
be stopped with Cancel (:class:`engine.tessel.SearchControl`); the best schedule found so far is
kept.

Threads and Panel. Bokeh/Panel models must only be changed while holding the session's document
lock, i.e. on the server's event loop (``panel serve``) or the kernel's loop (Jupyter). So the
search thread writes only plain Python attributes (the last :class:`~engine.tessel.SearchProgress`
and, at the end, the outcome); a Panel periodic callback (``pn.state.add_periodic_callback``,
run on the session's loop, see https://panel.holoviz.org/how_to/callbacks/periodic.html and
https://panel.holoviz.org/how_to/concurrency/manual_threading.html) reads them and updates the
widgets, and at the end loads the result into :class:`~planner_ui.state.PlanState`. Without an
event loop (pytest, scripts) nothing polls: :meth:`SearchPanel.run_search` (``wait=True``) joins
the thread and applies the outcome in the calling thread, and :meth:`SearchPanel.poll` applies
whatever has arrived.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import replace
from typing import Any, cast

import panel as pn
import param

from engine.cost import CostModel
from engine.errors import TesselError
from engine.plan import (
    ScheduleMetrics,
    check_memory_limit,
    compare_baselines,
    measure,
    plan_from_search,
    resimulate,
)
from engine.plan.model_search import model_search_plan
from engine.shape_costs import model_shape_placement
from engine.shapes import SHAPES, make_shape, shape_names
from engine.tessel import (
    InfeasibleMemoryError,
    SearchCancelled,
    SearchControl,
    SearchProgress,
    SearchResult,
    tessel_search,
)
from engine.tp_plan import parse_tp_plan
from planner_ui.background import bokeh_safe
from planner_ui.state import PlanState

#: Option of the placement selector meaning "the placement of the plan now loaded".
CURRENT = "current plan's placement"
_GIB = 2**30


def is_model_plan(plan) -> bool:
    """Whether ``plan`` is a plan of a model (a model name and segments), not an abstract placement."""
    return bool(plan is not None and not plan.meta.get("abstract") and plan.segments and plan.model.name)


def _plan_graph(plan, graph):
    """``graph`` when it is the operator graph of ``plan``'s model (it holds every layer the plan's
    segments name), else ``None`` (e.g. the graph of another model left by an import)."""
    if graph is None or not hasattr(graph, "layers"):
        return None
    named = {layer for seg in plan.segments for layer in seg.get("layers", [])}
    return graph if named and named <= set(graph.layers()) else None


def model_shape_options(plan, graph, devices: int) -> tuple[list[str], dict[str, str]]:
    """The Tessel shapes a model plan can be searched on with ``devices`` devices.

    Args:
        plan: a model plan (:func:`is_model_plan`); its cost model prices the placements.
        graph: the model's captured :class:`~engine.graph.OpGraph` (``state.graph``), or ``None``.
        devices: devices of the searched placement.

    Returns:
        ``(offered, refused)``: the shape names (in :data:`engine.shapes.SHAPES` order) whose
        placement :func:`engine.shape_costs.model_shape_placement` builds from the model's layers,
        and ``{shape: one-sentence reason}`` for the others (K on a model without two branches,
        too few layers for the shape on that many devices). Without the model's graph every shape
        is offered and the search itself refuses a shape the model cannot fill, in one sentence.
        Cheap (milliseconds): no capture, no search.
    """
    graph = _plan_graph(plan, graph)
    if graph is None:
        return list(SHAPES), {}
    cost = CostModel.from_dict(plan.cost) if plan.cost else CostModel.for_device("h100")
    offered: list[str] = []
    refused: dict[str, str] = {}
    for name in SHAPES:
        try:
            model_shape_placement(graph, cost, name, int(devices))
        except (TesselError, ValueError) as e:
            refused[name] = str(e)
        else:
            offered.append(name)
    return offered, refused


class _Job:
    """What one search needs, prepared (and validated) on the UI thread."""

    def __init__(self, placement, m, limit, time_limit, seed, *, base_plan, cost, variant, abstract, max_window=3,
                 model_shape=None, devices=None, current=None, tp_plan=None):
        self.placement = placement        # the searched placement (None until a model shape's search builds it)
        self.m = m
        self.limit = limit                # in the placement's internal units (bytes or units)
        self.time_limit = time_limit
        self.seed = seed
        self.max_window = max_window      # most micro-batches per repetend window
        self.base_plan = base_plan        # the model plan whose placement (or model) is searched, else None
        self.cost = cost                  # engine CostModel for simulation (None: free communication)
        self.variant = variant            # compare_baselines' variant for V placements, or None
        self.abstract = abstract
        self.model_shape = model_shape    # a shape of base_plan's model (model_search_plan), else None
        self.devices = devices            # devices of the model shape
        self.current = current            # the loaded plan whose own placement is searched (CURRENT), else None
        self.tp_plan = tp_plan            # the user's tensor-parallel plan for the all-device blocks, else None
        self.time_factor, self.time_unit = (1.0, "units") if abstract else (1e3, "ms")
        self.mem_factor, self.mem_unit = (1.0, "units") if abstract else (float(_GIB), "GiB")

    @property
    def label(self) -> str:
        """What is searched, for the progress line (e.g. ``the M shape of llama-tiny on 2 devices``)."""
        if self.model_shape is not None:
            return f"the {self.model_shape.upper()} shape of {self.base_plan.model.name} on {self.devices} devices"
        return f"{self.placement.name} on {self.placement.num_devices} devices"

    def t(self, seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * self.time_factor:.4g} {self.time_unit}"

    def mem(self, x: float | None) -> str:
        return "-" if x is None else f"{x / self.mem_factor:.4g} {self.mem_unit}"


class SearchPanel(pn.viewable.Viewer):
    """Tessel search with a live progress indicator and cancel.

    Construct with ``SearchPanel(state=state)``. Inputs are parameters (settable from code, shown
    as widgets): ``shape``, ``devices``, ``micro_batches``, ``memory_limit`` (``None`` = no limit;
    GiB for a model plan, abstract units otherwise), ``time_limit`` (s), ``seed``, ``max_window``,
    ``abstract_units``.

    With a model plan loaded, ``shape`` offers the shapes of that model on ``devices`` devices
    (:attr:`offered_shapes`; :attr:`refused_shapes` says why the others are not, also shown under
    the inputs) and :data:`CURRENT`; ``devices`` and ``micro_batches`` start from the plan's. With
    no plan, an abstract plan, or ``abstract_units`` ticked, it offers every shape in abstract units
    (and :data:`CURRENT` when a plan is loaded).

    Methods: :meth:`start` (background search), :meth:`cancel`, :meth:`run_search` (``wait=True``:
    synchronous, for tests and notebooks), :meth:`poll` (apply progress/outcome that arrived).

    Outputs: :attr:`result` (the last :class:`~engine.tessel.SearchResult`), :attr:`baselines`
    (``ScheduleMetrics`` of GPipe/1F1B/... on the same placement), :attr:`searched_plan` (the
    plan a model shape's search loaded, else ``None``), ``progress_text``, ``result_text``,
    ``running``. The searched schedule is loaded into ``state`` as
    :func:`engine.plan.from_search.plan_from_search` makes it: the model's searched plan for a
    model shape (``engine.plan.model_search.model_search_plan``), an abstract plan for an abstract
    shape, the loaded plan with the new schedule for the current plan's placement. Errors (an infeasible
    memory limit, bad devices, a shape the model cannot fill, ...) go to ``state.message`` with
    kind ``"error"`` and leave the plan unchanged.
    """

    state = param.ClassSelector(class_=PlanState, doc="the shared planner state")
    shape: param.Selector = param.Selector(default="m", objects=shape_names() + [CURRENT],
                           doc="placement shape (of the loaded model, or abstract), or the current plan's")
    devices = param.Integer(default=4, bounds=(1, 1024),
                            doc="devices of the shape (ignored for the current plan's placement)")
    micro_batches = param.Integer(default=8, bounds=(1, 100000), doc="micro-batches per step")
    memory_limit = param.Number(default=None, allow_None=True, bounds=(0, None),
                                doc="per-device limit: GiB (a model plan) or abstract units; None = no limit")
    time_limit = param.Number(default=10.0, bounds=(0.1, 3600), doc="search time limit, seconds")
    seed = param.Integer(default=0, bounds=(0, None), doc="CP-SAT seed")
    tp_plan = param.String(default="", doc="a model shape's tensor-parallel plan for its all-device blocks (M, NN, "
                                           "X) as JSON in transformers' base_model_tp_plan format (engine.tp_plan); "
                                           "blank: the model's own")
    max_window = param.Integer(default=3, bounds=(1, 8),
                               doc="most micro-batches per repetend window the search refines (the 1F1B policy's "
                                   "steady state, up to 3, always competes); 3-4 can shorten the period on M-like "
                                   "shapes but need a longer time limit (about 60 s)")
    abstract_units = param.Boolean(default=False,
                                   doc="search the shape in abstract units (no model) even when a model plan is "
                                       "loaded; the result then replaces the model plan with an abstract one")

    running = param.Boolean(default=False, doc="a search is running")
    progress_text = param.String(default="", doc="best period so far vs lower bound, elapsed time")
    progress_value = param.Integer(default=0, doc="progress bar value, 0..100 (-1: indeterminate)")
    result_text = param.String(default="", doc="Markdown summary of the last search and the baselines")
    shape_note = param.String(default="", doc="which shapes the loaded model offers and why not the others")

    poll_period_ms = param.Integer(default=250, bounds=(20, None), doc="how often the UI polls a running search")

    def __init__(self, **params):
        super().__init__(**params)
        if self.state is None:
            self.state = PlanState()
        self.result: SearchResult | None = None
        self.baselines: list[ScheduleMetrics] = []
        self.tessel_metrics: ScheduleMetrics | None = None
        self.searched_plan = None
        self.offered_shapes: list[str] = shape_names()
        self.refused_shapes: dict[str, str] = {}
        # written by the search thread (plain attributes only), read by poll()
        self._progress: SearchProgress | None = None
        self._outcome: tuple | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._control: SearchControl | None = None
        self._job: _Job | None = None
        self._t0 = 0.0
        self._finish_lock = threading.Lock()
        self._periodic = None
        self._plan_key: tuple | None = None
        self._options_cache: tuple | None = None  # (graph, cost dict, model name, devices, offered, refused)
        self._build()
        # a model plan already loaded: start from its devices and micro-batches unless given here
        self._on_plan(keep=set(params) & {"devices", "micro_batches", "abstract_units"})
        self._st.param.watch(lambda *_: self._on_plan(), "plan")
        self.param.watch(lambda *_: self._update_shape_options(), ["devices", "abstract_units"])

    # ------------------------------------------------------------------ widgets
    def _build(self) -> None:
        w = pn.widgets
        self.shape_input = w.Select.from_param(self.param.shape, name="Placement", css_classes=["tessel-search-shape"])
        self.devices_input = w.IntInput.from_param(self.param.devices, name="Devices",
                                                   css_classes=["tessel-search-devices"])
        self.mb_input = w.IntInput.from_param(self.param.micro_batches, name="Micro-batches",
                                              css_classes=["tessel-search-micro-batches"])
        self.memory_input = w.FloatInput.from_param(self.param.memory_limit, name="Memory limit (blank: none)",
                                                    css_classes=["tessel-search-memory"])
        self.time_input = w.FloatInput.from_param(self.param.time_limit, name="Time limit (s)",
                                                  css_classes=["tessel-search-time"])
        self.seed_input = w.IntInput.from_param(self.param.seed, name="Seed", css_classes=["tessel-search-seed"])
        self.window_input = w.IntInput.from_param(self.param.max_window, name="Window micro-batches (refined up to)",
                                                  css_classes=["tessel-search-window"])
        self.units_input = w.Checkbox.from_param(self.param.abstract_units, name="Abstract units (no model)",
                                                 css_classes=["tessel-search-units"])
        self.tp_plan_input = w.TextAreaInput.from_param(
            self.param.tp_plan, name="Tensor-parallel plan (JSON; blank: the model's own)", height=70,
            placeholder='{"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}',
            sizing_mode="stretch_width", css_classes=["tessel-search-tp-plan"])
        self.run_button = w.Button(label="Run Tessel", color="primary", css_classes=["tessel-search-run"])
        self.cancel_button = w.Button(label="Cancel", color="warning", disabled=True,
                                      css_classes=["tessel-search-cancel"])
        self.run_button.on_click(lambda _e: None if self.start() else None)
        self.cancel_button.on_click(lambda _e: None if self.cancel() else None)
        self.progress_bar = pn.indicators.Progress(value=0, max=100, active=False, sizing_mode="stretch_width",
                                                   css_classes=["tessel-search-progress-bar"])
        self.note_pane = pn.pane.Markdown(self.shape_note, css_classes=["tessel-search-note"])
        self.progress_pane = pn.pane.Markdown(self.progress_text, css_classes=["tessel-search-progress"])
        self.result_pane = pn.pane.Markdown(self.result_text, css_classes=["tessel-search-result"])
        self.param.watch(self._sync_widgets, ["running", "progress_text", "progress_value", "result_text",
                                              "shape_note"])
        self.param.watch(self._on_shape, ["shape"])

    @property
    def last_progress(self) -> SearchProgress | None:
        """The last :class:`~engine.tessel.SearchProgress` the running (or last) search reported
        (best period and lower bound in seconds or units), ``None`` before its first report."""
        return self._progress

    @property
    def _st(self) -> PlanState:
        """``state``, typed (it is set in ``__init__``)."""
        return cast(PlanState, self.state)

    @property
    def model_mode(self) -> bool:
        """A shape searches the loaded model's placement (a model plan is loaded and
        ``abstract_units`` is off); otherwise shapes are abstract."""
        return is_model_plan(self._st.plan) and not self.abstract_units

    @property
    def memory_unit(self) -> str:
        """Unit of ``memory_limit``: ``"GiB"`` when a model is searched (a model shape, or the
        current placement of a model plan), else ``"units"``."""
        if not is_model_plan(self._st.plan):
            return "units"
        return "GiB" if self.shape == CURRENT or not self.abstract_units else "units"

    def _on_plan(self, keep: set[str] | frozenset[str] = frozenset()) -> None:
        """A new plan: a new model plan's shapes are searched from its devices and micro-batches
        (except the parameters in ``keep``); refresh the shapes."""
        plan: Any = self._st.plan
        key = (plan.model.name, plan.parallel.devices) if is_model_plan(plan) else None
        if key is not None and key != self._plan_key:
            start = {"devices": max(1, int(plan.parallel.devices)),
                     "micro_batches": int(plan.schedule.num_micro_batches), "abstract_units": False}
            self.param.update(**{k: v for k, v in start.items() if k not in keep})
        self._plan_key = key
        self._update_shape_options()

    def _on_shape(self, event) -> None:
        sched = self._st.schedule
        if event.new == CURRENT and sched is not None:
            self.micro_batches = sched.num_micro_batches  # start from the plan's m
        self._sync_units()

    def _sync_units(self) -> None:
        self.memory_input.name = f"Memory limit ({self.memory_unit}; blank: none)"
        self.devices_input.disabled = self.shape == CURRENT
        self.units_input.disabled = not is_model_plan(self._st.plan)

    def _sync_widgets(self, *_events) -> None:
        self.run_button.disabled = self.running
        self.cancel_button.disabled = not self.running
        self.progress_bar.active = self.running and self.progress_value < 0
        self.progress_bar.value = max(-1, min(100, self.progress_value))
        self.progress_pane.object = self.progress_text
        self.result_pane.object = self.result_text
        self.note_pane.object = self.shape_note

    def _update_shape_options(self) -> None:
        plan: Any = self._st.plan
        if self.model_mode:
            graph, devices, c = self._st.graph, int(self.devices), self._options_cache
            if c is not None and c[0] is graph and c[1] is plan.cost and c[2:4] == (plan.model.name, devices):
                offered, refused = c[4], c[5]  # an edit of the same plan: the same shapes
            else:
                offered, refused = model_shape_options(plan, graph, devices)
                self._options_cache = (graph, plan.cost, plan.model.name, devices, offered, refused)
            note = (f"Shapes of {plan.model.name} on {self.devices} devices: "
                    f"{', '.join(s.upper() for s in offered) or 'none'}.")
            for name, why in refused.items():  # the engine's sentence, pointed at this tab's box for K
                why = why.rstrip(".").replace("in abstract units (no --model)", "with Abstract units ticked")
                note += f" {name.upper()} is not offered: {why}."
        else:
            offered, refused = shape_names(), {}
            note = ("Shapes in abstract units (forward 1, backward 2 per block)."
                    + (" Untick the box to search the loaded model's shapes." if is_model_plan(plan) else ""))
        self.offered_shapes, self.refused_shapes = offered, refused
        opts = offered + ([CURRENT] if plan is not None else [])
        self.param.shape.objects = opts
        if self.shape not in opts:
            self.shape = opts[0] if opts else CURRENT
        self.shape_note = note
        self._sync_units()

    def __panel__(self):
        return pn.Column(
            pn.Row(self.shape_input, self.devices_input, self.mb_input, self.units_input),
            self.note_pane,
            pn.Row(self.memory_input, self.time_input, self.seed_input, self.window_input),
            self.tp_plan_input,
            pn.Row(self.run_button, self.cancel_button),
            self.progress_bar, self.progress_pane, self.result_pane,
            css_classes=["tessel-search-panel"],
        )

    # ------------------------------------------------------------------ preparing
    def _prepare(self) -> _Job:
        """The search's inputs, checked; raises TesselError / ValueError with a user sentence."""
        m = int(self.micro_batches)
        if m < 1:
            raise TesselError(f"micro-batches must be at least 1, got {m}")
        limit_units = None if self.memory_limit is None else check_memory_limit(self.memory_limit)
        max_window = int(self.max_window)
        if self.tp_plan.strip() and (self.shape == CURRENT or not self.model_mode):
            raise TesselError("a tensor-parallel plan shards a model's all-device blocks; load a model plan and pick "
                              "its M, NN or X shape, or clear the tensor-parallel plan")
        if self.shape == CURRENT:
            plan = self._st.plan
            if plan is None:
                raise TesselError("no plan is loaded; pick a shape instead of the current plan's placement")
            abstract = self._st.abstract
            placement = plan.placement
            cost = CostModel.from_dict(plan.cost) if plan.cost else None
            base = None if abstract else plan
        elif self.model_mode:
            model_plan: Any = self._st.plan
            if self.shape in self.refused_shapes:
                raise TesselError(self.refused_shapes[self.shape])
            if not model_plan.cost:
                raise TesselError(f"the plan of {model_plan.model.name} records no cost model; plan the model again to "
                                  "search its shapes")
            limit = None if limit_units is None else limit_units * _GIB
            return _Job(None, m, limit, float(self.time_limit), int(self.seed), base_plan=model_plan,
                        cost=CostModel.from_dict(model_plan.cost), variant=None, abstract=False, max_window=max_window,
                        model_shape=self.shape, devices=int(self.devices), tp_plan=self._tp_plan())
        else:
            placement = make_shape(self.shape, int(self.devices))  # PlacementError: n < 2, odd n for NN/K
            abstract, cost, base = True, None, None
        limit = None if limit_units is None else limit_units * (1.0 if abstract else _GIB)
        variant = abstract_v_variant(placement) if abstract else None
        return _Job(placement, m, limit, float(self.time_limit), int(self.seed), base_plan=base, cost=cost,
                    variant=variant, abstract=abstract, max_window=max_window,
                    current=self._st.plan if self.shape == CURRENT else None)

    def _tp_plan(self) -> dict[str, str] | None:
        """The tensor-parallel plan field as a checked plan (:func:`engine.tp_plan.parse_tp_plan`), ``None``
        when blank.

        Raises:
            TesselError: not JSON, or not a valid plan (one sentence).
        """
        text = self.tp_plan.strip()
        return parse_tp_plan(text) if text else None

    # ------------------------------------------------------------------ running
    def start(self) -> bool:
        """Start the search in a background thread; ``False`` (and a message) when it cannot start.

        Progress reaches the widgets through a periodic callback on the session's event loop
        (when there is one); see the module docstring.
        """
        if self.running:
            self._say("a search is already running; cancel it first", "error")
            return False
        try:
            job = self._prepare()
        except (TesselError, ValueError) as e:
            self._say(f"cannot search: {e}", "error")
            return False
        self._job = job
        self._control = SearchControl()
        self._progress = None
        self._outcome = None
        self._done.clear()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._work, args=(job, self._control), name="tessel-search", daemon=True)
        self.param.update(running=True, progress_value=-1,
                          progress_text=f"searching {job.label}, {job.m} micro-batches...")
        self._thread.start()
        self._start_polling()
        return True

    def _work(self, job: _Job, control: SearchControl) -> None:
        """The search thread: plain attributes only (no param, no widgets, no state)."""
        try:
            if job.model_shape is not None:
                self._outcome = self._work_model(job, control)
                return
            res = tessel_search(job.placement, job.m, memory_limit=job.limit, time_limit=job.time_limit,
                                seed=job.seed, progress=self._on_progress, control=control,
                                max_window_micro_batches=job.max_window, fallback_baselines=True)
            tess = _measure(job, res.schedule)
            try:
                base = compare_baselines(job.placement, job.m, memory_limit=job.limit, cost=job.cost,
                                         variant=job.variant)
            except (TesselError, ValueError) as e:
                base = [ScheduleMetrics("baselines", None, None, None, note=str(e))]
            if job.base_plan is not None:  # the model plan's full simulation (DP, optimizer), as the Gantt shows
                base = [_measure(job, r.schedule) if r.schedule is not None else r for r in base]
            if not job.abstract:  # a model's variants are re-planned by the Compare view, not here
                for r in base:
                    if r.schedule is None and r.name in ("interleaved", "zb-h1") and job.placement.name == "V":
                        r.note = "re-plans the model: use Add baselines in the Compare view"
            self._outcome = ("ok", res, tess, base, None)
        except BaseException as e:  # noqa: BLE001 - reported on the UI thread by poll()
            self._outcome = ("error", e)
        finally:
            self._done.set()

    def _work_model(self, job: _Job, control: SearchControl) -> tuple:
        """A model shape's search (in the search thread): ``model_search_plan`` with the loaded
        plan's cost model and micro-batch shape, then the baselines on the same model placement
        (interleaved and ZB-H1 on a V from ``SearchPlan.variant``) and, for another shape, on the
        same model's plain pipeline (``SearchPlan.v_baselines``), all timed as schedules alone
        (like ``tessel search --model``)."""
        bp = job.base_plan
        sp = model_search_plan(bp.model.name, job.model_shape, job.devices, job.m,
                               micro_batch_size=bp.model.micro_batch_size, seq_len=bp.model.seq_len,
                               task=bp.model.task, cost=job.cost, memory_limit=job.limit, time_limit=job.time_limit,
                               precision=bp.parallel.precision, recompute=bp.parallel.recompute,
                               tp_plan=job.tp_plan, seed=job.seed, progress=self._on_progress, control=control,
                               max_window_micro_batches=job.max_window, fallback_baselines=True)
        job.placement = sp.placement
        res = sp.result
        tess = measure(res.schedule, job.limit, sp.cost)
        try:
            base = compare_baselines(sp.placement, job.m, memory_limit=job.limit, cost=sp.cost, variant=sp.variant)
            if sp.placement.name != "V":   # the yardstick, as `tessel search --model` prints it: the same model
                base = [r for r in base if r.makespan is not None or r.name not in ("interleaved", "zb-h1")]
                base += sp.v_baselines(job.limit)   # on a plain pipeline, rows "<schedule> (V)"
        except (TesselError, ValueError) as e:
            base = [ScheduleMetrics("baselines", None, None, None, note=str(e))]
        return ("ok", res, tess, base, sp.plan)

    def _on_progress(self, p: SearchProgress) -> None:
        self._progress = p  # one reference assignment: atomic

    def _start_polling(self) -> None:
        try:
            self._periodic = pn.state.add_periodic_callback(self.poll, period=self.poll_period_ms)
        except Exception:  # noqa: BLE001 - no session / loop: run_search() or poll() apply the outcome
            self._periodic = None

    def _stop_polling(self) -> None:
        cb, self._periodic = self._periodic, None
        if cb is not None:
            with contextlib.suppress(Exception):  # a session already destroyed has removed it
                cb.stop()

    @bokeh_safe
    def poll(self) -> None:
        """Apply what the search thread reported: progress while running, the outcome when done.

        Call on the UI thread (the periodic callback does); safe to call any time.
        """
        if not self.running or self._job is None:
            return
        job = self._job
        p = self._progress
        elapsed = time.perf_counter() - self._t0
        if self._done.is_set():
            self._finish()
            return
        frac = int(100 * min(1.0, elapsed / job.time_limit)) if job.time_limit > 0 else -1
        if p is None:
            what = "capturing the model and searching" if job.model_shape is not None else "searching"
            self.param.update(progress_value=frac, progress_text=f"{what}... {elapsed:.1f} s elapsed")
            return
        gap = p.best_period / p.lower_bound - 1 if p.lower_bound > 0 else 0.0
        cancelling = " (cancelling...)" if self._control is not None and self._control.cancelled else ""
        self.param.update(
            progress_value=frac,
            progress_text=(f"best period {job.t(p.best_period)}/micro-batch vs lower bound {job.t(p.lower_bound)} "
                           f"(gap {gap:.1%}); {p.step} solver calls, "
                           f"{elapsed:.1f} s of {job.time_limit:g} s{cancelling}"),
        )

    def cancel(self) -> bool:
        """Stop a running search (the best schedule so far is kept and loaded).

        Returns ``False`` with an info message when no search is running.
        """
        if not self.running or self._control is None:
            self._say("no search is running; nothing to cancel", "info")
            return False
        self._control.cancel()
        self.progress_text = self.progress_text + " (cancelling...)"
        self._say("cancelling the search; the best schedule found so far will be kept", "info")
        return True

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the search thread (``timeout`` s); ``True`` when it has finished."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._done.is_set()

    def run_search(self, wait: bool = True) -> SearchResult | None:
        """Run a search; with ``wait=True`` block until it ends and apply it here.

        Returns the :class:`~engine.tessel.SearchResult` (``None`` when the search failed or could
        not start: see ``state.message``). With ``wait=False`` this is :meth:`start` and returns
        ``None`` at once.
        """
        if not self.start():
            return None
        if not wait:
            return None
        self.join()
        self.poll()
        return self.result if self._outcome and self._outcome[0] == "ok" else None

    # ------------------------------------------------------------------ finishing (UI thread)
    def _finish(self) -> None:
        with self._finish_lock:
            if not self.running:
                return
            self._stop_polling()
            job, outcome = self._job, self._outcome
            elapsed = time.perf_counter() - self._t0
            try:
                if outcome is None or job is None:
                    self._fail("the search ended without a result")
                elif outcome[0] == "error":
                    self._fail_with(outcome[1], job)
                else:
                    self._apply(job, *outcome[1:], elapsed=elapsed)
            finally:
                self.running = False

    def _fail(self, text: str, kind: str = "error") -> None:
        self.param.update(progress_value=0, progress_text=text)
        self._say(text, kind)

    def _fail_with(self, e: BaseException, job: _Job) -> None:
        if isinstance(e, InfeasibleMemoryError):
            self._fail(f"memory limit {job.mem(job.limit)} is infeasible: device {e.device} needs more even with one "
                       f"micro-batch at a time; the smallest feasible limit is {job.mem(e.smallest)}")
        elif isinstance(e, SearchCancelled):
            self._fail("the search was cancelled before it found a schedule; the plan is unchanged", "info")
        elif isinstance(e, TesselError):
            self._fail(f"search failed: {e}")
        else:
            self._fail(f"search failed: {type(e).__name__}: {e}")

    def _apply(self, job: _Job, res: SearchResult, tess: ScheduleMetrics, base: list[ScheduleMetrics],
               model_plan=None, *, elapsed: float) -> None:
        cancelled = self._control is not None and self._control.cancelled
        how = ("cancelled; best schedule so far" if cancelled
               else ("time limit hit; best schedule so far" if res.timed_out else "done"))
        what = f" of {job.label}" if job.model_shape is not None else ""
        msg = (f"Tessel search{what} {how}: period {job.t(res.period)}/micro-batch "
               f"(lower bound {job.t(res.period_lower_bound)}), "
               f"makespan {job.t(tess.makespan)}")
        try:
            self._load_searched(job, res, model_plan, msg)
        except TesselError as e:
            self._fail(f"the searched schedule could not be loaded: {e}")
            return
        self._st.message_kind = "success"
        self.result, self.tessel_metrics, self.baselines = res, tess, base
        self.searched_plan = self._st.plan if model_plan is not None else None
        text = self._summary(job, res, tess, base)
        if model_plan is not None:
            text += "\n\n" + _model_plan_note(self._st, job.base_plan)
        self.param.update(progress_value=100,
                          progress_text=f"{how}: {res.steps} solver calls in {elapsed:.1f} s",
                          result_text=text)

    def _load_searched(self, job: _Job, res: SearchResult, model_plan, msg: str) -> None:
        """Load the searched plan (:func:`engine.plan.from_search.plan_from_search`): a model
        shape's plan (its memory limit, when the search had none, stays the loaded plan's), the
        loaded plan with the searched schedule (:data:`CURRENT`), or the abstract placement's plan."""
        if model_plan is not None:
            cap = job.base_plan.metrics.get("memory_capacity") if job.limit is None else None
            self._st.load(model_plan, message=msg, graph=_plan_graph(model_plan, self._st.graph))
            if cap:
                self._st.memory_limit = float(cap)
            return
        plan, timeline = plan_from_search(res, job.current, memory_limit=job.limit)
        graph = self._st.graph if job.base_plan is not None else None
        self._st.load(plan, message=msg, graph=graph, timeline=timeline)

    @staticmethod
    def _summary(job: _Job, res: SearchResult, tess: ScheduleMetrics, base: list[ScheduleMetrics]) -> str:
        opt = ", optimal" if res.optimal else ""
        lines = [
            (f"**Tessel**: period {job.t(res.period)}/micro-batch, lower bound {job.t(res.period_lower_bound)} "
             f"(gap {res.period_gap:.1%}{opt}); makespan {job.t(tess.makespan)}, bubble ratio {tess.bubble_ratio:.1%}, "
             f"peak memory {job.mem(max(tess.peak_memory or [0]))}"),
            "",
            "| schedule | makespan | bubble | peak memory | note |",
            "|---|---|---|---|---|",
        ]
        for r in [tess] + list(base):
            if r.makespan is None:
                lines.append(f"| {r.name} | - | - | - | {r.note} |")
            else:
                note = "over the memory limit" if r.over_limit else r.note
                lines.append(f"| {r.name} | {job.t(r.makespan)} | {r.bubble_ratio:.1%} | "
                             f"{job.mem(max(r.peak_memory or [0]))} | {note} |")
        return "\n".join(lines)

    def _say(self, text: str, kind: str) -> None:
        self._st.message_kind = kind
        self._st.message = text


def _model_plan_note(state: PlanState, base_plan) -> str:
    """What the summary adds for a model shape's plan (loaded in ``state``, searched from
    ``base_plan``): the Gantt's full step vs the schedules alone, what the search did not carry
    over, and whether the Launch tab can train the plan (one sentence each)."""
    plan: Any = state.plan
    step = state.timeline.makespan if state.timeline is not None else 0.0
    lines = [f"Makespans above are the schedules alone (as `tessel search --model` reports them); the Gantt's "
             f"step of {state.fmt_time(step)} adds the gradient syncs and the optimizer step."]
    if base_plan.parallel.optimizer != plan.parallel.optimizer:
        lines.append(f"The search models the {plan.parallel.optimizer} optimizer's memory, not the loaded plan's "
                     f"{base_plan.parallel.optimizer}.")
    multi = any(len(b.devices) > 1 for b in plan.placement.blocks)
    if multi and plan.model.split != "layers":
        lines.append(f"{plan.model.name} has no layer split, so the Launch tab cannot run its all-device blocks "
                     "(a tensor-parallel group each); this plan is a prediction only.")
    else:
        lines.append(f"The searched plan of {plan.model.name} is loaded: the Launch tab trains it.")
    return "  \n".join(lines)


def _measure(job: _Job, schedule) -> ScheduleMetrics:
    """Metrics of ``schedule``: for a model plan, re-simulated like the state does (the plan's
    DP degree and parameter bytes: gradient sync and optimizer step included); else
    :func:`engine.plan.compare.measure`."""
    if job.base_plan is None:
        return measure(schedule, job.limit, job.cost)
    tl = resimulate(replace(job.base_plan, schedule=schedule))
    peak = tl.peak_memory()
    over = job.limit is not None and any(p > job.limit for p in peak)
    return ScheduleMetrics(schedule.name, tl.makespan, tl.bubble_ratio(), peak, over, schedule)


def abstract_v_variant(placement):
    """``compare_baselines``' variant for the default abstract V shape: ZB-H1 on the same V with
    split backward. Interleaved 1F1B would need half-size segments, which the integral abstract
    memory units cannot express, so it is reported as not applicable. ``None`` for other shapes."""
    n = placement.num_devices
    try:
        if placement.name != "V" or placement != make_shape("v", n):
            return None
    except (TesselError, ValueError):
        return None

    def variant(name: str):
        if name == "zb-h1":
            return make_shape("v", n, split_backward=True)
        raise ValueError("interleaved needs half-size segments, which abstract units cannot express; "
                         "compare it on a model plan")

    return variant


__all__ = ["CURRENT", "SearchPanel", "abstract_v_variant", "is_model_plan", "model_shape_options"]
