"""The makespan lower bound under memory limits (engine.tessel.bounds.in_flight_bound).

The in-flight bound is only useful if it is valid: it never exceeds a proven exact optimum
(engine.tessel.exact.exact_schedule, itself checked against brute force) on small cases, nor the
simulated makespan of valid schedules built under the limit at m = 64. And it is tighter than
Little's law on memory (memory_time_bound), which misses the ramp-up and ramp-down of a pipeline.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest

from engine.baselines.generic import one_f_one_b_any
from engine.placement import Placement
from engine.plan import measure
from engine.schedule import Block, Schedule
from engine.shapes import custom_placement, make_shape
from engine.tessel.bounds import in_flight_bound, makespan_lower_bound, memory_time_bound
from engine.tessel.exact import exact_schedule


def _v2_grads() -> Placement:
    """V on 2 devices, activation 2, a 1-unit gradient buffer per segment."""
    return replace(make_shape("V", 2, activation=2), grad_memory=(1, 1))


def _cross_lags(pl: Placement, lag: float) -> dict[tuple[int, int], float]:
    return {(p, b): lag for b, spec in enumerate(pl.blocks) for p in spec.deps
            if set(pl.blocks[p].devices) != set(spec.devices)}


SPLIT = {"split_backward": True, "activation": 2}
# (name, placement, memory limit, m, the exact optimum when the bound reaches it, else None)
EXACT_CASES = [
    ("M4 limit 6 m=4", lambda: make_shape("M", 4), 6, 4, 36),
    ("M4 limit 6 m=5", lambda: make_shape("M", 4), 6, 5, None),
    ("M3 limit 3 m=4", lambda: make_shape("M", 3), 3, 4, 48),
    ("K4 limit 2 m=4", lambda: make_shape("K", 4), 2, 4, 30),
    ("K4 limit 3 m=5", lambda: make_shape("K", 4), 3, 5, 33),
    ("NN4 limit 9 m=3", lambda: make_shape("NN", 4), 9, 3, None),
    ("NN2 limit 4 m=3", lambda: make_shape("NN", 2), 4, 3, None),
    ("V4 limit 2 m=5", lambda: make_shape("V", 4), 2, 5, 36),
    ("V3 split limit 4 m=4", lambda: make_shape("V", 3, **SPLIT), 4, 4, None),
    ("X3 limit 3 m=3", lambda: make_shape("X", 3), 3, 3, None),
    ("interleaved2 limit 3 m=4", lambda: make_shape("interleaved", 2), 3, 4, None),
    ("MLLM3 limit 4 m=4", lambda: make_shape("mllm", 3), 4, 4, 51),
    ("finetune3 split limit 4 m=4", lambda: make_shape("finetune", 3, **SPLIT), 4, 4, None),
    ("alphafold2 split limit 2 m=4", lambda: make_shape("alphafold", 2, recycles=1, **SPLIT), 2, 4, 22),
    ("V2 grads limit 4 m=4", _v2_grads, 4, 4, None),
    ("V4 per-device limits m=5", lambda: make_shape("V", 4), [1, 3, 2, 1], 5, 60),
]


@pytest.mark.parametrize("name,build,limit,m,tight", EXACT_CASES, ids=[c[0] for c in EXACT_CASES])
def test_bound_never_exceeds_the_exact_optimum(name, build, limit, m, tight):
    pl = build()
    res = exact_schedule(pl, m, memory_limit=limit, time_limit=20)
    assert res.status == "optimal"
    bound = makespan_lower_bound(pl, m, memory_limit=limit)
    assert bound <= res.makespan + 1e-9, f"{name}: bound {bound} above the optimum {res.makespan}"
    assert in_flight_bound(pl, m, limit) <= bound
    if tight is not None:
        assert res.makespan == tight and bound == pytest.approx(tight)


def test_bound_with_lags_never_exceeds_the_exact_optimum():
    pl = make_shape("M", 4)
    lags = _cross_lags(pl, 1.0)
    res = exact_schedule(pl, 3, memory_limit=6, lags=lags, time_limit=20)
    assert res.status == "optimal"
    bound = makespan_lower_bound(pl, 3, memory_limit=6, lags=lags)
    assert makespan_lower_bound(pl, 3, memory_limit=6) <= bound <= res.makespan + 1e-9


def test_gradient_buffers_tighten_the_in_flight_count():
    """V2 with activation 2 and limit 4 fits two micro-batches' activations, but once the first
    backward has allocated a segment's 1-unit gradient buffer only one: the bound sees it (21 at
    m = 4, 15 without the buffers), and stays below the exact optimum (24)."""
    pl = _v2_grads()
    with_grads = in_flight_bound(pl, 4, 4)
    assert with_grads == 21 and in_flight_bound(replace(pl, grad_memory=()), 4, 4) == 15
    res = exact_schedule(pl, 4, memory_limit=4, time_limit=20)
    assert res.status == "optimal" and with_grads <= res.makespan == 24


# m = 64: valid schedules under the limit (memory-aware 1F1B), simulated
SCHEDULE_CASES = [("V", 8, {}, 4), ("V", 4, SPLIT, 5), ("M", 4, {}, 6), ("K", 4, {}, 2), ("NN", 4, {}, 9),
                  ("X", 4, {}, 3), ("mllm", 4, {}, 5), ("alphafold", 4, {}, 3), ("interleaved", 4, {}, 4)]


@pytest.mark.parametrize("shape,n,kw,limit", SCHEDULE_CASES, ids=[f"{c[0]}{c[1]} limit {c[3]}" for c in SCHEDULE_CASES])
def test_bound_never_exceeds_valid_schedules_at_m64(shape, n, kw, limit):
    pl = make_shape(shape, n, **kw)
    sched = one_f_one_b_any(pl, 64, memory_limit=limit)
    sched.validate(limit)
    bound = makespan_lower_bound(pl, 64, memory_limit=limit)
    assert bound <= measure(sched).makespan + 1e-9
    assert bound >= memory_time_bound(pl, 64, limit) - 1e-9


def test_v16_limit_8_bound_is_the_memory_aware_1f1b():
    """V on 16 devices (F=1, B=2), 8 activations per device, m = 64.

    Before: 384 = 64 x 6, Little's law (device 0 holds each activation for the 48-unit chain
    F0 .. B0, 8 at a time). By hand, the in-flight argument: device 15 cannot start B15 of
    micro-batch 7 before 15 + 8 x 1 + 7 x 2 = 37 (its first block starts at 15, then F15 of
    micro-batches 0..7 and B15 of 0..6, one at a time); that micro-batch's backward then runs
    through 16 devices and ends on device 0 at 37 + 16 x 2 = 69. With 8 activations on device 0,
    F0 of micro-batch 15 waits for it, and every 8 micro-batches later the whole 48-unit chain
    again: F0 of micro-batch 63 starts no sooner than 69 + 6 x 48 = 357 and its B0 ends no sooner
    than 357 + 48 = 405. The memory-aware 1F1B reaches 405: it is optimal.
    """
    pl = make_shape("V", 16)
    assert memory_time_bound(pl, 64, 8) == 384
    bound = makespan_lower_bound(pl, 64, memory_limit=8)
    assert bound == 405 > 384
    sched = one_f_one_b_any(pl, 64, memory_limit=8)
    sched.validate(8)
    assert measure(sched).makespan == 405


def test_k4_limit_2_rate_is_the_cycle_through_the_loss():
    """K on 4 devices, limit 2: each device holds its branch activation and the loss block's, so
    the next micro-batch's loss forward F4 waits for this one's B0 (3 units would be held): the
    cycle F4, B4, B1, B0 takes 1 + 2 + 2 + 2 = 7 per micro-batch, not the 6 of every device's work
    (the exact optima: 16, 23, 30 for m = 2, 3, 4). At m = 64: 2 + 7 x 64 = 450."""
    pl = make_shape("K", 4)
    assert makespan_lower_bound(pl, 64, memory_limit=2) == 450
    assert makespan_lower_bound(pl, 64) == 387


def test_step_tail_counts_after_each_device_last_block():
    """With a step tail per device the bound stays below the schedule's makespan with the tail
    (its last block per device, as simulated, plus that device's tail)."""
    pl = make_shape("V", 4)
    tail = [5.0, 1.0, 0.0, 3.0]
    sched = one_f_one_b_any(pl, 16, memory_limit=2)
    end = _device_ends(sched)
    with_tail = max(e + t for e, t in zip(end, tail))
    bound = makespan_lower_bound(pl, 16, memory_limit=2, tail=tail)
    assert makespan_lower_bound(pl, 16, memory_limit=2) < bound <= with_tail + 1e-9


def test_step_tail_runs_while_other_devices_finish():
    """The last stage of V4 ends its last backward 6 units before device 0 ends the step: its step
    tail (4) fits in that time, so the bound stays 201 (it once added the tail to the path after
    the device's last block, 205, above this schedule's 201)."""
    pl = make_shape("V", 4)
    tail = [0.0, 0.0, 0.0, 4.0]
    sched = one_f_one_b_any(pl, 64, memory_limit=5)
    end = _device_ends(sched)
    assert end == [201, 199, 197, 195]
    assert makespan_lower_bound(pl, 64, memory_limit=5, tail=tail) == 201 == max(e + t for e, t in zip(end, tail))


def _device_ends(s: Schedule) -> list[float]:
    """Per device, when its last block ends with the orders run as soon as possible."""
    pl = s.placement
    end: dict[Block, float] = {}
    free = [0.0] * pl.num_devices
    ptr = [0] * pl.num_devices
    while any(ptr[d] < len(s.orders[d]) for d in range(pl.num_devices)):
        for d in range(pl.num_devices):
            if ptr[d] >= len(s.orders[d]):
                continue
            blk = s.orders[d][ptr[d]]
            spec = pl.spec(blk.kind, blk.segment)
            deps = [Block(pl.blocks[a].segment, pl.blocks[a].kind, blk.micro_batch) for a in spec.deps]
            if any(x not in end for x in deps) or any(s.orders[e][ptr[e]] != blk for e in spec.devices):
                continue
            end[blk] = max([free[e] for e in spec.devices] + [end[x] for x in deps]) + spec.duration
            for e in spec.devices:
                free[e] = end[blk]
                ptr[e] += 1
    return free


def test_in_flight_bound_inputs():
    pl = make_shape("M", 4)
    with pytest.raises(ValueError, match="2 values for 4 devices"):
        in_flight_bound(pl, 8, [6, 6])
    # past the deadline nothing is examined: still a (trivial) lower bound
    assert in_flight_bound(pl, 64, 6, deadline=time.perf_counter() - 1) == 0.0
    assert makespan_lower_bound(pl, 64, 6, deadline=time.perf_counter() - 1) <= makespan_lower_bound(pl, 64, 6)
    # no limit (or an infinite one): the per-micro-batch refinement of the head-body-tail bound only
    assert in_flight_bound(pl, 64) == in_flight_bound(pl, 64, math.inf) <= makespan_lower_bound(pl, 64)
    assert in_flight_bound(pl, 64, 6) == 456


def test_unpaired_frees_give_no_memory_argument():
    """A free whose segment's forward allocated nothing cannot be paired: the device is skipped
    (as memory_time_bound does), so the limit changes nothing."""
    pl = custom_placement(1, [
        {"kind": "F", "segment": 0, "devices": [0], "duration": 1, "memory": 1},
        {"kind": "F", "segment": 1, "devices": [0], "duration": 1, "memory": 0, "deps": ["0F"]},
        {"kind": "B", "segment": 1, "devices": [0], "duration": 2, "memory": -1, "deps": ["1F"]},
        {"kind": "B", "segment": 0, "devices": [0], "duration": 2, "memory": 0, "deps": ["1B"]},
    ])
    assert in_flight_bound(pl, 8, 1) == in_flight_bound(pl, 8) == 8 * 6
