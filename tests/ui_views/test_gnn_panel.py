"""The app's GNN tab: plans on a real graph, refuses a budget nothing fits in one sentence and keeps
the previous plan, and profiles the model into the stacked-bar view."""

from __future__ import annotations

import pytest

pytest.importorskip("torch_geometric")


def test_plan_matches_the_engine_and_is_shown():
    from engine.gnn.models import GNNConfig
    from engine.gnn.plan import graph_from_spec, make_gnn_plan
    from engine.gnn.plan_parts import GraphStats
    from planner_ui.gnn_panel import GNNPanel
    from tasks.graphs import graph_stats

    panel = GNNPanel(kind="gcn", graph="karate", hidden=16, devices=2)
    plan = panel.make_plan()
    assert plan is not None and panel.message == ""
    assert panel.plan_view.plan is plan
    data = graph_from_spec("karate")
    st = graph_stats(data)
    ref = make_gnn_plan(GNNConfig("gcn", st["feature_dim"], 16, st["num_classes"], 2, 1), GraphStats.of(st), 2,
                        None, None, "cpu", edge_index=data.edge_index, graph_spec="karate")
    assert plan.partitions == ref.partitions
    assert plan.metrics["epoch_time"] == pytest.approx(ref.metrics["epoch_time"])


def test_a_budget_nothing_fits_is_one_sentence_and_keeps_the_plan():
    from planner_ui.gnn_panel import GNNPanel

    panel = GNNPanel(kind="gat", graph="karate", hidden=16, devices=1)
    first = panel.make_plan()
    assert first is not None
    panel.budget_mib = 0.001
    assert panel.make_plan() is None
    assert panel.message and "\n" not in panel.message and "budget" in panel.message.lower()
    assert panel.plan is first and panel.plan_view.plan is first
    assert panel._alert.visible


def test_profile_adds_rows_for_both_modes():
    from planner_ui.gnn_panel import GNNPanel

    panel = GNNPanel(kind="gin", graph="karate", hidden=8)
    n = panel.profile(repeats=1)
    assert n > 0 and len(panel.profile_view.rows) == n
    assert {r["mode"] for r in panel.profile_view.rows} == {"inference", "training"}
    assert panel.profile_view.bar_count >= 2  # one bar per layer


def test_the_app_has_the_gnn_tab():
    from planner_ui.app import TABS

    assert TABS[-1] == "GNN"
