"""Tessel phase 2: complete a repetend into a schedule for ``m`` micro-batches.

Unrolled, the repetend's copy ``j`` runs block ``b`` of micro-batch ``j - o_b``. Copies
``O..m-1`` (``O`` = the largest offset) are complete; the blocks of copies ``0..O-1`` form the
**warmup** and those of copies ``m..m-1+O`` the **cooldown**. Both are scheduled with CP-SAT to
minimal length under the same memory limit:

- warmup: minimise the start ``T0`` of the first complete copy; warmup blocks may fill idle
  slots of the first ``O`` complete copies and end before any later block that depends on them;
- cooldown: minimise the makespan; cooldown blocks may fill idle slots of the last complete
  copies and start after every block they depend on.

Memory is a CP-SAT reservoir per device (allocation at a block's start, release at its end),
starting from the static memory (warmup) or the steady-state level (cooldown). With too few
micro-batches for a complete copy (``m <= O``) all ``m`` micro-batches are scheduled directly.

The per-device orders are the blocks sorted by start time: a :class:`~engine.schedule.Schedule`
like any baseline's. Source: Tessel (HPCA 2024), section IV-B (schedule completion).
"""

from __future__ import annotations

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


def _solve(pl: Placement, sc: Scaled, free: list[Inst], fixed: dict[Inst, int], *, anchored: bool,
           release: dict[Inst, int], deadline: dict[Inst, list[int]], initial: list[int], cap: list[float] | None,
           horizon: int, time_limit: float, seed: int, hint: tuple[dict[Inst, int], int]) -> tuple[str, dict[Inst, int], int]:
    """Place the ``free`` instances around ``fixed`` ones (repetend copies) with CP-SAT.

    ``fixed[i]`` is the start of a repetend instance: relative to the anchor ``T0`` (a variable,
    minimised) when ``anchored`` (warmup), else an absolute tick (cooldown; minimise the makespan).
    ``deadline[i]``: the free instance must end by ``T0 + c`` for each ``c`` (warmup).
    Memory: a reservoir per device over free and fixed events from ``initial``.
    ``hint``: a known feasible solution ``(starts, objective)`` (the plainly unrolled repetend); it
    seeds the solver and is returned (status ``"hint"``) if nothing better is found in time.
    """
    model = cp_model.CpModel()
    fset = set(free)
    hi = max(horizon, hint[1] + 1, max((t + sc.durations[i[1]] for i, t in hint[0].items()), default=0) + 1)
    t0 = model.NewIntVar(0, hi, "T0") if anchored else 0
    start, end, iv = {}, {}, {}
    for inst in free:
        b = inst[1]
        t = sc.durations[b]
        lo = min(release.get(inst, 0), hint[0][inst])
        v = model.NewIntVar(lo, hi, f"s{inst}")
        start[inst], end[inst] = v, v + t
        iv[inst] = model.NewFixedSizeIntervalVar(v, t, f"iv{inst}")
        model.Add(v >= release.get(inst, 0))
        for c in deadline.get(inst, ()):
            model.Add(v + t <= t0 + c)
        model.AddHint(v, hint[0][inst])
    for inst, c in fixed.items():
        t = sc.durations[inst[1]]
        st = t0 + c if anchored else c
        start[inst], end[inst] = st, st + t
        iv[inst] = model.NewFixedSizeIntervalVar(st, t, f"fx{inst}")
    for inst in free:
        mb, b = inst
        for a in pl.blocks[b].deps:
            if (mb, a) in fset:
                model.Add(start[inst] >= end[(mb, a)] + sc.lags.get((a, b), 0))
    everything = list(free) + list(fixed)
    for d in range(pl.num_devices):
        on = [i for i in everything if d in pl.blocks[i[1]].devices]
        if len(on) > 1 and any(i in fset for i in on):
            model.AddNoOverlap([iv[i] for i in on])
        if cap is not None and on:
            times, changes = [], []
            for i in on:
                delta = sc.memory[i[1]]
                if delta:
                    times.append(start[i] if delta > 0 else end[i])
                    changes.append(delta)
            if times:
                top = int(cap[d] // sc.quantum) - initial[d]
                model.AddReservoirConstraint(times, changes, -(10**15), max(top, 0))
    if anchored:
        obj = t0
    else:
        obj = model.NewIntVar(0, hi + max(sc.durations, default=0), "makespan")
        model.AddMaxEquality(obj, [end[i] for i in everything])
    model.Add(obj <= hint[1])
    model.Minimize(obj)
    if anchored:
        model.AddHint(t0, hint[1])
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit)
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = 1
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return "hint", dict(hint[0]), hint[1]
    found = {i: solver.Value(start[i]) for i in free}
    return ("optimal" if status == cp_model.OPTIMAL else "feasible"), found, solver.Value(obj)


def complete(pl: Placement, sc: Scaled, rep: Repetend, m: int, *, memory_cap: list[float] | None,
             time_limit: float = 5.0, seed: int = 0) -> Completion:
    """Warmup + unrolled repetend + cooldown for ``m`` micro-batches (start ticks per instance).

    Warmup blocks may fill idle slots of the first ``O`` complete copies and cooldown blocks those
    of the last ``O + 1``; the plainly unrolled repetend seeds both solves and is kept whenever
    the solver finds nothing better in time, so completion always succeeds.
    """
    K = len(pl.blocks)
    P = rep.period
    s, o = rep.starts, rep.offsets
    O = max(o, default=0)
    n = pl.num_devices
    dur = sc.durations
    copy_start = lambda j: j * P  # noqa: E731  (plain unroll: copy j's window starts at j * P)
    naive = {(mb, b): copy_start(mb + o[b]) + s[b] for mb in range(m) for b in range(K)}
    naive_end = max(t + dur[b] for (mb, b), t in naive.items())

    if m <= O:  # too few micro-batches for a complete copy: schedule everything directly
        insts = list(naive)
        status, st, mk = _solve(pl, sc, insts, {}, anchored=False, release={}, deadline={}, initial=list(sc.static),
                                cap=memory_cap, horizon=naive_end, time_limit=time_limit, seed=seed, hint=(naive, naive_end))
        return Completion(st, mk, 0, status)

    L = min(O, 2)  # complete copies the warmup / cooldown may interleave with
    # ---- warmup: copies 0..O-1 free; copies O..O+L-1 fixed relative to T0 = start of copy O
    warm = [(j - o[b], b) for j in range(O) for b in range(K) if j - o[b] >= 0]
    wset = set(warm)
    last_fixed = min(m - 1, O + L - 1)
    w_fixed = {(j - o[b], b): (j - O) * P + s[b] for j in range(O, last_fixed + 1) for b in range(K)}
    deadline: dict[Inst, list[int]] = {}
    for inst in warm:
        mb, b = inst
        cs = [(last_fixed + 1 - O) * P]  # done before the copies that are not modelled
        for c_idx, c in enumerate(pl.blocks):
            if b in c.deps and (mb, c_idx) not in wset:
                j = mb + o[c_idx]
                cs.append((j - O) * P + s[c_idx] - sc.lags.get((b, c_idx), 0))
        deadline[inst] = cs
    w_hint = ({i: naive[i] for i in warm}, O * P)
    status_w, wst, t0 = _solve(pl, sc, warm, w_fixed, anchored=True, release={}, deadline=deadline,
                               initial=list(sc.static), cap=memory_cap, horizon=naive_end, time_limit=time_limit / 2,
                               seed=seed, hint=w_hint)
    starts: dict[Inst, int] = dict(wst)
    for j in range(O, m):
        for b in range(K):
            starts[(j - o[b], b)] = t0 + (j - O) * P + s[b]

    # ---- cooldown: copies m..m-1+O free; copies m-L-1..m-1 (those still running near the end) fixed
    first_fixed = max(O, m - L - 1)
    cool = [(j - o[b], b) for j in range(m, m + O) for b in range(K) if 0 <= j - o[b] < m]
    cset = set(cool)
    c_fixed = {(j - o[b], b): starts[(j - o[b], b)] for j in range(first_fixed, m) for b in range(K)}
    # everything before the fixed copies has finished by then; its memory is the initial level
    initial = [sc.static[d] + sum(sc.memory[b] for (mb, b) in starts if d in pl.blocks[b].devices
                                  and (mb + o[b] < first_fixed)) for d in range(n)]
    release: dict[Inst, int] = {}
    for inst in cool:
        mb, b = inst
        r = 0
        for a in pl.blocks[b].deps:
            if (mb, a) not in cset:
                r = max(r, starts[(mb, a)] + dur[a] + sc.lags.get((a, b), 0))
        release[inst] = r
    shift = t0 - O * P  # naive copy j started at j*P; here at t0 + (j - O) * P
    c_hint_starts = {i: naive[i] + shift for i in cool}
    c_hint_end = max([t + dur[i[1]] for i, t in c_hint_starts.items()] + [t + dur[i[1]] for i, t in c_fixed.items()])
    status_c, cst, mk = _solve(pl, sc, cool, c_fixed, anchored=False, release=release, deadline={}, initial=initial,
                               cap=memory_cap, horizon=c_hint_end, time_limit=time_limit / 2, seed=seed,
                               hint=(c_hint_starts, c_hint_end))
    starts.update(cst)
    cooldown = mk - (t0 + (m - O) * P)
    status = status_c if not warm else ("optimal" if status_w == status_c == "optimal" else "feasible")
    return Completion(starts, t0, cooldown, status)


def unrolled(rep: Repetend, m: int, num_blocks: int) -> Completion:
    """The plain completion: copy ``j`` at ``j * P``, blocks of micro-batches outside ``0..m-1`` dropped.

    Its per-device orders, executed as soon as inputs arrive, close most of the warmup and
    cooldown gaps by themselves, and it never exceeds the steady state's memory.
    """
    P, s, o = rep.period, rep.starts, rep.offsets
    starts = {(mb, b): (mb + o[b]) * P + s[b] for mb in range(m) for b in range(num_blocks)}
    O = max(o, default=0)
    return Completion(starts, O * P, O * P, "unrolled")


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
