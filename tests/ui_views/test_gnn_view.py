"""GNNPlanView: the GNN plan's Gantt (a load and a compute lane per device) and memory against the budget.

No browser: the Bokeh sources are checked against the simulated Timeline they are drawn from.
"""

from __future__ import annotations

import dataclasses

import panel as pn
import pytest
from bokeh.embed import json_item
from bokeh.layouts import column

from engine.gnn.models import GNNConfig
from engine.gnn.plan import make_gnn_plan
from engine.gnn.plan_parts import GraphStats
from engine.gnn.simulate import simulate_gnn
from planner_ui.gnn_view import LOAD_COLOR, GNNPlanView, gnn_lane_columns

STATS = GraphStats(num_vertices=400, num_edges=6000, feature_dim=16, num_classes=4)


@pytest.fixture(scope="module")
def plan():
    return make_gnn_plan(GNNConfig("gat", 16, 32, 4, 2, 4), STATS, devices=2, budget_bytes=2**30, P=4,
                         device_type="cpu", graph_spec="test-graph")


def test_view_draws_a_compute_and_a_load_lane_per_device(plan):
    view = GNNPlanView(plan=plan)
    tl = simulate_gnn(plan).timeline
    comp = view.compute_source.data
    lanes = view.load_source.data
    compute_events = [e for e in tl.events if e.stream == "compute"]
    load_events = [e for e in tl.events if e.stream == "load"]
    assert sorted(comp["name"]) == sorted(e.name for e in compute_events)
    assert sorted(n for n, op in zip(lanes["name"], lanes["op"]) if op == "LOAD") == sorted(e.name for e in load_events)
    assert {op for op in lanes["op"]} == {"LOAD", "ALLGATHER", "REDUCESCATTER", "ALLREDUCE"}
    # compute lane of device d at y = 2d, its load lane at 2d + 1
    assert all(y == 2 * d for y, d in zip(comp["y"], comp["device"]))
    for top, bottom, d in zip(lanes["top"], lanes["bottom"], lanes["device"]):
        assert top < 2 * d + 1 < bottom and top > 2 * d
    assert all(c == LOAD_COLOR for c, op in zip(lanes["color"], lanes["op"]) if op == "LOAD")
    # geometry in ms: a block spans its event
    e = compute_events[0]
    i = list(comp["name"]).index(e.name)
    assert comp["x"][i] == pytest.approx((e.start + e.end) / 2 * 1e3)
    assert comp["width"][i] == pytest.approx((e.end - e.start) * 1e3)
    labels = view.figure.yaxis.major_label_overrides
    assert labels[0] == "device 0 compute" and labels[1] == "device 0 load" and labels[3] == "device 1 load"
    assert view.figure.y_range.start == pytest.approx(3.5)
    json_item(column(view.figure, view.memory_figure))   # the figures (sharing the time axis) serialise


def test_memory_curves_and_budget_line(plan):
    view = GNNPlanView(plan=plan)
    mem = view.memory_source.data
    assert mem["label"] == ["device 0", "device 1"]
    tl = simulate_gnn(plan).timeline
    for d, ys in enumerate(mem["ys"]):
        assert max(ys) == pytest.approx(max(v for _, v in tl.memory[d]) / 2**20)   # MiB: the plan peaks below 1 GiB
    assert view.budget_span.visible and view.budget_span.location == pytest.approx(2**30 / 2**20)
    assert view.memory_figure.yaxis[0].axis_label == "memory (MiB)"
    assert view.memory_figure.y_range.end < 1024           # a budget far above the curves does not flatten them
    assert view.budget_span.line_dash == [6]          # Bokeh stores "dashed" as its dash pattern


def test_header_states_epoch_P_and_peak_against_budget(plan):
    view = GNNPlanView(plan=plan)
    head = view._header.object
    assert f'class="tessel-gnn-epoch">{plan.metrics["epoch_time"] * 1e3:,.3f} ms' in head
    assert 'class="tessel-gnn-partitions">4<' in head and "test-graph" in head
    assert 'class="tessel-gnn-budget">1 GiB<' in head and "tessel-gnn-over" not in head
    over = dataclasses.replace(plan, budget_bytes=max(plan.metrics["peak_memory"]) // 2)
    view.plan = over                                   # an over-budget plan is drawn, and said so
    assert "tessel-gnn-over" in view._header.object
    classes = view.__panel__().css_classes
    assert "tessel-gnn-view" in classes
    assert [o.css_classes[0] for o in view.__panel__().objects] == ["tessel-gnn-header", "tessel-gnn-gantt",
                                                                    "tessel-gnn-memory"]


def test_empty_view_and_webgl_threshold(plan):
    empty = GNNPlanView()
    assert "No GNN plan loaded" in empty._header.object and len(empty.compute_source.data["x"]) == 0
    assert gnn_lane_columns(None)[0]["x"] == []
    assert not GNNPlanView(plan=plan).webgl
    assert GNNPlanView(plan=plan, webgl_threshold=10).webgl
    assert isinstance(pn.panel(GNNPlanView(plan=plan)), pn.viewable.Viewable)
