"""The Co-locate tab: predicts copies of the current data-parallel plan, refuses the rest clearly."""

from __future__ import annotations

import panel as pn

from engine.baselines.generic import one_f_one_b_any
from engine.plan import make_plan
from engine.shapes import make_shape
from planner_ui.colocate_panel import ColocatePanel
from planner_ui.state import PlanState


def test_two_copies_of_a_dp_plan_are_predicted_and_crossover_beats_sequential():
    res = make_plan("gpt2-tiny", devices=2, dp=2, micro_batches=1, device_type="cpu")
    state = PlanState()
    state.load(res.plan)
    panel = ColocatePanel(state=state)
    assert panel.predict()
    c = panel.view.predictions["crossover"]
    s = panel.view.predictions["sequential"]
    assert c.jobs == ["A", "B"]
    assert c.aggregate_tokens_per_second > s.aggregate_tokens_per_second
    assert state.message_kind == "success" and "crossover" in state.message
    assert panel.view.block_count > 0
    pn.panel(panel).get_root()


def test_pipeline_and_abstract_plans_are_refused_with_a_message():
    state = PlanState()
    panel = ColocatePanel(state=state)
    assert not panel.predict() and "no plan" in state.message
    state.load(one_f_one_b_any(make_shape("v", 4), 8))
    assert not panel.predict() and "model plan" in state.message
    state.load(make_plan("gpt2-tiny", devices=2, micro_batches=4).plan)   # pp = 2
    assert not panel.predict()
    assert state.message_kind == "error" and "cannot co-locate" in state.message
