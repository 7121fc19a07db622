"""The Co-locate tab predicts on a chosen link: the plan's own, a preset or any parse_link spelling.

Checked against the engine on its own: ``compare_modes`` on plans made with
``make_plan(..., link="emulated:1gbit")``. The model (gpt2-small-cpu, 8 x 128 tokens per
micro-batch) computes about as long per step (~0.22 s) as its 19.5 MB of gradients take to
all-reduce on the shared 1 Gbit/s medium (~0.31 s), the case crossover is for; with 1 x 16
tokens the compute (~5 ms) would be too short to hide anything behind on that link.
"""

from __future__ import annotations

import html
import re

import pytest

from engine.crossover import compare_modes
from engine.plan import make_plan, resimulate
from planner_ui.colocate_panel import LINK_CHOICES, ColocatePanel, plan_on_link
from planner_ui.crossover_view import fmt_rate
from planner_ui.state import PlanState

PLAN_ARGS = dict(devices=2, dp=2, micro_batches=1, micro_batch_size=8, seq_len=128, device_type="cpu")
STEPS = 4


@pytest.fixture(scope="module")
def plans():
    """``{link: plan}``: the dp=2 plan on its own link (loopback) and planned on emulated:1gbit."""
    return {None: make_plan("gpt2-small-cpu", **PLAN_ARGS).plan,
            "emulated:1gbit": make_plan("gpt2-small-cpu", link="emulated:1gbit", **PLAN_ARGS).plan}


@pytest.fixture()
def panel(plans):
    state = PlanState()
    state.load(plans[None])
    return ColocatePanel(state=state, steps=STEPS)


def gain(preds) -> float:
    return preds["crossover"].aggregate_tokens_per_second / preds["sequential"].aggregate_tokens_per_second


def header(panel) -> str:
    return html.unescape(panel.view.header_text)


def assert_same(preds, expected) -> None:
    for mode, e in expected.items():
        p = preds[mode]
        assert p.aggregate_tokens_per_second == pytest.approx(e.aggregate_tokens_per_second, rel=1e-9), mode
        assert p.makespan == pytest.approx(e.makespan, rel=1e-9), mode
        assert p.comm_times == pytest.approx(e.comm_times, rel=1e-9), mode
        assert p.compute_times == pytest.approx(e.compute_times, rel=1e-9), mode


def test_emulated_1gbit_reprediction_matches_the_engine(panel, plans):
    # the plan's own link (the default) predicts as before
    assert panel.link == "" and panel.predict()
    own = panel.view.predictions
    assert_same(own, compare_modes([plans[None]] * 2, steps=STEPS))
    text = header(panel)
    assert "plan's own link: loopback" in text and 'class="tessel-crossover-link"' in text
    assert fmt_rate(own["crossover"].aggregate_tokens_per_second) in text

    # emulated 1 Gbit/s: the same numbers as plans made on that link
    assert panel.set_link("emulated:1gbit")
    slow = panel.view.predictions
    assert_same(slow, compare_modes([plans["emulated:1gbit"]] * 2, steps=STEPS))
    # ring all-reduce of the gradients on one medium shared by both ranks: 2 x bytes / 125e6 B/s
    grad_bytes = sum(s["param_bytes"] for s in plans[None].segments)
    m = slow["crossover"].comm_times["A"]
    assert m == pytest.approx(2 * grad_bytes / 125e6, rel=2e-3)
    assert m > 20 * own["crossover"].comm_times["A"]
    assert slow["crossover"].compute_times == pytest.approx(own["crossover"].compute_times)
    # every mode is slower, and crossover hides more of the (now longer) all-reduce
    for mode in own:
        assert slow[mode].aggregate_tokens_per_second < own[mode].aggregate_tokens_per_second
    assert gain(slow) > gain(own) + 0.3, (gain(slow), gain(own))
    text = header(panel)
    assert "emulated:1gbit (1 Gbit/s shared by all ranks, 75 us)" in text
    assert fmt_rate(slow["crossover"].aggregate_tokens_per_second) in text
    assert panel.state.message_kind == "success" and "on emulated:1gbit predicted" in panel.state.message
    assert panel.link_select.value == "emulated:1gbit"


def test_a_wrong_link_spelling_leaves_the_prediction_and_says_so(panel):
    assert panel.set_link("emulated:1gbit")
    before, shown = panel.view.prediction, panel.view.header_text
    for wrong in ("emulated:fast", "ethernet", "10gbit@soon"):
        assert not panel.set_link(wrong), wrong
        msg = panel.state.message
        assert panel.state.message_kind == "error" and "unchanged" in msg, msg
        assert not re.search(r"[.!?]\s+[A-Z]", msg) and "\n" not in msg, msg      # one sentence
        assert panel.link == "emulated:1gbit"
        assert panel.view.prediction is before and panel.view.header_text == shown
    # the text box does the same
    panel.link_text.value = "token-ring"
    assert "unknown link 'token-ring'" in panel.state.message and panel.view.prediction is before


def test_selector_and_text_box_re_predict(panel, plans):
    assert set(LINK_CHOICES) == {"plan's own link", "unshaped loopback", "emulated 1 Gbit/s", "emulated 10 Gbit/s"}
    panel.link_select.value = LINK_CHOICES["emulated 10 Gbit/s"]
    assert panel.link == "emulated:10gbit"
    fast = panel.view.predictions["crossover"]
    assert "emulated:10gbit (10 Gbit/s shared" in header(panel)
    # unshaped loopback = what this CPU plan was costed with
    panel.link_select.value = LINK_CHOICES["unshaped loopback"]
    loop = panel.view.predictions
    assert_same(loop, compare_modes([plans[None]] * 2, steps=STEPS))
    assert fast.comm_times["A"] > loop["crossover"].comm_times["A"]
    assert "loopback (20 Gbit/s per rank, 75 us)" in header(panel)
    # any parse_link spelling: a full-duplex 10 Gbit/s link per rank, shown as a custom choice
    panel.link_text.value = "10gbit@5us"
    assert panel.link == "10gbit@5us" and panel.link_select.value == "10gbit@5us"
    assert "custom: 10gbit@5us" in panel.link_select.options
    per_rank = panel.view.predictions["crossover"]
    assert per_rank.comm_times["A"] < fast.comm_times["A"]   # each rank has its own 10 Gbit/s
    assert "10gbit@5us (10 Gbit/s per rank, 5 us)" in header(panel)
    # back to the plan's own link: the custom entry goes, the text box empties
    panel.link_select.value = ""
    assert panel.link == "" and panel.link_text.value == ""
    assert not any(k.startswith("custom") for k in panel.link_select.options)
    assert "plan's own link" in header(panel)


def test_plan_on_link_re_costs_point_to_point_transfers_too():
    """A pipeline plan's SEND/RECV follow the link as well (plan_on_link is not all-reduce only)."""
    args = dict(devices=2, micro_batches=4, device_type="cpu")
    base = make_plan("gpt2-tiny", **args).plan
    slow = make_plan("gpt2-tiny", link="emulated:1gbit", **args)
    moved = plan_on_link(base, "emulated:1gbit")
    assert moved.meta["link"] == "emulated:1gbit" and "link" not in base.meta
    tl = resimulate(moved)
    assert tl.makespan == pytest.approx(slow.timeline.makespan, rel=1e-9)
    assert tl.makespan > resimulate(base).makespan
    sends = [e for e in tl.events if e.op == "SEND"]
    assert sends and sum(e.duration for e in sends) > sum(e.duration for e in resimulate(base).events
                                                          if e.op == "SEND")


def test_a_link_given_at_construction_is_shown_and_used(plans):
    state = PlanState()
    state.load(plans[None])
    panel = ColocatePanel(state=state, steps=STEPS, link="10gbit@5us")
    assert panel.link_select.value == "10gbit@5us" and "custom: 10gbit@5us" in panel.link_select.options
    assert panel.predict() and "10gbit@5us (10 Gbit/s per rank, 5 us)" in header(panel)
    assert panel.set_link("Emulated:1Gbit") and panel.link == "emulated:1gbit"
    assert panel.link_select.value == "emulated:1gbit" and not any(k.startswith("custom")
                                                                   for k in panel.link_select.options)
