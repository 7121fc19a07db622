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
from engine.tessel.bounds import exclusion_idle, makespan_lower_bound


def optimal_makespan(placement, m: int, time_limit: float = 20.0) -> int:
    """The exact minimum makespan of ``m`` micro-batches (integer durations required)."""
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


def _random_placement(rng: random.Random, n: int) -> list[dict]:
    """A random chain of forward blocks on random device sets, mirrored by backwards."""
    k = rng.randint(2, 5)
    blocks = []
    for s in range(k):
        devs = sorted(rng.sample(range(n), rng.choice([1, 1, n]) if n > 1 else 1))
        deps = [f"{s - 1}F"] if s else []
        if s >= 2 and rng.random() < 0.3:
            deps = [f"{rng.randrange(s)}F"]
        blocks.append({"kind": "F", "segment": s, "devices": devs, "duration": rng.randint(1, 2), "memory": 0,
                       "deps": deps})
    for s in reversed(range(k)):
        users = [t for t in range(k) if f"{s}F" in blocks[t]["deps"]]
        deps = [f"{t}B" for t in users] or [f"{s}F"]
        blocks.append({"kind": "B", "segment": s, "devices": blocks[s]["devices"],
                       "duration": rng.randint(1, 3), "memory": 0, "deps": deps})
    return blocks


@pytest.mark.parametrize("seed", range(12))
def test_bound_is_valid_on_random_placements(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 3)
    pl = custom_placement(n, _random_placement(rng, n), name=f"random{seed}")
    m = rng.randint(1, 3)
    assert makespan_lower_bound(pl, m) <= optimal_makespan(pl, m) + 1e-9
