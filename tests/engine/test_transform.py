"""Model transformation: balanced layer partition under a memory bound."""

from __future__ import annotations

import pytest

from engine.errors import TransformError
from engine.transform import ParallelConfig, balanced_partition


def test_partition_minimises_the_slowest_segment():
    w = [1, 1, 1, 1, 4, 1, 1, 1, 1]
    r = balanced_partition(w, 3)
    assert r[0][0] == 0 and r[-1][1] == len(w)
    assert all(a[1] == b[0] for a, b in zip(r, r[1:]))
    assert r == [(0, 4), (4, 5), (5, 9)]  # [1,1,1,1] [4] [1,1,1,1]: slowest segment 4


def test_partition_equal_layers_is_even():
    assert balanced_partition([1.0] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_partition_respects_fits():
    w = [1.0] * 6
    # no segment may hold more than 2 items
    r = balanced_partition(w, 3, fits=lambda i, j: j - i <= 2)
    assert r == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(TransformError, match="memory"):
        balanced_partition(w, 2, fits=lambda i, j: j - i <= 2)


def test_too_many_segments():
    with pytest.raises(TransformError, match="at most 3"):
        balanced_partition([1, 2, 3], 4)


def test_parallel_config_checks():
    assert ParallelConfig(dp=2, tp=2, pp=4).devices == 16
    with pytest.raises(TransformError, match="micro_batches"):
        ParallelConfig(micro_batches=0).check()
