"""Search, compare, export and launch panels, without a browser or a server.

The panels' logic lives in plain methods (``run_search``, ``rows``, ``plan_json``,
``import_bytes``...) and in Bokeh data sources; these tests call them and check what the state,
the sources and the texts contain.
"""

from __future__ import annotations

import json
import time

import pytest

from engine.baselines.generic import gpipe_any, one_f_one_b_any
from engine.io.plan import Plan
from engine.plan import measure
from engine.shapes import make_shape
from engine.tessel import tessel_search
from planner_ui.compare_view import CompareView
from planner_ui.export_panel import ExportError, ExportPanel
from planner_ui.launch_facade import NO_MODEL_MESSAGE, LaunchJob, LaunchNotPossible
from planner_ui.launch_panel import LaunchPanel
from planner_ui.search_panel import CURRENT, SearchPanel
from planner_ui.state import PlanState


def _orders(schedule):
    return [[str(b) for b in o] for o in schedule.orders]


# ----------------------------------------------------------------------------- search
def test_search_loads_a_valid_tessel_schedule_and_reports_baselines():
    st = PlanState()
    panel = SearchPanel(state=st, shape="m", devices=4, micro_batches=8, time_limit=5)
    res = panel.run_search(wait=True)
    assert res is not None and panel.result is res
    assert not panel.running
    # the state shows the searched schedule, which validates and has m micro-batches
    assert st.schedule is res.schedule and st.abstract
    st.schedule.validate()
    assert st.schedule.num_micro_batches == 8 and st.schedule.placement.name == "M"
    assert st.timeline.makespan == pytest.approx(measure(res.schedule).makespan)
    assert st.message_kind == "success" and "period" in st.message
    # result text: period, bound, makespan, bubble, and the baselines from compare_baselines
    txt = panel.result_text
    assert f"period {res.period:.4g} units" in txt and f"lower bound {res.period_lower_bound:.4g} units" in txt
    assert f"makespan {st.timeline.makespan:.4g} units" in txt and "bubble ratio" in txt
    gp = measure(gpipe_any(make_shape("m", 4), 8))
    assert f"| gpipe | {gp.makespan:.4g} units |" in txt and "| 1f1b |" in txt
    assert [b.name for b in panel.baselines][:2] == ["gpipe", "1f1b"]
    assert panel.progress_value == 100 and "solver calls" in panel.progress_text
    # the widgets follow the panel's outputs
    assert panel.result_pane.object == txt and panel.run_button.disabled is False and panel.cancel_button.disabled


def test_search_window_size_reaches_the_search(monkeypatch):
    """The panel's "micro-batches per window" input is handed to tessel_search."""
    import planner_ui.search_panel as sp

    seen = {}
    real = sp.tessel_search

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(sp, "tessel_search", spy)
    panel = SearchPanel(state=PlanState(), shape="v", devices=4, micro_batches=8, time_limit=3, max_window=1)
    res = panel.run_search(wait=True)
    assert res is not None and seen["max_window_micro_batches"] == 1
    panel.window_input.value = 3
    assert panel.max_window == 3
    with pytest.raises(ValueError):
        panel.max_window = 0  # the widget's bounds refuse it before a search can start


def test_search_progress_is_polled_from_plain_attributes():
    st = PlanState()
    panel = SearchPanel(state=st, shape="v", devices=4, micro_batches=8, time_limit=5)
    assert panel.start()
    assert panel.running and panel.cancel_button.disabled is False and panel.run_button.disabled
    assert panel.join(30)
    # nothing touched the state from the thread: the outcome is applied by poll() on "the UI thread"
    assert st.plan is None
    panel.poll()
    assert not panel.running and st.schedule is panel.result.schedule


def test_cancel_before_start_is_a_clean_message():
    st = PlanState()
    panel = SearchPanel(state=st)
    assert panel.cancel() is False
    assert "no search is running" in st.message and st.message_kind == "info"
    assert st.plan is None


def test_cancel_while_running_returns_cleanly():
    st = PlanState()
    panel = SearchPanel(state=st, shape="x", devices=4, micro_batches=12, time_limit=60)
    t0 = time.perf_counter()
    assert panel.start()
    assert panel.cancel() is True
    assert "cancelling" in st.message
    assert panel.join(30)
    panel.poll()
    assert time.perf_counter() - t0 < 30  # far below the 60 s time limit
    assert not panel.running
    assert "cancelled" in st.message
    if panel.result is not None:  # cancelled after the first solve: the best schedule so far is loaded
        st.schedule.validate()
        assert st.message_kind == "success"
    else:  # cancelled before the search started
        assert st.plan is None and st.message_kind == "info"


def test_infeasible_memory_limit_names_the_smallest_feasible_limit():
    st = PlanState()
    panel = SearchPanel(state=st, shape="m", devices=4, micro_batches=8, memory_limit=1, time_limit=5)
    assert panel.run_search() is None
    assert st.message_kind == "error" and st.plan is None
    assert "memory limit 1 units is infeasible" in st.message
    assert "smallest feasible limit is 2 units" in st.message
    # a feasible limit is honoured by the searched schedule
    panel.memory_limit = 6
    res = panel.run_search()
    assert res is not None and max(st.timeline.peak_memory()) <= 6 and st.memory_limit == 6


def test_bad_device_counts_show_the_engine_message():
    st = PlanState()
    panel = SearchPanel(state=st, shape="v", devices=1)
    assert panel.run_search() is None
    assert st.message_kind == "error" and "at least 2 devices" in st.message
    panel.param.update(shape="nn", devices=3)
    assert panel.run_search() is None and "even number of devices" in st.message
    assert st.plan is None and not panel.running


def test_search_on_the_current_plans_placement():
    st = PlanState()
    panel = SearchPanel(state=st)
    assert CURRENT not in panel.param.shape.objects
    st.load(one_f_one_b_any(make_shape("v", 4), 8))
    assert CURRENT in panel.param.shape.objects
    before = st.timeline.makespan
    panel.param.update(shape=CURRENT, devices=99, micro_batches=8, time_limit=5)  # devices ignored
    res = panel.run_search()
    assert res is not None and st.schedule.num_devices == 4
    assert st.timeline.makespan <= before


# ----------------------------------------------------------------------------- compare
@pytest.fixture(scope="module")
def v4():
    pl = make_shape("v", 4)
    return pl, tessel_search(pl, 8, time_limit=5)


def test_compare_rows_and_chart(v4):
    pl, tess = v4
    st = PlanState(tess.schedule)
    view = CompareView(state=st)
    assert view.add_current("tessel") == "tessel"
    view.add("1f1b", one_f_one_b_any(pl, 8))
    view.add("gpipe", gpipe_any(pl, 8))
    rows = {r["name"]: r for r in view.rows()}
    assert list(rows) == ["tessel", "1f1b", "gpipe"]
    for name, sched in (("tessel", tess.schedule), ("1f1b", one_f_one_b_any(pl, 8)), ("gpipe", gpipe_any(pl, 8))):
        m = measure(sched)
        r = rows[name]
        assert r["makespan"] == pytest.approx(m.makespan) and r["time_unit"] == "units"
        assert r["bubble_pct"] == pytest.approx(100 * m.bubble_ratio)
        assert r["peak_per_device"] == pytest.approx([float(p) for p in m.peak_memory])
        assert r["peak_memory"] == pytest.approx(max(m.peak_memory))
        assert r["reference"] == "1f1b"
        assert r["speedup"] == pytest.approx(measure(one_f_one_b_any(pl, 8)).makespan / m.makespan)
    assert rows["tessel"]["makespan"] == pytest.approx(st.timeline.makespan)
    # one makespan bar per plan; peak-memory bars grouped per device (device x plan)
    assert view.makespan_source.data["name"] == ["tessel", "1f1b", "gpipe"]
    assert view.makespan_source.data["makespan"] == pytest.approx([rows[n]["makespan"] for n in rows])
    assert list(view.makespan_fig.x_range.factors) == ["tessel", "1f1b", "gpipe"]
    assert len(view.memory_source.data["x"]) == 3 * 4
    assert view.memory_source.data["x"][:3] == [("device 0", "tessel"), ("device 0", "1f1b"), ("device 0", "gpipe")]
    assert view.memory_source.data["peak"][2] == pytest.approx(rows["gpipe"]["peak_per_device"][0])
    assert list(view.table.value["name"]) == ["tessel", "1f1b", "gpipe"]
    # remove / show / clear
    assert view.remove("gpipe") and not view.remove("gpipe")
    assert view.makespan_source.data["name"] == ["tessel", "1f1b"]
    assert view.show("1f1b") and st.schedule.name == "1f1b"
    view.clear()
    assert view.rows() == [] and view.makespan_source.data["name"] == []


def test_compare_add_baselines_of_an_abstract_plan(v4):
    pl, tess = v4
    st = PlanState(tess.schedule)
    view = CompareView(state=st)
    view.add_current("tessel")
    added = view.add_baselines()
    assert added == ["gpipe", "1f1b", "zb-h1"]
    assert "interleaved" in st.message  # listed as not applicable, with the reason
    rows = {r["name"]: r for r in view.rows()}
    assert rows["gpipe"]["makespan"] == pytest.approx(measure(gpipe_any(pl, 8)).makespan)
    # ZB-H1 (split backward) beats 1F1B on the V shape
    assert rows["zb-h1"]["speedup"] > 1.0
    assert len(view.makespan_source.data["name"]) == 4


def test_compare_without_plan_is_an_error_message():
    st = PlanState()
    view = CompareView(state=st)
    assert view.add_current() is None and st.message_kind == "error"
    assert view.add_baselines() == [] and "no plan" in st.message
    assert view.show("nothing") is False


# ----------------------------------------------------------------------------- export / import
@pytest.fixture
def v_state():
    st = PlanState()
    st.load(one_f_one_b_any(make_shape("v", 4), 8))
    return st


def test_plan_json_round_trips(v_state):
    ex = ExportPanel(state=v_state)
    d = json.loads(ex.plan_json())
    assert d["format"] == "tessel-plan"
    plan = Plan.from_dict(d)
    assert _orders(plan.schedule) == _orders(v_state.schedule)
    assert plan.placement == v_state.schedule.placement


def test_trace_json_is_a_perfetto_trace(v_state):
    ex = ExportPanel(state=v_state)
    tr = json.loads(ex.trace_json())
    blocks = [e for e in tr["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("F", "B")]
    assert len(blocks) == 4 * 8 * 2
    assert {e["pid"] for e in blocks} == {0, 1, 2, 3}
    assert tr["metadata"]["schedule"] == "1f1b"
    assert ex.measured_download.disabled
    with pytest.raises(ExportError, match="launch it first"):
        ex.measured_trace_json()


def test_csv_reimports_to_the_same_orders(v_state):
    ex = ExportPanel(state=v_state)
    text = ex.csv_text()
    assert text.splitlines()[0].startswith("0F0,")
    orders = _orders(v_state.schedule)
    # import the CSV of another schedule over the same placement, then the original back
    other = gpipe_any(v_state.schedule.placement, 8)
    from engine.io.torch_csv import schedule_to_csv_text

    assert ex.import_bytes("gpipe.csv", schedule_to_csv_text(other).encode())
    assert _orders(v_state.schedule) == _orders(other) and v_state.schedule.name == "gpipe"
    assert ex.import_bytes("mine.csv", text.encode())
    assert _orders(v_state.schedule) == orders and v_state.message_kind == "success"


def test_malformed_json_import_names_the_field_and_keeps_the_state(v_state):
    ex = ExportPanel(state=v_state)
    d = json.loads(ex.plan_json())
    d["schedule"]["orders"][1][2] = "1X9"
    rev, orders = v_state.revision, _orders(v_state.schedule)
    assert ex.import_bytes("broken.json", json.dumps(d).encode()) is False
    assert v_state.message_kind == "error" and "schedule.orders[1][2]" in v_state.message
    assert v_state.revision == rev and _orders(v_state.schedule) == orders
    # not JSON at all / wrong version / a CSV that breaks a dependency: all rejected, state unchanged
    assert not ex.import_bytes("x.json", b"{not json")
    assert "line 1" in v_state.message
    d2 = json.loads(ex.plan_json())
    d2["version"] = 99
    assert not ex.import_bytes("v.json", json.dumps(d2).encode()) and "'version'" in v_state.message
    rows = ex.csv_text().splitlines()
    rows[1] = ",".join(reversed(rows[1].split(",")))
    assert not ex.import_bytes("bad.csv", "\n".join(rows).encode())
    assert v_state.message_kind == "error" and v_state.revision == rev and _orders(v_state.schedule) == orders
    assert not ex.import_bytes("x.txt", b"hello") and "unknown file type" in v_state.message


def test_export_without_plan_and_multi_device_csv():
    st = PlanState()
    ex = ExportPanel(state=st)
    assert ex.plan_download.disabled and ex.csv_download.disabled
    with pytest.raises(ExportError, match="no plan"):
        ex.plan_json()
    assert not ex.import_bytes("s.csv", b"0F0\n") and "placement" in st.message
    st.load(gpipe_any(make_shape("m", 4), 4))  # the M shape has an all-device block
    assert not ex.plan_download.disabled and ex.csv_download.disabled
    with pytest.raises(ExportError, match="plan JSON instead"):
        ex.csv_text()


def test_save_to_folder_writes_all_three(v_state, tmp_path):
    ex = ExportPanel(state=v_state)
    paths = ex.save_to_folder(tmp_path / "out")
    assert sorted(p.name for p in paths) == ["plan.json", "schedule.csv", "trace.json"]
    assert Plan.from_dict(json.loads((tmp_path / "out" / "plan.json").read_text())).schedule.name == "1f1b"
    assert v_state.message_kind == "success"
    # the download callback produces the same bytes
    ex.plan_download._transfer()
    assert ex.plan_download.data.startswith("data:")


# ----------------------------------------------------------------------------- launch (no Ray needed)
def test_launch_panel_refuses_an_abstract_plan(v_state):
    panel = LaunchPanel(state=v_state)
    assert panel.launch(wait=True) is None
    assert v_state.message_kind == "error" and NO_MODEL_MESSAGE in v_state.message
    assert NO_MODEL_MESSAGE in panel.status and not panel.running and panel.job is None
    with pytest.raises(LaunchNotPossible, match="no model"):
        LaunchJob(v_state.plan, steps=2)


def test_launch_panel_without_plan():
    st = PlanState()
    panel = LaunchPanel(state=st)
    assert panel.launch() is None and "no plan" in st.message and st.message_kind == "error"


# ----------------------------------------------------------------------------- a model plan
@pytest.fixture(scope="module")
def tiny():
    from engine.plan import make_plan

    return make_plan("gpt2-tiny", devices=2, micro_batches=4, schedule="1f1b", device_type="cpu",
                     seq_len=32, micro_batch_size=2)


def test_search_and_compare_on_a_model_plan(tiny):
    from engine.plan import make_plan

    st = PlanState()
    st.load(tiny.plan, graph=tiny.graph)
    panel = SearchPanel(state=st, time_limit=5)
    panel.shape = CURRENT
    assert panel.micro_batches == 4 and panel.memory_unit == "GiB" and panel.devices_input.disabled
    res = panel.run_search()
    assert res is not None
    # the searched schedule replaces the model plan's schedule: model, cost and graph are kept
    assert st.plan.model.name == "gpt2-tiny" and not st.abstract and st.graph is tiny.graph
    assert st.schedule is res.schedule and st.plan.cost == tiny.plan.cost
    assert st.timeline.makespan <= tiny.timeline.makespan * (1 + 1e-9)
    assert f"makespan {st.timeline.makespan * 1e3:.4g} ms" in panel.result_text
    # a memory limit below the floor is reported in GiB
    panel.memory_limit = 1e-6
    assert panel.run_search() is None
    assert "GiB is infeasible" in st.message and "smallest feasible limit is" in st.message

    view = CompareView(state=st)
    view.add_current("tessel")
    added = view.add_baselines()  # re-plans the same model with each predefined schedule
    assert added == ["gpipe", "1f1b", "interleaved", "zb-h1"]
    rows = {r["name"]: r for r in view.rows()}
    gp = make_plan("gpt2-tiny", devices=2, micro_batches=4, schedule="gpipe", device_type="cpu",
                   seq_len=32, micro_batch_size=2)
    assert rows["gpipe"]["makespan_s"] == pytest.approx(gp.timeline.makespan)
    assert rows["gpipe"]["time_unit"] == "ms" and rows["gpipe"]["mem_unit"] == "GiB"
    assert rows["gpipe"]["peak_memory"] == pytest.approx(max(gp.timeline.peak_memory()) / 2**30)
    assert rows["tessel"]["makespan_s"] == pytest.approx(st.timeline.makespan)
    assert all(r["reference"] == "1f1b" for r in rows.values())
    assert len(view.makespan_source.data["name"]) == 5 and len(view.memory_source.data["x"]) == 5 * 2
