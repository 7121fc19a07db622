"""Lower bounds and memory floors for a placement (Tessel, HPCA 2024, section IV).

- Period lower bound: in steady state every device runs each of its blocks once per
  micro-batch, so the period is at least the busiest device's compute time per micro-batch.
- Critical path: the longest dependency chain of one micro-batch.
- Makespan lower bound for ``m`` micro-batches: per device, the shortest path to its first
  block + ``m`` times its work + the shortest path from its last block to the end.
- Memory floor: the least memory any schedule needs per device, reached by running one
  micro-batch at a time: static memory plus the highest prefix of that device's deltas along
  a topological order of the chain.
"""

from __future__ import annotations

import networkx as nx

from engine.placement import Placement


def period_lower_bound(placement: Placement) -> float:
    """Seconds: the busiest device's compute time for one micro-batch."""
    return max(placement.busy_time(d) for d in range(placement.num_devices))


def critical_path(placement: Placement) -> float:
    """Seconds: the longest dependency path of one micro-batch (sum of durations)."""
    g = placement.dependency_graph()
    longest: dict[int, float] = {}
    for i in nx.topological_sort(g):
        longest[i] = placement.blocks[i].duration + max((longest[p] for p in g.predecessors(i)), default=0.0)
    return max(longest.values(), default=0.0)


def makespan_lower_bound(placement: Placement, m: int) -> float:
    """Seconds: no schedule of ``m`` micro-batches finishes sooner (communication ignored).

    Per device ``d``: it cannot start before the shortest path to any of its blocks (``head``),
    must run ``m`` times its per-micro-batch work, and after its last block some chain of at
    least the shortest remaining path to a sink (``tail``) is still to run; the bound is the
    largest ``head + m * busy + tail``, and at least the critical path.
    """
    g = placement.dependency_graph()
    order = list(nx.topological_sort(g))
    blocks = placement.blocks
    head: dict[int, float] = {}
    for i in order:
        head[i] = max((head[p] + blocks[p].duration for p in g.predecessors(i)), default=0.0)
    tail: dict[int, float] = {}
    for i in reversed(order):
        tail[i] = max((tail[s] + blocks[s].duration for s in g.successors(i)), default=0.0)
    best = critical_path(placement)
    for d in range(placement.num_devices):
        on = placement.blocks_on(d)
        if on:
            best = max(best, min(head[i] for i in on) + m * placement.busy_time(d) + min(tail[i] for i in on))
    return best


def memory_floor(placement: Placement) -> list[int]:
    """Per device, the least peak memory of any schedule (bytes or the placement's units).

    One micro-batch in flight, blocks in chain (topological) order: static memory plus the
    maximum prefix sum of the device's memory deltas, with each segment's gradient buffer added
    at its weight-gradient block (or its transient gradient during that block, see
    :attr:`~engine.placement.Placement.grad_memory`).
    """
    g = placement.dependency_graph()
    order = list(nx.lexicographical_topological_sort(g))
    out = []
    for d in range(placement.num_devices):
        level = peak = placement.static_bytes(d)
        for i in order:
            b = placement.blocks[i]
            if d in b.devices:
                hold = trans = 0
                if b.kind in ("B", "W"):
                    hold = placement.grad_bytes(b.segment)
                    trans = 0 if hold else placement.grad_transient_bytes(b.segment)
                peak = max(peak, level + max(b.memory, 0) + hold + trans)
                level += b.memory + hold
        out.append(peak)
    return out
