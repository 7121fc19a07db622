"""The versioned JSON envelope shared by plan, placement, cost, profile and checkpoint files."""

from __future__ import annotations

import pytest

from engine.cost.model import COST_ENVELOPE, CostModel
from engine.cost.profiler import ProfileTable
from engine.envelope import Envelope, FieldReader, join_path
from engine.errors import CostModelError, PlacementError, PlanFormatError, TesselError
from engine.io.placement_json import PLACEMENT_ENVELOPE, placement_from_dict, placement_to_dict
from engine.io.plan import PLAN_ENVELOPE
from engine.shapes import SHAPES, make_shape

ENV = Envelope("tessel-demo", 3, PlanFormatError, what="a demo", style="path")


def test_wrap_puts_the_header_first():
    d = ENV.wrap({"a": 1})
    assert list(d) == ["format", "version", "a"] and d["format"] == "tessel-demo" and d["version"] == 3
    assert ENV.check(d) is d


@pytest.mark.parametrize("doc,match", [
    ({"format": "other", "version": 3}, "format is 'other', expected 'tessel-demo'"),
    ({"version": 3}, "format is None"),
    ({"format": "tessel-demo", "version": 4}, "version is 4, but this Tessel reads version 3"),
    ({"format": "tessel-demo"}, "version is None"),
    ({"format": "tessel-demo", "version": True}, "version is True"),
    ([1, 2], "a demo is a JSON object, got list"),
    ("text", "a demo is a JSON object, got str"),
])
def test_check_rejects_with_the_callers_error(doc, match):
    with pytest.raises(PlanFormatError, match=match) as e:
        ENV.check(doc, "f.json")
    assert str(e.value).startswith("f.json: ") and isinstance(e.value, TesselError)


def test_check_nested_path_names_the_field():
    with pytest.raises(PlanFormatError, match=r"^plan: cost\.version is 9"):
        ENV.check({"format": "tessel-demo", "version": 9}, "plan", path="cost")
    with pytest.raises(PlanFormatError, match=r"^cost should be a JSON object, got list"):
        ENV.check([], path="cost")


def test_lenient_envelope_accepts_a_missing_header_but_not_a_wrong_one():
    lenient = Envelope("tessel-demo", 1, CostModelError, require_format=False, require_version=False)
    assert lenient.check({"x": 1}) == {"x": 1}
    with pytest.raises(CostModelError, match="format is 'nope'"):
        lenient.check({"format": "nope"})
    with pytest.raises(CostModelError, match="version is 2"):
        lenient.check({"version": 2})


def test_field_reader_names_the_missing_field_path():
    r = FieldReader(PlacementError, "src", "path")
    doc = {"schedule": {"orders": [[1, 2]]}}
    assert r.need(doc, "schedule", dict, "schedule") == {"orders": [[1, 2]]}
    with pytest.raises(PlacementError, match=r"^src: schedule\.num_micro_batches is missing$"):
        r.need(doc["schedule"], "num_micro_batches", int, "schedule.num_micro_batches")
    with pytest.raises(PlacementError, match=r"^src: schedule should be list, got dict$"):
        r.need(doc, "schedule", list, "schedule")
    with pytest.raises(PlacementError, match=r"schedule\.orders\[1\]\[4\]: bad action"):
        raise r.fail(join_path(join_path("schedule.orders", 1), 4), ": bad action")
    fields = FieldReader(PlanFormatError, "plan.json", "field")
    with pytest.raises(PlanFormatError, match=r"^plan.json: missing field 'a\.b'$"):
        fields.need({"a": {}}, "b", int, "a.b")
    with pytest.raises(PlanFormatError, match=r"^plan.json: field 'n' should be int/float, got bool$"):
        fields.need({"n": True}, "n", (int, float), "n")   # a JSON boolean is not a number
    assert fields.optional({"n": None}, "n", int, "n", 7) == 7
    with pytest.raises(PlanFormatError, match="field 'n' should be int"):
        fields.optional({"n": "x"}, "n", int, "n")


def test_join_path():
    assert join_path("", "a") == "a" and join_path("a", "b") == "a.b" and join_path("a", 2) == "a[2]"


def test_formats_use_the_envelope_with_their_error_class():
    assert PLAN_ENVELOPE.error is PlanFormatError and PLAN_ENVELOPE.format == "tessel-plan"
    assert PLACEMENT_ENVELOPE.error is PlacementError and COST_ENVELOPE.error is CostModelError
    with pytest.raises(PlanFormatError, match="field 'version' is 2, but this Tessel reads version 1; re-create"):
        PLAN_ENVELOPE.check({"format": "tessel-plan", "version": 2}, "p.json")
    # cost and profile keep accepting a document without format/version
    d = CostModel.for_device("cpu").to_dict()
    del d["format"], d["version"]
    assert CostModel.from_dict(d) == CostModel.for_device("cpu")
    assert ProfileTable.from_dict({"device_key": "k"}) == ProfileTable("k")
    with pytest.raises(CostModelError, match=r"profile\.format is 'x'"):
        ProfileTable.from_dict({"format": "x", "device_key": "k"})


def test_placement_embedded_form_has_no_header_and_loads():
    pl = make_shape("m", 4, split_backward=True)
    body = placement_to_dict(pl, header=False)
    assert "format" not in body and "version" not in body
    assert placement_from_dict(body, embedded=True) == pl
    with pytest.raises(PlacementError, match="format is None"):
        placement_from_dict(body)   # a placement FILE needs its header
    with pytest.raises(PlacementError, match="version is 5"):
        placement_from_dict({**body, "format": "tessel-placement", "version": 5}, embedded=True)


@pytest.mark.parametrize("name", list(SHAPES))
def test_shape_registry_segment_counts(name):
    spec = SHAPES[name]
    for n in (2, 4):
        assert spec.build(n).num_segments == make_shape(name, n).num_segments
        if spec.model_parts is not None:
            assert spec.model_parts(n) <= spec.build(n).num_segments
        else:
            assert spec.no_model
