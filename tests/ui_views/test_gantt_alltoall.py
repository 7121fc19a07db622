"""The Gantt chart draws MoE all-to-alls (expert parallelism) in the communication lane, in their
own colour, with a legend entry and a hover that says what they are."""

from __future__ import annotations

import pytest

from engine.plan import make_plan
from planner_ui.gantt import GanttView
from planner_ui.sources import COMM_OFFSET, KIND_COLORS
from planner_ui.state import PlanState


@pytest.fixture(scope="module")
def moe_plan():
    return make_plan("gpt-moe-tiny", devices=4, dp=2, micro_batches=4, device_type="cpu")


def test_alltoall_glyphs_have_their_own_colour_in_the_comm_lane(moe_plan):
    state = PlanState(moe_plan.plan)
    view = GanttView(state=state)
    a2a = [e for e in state.timeline.events if e.op == "ALLTOALL" and e.end > e.start]
    assert len(a2a) == 2 * 16  # 2 pipeline ranks x (4 F + 4 B) x 2 all-to-alls
    d = view.comm_source.data
    rows = [i for i, op in enumerate(d["op"]) if op == "ALLTOALL"]
    assert len(rows) == len(a2a)
    colour = KIND_COLORS["ALLTOALL"]
    assert colour not in {c for k, c in KIND_COLORS.items() if k != "ALLTOALL"}
    assert {d["color"][i] for i in rows} == {colour}
    for i in rows:  # thin lane under the device's row, like the other communication
        dev = int(d["device"][i])
        assert d["top"][i] < dev + COMM_OFFSET < d["bottom"][i] and d["bottom"][i] - d["top"][i] < 0.5
        assert d["name"][i].startswith("a2a ") and d["nbytes"][i] > 0
        assert "all-to-all" in d["what"][i] and "expert" in d["what"][i]
    # times in ms match the simulated events
    starts = sorted(float(d["start"][i]) for i in rows)
    assert starts == pytest.approx(sorted(e.start * 1e3 for e in a2a))
    # the hover explains each communication block; the legend names and colours the new kind
    assert ("what", "@what") in view.comm_hover.tooltips
    head = view._header.object
    assert "ALL-TO-ALL (MoE)" in head and colour in head and "expert-parallel all-to-all" in head
    # the tied wte / lm_head all-reduce is drawn too, as an ALLREDUCE
    tied = [i for i, n in enumerate(d["name"]) if n == "allreduce tied"]
    assert sorted(int(d["device"][i]) for i in tied) == [0, 1]
    assert {d["color"][i] for i in tied} == {KIND_COLORS["ALLREDUCE"]}
    view.show_comm = False
    assert "ALLTOALL" not in list(view.comm_source.data["op"])


def test_dense_plan_has_no_alltoall_glyphs():
    res = make_plan("gpt-moe-tiny", devices=2, dp=1, micro_batches=2, device_type="cpu")
    view = GanttView(state=PlanState(res.plan))
    assert "ALLTOALL" not in list(view.comm_source.data["op"])
    assert view.block_count > 0
