"""The planner's memory model knows the optimizer: Adam with gradient accumulation holds a
gradient buffer from a stage's first backward to the optimizer step; AdamA holds none (only a
transient gradient of the largest parameter tensor while a backward runs)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from engine.baselines import build_schedule
from engine.baselines.generic import one_f_one_b_any
from engine.dependency import lower
from engine.errors import TransformError
from engine.io.placement_json import placement_from_dict, placement_to_dict
from engine.io.plan import Plan, load_plan, save_plan
from engine.placement import PlacementError, pipeline_placement
from engine.plan import make_plan, resimulate
from engine.schedule import gradient_events, memory_profile, peak_memory
from engine.simulate import simulate
from engine.transform import PARAM_STATE_FACTOR, gradient_bytes, training_state_bytes

MODEL = "gpt2-small-cpu"  # 4.9M parameters, byte vocabulary, plans in a few seconds


@pytest.fixture(scope="module")
def plans():
    return {opt: make_plan(MODEL, devices=2, micro_batches=8, schedule="1f1b", device_type="cpu", optimizer=opt)
            for opt in ("adam", "adama")}


def _tied(res) -> list[int]:
    """Bytes of tied copies per segment (wte on the first, lm_head on the last segment): AdamA does
    not fold their gradients (their sum over copies is only known at the step), so it holds them
    like Adam until the optimizer step (``runtime.worker`` module docstring)."""
    out = [0] * len(res.plan.segments)
    for g in res.plan.tied_weights:
        for seg in {m[0] for m in g["members"]}:
            out[seg] += g["nbytes"]
    return out


def _value_at(curve, t):
    """Value of a step-function memory curve at time ``t`` (the last point at or before ``t``)."""
    v = curve[0][1]
    for tt, vv in curve:
        if tt <= t:
            v = vv
        else:
            break
    return v


def test_optimizer_is_recorded_and_static_memory_is_params_and_moments(plans):
    for opt, res in plans.items():
        assert res.plan.parallel.optimizer == opt
        pl = res.plan.placement
        seg_bytes = [s["param_bytes"] for s in res.plan.segments]
        assert list(pl.static_memory) == [PARAM_STATE_FACTOR * b for b in seg_bytes]
        assert all(s["max_param_bytes"] > 0 for s in res.plan.segments)
    adam, adama = plans["adam"].plan.placement, plans["adama"].plan.placement
    assert list(adam.grad_memory) == [s["param_bytes"] for s in plans["adam"].plan.segments]
    # gpt2-small-cpu ties wte and lm_head (256 x 256 float32), one copy on each of the 2 stages
    assert _tied(plans["adama"]) == [256 * 256 * 4] * 2
    assert list(adama.grad_memory) == _tied(plans["adama"])
    assert adam.grad_transient == adama.grad_transient
    # gpt2-small-cpu's largest tensor is an MLP weight 256 x 1024 in float32
    assert list(adama.grad_transient) == [256 * 1024 * 4] * 2


def test_adama_peak_is_lower_by_the_segment_gradient_bytes(plans):
    adam, adama = plans["adam"], plans["adama"]
    seg_bytes = [s["param_bytes"] for s in adam.plan.segments]
    tied = _tied(adama)
    pa, pb = adam.plan.metrics["peak_memory"], adama.plan.metrics["peak_memory"]
    for d in range(2):
        # 1F1B's steady state backwards run with the same activations in flight and the same
        # transient gradient; only the resident gradient buffer differs (AdamA keeps the tied copy's)
        assert pa[d] - pb[d] == seg_bytes[d] - tied[d]
        assert 0.1 < (pa[d] - pb[d]) / pa[d] < 0.25  # 4.9M parameters on 2 stages, 8 micro-batches: 11-15 %
    # same schedule, same timing: only memory changes
    assert adam.timeline.makespan == pytest.approx(adama.timeline.makespan)


def test_adam_memory_steps_up_at_the_first_backward_not_at_zero(plans):
    adam, adama = plans["adam"], plans["adama"]
    seg_bytes = [s["param_bytes"] for s in adam.plan.segments]
    for d in range(2):
        static = adam.plan.placement.static_memory[d]
        curve = adam.timeline.memory[d]
        assert curve[0] == (0.0, static)  # parameters + m + v at t=0, no gradients
        first_b = min(e.start for e in adam.timeline.events if e.rank == d and e.op == "B")
        before = [v for t, v in curve if t < first_b]
        b_curve = adama.timeline.memory[d]
        # until the first backward both optimizers hold the same (parameters, states, activations)
        assert max(before) == max(v for t, v in b_curve if t < first_b)
        at = _value_at(curve, first_b)
        assert at - _value_at(curve, first_b - 1e-12) == seg_bytes[d]  # the buffer appears at 0B0's start
        # AdamA: the tied copy's gradient is kept from the first backward on (its buffer is that
        # block's allocation: engine.schedule.gradient_events counts a block's transient only when
        # it allocates no buffer); later backwards add only the transient gradient while they run
        assert _value_at(b_curve, first_b) - _value_at(b_curve, first_b - 1e-12) == _tied(adama)[d]
        second_b = sorted(e.start for e in adama.timeline.events if e.rank == d and e.op == "B")[1]
        assert _value_at(b_curve, second_b) - _value_at(b_curve, second_b - 1e-12) == \
            adama.plan.placement.grad_transient[d]
        # the optimizer step releases the buffer: both end at the static memory
        optim = next(e for e in adam.timeline.events if e.rank == d and e.op == "OPTIM")
        assert _value_at(curve, optim.end - 1e-12) == static + seg_bytes[d]
        assert curve[-1] == (optim.end, static)
        assert b_curve[-1][1] == static


def test_order_based_peak_matches_the_simulated_peak(plans):
    for res in plans.values():
        assert peak_memory(res.plan.schedule) == res.timeline.peak_memory()
        prof = memory_profile(res.plan.schedule)
        for d, row in enumerate(prof):  # the buffer (adam) stays until the end of the order
            assert row[-1] == res.plan.placement.static_memory[d] + res.plan.placement.grad_memory[d]


def test_single_device_prediction_drops_by_the_model_gradient_bytes():
    a = make_plan(MODEL, devices=1, micro_batches=4, device_type="cpu", optimizer="adam")
    b = make_plan(MODEL, devices=1, micro_batches=4, device_type="cpu", optimizer="adama")
    params = a.graph.graph["param_bytes"]
    assert a.plan.metrics["peak_memory"][0] - b.plan.metrics["peak_memory"][0] == params


def test_gradient_events_hold_once_then_transient():
    pl = pipeline_placement(1, activation_bytes=10, static_memory=[300])
    adam = replace(pl, grad_memory=(100,), grad_transient=(7,))
    adama = replace(pl, grad_memory=(0,), grad_transient=(7,))
    s_adam = build_schedule("1f1b", adam, 3)
    s_adama = build_schedule("1f1b", adama, 3)
    order = s_adam.orders[0]
    ev = gradient_events(adam, order)
    kinds = [b.kind for b in order]
    assert [e for e, k in zip(ev, kinds) if k == "B"] == [(100, 0), (0, 7), (0, 7)]
    assert all(e == (0, 0) for e, k in zip(ev, kinds) if k == "F")
    assert [e for e, k in zip(gradient_events(adama, order), kinds) if k == "B"] == [(0, 7)] * 3
    # F B F B F B: peaks 300 + 10 + 100 (first B) / + 7 on later Bs
    assert peak_memory(s_adam) == [300 + 10 + 100 + 7]
    assert peak_memory(s_adama) == [300 + 10 + 7]
    tl = simulate(lower(s_adam))
    assert tl.peak_memory() == [417] and tl.memory[0][-1][1] == 300
    assert [i.memory for i in lower(s_adam).streams[0] if i.op == "OPTIM"] == [-100]


def test_split_backward_allocates_at_the_weight_gradient_block():
    pl = replace(pipeline_placement(2, activation_bytes=10, split_backward=True, static_memory=[0, 0]),
                 grad_memory=(50, 60), grad_transient=(5, 6))
    s = build_schedule("zb-h1", pl, 4)
    for d, order in enumerate(s.orders):
        ev = gradient_events(pl, order)
        holds = [(b.kind, h) for b, (h, _) in zip(order, ev) if h]
        assert holds == [("W", pl.grad_memory[d])]  # I blocks compute no weight gradient
        assert all(t == 0 for b, (_, t) in zip(order, ev) if b.kind == "I")
    assert peak_memory(s) == simulate(lower(s)).peak_memory()


def test_placement_validates_and_serialises_gradient_memory(tmp_path):
    pl = pipeline_placement(2, activation_bytes=10, static_memory=[30, 30])
    with pytest.raises(PlacementError, match="one value per segment"):
        replace(pl, grad_memory=(1, 2, 3))
    with pytest.raises(PlacementError, match="non-negative"):
        replace(pl, grad_transient=(1, -2))
    g = replace(pl, grad_memory=(10, 20), grad_transient=(3, 4))
    assert placement_from_dict(json.loads(json.dumps(placement_to_dict(g, header=False))), embedded=True) == g
    assert placement_from_dict(json.loads(json.dumps(placement_to_dict(g)))) == g
    assert "grad_memory" not in placement_to_dict(pl)  # unchanged JSON for placements without gradients
    assert [g.reserved_bytes(d) for d in range(2)] == [30 + 10 + 3, 30 + 20 + 4]


def test_plan_round_trip_keeps_the_optimizer_and_the_prediction(plans, tmp_path):
    res = plans["adama"]
    path = save_plan(res.plan, tmp_path / "plan.json")
    back = load_plan(path)
    assert back.parallel.optimizer == "adama"
    assert back.placement == res.plan.placement
    assert resimulate(back).peak_memory() == res.timeline.peak_memory()
    # an old plan (no gradient fields, 4x static) re-simulates as before
    old = res.plan.to_dict()
    del old["placement"]["grad_transient"]
    old["placement"]["static_memory"] = [4 * s["param_bytes"] for s in old["segments"]]
    old["parallel"]["optimizer"] = "adam"
    tl = resimulate(Plan.from_dict(old))
    assert tl.memory[0][0][1] == 4 * old["segments"][0]["param_bytes"]


def test_data_parallel_adama_all_reduces_both_moments():
    a = make_plan("gpt2-tiny", devices=4, dp=2, micro_batches=4, device_type="cpu", optimizer="adam")
    b = make_plan("gpt2-tiny", devices=4, dp=2, micro_batches=4, device_type="cpu", optimizer="adama")
    ar_a = {e.segment: e.nbytes for e in a.timeline.events if e.op == "ALLREDUCE" and e.segment >= 0}
    ar_b = {e.segment: e.nbytes for e in b.timeline.events if e.op == "ALLREDUCE" and e.segment >= 0}
    tied = _tied(b)
    assert sorted(ar_a) == sorted(ar_b) == [0, 1] and all(x > 0 for x in ar_a.values())
    # m and v of the folded parameters (2x) plus the tied copy's gradient once (runtime.worker's
    # flat [m | v | tied gradients] buffer)
    assert all(ar_b[s] == 2 * (ar_a[s] - tied[s]) + tied[s] for s in ar_a)
    # the tied all-reduce itself carries one copy's gradient with either optimizer
    tied_a = [e.nbytes for e in a.timeline.events if e.name == "allreduce tied"]
    tied_b = [e.nbytes for e in b.timeline.events if e.name == "allreduce tied"]
    assert tied_a == tied_b == [b.plan.tied_weights[0]["nbytes"]] * 2


def test_stage_split_bound_uses_the_optimizer():
    p, t = 1000, 100
    assert gradient_bytes("adam", p, t) == (p, t) and gradient_bytes("adama", p, t) == (0, t)
    assert training_state_bytes("adam", p, t) == 4 * p + t
    assert training_state_bytes("adama", p, t) == 3 * p + t
    # a limit between the two bounds: adam's split cannot fit (warning), adama's can
    probe = make_plan(MODEL, devices=1, micro_batches=1, device_type="cpu", optimizer="adama")
    seg = probe.plan.segments[0]
    need_adam = training_state_bytes("adam", seg["param_bytes"], seg["max_param_bytes"]) + seg["activation_bytes"]
    need_adama = training_state_bytes("adama", seg["param_bytes"], seg["max_param_bytes"]) + seg["activation_bytes"]
    limit = (need_adam + need_adama) / 2
    from engine.cost import CostModel
    from engine.transform import ParallelConfig, split_segments

    cost = CostModel.from_dict(probe.plan.cost)
    cfg = ParallelConfig(micro_batches=1)
    _, warn_adam = split_segments(probe.graph, cost, cfg, memory_limit=limit, optimizer="adam")
    _, warn_adama = split_segments(probe.graph, cost, cfg, memory_limit=limit, optimizer="adama")
    assert any("no split" in w for w in warn_adam) and not warn_adama


def test_memory_limited_scheduler_counts_the_gradient_buffer():
    base = pipeline_placement(2, activation_bytes=10, static_memory=[100, 100])
    pl = replace(base, grad_memory=(40, 40), grad_transient=(5, 5))
    limit = 100 + 40 + 5 + 2 * 10  # room for two micro-batches in flight on device 0
    s = one_f_one_b_any(pl, 8, memory_limit=limit)
    s.validate(limit)
    assert max(peak_memory(s)) <= limit


def test_unknown_optimizer_is_refused():
    with pytest.raises(TransformError, match="unknown optimizer 'sgd'"):
        make_plan("gpt2-tiny", devices=1, micro_batches=1, optimizer="sgd")


def test_model_shape_placement_knows_the_optimizer():
    from engine.cost import CostModel
    from engine.graph import capture
    from engine.models import build_model
    from engine.shape_costs import model_shape_placement

    bundle = build_model("gpt2-tiny")
    graph = capture(bundle.module, bundle.example_inputs, name=bundle.name)
    cost = CostModel.for_device("cpu")
    pa, _ = model_shape_placement(graph, cost, "m", 2, optimizer="adam")
    pb, _ = model_shape_placement(graph, cost, "m", 2, optimizer="adama")
    assert pa.static_memory == pb.static_memory and sum(pb.grad_memory) == 0
    assert sum(pa.grad_memory) > 0 and pa.grad_transient == pb.grad_transient
    # the M shape's all-device segment splits its gradient over both devices, like its parameters
    for d in range(2):
        buf = sum(pa.grad_bytes(s) for s in pa.grad_segments_on(d))
        assert pa.reserved_bytes(d) - pb.reserved_bytes(d) == buf > 0


def test_cli_plan_optimizer_flag(tmp_path, capsys):
    from apps.cli import main

    assert main(["plan", "--model", "gpt2-tiny", "--devices", "2", "--micro-batches", "4", "--device-type", "cpu",
                 "--optimizer", "adama", "-o", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["parallel"]["optimizer"] == "adama"
    assert load_plan(tmp_path / "plan.json").parallel.optimizer == "adama"
