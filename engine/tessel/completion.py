"""Tessel phase 2: complete a repetend into a schedule for ``m`` micro-batches.

Unrolled, the repetend's copy ``j`` runs block ``b`` of micro-batch ``j - o_b``. Copies
``O..m-1`` (``O`` = the largest offset) are complete; the blocks of copies ``0..O-1`` form the
**warmup** and those of copies ``m..m-1+O`` the **cooldown**. Both are scheduled with CP-SAT to
minimal length under the same memory limit:

- warmup: the partial copies and the first two complete copies are rescheduled to minimise the
  start ``T0`` of the next copy, around two copies held at their repetend times;
- cooldown: the last two complete copies and the partial ones are rescheduled to minimise the
  makespan, around two held copies (so e.g. weight-gradient blocks can fill the drain's bubbles).

Memory is a CP-SAT reservoir per device (allocation at a block's start, release at its end),
starting from the static memory (warmup) or the steady-state level (cooldown). With too few
micro-batches for a complete copy (``m <= O``) all ``m`` micro-batches are scheduled directly.

The per-device orders are the blocks sorted by start time: a :class:`~engine.schedule.Schedule`
like any baseline's. Source: Tessel (HPCA 2024), section IV-B (schedule completion).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from engine.placement import Placement
from engine.schedule import Block, Schedule
from engine.tessel.repetend import Repetend, Scaled

Inst = tuple[int, int]  # (micro_batch, block index)


@dataclass
class Completion:
    """Start tick of every block instance, and the lengths of warmup and cooldown (ticks)."""

    starts: dict[Inst, int]
    warmup: int
    cooldown: int
    status: str


class _LastImprovement(cp_model.CpSolverSolutionCallback):
    """Records when CP-SAT last reported an improving solution (``time.perf_counter()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.at = time.perf_counter()

    def on_solution_callback(self) -> None:
        self.at = time.perf_counter()


def _solve_with_stall_stop(solver: cp_model.CpSolver, model: cp_model.CpModel, stall: float | None) -> int:
    """``solver.Solve(model)``, stopped (``CpSolver.stop_search``) once the time without an
    improving solution exceeds both ``stall`` seconds and the time it took to find the last
    improvement (a search that is still improving late keeps going as long again): completion
    starts from a complete hint and its later improvements are rare, so waiting out the whole
    time limit mostly proves nothing.

    A watcher thread polls every ``min(stall / 4, 0.05)`` s. The stop is wall-clock based, like
    the time limit itself: a solve that ends on it may differ between runs on a loaded machine;
    solves that finish (optimal) before it are deterministic for a fixed seed.

    Source: OR-Tools CP-SAT Python API (``CpSolverSolutionCallback``, ``CpSolver.stop_search``).
    """
    if stall is None or stall <= 0:
        return solver.Solve(model)
    cb = _LastImprovement()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(min(stall / 4, 0.05)):
            now = time.perf_counter()
            if now - cb.at > max(stall, cb.at - t_start):
                solver.stop_search()
                return

    th = threading.Thread(target=watch, name="tessel-completion-stall", daemon=True)
    t_start = cb.at = time.perf_counter()
    th.start()
    try:
        return solver.Solve(model, cb)
    finally:
        done.set()
        th.join()


def _solve(pl: Placement, sc: Scaled, free: list[Inst], fixed: dict[Inst, int], *, anchored: bool,
           release: dict[Inst, int], deadline: dict[Inst, list[int]], initial: list[int], cap: list[float] | None,
           horizon: int, time_limit: float, seed: int, hint: tuple[dict[Inst, int], int],
           stall: float | None = None, det_limit: float | None = None) -> tuple[str, dict[Inst, int], int]:
    """Place the ``free`` instances around ``fixed`` ones (repetend copies) with CP-SAT.

    ``fixed[i]`` is the start of a repetend instance: relative to the anchor ``T0`` (a variable,
    minimised) when ``anchored`` (warmup), else an absolute tick (cooldown; minimise the makespan).
    ``deadline[i]``: the free instance must end by ``T0 + c`` for each ``c`` (warmup).
    Memory: a reservoir per device over free and fixed events from ``initial``.
    ``hint``: a known feasible solution ``(starts, objective)`` (the plainly unrolled repetend); it
    seeds the solver and is returned (status ``"hint"``) if nothing better is found in time.
    ``stall``: stop early once no better solution has been found for this many seconds
    (:func:`_solve_with_stall_stop`); ``None``: run to ``time_limit`` or optimality.
    ``det_limit``: CP-SAT's deterministic time limit (``max_deterministic_time``, in its own work
    units, independent of machine speed and load), so a solve that ends on it returns the same
    solution on every run; ``time_limit`` stays the wall-clock safety bound.
    """
    t_build = time.perf_counter()
    model = cp_model.CpModel()
    fset = set(free)
    hi = max(horizon, hint[1] + 1, max((t + sc.durations[i[1]] for i, t in hint[0].items()), default=0) + 1)
    t0_var = model.new_int_var(0, hi, "T0") if anchored else None
    t0: cp_model.LinearExprT = t0_var if t0_var is not None else 0
    start: dict[tuple[int, int], cp_model.LinearExprT] = {}
    end: dict[tuple[int, int], cp_model.LinearExprT] = {}
    iv: dict[tuple[int, int], cp_model.IntervalVar] = {}
    for inst in free:
        b = inst[1]
        t = sc.durations[b]
        lo = min(release.get(inst, 0), hint[0][inst])
        v = model.new_int_var(lo, hi, f"s{inst}")
        start[inst], end[inst] = v, v + t
        iv[inst] = model.new_fixed_size_interval_var(v, t, f"iv{inst}")
        model.add(v >= release.get(inst, 0))
        for c in deadline.get(inst, ()):
            model.add(v + t <= t0 + c)
        model.add_hint(v, hint[0][inst])
    for inst, c in fixed.items():
        t = sc.durations[inst[1]]
        st = t0 + c if anchored else c
        start[inst], end[inst] = st, st + t
        iv[inst] = model.new_fixed_size_interval_var(st, t, f"fx{inst}")
    for inst in free:
        mb, b = inst
        for a in pl.blocks[b].deps:
            if (mb, a) in fset:
                model.add(start[inst] >= end[(mb, a)] + sc.lags.get((a, b), 0))
    everything = list(free) + list(fixed)
    for d in range(pl.num_devices):
        on = [i for i in everything if d in pl.blocks[i[1]].devices]
        if len(on) > 1 and any(i in fset for i in on):
            model.add_no_overlap([iv[i] for i in on])
        if cap is not None and on:
            times, changes = [], []
            for i in on:
                delta = sc.memory[i[1]]
                if delta:
                    times.append(start[i] if delta > 0 else end[i])
                    changes.append(delta)
            if times:
                top = int(cap[d] // sc.quantum) - initial[d]
                model.add_reservoir_constraint(times, changes, -(10**15), max(top, 0))
    if t0_var is not None:  # anchored
        obj = t0_var
    else:
        obj = model.new_int_var(0, hi + max(sc.durations, default=0), "makespan")
        model.add_max_equality(obj, [end[i] for i in everything])
    model.add(obj <= hint[1])
    model.minimize(obj)
    model.add_hint(obj, hint[1])  # a complete hint: CP-SAT starts from it instead of repairing it
    solver = cp_model.CpSolver()
    # ``time_limit`` covers building the model too (seconds on placements of thousands of blocks)
    solver.parameters.max_time_in_seconds = max(0.01, time_limit - (time.perf_counter() - t_build))
    if det_limit is not None:
        solver.parameters.max_deterministic_time = max(0.001, det_limit)
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = 1
    solver.parameters.cp_model_presolve = False
    status = _solve_with_stall_stop(solver, model, stall)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return "hint", dict(hint[0]), hint[1]
    found = {i: solver.Value(start[i]) for i in free}
    return ("optimal" if status == cp_model.OPTIMAL else "feasible"), found, solver.Value(obj)


def complete(pl: Placement, sc: Scaled, rep: Repetend, m: int, *, memory_cap: list[float] | None,
             time_limit: float = 5.0, seed: int = 0, free_copies: int = 2, fixed_copies: int = 2,
             direct_limit: int = 400, stall: float | None = None,
             deterministic_time: float | None = None) -> Completion:
    """Warmup + unrolled repetend + cooldown for ``m`` micro-batches (start ticks per instance).

    The partial copies and the first/last ``free_copies`` complete copies are rescheduled (so
    blocks such as deferred weight-gradient ``W`` can move into the cooldown's idle slots), around
    ``fixed_copies`` complete copies held at their repetend times. The plainly unrolled repetend
    seeds both solves and is kept whenever the solver finds nothing better in time, so completion
    always succeeds. With at most ``direct_limit`` block instances, or too few micro-batches for
    that split, all of them are rescheduled at once (this finds e.g. ZB-H1's deferred W blocks).
    ``stall``: each solve stops once it has not improved for this many seconds (``None``: it
    runs to its share of ``time_limit`` unless proven optimal).
    ``deterministic_time``: CP-SAT deterministic-time budget shared like ``time_limit`` (see
    :func:`_solve`): with it, and no ``stall``, a solve that is not proven optimal ends on this
    budget rather than on the wall clock, so the completion is reproducible for a fixed seed.
    """
    K = len(pl.blocks)
    P = rep.period
    s, o = rep.starts, rep.offsets
    max_o = max(o, default=0)  # O in the module docstring
    n = pl.num_devices
    dur = sc.durations
    naive = {(mb, b): (mb + o[b]) * P + s[b] for mb in range(m) for b in range(K)}
    naive_end = max(t + dur[b] for (mb, b), t in naive.items())
    A = max_o + free_copies          # first fixed copy of the warmup (its window start is the anchor T0)
    B = m - free_copies          # first rescheduled copy of the cooldown
    if B - fixed_copies - 1 < A + fixed_copies or m * K <= direct_limit:
        # few micro-batches (or too few complete copies to split): reschedule everything at once
        insts = list(naive)
        status, st, mk = _solve(pl, sc, insts, {}, anchored=False, release={}, deadline={}, initial=list(sc.static),
                                cap=memory_cap, horizon=naive_end, time_limit=time_limit, seed=seed,
                                hint=(naive, naive_end), stall=stall, det_limit=deterministic_time)
        return Completion(st, mk, 0, status)

    def copy_of(inst: Inst) -> int:
        return inst[0] + o[inst[1]]

    # ---- warmup: copies 0..A-1 free; copies A..A+fixed-1 held relative to T0
    warm = [i for i in naive if copy_of(i) < A]
    wset = set(warm)
    w_fixed = {i: (copy_of(i) - A) * P + s[i[1]] for i in naive if A <= copy_of(i) < A + fixed_copies}
    deadline: dict[Inst, list[int]] = {}
    for inst in warm:
        mb, b = inst
        cs = [fixed_copies * P]  # done before the copies that are not modelled
        for c_idx, c in enumerate(pl.blocks):
            if b in c.deps and (mb, c_idx) not in wset:
                cs.append((mb + o[c_idx] - A) * P + s[c_idx] - sc.lags.get((b, c_idx), 0))
        deadline[inst] = cs
    status_w, wst, t0 = _solve(pl, sc, warm, w_fixed, anchored=True, release={}, deadline=deadline,
                               initial=list(sc.static), cap=memory_cap, horizon=naive_end, time_limit=time_limit / 2,
                               seed=seed, hint=({i: naive[i] for i in warm}, A * P), stall=stall,
                               det_limit=None if deterministic_time is None else deterministic_time / 2)
    starts: dict[Inst, int] = dict(wst)
    for inst in naive:
        if copy_of(inst) >= A:
            starts[inst] = t0 + (copy_of(inst) - A) * P + s[inst[1]]

    # ---- cooldown: copies >= B free (the last complete ones and the partial ones); copies
    # B-fixed-1..B-1 held; earlier copies have finished before copy B-fixed starts, which is
    # when free blocks may start at the earliest
    window0 = t0 + (B - fixed_copies - A) * P
    cool = [i for i in naive if copy_of(i) >= B]
    cset = set(cool)
    c_fixed = {i: starts[i] for i in naive if B - fixed_copies - 1 <= copy_of(i) < B}
    initial = [sc.static[d] + sum(sc.memory[b] for (mb, b) in naive if d in pl.blocks[b].devices
                                  and copy_of((mb, b)) < B - fixed_copies - 1) for d in range(n)]
    release: dict[Inst, int] = {}
    for inst in cool:
        mb, b = inst
        r = window0
        for a in pl.blocks[b].deps:
            if (mb, a) not in cset:
                r = max(r, starts[(mb, a)] + dur[a] + sc.lags.get((a, b), 0))
        release[inst] = r
    c_hint = {i: starts[i] for i in cool}
    c_end = max(t + dur[i[1]] for i, t in list(c_hint.items()) + list(c_fixed.items()))
    status_c, cst, mk = _solve(pl, sc, cool, c_fixed, anchored=False, release=release, deadline={}, initial=initial,
                               cap=memory_cap, horizon=c_end, time_limit=time_limit / 2, seed=seed,
                               hint=(c_hint, c_end), stall=stall,
                               det_limit=None if deterministic_time is None else deterministic_time / 2)
    starts.update(cst)
    status = "optimal" if status_w == status_c == "optimal" else "feasible"
    return Completion(starts, t0 - (A - max_o) * P, mk - (t0 + (B - A) * P), status)


def unrolled(rep: Repetend, m: int, num_blocks: int) -> Completion:
    """The plain completion: copy ``j`` at ``j * P``, blocks of micro-batches outside ``0..m-1`` dropped.

    Its per-device orders, executed as soon as inputs arrive, close most of the warmup and
    cooldown gaps by themselves, and it never exceeds the steady state's memory.
    """
    P, s, o = rep.period, rep.starts, rep.offsets
    starts = {(mb, b): (mb + o[b]) * P + s[b] for mb in range(m) for b in range(num_blocks)}
    max_o = max(o, default=0)
    return Completion(starts, max_o * P, max_o * P, "unrolled")


def to_schedule(pl: Placement, comp: Completion, m: int, name: str = "tessel", meta: dict | None = None,
                micro_batches_per_window: int = 1) -> Schedule:
    """Per-device orders sorted by start tick (ties: micro-batch, then chain position).

    ``comp`` may be over the placement expanded ``r = micro_batches_per_window`` times
    (:func:`engine.tessel.repetend.expand`); its instances are mapped back to the original
    blocks and micro-batches, and those of micro-batches ``>= m`` are dropped.
    """
    r = micro_batches_per_window
    K = len(pl.blocks)
    orders: list[list[tuple[int, int, int, Block]]] = [[] for _ in range(pl.num_devices)]
    for (mb_x, b_x), t in comp.starts.items():
        k, b = divmod(b_x, K)
        mb = mb_x * r + k
        if mb >= m:
            continue
        spec = pl.blocks[b]
        blk = Block(spec.segment, spec.kind, mb)
        for d in spec.devices:
            orders[d].append((t, mb, b, blk))
    return Schedule(pl, m, [[x[3] for x in sorted(o)] for o in orders], name, dict(meta or {}))
