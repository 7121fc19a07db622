"""GPipe and 1F1B *policies* for ANY placement (X, M, NN, K, custom), by greedy list scheduling.

The predefined schedules of :mod:`engine.baselines` are fixed per-rank orders written for the
plain and interleaved pipelines. To compare Tessel against GPipe and 1F1B on Tessel's other
shapes, this module applies the two policies to an arbitrary placement with an event-driven
list scheduler:

* time advances from event to event (block ends), using the placement's block durations
  (communication is free, as in Tessel's search);
* at each event time every block instance whose dependencies have finished and whose devices
  are ALL free is a candidate (a multi-device block starts only when all of its devices are
  free); candidates start greedily in the policy's priority order (non-delay scheduling);
* a multi-device block that the policy admits but that finds some of its devices busy *holds*
  all of them: nothing else starts on a held device until the block starts (otherwise the
  staggered single-device blocks of a pipeline keep an all-device block, e.g. M's embedding,
  waiting until the pipeline has drained). A block never holds a device another block holds.
  Placements without multi-device blocks (V, X, interleaved) are unaffected;
* the result is a :class:`~engine.schedule.Schedule`: each device's blocks sorted by the start
  times found; blocks starting at the same time (only possible after zero-duration blocks)
  keep the order in which the scheduler started them, i.e. priority order (micro-batch, then
  chain position). With free communication, simulating the lowered schedule reproduces the
  start times found here (``meta["makespan"]``).

"Chain position" is a block's rank in the topological order of the placement's dependency
graph that prefers lower indices in :attr:`Placement.blocks`.

Sources: GPipe, Huang et al., NeurIPS 2019 (fill-drain); 1F1B, PipeDream-Flush (Narayanan et
al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021) as used by Megatron-LM
(Narayanan et al., SC'21, section 2.2.1); placements from Tessel (HPCA 2024).
"""

from __future__ import annotations

import heapq
from typing import Sequence

import networkx as nx

from engine.baselines.common import check_micro_batches, finish_schedule
from engine.errors import ScheduleError
from engine.placement import Placement
from engine.schedule import Block, Schedule

__all__ = ["gpipe_any", "one_f_one_b_any", "in_flight_caps"]

_BACKWARD_KINDS = ("B", "I", "W")


def _chain_positions(placement: Placement) -> list[int]:
    g = placement.dependency_graph()
    order = list(nx.lexicographical_topological_sort(g, key=lambda i: i))
    pos = [0] * len(placement.blocks)
    for p, i in enumerate(order):
        pos[i] = p
    return pos


def in_flight_caps(placement: Placement) -> list[int | None]:
    """1F1B's per-device cap on micro-batches in flight (see :func:`one_f_one_b_any`).

    ``cap[d]`` = the number of forward blocks on the longest forward path that starts at one of
    ``d``'s forward blocks and ends at the end of the forward chain (counting both ends), taking
    the largest over ``d``'s forward blocks ("from ``d``'s first forward block to the end of the
    forward chain"). For the V shape this is ``n - d``: 1F1B's ``n - d - 1`` warm-up forwards
    plus one. ``None`` for a device without forward blocks (no cap).
    """
    pl = placement
    fwd = [i for i, b in enumerate(pl.blocks) if b.kind == "F"]
    g = pl.dependency_graph().subgraph(fwd)
    longest: dict[int, int] = {}
    for i in reversed(list(nx.topological_sort(g))):
        longest[i] = 1 + max((longest[j] for j in g.successors(i)), default=0)
    caps: list[int | None] = []
    for d in range(pl.num_devices):
        here = [longest[i] for i in fwd if d in pl.blocks[i].devices]
        caps.append(max(here) if here else None)
    return caps


def _limits(memory_limit, n: int) -> list[float] | None:
    if memory_limit is None:
        return None
    if isinstance(memory_limit, (int, float)):
        return [float(memory_limit)] * n
    lim = [float(x) for x in memory_limit]
    if len(lim) != n:
        raise ScheduleError("memory", f"memory_limit has {len(lim)} values but the placement has {n} devices")
    return lim


def _list_schedule(placement: Placement, m: int, policy: str, memory_limit=None) -> tuple[list[list[Block]], dict]:
    """The event-driven list scheduler shared by both policies; returns (orders, meta)."""
    pl = placement
    n = pl.num_devices
    nb = len(pl.blocks)
    pos = _chain_positions(pl)
    is_bwd = [b.kind in _BACKWARD_KINDS for b in pl.blocks]
    devs = [b.devices for b in pl.blocks]
    dur = [b.duration for b in pl.blocks]
    dependents: list[list[int]] = [[] for _ in range(nb)]
    for i, b in enumerate(pl.blocks):
        for dep in b.deps:
            dependents[dep].append(i)
    n_deps = [len(b.deps) for b in pl.blocks]
    blocks_on = [pl.blocks_on(d) for d in range(n)]

    # policy state
    one_f_one_b = policy == "1f1b"
    fwd_left = [m * sum(1 for i in blocks_on[d] if not is_bwd[i]) for d in range(n)]  # GPipe's drain gate
    caps = in_flight_caps(pl) if one_f_one_b else [None] * n
    per_mb_on = [len(blocks_on[d]) for d in range(n)]
    left_on: list[dict[int, int]] = [dict() for _ in range(n)]  # device -> mb -> blocks not finished
    in_flight = [0] * n
    limits = _limits(memory_limit, n) if one_f_one_b else None
    mem_reserved = [0] * n  # worst-case memory of the micro-batches in flight (memory_limit)
    held_by: list[tuple[int, int] | None] = [None] * n  # device held for a waiting multi-device block
    footprint = [0] * n
    kept = [0] * n
    if limits is not None:
        for d in range(n):
            # worst case one micro-batch can hold on d: all of its allocations there
            footprint[d] = sum(pl.blocks[i].memory for i in blocks_on[d] if pl.blocks[i].memory > 0)
            # what a finished micro-batch leaves allocated (non-zero only if its frees do not
            # balance its allocations on d, e.g. a forward-only placement with memory)
            kept[d] = max(0, sum(pl.blocks[i].memory for i in blocks_on[d]))
            if pl.reserved_bytes(d) + footprint[d] > limits[d]:
                raise ScheduleError(
                    "memory",
                    f"1f1b cannot fit one micro-batch on device {d}: static and gradient memory "
                    f"{pl.reserved_bytes(d)} + "
                    f"{footprint[d]} activation exceeds the memory limit {limits[d]:g}", d,
                )

    if one_f_one_b:
        def prio(i: int, mb: int) -> tuple:
            return (0 if is_bwd[i] else 1, mb, pos[i])
    else:
        def prio(i: int, mb: int) -> tuple:
            return (1 if is_bwd[i] else 0, mb, pos[i])

    remaining = [[n_deps[i]] * m for i in range(nb)]
    ready: list[tuple] = []  # sorted list of (prio, i, mb)
    for mb in range(m):
        for i in range(nb):
            if n_deps[i] == 0:
                ready.append((prio(i, mb), i, mb))
    ready.sort()
    free_at = [0.0] * n
    running: list[tuple[float, int, int, int]] = []  # (end, seq, i, mb)
    started: list[tuple[float, int, int, int]] = []  # (start, seq, i, mb)
    seq = 0
    override = False  # admit one forward over its device's cap (stall breaker)
    overrides = 0
    t = 0.0
    total = nb * m
    finished = 0
    while finished < total:
        # 1. completions at or before t
        newly = []
        while running and running[0][0] <= t:
            _, _, i, mb = heapq.heappop(running)
            finished += 1
            for d in devs[i]:
                if not is_bwd[i]:
                    fwd_left[d] -= 1
                if one_f_one_b:
                    left = left_on[d][mb] - 1
                    left_on[d][mb] = left
                    if left == 0:
                        in_flight[d] -= 1
                        mem_reserved[d] -= footprint[d] - kept[d]
            for j in dependents[i]:
                remaining[j][mb] -= 1
                if remaining[j][mb] == 0:
                    newly.append((prio(j, mb), j, mb))
        if newly:
            ready.extend(newly)
            ready.sort()
        # 2. start candidates in priority order
        keep = []
        for item in ready:
            _, i, mb = item
            key = (i, mb)
            if any(held_by[d] is not None and held_by[d] != key for d in devs[i]):
                keep.append(item)  # a device is held for a waiting multi-device block
                continue
            ok = True
            if not one_f_one_b and is_bwd[i]:
                ok = all(fwd_left[d] == 0 for d in devs[i])
            if one_f_one_b and not is_bwd[i]:
                for d in devs[i]:
                    if mb not in left_on[d]:  # a NEW micro-batch on d
                        if caps[d] is not None and in_flight[d] >= caps[d] and not override:
                            ok = False
                            break
                        if limits is not None and pl.reserved_bytes(d) + mem_reserved[d] + footprint[d] > limits[d]:
                            ok = False
                            break
            if not ok:
                keep.append(item)
                continue
            if any(free_at[d] > t for d in devs[i]):
                if len(devs[i]) > 1:
                    # hold its free devices so it is not starved by the staggered pipeline
                    for d in devs[i]:
                        held_by[d] = key
                keep.append(item)
                continue
            for d in devs[i]:
                held_by[d] = None
                free_at[d] = t + dur[i]
                if one_f_one_b and mb not in left_on[d]:
                    left_on[d][mb] = per_mb_on[d]
                    in_flight[d] += 1
                    mem_reserved[d] += footprint[d]
            if override and not is_bwd[i]:
                override = False
                overrides += 1
            heapq.heappush(running, (t + dur[i], seq, i, mb))
            started.append((t, seq, i, mb))
            seq += 1
        ready = keep
        # 3. next event
        if running:
            nxt = running[0][0]
            if nxt > t:
                t = nxt
        elif finished < total:
            if one_f_one_b and not override and ready:
                # every device waits for a micro-batch that another device's cap keeps out: admit
                # the first waiting forward over its cap rather than deadlock (a safety net for
                # multi-chain placements; never needed on the built-in shapes or in fuzzing)
                override = True
                continue
            stuck = ", ".join(str(Block(pl.blocks[i].segment, pl.blocks[i].kind, mb)) for _, i, mb in ready[:4])
            raise ScheduleError(
                "memory",
                f"{policy} stalls under the memory limit: nothing can start at time {t:g} "
                f"(ready: {stuck or 'none'}); raise memory_limit",
            )
    orders: list[list[Block]] = [[] for _ in range(n)]
    makespan = 0.0
    for start, _, i, mb in sorted(started):
        b = pl.blocks[i]
        for d in b.devices:
            orders[d].append(Block(b.segment, b.kind, mb))
        makespan = max(makespan, start + dur[i])
    meta = {"policy": policy, "placement": pl.name, "makespan": makespan, "greedy": "event-driven list scheduling"}
    if one_f_one_b:
        meta["in_flight_caps"] = caps
        meta["cap_overrides"] = overrides
    return orders, meta


def gpipe_any(placement: Placement, m: int) -> Schedule:
    """GPipe (fill-drain) policy on any placement.

    Priority: forward blocks before backward blocks, then lower micro-batch, then chain
    position. A backward-kind block (``B``/``I``/``W``) may start only when EVERY forward block
    instance (all micro-batches) of each of its devices has finished: all forwards fill the
    pipeline, then all backwards drain it. Peak activation memory on a device is therefore ``m``
    times one micro-batch's forward allocation there. On ``pipeline_placement(n)`` this gives the
    same per-device orders as the predefined :func:`engine.baselines.gpipe`.

    Source: Huang et al., "GPipe", NeurIPS 2019, section 2.2.

    Args:
        placement: any valid placement (training or forward-only); durations in any time unit.
        m: micro-batches (placement instances), at least 1.

    Returns:
        The validated schedule, named ``"gpipe"``; ``meta`` holds ``policy``, ``placement`` and
        the greedy ``makespan`` (placement time units, free communication).

    Raises:
        ScheduleError: ``m < 1`` (rule ``"micro-batches"``).
    """
    check_micro_batches(m, "gpipe")
    orders, meta = _list_schedule(placement, m, "gpipe")
    meta["builder"] = "gpipe_any"
    meta["source"] = "Huang et al. 2019 (GPipe), fill-drain policy"
    return finish_schedule(placement, m, orders, "gpipe", meta)


def one_f_one_b_any(placement: Placement, m: int, memory_limit: float | Sequence[float] | None = None) -> Schedule:
    """1F1B (PipeDream-Flush) policy on any placement.

    Policy:

    * priority: backward-kind blocks (``B``, ``I``, ``W``) before forwards, then lower
      micro-batch, then chain position;
    * a micro-batch is *in flight* on device ``d`` from the start of its first block on ``d``
      until all of its blocks on ``d`` have finished (for training, its last backward block);
    * device ``d`` admits the forward of a NEW micro-batch only while fewer than ``cap[d]``
      micro-batches are in flight on it, with ``cap[d]`` from :func:`in_flight_caps` (the forward
      blocks from ``d``'s first forward block to the end of the forward chain; ``n - d`` for the
      V shape, i.e. 1F1B's warm-up plus one). A multi-device forward must be admitted by all
      its devices. Blocks of micro-batches already in flight are never held back, so the
      schedule always completes;
    * with ``memory_limit`` (bytes or units per device, scalar or list), a device also admits a
      new micro-batch only if static memory + the worst-case footprint of every micro-batch in
      flight + one more stays within the limit (footprint = the sum of one micro-batch's positive
      block memory deltas on that device), so the limit is never exceeded.

    On ``pipeline_placement(n)`` with ``m >= n`` and uniform block durations this reproduces the
    predefined 1F1B's order, makespan and per-device peak memory (``n - d`` micro-batches of
    activation on device ``d``). With uneven durations the greedy is non-delay: a device whose
    next forward has not arrived runs a ready backward instead of waiting, so its steady state
    may drift from strict one-forward-one-backward alternation (same peak memory; the makespan
    can differ from PyTorch's fixed order).

    Sources: Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training" (PipeDream-Flush),
    ICML 2021; Megatron-LM's 1F1B, Narayanan et al., SC'21, section 2.2.1.

    Args:
        placement: any valid placement (training or forward-only).
        m: micro-batches (placement instances), at least 1 (no ``m >= n`` requirement).
        memory_limit: per-device memory limit in the placement's memory unit, or ``None``.

    Returns:
        The validated schedule, named ``"1f1b"``; ``meta`` holds ``policy``, ``placement``,
        ``in_flight_caps`` and the greedy ``makespan``.

    Raises:
        ScheduleError: ``m < 1`` (rule ``"micro-batches"``); a memory limit too small for one
            micro-batch, or a ``memory_limit`` list of the wrong length (rule ``"memory"``).
    """
    check_micro_batches(m, "1f1b")
    orders, meta = _list_schedule(placement, m, "1f1b", memory_limit)
    meta["builder"] = "one_f_one_b_any"
    meta["source"] = "PipeDream-Flush (Narayanan et al., ICML 2021) / Megatron-LM 1F1B (SC'21, 2.2.1)"
    if memory_limit is not None:
        meta["memory_limit"] = memory_limit if isinstance(memory_limit, (int, float)) else list(memory_limit)
    s = Schedule(placement, m, orders, name="1f1b", meta=meta)
    from engine.schedule import validate

    validate(s, memory_limit)
    return s
