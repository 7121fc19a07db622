"""Chrome/Perfetto trace JSON of a :class:`~engine.timeline.Timeline`.

Layout (Trace Event Format, https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU):
``pid`` = device, ``tid`` = stream (0 compute, 1 send, 2 recv, 3 collective, 4 all-to-all: the
MoE ``ALLTOALL`` events of the collective stream get their own track, because they may overlap
an asynchronous data-parallel all-reduce and slices on one track must nest), ``ph:"X"``
complete events for blocks and transfers (``ts``/``dur`` in microseconds), ``ph:"C"``
counters named ``memory`` (bytes), and flow events (``ph:"s"``/``"f"``) from each send to the
matching receive, so dependencies show as arrows. Opens in ui.perfetto.dev and chrome://tracing.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.io.atomic import atomic_write_text
from engine.timeline import STREAMS, Timeline

_TID = {s: i for i, s in enumerate(STREAMS)}
_TID_ALLTOALL = len(STREAMS)
_US = 1e6


def _tid(e) -> int:
    if e.op == "ALLTOALL":
        return _TID_ALLTOALL
    return _TID.get(e.stream, 0)


def timeline_to_trace(tl: Timeline, *, name: str = "tessel", metadata: dict | None = None) -> dict:
    """Build the trace dictionary (``{"traceEvents": [...], ...}``).

    Args:
        tl: the timeline (seconds, bytes).
        name: shown as the trace's process-name prefix.
        metadata: JSON-able facts stored under ``"metadata"`` (plan metrics, schedule name...).
    """
    ev: list[dict] = []
    has_a2a = any(e.op == "ALLTOALL" for e in tl.events)
    used = {e.stream for e in tl.events}
    tracks = {s: tid for s, tid in _TID.items() if s != "load" or s in used}
    for r in range(tl.num_devices):
        ev.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"device {r}"}})
        ev.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for s, tid in tracks.items():
            ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": s}})
        if has_a2a:
            ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": _TID_ALLTOALL,
                       "args": {"name": "all-to-all"}})
    sends: dict[tuple[str, int, int], dict] = {}  # (block, src, dst) -> send event
    for e in tl.events:
        item = {
            "ph": "X", "name": e.name, "cat": e.op, "pid": e.rank, "tid": _tid(e),
            "ts": e.start * _US, "dur": max(e.end - e.start, 0.0) * _US,
            "args": {"op": e.op, "micro_batch": e.micro_batch, "segment": e.segment, "bytes": e.nbytes},
        }
        ev.append(item)
        if e.stream == "send":
            blk, dst = e.name.split(">")
            sends[(blk, e.rank, int(dst))] = item
    flow_id = 0
    for e in tl.events:
        if e.stream != "recv":
            continue
        blk, src = e.name.split("<")
        sent = sends.get((blk, int(src), e.rank))
        if sent is None:
            continue
        flow_id += 1
        ev.append({"ph": "s", "id": flow_id, "name": "dep", "cat": "dependency", "pid": sent["pid"],
                   "tid": sent["tid"], "ts": sent["ts"]})
        ev.append({"ph": "f", "bp": "e", "id": flow_id, "name": "dep", "cat": "dependency", "pid": e.rank,
                   "tid": _TID["recv"], "ts": e.end * _US})
    for r, curve in enumerate(tl.memory):
        for t, v in curve:
            ev.append({"ph": "C", "name": "memory", "pid": r, "ts": t * _US, "args": {"bytes": v}})
    return {
        "traceEvents": ev,
        "displayTimeUnit": "ms",
        "metadata": {"generator": name, "source": tl.source, **(metadata or {})},
    }


def write_trace(tl: Timeline, path: str | Path, **kw) -> Path:
    """Write :func:`timeline_to_trace` as JSON to ``path`` atomically; returns the path."""
    return atomic_write_text(path, json.dumps(timeline_to_trace(tl, **kw)))
