"""Issue 21 items 5-6: exact solver ticks, honest timings, and seed determinism under load.

References: ``resolution=1.0`` (the exact unit tick for F=1, B=3) through the Python API, the
simulator's makespan of the returned schedule, and a second run of the same search.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

from engine.dependency import lower
from engine.placement import BlockSpec, Placement
from engine.shapes import make_shape
from engine.simulate import simulate
from engine.tessel import tessel_search

ROOT = Path(__file__).resolve().parents[2]


def _f1b3(shape: str) -> Placement:
    return make_shape(shape, 4, forward=1.0, backward=3.0, activation=2)


@pytest.mark.parametrize("shape", ["v", "x", "m"])
def test_f1_b3_periods_are_integral_and_equal_the_unit_tick(shape):
    pl = _f1b3(shape)
    auto = tessel_search(pl, 16, time_limit=10)
    unit = tessel_search(pl, 16, time_limit=10, resolution=1.0)
    assert not auto.rounded and auto.resolution == 1.0
    assert auto.period == unit.period == int(auto.period)   # 4 / 8, not 4.02 / 8.04
    assert simulate(lower(auto.schedule)).makespan == simulate(lower(unit.schedule)).makespan


def _chain(durations: list[float]) -> Placement:
    n = len(durations) // 2
    blocks = []
    for i, d in enumerate(durations):
        dev = i if i < n else 2 * n - 1 - i
        blocks.append(BlockSpec("F" if i < n else "B", dev, (dev,), d, 1 if i < n else -1, (i - 1,) if i else ()))
    return Placement(n, tuple(blocks), name="irrational")


def test_inexact_durations_are_rounded_and_never_optimal():
    # 1/pi and e are within no rational of denominator <= 1e6 to 1e-9: the tick rounds them up
    pl = _chain([0.3183098861837907, 1.0, 2.718281828459045, 2.0])
    res = tessel_search(pl, 8, time_limit=5)
    assert res.rounded
    assert not res.optimal
    assert res.summary()["rounded"] is True and res.summary()["optimal"] is False


def _spin(stop):  # a busy loop: the machine under load
    while not stop.is_set():
        pass


def _orders(res):
    return [list(o) for o in res.schedule.orders]


@pytest.mark.serial
def test_same_seed_same_schedule_under_load():
    pl = make_shape("nn", 4, activation=2)
    # the phases' deterministic budgets are shares of time_limit; the wall clock gets three times
    # that, room for the 1.3-2.3x slowdown two busy loops cause on two cores (engine/tessel/budget.py)
    kw = dict(memory_limit=18, time_limit=10, wall_limit=30, seed=3)
    quiet = tessel_search(pl, 16, **kw)
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        loaded = tessel_search(pl, 16, **kw)
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=5)
    assert not quiet.wall_guard_hit and not loaded.wall_guard_hit
    assert _orders(quiet) == _orders(loaded)
    assert quiet.period == loaded.period


def test_cli_json_reports_search_completion_and_total(tmp_path):
    out = subprocess.run([sys.executable, "-m", "apps.cli", "search", "--json", "--placement", "x", "--devices", "4",
                          "--micro-batches", "8", "--time-limit", "3", "-o", str(tmp_path / "o")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("search_time", "completion_time", "total_time"):
        assert data[key] >= 0
    assert data["total_time"] >= data["search_time"] + data["completion_time"] - 1e-6
    assert data["rounded"] is False


def test_a_wall_limit_stretches_the_wall_clock_only(monkeypatch):
    """``wall_limit`` moves the deadline every phase is guarded by; the phases' deterministic
    budgets stay shares of ``time_limit``, so an idle machine gives the same schedule either way."""
    from engine.tessel.budget import SearchBudget

    pl = make_shape("m", 4, activation=2)
    made = []
    orig = SearchBudget.for_search.__func__

    def spy(cls, *a, **k):
        made.append(orig(cls, *a, **k))
        return made[-1]

    monkeypatch.setattr(SearchBudget, "for_search", classmethod(spy))
    plain = tessel_search(pl, 8, memory_limit=6, time_limit=2, seed=1)
    wide = tessel_search(pl, 8, memory_limit=6, time_limit=2, wall_limit=6, seed=1)
    assert made[1].deadline - made[1].t_start == pytest.approx(made[0].deadline - made[0].t_start + 4)
    assert made[1].clock.total_s == made[0].clock.total_s
    assert made[1].completion_cap_s == made[0].completion_cap_s
    assert not plain.wall_guard_hit and not wide.wall_guard_hit
    assert _orders(plain) == _orders(wide)
