"""Seed repetends from a list-scheduling policy's steady state.

The 1F1B policy of :mod:`engine.baselines.generic` (memory-aware) settles into a periodic
steady state on most placements, often one whose window holds several micro-batches (e.g. two
micro-batches every 17 units). Read off as a repetend, that steady state is a feasible starting
point (a CP-SAT hint and an upper bound) for the search at its window size, so the search never
settles for a period the policy already beats.
"""

from __future__ import annotations

import math

from engine.baselines.generic import one_f_one_b_any
from engine.dependency import lower
from engine.errors import TesselError
from engine.placement import Placement
from engine.simulate import simulate
from engine.tessel.repetend import Repetend


def policy_starts(placement: Placement, memory_limit=None, *, probe_micro_batches: int = 48,
                  comm=None) -> dict[tuple[int, int], float] | None:
    """Start times ``(micro-batch, block index) -> seconds`` of the memory-aware 1F1B policy's
    schedule of ``probe_micro_batches`` micro-batches, simulated (with ``comm``'s transfers, or
    free); ``None`` when the policy cannot run under the limit."""
    try:
        sched = one_f_one_b_any(placement, probe_micro_batches, memory_limit=memory_limit)
    except TesselError:
        return None
    tl = simulate(lower(sched), comm)
    index = {b.key: i for i, b in enumerate(placement.blocks)}
    start: dict[tuple[int, int], float] = {}
    for e in tl.events:
        if e.stream == "compute" and e.op in ("F", "B", "I", "W"):
            start[(e.micro_batch, index[(e.op, e.segment)])] = e.start
    return start


def policy_repetends(placement: Placement, resolution: float, memory_limit=None, *, max_window: int = 3,
                     probe_micro_batches: int = 48, comm=None,
                     starts: dict[tuple[int, int], float] | None = None) -> dict[int, Repetend]:
    """Steady-state windows of the memory-aware 1F1B policy, by micro-batches per window.

    Returns ``{r: repetend over expand(placement, r)}`` for every ``r <= max_window`` at which
    the policy's schedule is exactly periodic around its middle micro-batch; empty when it is not
    (or the policy cannot run under the limit). Times are rounded to ticks of ``resolution``.
    ``comm``: the cost model the policy's schedule is simulated with (its transfers); ``None``: free.
    ``starts``: :func:`policy_starts`'s result, when already computed.
    """
    m = probe_micro_batches
    start = starts if starts is not None else policy_starts(placement, memory_limit, probe_micro_batches=m, comm=comm)
    if start is None:
        return {}
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
        starts_, offsets = [], []
        for k in range(r):
            for b in range(K):
                rel = int(round((start[(mid + k, b)] - t0) / resolution))
                off = math.floor(rel / w_ticks)
                starts_.append(rel - off * w_ticks)
                offsets.append(off)
        low = min(offsets)
        out[r] = Repetend(w_ticks, starts_, [o - low for o in offsets], resolution, micro_batches=r)
    return out


def policy_rate_repetend(placement: Placement, resolution: float, starts: dict[tuple[int, int], float],
                         probe_micro_batches: int) -> Repetend | None:
    """A one-micro-batch repetend read off the policy's schedule where it is NOT exactly periodic
    (on 16-32 devices the 1F1B policy's steady state drifts): the window is its average rate around
    the middle micro-batch, rounded up to ticks, and each block keeps its time after the middle
    micro-batch's first block, folded into that window. Usually a few ticks from feasible: a
    CP-SAT hint (on NN, 16 devices, limit 45: a 13-unit repetend in 1.7 s, where the unhinted
    search stops at 15), not a solution; ``None`` where the probe is too short to tell a rate."""
    m = probe_micro_batches
    roots = [i for i, b in enumerate(placement.blocks) if not b.deps]
    root = roots[0]
    mid = m // 2
    k = max(1, m // 4)
    if mid - k < 0 or (mid + k, root) not in starts:
        return None
    rate = (starts[(mid + k, root)] - starts[(mid - k, root)]) / (2 * k)
    if rate <= 0:
        return None
    P = max(1, math.ceil(rate / resolution - 1e-9))
    t0 = starts[(mid, root)]
    starts_, offsets = [], []
    for b in range(len(placement.blocks)):
        u = int(round((starts[(mid, b)] - t0) / resolution))
        o = math.floor(u / P)
        starts_.append(u - o * P)
        offsets.append(o)
    low = min(offsets)
    return Repetend(P, starts_, [o - low for o in offsets], resolution)
