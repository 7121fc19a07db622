"""The schedule core: validation rules, order-based memory accounting, ``Schedule.move`` and the
torch-pipelining action strings.

Each validation rule is triggered by a hand-made bad schedule and checked by rule name (and,
where the validator reports them, the device and block).
"""

from __future__ import annotations

import pytest

from engine.errors import PlanFormatError, ScheduleError
from engine.placement import BlockSpec, Placement, pipeline_placement
from engine.schedule import Block, Schedule, memory_profile, parse_action, peak_memory, validate

GiB = 2**30


def sched(placement, m, rows, name="hand"):
    return Schedule.from_actions(placement, m, [r.split() for r in rows], name=name)


def gpipe_rows(pp, m):
    return [" ".join([f"{r}F{i}" for i in range(m)] + [f"{r}B{i}" for i in range(m)]) for r in range(pp)]


@pytest.fixture
def pl2():
    return pipeline_placement(2, activation_bytes=100)


def rule_of(s, **kw):
    with pytest.raises(ScheduleError) as e:
        validate(s, **kw)
    return e.value


# --------------------------------------------------------------------------- a valid one
def test_valid_schedule_passes(pl2):
    s = sched(pl2, 2, gpipe_rows(2, 2))
    validate(s)
    s.validate(memory_limit=200)


# --------------------------------------------------------------------------- rule: micro-batches
def test_rule_micro_batches_count(pl2):
    assert rule_of(Schedule(pl2, 0, [[], []])).rule == "micro-batches"


def test_rule_micro_batches_out_of_range(pl2):
    rows = gpipe_rows(2, 2)
    rows[1] += " 1F2"
    e = rule_of(sched(pl2, 2, rows))
    assert (e.rule, e.device, e.block) == ("micro-batches", 1, "1F2")


# --------------------------------------------------------------------------- rule: device
def test_rule_device_wrong_device(pl2):
    rows = ["0F0 1F0 0B0", "1B0"]  # 1F0 belongs to device 1
    e = rule_of(sched(pl2, 1, rows))
    assert (e.rule, e.device, e.block) == ("device", 0, "1F0")


def test_rule_device_block_not_in_placement(pl2):
    e = rule_of(sched(pl2, 1, ["0F0 0B0 0W0", "1F0 1B0"]))
    assert (e.rule, e.block) == ("device", "0W0")


def test_rule_device_order_count(pl2):
    assert rule_of(Schedule(pl2, 1, [[Block(0, "F", 0)]])).rule == "device"


# --------------------------------------------------------------------------- rule: completeness
def test_rule_completeness_missing(pl2):
    e = rule_of(sched(pl2, 2, ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0"]))
    assert (e.rule, e.device, e.block) == ("completeness", 1, "1B1")


def test_rule_completeness_duplicate(pl2):
    e = rule_of(sched(pl2, 1, ["0F0 0F0 0B0", "1F0 1B0"]))
    assert (e.rule, e.device, e.block) == ("completeness", 0, "0F0")


# --------------------------------------------------------------------------- rule: dependency
def test_rule_dependency_same_device():
    pl = pipeline_placement(1)
    e = rule_of(sched(pl, 2, ["0F0 0B1 0F1 0B0"]))
    assert (e.rule, e.device, e.block) == ("dependency", 0, "0B1")


def test_rule_dependency_split_backward():
    pl = pipeline_placement(1, split_backward=True)
    e = rule_of(sched(pl, 1, ["0F0 0W0 0I0"]))
    assert (e.rule, e.block) == ("dependency", "0W0")


# --------------------------------------------------------------------------- rule: deadlock
def test_rule_deadlock_cross_device(pl2):
    # device 1 waits for 0F1 first; device 0 runs 0F1 only after 0B0, which needs 1B0 (after 1F1).
    rows = ["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"]
    e = rule_of(sched(pl2, 2, rows))
    assert e.rule == "deadlock"
    assert "0F1" in str(e) and "1B0" in str(e)


def test_rule_deadlock_multi_device_block():
    # a block on both devices must be at the head of both orders at once
    blocks = (
        BlockSpec("F", 0, (0, 1)),
        BlockSpec("F", 1, (0,), deps=(0,)),
    )
    pl = Placement(2, blocks)
    ok = Schedule(pl, 2, [[Block(0, "F", 0), Block(1, "F", 0), Block(0, "F", 1), Block(1, "F", 1)],
                          [Block(0, "F", 0), Block(0, "F", 1)]])
    validate(ok)
    bad = Schedule(pl, 2, [[Block(0, "F", 0), Block(0, "F", 1), Block(1, "F", 0), Block(1, "F", 1)],
                           [Block(0, "F", 1), Block(0, "F", 0)]])
    assert rule_of(bad).rule == "deadlock"


# --------------------------------------------------------------------------- rule: memory
def test_rule_memory():
    pl = pipeline_placement(2, activation_bytes=GiB)
    s = sched(pl, 3, gpipe_rows(2, 3))
    validate(s, memory_limit=3 * GiB)
    e = rule_of(s, memory_limit=2.5 * GiB)
    assert (e.rule, e.device) == ("memory", 0)
    assert "3.00 GiB" in str(e) and "2.50 GiB" in str(e)
    e = rule_of(s, memory_limit=[4 * GiB, 2 * GiB])  # per device
    assert (e.rule, e.device) == ("memory", 1)


def test_rules_checked_in_order(pl2):
    # missing blocks AND a memory overflow: completeness is reported first
    s = sched(pl2, 2, ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0"])
    assert rule_of(s, memory_limit=1).rule == "completeness"


# --------------------------------------------------------------------------- memory accounting
def test_memory_profile_and_peak():
    pl = pipeline_placement(2, activation_bytes=[100, 300], static_memory=[10, 20])
    s = sched(pl, 2, ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"])
    assert memory_profile(s) == [[110, 210, 110, 10], [320, 20, 320, 20]]
    assert peak_memory(s) == [210, 320]


def test_memory_split_backward_frees_in_two_parts():
    pl = pipeline_placement(1, activation_bytes=1000, split_backward=True, weight_grad_fraction=0.25)
    s = sched(pl, 2, ["0F0 0F1 0I0 0W0 0I1 0W1"])
    assert memory_profile(s) == [[1000, 2000, 1250, 1000, 250, 0]]
    assert peak_memory(s) == [2000]


def test_peak_memory_empty_order_is_static():
    pl = Placement(2, (BlockSpec("F", 0, (0,), memory=5),), static_memory=(7, 9))
    s = Schedule(pl, 1, [[Block(0, "F", 0)], []])
    assert peak_memory(s) == [12, 9]


def test_memory_is_order_based():
    pl = pipeline_placement(1, activation_bytes=10)
    fill_drain = sched(pl, 3, ["0F0 0F1 0F2 0B0 0B1 0B2"])
    one_by_one = sched(pl, 3, ["0F0 0B0 0F1 0B1 0F2 0B2"])
    assert peak_memory(fill_drain) == [30] and peak_memory(one_by_one) == [10]


# --------------------------------------------------------------------------- Schedule.move
def test_move(pl2):
    s = sched(pl2, 2, gpipe_rows(2, 2))
    t = s.move(1, 2, 1)  # 1B0 before 1F1
    assert t.to_actions()[1] == ["1F0", "1B0", "1F1", "1B1"]
    assert s.to_actions()[1] == ["1F0", "1F1", "1B0", "1B1"]  # original untouched
    assert t.to_actions()[0] == s.to_actions()[0]
    validate(t)
    assert peak_memory(t)[1] == 100 < peak_memory(s)[1]
    assert s.move(0, 3, 3).orders == s.orders


def test_move_can_break_validity(pl2):
    one = sched(pipeline_placement(1), 2, gpipe_rows(1, 2)).move(0, 2, 0)  # 0B0 before 0F0
    assert (rule_of(one).rule, rule_of(one).block) == ("dependency", "0B0")
    # the same move on device 0 of a 2-device pipeline: 0B0 depends on 0F0 only transitively
    # (through 1F0 and 1B0 on the other device); it is still named a dependency violation
    two = sched(pl2, 2, gpipe_rows(2, 2)).move(0, 2, 0)
    assert (rule_of(two).rule, rule_of(two).block) == ("dependency", "0B0")
    # 0B0 before 0F1 on device 0 while device 1 runs 1F1 before 1B0: a cross-device cycle
    assert rule_of(sched(pl2, 2, gpipe_rows(2, 2)).move(0, 2, 1)).rule == "deadlock"


@pytest.mark.parametrize("src,dst", [(-1, 0), (0, 4), (4, 0)])
def test_move_out_of_range(pl2, src, dst):
    s = sched(pl2, 2, gpipe_rows(2, 2))
    with pytest.raises(ScheduleError) as e:
        s.move(0, src, dst)
    assert (e.value.rule, e.value.device) == ("device", 0)


def test_copy_is_independent(pl2):
    s = sched(pl2, 2, gpipe_rows(2, 2))
    c = s.copy()
    c.orders[0].reverse()
    c.meta["x"] = 1
    assert s.to_actions()[0][0] == "0F0" and "x" not in s.meta


# --------------------------------------------------------------------------- action strings
def test_action_round_trip(pl2):
    s = sched(pl2, 2, gpipe_rows(2, 2), name="gpipe")
    again = Schedule.from_actions(pl2, 2, s.to_actions(), name="gpipe")
    assert again.orders == s.orders and again.to_actions() == s.to_actions()
    assert "rank 1: 1F0 1F1 1B0 1B1" in str(s)


@pytest.mark.parametrize("text,block", [("1B3", Block(1, "B", 3)), (" 12I0 ", Block(12, "I", 0)),
                                        ("0W10", Block(0, "W", 10))])
def test_parse_action(text, block):
    assert parse_action(text) == block
    assert str(block) == text.strip()


@pytest.mark.parametrize("text", ["", "F0", "1X3", "1F", "1FF3", "a1F3", "1 F3"])
def test_parse_action_rejects(text):
    with pytest.raises(PlanFormatError, match="expected <stage><F|B|I|W><micro-batch>"):
        parse_action(text)


def test_block_key_and_order():
    assert Block(2, "W", 0).key == ("W", 2)
    assert sorted([Block(1, "F", 0), Block(0, "F", 1)])[0] == Block(0, "F", 1)
