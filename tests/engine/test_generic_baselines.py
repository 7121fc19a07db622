"""GPipe and 1F1B policies on any placement (engine.baselines.generic)."""

from __future__ import annotations

import time

import pytest

from engine.baselines import build_schedule
from engine.baselines.generic import gpipe_any, in_flight_caps, one_f_one_b_any
from engine.dependency import lower
from engine.errors import ScheduleError
from engine.placement import pipeline_placement
from engine.schedule import peak_memory, validate
from engine.shapes import custom_placement, make_shape
from engine.simulate import simulate


def makespan(schedule) -> float:
    return simulate(lower(schedule)).makespan


# ------------------------------------------------------------------ V: same as the predefined schedules
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("m", [4, 8])
def test_v_matches_predefined(n, m):
    pl = pipeline_placement(n, forward=1.0, backward=2.0, activation_bytes=1)
    g, ref_g = gpipe_any(pl, m), build_schedule("gpipe", pl, m)
    assert makespan(g) == pytest.approx(makespan(ref_g))
    assert g.orders == ref_g.orders
    o, ref_o = one_f_one_b_any(pl, m), build_schedule("1f1b", pl, m)
    assert makespan(o) == pytest.approx(makespan(ref_o))
    assert peak_memory(o) == peak_memory(ref_o) == [n - d for d in range(n)]
    assert o.orders == ref_o.orders
    assert g.name == "gpipe" and o.name == "1f1b"
    assert o.meta["in_flight_caps"] == [n - d for d in range(n)]


def test_v_with_uneven_durations():
    pl = pipeline_placement(4, forward=[1.0, 1.5, 0.5, 1.0], backward=[2.0, 3.0, 1.0, 2.5], activation_bytes=1)
    for m in (4, 6):
        assert makespan(gpipe_any(pl, m)) == pytest.approx(makespan(build_schedule("gpipe", pl, m)))
        ref = build_schedule("1f1b", pl, m)
        o = one_f_one_b_any(pl, m)
        assert peak_memory(o) == peak_memory(ref)
    # m=4: same order as PyTorch's 1F1B; m=6: the greedy runs a ready backward instead of waiting
    # for a late forward (non-delay), so its steady state is not strictly one-forward-one-backward
    assert one_f_one_b_any(pl, 4).orders == build_schedule("1f1b", pl, 4).orders
    assert [str(b) for b in one_f_one_b_any(pl, 6).orders[1][5:8]] == ["1B1", "1B2", "1B3"]


# ------------------------------------------------------------------ Tessel's other shapes
@pytest.mark.parametrize("shape", ["x", "m", "nn", "k"])
@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("m", [4, 16])
def test_shapes_validate_and_1f1b_saves_memory(shape, n, m):
    pl = make_shape(shape, n)
    g, o = gpipe_any(pl, m), one_f_one_b_any(pl, m)
    validate(g)
    validate(o)
    pg, po = peak_memory(g), peak_memory(o)
    assert all(a <= b for a, b in zip(po, pg)), (po, pg)
    # GPipe holds every micro-batch's activations at its peak
    assert pg == [m * sum(pl.blocks[i].memory for i in pl.blocks_on(d) if pl.blocks[i].memory > 0) for d in range(n)]
    # the greedy's own timing is what the simulator predicts (free communication)
    for s in (g, o):
        tl = simulate(lower(s))
        assert tl.makespan == pytest.approx(s.meta["makespan"])
        busy = max(pl.busy_time(d) for d in range(n)) * m
        assert busy - 1e-9 <= tl.makespan <= sum(b.duration for b in pl.blocks) * m + 1e-9


@pytest.mark.parametrize("shape", ["v", "x", "m", "nn", "k", "interleaved"])
@pytest.mark.parametrize("kw", [{"split_backward": True}, {"forward_only": True}])
def test_split_backward_and_forward_only(shape, kw):
    pl = make_shape(shape, 4, **kw)
    for build in (gpipe_any, one_f_one_b_any):
        s = build(pl, 6)
        validate(s)
        assert makespan(s) == pytest.approx(s.meta["makespan"])


def test_multi_device_blocks_are_not_starved():
    # M: the all-device F0 of the next micro-batch must interleave with the running V,
    # not wait until the previous micro-batch has drained
    pl = make_shape("m", 4)
    serial = sum(b.duration for b in pl.blocks) * 16
    assert makespan(one_f_one_b_any(pl, 16)) < 0.6 * serial
    assert makespan(gpipe_any(pl, 16)) < 0.5 * serial


def test_in_flight_caps():
    assert in_flight_caps(pipeline_placement(4)) == [4, 3, 2, 1]
    assert in_flight_caps(make_shape("m", 4)) == [5] * 4
    assert in_flight_caps(make_shape("k", 4)) == [3, 2, 3, 2]
    assert in_flight_caps(make_shape("x", 4)) == [4, 3, 3, 4]
    only_b = custom_placement(2, [{"kind": "F", "segment": 0, "devices": [0]},
                                  {"kind": "B", "segment": 0, "devices": [1], "deps": ["0F"]}])
    assert in_flight_caps(only_b) == [1, None]
    validate(one_f_one_b_any(only_b, 3))


# ------------------------------------------------------------------ memory limit
@pytest.mark.parametrize("shape", ["v", "x", "m", "k"])
def test_memory_limit_is_respected(shape):
    pl = make_shape(shape, 4)
    free = peak_memory(one_f_one_b_any(pl, 8))
    limit = max(free) - 1
    s = one_f_one_b_any(pl, 8, memory_limit=limit)
    assert max(peak_memory(s)) <= limit
    validate(s, limit)
    assert s.meta["memory_limit"] == limit


def test_memory_limit_per_device_and_static_memory():
    pl = make_shape("v", 4, static_memory=[10, 10, 10, 10], activation=2)
    s = one_f_one_b_any(pl, 8, memory_limit=[14, 14, 20, 20])
    assert peak_memory(s) == [14, 14, 14, 12]
    with pytest.raises(ScheduleError) as e:
        one_f_one_b_any(pl, 8, memory_limit=11)
    assert e.value.rule == "memory" and e.value.device == 0
    with pytest.raises(ScheduleError, match="4 devices"):
        one_f_one_b_any(pl, 8, memory_limit=[20, 20])


# ------------------------------------------------------------------ errors, custom placements, speed
@pytest.mark.parametrize("build", [gpipe_any, one_f_one_b_any])
def test_bad_micro_batches(build):
    for m in (0, -1, 2.5):
        with pytest.raises(ScheduleError) as e:
            build(make_shape("x", 2), m)
        assert e.value.rule == "micro-batches"


def test_custom_placement_schedules():
    blocks = [
        {"kind": "F", "segment": 0, "devices": [0, 1, 2], "memory": 1},
        {"kind": "F", "segment": 1, "devices": [1], "memory": 1, "deps": ["0F"]},
        {"kind": "F", "segment": 2, "devices": [2], "memory": 1, "deps": ["0F"]},
        {"kind": "F", "segment": 3, "devices": [0], "duration": 0.0, "memory": 0, "deps": ["1F", "2F"]},
        {"kind": "B", "segment": 3, "devices": [0], "duration": 0.0, "deps": ["3F"]},
        {"kind": "B", "segment": 2, "devices": [2], "duration": 2.0, "memory": -1, "deps": ["3B"]},
        {"kind": "B", "segment": 1, "devices": [1], "duration": 2.0, "memory": -1, "deps": ["3B"]},
        {"kind": "B", "segment": 0, "devices": [0, 1, 2], "duration": 2.0, "memory": -1, "deps": ["1B", "2B"]},
    ]
    pl = custom_placement(3, blocks)
    for build in (gpipe_any, one_f_one_b_any):
        s = build(pl, 5)
        validate(s)
        assert makespan(s) == pytest.approx(s.meta["makespan"])


@pytest.mark.parametrize("shape", ["v", "x", "m", "nn", "k"])
def test_speed_m64_on_8_devices(shape):
    pl = make_shape(shape, 8)
    for build in (gpipe_any, one_f_one_b_any):
        t0 = time.perf_counter()
        build(pl, 64)
        assert time.perf_counter() - t0 < 1.0
