"""The planner app under first use (issue 20): drops that line blocks up, a fast first session, a
sidebar that says what is drawn, hints where a tab starts empty, words instead of function names,
legends that explain colours and do not cover the curves. No browser: the views' Python side."""

from __future__ import annotations

import re

import pytest

import planner_ui.state as state_mod
from engine.baselines.generic import one_f_one_b_any
from engine.plan import make_plan
from engine.shapes import make_shape
from planner_ui import app as app_mod
from planner_ui.colocate_panel import ColocatePanel
from planner_ui.compare_view import CompareView
from planner_ui.gantt import GanttView
from planner_ui.graph_view import GraphView
from planner_ui.plan_form import PlanForm
from planner_ui.state import PlanState, block_spans

MODEL = ("gpt2-tiny", 2, 4, "1f1b", "cpu")  # model, devices, micro-batches, schedule, device type


@pytest.fixture(scope="module")
def tiny():
    return make_plan("gpt2-tiny", devices=2, micro_batches=4, schedule="1f1b", device_type="cpu")


def _order(st: PlanState, device: int) -> list[str]:
    return [str(b) for b in st.schedule.orders[device]]


# ----------------------------------------------------------------------------- 1. drops
def test_dropping_a_block_on_the_previous_blocks_left_edge_moves_it_before_that_block(tiny):
    st = PlanState(tiny.plan)
    view = GanttView(state=st)
    before = _order(st, 0)                      # 0F0 0F1 0B0 ...
    spans = block_spans(st.timeline, 0)
    a, b = before[1], before[2]                 # drag 0B0 left: its left edge on 0F1's left edge
    width = spans[b][1] - spans[b][0]
    res = view.on_drag(b, (spans[a][0] + width / 2) * 1e3, 0)
    assert res.ok, res.message
    assert _order(st, 0)[1:3] == [b, a]
    assert f"moved {b}" in st.message


def test_every_left_edge_drop_on_a_neighbour_is_applied_or_explained(tiny):
    """Each block dropped with its left edge on its right or left neighbour's: the order changes,
    or the message bar says why not (before: dragging left answered "nothing to move", silently)."""
    st = PlanState(tiny.plan)
    view = GanttView(state=st)
    for device in range(2):
        order = _order(st, device)
        spans = block_spans(st.timeline, device)
        for i in range(len(order) - 1):
            for moved, onto in ((order[i], order[i + 1]), (order[i + 1], order[i])):
                st.message = ""
                width = spans[moved][1] - spans[moved][0]
                res = view.on_drag(moved, (spans[onto][0] + width / 2) * 1e3, device)
                assert (_order(st, device) != order) == res.ok, res.message
                assert moved in st.message and st.message != "", (moved, onto, st.message)
                if res.ok:
                    st.undo()


def test_a_drop_where_the_block_already_runs_says_so():
    st = PlanState(one_f_one_b_any(make_shape("v", 2), 4))
    spans = block_spans(st.timeline, 0)
    start, end = spans["0F0"]
    res = st.drop_block("0F0", 0, (start + end) / 2)
    assert not res.ok and res.rule == "position"
    assert "0F0 stays at position 0" in st.message and "left edge" in st.message


# ----------------------------------------------------------------------------- 2. first session
def test_sessions_share_one_plan_and_build_only_the_schedule_tab(monkeypatch):
    app_mod.initial_plan.cache_clear()
    model, devices, mb, sched, dtype = MODEL
    kw = dict(model=model, devices=devices, micro_batches=mb, schedule=sched, device_type=dtype)
    first = app_mod.build_app(**kw)
    calls: list = []
    real = state_mod.resimulate
    monkeypatch.setattr(state_mod, "resimulate", lambda plan: calls.append(plan) or real(plan))
    second = app_mod.build_app(**kw)
    assert calls == []                                  # the session re-used the shared timeline
    assert app_mod.initial_plan.cache_info().hits >= 1  # and plan
    assert second.state.timeline.makespan == first.state.timeline.makespan
    assert second.state.schedule is not first.state.schedule
    # an edit in one session leaves the other's plan as it was
    assert second.state.move_block(0, 1, 2).ok
    assert _order(first.state, 0) != _order(second.state, 0)
    assert "(edited)" not in first.state.schedule.name
    # only the Schedule tab is built with the session; a tab is built when first shown
    assert list(second._built) == ["Schedule"]
    assert not second.tabs.dynamic
    second.show_tab("Compare")
    assert isinstance(second.compare, CompareView) and len(second.tabs[3].objects) == 1


# ----------------------------------------------------------------------------- 4. sidebar
def test_sidebar_says_what_is_shown_after_a_search_replaces_the_model(tiny):
    st = PlanState()
    form = PlanForm(state=st)
    st.load(tiny.plan)
    assert "gpt2-tiny" in form.shown_text and "1f1b" in form.shown_text
    st.load(one_f_one_b_any(make_shape("m", 4), 8))      # what the Search tab loads for abstract units
    assert "abstract" in form.shown_text and "gpt2" not in form.shown_text
    assert "4 devices x 8 micro-batches" in form.shown_text


# ----------------------------------------------------------------------------- 5. compare hint
def test_compare_tab_starts_with_a_hint_that_goes_once_plans_are_added(tiny):
    st = PlanState(tiny.plan)
    cv = CompareView(state=st)
    assert cv.hint.visible and "Add current plan" in cv.hint.object
    cv.add_current()
    assert not cv.hint.visible
    cv.clear()
    assert cv.hint.visible


# ----------------------------------------------------------------------------- 6. co-locate words
def test_colocate_tab_shows_no_python_names_before_a_prediction(tiny):
    panel = ColocatePanel(state=PlanState(tiny.plan))
    text = re.sub(r"<[^>]+>", "", panel.view.header_text)
    assert "Predict co-location" in text
    assert not re.search(r"\b[a-z]+\.[a-z_]+\b|\b[a-z]+_[a-z_]+\b", text), text
    panel.view.select_mode("sequential")  # a mode chosen before predicting: a message in words
    assert "Predict co-location" in panel.view.message
    assert not re.search(r"\b[a-z]+\.[a-z_]+\b|\b[a-z]+_[a-z_]+\(", panel.view.message), panel.view.message


# ----------------------------------------------------------------------------- 7. graph legend
def test_graph_legend_names_every_colour_drawn(tiny):
    st = PlanState()
    st.load(tiny.plan, graph=tiny.graph)
    view = GraphView(state=st)
    for color_by, word in (("segment", "segment"), ("device", "device")):
        view.color_by = color_by
        drawn = set(view.nodes_source.data["color"])
        items = view.legend()
        assert {c for c, _ in items} == drawn
        assert all(word in label for _, label in items), items
        assert all(label in view._legend_pane.object for _, label in items)


# ----------------------------------------------------------------------------- 8. memory legend
def test_memory_legend_is_outside_the_plot_area(tiny):
    view = GanttView(state=PlanState(tiny.plan))
    mem = view.memory_figure
    assert view.memory_legend in mem.below
    assert not [r for r in mem.center if r.__class__.__name__ == "Legend"]
    assert {item.label.field for item in view.memory_legend.items} == {"label"}
