"""GraphPartition and choose_partitions (NGra section 4 layout; issue 19).

References: the chunk layout is checked edge by edge against the raw ``edge_index`` (each edge's
original endpoints recovered through the permutation), chunk counts against a per-edge Python
count, the locality order against a graph whose optimal bandwidth is known (a shuffled path), and
the choice of P against :func:`predict_streamed_peak` evaluated independently at every P.
"""

from __future__ import annotations

import re

import pytest
import torch

from engine.errors import GNNError, PartitionError, TesselError
from engine.gnn.models import GNNConfig, build_gnn
from engine.gnn.partition import (
    GraphPartition,
    choose_partitions,
    locality_order,
    max_chunk_edges,
    partition_for_model,
    predict_streamed_peak,
)


def _graph(n: int = 203, e: int = 1500, seed: int = 0) -> torch.Tensor:
    """Random edges with duplicates and self-loops; vertices n-5..n-1 isolated."""
    gen = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n - 5, (2, e), generator=gen)
    loops = torch.tensor([[4, 4, 9], [4, 4, 9]])
    return torch.cat([ei, ei[:, :40], loops], dim=1)


@pytest.mark.parametrize("order", ["rcm", "identity"])
@pytest.mark.parametrize("parts", [1, 2, 3, 8, 16])
def test_every_edge_in_exactly_one_chunk_from_interval_i_to_j(parts: int, order: str) -> None:
    n = 203
    ei = _graph(n)
    part = GraphPartition.build(ei, n, parts, order=order)
    seen = []
    for j in range(parts):
        for i in range(parts):
            c = part.chunk(i, j)
            rows_i, rows_j = part.interval(i), part.interval(j)
            src, dst = c.src.long(), c.dst.long()
            assert bool((src >= 0).all()) and bool((src < rows_i.stop - rows_i.start).all())
            assert bool((dst >= 0).all()) and bool((dst < rows_j.stop - rows_j.start).all())
            # the local ids map back to the edge's original endpoints
            assert torch.equal(part.perm[src + rows_i.start], ei[0, c.edge_ids])
            assert torch.equal(part.perm[dst + rows_j.start], ei[1, c.edge_ids])
            assert bool((dst[1:] >= dst[:-1]).all()), "a chunk is destination-sorted (CSR-like)"
            seen.append(c.edge_ids)
    assert torch.equal(torch.sort(torch.cat(seen)).values, torch.arange(ei.shape[1]))


def test_chunk_counts_intervals_and_global_edges_match_a_per_edge_count() -> None:
    n, parts = 203, 5
    ei = _graph(n, seed=3)
    part = GraphPartition.build(ei, n, parts)
    sizes = [part.interval_size(k) for k in range(parts)]
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    starts = [part.interval(k).start for k in range(parts)]

    def interval_of(v: int) -> int:
        return max(k for k in range(parts) if starts[k] <= v)

    expected = torch.zeros(parts, parts, dtype=torch.int64)
    for s, d in ei.t().tolist():
        expected[interval_of(int(part.inv_perm[s])), interval_of(int(part.inv_perm[d]))] += 1
    assert torch.equal(part.chunk_edges(), expected)
    stats = part.stats()
    assert stats.max_chunk_edges == int(expected.max()) == part.max_chunk_edges
    assert stats.empty_chunks == int((expected == 0).sum())
    assert stats.diagonal_edges == int(expected.diagonal().sum())
    assert max_chunk_edges(ei, n, parts, part.perm) == part.max_chunk_edges
    # the global edge list is the renumbered input, in chunk order
    assert torch.equal(part.edge_index(), part.inv_perm[ei[:, part.edge_ids]])


def test_permute_unpermute_round_trip() -> None:
    n = 203
    part = GraphPartition.build(_graph(n), n, 4)
    x = torch.randn(n, 3, dtype=torch.float64)
    xp = part.permute(x)
    assert torch.equal(xp[7], x[part.perm[7]])
    assert torch.equal(part.unpermute(xp), x)
    assert torch.equal(part.permute(part.unpermute(x)), x)
    with pytest.raises(PartitionError, match="num_nodes=203 rows"):
        part.permute(x[:-1])


def test_rcm_recovers_the_locality_of_a_shuffled_path() -> None:
    """A path relabelled at random: RCM renumbers it with bandwidth 1, so only chunks (i, i) and
    (i, i +- 1) hold edges, where the identity order spreads them over most chunks."""
    n, parts = 400, 8
    gen = torch.Generator().manual_seed(1)
    label = torch.randperm(n, generator=gen)
    ei = torch.stack([label[:-1], label[1:]])
    perm = locality_order(ei, n)
    new = torch.empty_like(perm)
    new[perm] = torch.arange(n)
    assert int((new[ei[0]] - new[ei[1]]).abs().max()) == 1
    counts = GraphPartition.build(ei, n, parts).chunk_edges()
    far = [(i, j) for i in range(parts) for j in range(parts) if abs(i - j) > 1]
    assert all(int(counts[i, j]) == 0 for i, j in far)
    assert int((GraphPartition.build(ei, n, parts, order="identity").chunk_edges() > 0).sum()) > 3 * parts


def test_partition_for_model_uses_the_layers_prepared_edges() -> None:
    n = 203
    ei = _graph(n)
    gcn = build_gnn(GNNConfig("gcn", 4, 8, 3))
    sage = build_gnn(GNNConfig("sage", 4, 8, 3))
    # GCN replaces the self-loops by one per vertex
    assert partition_for_model(gcn, ei, n, 4).num_edges == int((ei[0] != ei[1]).sum()) + n
    assert partition_for_model(sage, ei, n, 4).num_edges == ei.shape[1]


@pytest.mark.parametrize("bad", [
    dict(num_parts=0), dict(num_parts=204), dict(order="bfs"), dict(order=torch.zeros(203, dtype=torch.long)),
    dict(edge_index=torch.tensor([[0, 1], [2, 203]])), dict(edge_index=torch.zeros(3, 4, dtype=torch.long)),
    dict(edge_index=torch.zeros(2, 4)),
])
def test_bad_partition_requests_raise_one_sentence(bad: dict) -> None:
    kwargs = dict(edge_index=_graph(), num_nodes=203, num_parts=4, order="rcm") | bad
    with pytest.raises(PartitionError) as info:
        GraphPartition.build(**kwargs)
    assert isinstance(info.value, GNNError) and isinstance(info.value, TesselError)
    assert str(info.value).endswith(".") and "\n" not in str(info.value)


def test_chunk_and_interval_reject_out_of_range_indices() -> None:
    part = GraphPartition.build(_graph(), 203, 4)
    with pytest.raises(PartitionError, match=r"\[0, 4\)"):
        part.chunk(0, 4)
    with pytest.raises(PartitionError, match=r"\[0, 4\)"):
        part.interval(-1)


CONFIG = GNNConfig("gat", 16, 32, 4, layers=2, heads=4)


def test_choose_partitions_is_the_smallest_fitting_power_of_two_and_monotone_in_the_budget() -> None:
    n = 512
    gen = torch.Generator().manual_seed(5)
    ei = build_gnn(CONFIG).layers[0].prepare_edges(torch.randint(0, n, (2, 20000), generator=gen), n)
    e = ei.shape[1]
    perm = locality_order(ei, n)
    peaks = {p: predict_streamed_peak(n, max_chunk_edges(ei, n, p, perm), CONFIG, p).total_bytes
             for p in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)}
    lo, hi = min(peaks.values()), max(peaks.values())
    budgets = sorted({int(lo + (hi - lo) * k / 40) for k in range(41)})
    chosen = [choose_partitions(n, e, CONFIG, b, edge_index=ei) for b in budgets]
    assert chosen == sorted(chosen, reverse=True), "a larger budget never needs more partitions"
    assert len(set(chosen)) > 2
    for b, p in zip(budgets, chosen):
        assert peaks[p] <= b
        assert all(peaks[q] > b for q in peaks if q < p), "P is the smallest power of two that fits"
    # a model instead of its config, and the uniform estimate without the edges, work too
    assert choose_partitions(n, e, build_gnn(CONFIG), budgets[-1], edge_index=ei) == chosen[-1]
    assert choose_partitions(n, e, CONFIG, hi) == 1


def test_choose_partitions_raises_one_sentence_naming_the_budget_and_the_minimum() -> None:
    n = 512
    ei = torch.randint(0, n, (2, 5000), generator=torch.Generator().manual_seed(2))
    floor = min(predict_streamed_peak(n, max_chunk_edges(ei, n, p, locality_order(ei, n)), CONFIG, p).total_bytes
                for p in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
    with pytest.raises(PartitionError) as info:
        choose_partitions(n, ei.shape[1], CONFIG, floor - 1, edge_index=ei)
    message = str(info.value)
    assert f"budget of {floor - 1} bytes" in message and f"predicted peak is {floor} bytes" in message
    assert message.endswith(".") and len(re.findall(r"\.\s+[A-Z]", message)) == 0 and "\n" not in message
    assert choose_partitions(n, ei.shape[1], CONFIG, floor, edge_index=ei) >= 1
    with pytest.raises(PartitionError, match="budget_bytes must be a positive int"):
        choose_partitions(n, ei.shape[1], CONFIG, 0)
    with pytest.raises(PartitionError, match="num_edges=7"):
        choose_partitions(n, 7, CONFIG, 10**9, edge_index=ei)
    with pytest.raises(PartitionError, match="GNNConfig or a GNNModel"):
        choose_partitions(n, ei.shape[1], object(), 10**9)
