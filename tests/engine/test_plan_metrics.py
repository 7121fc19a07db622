"""One set of predicted numbers per plan: ``engine.plan.metrics.predicted_metrics`` from the plan
alone equals what ``tessel plan``, ``tessel search`` (plan and table) and ``tessel show`` print, and
what the plan file saves (issue 20, "Numbers that disagree")."""

from __future__ import annotations

import json
import math

import pytest

from apps.cli import main
from engine.io import load_plan, save_plan
from engine.plan import METRIC_KEYS, make_plan, model_search_plan, predicted_metrics, resimulate


def cli_json(argv: list[str], capsys) -> dict:
    """Run ``tessel ARGV --json`` in-process; its last stdout line parsed."""
    capsys.readouterr()
    try:
        rc = main([*argv, "--json"])
    except SystemExit as e:   # argparse's refusal
        rc = e.code
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out.strip().splitlines()[-1])


def saved_metrics(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)["metrics"]


def test_make_plan_metrics_survive_save_and_load(tmp_path):
    """dp=2 x pp=2 on gpt2-tiny with an explicit micro-batch shape: tokens counted independently."""
    res = make_plan("gpt2-tiny", devices=4, dp=2, micro_batches=4, micro_batch_size=2, seq_len=32, schedule="1f1b")
    path = save_plan(res.plan, tmp_path / "plan.json")
    loaded = load_plan(path)
    m = predicted_metrics(loaded)
    assert set(METRIC_KEYS) <= set(m)
    saved = saved_metrics(path)
    assert {k: saved[k] for k in METRIC_KEYS} == {k: m[k] for k in METRIC_KEYS}
    assert resimulate(loaded).makespan == m["makespan"]
    # micro_batch_size x seq_len x micro-batches x data replicas, from the arguments above
    assert m["tokens_per_step"] == 2 * 32 * 4 * 2
    assert m["tokens_per_second"] > 0
    assert m["tokens_per_second"] == pytest.approx(m["tokens_per_step"] / m["makespan"], rel=1e-12)
    assert m["time_unit"] == "s"


def test_plan_and_show_print_the_same_numbers(tmp_path, capsys):
    out = tmp_path / "p"
    planned = cli_json(["plan", "--model", "gpt2-tiny", "--schedule", "1f1b", "--micro-batches", "8",
                        "-o", str(out)], capsys)
    shown = cli_json(["show", str(out / "plan.json")], capsys)
    m = predicted_metrics(load_plan(out / "plan.json"))
    assert planned["makespan"] == shown["makespan"] == m["makespan"] == saved_metrics(out / "plan.json")["makespan"]
    assert shown["peak_memory"] == m["peak_memory"]
    assert shown["tokens_per_second"] == m["tokens_per_second"] == planned["tokens_per_second"]


@pytest.fixture(scope="module")
def m_search():
    """A model search on Tessel's M placement (embedding and LM head on all devices)."""
    return model_search_plan("gpt2-tiny", "m", 4, 4, seq_len=32, time_limit=2.0, seed=0)


def test_search_plan_metrics_survive_save_and_load(m_search, tmp_path):
    sp = m_search
    path = save_plan(sp.plan, tmp_path / "plan.json")
    m = predicted_metrics(load_plan(path))
    saved = saved_metrics(path)
    assert {k: saved[k] for k in METRIC_KEYS} == {k: m[k] for k in METRIC_KEYS}
    assert sp.timeline.makespan == m["makespan"]
    # gpt2-tiny ties wte and lm_head: the search plan records the group, as make_plan's plans do
    names = sorted(n for g in sp.plan.tied_weights for _, n in g["members"])
    assert names == ["lm_head.weight", "transformer.wte.weight"]
    assert m["tokens_per_step"] == 1 * 32 * 4 * 1
    assert m["tokens_per_second"] > 0
    assert m["tokens_per_second"] == pytest.approx(m["tokens_per_step"] / m["makespan"], rel=1e-12)


def test_search_baseline_rows_are_their_plans_predictions(m_search):
    """The table's GPipe row on M is the GPipe plan of the same model, as `tessel show` would print it."""
    from engine.baselines.generic import gpipe_any

    sp = m_search
    sched = gpipe_any(sp.placement, 4)
    row = sp.v_baselines()[0]
    assert row.name == "gpipe (V)"
    v_plan = sp.plan_for(row.schedule)
    assert row.makespan == predicted_metrics(v_plan)["makespan"]
    assert sp.predict(sched)["makespan"] == predicted_metrics(sp.plan_for(sched))["makespan"]


def test_search_table_and_show_agree_on_m(tmp_path, capsys):
    out = tmp_path / "s"
    searched = cli_json(["search", "--model", "gpt2-tiny", "--placement", "m", "--devices", "4",
                         "--micro-batches", "4", "--seq-len", "32", "--time-limit", "2", "-o", str(out)], capsys)
    shown = cli_json(["show", str(out / "plan.json")], capsys)
    assert searched["makespan"] == shown["makespan"]
    assert searched["bubble_ratio"] == shown["bubble_ratio"]
    assert shown["tokens_per_second"] > 0 and searched["tokens_per_second"] == shown["tokens_per_second"]
    assert math.isclose(shown["tokens_per_second"], 1 * 32 * 4 / shown["makespan"], rel_tol=1e-12)


def test_the_same_1f1b_predicts_the_same_from_plan_and_search():
    """`tessel plan --schedule 1f1b` and the 1F1B row of `tessel search --placement v` run the same
    schedule on the same segments (tied copies included): one makespan and one peak memory per
    device (the search's placement counts the last stage's copy of GPT-2's tied ``wte``)."""
    from engine.baselines import build_schedule

    planned = make_plan("gpt2-tiny", devices=4, micro_batches=4, seq_len=32, schedule="1f1b").plan
    sp = model_search_plan("gpt2-tiny", "v", 4, 4, seq_len=32, time_limit=1.0, seed=0)
    sched = build_schedule("1f1b", sp.placement, 4)
    assert sched.orders == planned.schedule.orders
    assert [s["param_bytes"] for s in sp.plan.segments] == [s["param_bytes"] for s in planned.segments]
    assert sp.predict(sched)["makespan"] == planned.metrics["makespan"]
    assert sp.predict(sched)["peak_memory"] == planned.metrics["peak_memory"]


def test_the_searched_placement_counts_tied_copies_as_the_plan_does():
    """The placement the Tessel search schedules under a memory limit holds the last stage's copy
    of GPT-2's tied ``wte``/``lm_head`` (3x: weights and Adam's m, v), as make_plan's does; it
    held 601,344 of the plan's 797,952 bytes on device 3, so a search could break the limit."""
    from engine.cost import CostModel
    from engine.graph import capture
    from engine.models import build_model
    from engine.shape_costs import model_shape_placement

    planned = make_plan("gpt2-tiny", devices=4, micro_batches=4, seq_len=32, schedule="1f1b",
                        precision="32-true").plan
    bundle = build_model("gpt2-tiny", seq_len=32)
    graph = capture(bundle.module, bundle.example_inputs, name=bundle.name)
    pl, _ = model_shape_placement(graph, CostModel.for_device("h100"), "v", 4, tied_module=bundle.module)
    assert pl.static_memory == planned.placement.static_memory
    assert pl.grad_memory == planned.placement.grad_memory


def test_x_search_counts_both_model_replicas_tokens():
    """Tessel's X runs two model replicas per instance: twice the tokens of its micro-batches."""
    sp = model_search_plan("gpt2-tiny", "x", 4, 2, seq_len=16, time_limit=1.0, seed=0)
    m = predicted_metrics(sp.plan)
    assert m["tokens_per_step"] == 1 * 16 * 2 * 2
    assert m["tokens_per_second"] == pytest.approx(m["tokens_per_step"] / m["makespan"], rel=1e-12)
    assert m == {k: sp.plan.metrics[k] for k in m}


def test_search_tables_1f1b_row_is_tessel_plans_1f1b(tmp_path, capsys):
    """The 1F1B row of a V search is the predefined 1F1B that `tessel plan --schedule 1f1b` runs on the
    same model (gpt2-tiny's stages are uneven, where the list-scheduling policy drifts from it)."""
    common = ["--model", "gpt2-tiny", "--micro-batches", "4", "--seq-len", "32"]
    planned = cli_json(["plan", *common, "--schedule", "1f1b", "-o", str(tmp_path / "p")], capsys)
    searched = cli_json(["search", *common, "--placement", "v", "--time-limit", "1", "-o", str(tmp_path / "s")], capsys)
    assert searched["baselines"]["1f1b"]["makespan"] == planned["makespan"]
