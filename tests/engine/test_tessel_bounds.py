"""The makespan lower bound (engine.tessel.bounds) against exact optima.

A lower bound is only useful if it is valid: every test here compares it with the true optimal
makespan of small instances, found by an independent CP-SAT model written in this file (one
interval per block instance, NoOverlap per device, the chain's dependencies within each
micro-batch; no memory limit, free communication).
"""

from __future__ import annotations

import random

import pytest
from ortools.sat.python import cp_model

from engine.shapes import custom_placement, make_shape
from engine.tessel.bounds import exclusion_idle, makespan_lower_bound, memory_floor, memory_time_bound


def optimal_makespan(placement, m: int, time_limit: float = 20.0, memory_limit: int | None = None) -> int:
    """The exact minimum makespan of ``m`` micro-batches (integer durations required).

    With ``memory_limit``: a reservoir per device (a block's positive memory is allocated at its
    start, a negative one released at its end, as the simulator does), static memory included.
    """
    model = cp_model.CpModel()
    horizon = int(sum(b.duration for b in placement.blocks) * m)
    starts, ends = {}, {}
    per_device = [[] for _ in range(placement.num_devices)]
    for mb in range(m):
        for i, b in enumerate(placement.blocks):
            dur = int(b.duration)
            assert dur == b.duration, "the exact model needs integer durations"
            s = model.NewIntVar(0, horizon, f"s{mb}_{i}")
            e = model.NewIntVar(0, horizon, f"e{mb}_{i}")
            iv = model.NewIntervalVar(s, dur, e, f"iv{mb}_{i}")
            starts[mb, i], ends[mb, i] = s, e
            for d in b.devices:
                per_device[d].append(iv)
    for mb in range(m):
        for i, b in enumerate(placement.blocks):
            for dep in b.deps:
                model.Add(starts[mb, i] >= ends[mb, dep])
    for ivs in per_device:
        model.AddNoOverlap(ivs)
    if memory_limit is not None:
        for d in range(placement.num_devices):
            times, changes = [], []
            for mb in range(m):
                for i, b in enumerate(placement.blocks):
                    if d in b.devices and b.memory:
                        times.append(starts[mb, i] if b.memory > 0 else ends[mb, i])
                        changes.append(int(b.memory))
            if times:
                model.AddReservoirConstraint(times, changes, -10**6, memory_limit - placement.static_bytes(d))
    span = model.NewIntVar(0, horizon, "span")
    model.AddMaxEquality(span, list(ends.values()))
    model.Minimize(span)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = 2
    status = solver.Solve(model)
    assert status == cp_model.OPTIMAL, f"the reference solve did not finish ({solver.StatusName(status)})"
    return int(solver.ObjectiveValue())


@pytest.mark.parametrize("shape,n,m", [("m", 2, 2), ("m", 3, 2), ("m", 3, 3), ("m", 4, 2), ("nn", 4, 2),
                                       ("k", 4, 2), ("x", 2, 2), ("v", 3, 3)])
def test_bound_never_exceeds_the_optimum(shape, n, m):
    pl = make_shape(shape, n)
    assert makespan_lower_bound(pl, m) <= optimal_makespan(pl, m) + 1e-9


@pytest.mark.parametrize("n,m", [(2, 2), (3, 2), (3, 3)])
def test_m_shape_bound_counts_the_unavoidable_idle(n, m):
    """On M (F=1, B=2) every device works 6 per micro-batch, and the last device idles through
    the forward chain before its first own block and the backward chain after its last one:
    ``6 m + 3 (n - 1)``. The path argument alone gives only ``6 m`` (all-device blocks open
    and close the schedule). The bound is exact on these small instances."""
    pl = make_shape("m", n)
    assert exclusion_idle(pl, n - 1)[0][0] == n - 1
    assert exclusion_idle(pl, n - 1)[1][0] == 2 * (n - 1)
    assert makespan_lower_bound(pl, m) == 6 * m + 3 * (n - 1)
    assert optimal_makespan(pl, m) == 6 * m + 3 * (n - 1)


def test_v_shape_bound_is_unchanged_by_exclusion():
    """Without multi-device blocks the exclusion argument adds nothing to the path argument:
    on V the bound is 1F1B's makespan ``(m + n - 1) (F + B)``."""
    for n in (2, 4, 8):
        assert makespan_lower_bound(make_shape("v", n), 16) == (16 + n - 1) * 3


@pytest.mark.parametrize("shape,n,m,limit", [("v", 3, 3, 1), ("v", 3, 4, 2), ("m", 3, 3, 2), ("m", 3, 3, 3),
                                             ("m", 2, 4, 2), ("k", 4, 3, 2), ("nn", 4, 2, 3), ("x", 2, 3, 2)])
def test_memory_bound_never_exceeds_the_optimum_under_the_limit(shape, n, m, limit):
    pl = make_shape(shape, n)
    assert makespan_lower_bound(pl, m, memory_limit=limit) <= optimal_makespan(pl, m, memory_limit=limit) + 1e-9


def test_memory_bound_on_tight_v_and_m():
    """V with room for one micro-batch per device runs them one at a time: ``m (n F + n B)``,
    which the memory-time bound gives exactly. On M (4 devices, limit 6) device 0 holds two
    activations through the 12-unit chain F1 .. B1, all outside the 3 all-device units of each
    micro-batch: ``T >= 3 m + 2 * 12 m / 6 = 7 m``, above its 6 m of work. The in-flight bound
    adds the granularity Little's law averages away: 3 micro-batches fit, so micro-batches 0, 3,
    .., 63 (22 of them) hold device 0's activations one after another, 12 non-all-device units
    each: ``T >= 22 * 12 + 3 * 64 = 456``."""
    v = make_shape("v", 3)
    assert memory_time_bound(v, 4, 1) == 4 * 9
    assert optimal_makespan(v, 4, memory_limit=1) == 4 * 9
    assert memory_time_bound(make_shape("m", 4), 64, 6) == 7 * 64
    assert makespan_lower_bound(make_shape("m", 4), 64, memory_limit=6) == 22 * 12 + 3 * 64
    assert makespan_lower_bound(make_shape("m", 4), 64) == 6 * 64 + 9  # no limit: the work bound
    with pytest.raises(ValueError, match="2 values for 4 devices"):
        memory_time_bound(make_shape("m", 4), 8, [6, 6])


def test_memory_bound_skips_unpaired_frees():
    """A free whose segment's forward allocated nothing cannot be paired: no memory bound (the
    placement frees segment 0's activation in segment 1's backward)."""
    pl = custom_placement(1, [
        {"kind": "F", "segment": 0, "devices": [0], "duration": 1, "memory": 1},
        {"kind": "F", "segment": 1, "devices": [0], "duration": 1, "memory": 0, "deps": ["0F"]},
        {"kind": "B", "segment": 1, "devices": [0], "duration": 2, "memory": -1, "deps": ["1F"]},
        {"kind": "B", "segment": 0, "devices": [0], "duration": 2, "memory": 0, "deps": ["1B"]},
    ])
    assert memory_time_bound(pl, 8, 1) == 0.0
    assert makespan_lower_bound(pl, 8, memory_limit=1) == makespan_lower_bound(pl, 8) == 8 * 6


def _random_placement(rng: random.Random, n: int, memory: bool = False) -> list[dict]:
    """A random chain of forward blocks on random device sets, mirrored by backwards."""
    k = rng.randint(2, 5)
    blocks = []
    for s in range(k):
        devs = sorted(rng.sample(range(n), rng.choice([1, 1, n]) if n > 1 else 1))
        deps = [f"{s - 1}F"] if s else []
        if s >= 2 and rng.random() < 0.3:
            deps = [f"{rng.randrange(s)}F"]
        blocks.append({"kind": "F", "segment": s, "devices": devs, "duration": rng.randint(1, 2),
                       "memory": rng.randint(1, 2) if memory else 0, "deps": deps})
    for s in reversed(range(k)):
        users = [t for t in range(k) if f"{s}F" in blocks[t]["deps"]]
        deps = [f"{t}B" for t in users] or [f"{s}F"]
        blocks.append({"kind": "B", "segment": s, "devices": blocks[s]["devices"],
                       "duration": rng.randint(1, 3), "memory": -blocks[s]["memory"], "deps": deps})
    return blocks


@pytest.mark.parametrize("seed", range(12))
def test_bound_is_valid_on_random_placements(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 3)
    pl = custom_placement(n, _random_placement(rng, n), name=f"random{seed}")
    m = rng.randint(1, 3)
    assert makespan_lower_bound(pl, m) <= optimal_makespan(pl, m) + 1e-9


@pytest.mark.parametrize("seed", range(12))
def test_memory_bound_is_valid_on_random_placements(seed):
    rng = random.Random(1000 + seed)
    n = rng.randint(2, 3)
    pl = custom_placement(n, _random_placement(rng, n, memory=True), name=f"random{seed}")
    m = rng.randint(2, 3)
    floor = max(memory_floor(pl))
    limit = floor + rng.randint(0, 2)
    assert makespan_lower_bound(pl, m, memory_limit=limit) <= optimal_makespan(pl, m, memory_limit=limit) + 1e-9
