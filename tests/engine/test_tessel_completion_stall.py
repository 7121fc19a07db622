"""tessel_search(completion_stall=...): completion solves stop once they stop improving."""
from __future__ import annotations

import time

from ortools.sat.python import cp_model

from engine.shapes import make_shape
from engine.tessel import tessel_search
from engine.tessel.completion import _solve_with_stall_stop


def _hard_model():
    """A small job-shop-like model CP-SAT finds solutions for at once but cannot prove optimal fast."""
    m = cp_model.CpModel()
    rng = __import__("random").Random(0)
    n_jobs, n_mach = 15, 10
    ends, per_mach = [], {k: [] for k in range(n_mach)}
    for j in range(n_jobs):
        prev = None
        for k in rng.sample(range(n_mach), n_mach):
            d = rng.randint(1, 99)
            s = m.NewIntVar(0, 20000, f"s{j}{k}")
            per_mach[k].append(m.NewFixedSizeIntervalVar(s, d, f"i{j}{k}"))
            if prev is not None:
                m.Add(s >= prev)
            prev = s + d
        ends.append(prev)
    mk = m.NewIntVar(0, 20000, "mk")
    m.AddMaxEquality(mk, ends)
    for ivs in per_mach.values():
        m.AddNoOverlap(ivs)
    m.Minimize(mk)
    return m


def test_stall_stop_ends_a_solve_long_before_its_time_limit():
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 60.0
    solver.parameters.num_workers = 1
    t0 = time.perf_counter()
    status = _solve_with_stall_stop(solver, _hard_model(), 0.2)
    elapsed = time.perf_counter() - t0
    # this 15 x 10 job shop is not proven optimal within seconds (a plain 5 s solve ends FEASIBLE):
    # the stall rule stopped it, far before the 60 s limit, with a solution
    assert status == cp_model.FEASIBLE
    assert elapsed < 30.0


def test_no_stall_means_plain_solve():
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 0.5
    solver.parameters.num_workers = 1
    assert _solve_with_stall_stop(solver, _hard_model(), None) in (cp_model.FEASIBLE, cp_model.OPTIMAL)


def _spy_completions(monkeypatch) -> list[tuple[dict, object]]:
    """Every call tessel_search makes to ``complete``: (its keyword arguments, its result)."""
    import engine.tessel.search as search_mod

    calls: list[tuple[dict, object]] = []
    real = search_mod.complete

    def spy(*a, **kw):
        out = real(*a, **kw)
        calls.append((kw, out))
        return out

    monkeypatch.setattr(search_mod, "complete", spy)
    return calls


def test_search_passes_the_stall_to_completion_and_gives_a_valid_schedule(monkeypatch):
    calls = _spy_completions(monkeypatch)
    pl = make_shape("m", 4, activation=2)
    res = tessel_search(pl, 16, memory_limit=20, time_limit=10, completion_stall=0.2)
    res.schedule.validate(20)   # dependencies hold and the memory limit is respected
    assert res.schedule.num_micro_batches == 16
    assert [kw.get("stall") for kw, _ in calls] == [0.2]
    assert res.schedule.meta["tessel"]["pure_makespan"] >= res.makespan_lower_bound - 1e-9


def test_completion_ends_on_deterministic_time_and_repeats_exactly(monkeypatch):
    """A completion that is not proven optimal ends on CP-SAT's deterministic-time budget, not
    on the wall clock, so two runs give the same schedule whatever the machine's load."""
    calls = _spy_completions(monkeypatch)
    pl = make_shape("x", 8, activation=2)
    a = tessel_search(pl, 16, memory_limit=22, time_limit=10)
    b = tessel_search(pl, 16, memory_limit=22, time_limit=10)
    statuses = [(kw.get("deterministic_time"), out.status) for kw, out in calls]
    assert len(statuses) == 2 and statuses[0] == statuses[1]
    det, status = statuses[0]
    assert det is not None and det > 0 and status == "feasible"   # ended on its deterministic budget
    assert a.schedule.orders == b.schedule.orders
    assert a.schedule.meta["tessel"]["pure_makespan"] == b.schedule.meta["tessel"]["pure_makespan"]
