"""Seed repetends from a list-scheduling policy's steady state.

The 1F1B policy of :mod:`engine.baselines.generic` (memory-aware) settles into a periodic
steady state on most placements, often one whose window holds several micro-batches (e.g. two
micro-batches every 17 units). Read off as a repetend, that steady state is a feasible starting
point (a CP-SAT hint and an upper bound) for the search at its window size, so the search never
settles for a period the policy already beats.
"""

from __future__ import annotations

import math

from engine.placement import Placement
from engine.tessel.repetend import Repetend


def policy_repetends(placement: Placement, resolution: float, memory_limit=None, *, max_window: int = 3,
                     probe_micro_batches: int = 48, comm=None) -> dict[int, Repetend]:
    """Steady-state windows of the memory-aware 1F1B policy, by micro-batches per window.

    Returns ``{r: repetend over expand(placement, r)}`` for every ``r <= max_window`` at which
    the policy's schedule is exactly periodic around its middle micro-batch; empty when it is not
    (or the policy cannot run under the limit). Times are rounded to ticks of ``resolution``.
    ``comm``: the cost model the policy's schedule is simulated with (its transfers); ``None``: free.
    """
    from engine.baselines.generic import one_f_one_b_any
    from engine.dependency import lower
    from engine.errors import TesselError
    from engine.simulate import simulate

    m = probe_micro_batches
    try:
        sched = one_f_one_b_any(placement, m, memory_limit=memory_limit)
    except TesselError:
        return {}
    tl = simulate(lower(sched), comm)
    index = {b.key: i for i, b in enumerate(placement.blocks)}
    start: dict[tuple[int, int], float] = {}
    for e in tl.events:
        if e.stream == "compute" and e.op in ("F", "B", "I", "W"):
            start[(e.micro_batch, index[(e.op, e.segment)])] = e.start
    K = len(placement.blocks)
    roots = [i for i, b in enumerate(placement.blocks) if not b.deps]
    root = roots[0]
    mid = m // 2
    out: dict[int, Repetend] = {}
    for r in range(1, max_window + 1):
        W = start[(mid + r, root)] - start[(mid, root)]
        if W <= 0:
            continue
        periodic = all(
            abs(start[(mu + r, b)] - start[(mu, b)] - W) < 1e-9 * max(1.0, W)
            for mu in range(mid - 2 * r, mid + 2 * r) for b in range(K)
        )
        if not periodic:
            continue
        t0 = start[(mid, root)]
        w_ticks = int(round(W / resolution))
        starts, offsets = [], []
        for k in range(r):
            for b in range(K):
                rel = int(round((start[(mid + k, b)] - t0) / resolution))
                off = math.floor(rel / w_ticks)
                starts.append(rel - off * w_ticks)
                offsets.append(off)
        low = min(offsets)
        out[r] = Repetend(w_ticks, starts, [o - low for o in offsets], resolution, micro_batches=r)
    return out
