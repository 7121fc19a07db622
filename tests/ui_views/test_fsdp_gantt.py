"""A fully sharded plan's Gantt (issue 33): each block's parameter all-gathers sit in the
communication lane of their device, and the prefetched ones run while the forward that precedes
them computes (FSDP2's prefetch, simulated by ``engine.simulate``)."""

from __future__ import annotations

from engine.plan import make_plan, predict
from planner_ui.sources import COMM_OFFSET, gantt_columns


def test_prefetched_all_gathers_are_drawn_inside_the_forward_they_overlap():
    res = make_plan("llama-tiny", devices=2, dp=2, dp_shard=2, micro_batches=2, schedule="1f1b",
                    device_type="h100", link="10gbit@5us")
    cols = gantt_columns(predict(res.plan)[0])
    rows = [dict(zip(cols, vals)) for vals in zip(*cols.values())]
    gathers = [r for r in rows if r["op"] == "ALLGATHER" and r["name"].startswith("unshard")]
    forwards = [r for r in rows if r["op"] == "F"]
    assert gathers and forwards
    assert all(r["y"] == r["device"] + COMM_OFFSET and "prefetched" in r["what"] for r in gathers)
    inside = [g for g in gathers for f in forwards
              if g["name"].endswith(f" {f['name']}") and f["left"] < g["left"] and g["right"] <= f["right"]]
    # every unit but the first of each forward is gathered while the unit before it computes
    per_forward = {f["name"]: sum(1 for g in gathers if g["name"].endswith(f" {f['name']}")) for f in forwards}
    assert len(inside) == sum(n - 1 for n in per_forward.values() if n > 1) > 0
