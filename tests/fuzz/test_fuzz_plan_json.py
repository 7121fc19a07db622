"""Fuzz the plan JSON loader: a plan whose schedule validates or fails validation with a
``ScheduleError``, or one clear sentence (a ``TesselError``), never another exception (issue 20)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import ScheduleError, TesselError
from engine.io.plan import Plan, load_plan


def examples(ci: int) -> int:
    """Cases for a test: ``ci`` under the ``ci`` profile (40 cases by default), scaled with the loaded one."""
    return max(1, ci * settings.default.max_examples // 40)


def _check_sentence(e: TesselError) -> None:
    text = str(e)
    assert text and "\n" not in text and "Traceback" not in text, text


def _load_and_validate(path) -> Plan | None:
    """Load the plan and validate its schedule; only ``TesselError`` (one sentence) may escape."""
    try:
        plan = load_plan(path)
    except TesselError as e:
        _check_sentence(e)
        return None
    try:
        plan.schedule.validate()
    except ScheduleError as e:
        _check_sentence(e)
        return plan
    # a plan that loads and validates writes back to a document that loads to the same schedule
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.schedule.orders == plan.schedule.orders
    assert again.schedule.num_micro_batches == plan.schedule.num_micro_batches
    return plan


@settings(max_examples=examples(80))
@given(data=st.data())
def test_mutated_plan_files_load_or_raise_a_sentence(data, valid_plan_docs, mutate_json, tmp_path_factory):
    doc = data.draw(st.sampled_from(valid_plan_docs), label="plan")
    bad = mutate_json(data, doc)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(json.dumps(bad), encoding="utf-8")
    _load_and_validate(path)


@settings(max_examples=examples(40))
@given(data=st.data())
def test_mutated_schedules_load_or_raise_a_sentence(data, valid_plan_docs, mutate_json, tmp_path_factory):
    """Mutations aimed at the schedule: orders swapped, blocks duplicated or dropped, unknown
    devices and micro-batches, a wrong micro-batch count."""
    doc = json.loads(json.dumps(data.draw(st.sampled_from(valid_plan_docs), label="plan")))
    sched = doc["schedule"]
    op = data.draw(st.sampled_from(["mutate", "device", "micro-batch", "count", "action"]), label="op")
    if op == "mutate":
        doc["schedule"] = mutate_json(data, sched, max_mutations=4)
    elif op == "device":  # a block moved to a device that does not run it, or does not exist
        row = data.draw(st.integers(0, len(sched["orders"]) - 1), label="row")
        if sched["orders"][row]:
            item = sched["orders"][row].pop(0)
            target = data.draw(st.integers(0, len(sched["orders"])), label="to")
            if target == len(sched["orders"]):
                sched["orders"].append([item])
            else:
                sched["orders"][target].insert(0, item)
    elif op == "micro-batch":
        row = data.draw(st.integers(0, len(sched["orders"]) - 1), label="row")
        if sched["orders"][row]:
            a = sched["orders"][row][0]
            sched["orders"][row][0] = a[:-1] + data.draw(st.sampled_from(["3", "99", "1000000"]), label="mb")
    elif op == "count":
        sched["num_micro_batches"] = data.draw(st.sampled_from([0, -1, 1, 2, 4, 10**6, 10**18]), label="m")
    else:
        row = data.draw(st.integers(0, len(sched["orders"]) - 1), label="row")
        sched["orders"][row].append(data.draw(st.sampled_from(["0X0", "F", "", " 0F0 ", "0F-1", "99F0", "0f0",
                                                               "0F0\n", "１F0"]), label="action"))
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    _load_and_validate(path)


@settings(max_examples=examples(30))
@given(data=st.data())
def test_damaged_plan_text_loads_or_raises_a_sentence(data, valid_plan_docs, tmp_path_factory):
    """Truncated files, bytes that are not UTF-8, deep nesting, empty files, a byte-order mark."""
    raw = json.dumps(data.draw(st.sampled_from(valid_plan_docs), label="plan")).encode()
    kind = data.draw(st.sampled_from(["truncate", "garbage", "nest", "empty", "bom"]), label="damage")
    if kind == "truncate":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1), label="cut")]
    elif kind == "garbage":
        at = data.draw(st.integers(0, len(raw)), label="at")
        raw = raw[:at] + data.draw(st.binary(min_size=1, max_size=8), label="bytes") + raw[at:]
    elif kind == "nest":
        depth = data.draw(st.sampled_from([10, 1000, 100_000]), label="depth")
        raw = b'{"format": "tessel-plan", "version": 1, "model": ' + b"[" * depth + b"]" * depth + b"}"
    elif kind == "empty":
        raw = b""
    else:
        raw = b"\xef\xbb\xbf" + raw
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_bytes(raw)
    _load_and_validate(path)


def test_a_folder_or_a_missing_path_is_a_sentence(tmp_path):
    for path in (tmp_path, tmp_path / "missing.json"):
        try:
            load_plan(path)
        except TesselError as e:
            _check_sentence(e)
            assert str(path) in str(e)
        else:
            raise AssertionError(f"load_plan({path}) returned a plan")
