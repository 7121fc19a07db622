"""``engine.plan.capture_cache``: a built-in model planned again at the same micro-batch size,
sequence length, dtype and task reuses its capture, and the plan equals one made from a fresh
capture; anything else is captured again."""

from __future__ import annotations

import textwrap

import pytest

from engine.models import registry
from engine.plan import capture_cache, make_plan

KW = dict(devices=2, micro_batches=4, schedule="1f1b", device_type="cpu", seq_len=16)


@pytest.fixture(autouse=True)
def _empty_cache():
    capture_cache.clear()
    yield
    capture_cache.clear()


def _numbers(res) -> tuple:
    m = res.plan.metrics
    return m["makespan"], tuple(m["peak_memory"]), res.plan.to_dict()["segments"]


def test_a_second_plan_reuses_the_capture_and_equals_a_fresh_one():
    first = make_plan("llama-tiny", **KW)
    other_degrees = make_plan("llama-tiny", **{**KW, "devices": 4, "dp": 2})   # the degrees are not in the key
    again = make_plan("llama-tiny", **KW)
    assert again.graph is first.graph and other_degrees.graph is first.graph
    capture_cache.clear()
    fresh = make_plan("llama-tiny", **KW)
    assert fresh.graph is not first.graph
    assert _numbers(again) == _numbers(fresh)
    assert fresh.graph.summary() == first.graph.summary()


@pytest.mark.parametrize("change", [{"micro_batch_size": 2}, {"seq_len": 32}, {"dtype": "bfloat16"}])
def test_another_shape_or_dtype_is_captured_again(change):
    first = make_plan("llama-tiny", **KW)
    other = make_plan("llama-tiny", **{**KW, **change})
    assert other.graph is not first.graph


def test_a_name_registered_again_with_another_builder_is_captured_again():
    spec = registry.registered_spec("tessel-gpt")
    first = make_plan("tessel-gpt", **KW)
    try:
        registry.register_model("tessel-gpt", lambda device, dtype: spec.builder(device=device, dtype=dtype),
                                description=spec.description, default_seq_len=spec.default_seq_len,
                                source=spec.source, vocab_size=spec.vocab_size, max_seq_len=spec.max_seq_len,
                                task=spec.task)
        assert make_plan("tessel-gpt", **KW).graph is not first.graph
    finally:
        registry._REGISTRY["tessel-gpt"] = spec


def test_user_code_is_captured_every_time(tmp_path, monkeypatch):
    (tmp_path / "cache_user_model.py").write_text(textwrap.dedent("""
        import torch.nn as nn
        def mlp():
            return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), (__import__("torch").zeros(4, 8),)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    kw = {**KW, "seq_len": None}
    first = make_plan("cache_user_model:mlp", **kw)
    assert make_plan("cache_user_model:mlp", **kw).graph is not first.graph
    assert capture_cache.cache_key("cache_user_model:mlp", 1, None, "float32", None) is None


def test_the_least_recently_used_capture_is_dropped_beyond_the_bound():
    graphs = [make_plan("llama-tiny", **{**KW, "seq_len": 8 + i}).graph for i in range(capture_cache.MAX_ENTRIES)]
    make_plan("llama-tiny", **{**KW, "seq_len": 8})   # the oldest used again: now the newest
    make_plan("llama-tiny", **{**KW, "seq_len": 99})  # one more: the second oldest goes
    assert make_plan("llama-tiny", **{**KW, "seq_len": 8}).graph is graphs[0]
    assert make_plan("llama-tiny", **{**KW, "seq_len": 9}).graph is not graphs[1]
