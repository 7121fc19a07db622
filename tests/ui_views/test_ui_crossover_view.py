"""CrossoverView: the read-only Gantt of co-located jobs, its header and mode selector (no browser)."""

from __future__ import annotations

import numpy as np
import panel as pn
import pytest

from engine.crossover import JobProfile, compare_profiles, predict_profiles
from engine.plan import make_plan
from planner_ui.crossover_view import (
    CrossoverView,
    crossover_columns,
    crossover_header_html,
    fmt_ms,
    fmt_rate,
    job_color,
)
from planner_ui.sources import COMM_HEIGHT, COMPUTE_HEIGHT


@pytest.fixture(scope="module")
def synthetic_modes():
    jobs = [JobProfile.synthetic(n, 2e-3, 2e-3, 1e-4, num_devices=2, tokens_per_step=512) for n in "AB"]
    return compare_profiles(jobs, steps=3)


@pytest.fixture(scope="module")
def dp2_plan():
    return make_plan("gpt2-tiny", devices=2, dp=2, micro_batches=1, device_type="cpu").plan


def compute_events(pred):
    return [e for e in pred.timeline.events if e.stream == "compute"]


def test_blocks_and_lanes(synthetic_modes):
    pred = synthetic_modes["crossover"]
    view = CrossoverView(prediction=pred, predictions=synthetic_modes)
    evs = compute_events(pred)
    # one block per compute event (F, B, OPTIM of 2 jobs x 3 steps on 2 devices)
    assert view.block_count == len(evs) == 2 * 3 * 3 * 2
    # all-reduces in the thin lane (one per job, step and device)
    assert view.comm_count == 2 * 3 * 2
    d = view.block_source.data
    assert sorted(d["name"]) == sorted(e.name for e in evs)
    i = list(d["name"]).index("B 0B0")
    e = next(e for e in evs if e.name == "B 0B0" and e.rank == int(d["device"][i]))
    assert d["left"][i] == pytest.approx(e.start * 1e3) and d["right"][i] == pytest.approx(e.end * 1e3)
    assert d["job"][i] == "B" and d["color"][i] == job_color(1) and d["op"][i] == "B"
    # job B's sub-lane is the lower half of the device row
    dev = int(d["device"][i])
    assert d["top"][i] == pytest.approx(dev) and d["bottom"][i] == pytest.approx(dev + COMPUTE_HEIGHT / 2)
    c = view.comm_source.data
    assert set(c["op"]) == {"ALLREDUCE"}
    assert all(dev + 0.3 < t < dev + 0.6 for dev, t in zip(c["device"], c["top"]))
    assert np.all(np.asarray(c["bottom"]) - np.asarray(c["top"]) == pytest.approx(COMM_HEIGHT / 2))
    # colours follow the job, the hover shows the op
    assert {col for col, j in zip(d["color"], d["job"]) if j == "A"} == {job_color(0)}
    tips = dict(view.block_hover.tooltips)
    assert tips["op"] == "@op" and tips["job"] == "@job"
    assert view.figure.y_range.start == pytest.approx(1.5)
    assert view.figure.yaxis[0].major_label_overrides == {0: "device 0", 1: "device 1"}
    # without lanes every job uses the full row height
    blocks, _comm = crossover_columns(pred, lanes=False)
    assert np.allclose(np.asarray(blocks["bottom"]) - np.asarray(blocks["top"]), COMPUTE_HEIGHT)


def test_header_and_mode_switch(synthetic_modes):
    view = CrossoverView(prediction=synthetic_modes["crossover"], predictions=synthetic_modes)
    h = view.header_text
    cx = synthetic_modes["crossover"]
    assert 'class="tessel-crossover-mode">crossover<' in h
    assert fmt_ms(cx.makespan) in h
    assert fmt_rate(cx.aggregate_tokens_per_second) in h
    assert h.count('class="tessel-crossover-job"') == 2
    assert fmt_rate(cx.per_job_tokens_per_second["A"]) in h
    sp = cx.aggregate_tokens_per_second / synthetic_modes["sequential"].aggregate_tokens_per_second
    assert f"{sp:.2f}&times;" in h and sp > 1.5
    n_cx = view.block_count
    # switching the selector (what the RadioButtonGroup does) shows the other prediction
    view._mode_select.value = "sequential"
    assert view.mode == "sequential" and view.prediction is synthetic_modes["sequential"]
    h2 = view.header_text
    assert h2 != h and 'class="tessel-crossover-mode">sequential<' in h2
    assert fmt_ms(synthetic_modes["sequential"].makespan) in h2
    assert "tessel-crossover-speedup" not in h2
    assert view.block_count == n_cx  # same blocks, other times
    assert max(view.block_source.data["right"]) == pytest.approx(synthetic_modes["sequential"].makespan * 1e3)
    assert view.select_mode("uncoordinated") and 'uncoordinated<' in view.header_text


def test_mode_without_prediction_is_a_message(synthetic_modes):
    view = CrossoverView(prediction=synthetic_modes["uncoordinated"])
    assert view.mode == "uncoordinated"
    assert view.select_mode("crossover") is False
    assert "no prediction for mode 'crossover'" in view.message and view._alert.visible
    assert view.prediction is synthetic_modes["uncoordinated"]
    empty = CrossoverView()
    assert empty.block_count == 0 and "No prediction yet" in empty.header_text


def test_real_plans_and_root(dp2_plan):
    view = CrossoverView.from_plans([dp2_plan, dp2_plan], steps=2)
    pred = view.prediction
    assert pred.mode == "crossover" and set(view.predictions) == {"crossover", "uncoordinated", "sequential"}
    assert view.block_count == len(compute_events(pred)) == 2 * 2 * 3 * 2
    assert set(view.block_source.data["op"]) == {"F", "B", "OPTIM"}
    assert "tessel-crossover-speedup" in view.header_text
    root = pn.panel(view).get_root()
    assert root is not None
    css = set()
    for m in root.select({}):
        css.update(getattr(m, "css_classes", []) or [])
    assert {"tessel-crossover", "tessel-crossover-header", "tessel-crossover-plot",
            "tessel-crossover-mode-select"} <= css


def test_three_jobs_and_warning():
    jobs = [JobProfile.synthetic(n, 1e-3, 1e-3, num_devices=3, tokens_per_step=10) for n in "ABC"]
    pred = predict_profiles(jobs, "crossover", 2)
    pred.warnings.append("the co-located jobs need 90.00 GiB per device at peak")
    view = CrossoverView(prediction=pred)
    assert set(view.block_source.data["job_index"]) == {0, 1, 2}
    assert view.header_text.count('class="tessel-crossover-job"') == 3
    assert "tessel-crossover-warning" in view.header_text
    assert "90.00 GiB" in crossover_header_html(pred)
