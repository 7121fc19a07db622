"""Per-stage activation recomputation (issue 31, item 2: "per plan and per stage").

``make_plan(stage_recompute=...)`` / ``tessel plan --stage-recompute`` override the plan's
granularity stage by stage: each segment keeps what its own granularity keeps (checked against
the same model planned uniformly with that granularity), records it in the plan where it differs
from the plan's, and the runtime wraps exactly those stages' blocks in ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import json

import pytest
from cli_inprocess import cli

from engine.errors import TransformError
from engine.io import load_plan
from engine.plan import make_plan
from engine.recompute import plan_granularities

KW = dict(device_type="cpu", devices=2, micro_batches=2, schedule="1f1b")


@pytest.fixture(scope="module")
def plans():
    return {name: make_plan("llama-tiny", **KW, **kw).plan for name, kw in {
        "none": {}, "full": {"recompute": "full"},
        "full,none": {"stage_recompute": ["full", "none"]},
        "none,full": {"recompute": "full", "stage_recompute": ["none", "full"]}}.items()}


def test_each_stage_keeps_what_its_own_granularity_keeps(plans):
    mixed, back = plans["full,none"], plans["none,full"]
    assert plan_granularities(mixed) == ["full", "none"] and plan_granularities(back) == ["none", "full"]
    for plan, grans in ((mixed, ["full", "none"]), (back, ["none", "full"])):
        for i, g in enumerate(grans):
            assert plan.segments[i]["activation_bytes"] == plans[g].segments[i]["activation_bytes"]
            assert plan.segments[i]["backward_time"] == pytest.approx(plans[g].segments[i]["backward_time"])
    # a stage that recomputes nothing under a plan that recomputes records it, so a reader sees it
    assert back.segments[0]["recompute"] == "none" and back.parallel.recompute == "full"


def test_a_per_stage_plan_takes_the_layer_split_and_the_runtime_wraps_only_its_stages(plans):
    from runtime.stages import build_stages

    plan = plans["full,none"]
    assert plan.model.split == "layers"
    stages = build_stages(plan)
    wrapped = {i: {getattr(type(m), "recompute", None) for m in stages.modules[i].modules()} - {None}
               for i in stages.modules}
    assert wrapped == {0: {"full"}, 1: set()}


def test_a_wrong_count_or_name_is_one_sentence():
    with pytest.raises(TransformError, match="one per segment"):
        make_plan("llama-tiny", **KW, stage_recompute=["full", "none", "full"])


def test_the_cli_flag_plans_and_reports_it(tmp_path, capsys):
    rc, out, _ = cli(["plan", "--model", "llama-tiny", "--device-type", "cpu", "--devices", "2",
                      "--micro-batches", "2", "--stage-recompute", "full,none", "-o", str(tmp_path), "--json"], capsys)
    assert rc == 0
    assert plan_granularities(load_plan(tmp_path / "plan.json")) == ["full", "none"]
    assert json.loads(out.strip().splitlines()[-1])["stage_recompute"] == ["full", "none"]
    rc, _, err = cli(["plan", "--model", "llama-tiny", "--stage-recompute", "full,most", "-o", str(tmp_path)], capsys)
    assert rc == 2 and "'most' is not known" in err
