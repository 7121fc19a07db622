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
from engine.schedule import Block, Schedule, validate

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
    return _ListScheduler(placement, m, policy, memory_limit).run()


class _ListScheduler:
    """One run of the event-driven list scheduler (see the module docstring) under the ``gpipe``
    or ``1f1b`` policy. At each event time ``t``: finished blocks release their devices and their
    dependents (:meth:`_complete`), then ready blocks start in priority order where the policy
    admits them and their devices are free (:meth:`_start_ready`), then time advances to the next
    completion (:meth:`run`)."""

    def __init__(self, placement: Placement, m: int, policy: str, memory_limit) -> None:
        pl = self.pl = placement
        self.m, self.policy = m, policy
        n = self.n = pl.num_devices
        nb = self.nb = len(pl.blocks)
        self.pos = _chain_positions(pl)
        self.is_bwd = [b.kind in _BACKWARD_KINDS for b in pl.blocks]
        self.devs = [b.devices for b in pl.blocks]
        self.dur = [b.duration for b in pl.blocks]
        self.dependents: list[list[int]] = [[] for _ in range(nb)]
        for i, b in enumerate(pl.blocks):
            for dep in b.deps:
                self.dependents[dep].append(i)
        n_deps = [len(b.deps) for b in pl.blocks]
        blocks_on = [pl.blocks_on(d) for d in range(n)]

        # policy state
        self.one_f_one_b = policy == "1f1b"
        self.fwd_left = [m * sum(1 for i in blocks_on[d] if not self.is_bwd[i]) for d in range(n)]  # GPipe's drain gate
        self.caps = in_flight_caps(pl) if self.one_f_one_b else [None] * n
        self.per_mb_on = [len(blocks_on[d]) for d in range(n)]
        self.left_on: list[dict[int, int]] = [dict() for _ in range(n)]  # device -> mb -> blocks not finished
        self.in_flight = [0] * n
        self.limits = _limits(memory_limit, n) if self.one_f_one_b else None
        self.mem_reserved = [0] * n  # worst-case memory of the micro-batches in flight (memory_limit)
        self.held_by: list[tuple[int, int] | None] = [None] * n  # device held for a waiting multi-device block
        self.footprint, self.kept = self._footprints(blocks_on)

        # event state
        self.remaining = [[n_deps[i]] * m for i in range(nb)]
        self.ready: list[tuple] = sorted((self.prio(i, mb), i, mb) for mb in range(m) for i in range(nb)
                                         if n_deps[i] == 0)  # sorted list of (prio, i, mb)
        self.free_at = [0.0] * n
        self.running: list[tuple[float, int, int, int]] = []  # (end, seq, i, mb)
        self.started: list[tuple[float, int, int, int]] = []  # (start, seq, i, mb)
        self.seq = 0
        self.override = False  # admit one forward over its device's cap (stall breaker)
        self.overrides = 0
        self.finished = 0

    def _footprints(self, blocks_on: list[list[int]]) -> tuple[list[int], list[int]]:
        """Per device, with a memory limit: the worst case one micro-batch can hold there (all of
        its allocations) and what a finished micro-batch leaves allocated (non-zero only if its
        frees do not balance its allocations, e.g. a forward-only placement with memory).

        Raises:
            ScheduleError: one micro-batch does not fit a device's limit (rule ``"memory"``).
        """
        pl, n = self.pl, self.n
        footprint = [0] * n
        kept = [0] * n
        if self.limits is None:
            return footprint, kept
        for d in range(n):
            footprint[d] = sum(pl.blocks[i].memory for i in blocks_on[d] if pl.blocks[i].memory > 0)
            kept[d] = max(0, sum(pl.blocks[i].memory for i in blocks_on[d]))
            if pl.reserved_bytes(d) + footprint[d] > self.limits[d]:
                raise ScheduleError(
                    "memory",
                    f"1f1b cannot fit one micro-batch on device {d}: static and gradient memory "
                    f"{pl.reserved_bytes(d)} + "
                    f"{footprint[d]} activation exceeds the memory limit {self.limits[d]:g}", d,
                )
        return footprint, kept

    def prio(self, i: int, mb: int) -> tuple:
        """Start priority of block ``i`` of micro-batch ``mb`` (smaller first): 1F1B puts backward
        kinds first, GPipe forwards; then the micro-batch, then the chain position."""
        if self.one_f_one_b:
            return (0 if self.is_bwd[i] else 1, mb, self.pos[i])
        return (1 if self.is_bwd[i] else 0, mb, self.pos[i])

    def run(self) -> tuple[list[list[Block]], dict]:
        """Schedule every block instance; ``(orders, meta)``.

        Raises:
            ScheduleError: nothing can start under the memory limit (rule ``"memory"``).
        """
        t = 0.0
        total = self.nb * self.m
        while self.finished < total:
            self._complete(t)
            self._start_ready(t)
            if self.running:
                nxt = self.running[0][0]
                if nxt > t:
                    t = nxt
            elif self.finished < total:
                if self.one_f_one_b and not self.override and self.ready:
                    # every device waits for a micro-batch that another device's cap keeps out: admit
                    # the first waiting forward over its cap rather than deadlock (a safety net for
                    # multi-chain placements; never needed on the built-in shapes or in fuzzing)
                    self.override = True
                    continue
                stuck = ", ".join(str(Block(self.pl.blocks[i].segment, self.pl.blocks[i].kind, mb))
                                  for _, i, mb in self.ready[:4])
                raise ScheduleError(
                    "memory",
                    f"{self.policy} stalls under the memory limit: nothing can start at time {t:g} "
                    f"(ready: {stuck or 'none'}); raise memory_limit",
                )
        return self._result()

    def _complete(self, t: float) -> None:
        """Finish every block ending at or before ``t``: update the policies' counters and make
        the dependents whose dependencies have all finished ready."""
        newly = []
        while self.running and self.running[0][0] <= t:
            _, _, i, mb = heapq.heappop(self.running)
            self.finished += 1
            for d in self.devs[i]:
                if not self.is_bwd[i]:
                    self.fwd_left[d] -= 1
                if self.one_f_one_b:
                    left = self.left_on[d][mb] - 1
                    self.left_on[d][mb] = left
                    if left == 0:
                        self.in_flight[d] -= 1
                        self.mem_reserved[d] -= self.footprint[d] - self.kept[d]
            for j in self.dependents[i]:
                self.remaining[j][mb] -= 1
                if self.remaining[j][mb] == 0:
                    newly.append((self.prio(j, mb), j, mb))
        if newly:
            self.ready.extend(newly)
            self.ready.sort()

    def _admits(self, i: int, mb: int) -> bool:
        """The policy's gate: GPipe starts a backward only after every forward of its devices;
        1F1B starts a NEW micro-batch's forward on a device only under its in-flight cap (unless the
        stall breaker is on) and its memory limit."""
        if not self.one_f_one_b and self.is_bwd[i]:
            return all(self.fwd_left[d] == 0 for d in self.devs[i])
        if self.one_f_one_b and not self.is_bwd[i]:
            for d in self.devs[i]:
                if mb not in self.left_on[d]:  # a NEW micro-batch on d
                    cap = self.caps[d]
                    if cap is not None and self.in_flight[d] >= cap and not self.override:
                        return False
                    if (self.limits is not None
                            and self.pl.reserved_bytes(d) + self.mem_reserved[d] + self.footprint[d] > self.limits[d]):
                        return False
        return True

    def _start_ready(self, t: float) -> None:
        """Start, in priority order, every ready block the policy admits whose devices are all free
        and not held for another block; a multi-device block that finds a device busy holds its devices."""
        keep = []
        for item in self.ready:
            _, i, mb = item
            key = (i, mb)
            if any(self.held_by[d] is not None and self.held_by[d] != key for d in self.devs[i]):
                keep.append(item)  # a device is held for a waiting multi-device block
                continue
            if not self._admits(i, mb):
                keep.append(item)
                continue
            if any(self.free_at[d] > t for d in self.devs[i]):
                if len(self.devs[i]) > 1:
                    # hold its free devices so it is not starved by the staggered pipeline
                    for d in self.devs[i]:
                        self.held_by[d] = key
                keep.append(item)
                continue
            self._start(i, mb, t)
        self.ready = keep

    def _start(self, i: int, mb: int, t: float) -> None:
        for d in self.devs[i]:
            self.held_by[d] = None
            self.free_at[d] = t + self.dur[i]
            if self.one_f_one_b and mb not in self.left_on[d]:
                self.left_on[d][mb] = self.per_mb_on[d]
                self.in_flight[d] += 1
                self.mem_reserved[d] += self.footprint[d]
        if self.override and not self.is_bwd[i]:
            self.override = False
            self.overrides += 1
        heapq.heappush(self.running, (t + self.dur[i], self.seq, i, mb))
        self.started.append((t, self.seq, i, mb))
        self.seq += 1

    def _result(self) -> tuple[list[list[Block]], dict]:
        """Each device's blocks in start order (ties: the order they started), and the meta."""
        pl = self.pl
        orders: list[list[Block]] = [[] for _ in range(self.n)]
        makespan = 0.0
        for start, _, i, mb in sorted(self.started):
            b = pl.blocks[i]
            for d in b.devices:
                orders[d].append(Block(b.segment, b.kind, mb))
            makespan = max(makespan, start + self.dur[i])
        meta = {"policy": self.policy, "placement": pl.name, "makespan": makespan,
                "greedy": "event-driven list scheduling"}
        if self.one_f_one_b:
            meta["in_flight_caps"] = self.caps
            meta["cap_overrides"] = self.overrides
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
    validate(s, memory_limit)
    return s
