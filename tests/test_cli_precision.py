"""``tessel plan / search / show`` with precision policies and recomputation (issue 31, items 6, 7):
the flags, the device defaults, the refusal of a contradicting pair, what every report states,
and old plan files loading as ``32-true``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_inprocess import cli

from engine.io import load_plan
from engine.plan import predicted_metrics

DATA = Path(__file__).parent / "data"



def _json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_plan_on_h100_defaults_to_bf16_mixed_and_states_the_facts(tmp_path, capsys):
    rc, out, _ = cli(["plan", "--model", "gpt2-tiny", "--devices", "2", "--micro-batches", "4", "--seq-len", "32",
                      "-o", str(tmp_path)], capsys)
    assert rc == 0
    assert "precision bf16-mixed, sequence length 32, global batch 4 sequences, recomputation none" in out
    assert "MFU" in out and "TFLOP/s per device" in out and "micro-batches in flight" in out
    plan = load_plan(tmp_path / "plan.json")
    assert plan.parallel.precision == "bf16-mixed" and plan.model.dtype == "bfloat16"
    rc, out, _ = cli(["plan", "--model", "gpt2-tiny", "--devices", "2", "--micro-batches", "4", "--seq-len", "32",
                      "--precision", "16-mixed", "--recompute", "full", "-o", str(tmp_path), "--json"], capsys)
    j = _json(out)
    assert rc == 0 and j["precision"] == "16-mixed" and j["recompute"] == "full"
    assert j["seq_len"] == 32 and j["global_batch"] == 4
    assert j["model_flops"] > 0 and 0 < j["mfu"] < 1 and j["memory_breakdown"]["micro_batches_in_flight"] >= 1
    saved = load_plan(tmp_path / "plan.json")
    assert saved.parallel.recompute == "full" and saved.parallel.precision == "16-mixed"


def test_dtype_alone_keeps_its_meaning_and_cpu_defaults_to_32_true(tmp_path, capsys):
    base = ["plan", "--model", "gpt2-tiny", "--devices", "1", "--micro-batches", "1", "--seq-len", "16", "--json"]
    for extra, policy in ((["--dtype", "float32"], "32-true"), (["--dtype", "bfloat16"], "bf16-true"),
                          (["--device-type", "cpu"], "32-true")):
        rc, out, _ = cli([*base, *extra, "-o", str(tmp_path / policy)], capsys)
        assert rc == 0 and _json(out)["precision"] == policy


@pytest.mark.parametrize("command", ["plan", "search"])
def test_a_contradicting_dtype_and_precision_is_one_sentence_exit_2(tmp_path, capsys, command):
    argv = [command, "--model", "gpt2-tiny", "--devices", "2", "--micro-batches", "2", "--precision", "bf16-mixed",
            "--dtype", "float16", "-o", str(tmp_path)]
    rc, out, err = cli(argv, capsys)
    lines = err.strip().splitlines()
    assert rc == 2
    assert len(lines) == 1 and "Traceback" not in err
    assert "--dtype float16 contradicts --precision bf16-mixed" in lines[0]
    assert lines[0].rstrip().endswith(".") or "give only --precision" in lines[0]


def test_an_unknown_precision_or_recomputation_is_refused(tmp_path, capsys):
    rc, _, err = cli(["plan", "--precision", "fp8", "-o", str(tmp_path)], capsys)
    assert rc == 2 and "32-true, bf16-mixed, 16-mixed, bf16-true" in err
    rc, _, err = cli(["plan", "--recompute", "half", "-o", str(tmp_path)], capsys)
    assert rc == 2 and "none, selective, full" in err


def test_search_with_a_model_takes_precision_and_reports_it(tmp_path, capsys):
    rc, out, _ = cli(["search", "--model", "gpt2-tiny", "--devices", "2", "--micro-batches", "2", "--seq-len", "32",
                      "--time-limit", "1", "--precision", "bf16-true", "--recompute", "selective",
                      "-o", str(tmp_path), "--json"], capsys)
    j = _json(out)
    assert rc == 0 and j["precision"] == "bf16-true" and j["recompute"] == "selective"
    assert j["seq_len"] == 32 and j["global_batch"] == 2 and j["model_flops"] > 0 and j["mfu"] > 0
    plan = load_plan(tmp_path / "plan.json")
    assert plan.parallel.precision == "bf16-true" and plan.model.dtype == "bfloat16"
    # without --model: an abstract plan has no precision facts nor MFU
    rc, out, _ = cli(["search", "--devices", "2", "--micro-batches", "2", "--time-limit", "1",
                      "-o", str(tmp_path / "abstract"), "--json"], capsys)
    assert rc == 0 and "mfu" not in _json(out)


def test_show_states_the_facts_and_mfu(tmp_path, capsys):
    rc, _, _ = cli(["plan", "--model", "gpt2-tiny", "--devices", "2", "--micro-batches", "2", "--seq-len", "32",
                    "-o", str(tmp_path)], capsys)
    rc, out, _ = cli(["show", str(tmp_path / "plan.json")], capsys)
    assert rc == 0 and "precision bf16-mixed, sequence length 32, global batch 2 sequences" in out and "MFU" in out
    rc, out, _ = cli(["show", str(tmp_path / "plan.json"), "--json"], capsys)
    j = _json(out)
    assert j["precision"] == "bf16-mixed" and j["mfu"] == load_plan(tmp_path / "plan.json").metrics["mfu"]


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("plan_v1_*.json")))
def test_old_plans_load_as_32_true_and_resave_identically(name):
    raw = json.loads((DATA / name).read_text())
    plan = load_plan(DATA / name)
    assert plan.parallel.precision == "32-true" and plan.parallel.recompute == "none"
    assert plan.to_dict() == raw
    # the memory of an old (32-true) plan is what it was saved with; so is the makespan of a
    # predefined schedule (the searched plan's saved makespan predates a simulator change on main)
    m = predicted_metrics(plan)
    if "peak_memory" in raw["metrics"]:
        assert m["peak_memory"] == raw["metrics"]["peak_memory"]
    if "makespan" in raw["metrics"] and "search" not in name:
        assert m["makespan"] == pytest.approx(raw["metrics"]["makespan"], rel=1e-12)


def test_app_header_states_precision_and_mfu():
    """The Gantt header (planner_ui.gantt_edit.header_html) shows the plan's precision, sequence,
    batch, recomputation, TFLOP/s per device and MFU as ``tessel show`` computes them."""
    from types import SimpleNamespace

    from engine.plan import make_plan
    from planner_ui.gantt_edit import header_html

    res = make_plan("gpt2-tiny", devices=2, micro_batches=2, seq_len=32, recompute="selective")
    m = res.timeline.metrics()
    state = SimpleNamespace(plan=res.plan, timeline=res.timeline, schedule=res.plan.schedule, measured=None,
                            memory_limit=None, abstract=False, metrics=lambda: m,
                            fmt_time=lambda s: f"{s * 1e3:.3f} ms")
    html = header_html(state)
    assert '<span class="tessel-precision">bf16-mixed</span>, seq 32, global batch 2, recompute selective' in html
    assert f'MFU <b class="tessel-mfu">{res.plan.metrics["mfu"]:.1%}</b>' in html
    assert f'<b class="tessel-tflops">{res.plan.metrics["tflops_per_device"]:,.1f}</b>' in html


def test_plan_form_takes_precision_and_recompute():
    """The app's "Plan a model" form plans with its precision and recomputation (``default``: the
    device type's policy)."""
    from planner_ui.plan_form import PlanForm
    from planner_ui.state import PlanState

    state = PlanState()
    form = PlanForm(state=state, model="gpt2-tiny", devices=2, micro_batches=2)
    assert form.plan() and state.plan.parallel.precision == "bf16-mixed"
    form.precision, form.recompute, form.device_type = "16-mixed", "full", "a100"
    assert form.plan()
    assert (state.plan.parallel.precision, state.plan.parallel.recompute) == ("16-mixed", "full")
    assert "16-mixed, recompute full" in state.message
