"""Transfers between devices as the search sees them: dependency lags, and the search's own makespan.

Tessel's search places blocks; a dependency between blocks on different devices also carries a
tensor (a forward's activation, a backward's input gradient), whose transfer the simulator times
from the plan's cost model. :func:`transfer_lags` gives each such dependency the seconds that
transfer takes, computed exactly as :func:`engine.dependency.lower` emits the sends and
:func:`engine.simulate.simulate` times them, so the repetend and completion solvers place every
consumer at least that long after its producer (``tessel_search(comm=cost)``).

:func:`asap_makespan` is the search's own view of a finished schedule: each device runs its
blocks in the schedule's order as soon as its inputs have arrived (durations and lags in solver
ticks). With the lags of :func:`transfer_lags` it equals the simulated makespan up to the tick's
rounding, unless one device's sends queue behind each other (the simulator serialises a rank's
sends on one stream; a lag assumes its producer's sends start at once).

Source: SuperScaler (Lin et al., 2023), section 3 (data-dependency preserving: the send/recv pairs
inserted between placed blocks); Tessel (HPCA 2024), section IV (the repetend's dependencies).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from engine.dependency import COMPUTE_OPS, Op
from engine.placement import Placement

if TYPE_CHECKING:
    from engine.dependency import ExecutionPlan
    from engine.simulate import CommCost

__all__ = ["transfer_lags", "asap_makespan", "step_tail"]

#: ``(nbytes, src, dst) -> seconds``: a point-to-point transfer's time (``CostModel.p2p_time``).
P2P = Callable[[int, int, int], float]


def transfer_lags(placement: Placement, p2p: P2P) -> dict[tuple[int, int], float]:
    """Seconds from a producer's end until a consumer on other devices has its input, per dependency.

    The rules are :func:`engine.dependency.lower`'s and :func:`engine.simulate.simulate`'s: a
    producer block sends its output (``BlockSpec.output``, ``nbytes``) from the first device of its
    set to every device of a consumer's set that is not in its own, once per destination, the
    destinations in ascending order, one after another on its send stream, each taking
    ``p2p(nbytes, src, dst)`` seconds; a consumer on several devices starts once the last of its
    devices has received. So the lag of ``a -> b`` is the arrival time (relative to ``a``'s end) of
    the latest destination in ``b``'s devices, or 0.0 when ``b`` runs where ``a`` did (or nothing is
    sent: an abstract placement without tensors). It assumes ``a``'s sends start at ``a``'s end: a
    device whose earlier sends are still going delays them in the simulator (never the other way),
    so every lag is a lower bound of the simulated delay.

    Args:
        placement: the blocks of one micro-batch (block indices as in ``placement.blocks``).
        p2p: ``(nbytes, src, dst) -> seconds`` (e.g. ``CostModel.p2p_time``).

    Returns:
        ``{(producer index, consumer index): seconds}`` for every dependency with a positive lag.

    Raises:
        CostModelError: what ``p2p`` raises (e.g. a negative byte count).
    """
    blocks = placement.blocks
    dests: dict[int, list[int]] = {}
    for c in blocks:
        for a in c.deps:
            p = blocks[a]
            dests.setdefault(a, [])
            dests[a].extend(d for d in c.devices if d not in p.devices)
    lags: dict[tuple[int, int], float] = {}
    for a, ds in dests.items():
        p = blocks[a]
        nbytes = p.output.nbytes if p.output is not None else 0
        if not ds or nbytes <= 0:
            continue
        src = p.devices[0]
        arrival: dict[int, float] = {}
        t = 0.0
        for d in sorted(set(ds)):
            t += p2p(nbytes, src, d)
            arrival[d] = t
        for ci, c in enumerate(blocks):
            if a in c.deps:
                lag = max((arrival[d] for d in c.devices if d in arrival), default=0.0)
                if lag > 0:
                    lags[(a, ci)] = lag
    return lags


def step_tail(execution: "ExecutionPlan", cost: "CommCost") -> list[float]:
    """Seconds each rank works after its last compute block: its tied-weight all-reduces and its
    optimizer step (the instructions :func:`engine.dependency.lower` appends to a training stream),
    timed with ``cost`` as :func:`engine.simulate.simulate` times them.

    A tied all-reduce is a barrier across its holders, so a rank that finishes its blocks early
    waits for the others; the tail leaves that wait out (a lower bound of the rank's real tail).
    Data-parallel all-reduces (``dp > 1``) overlap the backward and are not counted.

    Returns:
        Per rank, seconds (0.0 for an inference stream).
    """
    out = []
    for stream in execution.streams:
        last = max((i for i, ins in enumerate(stream) if ins.op in COMPUTE_OPS), default=-1)
        t = 0.0
        for ins in stream[last + 1:]:
            if ins.op == Op.ALLREDUCE and ins.ranks:
                t += cost.collective_time("allreduce", ins.nbytes, list(ins.ranks))
            elif ins.op == Op.OPTIM:
                t += cost.optimizer_time(ins.nbytes)
        out.append(t)
    return out


def asap_makespan(placement: Placement, orders: Sequence[Sequence[tuple[int, int]]], durations: Sequence[int],
                  lags: dict[tuple[int, int], int] | None = None, tail: Sequence[int] | None = None) -> int:
    """Ticks until the last block ends when every device runs ``orders`` as soon as possible.

    Args:
        placement: the placement the instances are of (block indices into ``placement.blocks``).
        orders: per device, its ``(micro-batch, block index)`` instances in execution order; a
            block on several devices appears in each of their orders.
        durations: ticks per block (``engine.tessel.repetend.Scaled.durations``).
        lags: ticks per dependency ``(a, b)`` (``Scaled.lags``).
        tail: per device, ticks it works after its last block (:func:`step_tail`).

    Returns:
        The makespan in ticks: a block starts when every device of its set has finished the
        instance before it in its order and every dependency of the same micro-batch has ended
        plus its lag; the step ends when every device has also worked its ``tail``.

    Raises:
        ValueError: the orders deadlock (a block waits for one that can never run).
    """
    lags = lags or {}
    blocks = placement.blocks
    succ: dict[tuple[int, int], list[tuple[tuple[int, int], int]]] = {}
    indeg: dict[tuple[int, int], int] = {}
    for order in orders:
        for x in order:
            indeg.setdefault(x, 0)
        for x, y in zip(order, order[1:]):
            succ.setdefault(x, []).append((y, durations[x[1]]))
            indeg[y] += 1
    for (mb, b) in list(indeg):
        for a in blocks[b].deps:
            if (mb, a) in indeg:
                succ.setdefault((mb, a), []).append(((mb, b), durations[a] + lags.get((a, b), 0)))
                indeg[(mb, b)] += 1
    start = {x: 0 for x in indeg}
    ready = [x for x, k in indeg.items() if k == 0]
    done = 0
    span = 0
    device_end = [0] * len(orders)
    for d, order in enumerate(orders):
        if not order:
            device_end[d] = -1
    while ready:
        x = ready.pop()
        done += 1
        span = max(span, start[x] + durations[x[1]])
        for d in blocks[x[1]].devices:
            device_end[d] = max(device_end[d], start[x] + durations[x[1]])
        for y, w in succ.get(x, ()):
            if start[x] + w > start[y]:
                start[y] = start[x] + w
            indeg[y] -= 1
            if indeg[y] == 0:
                ready.append(y)
    if done < len(indeg):
        raise ValueError("the orders deadlock: some block waits for one that can never run")
    if tail:
        span = max([span] + [e + t for e, t in zip(device_end, tail) if e >= 0])
    return span
