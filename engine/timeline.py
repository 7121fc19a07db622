"""Timeline: start/end of every instruction and memory per device over time.

Predicted by :mod:`engine.simulate` and measured by the runtime; the Gantt chart and the
Perfetto trace draw it. Times in seconds, memory in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Streams (Perfetto thread tracks) of a device; ``"load"`` is a GNN plan's chunk loads
#: (:mod:`engine.gnn.simulate`, NGra's streaming), absent from pipeline plans.
STREAMS = ("compute", "send", "recv", "collective", "load")


@dataclass(slots=True)
class Event:
    """One instruction's execution interval on one device.

    Attributes:
        rank: device (pipeline rank).
        stream: ``"compute"``, ``"send"``, ``"recv"``, ``"collective"`` or ``"load"`` (a GNN plan's
            edge-chunk loads).
        op: ``F``, ``B``, ``I``, ``W``, ``OPTIM``, ``SEND``, ``RECV``, ``ALLREDUCE`` or
            ``ALLTOALL`` (MoE expert-parallel all-to-all; stream ``"collective"``).
        name: label, e.g. ``"1B3"``, ``"1F3>2"`` (send of 1F3 to rank 2), ``"allreduce s1"``
            (data-parallel gradients of segment 1), ``"allreduce tied"`` (tied weights across
            pipeline ranks) or ``"a2a 1F3"`` (an all-to-all run by block 1F3).
        start, end: seconds from the start of the step.
        nbytes: bytes moved (communication), 0 for compute.
        micro_batch: micro-batch index, -1 where none.
        segment: segment index, -1 where none.
        job: name of the job the event belongs to when several jobs share the devices
            (co-located jobs, :mod:`engine.crossover`), ``""`` for a single job. Optional in
            dicts: an event dict without ``"job"`` (older files) loads with ``""``.
    """

    rank: int
    stream: str
    op: str
    name: str
    start: float
    end: float
    nbytes: int = 0
    micro_batch: int = -1
    segment: int = -1
    job: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict:
        return {"rank": self.rank, "stream": self.stream, "op": self.op, "name": self.name,
                "start": self.start, "end": self.end, "nbytes": self.nbytes,
                "micro_batch": self.micro_batch, "segment": self.segment, "job": self.job}


@dataclass
class Timeline:
    """Events and memory curves of one step.

    Attributes:
        events: every executed instruction.
        memory: per device, ``(time_s, bytes)`` points of a step function (value holds until the next point).
        num_devices: devices (pipeline ranks).
        static_memory: resident bytes per device included in ``memory``.
        source: ``"predicted"`` or ``"measured"``.
    """

    events: list[Event]
    memory: list[list[tuple[float, int]]]
    num_devices: int
    static_memory: list[int] = field(default_factory=list)
    source: str = "predicted"

    @property
    def makespan(self) -> float:
        """Seconds from the first start to the last end of any event."""
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy_time(self, rank: int) -> float:
        """Seconds the compute stream of ``rank`` is busy (F/B/I/W and optimizer)."""
        return sum(e.end - e.start for e in self.events if e.rank == rank and e.stream == "compute")

    def bubble_ratios(self) -> list[float]:
        """Per device: idle compute time / makespan."""
        ms = self.makespan
        if ms <= 0:
            return [0.0] * self.num_devices
        busy = [0.0] * self.num_devices
        for e in self.events:
            if e.stream == "compute":
                busy[e.rank] += e.end - e.start
        return [max(0.0, 1.0 - b / ms) for b in busy]

    def bubble_ratio(self) -> float:
        """Idle time / (devices x makespan)."""
        r = self.bubble_ratios()
        return sum(r) / len(r) if r else 0.0

    def peak_memory(self) -> list[int]:
        """Peak bytes per device."""
        return [max(v for _, v in curve) if curve else 0 for curve in self.memory]

    def metrics(self) -> dict:
        """JSON-able summary: makespan (s), bubble ratio overall and per device, peak memory (bytes)."""
        return {
            "makespan": self.makespan,
            "bubble_ratio": self.bubble_ratio(),
            "bubble_ratios": self.bubble_ratios(),
            "peak_memory": self.peak_memory(),
        }

    def to_dict(self) -> dict:
        return {"source": self.source, "num_devices": self.num_devices, "static_memory": self.static_memory,
                "events": [e.to_dict() for e in self.events],
                "memory": [[[t, v] for t, v in c] for c in self.memory]}

    @classmethod
    def from_dict(cls, d: dict) -> "Timeline":
        return cls([Event(**e) for e in d["events"]], [[(float(t), int(v)) for t, v in c] for c in d["memory"]],
                   int(d["num_devices"]), list(d.get("static_memory", [])), d.get("source", "predicted"))
