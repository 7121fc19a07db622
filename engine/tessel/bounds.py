"""Lower bounds and memory floors for a placement (Tessel, HPCA 2024, section IV).

- Period lower bound: in steady state every device runs each of its blocks once per
  micro-batch, so the period is at least the busiest device's compute time per micro-batch.
- Critical path: the longest dependency chain of one micro-batch.
- Makespan lower bound for ``m`` micro-batches: per device, the idle time it cannot avoid
  before its work (the shortest path to its first block, or the blocks of other devices it
  cannot overlap because a multi-device block would need them too) + ``m`` times its work + the
  same at the end.
- Memory-time bound under a memory limit: activations must be held for at least their chain's
  length, and a device holds at most its limit at once (:func:`memory_time_bound`).
- Memory floor: the least memory any schedule needs per device, reached by running one
  micro-batch at a time: static memory plus the highest prefix of that device's deltas along
  a topological order of the chain.
"""

from __future__ import annotations

import time

import networkx as nx

from engine.placement import Placement


def period_lower_bound(placement: Placement) -> float:
    """Seconds: the busiest device's compute time for one micro-batch."""
    return max(placement.busy_time(d) for d in range(placement.num_devices))


def critical_path(placement: Placement, lags: dict[tuple[int, int], float] | None = None) -> float:
    """Seconds: the longest dependency path of one micro-batch (durations, plus the ``lags`` of
    cross-device dependencies where given: :func:`engine.tessel.comm.transfer_lags`)."""
    lags = lags or {}
    g = placement.dependency_graph()
    longest: dict[int, float] = {}
    for i in nx.topological_sort(g):
        longest[i] = placement.blocks[i].duration + max((longest[p] + lags.get((p, i), 0.0) for p in g.predecessors(i)),
                                                        default=0.0)
    return max(longest.values(), default=0.0)


def makespan_lower_bound(placement: Placement, m: int, memory_limit=None, *, deadline: float | None = None,
                         lags: dict[tuple[int, int], float] | None = None,
                         tail: list[float] | None = None) -> float:
    """Seconds: no schedule of ``m`` micro-batches finishes sooner.

    Communication counts only through ``lags`` (seconds per cross-device dependency, e.g.
    :func:`engine.tessel.comm.transfer_lags`, each at most the simulated transfer delay): they
    lengthen the dependency paths of the critical path and of the path heads and tails below;
    without them communication is ignored. ``tail`` (seconds per device, e.g. its optimizer step:
    :func:`engine.tessel.comm.step_tail`) is work a device does after its last block: it is added
    to that device's bound, and the smallest tail among the devices of the chain's sinks to the
    critical path.

    With ``memory_limit`` (per device, scalar or list, static memory included, the placement's
    memory unit) it is also at least :func:`memory_time_bound`. ``deadline`` (a
    ``time.perf_counter()`` value) bounds the memory-time term's effort, the only part that is
    quadratic in the blocks: past it, devices not yet examined are left out of that term (the
    result is still a lower bound, possibly a weaker one).

    Per device ``d`` the bound is ``head(d) + m * busy(d) + tail(d)``, the largest over devices,
    and at least the critical path. ``busy(d)`` is ``d``'s work per micro-batch; ``head`` and
    ``tail`` are idle time ``d`` cannot avoid at the start and the end of the schedule, the larger
    of two arguments:

    * *path*: ``d`` cannot start before the shortest path to any of its blocks, and after its
      last block at least the shortest remaining path to a sink still runs;
    * *exclusion* (:func:`exclusion_idle`): a block on several devices occupies all of them at
      once, so while another device runs a block that shares a device with every block ``d`` can
      run at that moment, ``d`` waits. E.g. on the M shape, device ``n - 1`` idles through the
      forward chain ``F1 .. F(n-1)`` before its first own forward (all it could run meanwhile is
      the all-device ``F0``, which needs device 0 too) and through ``B(n-1) .. B1`` after its last
      own backward: ``3 (n - 1)`` units with F=1, B=2, which the path argument misses (its
      all-device blocks start at time 0 and end the schedule).

    Source: the classic head-body-tail bound of one-machine scheduling (Carlier 1982), per device;
    the exclusion argument is ours, for Tessel's multi-device blocks (HPCA 2024, section III).

    Raises:
        ValueError: a ``memory_limit`` list with the wrong number of devices.
    """
    lags = lags or {}
    extra = list(tail) if tail else [0.0] * placement.num_devices   # the step's tail per device
    g = placement.dependency_graph()
    order = list(nx.topological_sort(g))
    blocks = placement.blocks
    head: dict[int, float] = {}
    for i in order:
        head[i] = max((head[p] + blocks[p].duration + lags.get((p, i), 0.0) for p in g.predecessors(i)), default=0.0)
    after: dict[int, float] = {}
    for i in reversed(order):
        after[i] = max((after[s] + blocks[s].duration + lags.get((i, s), 0.0) for s in g.successors(i)), default=0.0)
    sink_devices = {d for i in order if not any(True for _ in g.successors(i)) for d in blocks[i].devices}
    best = critical_path(placement, lags) + min((extra[d] for d in sink_devices), default=0.0)
    for d in range(placement.num_devices):
        on = placement.blocks_on(d)
        if not on:
            continue
        path_head = min(head[i] for i in on)
        path_tail = min(after[i] for i in on)
        (ex_head, first), (ex_tail, last) = exclusion_idle(placement, d)
        work = m * placement.busy_time(d) + extra[d]
        if first & last:
            # the first block instance waiting on another device starts before the last one
            # another device waits on ends (a block type in both sets), so the two idle spans
            # are disjoint
            best = max(best, max(path_head, ex_head) + work + max(path_tail, ex_tail))
        else:
            best = max(best, max(path_head, ex_head) + work + path_tail, path_head + work + max(path_tail, ex_tail))
    if memory_limit is not None:
        best = max(best, memory_time_bound(placement, m, memory_limit, deadline=deadline))
    return best


def memory_time_bound(placement: Placement, m: int, memory_limit, *, deadline: float | None = None) -> float:
    """Seconds: the makespan ``m`` micro-batches need to fit their activations under the limit.

    Little's law on memory. On device ``d``, an activation of ``s`` bytes allocated when its
    forward ``F`` starts and freed when a backward-kind block ``f`` of the same segment ends is
    held at least through the blocks on the heaviest dependency path from ``F`` to ``f``, which
    run one after another. Count only time outside the blocks on ALL devices (``E``: they exclude
    every other block and one another, so they fill exactly ``m * sum(E durations)`` seconds).
    Outside them ``d`` holds at most ``limit - static``, so::

        m * sum(s * path_excluding_E(F, f)) <= (limit_d - static_d) * (T - m * sum(E durations))

    which bounds the makespan ``T``. E.g. M on 4 devices (F=1, B=2, activation 1, limit 6): device
    0 holds the all-device ``F0``'s and its own ``F1``'s activation through the 12-unit chain
    ``F1 .. B1``, so ``T >= 3 m + 2 * 12 m / 6 = 7 m``, although it works only ``6 m``. A device
    whose frees cannot be paired with an earlier forward of the same segment is skipped (the bound
    stays valid, only weaker). Gradient buffers are ignored (they only add memory). Past
    ``deadline`` (a ``time.perf_counter()`` value) the device being examined and the rest are
    skipped the same way (its cost grows with blocks squared: one ancestor set per freeing block).

    Raises:
        ValueError: a ``memory_limit`` list with the wrong number of devices.
    """
    n = placement.num_devices
    limits = [float(memory_limit)] * n if isinstance(memory_limit, (int, float)) else [float(x) for x in memory_limit]
    if len(limits) != n:
        raise ValueError(f"memory_limit has {len(limits)} values for {n} devices")
    g = placement.dependency_graph()
    blocks = placement.blocks
    every = {i for i, b in enumerate(blocks) if len(b.devices) == n}
    e_time = sum(blocks[i].duration for i in every)
    order = list(nx.topological_sort(g))
    weight = [0.0 if i in every else b.duration for i, b in enumerate(blocks)]
    best = 0.0
    for d in range(n):
        room = limits[d] - placement.static_bytes(d)
        if room <= 0:
            continue
        held = 0.0  # sum over activations of bytes x seconds held outside E time, per micro-batch
        ok = True
        freed: dict[int, float] = {}
        for f in placement.blocks_on(d):
            if blocks[f].memory >= 0:
                continue
            if deadline is not None and time.perf_counter() >= deadline:
                return best  # out of time: the devices examined so far (still a lower bound)
            anc = nx.ancestors(g, f)
            alloc = [a for a in anc if blocks[a].kind == "F" and blocks[a].segment == blocks[f].segment
                     and d in blocks[a].devices and blocks[a].memory > 0]
            if len(alloc) != 1:
                ok = False
                break
            a = alloc[0]
            freed[a] = freed.get(a, 0.0) - blocks[f].memory
            if freed[a] > blocks[a].memory:
                ok = False
                break
            # heaviest path a -> f in non-E seconds, both ends included
            inside = (nx.descendants(g, a) & anc) | {a, f}
            longest: dict[int, float] = {}
            for i in order:
                if i in inside:
                    longest[i] = weight[i] + max((longest[p] for p in g.predecessors(i) if p in longest), default=0.0)
            held += -blocks[f].memory * longest[f]
        if ok and held > 0:
            best = max(best, m * e_time + m * held / room)
    return best


def exclusion_idle(placement: Placement, d: int) -> tuple[tuple[float, set[int]], tuple[float, set[int]]]:
    """Idle time device ``d`` cannot avoid at the start and at the end of any schedule (seconds).

    Start: let ``R`` be ``d``'s blocks with an ancestor on another device, and consider the first
    instance (any micro-batch) of an ``R`` block to start. Before it, ``d`` can only run its
    other blocks ``N`` (all of whose ancestors are on ``d``). Its ancestors on other devices run
    one after another along any dependency path; while one of them runs that shares a device
    with every block of ``N``, ``d`` is idle. So ``d`` idles at least the minimum over ``R`` of
    the heaviest such path into the block. The end is the mirror image (descendants, the last
    instance to end).

    Returns:
        ``((head, R), (tail, R'))``: the two idle times and the block index sets they refer to
        (the caller adds them only when ``R & R'`` is non-empty, which makes the spans disjoint).
    """
    g = placement.dependency_graph()
    blocks = placement.blocks
    on = set(placement.blocks_on(d))

    def side(graph) -> tuple[float, set[int]]:
        topo = list(nx.topological_sort(graph))
        # foreign[i]: block i has an ancestor not on d (one topological pass, not one ancestor set per block)
        foreign: dict[int, bool] = {}
        for i in topo:
            foreign[i] = any(foreign[p] or d not in blocks[p].devices for p in graph.predecessors(i))
        waits = {i for i in on if foreign[i]}
        free = on - waits  # what d can run before the first waiting block starts
        if not waits:
            return 0.0, waits
        free_sets = {frozenset(blocks[f].devices) for f in free}  # distinct device sets: few

        def blocking(p: int) -> bool:
            return d not in blocks[p].devices and all(not fs.isdisjoint(blocks[p].devices) for fs in free_sets)

        weight = {p: blocks[p].duration if blocking(p) else 0.0 for p in topo}
        acc: dict[int, float] = {}  # heaviest blocking-weight path ending at i, i excluded
        for i in topo:
            acc[i] = max((acc[p] + weight[p] for p in graph.predecessors(i)), default=0.0)
        return min(acc[i] for i in waits), waits

    return side(g), side(g.reverse(copy=True))


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
