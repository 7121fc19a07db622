"""Tessel phase 1: the repetend, found with OR-Tools CP-SAT.

A repetend is a window of length ``P`` (the period) in which every block of the placement
runs exactly once, block ``b`` serving the micro-batch ``o_b`` windows older than the newest
one (its *offset*; later blocks serve older micro-batches). Repeating the window runs one
micro-batch per period in steady state.

Model for a fixed period ``P`` (integer ticks; durations are scaled by a stated resolution and
rounded up, so the model never underestimates):

- ``s_b in [0, P)``: start of block ``b`` in the window; a block may wrap around the window edge
  (an interval plus a copy shifted by ``P``);
- per device, ``NoOverlap`` of the intervals of its blocks and their shifted copies (circular
  disjointness; a multi-device block's intervals are in the NoOverlap of every device of its set,
  so it occupies them all at once);
- ``o_b`` integer (the first root starts the window at 0 and some root has offset 0, which
  removes the rotation symmetry), and for a dependency ``a -> b`` (same micro-batch):
  ``0 <= o_b - o_a <= 2`` and ``s_b + (o_b - o_a) * P >= s_a + t_a + lag_ab`` — the dependency
  across consecutive repetend copies;
- memory: the steady-state level of device ``d`` at window time ``tau`` is
  ``static_d - sum_b delta_b * o_b + sum_b delta_b * [b's event <= tau]`` (allocation at a block's
  start, release at its end; a release that wraps counts one window later). It peaks right after
  an allocation, so it is bounded at each allocating block's start using literals
  ``[event_b <= s_c]`` between the device's blocks.

The period is minimised by a search over ``P`` from the lower bound (max per-device busy time)
up; at the best period a second solve minimises the summed per-device peak memory.

Source: Lin et al., "Tessel: Boosting Distributed Execution of Large DNN Models via Flexible
Schedule Search", HPCA 2024, section IV-A (repetend construction; the reference solver is Z3 with
a binary search on the objective — this is the CP-SAT formulation).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from fractions import Fraction

import networkx as nx
from ortools.sat.python import cp_model

from engine.placement import Placement

#: Largest offset difference along one dependency; 1 always satisfies a dependency with no lag,
#: 2 leaves room for communication lags.
MAX_STAGGER = 2


@dataclass
class Scaled:
    """Integer view of a placement for the solver.

    Attributes:
        resolution: seconds per tick.
        durations: ticks per block (rounded up).
        memory: per block delta in memory quanta (allocations rounded up, releases rounded down).
        quantum: bytes (or units) per memory quantum.
        static: per device static memory in quanta (rounded up).
        lags: ``(a, b) -> ticks`` of communication on a cross-device dependency.
    """

    resolution: float
    durations: list[int]
    memory: list[int]
    quantum: float
    static: list[int]
    lags: dict[tuple[int, int], int] = field(default_factory=dict)

    def ticks(self, seconds: float) -> int:
        """``seconds`` in ticks: exact when within :data:`EXACT_REL_TOL` of a whole tick, else rounded up."""
        return to_ticks(seconds, self.resolution)


#: Relative tolerance within which a duration counts as equal to a rational number (and a tick
#: count as whole): 1e-9, far below any cost model's precision and far above float rounding.
EXACT_REL_TOL = 1e-9

#: Largest denominator of the rational a duration is read as (``Fraction.limit_denominator``).
MAX_DENOMINATOR = 10**6

#: Most ticks the longest block may take with an exact tick (the durations' greatest common
#: divisor); beyond it the tick falls back to ``longest / ticks_per_block`` and durations are
#: rounded up (the result says so). Keeps the solver's time domains, and the number of window
#: lengths the period search steps through, small.
MAX_EXACT_TICKS = 1000


def to_ticks(seconds: float, resolution: float) -> int:
    """``seconds`` as a whole number of ticks of ``resolution`` seconds.

    A value within :data:`EXACT_REL_TOL` (relative) of a whole tick count is that count; any other
    is rounded up, so the solver never underestimates a duration.
    """
    t = seconds / resolution
    n = round(t)
    if abs(t - n) <= EXACT_REL_TOL * max(1.0, abs(t)):
        return int(n)
    return int(math.ceil(t))


def _as_fraction(x: float) -> Fraction | None:
    """``x`` as a rational with denominator <= :data:`MAX_DENOMINATOR` when within :data:`EXACT_REL_TOL` of one."""
    q = Fraction(x).limit_denominator(MAX_DENOMINATOR)
    return q if abs(float(q) - x) <= EXACT_REL_TOL * abs(x) else None


def exact_tick(values: Iterable[float]) -> Fraction | None:
    """The greatest common divisor of ``values`` (seconds or abstract units), or ``None``.

    Each positive value is read as the nearest rational with denominator <=
    :data:`MAX_DENOMINATOR` (``fractions.Fraction.limit_denominator``); ``None`` when one is not
    within :data:`EXACT_REL_TOL` of it (e.g. a measured duration in seconds) or nothing is positive.
    """
    fracs = []
    for v in values:
        if v > 0:
            q = _as_fraction(v)
            if q is None:
                return None
            fracs.append(q)
    if not fracs:
        return None
    den = math.lcm(*(q.denominator for q in fracs))
    num = math.gcd(*(q.numerator * (den // q.denominator) for q in fracs))
    return Fraction(num, den)


def is_exact(values: Iterable[float], resolution: float) -> bool:
    """Whether every value is a whole number of ticks of ``resolution`` (within :data:`EXACT_REL_TOL`)."""
    for v in values:
        t = v / resolution
        if abs(t - round(t)) > EXACT_REL_TOL * max(1.0, abs(t)):
            return False
    return True


def auto_resolution(placement: Placement, ticks_per_block: int = 100,
                    lags: dict[tuple[int, int], float] | None = None) -> tuple[float, bool]:
    """The solver tick (seconds or abstract units per tick) and whether durations are rounded to it.

    The tick is the greatest common divisor of the block durations and lags (:func:`exact_tick`:
    F=1, B=3 gives 1, so periods are whole numbers of units) when they are rational and the longest
    block is then at most :data:`MAX_EXACT_TICKS` ticks; otherwise (measured seconds) the longest
    block is ``ticks_per_block`` ticks and the others are rounded up to whole ticks, which the
    second value (``True``) reports: the search's periods are then upper bounds, never optimal.
    """
    durations = [b.duration for b in placement.blocks] + list((lags or {}).values())
    longest = max(durations, default=1.0) or 1.0
    tick = exact_tick(durations)
    if tick is not None and longest / float(tick) <= MAX_EXACT_TICKS * (1 + EXACT_REL_TOL):
        return float(tick), False
    fine = longest / ticks_per_block
    return fine, not is_exact(durations, fine)


def scale(placement: Placement, resolution: float, lags: dict[tuple[int, int], float] | None = None) -> Scaled:
    """Scale durations to ticks (rounded up, never underestimated) and memory to exact quanta.

    The memory quantum is the greatest common divisor of every block's delta and every static
    size, so memory stays exact (CP-SAT's 64-bit integers hold byte counts comfortably); an
    inexact rounding would let allocations and releases of one micro-batch disagree.
    """
    durs = [to_ticks(b.duration, resolution) for b in placement.blocks]
    # gradient buffers and transients (Placement.grad_memory/grad_transient) count as static:
    # reserved_bytes bounds them for the whole step, so the steady state stays within the limit
    values = ([abs(int(b.memory)) for b in placement.blocks]
              + [int(placement.reserved_bytes(d)) for d in range(placement.num_devices)])
    quantum = 0
    for v in values:
        quantum = math.gcd(quantum, v)
    quantum = quantum or 1
    mem = [int(b.memory) // quantum for b in placement.blocks]
    static = [int(placement.reserved_bytes(d)) // quantum for d in range(placement.num_devices)]
    lg = {k: to_ticks(v, resolution) for k, v in (lags or {}).items()}
    return Scaled(resolution, durs, mem, float(quantum), static, lg)


@dataclass
class Repetend:
    """A steady-state window.

    Attributes:
        period: ticks per window.
        starts: per block of the (expanded) placement, start tick in the window.
        offsets: per block, how many windows older its micro-batch is than the newest one's.
        resolution: seconds per tick.
        peak: per device steady-state peak memory (quanta x quantum = bytes/units), static included.
        micro_batches: micro-batches per window ``r`` (the placement expanded ``r`` times, see
            :func:`expand`); the period per micro-batch is ``period / r``.
    """

    period: int
    starts: list[int]
    offsets: list[int]
    resolution: float
    peak: list[float] = field(default_factory=list)
    micro_batches: int = 1

    @property
    def period_seconds(self) -> float:
        """Seconds (or abstract units) per micro-batch in steady state: ticks x tick / micro-batches,
        computed on the tick's rational value where it has one (a period of 40 ticks of 0.1 is 4.0)."""
        q = _as_fraction(self.resolution) if self.resolution > 0 else None
        if q is not None:
            return float(q * self.period / self.micro_batches)
        return self.period * self.resolution / self.micro_batches

    @property
    def in_flight(self) -> int:
        """Micro-batches alive at once in steady state (max offset + 1)."""
        return max(self.offsets, default=0) + 1

    def to_dict(self) -> dict:
        return {"period": self.period_seconds, "window_ticks": self.period, "micro_batches": self.micro_batches,
                "resolution": self.resolution, "starts": self.starts, "offsets": self.offsets, "peak_memory": self.peak}


def expand(placement: Placement, r: int) -> Placement:
    """The placement repeated ``r`` times as independent chains: a window holding ``r`` micro-batches.

    Copy ``k`` of block ``b`` is block ``k * K + b`` with segment ``k * S + segment`` (``K`` blocks,
    ``S`` segments); micro-batch ``mb'`` of the expanded placement's copy ``k`` is micro-batch
    ``r * mb' + k`` of the original. A repetend over it can reach periods like 8.5 per micro-batch
    that a one-micro-batch window cannot (Tessel allows several micro-batches per repetend).
    """
    if r == 1:
        return placement
    K, S = len(placement.blocks), placement.num_segments
    blocks = [replace(b, segment=k * S + b.segment, deps=tuple(k * K + d for d in b.deps))
              for k in range(r) for b in placement.blocks]
    # the copies share one set of parameters: their gradient memory is counted once, as static
    reserved = tuple(placement.reserved_bytes(d) for d in range(placement.num_devices))
    return Placement(placement.num_devices, tuple(blocks), name=f"{placement.name}x{r}", static_memory=reserved)


class _Stopper(cp_model.CpSolverSolutionCallback):
    def __init__(self, should_stop):
        super().__init__()
        self._should_stop = should_stop

    def on_solution_callback(self) -> None:
        if self._should_stop():
            self.stop_search()


def build_model(placement: Placement, sc: Scaled, period: int, memory_cap: list[float] | None,
                objective: str | None = None, max_latency: int | None = None, replicas: int = 1,
                latency_cap: int | None = None):
    """The CP-SAT model for a fixed period; returns ``(model, starts, offsets, peaks)``.

    Blocks may wrap around the window edge (a block starting at ``s`` occupies
    ``[s, s + t) mod P``): each block has an interval and a copy shifted by ``P``, and every
    device's NoOverlap covers both, which is exactly circular disjointness for ``t <= P``.

    ``objective``: ``None`` (feasibility), ``"memory"`` (least summed per-device peak),
    ``"latency"`` (least time from a window's earliest root start to its latest sink end, unrolled) or
    ``"latency+memory"`` (latency, then memory). ``max_latency`` and ``latency_cap`` bound that
    latency (ticks; the second e.g. by the solution a polish starts from).
    """
    pl = placement
    n = pl.num_devices
    P = period
    model = cp_model.CpModel()
    K = len(pl.blocks)
    starts, offsets, ends = [], [], []
    ivs: list[tuple] = []
    # an offset grows by at most MAX_STAGGER per dependency: bound it by the block's depth
    depth: dict[int, int] = {}
    for i in nx.topological_sort(pl.dependency_graph()):
        depth[i] = 1 + max((depth[a] for a in pl.blocks[i].deps), default=-1)
    max_depth = max(depth.values(), default=0)
    max_off = MAX_STAGGER * (2 * max_depth + 1)
    for i, _b in enumerate(pl.blocks):
        t = sc.durations[i]
        if t > P:
            return None
        s = model.new_int_var(0, P - 1, f"s{i}")
        iv = model.new_fixed_size_interval_var(s, t, f"iv{i}")
        iv2 = model.new_fixed_size_interval_var(s + P, t, f"iv{i}+P")
        o = model.new_int_var(0, MAX_STAGGER * (max_depth + depth[i]), f"o{i}")
        starts.append(s)
        ends.append(s + t)
        ivs.append((iv, iv2))
        offsets.append(o)
    # symmetry breaking: rotating the window (and shifting every offset by one) gives an
    # equivalent repetend, so the first root starts the window and some root has offset 0
    roots = [i for i, b in enumerate(pl.blocks) if not b.deps]
    model.add(starts[roots[0]] == 0)
    model.add_min_equality(model.new_constant(0), [offsets[r] for r in roots])
    # an expanded placement (several micro-batches per window, see expand) has interchangeable
    # replicas: order them by the unrolled start time of their first root, each starting within
    # one window of the previous (micro-batch r*j+k+1 starts at most P after micro-batch r*j+k)
    if replicas > 1:
        per = K // replicas
        for k in range(replicas - 1):
            a, b2 = roots[0] + k * per, roots[0] + (k + 1) * per
            model.add(starts[a] + offsets[a] * P < starts[b2] + offsets[b2] * P)
            model.add(starts[b2] + offsets[b2] * P < starts[a] + offsets[a] * P + P)  # within one window
    for i, b in enumerate(pl.blocks):
        for a in b.deps:
            diff = offsets[i] - offsets[a]
            model.add(diff >= 0)
            model.add(diff <= MAX_STAGGER)
            lag = sc.lags.get((a, i), 0)
            model.add(starts[i] + diff * P >= starts[a] + sc.durations[a] + lag)
    on_dev = [[i for i, b in enumerate(pl.blocks) if d in b.devices] for d in range(n)]
    for d in range(n):
        if len(on_dev[d]) > 1:
            model.add_no_overlap([x for i in on_dev[d] for x in ivs[i]])
    peaks = []
    if memory_cap is not None or objective in ("memory", "latency+memory"):
        # wrap[b]: a releasing block ends in the next window (its release counts one window later)
        wrap = {}
        for i in range(K):
            if sc.memory[i] < 0:
                w = model.new_bool_var(f"w{i}")
                model.add(ends[i] >= P).only_enforce_if(w)
                model.add(ends[i] <= P).only_enforce_if(w.negated())
                wrap[i] = w

        def event(i):  # position of block i's memory event in the window
            return starts[i] if sc.memory[i] > 0 else ends[i] - P * wrap[i]

        hi_all = sum(sc.static) + sum(abs(x) for x in sc.memory) * (max_off + 2) + 1
        for d in range(n):
            blocks = [i for i in on_dev[d] if sc.memory[i]]
            base = sc.static[d] - sum(sc.memory[b] * (offsets[b] + (wrap[b] if b in wrap else 0)) for b in blocks)
            peak = model.new_int_var(-hi_all, hi_all, f"peak{d}")
            model.add(peak >= base)
            for c in blocks:
                if sc.memory[c] <= 0:
                    continue
                terms = []
                for j in blocks:
                    if j == c:
                        continue
                    x = model.new_bool_var(f"x{d}_{j}_{c}")
                    model.add(event(j) <= starts[c]).only_enforce_if(x)
                    model.add(event(j) >= starts[c] + 1).only_enforce_if(x.negated())
                    terms.append(sc.memory[j] * x)
                model.add(peak >= base + sc.memory[c] + sum(terms))
            if memory_cap is not None:
                model.add(peak <= int(math.floor(memory_cap[d] / sc.quantum + 1e-9)))
            peaks.append(peak)
    latency = None
    if objective in ("latency", "latency+memory") or max_latency is not None or latency_cap is not None:
        # from the earliest root's start to the latest sink's end, unrolled: it sets the warmup and
        # cooldown (the makespan of m micro-batches is about (m - 1) windows plus it)
        horizon = P * (max_off + 2)
        first = model.new_int_var(0, horizon, "first")
        last = model.new_int_var(0, horizon, "last")
        g = pl.dependency_graph()
        for i in g.nodes:
            if g.in_degree(i) == 0:
                model.add(first <= offsets[i] * P + starts[i])
            if g.out_degree(i) == 0:
                model.add(last >= offsets[i] * P + ends[i])
        latency = last - first
        if max_latency is not None:
            model.add(latency <= max_latency)
        if latency_cap is not None:
            model.add(latency <= latency_cap)
    if objective == "memory" and peaks:
        model.minimize(sum(peaks))
    elif objective == "latency":
        assert latency is not None  # set above for this objective
        model.minimize(latency)
    elif objective == "latency+memory":
        # lexicographic: the micro-batch latency first (it sets the length of warmup + cooldown),
        # then the summed per-device peak memory
        assert latency is not None  # set above for this objective
        weight = 1 + 2 * (sum(sc.static) + sum(abs(x) for x in sc.memory) * (max_off + 2) + 1)
        model.minimize(latency * weight + sum(peaks))
    return model, starts, offsets, peaks


def solve_period(placement: Placement, sc: Scaled, period: int, memory_cap: list[float] | None, *,
                 time_limit: float, seed: int, workers: int = 1, objective: str | None = None,
                 max_latency: int | None = None, hint: Repetend | None = None, replicas: int = 1,
                 should_stop=None, on_solver=None, hinted_share: float = 0.0, det_limit: float | None = None,
                 stats: dict | None = None, latency_cap: int | None = None) -> tuple[str, Repetend | None]:
    """Solve the repetend model at a fixed period.

    Feasibility solves (``objective=None``) decide the offsets first, smallest first, with a
    fixed search. With ``hinted_share > 0`` and a ``hint`` of this period, that last share of
    ``time_limit`` goes to a second solve with CP-SAT's default search guided by the hint, when
    the fixed search has not settled the window (the hinted search often finds a feasible
    repetend near e.g. :func:`retime`'s guess where the fixed one does not; the fixed one is
    better at proving a window infeasible).

    ``det_limit``: CP-SAT's deterministic time budget (``max_deterministic_time``, split like
    ``time_limit``), which makes the outcome reproducible for a fixed seed and one worker;
    ``time_limit`` (wall-clock seconds) is then only a guard. ``stats`` (a dict) accumulates
    ``"det"`` (deterministic time used) and sets ``"wall_hit"`` when a solve ended on the wall clock
    before its deterministic budget (the outcome may then depend on the machine's load).

    Returns:
        ``(status, repetend)``: status is ``"feasible"``, ``"infeasible"`` or ``"unknown"``
        (time limit or cancelled); the repetend when feasible.
    """
    use_hint = hint is not None and hint.period == period
    if objective is None and use_hint and hinted_share > 0:
        t0 = time.perf_counter()
        status, rep = _solve_once(placement, sc, period, memory_cap, time_limit=(1 - hinted_share) * time_limit,
                                  seed=seed, workers=workers, objective=None, max_latency=max_latency, hint=hint,
                                  replicas=replicas, should_stop=should_stop, on_solver=on_solver, fixed=True,
                                  det_limit=None if det_limit is None else (1 - hinted_share) * det_limit, stats=stats)
        if status != "unknown" or (should_stop is not None and should_stop()):
            return status, rep
        return _solve_once(placement, sc, period, memory_cap,
                           time_limit=max(0.01, time_limit - (time.perf_counter() - t0)),
                           seed=seed, workers=workers, objective=None, max_latency=max_latency, hint=hint,
                           replicas=replicas, should_stop=should_stop, on_solver=on_solver, fixed=False,
                           det_limit=None if det_limit is None else hinted_share * det_limit, stats=stats)
    return _solve_once(placement, sc, period, memory_cap, time_limit=time_limit, seed=seed, workers=workers,
                       objective=objective, max_latency=max_latency, hint=hint if use_hint else None,
                       replicas=replicas, should_stop=should_stop, on_solver=on_solver, fixed=objective is None,
                       det_limit=det_limit, stats=stats, latency_cap=latency_cap)


def _solve_once(placement: Placement, sc: Scaled, period: int, memory_cap, *, time_limit: float, seed: int,
                workers: int, objective: str | None, max_latency: int | None, hint: Repetend | None, replicas: int,
                should_stop, on_solver, fixed: bool, det_limit: float | None = None,
                stats: dict | None = None, latency_cap: int | None = None) -> tuple[str, Repetend | None]:
    t_build = time.perf_counter()
    built = build_model(placement, sc, period, memory_cap, objective, max_latency, replicas, latency_cap)
    if built is None:
        return "infeasible", None
    model, starts, offsets, peaks = built
    if hint is not None and hint.period == period:
        for v, x in zip(starts, hint.starts):
            model.add_hint(v, x)
        for v, x in zip(offsets, hint.offsets):
            model.add_hint(v, x)
    solver = cp_model.CpSolver()
    # ``time_limit`` covers building the model too (seconds on placements of thousands of blocks)
    wall = max(0.01, time_limit - (time.perf_counter() - t_build))
    solver.parameters.max_time_in_seconds = wall
    if det_limit is not None:
        solver.parameters.max_deterministic_time = max(0.001, det_limit)
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = workers
    if fixed:
        # feasibility: decide the offsets first, smallest first (they fix the in-flight memory,
        # and a small offset is the common case); 10-100x faster than the default search on
        # memory-bound instances of this model (measured on M, NN and X shapes)
        model.add_decision_strategy(offsets, cp_model.CHOOSE_FIRST, cp_model.SELECT_MIN_VALUE)
        solver.parameters.search_branching = cp_model.FIXED_SEARCH
    if on_solver is not None:
        on_solver(solver)
    cb = _Stopper(should_stop) if should_stop is not None else None
    status = solver.Solve(model, cb) if cb is not None else solver.Solve(model)
    if stats is not None:
        stats["det"] = stats.get("det", 0.0) + solver.deterministic_time
        if (status == cp_model.UNKNOWN or (status == cp_model.FEASIBLE and objective is not None)) \
                and solver.wall_time >= 0.95 * wall and not (should_stop is not None and should_stop()):
            stats["wall_hit"] = True
    if status == cp_model.FEASIBLE and objective is None:
        status = cp_model.OPTIMAL
    if on_solver is not None:
        on_solver(None)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        rep = Repetend(period, [solver.Value(s) for s in starts], [solver.Value(o) for o in offsets], sc.resolution,
                       [solver.Value(p) * sc.quantum for p in peaks])
        return "feasible", rep
    if status == cp_model.INFEASIBLE:
        return "infeasible", None
    return "unknown", None


def repetend_latency(placement: Placement, sc: Scaled, rep: Repetend) -> int:
    """Ticks from a window's earliest root start to its latest sink end, unrolled (what the
    ``"latency"`` objective of :func:`build_model` minimises)."""
    g = placement.dependency_graph()
    P = rep.period
    first = min(rep.offsets[i] * P + rep.starts[i] for i in g.nodes if g.in_degree(i) == 0)
    last = max(rep.offsets[i] * P + rep.starts[i] + sc.durations[i] for i in g.nodes if g.out_degree(i) == 0)
    return last - first


def retime(rep: Repetend, num_blocks: int, r: int, window: int) -> Repetend:
    """A guess at a repetend of ``r`` micro-batches per ``window`` ticks, read off ``rep``.

    ``rep`` (over the placement expanded ``rep.micro_batches`` times, ``num_blocks`` blocks per
    micro-batch) is unrolled, its time axis scaled so that one micro-batch takes
    ``window / r`` ticks instead of ``rep``'s period per micro-batch, and ``r`` consecutive
    micro-batches of the middle are cut into a window (over the placement expanded ``r``
    times). Usually a few ticks from feasible: a solver hint, not a solution.
    """
    r0, P0, K = rep.micro_batches, rep.period, num_blocks

    def unrolled_start(j: int, b: int) -> int:
        mb_x, k = divmod(j, r0)
        i = k * K + b
        return (mb_x + rep.offsets[i]) * P0 + rep.starts[i]

    j0 = 4 * r0 * r * (max(rep.offsets, default=0) + 1)
    ref = unrolled_start(j0, 0)
    factor = window * r0 / (r * P0)
    starts, offsets = [], []
    for k in range(r):
        for b in range(K):
            u = int(math.floor((unrolled_start(j0 + k, b) - ref) * factor + 0.5))
            starts.append(u % window)
            offsets.append(u // window)
    low = min(offsets, default=0)
    return Repetend(window, starts, [o - low for o in offsets], rep.resolution, micro_batches=r)


def sequential_repetend(placement: Placement, sc: Scaled) -> Repetend:
    """The trivial repetend: one micro-batch at a time, blocks back to back in chain order.

    Always valid; its memory is the memory floor. The period is the sum of all block
    durations and lags (multi-device blocks counted once).
    """
    g = placement.dependency_graph()
    t = 0
    starts = [0] * len(placement.blocks)
    for i in nx.lexicographical_topological_sort(g):
        lag = max((sc.lags.get((a, i), 0) for a in placement.blocks[i].deps), default=0)
        t += lag
        starts[i] = t
        t += sc.durations[i]
    return Repetend(max(t, 1), starts, [0] * len(placement.blocks), sc.resolution)
