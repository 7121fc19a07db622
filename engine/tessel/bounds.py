"""Lower bounds and memory floors for a placement (Tessel, HPCA 2024, section IV).

- Period lower bound: in steady state every device runs each of its blocks once per
  micro-batch, so the period is at least the busiest device's compute time per micro-batch.
- Critical path: the longest dependency chain of one micro-batch.
- Makespan lower bound for ``m`` micro-batches: per device, the idle time it cannot avoid
  before its work (the shortest path to its first block, or the blocks of other devices it
  cannot overlap because a multi-device block would need them too) + ``m`` times its work + the
  same at the end.
- Memory-time bound under a memory limit: activations must be held for at least their chain's
  length, and a device holds at most its limit at once (:func:`memory_time_bound`; Little's law,
  also the steady-state rate per micro-batch).
- In-flight bound (:func:`in_flight_bound`): a longest path over the instances of all ``m``
  micro-batches, through the dependencies, each block's instances one after another, each
  device's load and, under a memory limit, how many micro-batches can be in flight on a device
  (1F1B's limit, made a precedence): the ramp-up and ramp-down that Little's law misses.
- Memory floor: the peak memory per device of running one micro-batch at a time: static memory
  plus the highest prefix of that device's deltas along a topological order of the chain
  (gradient buffers held across micro-batches can make a schedule need more, see
  :func:`memory_floor`).
"""

from __future__ import annotations

import math
import time
from fractions import Fraction

import networkx as nx
import numpy as np

from engine.errors import PlacementError
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
    :func:`engine.tessel.comm.step_tail`) is work a device does after its last block, while the
    other devices may still run theirs (the step ends when every device has, as
    :func:`engine.tessel.comm.asap_makespan` counts it): a device's bound ends with the larger of
    its tail and the time after its last block, and the critical path gets the smallest tail among
    the devices of the chain's sinks.

    With ``memory_limit`` (per device, scalar or list, static memory included, the placement's
    memory unit) it is also at least :func:`memory_time_bound`. It is always at least
    :func:`in_flight_bound` (with the limit, if any): the per-device head-body-tail below refined
    per micro-batch, and under a limit the in-flight precedences of memory. ``deadline`` (a
    ``time.perf_counter()`` value) bounds the effort of those two terms (the memory-time term is
    quadratic in the blocks, the in-flight one linear in ``m`` x blocks): past it, what is not yet
    examined is left out (the result is still a lower bound, possibly a weaker one).

    Per device ``d`` the bound is ``head(d) + m * busy(d) + tail(d)``, the largest over devices,
    and at least the critical path. ``busy(d)`` is ``d``'s work per micro-batch; ``head`` and
    ``tail`` are idle time ``d`` cannot avoid at the start and the end of the schedule, the larger
    of two arguments (and for ``tail``, at least ``d``'s step tail):

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
    limits = _limit_list(placement.num_devices, memory_limit)
    net = _net(placement, lags)
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
        (ex_head, first), (ex_tail, last) = _exclusion_idle(net, blocks, d)
        work = m * placement.busy_time(d)
        # after d's last block, d works its step tail while the other devices finish: the larger
        path_tail = max(path_tail, extra[d])
        if first & last:
            # the first block instance waiting on another device starts before the last one
            # another device waits on ends (a block type in both sets), so the two idle spans
            # are disjoint
            best = max(best, max(path_head, ex_head) + work + max(path_tail, ex_tail))
        else:
            best = max(best, max(path_head, ex_head) + work + path_tail, path_head + work + max(path_tail, ex_tail))
    if memory_limit is not None:
        best = max(best, memory_time_bound(placement, m, memory_limit, deadline=deadline))
    if m >= 1 and blocks:
        best = max(best, _in_flight(placement, net, m, limits, [float(x) for x in extra], deadline))
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
        raise PlacementError(f"memory_limit has {len(limits)} values for {n} devices")
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


def in_flight_bound(placement: Placement, m: int, memory_limit=None, *,
                    lags: dict[tuple[int, int], float] | None = None, tail: list[float] | None = None,
                    deadline: float | None = None) -> float:
    """Seconds: no schedule of ``m`` micro-batches finishes sooner, by a longest path over the block
    instances of all ``m`` micro-batches that also sees how many micro-batches memory lets be in
    flight on each device (with ``memory_limit``), the ramp-up and ramp-down of a pipeline included.

    ``memory_limit`` (scalar or one value per device, static memory included, the placement's memory
    unit; ``None``: no limit), ``lags`` and ``tail`` (the step tail per device) mean what they mean
    for :func:`makespan_lower_bound`, which takes this bound as one of its terms. ``deadline`` (a
    ``time.perf_counter()`` value): past it, what is left is skipped (0.0 if nothing was finished;
    still a lower bound). Cost: ``O(m x (blocks + dependencies + constraints))``, a few tens of
    milliseconds for 32 devices and m = 64.

    **FIFO.** An optimal schedule exists in which every block's instances start in micro-batch order
    (:mod:`engine.tessel.exact`, "Symmetry breaking": relabel each block's instances by start time;
    device occupancy, memory and the dependencies with their lags still hold), so a bound on every
    FIFO schedule bounds the optimum, hence every schedule. Let ``S(i, b)`` be the start of
    micro-batch ``i``'s instance of block ``b``, ``w(b)`` its duration, ``T`` the makespan. Every
    FIFO schedule satisfies, for every ``i``:

    1. *dependencies*: ``S(i, b) >= S(i, p) + w(p) + lag(p, b)`` for each dependency ``p`` of ``b``;
    2. *one block at a time*: ``S(i, b) >= S(i - 1, b) + w(b)`` (FIFO; the instances share devices);
    3. *one device's load*: for each device ``d`` of ``b``, with ``A`` the blocks on ``d`` that are
       ancestors of ``b``, ``S(i, b) >= h + (i + 1) w(A) + i w(b)``, where ``h`` is the least head
       (longest path from a source, lags included) of ``A`` and ``b``: before ``S(i, b)``, ``d`` ran
       instances ``0..i`` of every block of ``A`` (dependencies and FIFO) and ``0..i - 1`` of ``b``, one
       at a time, none before ``h``;
    4. *in flight*: device ``d``'s block memory splits into *pieces*, each allocated at the start of
       a forward and freed at the end of a later block of the same micro-batch (or never): every
       free paired with its segment's forward, as :func:`memory_time_bound` does (a device where
       that fails gets no such constraint). Its level is static memory, gradient memory and the
       pieces held, all non-negative, at most the limit; ``room`` is the limit less static memory.
       For a set ``X`` of blocks and a freeing block ``f`` of ``d``, let ``P(X, f)`` be the pieces
       of one micro-batch allocated by ``X`` or an ancestor and freed by ``f`` or a descendant (or
       never), ``|.|`` their amount. For an allocating block ``a`` of ``d`` and ``c >= 1`` with
       ``K1 + (c - 1) K2 + K3 > room``:  ``S(i + c, a) >= S(i, f) + w(f)``, where ``K2 = |P({a}, f)|``
       and either

       * ``K1 = K2`` and ``K3 = K2`` plus the pieces allocated by ``a`` or an ancestor and freed a
         positive time after ``a`` starts (by a descendant of ``a``), or
       * ``K1 = |P({a, a1}, f)|`` and ``K3 = K2``, for another allocating block ``a1`` of ``d`` that
         ``f`` follows by a positive time.

       Proof: let ``t = S(i + c, a)`` (second case: the later of it and ``S(i, a1)``) and suppose
       ``t < e = S(i, f) + w(f)``. Every micro-batch ``j`` of ``i..i + c`` has allocated ``P({a}, f)``
       by ``t`` (``S(j, a) <= S(i + c, a)``, FIFO) and frees it no sooner than ``e`` (FIFO on ``f``):
       ``K2`` each; in the first case micro-batch ``i + c`` also holds the pieces that a
       descendant of its ``a`` frees, a positive time after ``t``, its ``a``'s start; in the second
       micro-batch ``i`` also holds what ``a1`` and its ancestors allocated. So the level exceeds
       ``room``: hence ``t >= e``, and as ``S(i, a1) < e``, ``S(i + c, a) >= e``. With one piece per
       micro-batch (first case) this is 1F1B's in-flight limit, ``c = floor(room / activation)``.
       *Gradient buffers*
       (:attr:`~engine.placement.Placement.grad_memory`): let ``G`` be those of the segments whose
       weight-gradient block on ``d`` is ``f`` or an ancestor of it, and ``c' < c`` the least count
       for ``room - G``; then also ``S(i + c', a) >= e`` for ``i >= c - c'``: if ``f`` of micro-batch
       0 ended by ``t``, those buffers are held (allocated when their segment's first
       weight-gradient instance starts, no later), and ``G + K1 + (c' - 1) K2 + K3 > room``;
       otherwise micro-batches ``0..i - 1`` hold ``K2`` each too (freed no sooner than ``f`` of
       micro-batch 0 ends), and ``i K2 + K1 + (c' - 1) K2 + K3 >= K1 + (c - 1) K2 + K3 > room``.

    Every constraint links an instance to ones of the same or an earlier micro-batch (``c >= 1``),
    so the least ``S`` satisfying them all is a longest path in an acyclic graph, computed micro-batch
    by micro-batch; every FIFO schedule starts each instance no sooner. The same computation on the
    *reversed* problem (time runs backwards: dependencies reversed with their lags, a piece's free
    becomes its allocation, the step tail a head: no block of device ``d`` starts before its tail;
    constraint 4 maps onto itself, and a FIFO schedule reversed is FIFO after relabelling ``i -> m - 1
    - i``) gives ``R``, with ``T - S(i, b) - w(b) >= R(m - 1 - i, b)``. Then:

    * ``T >= S(j, b) + w(b) + R(m - 1 - j, b)`` for every block and micro-batch (``j = m - 1``:
      the last instance, then the longest path after it and the step tail);
    * per device ``d`` and ``j <= j'``: ``T >= min_b S(j, b) + (j' - j + 1) busy(d) + min_b R(m - 1 -
      j', b)`` over ``d``'s blocks (one machine: the instances of micro-batches ``j..j'`` on ``d``
      start no sooner than the first term, run one at a time, and the last to end is followed by
      the last term; both terms are monotone in the micro-batch), the best ``j`` by a running
      maximum;
    * per device with pieces, *memory area* (Little's law with its ramps): each piece is held at
      least its span (the longest path from its allocating block's start to its freeing block's
      end), so the pieces need ``m x sum(amount x span)`` of area under the level; at time ``t`` the
      level is at most ``room``, at most ``U(t)``, the amount whose allocating instance can have
      started (``S <= t``), and at most ``V(T - t)``, the amount whose freeing instance can still
      be running (``R < T - t``). ``T`` is at least the least value for which the integral of the
      smallest of the three over ``[0, T]`` reaches the need (:func:`_area_bound`).

    All of it in real time, and, where the placement has blocks on every device (``E``: they
    exclude every other block and one another, so they fill exactly ``m x sum(E durations)``), again
    in *non-E time* (the clock stops while an ``E`` block runs): constraints 1-4 hold there with
    ``E`` durations 0 and the lags dropped (an ``E`` block of another micro-batch may run during a
    lag; constraint 4 holds in any clock that never runs backwards; the step tail follows the
    device's last block, after every ``E`` block), and ``T`` is the non-E bound plus ``m x sum(E
    durations)``.

    Examples (F=1, B=2, activation 1). V on 16 devices, limit 8, m = 64: device 15 starts ``B15`` of
    micro-batch 7 no sooner than ``15 + 8 x 1 + 7 x 2 = 37`` (constraint 3); its backward reaches
    device 0 and ends at ``37 + 16 x 2 = 69``; ``F0`` of micro-batch 15 waits for it (8 in flight),
    and each micro-batch 8 later waits for the whole 48-unit chain ``F0 .. B0`` again:
    ``69 + 7 x 48 = 405``, which 1F1B with the limit achieves (Little's law gives 384). M on 4
    devices, limit 6, m = 4: device 0 holds 2 activations of each micro-batch from ``F1`` to ``B1``,
    12 non-E units apart, so ``c = 3``; the first three ``F1`` start at non-E 0, 1, 2, the fourth
    waits for the first ``B1`` to end (12), the last ``B1`` ends at 24: ``T >= 24 + 4 x 3 = 36``, the
    exact optimum (Little's law gives ``4 x 3 + 4 x 2 x 12 / 6 = 28``).

    Sources: the in-flight limit is 1F1B's (PipeDream-Flush, Narayanan et al., ICML 2021) made a
    precedence, as in :mod:`engine.tessel.exact`'s model; the one-machine bounds are the classic
    head-body-tail bounds (Carlier 1982); the area term is Little's law (Little 1961) with release
    and due times; the non-E clock and the multi-piece counts are ours, for Tessel's placements.

    Raises:
        ValueError: a ``memory_limit`` list with the wrong number of devices.
    """
    limits = _limit_list(placement.num_devices, memory_limit)
    if m < 1 or not placement.blocks:
        return 0.0
    extra = [float(x) for x in tail] if tail else [0.0] * placement.num_devices
    return _in_flight(placement, _net(placement, lags), m, limits, extra, deadline)


def _limit_list(n: int, memory_limit) -> list[float | None]:
    """The memory limit per device (``None`` everywhere without one); raises ``ValueError`` for a
    list of the wrong length."""
    if memory_limit is None:
        return [None] * n
    if isinstance(memory_limit, (int, float)):
        return [float(memory_limit)] * n
    limits: list[float | None] = [float(x) for x in memory_limit]
    if len(limits) != n:
        raise PlacementError(f"memory_limit has {len(limits)} values for {n} devices")
    return limits


def _in_flight(placement: Placement, net: "_Net", m: int, limits: list[float | None], extra: list[float],
               deadline: float | None) -> float:
    """:func:`in_flight_bound` on the placement's DAG ``net`` (:func:`_net`, with the lags)."""
    blocks = placement.blocks
    n = placement.num_devices
    memory = _memory_pieces(placement, net, limits)
    cons = _in_flight_constraints(placement, net, memory, m)
    every = [len(b.devices) == n for b in blocks]
    e_time = sum(b.duration for b, e in zip(blocks, every) if e)
    clocks = [([b.duration for b in blocks], net, 0.0)]
    if e_time > 0:
        clocks.append(([0.0 if e else b.duration for b, e in zip(blocks, every)], net.without_lags(), m * e_time))
    best = 0.0
    for w, clock_net, added in clocks:
        out = _instance_bound(clock_net, w, cons, memory, m, extra, deadline)
        if out is None:
            break
        best = max(best, out + added)
    return best


def _net(placement: Placement, lags: dict[tuple[int, int], float] | None) -> "_Net":
    """The placement's dependency DAG with its lags, as :class:`_Net`."""
    lags = lags or {}
    blocks = placement.blocks
    return _Net(len(blocks), [[(p, float(lags.get((p, i), 0.0))) for p in b.deps] for i, b in enumerate(blocks)],
                [b.devices for b in blocks], placement.num_devices)


class _Net:
    """The dependency DAG of one micro-batch as the in-flight bound walks it: per block its
    predecessors and successors with their lags, a topological order, ancestor and descendant sets
    (bit masks), device sets and the blocks of each device. :meth:`reversed` is the same DAG with
    time running backwards."""

    def __init__(self, nb: int, preds: list[list[tuple[int, float]]], devs: list[tuple[int, ...]], n: int,
                 _rest: tuple | None = None) -> None:
        self.nb, self.preds, self.devs, self.n = nb, preds, devs, n
        if _rest is not None:
            self.succs, self.topo, self.anc, self.desc, self.on = _rest
            return
        succs: list[list[tuple[int, float]]] = [[] for _ in range(nb)]
        for b in range(nb):
            for p, lag in preds[b]:
                succs[p].append((b, lag))
        indeg = [len(p) for p in preds]
        stack = [b for b in range(nb) if not indeg[b]]
        topo: list[int] = []
        while stack:
            b = stack.pop()
            topo.append(b)
            for s, _ in succs[b]:
                indeg[s] -= 1
                if not indeg[s]:
                    stack.append(s)
        anc = [0] * nb
        for b in topo:
            for p, _ in preds[b]:
                anc[b] |= anc[p] | (1 << p)
        desc = [0] * nb
        for b in reversed(topo):
            for s, _ in succs[b]:
                desc[b] |= desc[s] | (1 << s)
        on: list[list[int]] = [[] for _ in range(n)]
        for b in range(nb):
            for d in devs[b]:
                on[d].append(b)
        self.succs, self.topo, self.anc, self.desc, self.on = succs, topo, anc, desc, on

    def reversed(self) -> "_Net":
        return _Net(self.nb, self.succs, self.devs, self.n,
                    (self.preds, self.topo[::-1], self.desc, self.anc, self.on))

    def without_lags(self) -> "_Net":
        return _Net(self.nb, [[(p, 0.0) for p, _ in ps] for ps in self.preds], self.devs, self.n,
                    ([[(s, 0.0) for s, _ in ss] for ss in self.succs], self.topo, self.anc, self.desc, self.on))


Amount = int | Fraction   # memory, exactly: ints where every size is whole (the usual case: bytes, units)


def _exact(x: float | Fraction) -> Amount:
    """``x`` as an exact number: an ``int`` when it is whole, otherwise a ``Fraction``."""
    q = Fraction(x)
    return q.numerator if q.denominator == 1 else q


def _pieces(placement: Placement, d: int, anc: list[int]) -> list[tuple[int, int | None, Amount]] | None:
    """Device ``d``'s block memory as pieces ``(alloc, free, amount)``: ``amount`` allocated at the
    start of block ``alloc`` and freed at the end of block ``free`` (``None``: never) of the same
    micro-batch, every free paired with the one forward of its segment on ``d`` among its ancestors
    that allocates (:func:`memory_time_bound`'s pairing); ``None`` where that fails. As the allocating
    block is an ancestor of the freeing one, the level on ``d`` is the sum of the pieces held."""
    blocks = placement.blocks
    on = placement.blocks_on(d)
    left = {b: _exact(blocks[b].memory) for b in on if blocks[b].memory > 0}
    out: list[tuple[int, int | None, Amount]] = []
    for f in on:
        if blocks[f].memory >= 0:
            continue
        alloc = [a for a in left
                 if anc[f] >> a & 1 and blocks[a].kind == "F" and blocks[a].segment == blocks[f].segment]
        amount = -_exact(blocks[f].memory)
        if len(alloc) != 1 or left[alloc[0]] < amount:
            return None
        left[alloc[0]] -= amount
        out.append((alloc[0], f, amount))
    out += [(a, None, k) for a, k in left.items() if k > 0]
    return out


def _memory_pieces(placement: Placement, net: _Net,
                   limits: list[float | None]) -> list[tuple[list[tuple[int, int | None, Amount]], Amount] | None]:
    """Per device, its pieces (:func:`_pieces`) and its room (limit less static memory), or ``None``
    (no limit, no block memory, or frees that do not pair). Where every size is whole, so is the
    level, and the room is rounded down to a whole number (the level fits iff it fits that)."""
    out: list[tuple[list[tuple[int, int | None, Amount]], Amount] | None] = []
    whole = all(isinstance(_exact(v), int) for v in
                [b.memory for b in placement.blocks] + list(placement.grad_memory) + list(placement.static_memory))
    for d, lim in enumerate(limits):
        if lim is None or not math.isfinite(lim):
            out.append(None)
            continue
        pieces = _pieces(placement, d, net.anc)
        room = Fraction(lim) - placement.static_bytes(d)
        out.append((pieces, math.floor(room) if whole else _exact(room)) if pieces else None)
    return out


def _in_flight_constraints(placement: Placement, net: _Net, memory: list, m: int) -> list[tuple[int, int, int, int]]:
    """``(a, f, c, i0)``: ``S(i + c, a) >= S(i, f) + w(f)`` for every ``i >= i0`` (constraint 4 of
    :func:`in_flight_bound`), only those with ``1 <= c`` and ``i0 + c < m`` (the others say nothing).
    ``memory``: :func:`_memory_pieces`."""
    out: list[tuple[int, int, int, int]] = []
    blocks = placement.blocks
    dur = [b.duration for b in blocks]
    spans: dict[int, list[float]] = {}

    def longest(a: int) -> list[float]:
        if a not in spans:
            spans[a] = _longest_from(net, dur, a)
        return spans[a]

    for d, mem in enumerate(memory):
        if mem is None:
            continue
        pieces, room = mem
        grads = []   # (buffer bytes, its segment's weight-gradient blocks on d)
        for s in placement.grad_segments_on(d):
            if placement.grad_bytes(s):
                grads.append((placement.grad_bytes(s), [b for b in net.on[d] if blocks[b].segment == s
                                                          and blocks[b].kind in ("B", "W")]))
        allocs = sorted({p[0] for p in pieces})
        frees = sorted({p[1] for p in pieces if p[1] is not None})
        for f in frees:
            after = net.desc[f] | 1 << f
            held = [(x, q) for x, y, q in pieces if y is None or after >> y & 1]   # freed by f or later
            g = sum(size for size, wg in grads if any(x == f or net.anc[f] >> x & 1 for x in wg))
            # the oldest micro-batch's other allocating block a1: one that f follows by a positive
            # time (so that a1 starts before f ends)
            olds = [a for a in allocs if net.anc[f] >> a & 1 and longest(a)[f] > 0]
            for a2 in allocs:
                mask2 = net.anc[a2] | 1 << a2
                k2 = sum(q for x, q in held if mask2 >> x & 1)
                if k2 <= 0:
                    continue
                # what the youngest micro-batch holds when its a2 starts: also pieces freed after a2
                # by a positive time
                span2 = longest(a2)
                k3 = sum(q for x, y, q in pieces if mask2 >> x & 1 and (y is None or after >> y & 1 or span2[y] > 0))
                found: set[tuple[int, int]] = set()   # (c, i0)
                for a1 in [a2] + [a for a in olds if a != a2]:
                    mask1 = mask2 | net.anc[a1] | 1 << a1
                    k1 = sum(q for x, q in held if mask1 >> x & 1)
                    last = k3 if a1 == a2 else k2
                    c = _least_count(room, k1, k2, last)
                    if c is None or c >= m:
                        continue
                    found.add((c, 0))
                    c2 = _least_count(room - g, k1, k2, last) if g else None
                    if c2 is not None and c2 < c:
                        found.add((c2, c - c2))
                out += [(a2, f, c, i0) for c, i0 in found]
    # keep per (a, f) the constraints no other one implies (a smaller c from a smaller i0 does)
    best: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for a, f, c, i0 in out:
        best.setdefault((a, f), set()).add((c, i0))
    return [(a, f, c, i0) for (a, f), found in best.items() for c, i0 in sorted(found)
            if not any((c_, i_) != (c, i0) and c_ <= c and i_ <= i0 for c_, i_ in found)]


def _least_count(room: Amount, k1: Amount, k2: Amount, last: Amount) -> int | None:
    """The least ``c >= 1`` with ``k1 + (c - 1) k2 + last > room`` (``None``: none, as ``k2`` is 0)."""
    if k1 + last > room:
        return 1
    if k2 <= 0:
        return None
    return int((room - k1 - last) // k2) + 2


def _instance_bound(net: _Net, w: list[float], cons: list[tuple[int, int, int, int]], memory: list, m: int,
                    extra: list[float], deadline: float | None) -> float | None:
    """The bounds of :func:`in_flight_bound` for one clock (durations ``w``, lags in ``net``): the
    largest of the per-instance, per-device and memory-area terms; ``None`` past ``deadline``."""
    zero = [0.0] * net.n
    forward = _least_starts(net, w, [(a, f, c, c + i0, m - 1) for a, f, c, i0 in cons], m, zero, deadline)
    if forward is None:
        return None
    back = net.reversed()
    # reversed: S(i + c, a) >= end(i, f) reads R(j + c, f) >= R(j, a) + w(a) with j = m - 1 - i - c
    backward = _least_starts(back, w, [(f, a, c, c, m - 1 - i0) for a, f, c, i0 in cons], m, extra, deadline)
    if backward is None:
        return None
    ends_at = backward[:, ::-1]   # ends_at[b, i]: T - (end of micro-batch i's b) is at least this
    best = float(np.max(forward + np.array(w)[:, None] + ends_at))
    j = np.arange(m, dtype=float)
    for d in range(net.n):
        on = net.on[d]
        if not on:
            continue
        busy = sum(w[b] for b in on)
        run = np.maximum.accumulate(forward[on].min(axis=0) - j * busy)
        best = max(best, float(np.max(run + (j + 1) * busy + ends_at[on].min(axis=0))))
    spans: dict[int, list[float]] = {}
    for mem in memory:
        if mem is None:
            continue
        pieces, room = mem
        need = 0.0
        for a, f, k in pieces:
            if f is not None:
                if a not in spans:
                    spans[a] = _longest_from(net, w, a)
                need += float(k) * spans[a][f]
        if need > 0:
            starts = sorted((x, float(k)) for a, _, k in pieces for x in forward[a].tolist())
            ends = sorted((x, float(k)) for _, f, k in pieces
                          for x in ([0.0] * m if f is None else ends_at[f].tolist()))
            best = max(best, _area_bound(starts, ends, float(room), m * need))
    return best


def _longest_from(net: _Net, w: list[float], a: int) -> list[float]:
    """Per block ``b``, the longest path from the start of ``a`` to the end of ``b`` (durations and
    lags, both ends included); ``-inf`` where ``b`` does not descend from ``a``."""
    dist = [-math.inf] * net.nb
    dist[a] = w[a]
    for b in net.topo:
        if net.anc[b] >> a & 1:
            dist[b] = w[b] + max(dist[p] + lag for p, lag in net.preds[b])
    return dist


def _area_bound(starts: list[tuple[float, float]], ends: list[tuple[float, float]], room: float, need: float) -> float:
    """The least ``T`` with ``need <= integral over [0, T] of min(room, U(t), V(T - t))``, where ``U(t)``
    sums the amounts of ``starts`` at most ``t`` and ``V(x)`` those of ``ends`` below ``x`` (both
    sorted by time): the memory-area term of :func:`in_flight_bound`. By layer: at level ``y`` the
    integrand exceeds ``y`` on ``[u(y), T - v(y))``, ``u(y)`` the first start where ``U`` passes ``y``
    and ``v(y)`` the first end where ``V`` does, so the integral is ``sum dy * max(0, T - u - v)``."""
    total = sum(k for _, k in starts)
    top = min(room, total)
    layers: list[tuple[float, float]] = []   # (u + v, dy)
    iu = iv = 0
    cu, cv = starts[0][1], ends[0][1]
    y = 0.0
    while y < top:
        nxt = min(cu, cv, top)
        if nxt > y:
            layers.append((starts[iu][0] + ends[iv][0], nxt - y))
        y = nxt
        while cu <= y and iu + 1 < len(starts):
            iu += 1
            cu += starts[iu][1]
        while cv <= y and iv + 1 < len(ends):
            iv += 1
            cv += ends[iv][1]
        if cu <= y or cv <= y:
            break
    if not layers:
        return 0.0
    layers.sort()
    slope = offset = 0.0
    for idx, (g, dy) in enumerate(layers):
        slope += dy
        offset += dy * g
        t = (need + offset) / slope
        if idx + 1 == len(layers) or t <= layers[idx + 1][0]:
            return t
    return 0.0


def _least_starts(net: _Net, w: list[float], cons: list[tuple[int, int, int, int, int]], m: int,
                  head_extra: list[float], deadline: float | None) -> np.ndarray | None:
    """The least start of every instance under constraints 1-4 of :func:`in_flight_bound`: ``S[b, i]``.
    ``cons``: ``(a, f, c, lo, hi)``, ``S[a, t] >= S[f, t - c] + w(f)`` for ``lo <= t <= hi``.
    ``head_extra``: per device, no block on it starts sooner (the reversed problem's step tail)."""
    nb = net.nb
    head = [0.0] * nb
    for b in net.topo:
        head[b] = max([head_extra[d] for d in net.devs[b]] + [head[p] + w[p] + lag for p, lag in net.preds[b]])
    # constraint 3 as lines S[b][i] >= c0 + i * c1, one per device of b
    idx = np.arange(m, dtype=float)
    S: list[list[float]] = []
    for b in range(nb):
        found = set()
        for d in net.devs[b]:
            first, load = head[b], 0.0
            for x in net.on[d]:
                if net.anc[b] >> x & 1:
                    first = min(first, head[x])
                    load += w[x]
            found.add((first + load, load + w[b]))
        S.append(np.max([c0 + c1 * idx for c0, c1 in found], axis=0).tolist())
    into: list[list[tuple[list[float], int, int, int, float]]] = [[] for _ in range(nb)]
    for a, f, c, lo, hi in cons:
        if lo <= hi:
            into[a].append((S[f], c, lo, hi, w[f]))
    plan = [(S[b], w[b], [(S[p], w[p] + lag) for p, lag in net.preds[b]], into[b]) for b in net.topo]
    for i in range(m):
        if deadline is not None and not i % 16 and time.perf_counter() >= deadline:
            return None
        for row, wb, edges, flights in plan:
            v = row[i]   # constraint 3, then 2, 1 and 4 raise it
            if i and row[i - 1] + wb > v:
                v = row[i - 1] + wb
            for prow, gap in edges:
                x = prow[i] + gap
                if x > v:
                    v = x
            for frow, c, lo, hi, wf in flights:
                if lo <= i <= hi:
                    x = frow[i - c] + wf
                    if x > v:
                        v = x
            row[i] = v
    return np.array(S, dtype=float).reshape(nb, m)


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
    return _exclusion_idle(_net(placement, None), placement.blocks, d)


def _exclusion_idle(net: "_Net", blocks, d: int) -> tuple[tuple[float, set[int]], tuple[float, set[int]]]:
    """:func:`exclusion_idle` on the placement's DAG ``net`` (lags are not used)."""
    on = set(net.on[d])
    nb = net.nb

    def side(preds: list[list[tuple[int, float]]], topo: list[int]) -> tuple[float, set[int]]:
        # foreign[i]: block i has an ancestor not on d (one topological pass, not one ancestor set per block)
        foreign = [False] * nb
        for i in topo:
            foreign[i] = any(foreign[p] or d not in blocks[p].devices for p, _ in preds[i])
        waits = {i for i in on if foreign[i]}
        free = on - waits  # what d can run before the first waiting block starts
        if not waits:
            return 0.0, waits
        free_sets = {frozenset(blocks[f].devices) for f in free}  # distinct device sets: few

        def blocking(p: int) -> bool:
            return d not in blocks[p].devices and all(not fs.isdisjoint(blocks[p].devices) for fs in free_sets)

        weight = [blocks[p].duration if blocking(p) else 0.0 for p in range(nb)]
        acc = [0.0] * nb  # heaviest blocking-weight path ending at i, i excluded
        for i in topo:
            acc[i] = max((acc[p] + weight[p] for p, _ in preds[i]), default=0.0)
        return min(acc[i] for i in waits), waits

    return side(net.preds, net.topo), side(net.succs, net.topo[::-1])


def memory_floor(placement: Placement) -> list[int]:
    """Per device, the peak memory of running ONE micro-batch at a time, its blocks in chain order
    (bytes or the placement's units): what the search and :func:`engine.tessel.exact.exact_schedule`
    require of a memory limit.

    Static memory plus the maximum prefix sum of the device's memory deltas along the chain's
    (lexicographic) topological order, with each segment's gradient buffer added at its
    weight-gradient block (or its transient gradient during that block, see
    :attr:`~engine.placement.Placement.grad_memory`). It is not the least peak of every schedule of
    ``m`` micro-batches: a gradient buffer, once allocated, is held to the end of the step, so with
    buffers (e.g. split backward, whose ``W`` blocks allocate them after the ``I`` blocks freed part
    of the activations) the next micro-batches' activations stack on top of buffers that one
    micro-batch's chain allocates only after its own peak, and a schedule can need more than this.
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
