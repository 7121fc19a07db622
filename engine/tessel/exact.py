"""The exact optimum of the full scheduling problem for a few micro-batches (OR-Tools CP-SAT).

Tessel (:func:`engine.tessel.search.tessel_search`) builds a schedule from a periodic repetend
and a completion; :func:`engine.tessel.bounds.makespan_lower_bound` bounds every schedule from
below. Where the two differ, :func:`exact_schedule` tells whose the gap is: it solves the whole
problem for ``m`` micro-batches at once, with no repetend, and returns the optimal makespan with
a proof (CP-SAT status ``OPTIMAL``), or the best schedule and the best proven bound found in the
time given.

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
  reservoir of the same events (:func:`_add_memory`; the two are equivalent);
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
  in :func:`_add_memory`);
* with a valid hint schedule under the limit, ``makespan <= `` its makespan in ticks (it is a
  feasible solution; its FIFO relabelling, by the claim above, satisfies every constraint).

``use_bound=True`` adds ``makespan >= ceil(makespan_lower_bound / tick)`` (valid: the tick
model's makespan is a whole number of ticks, and with durations rounded up never shorter than
an exact schedule's). It is off by default so that the optimum, and its proof, do not depend on
:mod:`engine.tessel.bounds`: the point of this module is to check that bound.

The code: one model, two uses
-----------------------------
:func:`prepare_exact` checks the inputs and computes, once, everything above in ticks and quanta
(an :class:`ExactProblem`); :meth:`ExactProblem.build` states the CP-SAT model. Without ``fixed``
it is the full model that :func:`exact_schedule` solves. With ``fixed`` (start ticks of the
instances held in place, taken from a solution) it is a *neighbourhood* model for
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
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Mapping, Sequence, TypeVar, cast

import networkx as nx
from ortools.sat.python import cp_model

from engine.errors import RunError, ScheduleError, TesselError
from engine.placement import Placement
from engine.schedule import Block, Schedule
from engine.tessel.bounds import makespan_lower_bound, memory_floor
from engine.tessel.repetend import EXACT_REL_TOL, MAX_DENOMINATOR, auto_resolution, scale

__all__ = ["ExactModel", "ExactProblem", "ExactResult", "exact_schedule", "prepare_exact"]

log = logging.getLogger(__name__)

Inst = tuple[int, int]  # (micro_batch, block index)
_Num = TypeVar("_Num", int, float)

_CP_STATUS = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible", cp_model.INFEASIBLE: "infeasible",
              cp_model.UNKNOWN: "unknown"}


@dataclass
class ExactResult:
    """Outcome of :func:`exact_schedule`.

    Attributes:
        status: ``"optimal"`` (proven, exact durations), ``"optimal_at_resolution"`` (proven for the
            durations rounded up to ticks: ``rounded``), ``"feasible"`` (a schedule, optimality not
            proven in the time given), ``"infeasible"`` (proven: no schedule fits the memory limit),
            ``"unknown"`` (nothing found in the time given).
        makespan: the returned schedule's makespan in the placement's time unit (the simulated one,
            :func:`engine.simulate.simulate` of :func:`engine.dependency.lower`, when there are no
            lags; with lags, the same as-soon-as-possible execution of its orders with the lags
            added); ``None`` without a schedule.
        lower_bound: placement time units: no schedule is shorter. The larger of CP-SAT's proven
            bound (``solver_bound``, left out when ``rounded``: it then bounds the rounded-up problem,
            not the exact one) and ``makespan_lower_bound``; ``inf`` when proven infeasible.
        schedule: the best schedule found (per-device orders by start time, named ``"exact"``), or
            ``None``; it passes ``schedule.validate(memory_limit)``.
        wall_time: seconds of the whole call (``time.perf_counter``), model building included.
        resolution: placement time units per solver tick.
        rounded: durations or lags are not whole ticks and were rounded up: ``makespan`` is then
            that of a schedule optimal for the rounded durations, not necessarily for the exact ones.
        solver_bound: CP-SAT's proven bound on the tick model's makespan, in placement time units
            (a lower bound in exact time only when not ``rounded``); ``None`` when nothing was proven.
        makespan_lower_bound: :func:`engine.tessel.bounds.makespan_lower_bound` for ``m`` and the
            limit (communication ignored).
        makespan_ticks: the schedule's makespan in ticks (durations and lags rounded up to ticks).
        fifo: whether the FIFO symmetry breaking was on (always, except in tests).
        meta: solver details: ``cp_sat_status``, ``wall_time_solver`` (s), ``hint_makespan_ticks``,
            ``model_lower_bound_ticks`` (the model's own path bound), ``horizon_ticks``.
    """

    status: str
    makespan: float | None
    lower_bound: float
    schedule: Schedule | None
    wall_time: float
    resolution: float
    rounded: bool = False
    solver_bound: float | None = None
    makespan_lower_bound: float = 0.0
    makespan_ticks: int | None = None
    fifo: bool = True
    meta: dict = field(default_factory=dict)

    @property
    def proven_optimal(self) -> bool:
        """The makespan is proven optimal in exact time (``status == "optimal"``)."""
        return self.status == "optimal"

    @property
    def gap(self) -> float | None:
        """``makespan / lower_bound - 1``: 0 when proven optimal; ``None`` without a makespan."""
        if self.makespan is None or not self.lower_bound or math.isinf(self.lower_bound):
            return None
        return self.makespan / self.lower_bound - 1


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


def _ticks_to_units(ticks: int, resolution: float) -> float:
    """``ticks`` x ``resolution``, computed on the tick's rational value where it has one (40 ticks of
    0.1 are 4.0, not 4.000000000000001)."""
    q = Fraction(resolution).limit_denominator(MAX_DENOMINATOR)
    if abs(float(q) - resolution) <= EXACT_REL_TOL * resolution:
        return float(q * ticks)
    return ticks * resolution


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


def _quantum(placement: Placement) -> int:
    """The greatest common divisor of every memory size the model counts (1 if all are zero)."""
    q = 0
    vals = [abs(int(b.memory)) for b in placement.blocks]
    vals += [int(placement.static_bytes(d)) for d in range(placement.num_devices)]
    vals += [int(x) for x in placement.grad_memory] + [int(x) for x in placement.grad_transient]
    for v in vals:
        q = math.gcd(q, v)
    return q or 1


# ----------------------------------------------------------------------------- the model
def _is_const(x: object) -> bool:
    """An instance start, term end or literal that is a number, not a CP-SAT expression."""
    return isinstance(x, int)


@dataclass
class _DeviceMemory:
    """One device's memory as the model counts it, in quanta (:func:`_add_memory`).

    Attributes:
        cap: ``limit - static`` in quanta (may be negative only for an infeasible limit).
        pieces: ``(alloc, free, quanta, least)`` per piece (:func:`_activation_pieces`), ``least``
            the least ticks it is held (the dependency path); ``None``: not in pieces.
        raw: ``(block, delta quanta)`` per block with memory, when not in pieces.
        grads: ``(weight-gradient blocks of the segment on the device, buffer quanta, transient
            quanta)`` per segment with gradient memory on the device.
        in_flight: ``(a, f, c)`` in-flight precedences (:func:`_in_flight_precedences`).
    """

    cap: int
    pieces: list[tuple[int, int | None, int, int]] | None
    raw: list[tuple[int, int]]
    grads: list[tuple[list[int], int, int]]
    in_flight: list[tuple[int, int, int]]


@dataclass
class ExactProblem:
    """The whole-schedule problem of ``m`` micro-batches in solver ticks, checked and prepared once
    (:func:`prepare_exact`); :meth:`build` turns it into a CP-SAT model: the full one that
    :func:`exact_schedule` solves, or the model of a *neighbourhood* (some instances fixed at given
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
            pairs up (:func:`_add_memory`).
        memory: per device, what :func:`_add_memory` counts; ``None`` without a limit.
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
    memory: list[_DeviceMemory] | None = None
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
        the exact durations and lags (what :func:`exact_schedule` reports)."""
        pl = self.placement
        if self.lags_s:
            real = _asap(pl, schedule.orders, [b.duration for b in pl.blocks], self.lags_s)
            return max(t + pl.blocks[b].duration for (_, b), t in real.items())
        from engine.dependency import lower
        from engine.simulate import simulate

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
            _add_memory(model, self, expr, makespan, max(ms_lo, H), reach)
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

    Arguments as for :func:`exact_schedule` (``fifo`` and ``cumulative`` are its ``_fifo`` and
    ``_cumulative``). With a ``hint``, its start times (orders executed as soon as possible in ticks,
    FIFO-relabelled) are :attr:`ExactProblem.hint_starts` and, when it fits the limit, its makespan
    caps the model's (:attr:`ExactProblem.horizon`); a hint above the limit is used as a hint only
    (logged), or refused with ``hint_must_fit``.

    Raises:
        TesselError: ``m < 1``, a malformed ``memory_limit`` or lag, a hint of another placement or
            micro-batch count, or one whose orders are not a valid schedule (``ScheduleError``), or
            with ``hint_must_fit`` one above the limit (``ScheduleError``, rule ``"memory"``).
        InfeasibleMemoryError: the limit is below :func:`engine.tessel.bounds.memory_floor`.
    """
    from engine.tessel.search import InfeasibleMemoryError  # the search's error for the same refusal

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

    # ---- memory, per device (:func:`_add_memory`)
    memory: list[_DeviceMemory] | None = None
    as_alloc: list[list[tuple[int, int]]] = [[] for _ in range(K)]
    as_free: list[list[tuple[int, int]]] = [[] for _ in range(K)]
    if limits is not None:
        memory = []
        q = _quantum(pl)
        for d in range(n):
            cap = math.floor(Fraction(limits[d]) / q) - pl.static_bytes(d) // q
            on = pl.blocks_on(d)
            pieces = _activation_pieces(pl, d, q) if cumulative else None
            raw = []
            if pieces is None:
                raw = [(b, int(pl.blocks[b].memory) // q) for b in on if int(pl.blocks[b].memory) // q]
            grads = []
            for s in pl.grad_segments_on(d):
                wg = [b for b in on if pl.blocks[b].kind in ("B", "W") and pl.blocks[b].segment == s]
                grads.append((wg, pl.grad_bytes(s) // q, pl.grad_transient_bytes(s) // q))
            in_flight = _in_flight_precedences(pl, d, pieces, cap) if fifo and pieces is not None else []
            for a, f, c in in_flight:
                as_alloc[a].append((f, c))
                as_free[f].append((a, c))
            memory.append(_DeviceMemory(
                cap=cap, raw=raw, grads=grads, in_flight=in_flight,
                pieces=None if pieces is None else
                [(a, f, k, dur[a] + tail[a] if f is None else _span(pl, a, f, dur, lag)) for a, f, k in pieces]))
    succ = [sorted(g.successors(b)) for b in range(K)]
    return ExactProblem(placement=pl, m=m, durations=dur, lags=lag, lags_s=lag_s, resolution=res, rounded=rounded,
                        limits=limits, makespan_lower_bound=ms_lb, head=head, tail=tail, lb_ticks=lb_ticks,
                        horizon=horizon, hint_starts=hint_starts, hint_span=hint_span, hint_fits=hint_fits,
                        fifo=fifo, cumulative=cumulative, memory=memory, _succ=succ, _in_flight_as_alloc=as_alloc,
                        _in_flight_as_free=as_free)


# ----------------------------------------------------------------------------- the solver
def exact_schedule(
    placement: Placement,
    m: int,
    *,
    memory_limit: float | Sequence[float] | None = None,
    lags: dict[tuple[int, int], float] | None = None,
    time_limit: float = 60.0,
    workers: int = 1,
    seed: int = 0,
    hint: Schedule | None = None,
    use_bound: bool = False,
    _fifo: bool = True,
    _cumulative: bool = True,
) -> ExactResult:
    """The minimum-makespan schedule of ``m`` micro-batches, solved exactly with CP-SAT.

    See the module docstring for the model, the FIFO symmetry breaking and its proof, and the
    redundant constraints. Meant for a few micro-batches (up to about 16 on 4-device shapes): the
    model has ``m x blocks`` intervals.

    Args:
        placement: the blocks of one micro-batch (durations in any time unit; memory in any unit).
        m: micro-batches, at least 1.
        memory_limit: per-device limit in the placement's memory units (a scalar for every device,
            or one value per device), static memory included, as for
            :func:`engine.tessel.search.tessel_search`; ``None``: no limit.
        lags: time units of communication on dependencies, ``(a, b) -> lag`` by block index (``b``
            waits ``lag`` after ``a`` ends), as for ``tessel_search``; ``None``: free communication.
        time_limit: wall-clock seconds for the whole call, model building included; CP-SAT returns
            its best solution and bound when it hits.
        workers: CP-SAT search workers (1: deterministic for a fixed ``seed``).
        seed: CP-SAT random seed.
        hint: a schedule of the same placement and ``m`` (e.g. Tessel's) whose start times, its
            orders executed as soon as possible (as :func:`engine.simulate.simulate` does, with the
            lags and the rounded durations of the model), FIFO-relabelled, seed CP-SAT
            (``AddHint``); when it fits the memory limit its makespan also caps the model's.
        use_bound: also require ``makespan >= makespan_lower_bound`` (in ticks, rounded up). Faster
            proofs, but the optimum then relies on :mod:`engine.tessel.bounds` being right.
        _fifo: the FIFO symmetry breaking (tests switch it off to check it changes nothing).
        _cumulative: the memory as a ``Cumulative`` with in-flight precedences where the activations
            pair up (:func:`_add_memory`); off: the plain reservoir (tests check both agree).

    Returns:
        :class:`ExactResult`.

    Raises:
        TesselError: ``m < 1``, a time limit or worker count that is not positive, a malformed
            ``memory_limit`` or lag, a hint of another placement or micro-batch count, or one whose
            orders are not a valid schedule (``ScheduleError``).
        InfeasibleMemoryError: the limit is below :func:`engine.tessel.bounds.memory_floor` (what
            one micro-batch at a time needs).
        RunError: the model and the schedule built from its solution disagree (a bug here).
    """

    t0 = time.perf_counter()
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise TesselError(f"need at least one micro-batch, got m={m!r}")
    if not (isinstance(time_limit, (int, float)) and math.isfinite(time_limit) and time_limit > 0):
        raise TesselError(f"the time limit must be a positive number of seconds, got {time_limit!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise TesselError(f"workers must be a positive integer, got {workers!r}")
    prob = prepare_exact(placement, m, memory_limit=memory_limit, lags=lags, hint=hint, use_bound=use_bound,
                         fifo=_fifo, cumulative=_cumulative)
    em = prob.build(hint=prob.hint_starts)
    pl, model, start, makespan = placement, em.model, em.start, em.makespan
    res, rounded, limits, ms_lb = prob.resolution, prob.rounded, prob.limits, prob.makespan_lower_bound
    hint_span, horizon, lb_ticks = prob.hint_span, prob.horizon, prob.lb_ticks

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit - (time.perf_counter() - t0))
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    code = solver.solve(model)
    if code == cp_model.MODEL_INVALID:
        raise RunError(f"exact_schedule built an invalid CP-SAT model: {model.validate()}")
    status = _CP_STATUS.get(code, "unknown")
    if status == "infeasible" and prob.hint_fits:
        raise RunError("exact_schedule: CP-SAT proved infeasible a model whose hint fits the memory limit (a bug)")
    solver_bound_ticks: int | None = None
    if status in ("optimal", "feasible", "unknown"):
        bound = solver.best_objective_bound
        if math.isfinite(bound):
            solver_bound_ticks = int(math.ceil(bound - 1e-9))

    schedule = None
    span = None
    span_ticks = None
    if status in ("optimal", "feasible"):
        found = {inst: solver.value(v) for inst, v in start.items()}
        obj = solver.value(makespan)
        orders = prob.orders(found)
        schedule = Schedule(pl, m, orders, "exact")
        try:
            schedule.validate(limits)
        except ScheduleError as e:
            raise RunError(f"exact_schedule: the schedule from the CP-SAT solution is invalid ({e}): a bug") from e
        span_ticks = prob.span_ticks(orders)
        if span_ticks > obj:  # the model allowed what the orders cannot do: its bound stays a bound
            log.warning("exact_schedule: the solution's orders run in %d ticks, the model said %d; not optimal",
                        span_ticks, obj)
            status = "feasible"
        elif span_ticks < obj and status == "optimal":  # a shorter solution than the proven optimum
            log.warning("exact_schedule: the solution's orders run in %d ticks, shorter than the proven optimum %d: "
                        "the model is over-constrained%s", span_ticks, obj,
                        " (use_bound: makespan_lower_bound exceeds the optimum)" if use_bound else "")
            status = "feasible"
            solver_bound_ticks = None
        span = prob.span_units(schedule)
        if status == "optimal" and rounded:
            status = "optimal_at_resolution"
        schedule.meta["exact"] = {"status": status, "makespan": span, "makespan_ticks": span_ticks,
                                  "resolution": res, "rounded": rounded, "fifo": _fifo}

    solver_bound = None if solver_bound_ticks is None else _ticks_to_units(solver_bound_ticks, res)
    if status == "infeasible":
        lower_bound = math.inf
    else:
        lower_bound = ms_lb if (solver_bound is None or rounded) else max(ms_lb, solver_bound)
    if span is not None and ms_lb > span * (1 + 1e-9):
        log.warning("exact_schedule: makespan_lower_bound %.6g exceeds a feasible schedule's makespan %.6g: the bound "
                    "is wrong for this placement (m=%d, memory_limit=%s)", ms_lb, span, m, memory_limit)
    wall = time.perf_counter() - t0
    log.info("exact_schedule %s m=%d: %s, makespan %s, lower bound %.6g (%.2f s, %d workers)", pl.name, m, status,
             span, lower_bound, wall, workers)
    return ExactResult(status=status, makespan=span, lower_bound=lower_bound, schedule=schedule, wall_time=wall,
                       resolution=res, rounded=rounded, solver_bound=solver_bound, makespan_lower_bound=ms_lb,
                       makespan_ticks=span_ticks, fifo=_fifo,
                       meta={"cp_sat_status": solver.status_name(code), "wall_time_solver": solver.wall_time,
                             "hint_makespan_ticks": hint_span, "model_lower_bound_ticks": lb_ticks,
                             "horizon_ticks": horizon})


def _span(pl: Placement, a: int, f: int, dur: Sequence[int], lag: dict[tuple[int, int], int]) -> int:
    """Least ticks from the start of block ``a`` to the end of its descendant ``f`` in one
    micro-batch: the longest dependency path from ``a`` to ``f``, both durations and the lags included."""
    g = pl.dependency_graph()
    inside = (nx.descendants(g, a) & nx.ancestors(g, f)) | {a, f}
    longest: dict[int, int] = {}
    for i in nx.topological_sort(g.subgraph(inside)):
        longest[i] = dur[i] + max((longest[p] + lag.get((p, i), 0) for p in g.predecessors(i) if p in longest),
                                  default=0)
    return longest[f]


def _activation_pieces(pl: Placement, d: int, q: int) -> list[tuple[int, int | None, int]] | None:
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


def _in_flight_precedences(pl: Placement, d: int, pieces: list[tuple[int, int | None, int]],
                           cap: int) -> list[tuple[int, int, int]]:
    """``(a, f, c)``: with FIFO, ``start(i + c, a) >= end(i, f)`` for every ``i`` (proof in
    :func:`_add_memory`). One per allocating block ``a`` and freeing block ``f`` of ``d``'s pieces,
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


def _add_memory(model: cp_model.CpModel, prob: ExactProblem, start: Mapping[Inst, cp_model.LinearExprT],
                makespan: cp_model.IntVar, horizon: int, reach: Sequence[tuple[int, int] | None] | None) -> None:
    """Memory per device, in exact quanta, ``static + level <= limit`` (see the module docstring).

    The level is a sum of *terms*, each ``k`` quanta held on ``[s, e)`` (``e`` absent: to the end):

    * block memory: where it splits into pieces (:func:`_activation_pieces`: every free paired with
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

    When every term is fixed (no literal) and the block memory is in pieces, the constraint is a
    ``Cumulative`` of one interval per term (``[s, e)``, or ``[s, makespan + 1)`` for a term held
    to the end, so that it also counts at the last instant), capacity ``limit - static``: the
    amount it bounds at each time ``t`` is exactly the reservoir's (a term is counted at ``t`` in
    both iff ``s <= t < e``), and CP-SAT propagates a cumulative (time-tabling, energetic
    reasoning) far more strongly than a reservoir. Otherwise a reservoir (with optional events for
    the literals) over the same events. Each interval's size is at least the dependency path from
    its start to its end (a valid bound on every schedule).

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
    """
    m, dur, tail, fifo = prob.m, prob.durations, prob.tail, prob.fifo
    assert prob.memory is not None
    for d, mem in enumerate(prob.memory):
        rng = None if reach is None else reach[d]
        if reach is not None and rng is None:
            continue   # no free instance on d: its memory is as the fixed solution's
        cap = mem.cap
        # (start, end or None, quanta, active literal, least size)
        terms: list[tuple[cp_model.LinearExprT, cp_model.LinearExprT | None, int, cp_model.LiteralT, int]] = []
        raw: list[tuple[cp_model.LinearExprT, int]] = []   # block memory events when not in pieces
        if mem.pieces is not None:
            for a, f, k, least in mem.pieces:
                for i in range(m):
                    terms.append((start[(i, a)], None if f is None else start[(i, f)] + dur[f], k, True, least))
        else:
            for b, delta in mem.raw:
                for i in range(m):
                    raw.append((start[(i, b)] if delta > 0 else start[(i, b)] + dur[b], delta))
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
        if fifo and mem.pieces is not None:
            for a, f, c_ in mem.in_flight:
                for i in range(m - c_):
                    if not _is_const(start[(i + c_, a)]) and not _is_const(start[(i, f)]):
                        model.add(start[(i + c_, a)] >= start[(i, f)] + dur[f])
        if not terms and not raw:
            continue
        if prob.cumulative and mem.pieces is not None and all(t[3] is True for t in terms):
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
            continue
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
                continue
        times = [e[0] for e in events]
        changes = [e[1] for e in events]
        low = -sum(abs(c) for c in changes) - 1
        if all(e[2] is True for e in events):
            model.add_reservoir_constraint(times, changes, low, cap)
        else:
            model.add_reservoir_constraint_with_active(times, changes, [e[2] for e in events], low, cap)
