"""improve_schedule: large-neighbourhood search on the exact whole-schedule model.

References: the simulator (engine.simulate of engine.dependency.lower, with the same comm cost
model) for every reported makespan; Schedule.validate for the memory limit;
makespan_lower_bound for what no schedule beats; a second run for determinism; the full exact
model and its reservoir form for the neighbourhood models.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from ortools.sat.python import cp_model

from engine.baselines.generic import gpipe_any, one_f_one_b_any
from engine.dependency import lower
from engine.errors import ScheduleError, TesselError
from engine.placement import TensorSpec, pipeline_placement
from engine.schedule import peak_memory
from engine.shapes import make_shape
from engine.simulate import simulate
from engine.tessel import makespan_lower_bound, tessel_search
from engine.tessel.bounds import memory_floor
from engine.tessel.comm import transfer_lags
from engine.tessel.exact_model import prepare_exact
from engine.tessel.improve import ImproveResult, improve_schedule


class FixedLink:
    """Every transfer of a non-empty tensor between two devices takes ``seconds`` (abstract units)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def p2p_time(self, nbytes: int, src: int, dst: int) -> float:
        return self.seconds if nbytes and src != dst else 0.0

    def collective_time(self, kind: str, nbytes: int, ranks: list[int]) -> float:
        return 0.0

    def optimizer_time(self, param_bytes: int) -> float:
        return 0.0


def with_tensors(shape: str, n: int = 4, **kw):
    """The shape with a tensor on every forward output and backward input gradient."""
    probe = make_shape(shape, n, **kw)
    out = [TensorSpec((4096, 64), "float32")] * probe.num_segments
    return make_shape(shape, n, outputs=out, input_grads=out, **kw)


def _check(res: ImproveResult, schedule, limit, comm=None) -> None:
    """Valid under the limit, the reported makespan is the simulated one, never worse than the input."""
    res.schedule.validate(limit)
    assert res.schedule.num_micro_batches == schedule.num_micro_batches
    assert simulate(lower(res.schedule), comm).makespan == pytest.approx(res.makespan, abs=1e-9)
    assert simulate(lower(schedule), comm).makespan == pytest.approx(res.before, abs=1e-9)
    assert res.makespan <= res.before + 1e-9
    assert res.improved == (res.makespan < res.before - 1e-9)
    if not res.improved:
        assert res.schedule is schedule
    assert res.deterministic_time >= 0 and res.rounds >= 0


def test_improves_tessel_on_m4_m16():
    """M on 4 devices, limit 12 (6 activations of 2), m=16: Tessel's schedule (140 units when this
    was written) has slack in its warmup, cooldown and steady state; a small budget finds some."""
    pl, m, limit = make_shape("M", 4, activation=2), 16, 12
    ts = tessel_search(pl, m, memory_limit=limit, time_limit=1.0)
    res = improve_schedule(pl, ts.schedule, memory_limit=limit, deterministic_time=0.03, time_limit=30)
    _check(res, ts.schedule, limit)
    assert res.before == pytest.approx(ts.makespan)
    assert res.improved and res.makespan < ts.makespan
    assert res.makespan >= makespan_lower_bound(pl, m, memory_limit=limit) - 1e-9
    assert res.schedule.name == ts.schedule.name and res.schedule.meta["improve"]["before"] == res.before
    assert not res.wall_guard_hit


@pytest.mark.parametrize("shape,limit", [("X", 12), ("K", 4)])
def test_improves_1f1b_to_the_lower_bound(shape, limit):
    """The memory-aware 1F1B policy on X and K (4 devices, m=8) is improved to the makespan lower
    bound (X: 55 -> 51, K: 72 -> 58 units when this was written), where the search stops."""
    pl, m = make_shape(shape, 4, activation=2), 8
    s = one_f_one_b_any(pl, m, memory_limit=limit)
    res = improve_schedule(pl, s, memory_limit=limit, deterministic_time=0.2, time_limit=30)
    _check(res, s, limit)
    assert res.improved and res.stop == "bound"
    assert res.makespan == pytest.approx(makespan_lower_bound(pl, m, memory_limit=limit))


def test_never_worse_when_the_input_is_optimal():
    """1F1B on V without a limit reaches the bound: nothing to do, the input comes back as it is."""
    pl = make_shape("V", 4)
    s = one_f_one_b_any(pl, 8)
    res = improve_schedule(pl, s, deterministic_time=1.0, time_limit=30)
    _check(res, s, None)
    assert not res.improved and res.schedule is s and res.stop == "bound" and res.rounds == 0


def test_never_worse_on_a_short_budget():
    """A budget too short for any round still returns a valid schedule no worse than the input."""
    pl, limit = make_shape("NN", 4, activation=2), 18
    s = one_f_one_b_any(pl, 6, memory_limit=limit)
    res = improve_schedule(pl, s, memory_limit=limit, deterministic_time=1e-4, time_limit=30)
    _check(res, s, limit)
    assert res.rounds <= 1


def test_same_seed_same_schedule():
    """Two runs with the same seed end on the deterministic budget with identical orders."""
    pl, m, limit = make_shape("NN", 4, activation=2), 8, 18
    s = one_f_one_b_any(pl, m, memory_limit=limit)
    runs = [improve_schedule(pl, s, memory_limit=limit, deterministic_time=0.03, time_limit=60, seed=5)
            for _ in range(2)]
    a, b = runs
    assert a.stop == b.stop == "budget" and not a.wall_guard_hit and not b.wall_guard_hit
    assert a.improved and a.makespan == b.makespan and a.rounds == b.rounds
    assert [list(o) for o in a.schedule.orders] == [list(o) for o in b.schedule.orders]
    _check(a, s, limit)


def test_transfers_are_respected_and_the_makespan_is_simulated_with_them():
    """M with tensors and 1-unit links: the search sees the transfers as lags and the reported
    makespan is the simulator's with the same cost (103 -> 83 units when this was written)."""
    pl, m, limit = with_tensors("m", 4, activation=2), 8, 12
    comm = FixedLink(1.0)
    s = one_f_one_b_any(pl, m, memory_limit=limit)
    res = improve_schedule(pl, s, memory_limit=limit, comm=comm, deterministic_time=0.03, time_limit=30)
    _check(res, s, limit, comm)
    assert res.improved
    lags = transfer_lags(pl, comm.p2p_time)
    assert lags and res.makespan >= makespan_lower_bound(pl, m, memory_limit=limit, lags=lags) - 1e-9
    # the same lags without the cost model: the makespan is the orders' as-soon-as-possible one with them
    plain = improve_schedule(pl, s, memory_limit=limit, lags=lags, deterministic_time=0.03, time_limit=30)
    assert plain.makespan == pytest.approx(prepare_exact(pl, m, memory_limit=limit, lags=lags)
                                           .span_units(plain.schedule))
    plain.schedule.validate(limit)
    assert plain.makespan <= plain.before


def _zb4_grads():
    """Split backward (I/W) on 4 devices with gradient buffers and transient gradients."""
    return replace(pipeline_placement(4, split_backward=True, activation_bytes=2), grad_memory=(3,) * 4,
                   grad_transient=(1,) * 4)


def _v4_transient():
    """Plain backward with transient gradients only."""
    return replace(make_shape("V", 4, activation=2), grad_transient=(1,) * 4)


NEIGHBOURHOOD_CASES = [("M4 limit 12", lambda: make_shape("M", 4, activation=2), 12),
                       ("ZB4 grads limit 9", _zb4_grads, 9), ("V4 transient limit 7", _v4_transient, 7)]


@pytest.mark.parametrize("name,build,limit", NEIGHBOURHOOD_CASES, ids=[c[0] for c in NEIGHBOURHOOD_CASES])
def test_neighbourhood_models_agree_with_the_reservoir_form_and_keep_the_incumbent(name, build, limit):
    """Each window of the incumbent, re-solved with every other instance fixed: the incumbent is a
    solution (the optimum is no worse), and the cumulative and reservoir memory forms (which fold
    fixed events before the window into one) give the same optimum. Then the search itself."""
    pl, m = build(), 5
    s = one_f_one_b_any(pl, m, memory_limit=limit)
    forms = [prepare_exact(pl, m, memory_limit=limit, hint=s, cumulative=c) for c in (True, False)]
    cur = forms[0].hint_starts
    assert cur == forms[1].hint_starts
    order = sorted(cur, key=lambda x: (cur[x], x))
    span = forms[0].span(cur)
    for pos in range(0, len(order) - 12, 6):
        free = set(order[pos:pos + 12])
        fixed = {x: t for x, t in cur.items() if x not in free}
        best = []
        for prob in forms:
            em = prob.build(fixed=fixed, horizon=span, hint=cur)
            em.model.minimize(len(free) * (span + 1) * em.makespan + sum(em.start.values()))
            solver = cp_model.CpSolver()
            solver.parameters.num_workers = 1
            solver.parameters.max_time_in_seconds = 20
            assert solver.solve(em.model) == cp_model.OPTIMAL
            sol = em.solution(solver)
            assert solver.value(em.makespan) <= span
            assert sum(sol[x] for x in free) <= sum(cur[x] for x in free)
            best.append((solver.value(em.makespan), sum(sol[x] for x in free)))
        assert best[0] == best[1], pos
    _check(improve_schedule(pl, s, memory_limit=limit, deterministic_time=0.02, time_limit=30), s, limit)


def test_wall_guard_returns_a_valid_schedule_and_says_so():
    pl, limit = make_shape("NN", 4, activation=2), 18
    s = one_f_one_b_any(pl, 16, memory_limit=limit)
    res = improve_schedule(pl, s, memory_limit=limit, deterministic_time=100.0, time_limit=0.3)
    assert res.wall_guard_hit and res.stop == "wall"
    _check(res, s, limit)


def test_errors():
    pl, limit = make_shape("M", 4, activation=2), 12
    s = one_f_one_b_any(pl, 4, memory_limit=limit)
    kw = dict(deterministic_time=0.1, time_limit=10)
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(TesselError):
            improve_schedule(pl, s, memory_limit=limit, deterministic_time=bad, time_limit=10)
        with pytest.raises(TesselError):
            improve_schedule(pl, s, memory_limit=limit, deterministic_time=0.1, time_limit=bad)
    with pytest.raises(TesselError):
        improve_schedule(pl, s, memory_limit=limit, workers=0, **kw)
    floor = max(memory_floor(pl))
    greedy = gpipe_any(pl, 4)
    assert max(peak_memory(greedy)) > floor
    with pytest.raises(ScheduleError):   # the input exceeds the limit
        improve_schedule(pl, greedy, memory_limit=floor, **kw)
    with pytest.raises(TesselError):     # a schedule of another placement
        improve_schedule(make_shape("V", 4), s, **kw)
    bad = one_f_one_b_any(pl, 4, memory_limit=limit)
    bad.orders[1] = list(reversed(bad.orders[1]))
    with pytest.raises(ScheduleError):
        improve_schedule(pl, bad, memory_limit=limit, **kw)
