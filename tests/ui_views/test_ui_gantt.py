"""GanttView: what the chart shows, what drags / the edit form do to the plan, undo/redo, overlays.

No browser: the Bokeh sources are checked directly and browser changes are simulated by
assigning the block source the way BokehJS's BoxEditTool does (the whole ``data`` dict).
"""

from __future__ import annotations

import numpy as np
import panel as pn
import pytest

from engine.baselines.generic import one_f_one_b_any
from engine.plan import make_plan
from engine.shapes import make_shape
from planner_ui.gantt import GanttView
from planner_ui.state import PlanState, block_starts


@pytest.fixture
def v4():
    st = PlanState(one_f_one_b_any(make_shape("v", 4), 8))
    return st, GanttView(state=st)


@pytest.fixture(scope="module")
def gpt2_result():
    return make_plan("gpt2-tiny", devices=2, micro_batches=4)


def compute_events(tl):
    return [e for e in tl.events if e.stream == "compute"]


def row_of(view, name, device=None):
    d = view.block_source.data
    for i, n in enumerate(d["name"]):
        if n == name and (device is None or int(d["device"][i]) == device):
            return i
    raise KeyError(name)


def header(view):
    return view._header.object


# ---------------------------------------------------------------- rendering
def test_blocks_match_compute_events_abstract(v4):
    st, view = v4
    evs = compute_events(st.timeline)
    assert view.block_count == len(evs) == len(view.block_source.data["x"])
    assert sorted(view.block_source.data["name"]) == sorted(e.name for e in evs)
    # geometry: Rect centre/width in abstract units, one row per device
    i = row_of(view, "0B0")
    e = next(e for e in evs if e.name == "0B0")
    assert view.block_source.data["x"][i] == pytest.approx((e.start + e.end) / 2)
    assert view.block_source.data["width"][i] == pytest.approx(e.end - e.start)
    assert view.block_source.data["y"][i] == 0
    assert view.figure.xaxis[0].axis_label == "time (units)"
    assert view.figure.y_range.start == pytest.approx(3.5) and view.figure.y_range.end == pytest.approx(-0.5)
    assert view.figure.yaxis[0].major_label_overrides[0] == "device 0"
    # labels are micro-batch numbers of the F/B blocks (small plan)
    assert view.labels_shown
    assert sorted(set(view.label_source.data["text"])) == [str(m) for m in range(8)]
    assert not view.webgl  # 68 glyphs: canvas
    # abstract plans have free communication: zero-length events are not drawn
    assert len(view.comm_source.data["left"]) == 0


def test_header_has_makespan_and_bubble(v4):
    st, view = v4
    m = st.metrics()
    h = header(view)
    assert st.fmt_time(m["makespan"]) in h and "33 units" in h
    assert f"{m['bubble_ratio'] * 100:.1f}%" in h
    assert "1f1b" in h
    for kind in ("F", "B", "I", "W", "SEND/RECV", "ALLREDUCE", "OPTIM"):
        assert f">{kind}</span>" in h


def test_gpt2_plan_in_ms_with_comm_and_memory(gpt2_result):
    st = PlanState(gpt2_result.plan, graph=gpt2_result.graph)
    view = GanttView(state=st)
    tl = st.timeline
    assert view.block_count == len(compute_events(tl))
    comm = [e for e in tl.events if e.stream != "compute" and e.end > e.start]
    assert len(comm) > 0 and len(view.comm_source.data["left"]) == len(comm)
    assert set(view.comm_source.data["op"]) <= {"SEND", "RECV", "ALLREDUCE"}
    assert max(view.comm_source.data["nbytes"]) > 0
    assert view.figure.xaxis[0].axis_label == "time (ms)"
    i = row_of(view, "1B0")
    e = next(e for e in tl.events if e.name == "1B0" and e.stream == "compute")
    assert view.block_source.data["start"][i] == pytest.approx(e.start * 1e3)
    assert view.block_source.data["duration"][i] == pytest.approx((e.end - e.start) * 1e3)
    assert st.fmt_time(tl.makespan) in header(view) and "ms" in header(view)
    # memory: one step line per device, in GiB, limit as a dashed span
    mem = view.memory_source.data
    assert len(mem["xs"]) == len(mem["ys"]) == 2
    assert max(mem["ys"][1]) == pytest.approx(tl.peak_memory()[1] / 2**20)  # MiB: gpt2-tiny peaks below 1 GiB
    assert view.memory_span.visible
    assert view.memory_span.location == pytest.approx(st.memory_limit / 2**20)
    assert view.memory_span.line_dash == [6] or view.memory_span.line_dash  # dashed
    assert view.memory_figure.x_range is view.figure.x_range
    # hover shows bytes for communication
    assert any("@nbytes" in t[1] for t in view.comm_hover.tooltips)
    assert ("device", "@device") in view.block_hover.tooltips
    # toggling communication off empties only the comm source
    view.show_comm = False
    assert len(view.comm_source.data["left"]) == 0 and view.block_count == len(compute_events(tl))


def test_memory_limit_span_follows_state(v4):
    st, view = v4
    assert not view.memory_span.visible  # no limit on this plan
    assert len(view.memory_source.data["xs"]) == 4
    st.memory_limit = 5
    assert view.memory_span.visible and view.memory_span.location == 5
    assert view.memory_figure.y_range.end >= 5  # the limit is in view
    assert "5 units" in header(view)
    st.memory_limit = None
    assert not view.memory_span.visible


def test_get_root_builds_bokeh_models(v4, gpt2_result):
    _st, view = v4
    root = pn.panel(view).get_root()
    assert root is not None
    assert any(getattr(m, "output_backend", None) == "canvas" for m in root.references())
    view2 = GanttView(state=PlanState(gpt2_result.plan))
    assert pn.panel(view2).get_root() is not None


# ---------------------------------------------------------------- dragging
def test_drag_valid_changes_plan_and_header(v4):
    st, view = v4
    starts = block_starts(st.timeline, 0)
    before = st.timeline.makespan
    # drop 0F0 just after the start of 0F1: it becomes second on device 0
    res = view.on_drag("0F0", starts["0F1"] + 0.1, 0.1)
    assert res.ok, res.message
    assert [str(b) for b in st.schedule.orders[0][:2]] == ["0F1", "0F0"]
    assert st.timeline.makespan == pytest.approx(34.0) and before == pytest.approx(33.0)
    assert "34 units" in header(view) and st.message_kind == "success"
    # the chart now shows the re-simulated timeline
    i = row_of(view, "0F0")
    assert view.block_source.data["x"][i] == pytest.approx(1.5)
    assert view.state.selected_block == "0F0"
    assert len(view.selection_source.data["x"]) == 1


def test_drag_breaking_dependency_rejected_and_restored(v4):
    st, view = v4
    i = row_of(view, "0B0")
    x0 = float(view.block_source.data["x"][i])
    plan0 = st.plan
    # the browser drags 0B0 before 0F0: BoxEditTool sends the whole data dict with x/y changed
    data = dict(view.block_source.data)
    data["x"] = np.array(data["x"], dtype=float)
    data["x"][i] = -0.4
    data["y"] = np.array(data["y"], dtype=float)
    data["y"][i] = 0.2
    view.block_source.data = data
    assert st.message_kind == "error"
    assert "depend" in st.message.lower()
    assert st.plan is plan0
    assert float(view.block_source.data["x"][i]) == pytest.approx(x0)
    assert float(view.block_source.data["y"][i]) == 0
    assert view._alert.alert_type == "danger" and view._alert.visible


def test_drag_to_device_outside_placement_rejected(v4):
    st, view = v4
    rev = st.revision
    res = view.on_drag("0F2", 2.5, 1.1)
    assert not res.ok and res.rule == "device"
    assert st.message_kind == "error" and "device" in st.message
    assert st.revision == rev
    assert view.block_source.data["y"][row_of(view, "0F2")] == 0
    res = view.on_drag("0F2", 2.5, 7.0)
    assert not res.ok and "devices 0..3" in st.message


def test_browser_add_or_delete_is_undone(v4):
    st, view = v4
    n = view.block_count
    data = {k: list(v)[:-1] for k, v in view.block_source.data.items()}   # Backspace deleted a box
    view.block_source.data = data
    assert len(view.block_source.data["x"]) == n
    assert st.message_kind == "error" and "added or deleted" in st.message


def test_drag_with_a_previous_tap_moves_the_grabbed_block(v4):
    # BoxEditTool appends the grabbed box to an earlier tap selection and drags both
    st, view = v4
    a, b = row_of(view, "3B3"), row_of(view, "0F0")
    view.block_source.selected.indices = [a]
    view.block_source.selected.indices = [a, b]
    assert st.selected_block == "0F0"
    starts = block_starts(st.timeline, 0)
    dx = starts["0F1"] + 0.1 - view.block_source.data["x"][b]
    data = dict(view.block_source.data)
    data["x"] = np.array(data["x"], dtype=float)
    data["x"][[a, b]] += dx
    view.block_source.data = data
    assert st.message_kind == "success", st.message
    assert [str(x) for x in st.schedule.orders[0][:2]] == ["0F1", "0F0"]
    assert str(st.schedule.orders[3][7]) == "3B3"


def test_browser_resize_is_refused(v4):
    st, view = v4
    i = row_of(view, "1F1")
    data = dict(view.block_source.data)
    data["x"] = np.array(data["x"], dtype=float)
    data["width"] = np.array(data["width"], dtype=float)
    data["x"][i] += 3
    data["width"][i] *= 2
    plan0 = st.plan
    view.block_source.data = data
    assert st.plan is plan0 and "resized" in st.message
    assert view.block_source.data["width"][i] == pytest.approx(1.0)


def test_drag_through_source_applies_valid_edit(v4):
    st, view = v4
    i = row_of(view, "0F0")
    starts = block_starts(st.timeline, 0)
    data = dict(view.block_source.data)
    data["x"] = np.array(data["x"], dtype=float)
    data["x"][i] = starts["0F1"] + 0.2
    view.block_source.data = data
    assert st.message_kind == "success", st.message
    assert str(st.schedule.orders[0][1]) == "0F0"


def test_memory_rejection_via_drag(gpt2_result):
    st = PlanState(gpt2_result.plan)
    view = GanttView(state=st)
    st.memory_limit = float(st.timeline.peak_memory()[0])
    # pull the last forward of device 0 before the first backward: more activations live at once
    order = [str(b) for b in st.schedule.orders[0]]
    first_b = order.index("0B0")
    last_f = max(k for k, a in enumerate(order) if "F" in a)
    if last_f < first_b:
        pytest.skip("no forward after the first backward on device 0")
    starts = block_starts(st.timeline, 0)
    res = view.on_drag(order[last_f], starts["0B0"] * 1e3 - 1e-6, 0)
    assert not res.ok and res.rule == "memory", res
    assert st.message_kind == "error"


# ---------------------------------------------------------------- tap / form / undo
def test_tap_and_form_move(v4):
    st, view = v4
    view.block_source.selected.indices = [row_of(view, "3B0")]   # browser tap
    assert st.selected_block == "3B0"
    assert view._block_input.value == "3B0"
    assert view._position_input.value == 1 and not view._move_button.disabled
    assert not view._device_select.visible
    assert "3B0" in view._selected_html.object
    before = st.timeline.makespan
    view._position_input.value = 2          # after 3F1
    view._move_button.clicks += 1           # what the Move button does
    assert st.message_kind == "success", st.message
    assert [str(b) for b in st.schedule.orders[3][:3]] == ["3F0", "3F1", "3B0"]
    assert st.timeline.makespan != before
    assert not view._undo_button.disabled and view._redo_button.disabled


def test_typed_block_name_and_errors(v4):
    st, view = v4
    view._block_input.value = "2b3"
    assert st.selected_block == "2B3"
    assert view._position_input.value == st.position_of(2, "2B3")
    assert not view.select("9F0") and st.message_kind == "error"
    assert not view.select("hello") and "not a block name" in st.message
    assert st.selected_block == "2B3"
    view.select("")
    assert st.selected_block == "" and view._move_button.disabled
    res = view.move_selected()
    assert not res.ok and "select a block" in st.message


def test_form_move_rejected_dependency(v4):
    st, view = v4
    view.select("1B0")
    res = view.move_selected(position=0)
    assert not res.ok and res.rule == "dependency"
    assert st.message_kind == "error"


def test_multi_device_block_device_selector():
    st = PlanState(one_f_one_b_any(make_shape("m", 4), 4))
    view = GanttView(state=st)
    assert view.select("0F0")
    assert view._device_select.visible
    assert list(view._device_select.options.values()) == [0, 1, 2, 3]
    view._device_select.value = 2
    assert view._position_input.value == st.position_of(2, "0F0")
    # it is drawn on each of its devices, and highlighted on all of them
    assert len(view.selection_source.data["x"]) == 4


def test_undo_redo_restore_makespans(v4):
    st, view = v4
    m0 = st.timeline.makespan
    starts = block_starts(st.timeline, 0)
    assert view.on_drag("0F0", starts["0F1"] + 0.1, 0).ok
    m1 = st.timeline.makespan
    assert m1 != m0
    assert not view._undo_button.disabled
    view._undo_button.clicks += 1
    assert st.timeline.makespan == pytest.approx(m0)
    assert st.fmt_time(m0) in header(view)
    assert view._undo_button.disabled and not view._redo_button.disabled
    assert view.block_source.data["x"][row_of(view, "0F0")] == pytest.approx(0.5)
    assert view.redo()
    assert st.timeline.makespan == pytest.approx(m1)
    assert st.fmt_time(m1) in header(view)


# ---------------------------------------------------------------- highlight / measured
def test_highlight_segment_dims_others(v4):
    st, view = v4
    st.selected_segment = 2
    d = view.block_source.data
    seg = np.asarray(d["segment"])
    alpha = np.asarray(d["alpha"])
    assert (alpha[seg == 2] > 0.9).all()
    assert (alpha[seg != 2] < 0.5).all()
    st.selected_segment = None
    assert (np.asarray(view.block_source.data["alpha"]) > 0.9).all()


def test_measured_overlay(v4):
    st, view = v4
    assert not view.measured_renderer.visible and len(view.measured_source.data["left"]) == 0
    st.measured = st.timeline
    n = len(compute_events(st.timeline))
    assert len(view.measured_source.data["left"]) == n
    assert view.measured_renderer.visible and view.measured_legend.visible
    assert view.measured_legend.items[0].label.value == "measured"
    # drawn in the upper part of each row
    tops = np.asarray(view.measured_source.data["top"])
    devs = np.asarray(view.measured_source.data["device"])
    assert (tops < devs).all()
    h = header(view)
    assert "measured" in h and "tessel-measured-makespan" in h
    # a plan change clears the measurement
    starts = block_starts(st.timeline, 0)
    view.on_drag("0F0", starts["0F1"] + 0.1, 0)
    assert st.measured is None and not view.measured_renderer.visible


# ---------------------------------------------------------------- large plans
def test_ten_thousand_blocks_webgl_no_labels():
    st = PlanState(one_f_one_b_any(make_shape("v", 8), 600))
    view = GanttView(state=st)
    assert view.block_count >= 9600
    assert view.webgl
    assert view.figure.output_backend == "webgl" and view.memory_figure.output_backend == "canvas"
    assert not view.labels_shown and len(view.label_source.data["text"]) == 0
    assert isinstance(view.block_source.data["x"], np.ndarray)
    assert pn.panel(view).get_root() is not None
    # an edit replaces the data, not the figures
    fig = view.figure
    starts = block_starts(st.timeline, 7)
    res = view.on_drag("7B0", starts["7F2"] + 0.5, 7)      # 7B0 behind 7F2: the pipeline deadlocks
    assert not res.ok and res.rule == "deadlock" and "deadlock" in st.message
    assert view.block_source.data["x"][row_of(view, "7B0", 7)] == pytest.approx(starts["7B0"] + 1.0)
    res = view.on_drag("7B0", starts["7F1"] + 0.5, 7)      # 7B0 behind 7F1: valid
    assert res.ok, res.message
    assert [str(b) for b in st.schedule.orders[7][:3]] == ["7F0", "7F1", "7B0"]
    assert view.figure is fig and view.block_count >= 9600
    # a small plan loaded afterwards goes back to canvas with labels
    st.load(one_f_one_b_any(make_shape("v", 2), 4))
    assert not view.webgl and view.labels_shown and view.block_count == 2 * 4 * 2 + 2


def test_time_axis_fits_each_new_plan_and_memory_axis_uses_mib_for_small_models():
    from engine.baselines.generic import one_f_one_b_any
    from engine.plan import make_plan
    from engine.shapes import make_shape
    from planner_ui.gantt import GanttView
    from planner_ui.state import PlanState

    res = make_plan("gpt2-tiny", devices=2, micro_batches=4)
    state = PlanState()
    state.load(res.plan)
    view = GanttView(state=state)
    ms = state.timeline.makespan * 1e3
    assert view.figure.x_range.end == pytest.approx(ms * 1.01)
    assert view.memory_figure.yaxis[0].axis_label == "memory (MiB)"  # gpt2-tiny peaks at a few MiB
    state.load(one_f_one_b_any(make_shape("v", 4), 8))  # 33 units: the axis follows the new plan
    assert view.figure.x_range.end == pytest.approx(state.timeline.makespan * 1.01)
    assert view.memory_figure.yaxis[0].axis_label == "memory (units)"


def test_plan_form_optimizer_choice_changes_the_memory_curves():
    from planner_ui.plan_form import PlanForm
    from planner_ui.state import PlanState

    state = PlanState()
    form = PlanForm(state=state, model="gpt2-tiny", devices=2, micro_batches=4, precision="32-true")
    assert form.plan()
    adam_peak = state.timeline.peak_memory()
    form.optimizer = "adama"
    assert form.plan() and state.plan.parallel.optimizer == "adama"
    adama_peak = state.timeline.peak_memory()
    seg_bytes = [sum(int(s["param_bytes"]) for s in state.plan.segments if s["index"] == d) for d in range(2)]
    tied = [sum(g["nbytes"] for g in state.plan.tied_weights if d in {m[0] for m in g["members"]}) for d in range(2)]
    assert tied[0] == tied[1] > 0  # gpt2-tiny's wte / lm_head copies on both stages
    # AdamA holds no gradient buffer across micro-batches, except the tied copies' gradients (summed
    # across copies at the step, so not folded): each device's peak drops by its other parameters' bytes
    assert [a - b for a, b in zip(adam_peak, adama_peak)] == [p - t for p, t in zip(seg_bytes, tied)]


def test_plan_form_transformations_are_planned_drawn_and_refused_in_one_sentence():
    """The plan form's CoCoNet transformations: the sharded update and overlapped sync reach the
    plan, their reduce-scatter / all-gather / bucket all-reduces reach the Gantt's communication
    lane, and one the plan cannot take leaves the plan as it was with one sentence."""
    from planner_ui.gantt import GanttView
    from planner_ui.plan_form import PlanForm
    from planner_ui.state import PlanState

    state = PlanState()
    form = PlanForm(state=state, model="gpt2-tiny", devices=2, dp=2, micro_batches=2, device_type="cpu",
                    link="emulated:1gbit", transforms=["sharded-update"])
    assert form.plan() and state.plan.parallel.transforms == ("sharded-update",)
    assert state.plan.cost["intra_link"]["name"] == "emulated:1gbit"
    ops = {e.op for e in state.timeline.events if e.stream == "collective"}
    assert {"REDUCESCATTER", "ALLGATHER"} <= ops and "sharded-update" in state.message
    gantt = GanttView(state=state)
    assert {"REDUCESCATTER", "ALLGATHER"} <= set(gantt.comm_source.data["op"])
    before = state.plan
    form.transforms = ["tp-split"]
    assert not form.plan()
    assert state.plan is before and state.message_kind == "error"
    assert "'tp-split' needs tp > 1" in state.message
