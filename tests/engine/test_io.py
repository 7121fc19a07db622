"""Plan JSON, Perfetto trace and torch pipelining CSV I/O."""

from __future__ import annotations

import json

import pytest

from engine.dependency import lower
from engine.errors import PlanFormatError
from engine.io import Plan, load_plan, read_torch_csv, save_plan, timeline_to_trace, write_torch_csv
from engine.placement import BlockSpec, Placement, TensorSpec, pipeline_placement
from engine.schedule import Block, Schedule
from engine.simulate import simulate

ACT = TensorSpec((1, 8, 16), "float32")


def _schedule(n=3, m=4):
    pl = pipeline_placement(n, activation_bytes=64, outputs=[ACT] * n, input_grads=[ACT] * n, static_memory=[10] * n)
    orders = [[Block(d, "F", i) for i in range(m)] + [Block(d, "B", i) for i in range(m)] for d in range(n)]
    return Schedule(pl, m, orders, "gpipe")


def _plan():
    s = _schedule()
    return Plan(model={"name": "toy"}, parallel={"dp": 1, "tp": 1, "pp": 3},
                segments=[{"index": i, "param_bytes": 0} for i in range(3)],
                schedule=s, metrics=simulate(lower(s)).metrics())


def test_plan_round_trip(tmp_path):
    p = _plan()
    path = save_plan(p, tmp_path / "plan.json")
    d = json.loads(path.read_text())
    assert d["format"] == "tessel-plan" and d["version"] == 1
    q = load_plan(path)
    assert q.schedule.orders == p.schedule.orders
    assert q.placement == p.placement
    assert q.metrics == p.metrics
    q.schedule.validate()


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d.update(version=99), "field 'version' is 99"),
        (lambda d: d.update(format="other"), "field 'format'"),
        (lambda d: d["schedule"]["orders"][1].__setitem__(2, "xx"), "schedule.orders[1][2]"),
        (lambda d: d.pop("segments"), "missing field 'segments'"),
        (lambda d: d["schedule"].update(num_micro_batches="4"), "schedule.num_micro_batches"),
        (lambda d: d["placement"]["blocks"][0].update(devices=[7]), "field 'placement'"),
    ],
)
def test_malformed_plan_names_the_field(tmp_path, mutate, needle):
    d = _plan().to_dict()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFormatError) as ei:
        load_plan(path)
    assert needle in str(ei.value)


def test_not_json_gives_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"format": "tessel-plan",\n "version": }')
    with pytest.raises(PlanFormatError, match="line 2"):
        load_plan(path)


def test_trace_structure():
    s = _schedule()
    tl = simulate(lower(s))
    tr = timeline_to_trace(tl)
    ev = tr["traceEvents"]
    blocks = [e for e in ev if e["ph"] == "X" and e["tid"] == 0 and e["cat"] in "FB"]
    assert len(blocks) == 3 * 4 * 2  # every F and B on the compute track
    assert sum(e["cat"] == "OPTIM" for e in ev if e["ph"] == "X") == 3  # one optimizer step per device
    assert {e["pid"] for e in blocks} == {0, 1, 2}
    sends = [e for e in ev if e["ph"] == "X" and e["tid"] == 1]
    recvs = [e for e in ev if e["ph"] == "X" and e["tid"] == 2]
    assert len(sends) == len(recvs) == 2 * 4 * 2  # 2 boundaries x 4 micro-batches x (F and B)
    starts = {e["id"] for e in ev if e["ph"] == "s"}
    ends = {e["id"] for e in ev if e["ph"] == "f"}
    assert starts == ends and len(starts) == len(sends)
    counters = [e for e in ev if e["ph"] == "C"]
    assert counters and all(e["name"] == "memory" and "bytes" in e["args"] for e in counters)
    assert max(e["args"]["bytes"] for e in counters if e["pid"] == 0) == 10 + 4 * 64


def test_csv_round_trip(tmp_path):
    s = _schedule()
    path = write_torch_csv(s, tmp_path / "s.csv")
    assert path.read_text().splitlines()[0] == "0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3"
    t = read_torch_csv(path, s.placement)
    assert t.orders == s.orders and t.num_micro_batches == 4


def test_csv_errors(tmp_path):
    s = _schedule()
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0Q1\n1F0\n2F0\n")
    with pytest.raises(PlanFormatError, match="row 1, column 2"):
        read_torch_csv(bad, s.placement)
    multi = Placement(2, (BlockSpec("F", 0, (0, 1)),))
    with pytest.raises(PlanFormatError, match="devices"):
        write_torch_csv(Schedule(multi, 1, [[Block(0, "F", 0)]] * 2), tmp_path / "x.csv")
