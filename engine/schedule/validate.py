"""Schedule validation and order-based memory accounting.

Rules, checked in this order, the first violation raised as :class:`ScheduleError`:

1. ``micro-batches``/``device``: every block names a placement block and a micro-batch in
   range, and appears only on devices of its placement device set;
2. ``completeness``: every block of every micro-batch appears exactly once on each of its devices;
3. ``dependency``: a block never precedes, on the same device, a block it depends on
   (directly or through blocks on other devices);
4. ``deadlock``: the device orders plus the dependencies have no cycle across devices (the
   send/recv of such a cycle would wait forever); found with Kahn's algorithm;
5. ``memory``: the peak memory of each device stays within the limit.

Dependency direction: :mod:`engine.schedule.schedule` imports this module (``Schedule.validate``
delegates here), never the reverse: the functions here take any :class:`BlockOrders` (a
placement, a micro-batch count and per-device block orders), which a ``Schedule`` is.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import networkx as nx

from engine.errors import ScheduleError
from engine.placement import Placement
from engine.schedule.block import Block


class BlockOrders(Protocol):
    """What validation reads of a schedule (:class:`~engine.schedule.schedule.Schedule` is one):
    the placement, ``m`` micro-batches and every device's block order."""

    placement: Placement
    num_micro_batches: int
    orders: list[list[Block]]

    @property
    def num_devices(self) -> int:
        """Devices of the placement."""


def _fmt_gib(x: float) -> str:
    """Memory for messages: GiB for large byte counts, the plain number otherwise (bytes or units)."""
    return f"{x / 2**30:.2f} GiB" if abs(x) >= 2**26 else f"{x:,.0f}"


def _check_membership(s: BlockOrders) -> None:
    pl, m = s.placement, s.num_micro_batches
    if m < 1:
        raise ScheduleError("micro-batches", f"a schedule needs at least one micro-batch, got {m}")
    if len(s.orders) != pl.num_devices:
        raise ScheduleError("device", f"the schedule has {len(s.orders)} device orders but the placement has "
                                      f"{pl.num_devices} devices")
    seen: dict[tuple[int, Block], int] = {}
    for d, order in enumerate(s.orders):
        for pos, b in enumerate(order):
            if not pl.has(b.kind, b.segment):
                raise ScheduleError("device", f"block {b} on device {d} is not in the placement "
                                              f"(no {b.segment}{b.kind} block)", d, str(b))
            if not 0 <= b.micro_batch < m:
                raise ScheduleError("micro-batches", f"block {b} on device {d} names micro-batch {b.micro_batch}, "
                                                     f"outside 0..{m - 1}", d, str(b))
            devs = pl.spec(b.kind, b.segment).devices
            if d not in devs:
                raise ScheduleError("device", f"block {b} is on device {d} but its placement runs it on device(s) "
                                              f"{list(devs)}", d, str(b))
            if (d, b) in seen:
                raise ScheduleError("completeness", f"block {b} appears twice on device {d} "
                                                    f"(positions {seen[(d, b)]} and {pos})", d, str(b))
            seen[(d, b)] = pos
    for spec in pl.blocks:
        for mb in range(m):
            b = Block(spec.segment, spec.kind, mb)
            for d in spec.devices:
                if (d, b) not in seen:
                    raise ScheduleError("completeness", f"block {b} is missing from device {d}'s order", d, str(b))


def _check_same_device_deps(s: BlockOrders) -> None:
    """Rule 3, over transitive dependencies: ``0B0`` before ``0F0`` on one device is a
    dependency violation even though ``0B0`` depends on ``0F0`` only through other devices.

    One pass per micro-batch over the placement's blocks in topological order: ``last[k]`` maps
    each device to the latest position, in that device's order, of an ancestor of block ``k``
    (or ``k`` itself) that runs on it, the maximum of its dependencies' maps. A block violates
    rule 3 on device ``d`` exactly when an ancestor on ``d`` comes later there, i.e. when its
    dependencies' latest position on ``d`` exceeds its own. Cost: dependency edges x devices
    reached x micro-batches (the per-block ``networkx.ancestors`` of earlier versions was
    quadratic in the blocks: 2,000 blocks took over a minute). Of all violations the one raised
    is the first in device order, then position (the dependency named is the latest one on that
    device), so the result does not depend on the traversal.
    """
    pl = s.placement
    m = s.num_micro_batches
    index = {b.key: i for i, b in enumerate(pl.blocks)}
    # pos[d][k * m + mb]: position of (block k, micro-batch mb) in device d's order (complete: rule 2 passed)
    pos: list[dict[int, int]] = [{index[b.key] * m + b.micro_batch: i for i, b in enumerate(order)}
                                 for order in s.orders]
    topo = list(nx.topological_sort(pl.dependency_graph()))
    first: tuple[int, int, int] | None = None  # (device, position, position of the dependency)
    for mb in range(m):
        last: list[dict[int, int]] = [{} for _ in pl.blocks]
        for k in topo:
            spec = pl.blocks[k]
            inherited: dict[int, int] = {}
            for p in spec.deps:
                for d, j in last[p].items():
                    if inherited.get(d, -1) < j:
                        inherited[d] = j
            mine = dict(inherited)
            for d in spec.devices:
                i = pos[d][k * m + mb]
                j = inherited.get(d, -1)
                if j > i:
                    if first is None or (d, i) < first[:2]:
                        first = (d, i, j)
                else:
                    mine[d] = i
            last[k] = mine
    if first is not None:
        d, i, j = first
        b, db = s.orders[d][i], s.orders[d][j]
        raise ScheduleError("dependency", f"block {b} on device {d} runs before {db}, which it depends on "
                                          f"(position {i} < {j})", d, str(b))


def _check_deadlock(s: BlockOrders) -> None:
    """Kahn's algorithm over blocks: an order edge per device, a dependency edge per dep."""
    pl = s.placement
    ptr = [0] * pl.num_devices
    done: set[Block] = set()
    # a multi-device block starts only when it is at the head of all its devices' orders
    total = sum(len(o) for o in s.orders)
    progressed = True
    executed = 0
    while progressed:
        progressed = False
        for d in range(pl.num_devices):
            while ptr[d] < len(s.orders[d]):
                b = s.orders[d][ptr[d]]
                spec = pl.spec(b.kind, b.segment)
                if any(Block(pl.blocks[k].segment, pl.blocks[k].kind, b.micro_batch) not in done for k in spec.deps):
                    break
                if any(ptr[e] >= len(s.orders[e]) or s.orders[e][ptr[e]] != b for e in spec.devices):
                    break
                for e in spec.devices:
                    ptr[e] += 1
                    executed += 1
                done.add(b)
                progressed = True
    if executed < total:
        waits = []
        for d in range(pl.num_devices):
            if ptr[d] < len(s.orders[d]):
                b = s.orders[d][ptr[d]]
                spec = pl.spec(b.kind, b.segment)
                missing = [str(Block(pl.blocks[k].segment, pl.blocks[k].kind, b.micro_batch)) for k in spec.deps
                           if Block(pl.blocks[k].segment, pl.blocks[k].kind, b.micro_batch) not in done]
                why = (f"waits for {', '.join(missing)}" if missing
                       else "waits for the other devices of this multi-device block")
                waits.append((d, b, why))
        d0, b0, _ = waits[0]
        detail = "; ".join(f"device {d} at {b} {why}" for d, b, why in waits)
        raise ScheduleError("deadlock", f"the device orders deadlock: {detail}", d0, str(b0))


def gradient_events(placement, order: Sequence[Block]) -> list[tuple[int, int]]:
    """Per block of one device's ``order``: ``(hold, transient)`` gradient bytes.

    ``hold``: the segment's gradient buffer (:attr:`~engine.placement.Placement.grad_memory`),
    allocated at the start of the segment's FIRST weight-gradient block (``B`` or ``W``) in the
    order and kept until the optimizer step. ``transient``: bytes live only while the block runs
    (:attr:`~engine.placement.Placement.grad_transient`), on every weight-gradient block except
    the one that allocates a non-empty buffer (its micro-batch gradient becomes the buffer).
    ``(0, 0)`` for ``F``/``I`` blocks.
    """
    held: set[int] = set()
    out = []
    for b in order:
        hold = trans = 0
        if b.kind in ("B", "W"):
            if b.segment not in held:
                held.add(b.segment)
                hold = placement.grad_bytes(b.segment)
            if not hold:
                trans = placement.grad_transient_bytes(b.segment)
        out.append((hold, trans))
    return out


def _levels(s: BlockOrders, d: int) -> list[tuple[int, int]]:
    """Device ``d``: ``(during, after)`` bytes for each block of its order.

    ``during``: the level while the block runs (its allocation, a gradient buffer it allocates
    and its transient gradient included; what it frees is still held); ``after``: once it ends.
    """
    pl = s.placement
    cur = pl.static_bytes(d)
    out = []
    order = s.orders[d]
    for b, (hold, trans) in zip(order, gradient_events(pl, order)):
        mem = pl.spec(b.kind, b.segment).memory
        during = cur + max(mem, 0) + hold + trans
        cur += mem + hold
        out.append((during, cur))
    return out


def memory_profile(s: BlockOrders) -> list[list[int]]:
    """Per device, the memory in bytes after each block of its order (static memory included).

    Memory changes at block granularity: a block's ``memory`` delta (activation allocated by F,
    freed by B/I/W) applies when it runs; a segment's gradient buffer (``grad_memory``, Adam with
    gradient accumulation) is added at its first weight-gradient block and stays to the end of
    the order (the optimizer step). Transient gradients are gone after their block (see
    :func:`peak_memory`). Order-based, so independent of timing.
    """
    return [[after for _, after in _levels(s, d)] for d in range(len(s.orders))]


def peak_memory(s: BlockOrders) -> list[int]:
    """Peak bytes per device: static memory plus the maximum, over the blocks of the order, of
    in-flight activations, gradient buffers held and the running block's transient gradient."""
    return [max([s.placement.static_bytes(d)] + [during for during, _ in _levels(s, d)])
            for d in range(len(s.orders))]


def validate(s: BlockOrders, memory_limit: float | Sequence[float] | None = None) -> None:
    """Check a schedule; raise :class:`ScheduleError` naming the first violated rule.

    Args:
        s: the schedule.
        memory_limit: bytes per device (a scalar applies to every device), or ``None`` for no limit.

    Raises:
        ScheduleError: with ``rule`` in ``micro-batches``, ``device``, ``completeness``,
            ``dependency``, ``deadlock``, ``memory``.
    """
    _check_membership(s)
    _check_same_device_deps(s)
    _check_deadlock(s)
    if memory_limit is not None:
        limits = [memory_limit] * s.num_devices if isinstance(memory_limit, (int, float)) else list(memory_limit)
        for d, (peak, lim) in enumerate(zip(peak_memory(s), limits)):
            if peak > lim:
                raise ScheduleError("memory", f"device {d} peaks at {_fmt_gib(peak)}, above its memory limit of "
                                              f"{_fmt_gib(lim)}", d)
