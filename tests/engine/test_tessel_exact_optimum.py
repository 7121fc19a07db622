"""engine.tessel.exact: the exact optimum of the whole scheduling problem for a few micro-batches.

References: an independent brute force written here (every per-device order, checked with
``Schedule.validate`` and timed with ``engine.simulate``) on 2-device placements; the makespan
lower bound, Tessel's search and the generic GPipe / 1F1B policies bracket the optimum on the
4-device shapes; the model without its FIFO symmetry breaking finds the same optimum.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import networkx as nx
import pytest

from engine.baselines.generic import gpipe_any, one_f_one_b_any
from engine.dependency import lower
from engine.errors import ScheduleError, TesselError
from engine.placement import BlockSpec, Placement, pipeline_placement
from engine.schedule import Block, Schedule
from engine.schedule.validate import peak_memory
from engine.shapes import make_shape
from engine.simulate import simulate
from engine.tessel import InfeasibleMemoryError, tessel_search
from engine.tessel.bounds import makespan_lower_bound, memory_floor
from engine.tessel.exact import exact_schedule
from engine.tessel.exact_memory import activation_pieces as _activation_pieces
from engine.tessel.exact_memory import in_flight_precedences as _in_flight_precedences
from engine.tessel.exact_model import _asap


# ----------------------------------------------------------------------------- placements
def _v2() -> Placement:
    return make_shape("V", 2)


def _k2() -> Placement:
    """Two branches (one per device) joined by an all-device loss block; unequal durations."""
    return Placement(2, (
        BlockSpec("F", 0, (0,), 1.0, 1), BlockSpec("F", 1, (1,), 2.0, 1),
        BlockSpec("F", 2, (0, 1), 1.0, 1, (0, 1)), BlockSpec("B", 2, (0, 1), 1.0, -1, (2,)),
        BlockSpec("B", 1, (1,), 3.0, -1, (3,)), BlockSpec("B", 0, (0,), 2.0, -1, (3,))), name="k2")


def _m2() -> Placement:
    """M on 2 devices with unequal durations: an all-device block at both ends of a pipeline."""
    return Placement(2, (
        BlockSpec("F", 0, (0, 1), 1.0, 1), BlockSpec("F", 1, (0,), 2.0, 1, (0,)),
        BlockSpec("F", 2, (1,), 1.0, 1, (1,)), BlockSpec("B", 2, (1,), 2.0, -1, (2,)),
        BlockSpec("B", 1, (0,), 3.0, -1, (3,)), BlockSpec("B", 0, (0, 1), 1.0, -1, (4,))), name="m2")


def _zb2_grads() -> Placement:
    """Split backward (I/W) on 2 devices with gradient buffers and transient gradients."""
    pl = pipeline_placement(2, split_backward=True, activation_bytes=2)
    return replace(pl, grad_memory=(3, 3), grad_transient=(1, 1))


def _v2_transient() -> Placement:
    """Plain backward with transient gradients only (no buffer: every B holds its transient)."""
    return replace(make_shape("V", 2, activation=2), grad_transient=(1, 1))


# ----------------------------------------------------------------------------- brute force
def _linear_extensions(items: list[Block], preds: dict[Block, set[Block]]) -> list[list[Block]]:
    out: list[list[Block]] = []

    def rec(prefix: list[Block], placed: set[Block], rest: list[Block]) -> None:
        if not rest:
            out.append(list(prefix))
            return
        for k, x in enumerate(rest):
            if preds[x] <= placed:
                prefix.append(x)
                placed.add(x)
                rec(prefix, placed, rest[:k] + rest[k + 1:])
                prefix.pop()
                placed.discard(x)

    rec([], set(), items)
    return out


def _valid_orders(pl: Placement, m: int, limit) -> list[list[list[Block]]]:
    """Per device, every order of its block instances that keeps each micro-batch's chain order on
    that device (any other order breaks validate's dependency rule) and fits the limit."""
    g = pl.dependency_graph()
    anc = {b: nx.ancestors(g, b) for b in range(len(pl.blocks))}
    per_dev = []
    for d in range(pl.num_devices):
        insts = [Block(pl.blocks[b].segment, pl.blocks[b].kind, i) for b in pl.blocks_on(d) for i in range(m)]
        idx = {x: pl.index(x.kind, x.segment) for x in insts}
        preds = {x: {y for y in insts if y.micro_batch == x.micro_batch and idx[y] in anc[idx[x]]} for x in insts}
        orders = _linear_extensions(insts, preds)
        if limit is not None:
            alone = [[] for _ in range(pl.num_devices)]
            orders = [o for o in orders
                      if peak_memory(Schedule(pl, m, [o if e == d else alone[e] for e in range(pl.num_devices)]))[d]
                      <= limit]
        per_dev.append(orders)
    return per_dev


def _combos(pl: Placement, m: int, limit):
    """Every valid schedule of a 2-device placement: pairs of device orders whose all-device blocks
    come in the same order on both devices (any other pair deadlocks), then ``validate``."""
    assert pl.num_devices == 2
    per_dev = _valid_orders(pl, m, limit)
    shared = {(b.kind, b.segment) for b in pl.blocks if len(b.devices) == 2}

    def key(o):
        return tuple(x for x in o if x.key in shared)

    by_key: dict[tuple, list] = {}
    for o in per_dev[1]:
        by_key.setdefault(key(o), []).append(o)
    for o0 in per_dev[0]:
        for o1 in by_key.get(key(o0), []):
            s = Schedule(pl, m, [list(o0), list(o1)])
            try:
                s.validate(limit)
            except ScheduleError:
                continue
            yield s


_BRUTE: dict[tuple, float] = {}


def brute_force(pl: Placement, m: int, limit=None) -> float:
    """The least simulated makespan over every valid schedule (engine.simulate, free communication)."""
    key = (pl, m, limit)
    if key not in _BRUTE:
        _BRUTE[key] = min(simulate(lower(s)).makespan for s in _combos(pl, m, limit))
    return _BRUTE[key]


def _lagged_makespan(s: Schedule, lags: dict[tuple[int, int], float]) -> float:
    """The schedule's orders as soon as possible with ``lags`` on dependencies (a test-local replay)."""
    pl = s.placement
    end: dict[Block, float] = {}
    free = [0.0] * pl.num_devices
    ptr = [0] * pl.num_devices
    while any(ptr[d] < len(s.orders[d]) for d in range(pl.num_devices)):
        moved = False
        for d in range(pl.num_devices):
            if ptr[d] >= len(s.orders[d]):
                continue
            blk = s.orders[d][ptr[d]]
            b = pl.index(blk.kind, blk.segment)
            spec = pl.blocks[b]
            deps = [Block(pl.blocks[a].segment, pl.blocks[a].kind, blk.micro_batch) for a in spec.deps]
            if any(x not in end for x in deps) or any(s.orders[e][ptr[e]] != blk for e in spec.devices):
                continue
            t = max([free[e] for e in spec.devices]
                    + [end[x] + lags.get((a, b), 0.0) for a, x in zip(spec.deps, deps)])
            end[blk] = t + spec.duration
            for e in spec.devices:
                free[e] = end[blk]
                ptr[e] += 1
            moved = True
        assert moved
    return max(end.values())


def _check(res, pl: Placement, m: int, limit) -> None:
    """(4): the returned schedule is valid under the limit and simulates to the reported makespan."""
    assert res.schedule is not None
    res.schedule.validate(limit)
    assert res.schedule.num_micro_batches == m
    assert simulate(lower(res.schedule)).makespan == pytest.approx(res.makespan, abs=1e-9)
    assert res.lower_bound <= res.makespan + 1e-9


# ----------------------------------------------------------------------------- (1) brute force
BRUTE_CASES = [
    ("V2 m=2", _v2, 2, None),
    ("V2 m=3 limit 1", _v2, 3, 1),
    ("K2 m=2", _k2, 2, None),
    ("M2 m=2", _m2, 2, None),
    ("M2 m=2 limit 3", _m2, 2, 3),
    ("ZB2 grads m=2 limit 5", _zb2_grads, 2, 5),
    ("ZB2 grads m=2 limit 9", _zb2_grads, 2, 9),
    ("V2 transient m=2 limit 4", _v2_transient, 2, 4),
]


@pytest.mark.parametrize("cumulative", [True, False], ids=["cumulative", "reservoir"])
@pytest.mark.parametrize("name,build,m,limit", BRUTE_CASES, ids=[c[0] for c in BRUTE_CASES])
def test_exact_optimum_equals_brute_force(name, build, m, limit, cumulative):
    """Both memory forms (the cumulative with in-flight precedences, and the plain reservoir)."""
    pl = build()
    res = exact_schedule(pl, m, memory_limit=limit, time_limit=20, _cumulative=cumulative)
    assert res.status == "optimal" and not res.rounded
    assert res.makespan == brute_force(pl, m, limit)
    assert res.lower_bound == res.makespan
    _check(res, pl, m, limit)


def test_memory_limit_binds_in_the_brute_force_cases():
    """The limits above matter: without them the optimum is shorter (so the reservoir is exercised)."""
    for build, m, limit in [(_v2, 3, 1), (_m2, 2, 3), (_zb2_grads, 2, 5), (_v2_transient, 2, 4)]:
        pl = build()
        limited = exact_schedule(pl, m, memory_limit=limit, time_limit=20).makespan
        free = exact_schedule(pl, m, time_limit=20).makespan
        assert free is not None and limited is not None and free < limited


def test_gradient_buffer_held_across_micro_batches_can_make_the_floor_infeasible():
    """memory_floor (one micro-batch alone) is 4 on ZB2 with gradient buffers, but a second
    micro-batch's activation (2) meets the first one's buffer (3): no schedule of m=2 fits 4.
    The model proves it, and the brute force finds no valid schedule either."""
    pl = _zb2_grads()
    floor = max(memory_floor(pl))
    assert floor == 4
    res = exact_schedule(pl, 2, memory_limit=floor, time_limit=20)
    assert res.status == "infeasible" and res.makespan is None and res.schedule is None
    assert math.isinf(res.lower_bound)
    assert not any(True for _ in _combos(pl, 2, floor))
    one = exact_schedule(pl, 1, memory_limit=floor)
    assert one.status == "optimal"
    _check(one, pl, 1, floor)
    with pytest.raises(InfeasibleMemoryError):
        exact_schedule(pl, 2, memory_limit=floor - 1)


def test_lags_against_brute_force():
    pl = _m2()
    lags = {(1, 2): 0.5, (3, 4): 1.5}   # F1 -> F2 and B2 -> B1 cross devices
    one = exact_schedule(pl, 1, lags=lags)
    assert one.status == "optimal" and one.makespan == 1 + 2 + 0.5 + 1 + 2 + 1.5 + 3 + 1
    res = exact_schedule(pl, 2, lags=lags, time_limit=20)
    want = min(_lagged_makespan(s, lags) for s in _combos(pl, 2, None))
    assert res.status == "optimal" and res.makespan == pytest.approx(want)
    res.schedule.validate()
    assert _lagged_makespan(res.schedule, lags) == pytest.approx(res.makespan)


def test_rounded_durations_are_optimal_at_resolution():
    pl = make_shape("V", 2, backward=math.pi)  # no common tick: durations are rounded up
    res = exact_schedule(pl, 2, time_limit=20)
    assert res.rounded and res.status == "optimal_at_resolution"
    best = brute_force(pl, 2)
    assert best - 1e-9 <= res.makespan <= best + 2 * 4 * res.resolution
    assert res.lower_bound == res.makespan_lower_bound <= best + 1e-9
    _check(res, pl, 2, None)


# ----------------------------------------------------------------------------- (2) bracketing
BRACKET_CASES = [("V", 3, 2), ("V", 3, 6), ("M", 6, 2), ("M", 6, 4), ("NN", 9, 3), ("K", 5, 4), ("X", 4, 4)]


@pytest.mark.parametrize("shape,limit,m", BRACKET_CASES, ids=[f"{s}4 limit {lim} m={m}" for s, lim, m in BRACKET_CASES])
def test_bound_and_schedulers_bracket_the_optimum(shape, limit, m):
    pl = make_shape(shape, 4)
    res = exact_schedule(pl, m, memory_limit=limit, time_limit=20)
    assert res.status == "optimal"
    _check(res, pl, m, limit)
    lb = makespan_lower_bound(pl, m, memory_limit=limit)
    assert lb == res.makespan_lower_bound
    assert lb <= res.makespan + 1e-9, f"makespan_lower_bound {lb} exceeds the optimum {res.makespan}"
    tessel = tessel_search(pl, m, memory_limit=limit, time_limit=1.0).schedule
    policies = [tessel, one_f_one_b_any(pl, m, memory_limit=limit), gpipe_any(pl, m)]
    for s in policies:
        try:
            s.validate(limit)
        except ScheduleError:
            assert s.name == "gpipe"   # GPipe ignores the limit: no comparison under it
            continue
        assert res.makespan <= simulate(lower(s)).makespan + 1e-9, s.name


# ----------------------------------------------------------------------------- (3) FIFO on/off
FIFO_CASES = [("V2 m=3 limit 1", _v2, 3, 1), ("K2 m=2", _k2, 2, None), ("M2 m=2 limit 3", _m2, 2, 3),
              ("ZB2 grads m=2 limit 5", _zb2_grads, 2, 5), ("M4 m=2 limit 6", lambda: make_shape("M", 4), 2, 6)]


@pytest.mark.parametrize("name,build,m,limit", FIFO_CASES, ids=[c[0] for c in FIFO_CASES])
def test_fifo_symmetry_breaking_keeps_the_optimum(name, build, m, limit):
    pl = build()
    on = exact_schedule(pl, m, memory_limit=limit, time_limit=20)
    off = exact_schedule(pl, m, memory_limit=limit, time_limit=20, _fifo=False)
    assert on.status == off.status == "optimal" and on.fifo and not off.fifo
    assert on.makespan == off.makespan
    _check(off, pl, m, limit)


@pytest.mark.parametrize("shape,limit,m", [("M", 6, 4), ("NN", 9, 3), ("V", 2, 5)])
def test_cumulative_form_keeps_the_optimum(shape, limit, m):
    pl = make_shape(shape, 4)
    on = exact_schedule(pl, m, memory_limit=limit, time_limit=20)
    off = exact_schedule(pl, m, memory_limit=limit, time_limit=20, _cumulative=False)
    assert on.status == off.status == "optimal" and on.makespan == off.makespan
    _check(off, pl, m, limit)


def test_in_flight_precedences_of_m4():
    """M on 4 devices, limit 6: device 0 holds F0's and F1's activations (2 per micro-batch) from F1
    to B1, so at most 3 micro-batches between F1 and B1: start(i + 3, F1) >= end(i, B1)."""
    pl = make_shape("M", 4)
    pieces = _activation_pieces(pl, 0, 1)
    f0, f1, b1, b0 = pl.index("F", 0), pl.index("F", 1), pl.index("B", 1), pl.index("B", 0)
    assert sorted(pieces) == sorted([(f1, b1, 1), (f0, b0, 1)])
    prec = {(a, f): c for a, f, c in _in_flight_precedences(pl, 0, pieces, 6)}
    assert prec == {(f1, b1): 3, (f1, b0): 6, (f0, b1): 6, (f0, b0): 6}


# ----------------------------------------------------------------------------- hints and options
def test_hint_from_tessel_gives_the_same_optimum_and_its_start_times_are_the_simulators():
    pl, m, limit = make_shape("M", 4), 4, 6
    tessel = tessel_search(pl, m, memory_limit=limit, time_limit=1.0).schedule
    events = {(e.micro_batch, pl.index(e.op, e.segment)): e.start
              for e in simulate(lower(tessel)).events if e.op in ("F", "B", "I", "W")}
    assert _asap(pl, tessel.orders, [b.duration for b in pl.blocks], {}) == events
    plain = exact_schedule(pl, m, memory_limit=limit, time_limit=20)
    hinted = exact_schedule(pl, m, memory_limit=limit, time_limit=20, hint=tessel)
    assert hinted.status == plain.status == "optimal" and hinted.makespan == plain.makespan
    assert hinted.meta["hint_makespan_ticks"] == simulate(lower(tessel)).makespan
    _check(hinted, pl, m, limit)


def test_use_bound_and_per_device_limits_give_the_same_optimum():
    pl, m = make_shape("M", 4), 4
    ref = exact_schedule(pl, m, memory_limit=6, time_limit=20)
    assert exact_schedule(pl, m, memory_limit=6, time_limit=20, use_bound=True).makespan == ref.makespan
    assert exact_schedule(pl, m, memory_limit=[6, 6, 6, 6], time_limit=20).makespan == ref.makespan


def test_time_limit_returns_a_valid_schedule_or_nothing():
    pl, m, limit = make_shape("NN", 4), 6, 9
    res = exact_schedule(pl, m, memory_limit=limit, time_limit=0.3)
    assert res.status in ("optimal", "feasible", "unknown")
    assert res.lower_bound >= res.makespan_lower_bound
    if res.schedule is not None:
        _check(res, pl, m, limit)


def test_errors():
    pl = _v2()
    with pytest.raises(TesselError):
        exact_schedule(pl, 0)
    with pytest.raises(TesselError):
        exact_schedule(pl, 2, time_limit=0)
    with pytest.raises(TesselError):
        exact_schedule(pl, 2, memory_limit=[2, 2, 2])
    with pytest.raises(TesselError):
        exact_schedule(pl, 2, lags={(0, 3): 1.0})   # not a dependency
    with pytest.raises(TesselError):
        exact_schedule(pl, 2, lags={(0, 1): -1.0})
    with pytest.raises(InfeasibleMemoryError):
        exact_schedule(pl, 2, memory_limit=0)
    with pytest.raises(TesselError):
        exact_schedule(pl, 3, hint=one_f_one_b_any(pl, 2))
    bad = one_f_one_b_any(pl, 2)
    bad.orders[0] = list(reversed(bad.orders[0]))
    with pytest.raises(ScheduleError):
        exact_schedule(pl, 2, hint=bad)


def test_all_small_orders_agree_on_v2_m2():
    """Sanity of the brute force itself: the optimum of V on 2 devices, m=2, is 1F1B's 9 units."""
    pl = _v2()
    spans = sorted(simulate(lower(s)).makespan for s in _combos(pl, 2, None))
    assert spans[0] == 9.0 == simulate(lower(one_f_one_b_any(pl, 2))).makespan
    assert len(list(itertools.islice(_combos(pl, 2, None), 100))) > 1
