"""Memory in the exact whole-schedule model: per device, ``static + level <= limit`` in CP-SAT.

The whole-schedule model (:mod:`engine.tessel.exact_model`) counts a device's memory in exact
quanta (:func:`memory_quantum`: the greatest common divisor of every delta and static size):
static memory, activations allocated at a block's start and freed at its end, gradient buffers
and transient gradients exactly as :func:`engine.schedule.gradient_events` counts them.
:func:`device_memory` prepares, once per problem, what each device holds (:class:`DeviceMemory`:
activation pieces where every free pairs with its forward, the gradient terms, the in-flight
precedences); :func:`add_memory` states it in a CP-SAT model: a ``Cumulative`` of "held"
intervals where the activations pair up (V, X, M, NN, K and split-backward shapes), otherwise a
reservoir of the same events (the two are equivalent; the proofs are in :func:`add_memory`).

Sources: OR-Tools CP-SAT's ``AddCumulative`` and ``AddReservoirConstraintWithActive``; the
activation pairing is :func:`engine.tessel.bounds.memory_time_bound`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping, Sequence, cast

import networkx as nx
from ortools.sat.python import cp_model

from engine.placement import Placement

__all__ = ["DeviceMemory", "Inst", "activation_pieces", "add_memory", "device_memory", "in_flight_precedences",
           "memory_quantum"]

Inst = tuple[int, int]  # (micro_batch, block index)

#: A memory term: ``(start, end or None, quanta, active literal, least size in ticks)``.
_Term = tuple[cp_model.LinearExprT, cp_model.LinearExprT | None, int, cp_model.LiteralT, int]


@dataclass
class DeviceMemory:
    """One device's memory as the model counts it, in quanta (:func:`add_memory`).

    Attributes:
        cap: ``limit - static`` in quanta (may be negative only for an infeasible limit).
        pieces: ``(alloc, free, quanta, least)`` per piece (:func:`activation_pieces`), ``least``
            the least ticks it is held (the dependency path); ``None``: not in pieces.
        raw: ``(block, delta quanta)`` per block with memory, when not in pieces.
        grads: ``(weight-gradient blocks of the segment on the device, buffer quanta, transient
            quanta)`` per segment with gradient memory on the device.
        in_flight: ``(a, f, c)`` in-flight precedences (:func:`in_flight_precedences`).
    """

    cap: int
    pieces: list[tuple[int, int | None, int, int]] | None
    raw: list[tuple[int, int]]
    grads: list[tuple[list[int], int, int]]
    in_flight: list[tuple[int, int, int]]


def _is_const(x: object) -> bool:
    """An instance start, term end or literal that is a number, not a CP-SAT expression."""
    return isinstance(x, int)


def memory_quantum(placement: Placement) -> int:
    """The greatest common divisor of every memory size the model counts (1 if all are zero)."""
    q = 0
    vals = [abs(int(b.memory)) for b in placement.blocks]
    vals += [int(placement.static_bytes(d)) for d in range(placement.num_devices)]
    vals += [int(x) for x in placement.grad_memory] + [int(x) for x in placement.grad_transient]
    for v in vals:
        q = math.gcd(q, v)
    return q or 1


def hold_ticks(pl: Placement, a: int, f: int, dur: Sequence[int], lag: dict[tuple[int, int], int]) -> int:
    """Least ticks from the start of block ``a`` to the end of its descendant ``f`` in one
    micro-batch: the longest dependency path from ``a`` to ``f``, both durations and the lags included."""
    g = pl.dependency_graph()
    inside = (nx.descendants(g, a) & nx.ancestors(g, f)) | {a, f}
    longest: dict[int, int] = {}
    for i in nx.topological_sort(g.subgraph(inside)):
        longest[i] = dur[i] + max((longest[p] + lag.get((p, i), 0) for p in g.predecessors(i) if p in longest),
                                  default=0)
    return longest[f]


def activation_pieces(pl: Placement, d: int, q: int) -> list[tuple[int, int | None, int]] | None:
    """Device ``d``'s block memory as pieces ``(alloc, free, quanta)``: ``quanta`` allocated at the
    start of block ``alloc`` and freed at the end of block ``free`` of the same micro-batch (``None``:
    never freed in the step). Each freeing block is paired with the one forward of its segment on
    ``d`` among its ancestors that allocates (the pairing of
    :func:`engine.tessel.bounds.memory_time_bound`); ``None`` when some free cannot be paired so,
    or frees more than its forward allocated (the level is then not a sum of pieces).
    """
    g = pl.dependency_graph()
    blocks = pl.blocks
    left = {b: int(blocks[b].memory) // q for b in pl.blocks_on(d) if blocks[b].memory > 0}
    pieces: list[tuple[int, int | None, int]] = []
    for f in pl.blocks_on(d):
        if blocks[f].memory >= 0:
            continue
        anc = nx.ancestors(g, f)
        alloc = [a for a in left if a in anc and blocks[a].kind == "F" and blocks[a].segment == blocks[f].segment]
        amount = -int(blocks[f].memory) // q
        if len(alloc) != 1 or left[alloc[0]] < amount:
            return None
        left[alloc[0]] -= amount
        pieces.append((alloc[0], f, amount))
    pieces += [(a, None, k) for a, k in left.items() if k > 0]
    return pieces


def in_flight_precedences(pl: Placement, d: int, pieces: list[tuple[int, int | None, int]],
                          cap: int) -> list[tuple[int, int, int]]:
    """``(a, f, c)``: with FIFO, ``start(i + c, a) >= end(i, f)`` for every ``i`` (proof in
    :func:`add_memory`). One per allocating block ``a`` and freeing block ``f`` of ``d``'s pieces,
    where the pieces allocated by ``a`` or its ancestors and freed by ``f`` or its descendants
    (or never) hold ``K > 0`` quanta and ``c = cap // K``."""
    g = pl.dependency_graph()
    out = []
    allocs = sorted({a for a, _, _ in pieces})
    frees = sorted({f for _, f, _ in pieces if f is not None})
    for a_star in allocs:
        before = nx.ancestors(g, a_star) | {a_star}
        for f_star in frees:
            after = nx.descendants(g, f_star) | {f_star}
            k = sum(k for a, f, k in pieces if a in before and (f is None or f in after))
            if k > 0:
                out.append((a_star, f_star, max(cap, 0) // k))
    return out


def device_memory(pl: Placement, limits: Sequence[float], dur: Sequence[int], lag: dict[tuple[int, int], int],
                  tail: Sequence[int], *, fifo: bool, cumulative: bool
                  ) -> tuple[list[DeviceMemory], list[list[tuple[int, int]]], list[list[tuple[int, int]]]]:
    """What :func:`add_memory` counts on each device under ``limits`` (placement memory units).

    Args:
        pl: the placement; ``dur``, ``lag``: block durations and dependency lags in ticks; ``tail``:
            per block, the longest dependency path after its end (ticks).
        fifo: the FIFO symmetry breaking is on (the in-flight precedences need it).
        cumulative: try the pieces form (:func:`activation_pieces`); off: raw events (a reservoir).

    Returns:
        ``(memory, as_alloc, as_free)``: a :class:`DeviceMemory` per device, and per block the
        in-flight precedences it takes part in, ``(free block, c)`` as the allocating block and
        ``(allocating block, c)`` as the freeing one.
    """
    K, n = len(pl.blocks), pl.num_devices
    memory: list[DeviceMemory] = []
    as_alloc: list[list[tuple[int, int]]] = [[] for _ in range(K)]
    as_free: list[list[tuple[int, int]]] = [[] for _ in range(K)]
    q = memory_quantum(pl)
    for d in range(n):
        cap = math.floor(Fraction(limits[d]) / q) - pl.static_bytes(d) // q
        on = pl.blocks_on(d)
        pieces = activation_pieces(pl, d, q) if cumulative else None
        raw = []
        if pieces is None:
            raw = [(b, int(pl.blocks[b].memory) // q) for b in on if int(pl.blocks[b].memory) // q]
        grads = []
        for s in pl.grad_segments_on(d):
            wg = [b for b in on if pl.blocks[b].kind in ("B", "W") and pl.blocks[b].segment == s]
            grads.append((wg, pl.grad_bytes(s) // q, pl.grad_transient_bytes(s) // q))
        in_flight = in_flight_precedences(pl, d, pieces, cap) if fifo and pieces is not None else []
        for a, f, c in in_flight:
            as_alloc[a].append((f, c))
            as_free[f].append((a, c))
        memory.append(DeviceMemory(
            cap=cap, raw=raw, grads=grads, in_flight=in_flight,
            pieces=None if pieces is None else
            [(a, f, k, dur[a] + tail[a] if f is None else hold_ticks(pl, a, f, dur, lag)) for a, f, k in pieces]))
    return memory, as_alloc, as_free


def add_memory(model: cp_model.CpModel, memory: Sequence[DeviceMemory], start: Mapping[Inst, cp_model.LinearExprT],
               makespan: cp_model.IntVar, horizon: int, reach: Sequence[tuple[int, int] | None] | None, *,
               m: int, durations: Sequence[int], tail: Sequence[int], fifo: bool, cumulative: bool) -> None:
    """Memory per device, in exact quanta, ``static + level <= limit`` (see the module docstring).

    The level is a sum of *terms*, each ``k`` quanta held on ``[s, e)`` (``e`` absent: to the end):

    * block memory: where it splits into pieces (:func:`activation_pieces`: every free paired with
      its forward), one term per piece and micro-batch, from the allocating block's start to the
      freeing block's end; otherwise the raw events (a positive delta at the start, a negative
      one at the end), for the reservoir only;
    * the gradient buffer of segment ``s``: from the start of the earliest-starting instance of its
      weight-gradient blocks on ``d`` (``B``/``W`` of ``s``) to the end. With FIFO that is one of
      the micro-batch-0 instances (fixed when ``s`` has one weight-gradient block kind, the usual
      case); otherwise a literal per candidate, exactly one true, marks it and requires it to
      start first. That instance's transient gradient is not counted (it becomes the buffer);
    * every other weight-gradient instance's transient gradient, over the block itself
      (:func:`engine.schedule.gradient_events`).

    When every term is fixed (no literal) and the block memory is in pieces (and ``cumulative``),
    the constraint is a ``Cumulative`` of one interval per term (``[s, e)``, or ``[s, makespan + 1)``
    for a term held to the end, so that it also counts at the last instant), capacity ``limit -
    static``: the amount it bounds at each time ``t`` is exactly the reservoir's (a term is counted
    at ``t`` in both iff ``s <= t < e``), and CP-SAT propagates a cumulative (time-tabling,
    energetic reasoning) far more strongly than a reservoir. Otherwise a reservoir (with optional
    events for the literals) over the same events. Each interval's size is at least the dependency
    path from its start to its end (a valid bound on every schedule).

    Redundant, with FIFO and pieces: *in-flight precedences*. Let ``a`` allocate and ``f`` free on
    ``d``, ``P`` the pieces allocated by ``a`` or one of its ancestors and freed by ``f`` or one of
    its descendants (or never), ``K`` their quanta and ``c = cap // K`` (so ``(c + 1) K > cap``).
    Then ``start(i + c, a) >= end(i, f)``. Proof: otherwise, at ``t = start(i + c, a)``, each
    micro-batch ``j`` in ``i..i + c`` holds all of ``P``: its allocations happened by ``t`` (at
    ``start(j, a)`` or earlier, by the dependencies, and ``start(j, a) <= t`` by FIFO) and its
    frees did not (at ``end(j, f)`` or later, and ``end(j, f) >= end(i, f) > t`` by FIFO): the level
    is at least ``(c + 1) K > cap``, as every other term is non-negative. Pure precedences, they
    let CP-SAT's precedence propagation see 1F1B-style in-flight limits at once.

    A neighbourhood model (``reach`` given: per device, ``[earliest start, latest end)`` of its
    free instances, ``None`` for a device without any) states the memory of a device with free
    instances only; there, ``start`` maps fixed instances to numbers, and a term or event that is
    fixed (constant times and literal) counts only where it can meet a free one: a cumulative
    leaves out fixed intervals outside the reach, a reservoir sums the fixed events before the
    reach into one event at time 0 and leaves out those after it. Sound because every free
    instance, hence every variable time, stays inside its device's reach: outside it, which
    terms are held at a time is the same as in the fixed solution, which fits the limit.

    Args:
        model: the CP-SAT model to add to; ``memory``: per device (:func:`device_memory`).
        start: every instance's start: a variable (free) or a number of ticks (fixed).
        makespan: the makespan variable; ``horizon``: its upper bound (ticks).
        reach: per device, the reach of its free instances (a neighbourhood model), or ``None``
            (the full model).
        m: micro-batches; ``durations``, ``tail``: per block, ticks (the tail as in
            :func:`device_memory`); ``fifo``, ``cumulative``: as for :func:`device_memory`.
    """
    dur = durations
    for d, mem in enumerate(memory):
        rng = None if reach is None else reach[d]
        if reach is not None and rng is None:
            continue   # no free instance on d: its memory is as the fixed solution's
        terms, raw = _block_terms(mem, start, m, dur)
        terms += _gradient_terms(model, d, mem, start, m, dur, tail, fifo)
        if fifo and mem.pieces is not None:
            for a, f, c_ in mem.in_flight:
                for i in range(m - c_):
                    if not _is_const(start[(i + c_, a)]) and not _is_const(start[(i, f)]):
                        model.add(start[(i + c_, a)] >= start[(i, f)] + dur[f])
        if not terms and not raw:
            continue
        if cumulative and mem.pieces is not None and all(t[3] is True for t in terms):
            _add_cumulative(model, d, terms, makespan, horizon, rng, mem.cap)
        else:
            _add_reservoir(model, terms, raw, rng, mem.cap)


def _block_terms(mem: DeviceMemory, start: Mapping[Inst, cp_model.LinearExprT], m: int, dur: Sequence[int]
                 ) -> tuple[list[_Term], list[tuple[cp_model.LinearExprT, int]]]:
    """The device's block memory: one term per piece and micro-batch, or (not in pieces) the raw
    events ``(time, delta quanta)`` for the reservoir."""
    terms: list[_Term] = []
    raw: list[tuple[cp_model.LinearExprT, int]] = []
    if mem.pieces is not None:
        for a, f, k, least in mem.pieces:
            for i in range(m):
                terms.append((start[(i, a)], None if f is None else start[(i, f)] + dur[f], k, True, least))
    else:
        for b, delta in mem.raw:
            for i in range(m):
                raw.append((start[(i, b)] if delta > 0 else start[(i, b)] + dur[b], delta))
    return terms, raw


def _gradient_terms(model: cp_model.CpModel, d: int, mem: DeviceMemory, start: Mapping[Inst, cp_model.LinearExprT],
                    m: int, dur: Sequence[int], tail: Sequence[int], fifo: bool) -> list[_Term]:
    """The device's gradient buffers (from the earliest weight-gradient instance of their segment,
    marked by literals where it is not known) and transient gradients, as terms."""
    terms: list[_Term] = []
    for wg, hold, trans in mem.grads:
        insts = [(i, b) for b in wg for i in range(m)]
        lit: dict[Inst, cp_model.LiteralT] = {}
        if hold:
            cands = [(0, b) for b in wg] if fifo else insts
            if len(cands) == 1:
                lit[cands[0]] = True
            elif all(_is_const(start[c]) for c in cands):   # a neighbourhood with the candidates fixed
                earliest = min(cands, key=lambda c: (cast(int, start[c]), c))
                for c in cands:
                    lit[c] = c == earliest
            else:
                for c in cands:
                    lit[c] = model.new_bool_var(f"first_d{d}_s{wg[0]}_{c[0]}_{c[1]}")
                model.add_exactly_one([lit[c] for c in cands])
                for c in cands:
                    for x in (cands if fifo else insts):
                        if x == c:
                            continue
                        if _is_const(start[c]) and _is_const(start[x]):
                            if cast(int, start[c]) > cast(int, start[x]):
                                model.add_bool_or([~lit[c]])
                        else:
                            model.add(start[c] <= start[x]).only_enforce_if(lit[c])
        for x in insts:
            first = lit.get(x, False)
            if first is not False:
                terms.append((start[x], None, hold, first, dur[x[1]] + tail[x[1]]))
            if trans and first is not True:
                terms.append((start[x], start[x] + dur[x[1]], trans, True if first is False else ~first,
                              dur[x[1]]))
    return terms


def _add_cumulative(model: cp_model.CpModel, d: int, terms: list[_Term], makespan: cp_model.IntVar, horizon: int,
                    rng: tuple[int, int] | None, cap: int) -> None:
    """The terms (all fixed literals) as a ``Cumulative`` of held intervals of capacity ``cap``;
    fixed intervals outside the reach ``rng`` of a neighbourhood are left out."""
    intervals, demands = [], []
    for k_, (s0, e0, k, _, least) in enumerate(terms):
        if e0 is not None and least == 0:
            continue   # an empty interval counts nowhere (nor does the reservoir's +k/-k at one time)
        if rng is not None and _is_const(s0) and (e0 is None or _is_const(e0)):
            s_fixed, e_fixed = cast(int, s0), None if e0 is None else cast(int, e0)
            if s_fixed >= rng[1] or (e_fixed is not None and e_fixed <= rng[0]):
                continue   # fixed, and away from every free instance
            if e_fixed is not None:
                if e_fixed > s_fixed:
                    intervals.append(model.new_fixed_size_interval_var(s_fixed, e_fixed - s_fixed,
                                                                       f"mem_d{d}_{k_}"))
                    demands.append(k)
                continue
        end = makespan + 1 if e0 is None else e0
        size = model.new_int_var(min(least + (e0 is None), horizon + 1), horizon + 1, f"mem_d{d}_{k_}")
        intervals.append(model.new_interval_var(s0, size, end, f"mem_d{d}_{k_}"))
        demands.append(k)
    model.add_cumulative(intervals, demands, max(cap, 0))


def _add_reservoir(model: cp_model.CpModel, terms: list[_Term], raw: list[tuple[cp_model.LinearExprT, int]],
                   rng: tuple[int, int] | None, cap: int) -> None:
    """The raw events and the terms' events as a reservoir of capacity ``cap`` (optional events for
    the literals); in a neighbourhood, fixed events before the reach ``rng`` are summed into one
    at time 0 and those after it left out."""
    events: list[tuple[cp_model.LinearExprT, int, cp_model.LiteralT]] = [(t, k, True) for t, k in raw]
    for s0, e0, k, active, _ in terms:
        events.append((s0, k, active))
        if e0 is not None:
            events.append((e0, -k, active))
    if rng is not None:
        base, kept = 0, []
        for t, k, active in events:
            if _is_const(t) and isinstance(active, bool):
                if active is False or cast(int, t) > rng[1]:
                    continue
                if cast(int, t) < rng[0]:
                    base += k
                    continue
            kept.append((t, k, active))
        events = ([(0, base, True)] if base else []) + kept
        if not events:
            return
    times = [e[0] for e in events]
    changes = [e[1] for e in events]
    low = -sum(abs(c) for c in changes) - 1
    if all(e[2] is True for e in events):
        model.add_reservoir_constraint(times, changes, low, cap)
    else:
        model.add_reservoir_constraint_with_active(times, changes, [e[2] for e in events], low, cap)
