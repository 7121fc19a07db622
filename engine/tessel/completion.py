"""Tessel phase 2: complete a repetend into a schedule for ``m`` micro-batches.

Unrolled, the repetend's copy ``j`` runs block ``b`` of micro-batch ``j - o_b``. Copies
``O..m-1`` (``O`` = the largest offset) are complete; the blocks of copies ``0..O-1`` form the
**warmup** and those of copies ``m..m-1+O`` the **cooldown**. Both are scheduled with CP-SAT to
minimal length under the same memory limit:

- warmup: minimise the start ``T0`` of the first complete copy; a warmup block ends before its
  device's first block of that copy, and before any later block that depends on it;
- cooldown: minimise the makespan; a cooldown block starts after its device's last block of the
  last complete copy and after every block it depends on.

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


def _solve(pl: Placement, sc: Scaled, insts: list[Inst], *, release: dict[Inst, int], device_ready: list[int],
           initial: list[int], cap: list[float] | None, anchor: dict[Inst, list[int]] | None, horizon: int,
           time_limit: float, seed: int) -> tuple[str, dict[Inst, int], int]:
    """Schedule instances; with ``anchor`` minimise the anchor ``T0`` such that instance ``i`` ends
    by ``T0 + c`` for each ``c`` in ``anchor[i]``, else minimise the makespan."""
    model = cp_model.CpModel()
    iset = set(insts)
    start, end, iv = {}, {}, {}
    for inst in insts:
        b = inst[1]
        t = sc.durations[b]
        lo = max([release.get(inst, 0)] + [device_ready[d] for d in pl.blocks[b].devices])
        s = model.NewIntVar(lo, horizon, f"s{inst}")
        start[inst] = s
        end[inst] = s + t
        iv[inst] = model.NewFixedSizeIntervalVar(s, t, f"iv{inst}")
    for inst in insts:
        mb, b = inst
        for a in pl.blocks[b].deps:
            if (mb, a) in iset:
                model.Add(start[inst] >= end[(mb, a)] + sc.lags.get((a, b), 0))
    n = pl.num_devices
    for d in range(n):
        on = [i for i in insts if d in pl.blocks[i[1]].devices]
        if len(on) > 1:
            model.AddNoOverlap([iv[i] for i in on])
        if cap is not None and on:
            times, changes = [], []
            for i in on:
                delta = sc.memory[i[1]]
                if delta > 0:
                    times.append(start[i])
                    changes.append(delta)
                elif delta < 0:
                    times.append(end[i])
                    changes.append(delta)
            if times:
                top = int(cap[d] // sc.quantum) - initial[d]
                model.AddReservoirConstraint(times, changes, -(10**15), max(top, 0))
    if anchor is not None:
        t0 = model.NewIntVar(0, horizon, "T0")
        for inst, cs in anchor.items():
            for c in cs:
                model.Add(end[inst] <= t0 + c)
        model.Minimize(t0)
    else:
        mk = model.NewIntVar(0, horizon + max(sc.durations, default=0), "makespan")
        model.AddMaxEquality(mk, [end[i] for i in insts])
        model.Minimize(mk)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit)
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = 1
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return ("infeasible" if status == cp_model.INFEASIBLE else "unknown"), {}, 0
    found = {i: solver.Value(start[i]) for i in insts}
    obj = solver.Value(t0) if anchor is not None else solver.Value(mk)
    return ("optimal" if status == cp_model.OPTIMAL else "feasible"), found, obj


def complete(pl: Placement, sc: Scaled, rep: Repetend, m: int, *, memory_cap: list[float] | None,
             time_limit: float = 5.0, seed: int = 0) -> Completion:
    """Warmup + unrolled repetend + cooldown for ``m`` micro-batches (start ticks per instance).

    Raises:
        RuntimeError: CP-SAT found no warmup/cooldown within the time limit (not expected: the
            unrolled steady state itself is a feasible completion, so this signals a bug).
    """
    K = len(pl.blocks)
    P = rep.period
    s, o = rep.starts, rep.offsets
    O = max(o, default=0)
    n = pl.num_devices
    on_dev = [[b for b in range(K) if d in pl.blocks[b].devices] for d in range(n)]
    total = sum(sc.durations)
    steady = [sc.static[d] - sum(sc.memory[b] * o[b] for b in on_dev[d]) for d in range(n)]

    if m <= O:  # no complete copy: schedule everything directly
        insts = [(mb, b) for mb in range(m) for b in range(K)]
        status, st, mk = _solve(pl, sc, insts, release={}, device_ready=[0] * n, initial=list(sc.static), cap=memory_cap,
                                anchor=None, horizon=total * m + 1, time_limit=time_limit, seed=seed)
        if not st:
            raise RuntimeError(f"no schedule for {m} micro-batches found within {time_limit:.1f} s ({status})")
        return Completion(st, mk, 0, status)

    # ---- warmup: copies 0..O-1
    warm = [(j - o[b], b) for j in range(O) for b in range(K) if j - o[b] >= 0]
    wset = set(warm)
    first = [min((s[b] for b in on_dev[d]), default=0) for d in range(n)]
    anchor: dict[Inst, list[int]] = {}
    for inst in warm:
        mb, b = inst
        cs = [first[d] for d in pl.blocks[b].devices]
        for c_idx, c in enumerate(pl.blocks):
            if b in c.deps and (mb, c_idx) not in wset:
                j = mb + o[c_idx]  # copy of the dependent block, >= O
                cs.append((j - O) * P + s[c_idx] - sc.lags.get((b, c_idx), 0))
        anchor[inst] = cs
    status_w, wst, t0 = _solve(pl, sc, warm, release={}, device_ready=[0] * n, initial=list(sc.static), cap=memory_cap,
                               anchor=anchor, horizon=total * (O + 1) + P * (O + 1), time_limit=time_limit / 2, seed=seed)
    if warm and not wst:
        raise RuntimeError(f"no warmup found within {time_limit / 2:.1f} s ({status_w})")

    starts: dict[Inst, int] = dict(wst)
    for j in range(O, m):
        for b in range(K):
            starts[(j - o[b], b)] = t0 + (j - O) * P + s[b]

    # ---- cooldown: copies m..m-1+O, relative to the start R of the last complete copy (m-1)
    R = t0 + (m - 1 - O) * P
    cool = [(j - o[b], b) for j in range(m, m + O) for b in range(K) if 0 <= j - o[b] < m]
    cset = set(cool)
    ready = [max((s[b] + sc.durations[b] for b in on_dev[d]), default=0) for d in range(n)]
    release: dict[Inst, int] = {}
    for inst in cool:
        mb, b = inst
        r = 0
        for a in pl.blocks[b].deps:
            if (mb, a) not in cset:  # already placed: in the warmup or a complete copy
                r = max(r, starts[(mb, a)] + sc.durations[a] + sc.lags.get((a, b), 0) - R)
        release[inst] = r
    status_c, cst, mk = _solve(pl, sc, cool, release=release, device_ready=ready, initial=steady, cap=memory_cap,
                               anchor=None, horizon=P + total * (O + 1), time_limit=time_limit / 2, seed=seed)
    if cool and not cst:
        raise RuntimeError(f"no cooldown found within {time_limit / 2:.1f} s ({status_c})")
    for inst, t in cst.items():
        starts[inst] = R + t
    status = "optimal" if status_w in ("optimal",) and status_c in ("optimal",) else "feasible"
    if not warm:
        status = status_c
    return Completion(starts, t0, mk, status)


def to_schedule(pl: Placement, comp: Completion, m: int, name: str = "tessel", meta: dict | None = None) -> Schedule:
    """Per-device orders sorted by start tick (ties: micro-batch, then chain position)."""
    orders: list[list[tuple[int, int, int, Block]]] = [[] for _ in range(pl.num_devices)]
    for (mb, b), t in comp.starts.items():
        spec = pl.blocks[b]
        blk = Block(spec.segment, spec.kind, mb)
        for d in spec.devices:
            orders[d].append((t, mb, b, blk))
    return Schedule(pl, m, [[x[3] for x in sorted(o)] for o in orders], name, dict(meta or {}))
