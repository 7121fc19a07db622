"""The exact whole-schedule model: every block instance of ``m`` micro-batches in one CP-SAT model.

:func:`engine.tessel.exact.exact_schedule` solves it whole (the exact optimum: the reference for
the bounds and the search); :func:`engine.tessel.improve.improve_schedule` solves it one
*neighbourhood* at a time around Tessel's schedule (large-neighbourhood search). This module
states it; the memory constraints are :mod:`engine.tessel.exact_memory`'s.

The problem is the one :meth:`engine.schedule.Schedule.validate` and :mod:`engine.simulate`
define: every block instance (micro-batch ``i``, placement block ``b``) runs once, for its
duration, on all devices of its set at once; one block at a time per device; a block starts
after the blocks it depends on in its micro-batch have ended (plus a communication lag, if
given); per device, the memory (static memory, activations allocated at a block's start and
freed at its end, gradient buffers and transient gradients exactly as
:func:`engine.schedule.gradient_events` counts them) never exceeds the limit. The makespan is
minimised. Communication is free unless ``lags`` are given.

The CP-SAT model
----------------
Durations and lags are integer ticks (:func:`engine.tessel.repetend.auto_resolution`: the
greatest common divisor of the durations where it is a reasonable tick, so the model is exact;
otherwise the longest block is 100 ticks and the others are rounded UP, which the result reports
as ``rounded`` and the status ``"optimal_at_resolution"``). Memory is counted in exact quanta (the
greatest common divisor of every delta and static size).

* one fixed-size interval per block instance, ``start(i, b)`` an integer variable;
* a dependency ``a -> b``: ``start(i, b) >= start(i, a) + dur(a) + lag(a, b)``;
* per device, a ``NoOverlap`` over the intervals of every instance whose block runs on it (a
  multi-device block is in the ``NoOverlap`` of each of its devices, so it holds them all at once);
* per device, with a memory limit, the level (static memory + activations + gradient buffers
  and transient gradients) at most the limit at every time: a positive block delta counts from
  the block's start, a negative one from its end; a segment's gradient buffer from the start of
  its first weight-gradient block on the device, to the end; a transient gradient during its
  block. Stated as a ``Cumulative`` of "held" intervals where the device's activations pair up
  (each free with its forward: V, X, M, NN, K and split-backward shapes), otherwise as a
  reservoir of the same events (:func:`engine.tessel.exact_memory.add_memory`; the two are
  equivalent);
* minimise ``makespan >= start(i, b) + dur(b)`` over all instances.

Symmetry breaking: micro-batches in FIFO order
----------------------------------------------
Micro-batches are interchangeable, so the model requires every block's instances to start in
micro-batch order, ``start(i, b) <= start(i + 1, b)``; as the instances of one block share its
(non-empty) device set, the ``NoOverlap`` then gives ``start(i + 1, b) >= start(i, b) + dur(b)``,
which the model states directly.

*Claim*: if any feasible schedule exists, a feasible one with the same makespan satisfies these
constraints. *Proof*: take a feasible schedule and, for every block ``b`` independently, relabel
its instances so that the ``k``-th earliest start (ties broken arbitrarily) belongs to
micro-batch ``k``. The set of intervals of every block is unchanged, so the makespan, every
device's occupancy (``NoOverlap``) and every device's memory (the same multiset of deltas at the
same times; the earliest weight-gradient instance of a segment on a device, the one that
allocates its gradient buffer, is still the same interval) are unchanged. Dependencies still
hold: for ``a -> b`` with lag ``L``, let ``s_1 <= ... <= s_m`` be the sorted starts of ``b`` and
``e_1 <= ... <= e_m`` the sorted ends of ``a``. The instances with the ``k`` smallest ``b``-starts
belong to ``k`` distinct micro-batches, and each of those micro-batches' ``a``-end is at most its
own ``b``-start minus ``L``, hence at most ``s_k - L``: at least ``k`` ``a``-ends are ``<= s_k - L``,
so ``e_k + L <= s_k``. After relabelling, micro-batch ``k`` has exactly ``a``-end ``e_k`` (ends of
``a`` are ordered like its starts: one duration) and ``b``-start ``s_k``, so its dependency holds.
Hence an optimum exists among FIFO schedules. This cuts the ``m!`` relabellings of every block
(``(m!)^K`` in all) and turns each block's instances into a chain.

Redundant constraints (each valid for every FIFO schedule, so the optimum is unchanged)
--------------------------------------------------------------------------------------
* ``start(i, b) >= head(b) + i * dur(b)``, with ``head(b)`` the longest path (durations and lags)
  from a source to ``b``: the dependencies, and the ``i`` earlier instances of ``b`` that run one
  after another (FIFO chain) before it (a variable domain);
* ``start(i, b) + dur(b) + (m - 1 - i) * dur(b) + tail(b) <= makespan``, with ``tail(b)`` the
  longest path after ``b`` ends: symmetrically, the later instances of ``b`` and the blocks that
  depend on it (a domain, and ``makespan >= start(i, b) + dur(b) + tail(b)`` as a constraint);
* ``makespan >= min head(d) + m * busy(d) + min tail(d)`` per device ``d`` (and the critical
  path): ``d`` cannot start before the earliest head of its blocks, works ``m * busy(d)`` ticks,
  and after its last block ends, that block's tail still runs;
* a held-memory interval lasts at least the dependency path from its allocating block's start
  to its freeing block's end (a domain);
* *in-flight precedences* ``start(i + c, a) >= end(i, f)`` for an allocating block ``a`` and a
  freeing block ``f`` of a device, ``c`` from the memory limit: ``c + 1`` micro-batches holding
  what ``a`` and its ancestors allocate and ``f`` and its descendants free would exceed it (proof
  in :func:`engine.tessel.exact_memory.add_memory`);
* with a valid hint schedule under the limit, ``makespan <= `` its makespan in ticks (it is a
  feasible solution; its FIFO relabelling, by the claim above, satisfies every constraint).

``use_bound=True`` adds ``makespan >= ceil(makespan_lower_bound / tick)`` (valid: the tick
model's makespan is a whole number of ticks, and with durations rounded up never shorter than
an exact schedule's). It is off by default so that the optimum, and its proof, do not depend on
:mod:`engine.tessel.bounds`: the point of the exact solver is to check that bound.

The code: one model, two uses
-----------------------------
:func:`prepare_exact` checks the inputs and computes, once, everything above in ticks and quanta
(an :class:`ExactProblem`); :meth:`ExactProblem.build` states the CP-SAT model (an
:class:`ExactModel`). Without ``fixed`` it is the full model that
:func:`engine.tessel.exact.exact_schedule` solves. With ``fixed`` (start ticks of the instances
held in place, taken from a solution) it is a *neighbourhood* model for
:func:`engine.tessel.improve.improve_schedule`'s large-neighbourhood search: the free instances
are the only variables; a precedence from or to a fixed instance becomes a bound of the free
one's domain, and the domains are tightened along the precedences between free instances
(longest paths: sound, as every bound follows from the model's constraints); a device's
``NoOverlap`` and memory keep only the fixed intervals and memory terms that overlap the reach of
its free instances, and a device without free instances is left out (its order, hence its
memory, is unchanged). Every solution of a neighbourhood model, completed with the fixed starts,
is a solution of the full model.

Sources: the problem is Tessel's (Lin et al., HPCA 2024, section III: placement of one
micro-batch, scheduling of many); the model follows OR-Tools CP-SAT's scheduling primitives
(``NewFixedSizeIntervalVar``, ``AddNoOverlap``, ``AddCumulative``,
``AddReservoirConstraintWithActive``, ``AddHint``); the FIFO argument is the classic exchange
argument for identical jobs (here, micro-batches), written out above.

Limits: the model is exact for blocks of positive duration. A zero-duration block's transient
gradient is counted by :func:`engine.schedule.peak_memory` but not by the model (its ``+k`` and
``-k`` fall at one instant); a schedule that this makes exceed the limit is caught by the final
``validate`` (``RunError``). Model size grows as ``m x blocks`` intervals; proofs are quick for a
few micro-batches and get hard beyond about 8 on 4-device shapes with a tight memory limit, where
the result is a feasible schedule and a proven bound.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence, TypeVar

import networkx as nx
from ortools.sat.python import cp_model

from engine.dependency import lower
from engine.errors import InfeasibleMemoryError, ScheduleError, TesselError
from engine.placement import Placement
from engine.schedule import Block, Schedule
from engine.simulate import simulate
from engine.tessel.bounds import makespan_lower_bound, memory_floor
from engine.tessel.exact_memory import DeviceMemory, Inst, add_memory, device_memory
from engine.tessel.repetend import EXACT_REL_TOL, auto_resolution, scale

__all__ = ["ExactModel", "ExactProblem", "Inst", "prepare_exact"]

log = logging.getLogger(__name__)

_Num = TypeVar("_Num", int, float)


# ----------------------------------------------------------------------------- helpers
def _limits(placement: Placement, memory_limit) -> list[float] | None:
    """The per-device memory limit as a list (placement units), or ``None``."""
    if memory_limit is None:
        return None
    n = placement.num_devices
    vals = [memory_limit] * n if isinstance(memory_limit, (int, float)) else list(memory_limit)
    if len(vals) != n:
        raise TesselError(f"memory_limit has {len(vals)} values for {n} devices")
    out = []
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise TesselError(f"memory_limit must hold finite numbers (placement memory units), got {v!r}")
        out.append(float(v))
    return out


def _check_lags(placement: Placement, lags: dict[tuple[int, int], float] | None) -> dict[tuple[int, int], float]:
    out: dict[tuple[int, int], float] = {}
    for key, v in (lags or {}).items():
        a, b = key
        if not (0 <= b < len(placement.blocks)) or a not in placement.blocks[b].deps:
            raise TesselError(f"lag {key} is not a dependency of the placement (block index {a} -> {b})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise TesselError(f"lag {key} must be a non-negative number of seconds, got {v!r}")
        if v > 0:
            out[(a, b)] = float(v)
    return out



def _topo_rank(placement: Placement) -> list[int]:
    order = list(nx.lexicographical_topological_sort(placement.dependency_graph(), key=lambda i: i))
    rank = [0] * len(placement.blocks)
    for p, i in enumerate(order):
        rank[i] = p
    return rank


def _asap(placement: Placement, orders: Sequence[Sequence[Block]], durations: Sequence[_Num],
          lags: dict[tuple[int, int], _Num]) -> dict[Inst, _Num]:
    """Start times of the schedule's orders executed as soon as possible (what
    :func:`engine.simulate.simulate` does with free communication, here with ``lags`` added to
    the dependencies and in any unit: ticks or seconds).

    Raises:
        ScheduleError: the orders deadlock (rule ``"deadlock"``).
    """
    pl = placement
    ptr = [0] * pl.num_devices
    free: list = [0] * pl.num_devices
    start: dict[Inst, _Num] = {}
    end: dict[Inst, _Num] = {}
    total = sum(len(o) for o in orders)
    done = 0
    progressed = True
    while progressed:
        progressed = False
        for d in range(pl.num_devices):
            while ptr[d] < len(orders[d]):
                blk = orders[d][ptr[d]]
                b = pl.index(blk.kind, blk.segment)
                inst = (blk.micro_batch, b)
                spec = pl.blocks[b]
                if any((blk.micro_batch, a) not in end for a in spec.deps):
                    break
                if any(ptr[e] >= len(orders[e]) or orders[e][ptr[e]] != blk for e in spec.devices):
                    break
                t = max([free[e] for e in spec.devices]
                        + [end[(blk.micro_batch, a)] + lags.get((a, b), 0) for a in spec.deps])
                start[inst], end[inst] = t, t + durations[b]
                for e in spec.devices:
                    ptr[e] += 1
                    free[e] = end[inst]
                    done += 1
                progressed = True
    if done < total:
        raise ScheduleError("deadlock", "the schedule's device orders deadlock")
    return start


def _fifo_relabel(starts: dict[Inst, int], m: int, num_blocks: int) -> dict[Inst, int]:
    """The FIFO relabelling of the module docstring: per block, the ``k``-th earliest start goes to
    micro-batch ``k``."""
    out: dict[Inst, int] = {}
    for b in range(num_blocks):
        for k, t in enumerate(sorted(starts[(i, b)] for i in range(m))):
            out[(k, b)] = t
    return out


def _orders(placement: Placement, m: int, starts: dict[Inst, int], durations: Sequence[int]) -> list[list[Block]]:
    """Per-device orders sorted by (start, end, chain position, micro-batch): one global order that
    every dependency follows (a dependent starts at or after its dependency's end; at the same time
    only after a zero-length dependency, which sorts first), so the orders cannot deadlock."""
    rank = _topo_rank(placement)
    keyed: list[list[tuple[int, int, int, int, Block]]] = [[] for _ in range(placement.num_devices)]
    for (mb, b), t in starts.items():
        spec = placement.blocks[b]
        blk = Block(spec.segment, spec.kind, mb)
        for d in spec.devices:
            keyed[d].append((t, t + durations[b], rank[b], mb, blk))
    return [[x[4] for x in sorted(o)] for o in keyed]


# ----------------------------------------------------------------------------- the model
@dataclass
class ExactProblem:
    """The whole-schedule problem of ``m`` micro-batches in solver ticks, checked and prepared once
    (:func:`prepare_exact`); :meth:`build` turns it into a CP-SAT model: the full one that
    :func:`engine.tessel.exact.exact_schedule` solves, or the model of a *neighbourhood* (some instances fixed at given
    start ticks, the others free) that :func:`engine.tessel.improve.improve_schedule` solves round
    after round.

    Attributes:
        placement: the placement; ``m`` its micro-batches.
        durations: ticks per block (rounded up when ``rounded``).
        lags: ticks per dependency ``(a, b)`` with a lag (rounded up when ``rounded``).
        lags_s: the same lags in placement time units, as given (checked).
        resolution: placement time units per tick; ``rounded``: durations or lags were rounded up.
        limits: per-device memory limit (placement units), or ``None``.
        makespan_lower_bound: :func:`engine.tessel.bounds.makespan_lower_bound` (placement units).
        head, tail: per block, the longest dependency path (durations and lags, ticks) before its
            start and after its end in one micro-batch.
        lb_ticks: the model's own path bound on the makespan (ticks).
        horizon: the makespan's upper bound (ticks): the hint's when it fits the limit.
        hint_starts: the hint's start ticks (its orders as soon as possible, FIFO-relabelled), or ``None``.
        hint_span: the hint's makespan in ticks, or ``None``; ``hint_fits``: the hint fits ``limits``
            (then ``horizon <= hint_span``: the hint is a solution of the model).
        fifo: the FIFO symmetry breaking is on; ``cumulative``: memory as a ``Cumulative`` where it
            pairs up (:func:`engine.tessel.exact_memory.add_memory`).
        memory: per device, what :func:`~engine.tessel.exact_memory.add_memory` counts; ``None`` without a limit.
    """

    placement: Placement
    m: int
    durations: list[int]
    lags: dict[tuple[int, int], int]
    lags_s: dict[tuple[int, int], float]
    resolution: float
    rounded: bool
    limits: list[float] | None
    makespan_lower_bound: float
    head: list[int]
    tail: list[int]
    lb_ticks: int
    horizon: int
    hint_starts: dict[Inst, int] | None = None
    hint_span: int | None = None
    hint_fits: bool = False
    fifo: bool = True
    cumulative: bool = True
    memory: list[DeviceMemory] | None = None
    _succ: list[list[int]] = field(default_factory=list, repr=False)
    _in_flight_as_alloc: list[list[tuple[int, int]]] = field(default_factory=list, repr=False)
    _in_flight_as_free: list[list[tuple[int, int]]] = field(default_factory=list, repr=False)

    # ---- solutions and schedules
    def asap(self, orders: Sequence[Sequence[Block]]) -> dict[Inst, int]:
        """Start ticks of ``orders`` executed as soon as possible (durations and lags in ticks),
        FIFO-relabelled when ``fifo``: a solution of the model whenever the orders fit the limit
        and their makespan fits the horizon (memory depends on each device's order alone).

        Raises:
            ScheduleError: the orders deadlock.
        """
        starts = _asap(self.placement, orders, self.durations, self.lags)
        return _fifo_relabel(starts, self.m, len(self.placement.blocks)) if self.fifo else starts

    def span(self, starts: Mapping[Inst, int]) -> int:
        """The makespan (ticks) of a solution's start ticks."""
        dur = self.durations
        return max(t + dur[b] for (_, b), t in starts.items())

    def orders(self, starts: Mapping[Inst, int]) -> list[list[Block]]:
        """Per-device orders of a solution's start ticks (sorted so that they cannot deadlock)."""
        return _orders(self.placement, self.m, dict(starts), self.durations)

    def span_ticks(self, orders: Sequence[Sequence[Block]]) -> int:
        """Ticks of ``orders`` executed as soon as possible with the model's durations and lags."""
        return self.span(_asap(self.placement, orders, self.durations, self.lags))

    def span_units(self, schedule: Schedule) -> float:
        """The schedule's makespan in placement units: simulated (:func:`engine.simulate.simulate` of
        :func:`engine.dependency.lower`) without lags; with lags, its orders as soon as possible with
        the exact durations and lags (what :func:`engine.tessel.exact.exact_schedule` reports)."""
        pl = self.placement
        if self.lags_s:
            real = _asap(pl, schedule.orders, [b.duration for b in pl.blocks], self.lags_s)
            return max(t + pl.blocks[b].duration for (_, b), t in real.items())
        return simulate(lower(schedule)).makespan

    # ---- the CP-SAT model
    def _edges(self, inst: Inst) -> tuple[list[tuple[Inst, int]], list[tuple[Inst, int]]]:
        """The precedences of the model at ``inst``: ``(before, delta)`` with ``start(inst) >=
        start(before) + delta``, and ``(after, delta)`` with ``start(after) >= start(inst) + delta``
        (dependencies with their lags, the FIFO chain, the in-flight precedences)."""
        i, b = inst
        m, dur, lag, blocks = self.m, self.durations, self.lags, self.placement.blocks
        before = [((i, a), dur[a] + lag.get((a, b), 0)) for a in blocks[b].deps]
        after = [((i, c), dur[b] + lag.get((b, c), 0)) for c in self._succ[b]]
        if self.fifo:
            if i > 0:
                before.append(((i - 1, b), dur[b]))
            if i + 1 < m:
                after.append(((i + 1, b), dur[b]))
        before += [((i - c, f), dur[f]) for f, c in self._in_flight_as_alloc[b] if i - c >= 0]
        after += [((i + c, a), dur[b]) for a, c in self._in_flight_as_free[b] if i + c < m]
        return before, after

    def _domains(self, free: list[Inst], fixed: Mapping[Inst, int], dom: dict[Inst, tuple[int, int]]) -> None:
        """Tighten the free instances' domains ``dom`` (in place) by the precedences: those to fixed
        instances (which the neighbourhood model states this way only), then along the free ones
        (longest paths, forward and backward in ``(micro-batch, topological rank)`` order: every
        precedence goes forward in it). Sound: every bound follows from the model's constraints."""
        rank = _topo_rank(self.placement)
        edges = {x: self._edges(x) for x in free}
        for x in free:
            lo, hi = dom[x]
            for y, dlt in edges[x][0]:
                t = fixed.get(y)
                if t is not None:
                    lo = max(lo, t + dlt)
            for y, dlt in edges[x][1]:
                t = fixed.get(y)
                if t is not None:
                    hi = min(hi, t - dlt)
            dom[x] = (lo, hi)
        topo = sorted(free, key=lambda x: (x[0], rank[x[1]]))
        for x in topo:
            lo = max([dom[x][0]] + [dom[y][0] + dlt for y, dlt in edges[x][0] if y in dom])
            dom[x] = (lo, dom[x][1])
        for x in reversed(topo):
            hi = min([dom[x][1]] + [dom[y][1] - dlt for y, dlt in edges[x][1] if y in dom])
            dom[x] = (dom[x][0], hi)

    def build(self, *, fixed: Mapping[Inst, int] | None = None, horizon: int | None = None,
              hint: Mapping[Inst, int] | None = None) -> "ExactModel":
        """The CP-SAT model, minimising the makespan (the caller may replace the objective).

        Args:
            fixed: start ticks of instances held where they are (a neighbourhood model: they are
                constants, and only what can interact with the free instances is stated: the
                precedences that tie a free instance to a fixed one as its domain, the fixed
                intervals and memory terms that overlap the free instances' reach on their
                devices; a device without free instances keeps its memory as it is). The fixed
                starts must be part of a solution of the model (e.g. the current one, minus the
                instances set free). Needs ``fifo``. ``None``: the full model.
            horizon: the makespan's upper bound in ticks (default :attr:`horizon`).
            hint: start ticks of every instance (a complete solution) to hint to CP-SAT; the
                makespan is hinted as the largest end.

        Returns:
            :class:`ExactModel`: ``start`` holds the variables of the free instances only.
        """
        pl, m, dur, lag, head, tail, fifo = (self.placement, self.m, self.durations, self.lags, self.head,
                                             self.tail, self.fifo)
        K, n = len(pl.blocks), pl.num_devices
        fixed = dict(fixed or {})
        if fixed and not fifo:
            raise TesselError("a neighbourhood model (fixed instances) needs the FIFO symmetry breaking")
        H = self.horizon if horizon is None else horizon
        model = cp_model.CpModel()
        start: dict[Inst, cp_model.IntVar] = {}
        expr: dict[Inst, cp_model.LinearExprT] = {}
        iv: dict[Inst, cp_model.IntervalVar] = {}
        dom: dict[Inst, tuple[int, int]] = {}
        for i in range(m):
            for b in range(K):
                if (i, b) not in fixed:
                    dom[(i, b)] = (head[b] + (i * dur[b] if fifo else 0),
                                   H - dur[b] - tail[b] - ((m - 1 - i) * dur[b] if fifo else 0))
        if fixed:
            self._domains(list(dom), fixed, dom)
        for i in range(m):
            for b in range(K):
                if (i, b) in fixed:
                    expr[(i, b)] = fixed[(i, b)]
                    continue
                lo, hi = dom[(i, b)]
                dom[(i, b)] = (lo, max(lo, hi))
                v = model.new_int_var(lo, max(lo, hi), f"s{i}_{b}")  # hi >= lo: the horizon holds an optimum
                start[(i, b)] = expr[(i, b)] = v
                iv[(i, b)] = model.new_fixed_size_interval_var(v, dur[b], f"iv{i}_{b}")
        ms_lo = max([self.lb_ticks] + [t + dur[b] + tail[b] for (_, b), t in fixed.items()])
        makespan = model.new_int_var(ms_lo, max(ms_lo, H), "makespan")
        for i in range(m):
            for b, spec in enumerate(pl.blocks):
                if (i, b) not in start:
                    continue
                for a in spec.deps:
                    if (i, a) in start:
                        model.add(start[(i, b)] >= start[(i, a)] + dur[a] + lag.get((a, b), 0))
                model.add(makespan >= start[(i, b)] + dur[b] + tail[b])
        if fifo:
            for b in range(K):
                for i in range(m - 1):
                    if (i, b) in start and (i + 1, b) in start:
                        model.add(start[(i + 1, b)] >= start[(i, b)] + dur[b])
        # per device, the reach of its free instances: [earliest start, latest end)
        reach: list[tuple[int, int] | None] | None = None
        if fixed:
            reach = [None] * n
            for (_, b), (lo, hi) in dom.items():
                for d in pl.blocks[b].devices:
                    r = reach[d]
                    reach[d] = (lo, hi + dur[b]) if r is None else (min(r[0], lo), max(r[1], hi + dur[b]))
        for d in range(n):
            insts = [(i, b) for b in pl.blocks_on(d) for i in range(m)]
            ivs = [iv[x] for x in insts if x in start]
            r = reach[d] if reach is not None else None
            if r is not None:
                for x in insts:
                    t = fixed.get(x)
                    if t is not None and dur[x[1]] > 0 and t < r[1] and t + dur[x[1]] > r[0]:
                        ivs.append(model.new_fixed_size_interval_var(t, dur[x[1]], f"fx{x[0]}_{x[1]}"))
            if len(ivs) > 1 and (reach is None or r is not None):
                model.add_no_overlap(ivs)
        if self.memory is not None:
            add_memory(model, self.memory, expr, makespan, max(ms_lo, H), reach, m=m, durations=dur, tail=tail,
                       fifo=fifo, cumulative=self.cumulative)
        model.minimize(makespan)
        if hint is not None:
            for inst, v in start.items():
                model.add_hint(v, hint[inst])
            model.add_hint(makespan, max(t + dur[b] for (_, b), t in hint.items()))
        return ExactModel(problem=self, model=model, start=start, makespan=makespan, fixed=fixed)


@dataclass
class ExactModel:
    """A CP-SAT model built by :meth:`ExactProblem.build`.

    Attributes:
        problem: the problem it models.
        model: the CP-SAT model (``minimize(makespan)`` unless the caller replaced it).
        start: the start-tick variable of every free instance ``(micro_batch, block index)``.
        makespan: the makespan variable (ticks).
        fixed: the start ticks of the fixed instances (empty for the full model).
    """

    problem: ExactProblem
    model: cp_model.CpModel
    start: dict[Inst, cp_model.IntVar]
    makespan: cp_model.IntVar
    fixed: dict[Inst, int]

    def solution(self, solver: cp_model.CpSolver) -> dict[Inst, int]:
        """Every instance's start tick: the solver's values of the free ones, the fixed ones as fixed."""
        out = dict(self.fixed)
        out.update({inst: solver.value(v) for inst, v in self.start.items()})
        return out


def _check_hint(placement: Placement, m: int, hint: Schedule) -> None:
    """A hint must be a valid schedule (memory aside) of the same placement and ``m``.

    Raises:
        TesselError: another placement or micro-batch count; ``ScheduleError``: orders that break a rule.
    """
    pl = placement
    if hint.num_micro_batches != m or hint.placement.num_devices != pl.num_devices or \
            [(b.kind, b.segment, b.devices, b.deps) for b in hint.placement.blocks] != \
            [(b.kind, b.segment, b.devices, b.deps) for b in pl.blocks]:
        raise TesselError("the hint must be a schedule of the same placement and number of micro-batches")
    hint.validate()



def prepare_exact(
    placement: Placement,
    m: int,
    *,
    memory_limit: float | Sequence[float] | None = None,
    lags: dict[tuple[int, int], float] | None = None,
    hint: Schedule | None = None,
    use_bound: bool = False,
    fifo: bool = True,
    cumulative: bool = True,
    hint_must_fit: bool = False,
) -> ExactProblem:
    """Check the inputs and prepare the whole-schedule problem of ``m`` micro-batches (module docstring).

    Arguments as for :func:`engine.tessel.exact.exact_schedule` (``fifo`` and ``cumulative`` are its
    ``_fifo`` and ``_cumulative``). With a ``hint``, its start times (orders executed as soon as
    possible in ticks, FIFO-relabelled) are :attr:`ExactProblem.hint_starts` and, when it fits the limit, its makespan
    caps the model's (:attr:`ExactProblem.horizon`); a hint above the limit is used as a hint only
    (logged), or refused with ``hint_must_fit``.

    Raises:
        TesselError: ``m < 1``, a malformed ``memory_limit`` or lag, a hint of another placement or
            micro-batch count, or one whose orders are not a valid schedule (``ScheduleError``), or
            with ``hint_must_fit`` one above the limit (``ScheduleError``, rule ``"memory"``).
        InfeasibleMemoryError: the limit is below :func:`engine.tessel.bounds.memory_floor`.
    """
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise TesselError(f"need at least one micro-batch, got m={m!r}")
    pl = placement
    K, n = len(pl.blocks), pl.num_devices
    limits = _limits(pl, memory_limit)
    if limits is not None:
        floor = memory_floor(pl)
        worst = max(range(n), key=lambda d: floor[d] - limits[d])
        if floor[worst] > limits[worst]:
            raise InfeasibleMemoryError(
                f"memory limit {limits[worst]:g} is infeasible: device {worst} needs at least {floor[worst]:g} even "
                f"with one micro-batch at a time; the smallest feasible limit is {max(floor):g}", max(floor), worst)
    lag_s = _check_lags(pl, lags)
    if hint is not None:
        _check_hint(pl, m, hint)
    res, rounded = auto_resolution(pl, lags=lag_s or None)
    sc = scale(pl, res, lag_s or None)
    dur, lag = list(sc.durations), dict(sc.lags)
    ms_lb = makespan_lower_bound(pl, m, memory_limit=limits)

    # ---- longest paths (ticks): head(b) before b starts, tail(b) after b ends
    g = pl.dependency_graph()
    topo = list(nx.topological_sort(g))
    head = [0] * K
    for b in topo:
        head[b] = max((head[a] + dur[a] + lag.get((a, b), 0) for a in pl.blocks[b].deps), default=0)
    tail = [0] * K
    for a in reversed(topo):
        tail[a] = max((lag.get((a, c), 0) + dur[c] + tail[c] for c in g.successors(a)), default=0)
    lb_ticks = max((head[b] + dur[b] + tail[b] for b in range(K)), default=0)
    for d in range(n):
        on = pl.blocks_on(d)
        if on:
            lb_ticks = max(lb_ticks, min(head[b] for b in on) + m * sum(dur[b] for b in on) + min(tail[b] for b in on))
    if use_bound:
        x = ms_lb / res
        lb_ticks = max(lb_ticks, math.ceil(x - EXACT_REL_TOL * max(1.0, x)))
    # an as-soon-as-possible schedule of any orders has a chain of instances and lags filling its
    # makespan, so an optimum (which may be taken as-soon-as-possible) fits this horizon
    horizon = m * (sum(dur) + sum(lag.values()))

    # ---- the hint: its orders as soon as possible, in ticks, FIFO-relabelled
    hint_starts: dict[Inst, int] | None = None
    hint_span = None
    hint_fits = False
    if hint is not None:
        hs = _asap(pl, hint.orders, dur, lag)
        hint_starts = _fifo_relabel(hs, m, K) if fifo else hs
        hint_span = max(hs[i] + dur[i[1]] for i in hs)
        try:
            hint.validate(limits)
            horizon = min(horizon, hint_span)
            hint_fits = True
        except ScheduleError as e:
            if hint_must_fit:
                raise
            log.warning("exact model: the hint does not fit the memory limit (%s); used as a hint only", e)

    # ---- memory, per device (:func:`engine.tessel.exact_memory.add_memory`)
    memory: list[DeviceMemory] | None = None
    as_alloc: list[list[tuple[int, int]]] = [[] for _ in range(K)]
    as_free: list[list[tuple[int, int]]] = [[] for _ in range(K)]
    if limits is not None:
        memory, as_alloc, as_free = device_memory(pl, limits, dur, lag, tail, fifo=fifo, cumulative=cumulative)
    succ = [sorted(g.successors(b)) for b in range(K)]
    return ExactProblem(placement=pl, m=m, durations=dur, lags=lag, lags_s=lag_s, resolution=res, rounded=rounded,
                        limits=limits, makespan_lower_bound=ms_lb, head=head, tail=tail, lb_ticks=lb_ticks,
                        horizon=horizon, hint_starts=hint_starts, hint_span=hint_span, hint_fits=hint_fits,
                        fifo=fifo, cumulative=cumulative, memory=memory, _succ=succ, _in_flight_as_alloc=as_alloc,
                        _in_flight_as_free=as_free)
