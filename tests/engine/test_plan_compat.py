"""Plan files written before ``plan.model``/``plan.parallel`` were typed load with typed fields
and save to the identical JSON document (tests/data/plan_v1_*.json were written by Tessel 0.1.0,
commit eb8860f: ``tessel plan``, ``tessel search`` and the planner UI's ``abstract_plan``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import ModelRef, ParallelConfig
from engine.errors import PlanFormatError
from engine.io import Plan, load_plan, save_plan

DATA = Path(__file__).resolve().parents[1] / "data"
FILES = ["plan_v1_gpt2_tiny_1f1b.json", "plan_v1_moe_adama_dp2.json", "plan_v1_search_abstract.json",
         "plan_v1_search_gpt2_tiny.json", "plan_v1_ui_abstract.json"]


@pytest.mark.parametrize("name", FILES)
def test_v1_plan_round_trips_to_the_identical_document(name, tmp_path):
    text = (DATA / name).read_text()
    plan = load_plan(DATA / name)
    assert isinstance(plan.model, ModelRef) and isinstance(plan.parallel, ParallelConfig)
    assert plan.to_dict() == json.loads(text)
    assert save_plan(plan, tmp_path / "plan.json").read_text() == text   # same keys, same order


def test_v1_plan_fields_are_typed():
    p = load_plan(DATA / "plan_v1_gpt2_tiny_1f1b.json")
    m, par = p.model, p.parallel
    assert (m.name, m.source, m.micro_batch_size, m.batch_size, m.seq_len, m.dtype, m.num_params) == \
        ("gpt2-tiny", "hf", 1, 4, 128, "float32", 224640)
    assert m.config is not None and m.config["n_layer"] == 4 and m.extra == {}
    assert (par.dp, par.tp, par.pp, par.virtual_stages, par.micro_batches, par.micro_batch_size, par.optimizer) == \
        (1, 1, 2, 1, 4, 1, "adam")
    assert par.devices == 2 and par.extra == {}

    moe = load_plan(DATA / "plan_v1_moe_adama_dp2.json")
    assert (moe.parallel.dp, moe.parallel.pp, moe.parallel.devices, moe.parallel.optimizer) == (2, 2, 4, "adama")
    assert moe.model.batch_size == 8 and moe.model.source == "zoo"


def test_v1_search_plans_keep_missing_keys_missing_and_unknown_keys():
    s = load_plan(DATA / "plan_v1_search_abstract.json")
    assert s.model.name == "abstract" and s.model.extra == {"forward": 1.0, "backward": 2.0}
    assert s.model.seq_len is None and s.model.micro_batch_size == 1
    # absent keys take the one default of ParallelConfig
    assert (s.parallel.virtual_stages, s.parallel.micro_batch_size, s.parallel.pp) == (1, 1, 2)
    assert "virtual_stages" not in s.to_dict()["parallel"]
    ui = load_plan(DATA / "plan_v1_ui_abstract.json")
    assert ui.model.to_dict() == {"name": "vshape"} and ui.meta["abstract"] is True


def test_built_in_code_writes_every_field_in_the_v1_order():
    par = ParallelConfig(pp=2, micro_batches=4)
    assert list(par.to_dict()) == ["dp", "tp", "pp", "virtual_stages", "micro_batches", "micro_batch_size",
                                   "devices", "optimizer", "precision", "recompute", "layout"]
    assert list(ModelRef("m").to_dict()) == ["name", "source", "config", "micro_batch_size", "batch_size",
                                             "seq_len", "dtype", "num_params", "task", "split"]


def test_missing_micro_batches_default_to_the_schedules():
    d = json.loads((DATA / "plan_v1_gpt2_tiny_1f1b.json").read_text())
    del d["parallel"]["micro_batches"]
    assert Plan.from_dict(d).parallel.micro_batches == 4


def test_an_implied_micro_batch_count_is_not_written_back():
    """A plan without ``parallel.micro_batches`` saves without it (so its checkpoint hash, which
    hashes the plan document, stays the same) until the count is changed."""
    from dataclasses import replace

    d = json.loads((DATA / "plan_v1_gpt2_tiny_1f1b.json").read_text())
    del d["parallel"]["micro_batches"]
    plan = Plan.from_dict(d)
    assert plan.to_dict()["parallel"] == d["parallel"]
    assert replace(plan.parallel, micro_batches=8).to_dict()["micro_batches"] == 8


@pytest.mark.parametrize("section, key, value, needle", [
    ("parallel", "pp", "2", "field 'parallel.pp' should be int, got str"),
    ("parallel", "dp", True, "field 'parallel.dp' should be int, got bool"),
    ("parallel", "optimizer", "lamb", "field 'parallel.optimizer' is 'lamb'"),
    ("model", "seq_len", 1.5, "field 'model.seq_len' should be int/null, got float"),
    ("model", "name", None, "field 'model.name' should be str, got NoneType"),
])
def test_a_wrong_type_names_the_field(section, key, value, needle):
    d = json.loads((DATA / "plan_v1_gpt2_tiny_1f1b.json").read_text())
    d[section][key] = value
    with pytest.raises(PlanFormatError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        Plan.from_dict(d, source="p.json")
    d = json.loads((DATA / "plan_v1_gpt2_tiny_1f1b.json").read_text())
    del d["model"]["name"]
    with pytest.raises(PlanFormatError, match="missing field 'model.name'"):
        Plan.from_dict(d)
