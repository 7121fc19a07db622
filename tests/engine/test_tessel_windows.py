"""Repetend windows of several micro-batches: the fixed window option and the refinement rounds.

References: the repetend model's own proofs (a window proven infeasible at every shorter length
is optimal for its size), the simulator (every schedule validates under its limit) and the
rate bound (Little's law on memory, engine.tessel.bounds.memory_time_bound)."""

from __future__ import annotations

import pytest

from engine.errors import TesselError
from engine.plan import measure
from engine.shapes import make_shape
from engine.tessel import tessel_search
from engine.tessel.bounds import memory_time_bound


def test_fixed_window_searches_only_that_size():
    """M on 4 devices, limit 6 (F=1, B=2): one micro-batch per window reaches 9 units, proven
    optimal for that size; two reach 8, also proven; every result validates under the limit."""
    pl = make_shape("m", 4)
    got = {}
    for r in (1, 2):
        res = tessel_search(pl, 16, memory_limit=6, time_limit=10, window_micro_batches=r)
        assert res.repetend.micro_batches == r
        assert res.schedule.meta["tessel"]["micro_batches_per_window"] == r
        res.schedule.validate(6)
        assert not measure(res.schedule, 6).over_limit
        got[r] = (res.period, res.optimal)
    assert got == {1: (9.0, True), 2: (8.0, True)}


def test_fixed_window_is_validated():
    pl = make_shape("v", 4)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(TesselError, match="window_micro_batches must be an integer >= 1"):
            tessel_search(pl, 4, window_micro_batches=bad)


def test_period_bound_counts_littles_law_on_memory():
    """The reported period bound is the larger of the busiest device's work and Little's law on
    memory for one micro-batch; no window found beats it (M, 4 devices, limit 6: 7 > 6 units)."""
    pl = make_shape("m", 4)
    rate = memory_time_bound(pl, 1, 6)
    assert rate == pytest.approx(7.0)
    res = tessel_search(pl, 16, memory_limit=6, time_limit=5)
    assert res.period_lower_bound == pytest.approx(7.0)
    assert res.period >= res.period_lower_bound - 1e-9
    assert res.makespan_lower_bound >= 16 * 7.0


def test_refinement_beats_one_micro_batch_per_window():
    """Under a tight limit the refinement's windows of 2-3 micro-batches beat r = 1 (9 units on M,
    4 devices, limit 6) and the makespan follows the period."""
    pl = make_shape("m", 4)
    one = tessel_search(pl, 32, memory_limit=6, time_limit=5, window_micro_batches=1)
    more = tessel_search(pl, 32, memory_limit=6, time_limit=5)
    assert one.period == pytest.approx(9.0)
    assert more.period < one.period and more.repetend.micro_batches > 1
    assert measure(more.schedule, 6).makespan < measure(one.schedule, 6).makespan
