"""The Tune tab (``planner_ui.tune_panel.TunePanel``) without a browser.

A small space of llama-tiny on 4 H100s (micro-batch sizes 1 and 2, 1F1B and ZB-H1, no or full
recomputation, the sharded update) is tuned by the panel and, independently, by
:func:`engine.tune.tune` itself: the scatter and the table hold exactly the tuner's fitting rows;
colouring follows the chosen knob; selecting a point (or a table row) loads a plan whose degrees,
schedule and simulated step time are that row's (the step re-simulated by the state, not copied);
nothing fitting says the tuner's one sentence and leaves the plan alone.
"""

from __future__ import annotations

import math

import pytest

from engine.plan import make_plan, resimulate
from engine.tune import TuneSpace, tune
from engine.tune.report import TABLE_HEADERS, nothing_fits_advice, table_row, why_runner_up_loses
from planner_ui.app import TABS, PlannerApp
from planner_ui.gantt import GanttView
from planner_ui.state import PlanState
from planner_ui.tune_panel import KNOBS, TunePanel, knob_colors, parse_sizes

pytestmark = pytest.mark.timeout(120)

MODEL, SEQ, GPUS = "llama-tiny", 32, 4
SETTINGS = dict(gpus=GPUS, gpus_per_node=4, global_batch=8, micro_batch_sizes="1,2", schedules=["1f1b", "zb-h1"],
                recompute=["none", "full"], sharded_update=True, sequence_parallel=False, overlap_grad_sync=False,
                device_type="h100", seq_len=SEQ)
SPACE = TuneSpace(gpus=GPUS, global_batch=8, gpus_per_node=4, micro_batch_sizes=(1, 2), schedules=("1f1b", "zb-h1"),
                  recompute=("none", "full"), sharded_update=True, sequence_parallel=False, overlap_grad_sync=False)


@pytest.fixture(scope="module")
def start_plan():
    return make_plan(MODEL, devices=GPUS, micro_batches=4, seq_len=SEQ, device_type="h100")


def _state(start_plan) -> PlanState:
    st = PlanState()
    st.load(start_plan.plan, graph=start_plan.graph)
    return st


@pytest.fixture(scope="module")
def reference():
    """The tuner called directly on the same space."""
    return tune(MODEL, SPACE, device_type="h100", seq_len=SEQ)


@pytest.fixture(scope="module")
def tuned(start_plan):
    st = _state(start_plan)
    panel = TunePanel(state=st, **SETTINGS)
    assert panel.run(wait=True) is not None, st.message
    return st, panel


def test_the_panel_starts_from_the_loaded_model_plan(start_plan):
    panel = TunePanel(state=_state(start_plan))
    assert (panel.model, panel.gpus, panel.device_type, panel.seq_len) == (MODEL, GPUS, "h100", SEQ)
    # a plan of another model retargets the inputs
    other = make_plan("gpt2-tiny", devices=2, micro_batches=2, device_type="cpu")
    panel.state.load(other.plan, graph=other.graph)
    assert (panel.model, panel.gpus, panel.device_type) == ("gpt2-tiny", 2, "cpu")


def test_running_fills_the_scatter_and_table_with_exactly_the_fitting_rows(tuned, reference):
    st, panel = tuned
    res = panel.result
    fit = reference.fitting()
    assert len(fit) >= 10 and len(fit) < len(reference.rows)   # a space where some rows are pruned
    d = panel.source.data
    assert list(d["label"]) == [r.candidate.label() for r in fit]
    assert list(d["x"]) == pytest.approx([r.peak_memory / 2**30 for r in fit], rel=1e-12)
    assert list(d["y"]) == pytest.approx([r.tokens_per_second for r in fit], rel=1e-12)
    # tokens/s is the global batch's tokens over the step time
    assert list(d["y"]) == pytest.approx([8 * SEQ / r.step_time for r in fit], rel=1e-9)
    assert [res.rows[i].candidate for i in d["row"]] == [r.candidate for r in fit]
    table = panel.table.value
    assert list(table.columns) == [*TABLE_HEADERS, "Pareto"]
    assert table[list(TABLE_HEADERS)].values.tolist() == [table_row(k + 1, r) for k, r in enumerate(fit)]
    # the Pareto front: exactly the fitting rows no other fitting row beats on both throughput and memory
    front = {r.candidate.label() for r in fit
             if not any((o.step_time < r.step_time and o.peak_memory <= r.peak_memory)
                        or (o.step_time <= r.step_time and o.peak_memory < r.peak_memory) for o in fit)}
    assert {lab for lab, p in zip(d["label"], d["pareto"]) if p == "yes"} == front
    assert [p == "yes" for p in table["Pareto"]] == [p == "yes" for p in d["pareto"]]
    px = panel.pareto_source.data["x"]
    assert len(px) == len(front) and list(px) == sorted(px)
    assert panel.why_text == why_runner_up_loses(reference) and "runner-up" in panel.why_text
    assert st.message_kind == "success" and fit[0].candidate.label() in st.message
    assert f"{len(reference.rows)} configurations" in panel.progress_text and not panel.running


def test_colouring_follows_the_chosen_knob(start_plan):
    st = _state(start_plan)
    panel = TunePanel(state=st, **SETTINGS)
    panel.run(wait=True)
    res = panel.result
    rows = [res.rows[i] for i in panel.source.data["row"]]
    for knob in ("schedule", "pp", "micro_batch_size", "recompute"):
        before = list(panel.source.data["color"])
        panel.color_by = knob
        d = panel.source.data
        assert list(d["knob"]) == [str(r.candidate.knobs()[knob]) for r in rows]
        # one colour per value, distinct values distinct colours
        pairs = set(zip(d["knob"], d["color"]))
        assert len(pairs) == len(set(d["knob"])) == len(set(d["color"])) >= 2
        assert panel.figure.legend.title == knob
        if knob != "schedule":
            assert list(d["color"]) != before
    assert set(KNOBS) <= set(rows[0].candidate.knobs())
    assert knob_colors(["4", "10", "2"]) == {"2": "#1f77b4", "4": "#ff7f0e", "10": "#2ca02c"}   # numeric order


def _check_loaded(st: PlanState, row) -> None:
    c = row.candidate
    par = st.plan.parallel
    assert (par.tp, par.pp, par.dp, par.dp_shard, par.virtual_stages, par.micro_batches, par.micro_batch_size,
            par.recompute, tuple(par.transforms)) == (c.tp, c.pp, c.dp, c.dp_shard, c.virtual_stages,
                                                      c.micro_batches, c.micro_batch_size, c.recompute, c.transforms)
    assert st.plan.schedule.name == c.schedule and st.plan.model.name == MODEL
    assert st.timeline.makespan == pytest.approx(row.step_time, rel=1e-9)
    assert resimulate(st.plan).makespan == pytest.approx(row.step_time, rel=1e-9)
    assert max(st.timeline.peak_memory()) == pytest.approx(row.peak_memory, rel=1e-9)
    assert st.graph is not None and st.message_kind == "success" and c.label() in st.message


def test_selecting_a_point_loads_that_rows_plan(start_plan):
    st = _state(start_plan)
    panel = TunePanel(state=st, **SETTINGS)
    res = panel.run(wait=True)
    rows = list(panel.source.data["row"])
    kept = next(k for k, i in enumerate(rows) if i in res.plans)
    unkept = next(k for k, i in enumerate(rows) if i not in res.plans and res.rows[i].candidate.pp > 1)
    for k, n in ((kept, 1), (unkept, 2)):   # the tuner's kept plan, and one planned again by make_plan
        panel.select_point(k)
        row = res.rows[rows[k]]
        _check_loaded(st, row)
        assert panel.loaded == n and panel.loaded_row == rows[k]
        # the Gantt of the shared state draws one row per pipeline rank
        assert GanttView(state=st).figure.yaxis.ticker.ticks == list(range(row.candidate.pp))
    # a table row does the same
    panel.table.selection = [3]
    panel.join()
    _check_loaded(st, res.rows[rows[3]])
    assert panel.loaded == 3


def test_the_app_shows_the_schedule_tab_when_a_point_is_loaded(start_plan):
    app = PlannerApp(_state(start_plan))
    assert TABS[6] == "Tune" and TABS[-1] == "GNN"
    app.tabs.active = TABS.index("Tune")
    panel = app.tune
    assert isinstance(panel, TunePanel) and panel.model == MODEL
    panel.param.update(**SETTINGS)
    panel.run(wait=True)
    panel.select_point(len(panel.source.data["row"]) - 1)
    assert app.tabs.active == 0
    _check_loaded(app.state, panel.result.rows[panel.source.data["row"][-1]])


def test_nothing_fits_says_the_smallest_change_and_keeps_the_plan(start_plan):
    st = _state(start_plan)
    before, rev = st.plan, st.revision
    panel = TunePanel(state=st, **{**SETTINGS, "recompute": ["none"], "memory_limit": 1e-4})   # 0.1 MiB
    res = panel.run(wait=True)
    assert res is not None and res.best is None and not res.fitting()
    assert st.message_kind == "error" and st.message == nothing_fits_advice(res)
    assert "nothing fits in" in st.message and "recomputation" in st.message   # full recomputation left out
    assert st.plan is before and st.revision == rev
    assert len(panel.source.data["row"]) == 0 and len(panel.table.value) == 0
    assert not panel.load_row(0) and st.plan is before


def test_bad_inputs_are_one_sentence_and_start_nothing(start_plan):
    st = _state(start_plan)
    panel = TunePanel(state=st, **{**SETTINGS, "micro_batch_sizes": "1,x"})
    assert panel.run() is None and not panel.running
    assert st.message_kind == "error" and st.message.startswith("cannot tune: micro-batch sizes")
    panel.param.update(micro_batch_sizes="1", schedules=[])
    assert panel.run() is None and "no schedule" in st.message
    panel.param.update(schedules=["1f1b"], model="no-such-model")
    assert panel.run() is None and st.message.startswith("cannot tune no-such-model:") and "\n" not in st.message
    assert parse_sizes(" 1, 2 ,4") == (1, 2, 4)
    assert math.isfinite(panel.time_limit)
