"""Ranks that share a node's CPU cores: the step time of a plan whose ranks outnumber them.

The simulator gives every rank its own processor. CPU ranks placed on one host with fewer cores
than ranks (four gloo ranks on two cores) share them: the operating system time-slices the busy
ranks, so while ``k`` ranks compute, each progresses at ``cores / k`` of its speed (processor
sharing). Whatever the interleaving, the node's cores cannot do more than ``cores`` seconds of
work per second, so a step takes at least the node's summed CPU work (compute, and gloo's sends
and collectives) over its cores; and
at least the simulated makespan, the time with a core per rank. :func:`shared_core_step_time`
predicts the larger of the two (the work bound of a roofline, here over cores), per node.

Measured on this machine (``benchmarks/tune_cpu_bench.py --ranks 4``, llama-32k-cpu, four ranks
on two cores, 15 candidates): by the makespan alone the tuner's ranking has Spearman 0.23 and its
pick is 29% slower than the measured best, because it favours plans whose ranks are all busy at
once (data parallelism) over pipelines whose bubbles leave cores to the busy ranks. Counting
compute alone in the bound: 0.72 and 0.8%; compute, sends and collectives: 0.81 and 0.8%.

Source: Kleinrock, "Time-shared systems: a theoretical treatment", JACM 14(2), 1967 (processor
sharing); the work bound as in Williams et al., "Roofline", CACM 52(4), 2009.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import product

from engine.layout import RankLayout
from engine.timeline import Timeline

__all__ = ["CPU_WORK_STREAMS", "node_work_seconds", "shared_core_step_time", "uncontended_timeline"]


#: The streams whose events are work of a CPU rank's core: its compute blocks, and the sends and
#: collectives that gloo runs on the CPU (copies through the kernel's loopback, reductions). A
#: receive is the sender's transfer seen from the other end (and, measured, includes the wait).
CPU_WORK_STREAMS = ("compute", "send", "collective")


def node_work_seconds(timeline: Timeline, layout: RankLayout, devices_per_node: int) -> list[float]:
    """Per node, the summed seconds of its devices' CPU work (:data:`CPU_WORK_STREAMS`).

    ``timeline`` is a plan's simulated step, one rank per pipeline rank (the data-parallel
    replicas and tensor ranks of a stage do what its pipeline rank does); ``layout`` places each
    ``(tp, dp, pp)`` rank on a device, device ``i`` on node ``i // devices_per_node``
    (:mod:`engine.layout`).

    Raises:
        ValueError: ``devices_per_node`` below 1.
    """
    if devices_per_node < 1:
        raise ValueError(f"devices per node must be at least 1, got {devices_per_node}")
    busy = [0.0] * layout.pp
    for e in timeline.events:
        if e.stream in CPU_WORK_STREAMS and 0 <= e.rank < layout.pp:
            busy[e.rank] += e.end - e.start
    out = [0.0] * (-(-layout.size // devices_per_node))
    for t, d, p in product(range(layout.tp), range(layout.dp), range(layout.pp)):
        out[layout.device(t, d, p) // devices_per_node] += busy[p]
    return out


def shared_core_step_time(timeline: Timeline, layout: RankLayout, devices_per_node: int, cores: int) -> float:
    """Seconds per step when each node's ranks share ``cores`` cores: the simulated makespan or,
    if larger, the busiest node's CPU work (:func:`node_work_seconds`) divided by ``cores``.
    With a core per rank (``cores >= devices_per_node``) it is the makespan.

    Raises:
        ValueError: ``devices_per_node`` or ``cores`` below 1.
    """
    if cores < 1:
        raise ValueError(f"cores per node must be at least 1, got {cores}")
    makespan = timeline.makespan
    if cores >= devices_per_node:
        return makespan
    work = max(node_work_seconds(timeline, layout, devices_per_node), default=0.0)
    return max(makespan, work / cores)


def uncontended_timeline(timeline: Timeline, layout: RankLayout, devices_per_node: int, cores: int) -> Timeline:
    """A measured step with each CPU-work event's duration (:data:`CPU_WORK_STREAMS`: compute,
    sends, collectives) replaced by the work it did: under processor sharing an event running while
    ``k`` of its node's devices work progresses at ``min(1, cores / k)`` of its own speed, so its
    work is the integral of that rate over the event (seconds of one core). Collectives too: a
    data-parallel all-reduce that all four ranks on two cores run at once measures twice its
    work, and :func:`shared_core_step_time` counts it as work again. Replicas and tensor ranks are
    taken to run as their pipeline rank of replica 0 does (the measured timeline holds only
    replica 0, ``runtime.launch_result``); a pipeline rank's events are counted on the node of its
    first device. Events keep their start; receives are unchanged. With a core per device the
    timeline is returned as it is.

    Raises:
        ValueError: ``devices_per_node`` or ``cores`` below 1.
    """
    if cores < 1 or devices_per_node < 1:
        raise ValueError(f"cores and devices per node must be at least 1, got {cores} and {devices_per_node}")
    if cores >= devices_per_node:
        return timeline
    copies: dict[int, dict[int, int]] = {}   # pipeline rank -> node -> devices
    for t, d, p in product(range(layout.tp), range(layout.dp), range(layout.pp)):
        node = layout.device(t, d, p) // devices_per_node
        copies.setdefault(p, {})[node] = copies.setdefault(p, {}).get(node, 0) + 1
    home = {p: layout.device(0, 0, p) // devices_per_node for p in copies}
    working = [e for e in timeline.events if e.stream in CPU_WORK_STREAMS and e.end > e.start and e.rank in copies]
    marks = sorted({x for e in working for x in (e.start, e.end)})
    index = {x: i for i, x in enumerate(marks)}
    delta = [[0] * (len(marks) + 1) for _ in range(len(copies))]   # per rank: +1 at start, -1 at end
    ranks = sorted(copies)
    row = {p: i for i, p in enumerate(ranks)}
    for e in working:
        delta[row[e.rank]][index[e.start]] += 1
        delta[row[e.rank]][index[e.end]] -= 1
    nodes = sorted({n for c in copies.values() for n in c})
    cum = {n: [0.0] * len(marks) for n in nodes}   # per node: integral of the rate up to each mark
    active = [0] * len(ranks)
    for i in range(len(marks) - 1):
        for k in range(len(ranks)):
            active[k] += delta[k][i]
        for n in nodes:
            busy = sum(copies[p].get(n, 0) for k, p in enumerate(ranks) if active[k] > 0)
            rate = min(1.0, cores / busy) if busy else 1.0
            cum[n][i + 1] = cum[n][i] + rate * (marks[i + 1] - marks[i])
    work = {id(e): cum[home[e.rank]][index[e.end]] - cum[home[e.rank]][index[e.start]] for e in working}
    events = [replace(e, end=e.start + work[id(e)]) if id(e) in work else e for e in timeline.events]
    return replace(timeline, events=events)
