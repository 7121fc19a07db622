"""Sink deferral: pick, among repetends of one period, the one whose completion is shortest.

A *sink* is a block no other block depends on (a weight-gradient ``W``, or the last backward
of a chain). Running a sink ``k`` windows later (its offset ``o_b`` raised by ``k``, its start in
the window unchanged) keeps every dependency of the repetend satisfied and its period
unchanged; it only holds the sink's memory ``k`` windows longer. In the unrolled schedule it
moves ``k`` instances of the sink out of the warmup (where they delay the devices that are
still filling the pipeline) into the cooldown (where those devices would otherwise idle):
with ``W`` blocks this is exactly how ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024, section 3) reaches the makespan bound of the V shape with 1F1B's memory.

:func:`defer_sinks` is a local search over the sinks' extra offsets: each move defers one sink
by one more window; a move is kept when the schedule's makespan (as-soon-as-possible execution
of the unrolled repetend's per-device orders, :func:`unrolled_makespan`) does not grow and the
per-device peak memory stays within the limit; it stops after a few passes without a strict
improvement, then undoes every deferral that does not pay for itself (less memory, same
makespan). Moves are judged on at most ``r * max(16, 4 * in-flight windows)`` micro-batches
(warmup, steady copies, cooldown); the result is kept only if it is also shorter for all ``m``.
Memory is exact: on one device the blocks run one after another in the schedule's order, so its
peak is the highest prefix sum of its memory deltas (allocation at a block's start, release at
its end), whatever the timing.
"""

from __future__ import annotations

import time

from engine.placement import Placement
from engine.tessel.repetend import Repetend


def _instances(rep: Repetend, m: int, r: int, K: int, K0: int) -> list[tuple[int, int, int, int]]:
    """``(unrolled start tick, micro-batch, expanded block, original block)`` for every instance kept."""
    P, s, o = rep.period, rep.starts, rep.offsets
    m_w = -(-m // r)
    out = []
    for b in range(K):
        k, b0 = divmod(b, K0)
        for mb_x in range(m_w):
            mb = mb_x * r + k
            if mb < m:
                out.append(((mb_x + o[b]) * P + s[b], mb, b, b0))
    out.sort()
    return out


def unrolled_makespan(pl: Placement, rep: Repetend, m: int, r: int = 1,
                      static: list[float] | None = None,
                      lags: dict[tuple[int, int], float] | None = None) -> tuple[float, list[float]]:
    """Makespan and per-device peak memory of the unrolled repetend executed as soon as possible.

    ``pl`` is the placement the repetend is over (expanded ``r`` times, see
    :func:`engine.tessel.repetend.expand`); ``m`` micro-batches of the original placement.
    Each device runs its blocks in the order of their unrolled start ticks (as
    :func:`engine.tessel.completion.to_schedule` orders them) and a block starts once its
    devices are free and its dependencies have finished, plus their ``lags`` (seconds per
    dependency of ``pl``'s blocks, :func:`engine.tessel.comm.transfer_lags`; none: communication
    is free, as in the simulator without a cost model). Durations in the placement's unit
    (seconds); memory in its unit, ``static`` per device (default: :meth:`Placement.reserved_bytes`).

    Returns:
        ``(makespan, peaks)``.
    """
    K = len(pl.blocks)
    K0 = K // r
    n = pl.num_devices
    free = [0.0] * n
    level = [float(pl.reserved_bytes(d)) if static is None else float(static[d]) for d in range(n)]
    peak = list(level)
    end: dict[tuple[int, int], float] = {}
    blocks = pl.blocks
    span = 0.0
    # the unrolled start ticks order every device and respect every dependency (a dependent
    # starts strictly later), so one pass in that order is a topological order
    lags = lags or {}
    for _, mb, b, _b0 in _instances(rep, m, r, K, K0):
        spec = blocks[b]
        t = max(free[d] for d in spec.devices)
        for a in spec.deps:
            e = end[(mb, a)] + lags.get((a, b), 0.0)
            if e > t:
                t = e
        e = t + spec.duration
        end[(mb, b)] = e
        for d in spec.devices:
            free[d] = e
            if spec.memory > 0:
                level[d] += spec.memory
                if level[d] > peak[d]:
                    peak[d] = level[d]
            else:
                level[d] += spec.memory
        if e > span:
            span = e
    return span, peak


def sinks(pl: Placement) -> list[int]:
    """Blocks no other block depends on, latest device first (the ones deferred first)."""
    used = {a for b in pl.blocks for a in b.deps}
    out = [i for i in range(len(pl.blocks)) if i not in used]
    return sorted(out, key=lambda i: (-max(pl.blocks[i].devices), i))


def defer_sinks(pl: Placement, rep: Repetend, m: int, caps: list[float] | None, *, r: int = 1,
                max_passes: int = 64, stale_passes: int = 3, deadline: float | None = None,
                lags: dict[tuple[int, int], float] | None = None) -> tuple[Repetend, float]:
    """Raise sink offsets while the unrolled makespan does not grow and memory fits (see module doc).

    Args:
        pl: the placement the repetend is over (expanded ``r`` times).
        rep: the repetend; not modified.
        m: micro-batches of the original placement.
        caps: per-device memory limit (static memory included), or ``None`` (then the
            repetend's own steady-state peak per device is kept as the limit, so deferral
            never raises memory above what the search already needs).
        r: micro-batches per window.
        max_passes, stale_passes: at most ``max_passes`` passes over the sinks, stopping after
            ``stale_passes`` passes in a row without a strict improvement.
        deadline: ``time.perf_counter()`` value after which the search stops.
        lags: seconds per dependency of ``pl``'s blocks (transfers), as :func:`unrolled_makespan` takes them.

    Returns:
        ``(repetend, makespan)``: the best repetend found (``rep`` itself when nothing helps) and
        its :func:`unrolled_makespan` for ``m`` micro-batches.
    """
    full_span, full_peak = unrolled_makespan(pl, rep, m, r, lags=lags)
    limit = list(caps) if caps is not None else list(full_peak)
    # moves only change the warmup and the cooldown: judge them on a run long enough to hold
    # both with steady copies between (deferred sinks lengthen both by at most the deferral)
    m_eval = min(m, r * max(16, 4 * (max(rep.offsets, default=0) + 1)))
    base_span = full_span if m_eval == m else unrolled_makespan(pl, rep, m_eval, r, lags=lags)[0]
    tol = 1e-9 * max(1.0, base_span)
    offs = list(rep.offsets)
    best = base_span
    cand = sinks(pl)

    def trial(o: list[int], mm: int = m_eval) -> tuple[float, bool]:
        span, peak = unrolled_makespan(pl, Repetend(rep.period, rep.starts, o, rep.resolution, micro_batches=r), mm, r,
                                       lags=lags)
        return span, all(p <= c + 1e-9 * max(1.0, abs(c)) for p, c in zip(peak, limit))

    def out_of_time() -> bool:
        return deadline is not None and time.perf_counter() >= deadline

    stale = 0
    for _ in range(max_passes):
        if stale >= stale_passes or out_of_time():
            break
        moved = improved = False
        for b in cand:
            t = list(offs)
            t[b] += 1
            span, ok = trial(t)
            if ok and span <= best + tol:
                improved |= span < best - tol
                offs, best, moved = t, min(best, span), True
            if out_of_time():
                break
        if not moved:
            break
        stale = 0 if improved else stale + 1
    # undo deferrals that do not pay for themselves (memory back, makespan unchanged)
    changed = True
    while changed and not out_of_time():
        changed = False
        for b in reversed(cand):
            if offs[b] > rep.offsets[b]:
                t = list(offs)
                t[b] -= 1
                span, ok = trial(t)
                if ok and span <= best + tol:
                    offs, best, changed = t, min(best, span), True
    if offs == list(rep.offsets) or best >= base_span - tol:
        return rep, full_span
    span, ok = (best, True) if m_eval == m else trial(offs, m)
    if not ok or span >= full_span - tol:  # judged on the shorter run only: keep what is sure
        return rep, full_span
    return Repetend(rep.period, list(rep.starts), offs, rep.resolution, list(rep.peak), r), span
