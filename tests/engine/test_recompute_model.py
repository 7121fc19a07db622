"""Activation recomputation in the planner's memory and time models (engine.recompute, used by
engine.transform.split_segments, engine.plan.make.placement_from_segments and
engine.shape_costs.model_shape_placement).

References computed here, independently of the engine's recompute code: a block's input is the
``[b, s, h]`` hidden state (``b·s·h·4`` bytes in fp32); an eager GPT-2 attention core keeps its
softmax output and dropout output (``a·s²·b`` elements each, 4 bytes) and the dropout mask (1
byte), ``9·a·s²·b`` bytes (Korthikanti et al. 2022, section 4, at 32 bits); full recomputation
runs each block's forward again in its backward (section 5).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import engine.plan.make as make_mod
from engine.config import ParallelConfig
from engine.cost import CostModel
from engine.errors import TransformError
from engine.graph import capture
from engine.io.plan import load_plan, save_plan
from engine.models.hf import build_hf
from engine.plan import make_plan, predicted_metrics
from engine.plan.make import placement_from_segments
from engine.shape_costs import model_shape_placement
from engine.transform import is_block_layer, layer_costs, split_segments
from planner_ui.sources import recompute_columns

B, S, H, A = 2, 128, 64, 4   # gpt2-tiny: hidden 64, 4 heads; 4 blocks


@functools.lru_cache(maxsize=None)
def _graph(attn: str = "eager"):
    module, _ = build_hf("gpt2-tiny", attn_implementation=attn, attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
    return capture(module, (torch.zeros(B, S, dtype=torch.long, device="meta"),))


COST = CostModel.for_device("a100")


def _split(recompute: str, *, attn: str = "eager", pp: int = 2, **kw):
    cfg = ParallelConfig(pp=pp, micro_batches=4, recompute=recompute, **kw)
    segs, warnings = split_segments(_graph(attn), COST, cfg)
    return segs, warnings


def _blocks(seg) -> list[str]:
    return [name for name in seg.layers if is_block_layer(name)]


def test_full_keeps_only_block_inputs_and_recomputes_their_forward():
    none, _ = _split("none")
    full, _ = _split("full")
    costs = {lc.name: lc for lc in layer_costs(_graph(), COST, 1)}
    for n, f in zip(none, full):
        assert n.layers == f.layers   # same split here (no memory bound hit)
        others = sum(costs[name].activation_bytes for name in n.layers if not is_block_layer(name))
        assert f.activation_bytes == len(_blocks(f)) * B * S * H * 4 + others
        fwd_blocks = sum(costs[name].forward_time for name in _blocks(f))
        assert f.recompute_time == pytest.approx(fwd_blocks)
        assert f.backward_time - n.backward_time == pytest.approx(fwd_blocks)
        assert f.recompute_transient_bytes == max(costs[name].activation_bytes for name in _blocks(f))
        assert f.forward_time == n.forward_time


def test_selective_drops_exactly_the_attention_core():
    none, _ = _split("none")
    sel, _ = _split("selective")
    full, _ = _split("full")
    for n, s, f in zip(none, sel, full):
        core = 9 * A * S * S * B   # softmax output + dropout output (fp32) + 1-byte mask
        assert n.activation_bytes - s.activation_bytes == len(_blocks(n)) * core
        assert s.recompute_transient_bytes == core
        assert 0 < s.recompute_time < f.recompute_time
        assert s.backward_time - n.backward_time == pytest.approx(s.recompute_time)


def test_fused_attention_has_nothing_to_drop():
    none, _ = _split("none", attn="sdpa")
    sel, _ = _split("selective", attn="sdpa")
    for n, s in zip(none, sel):
        assert s.activation_bytes == n.activation_bytes
        assert s.recompute_time == 0.0 and s.backward_time == n.backward_time


def test_full_with_tensor_parallelism_keeps_the_input_whole_unless_sequence_parallel():
    plain, _ = _split("full", pp=1, tp=2)
    sp, _ = _split("full", pp=1, tp=2, transforms=("tp-split",))
    costs_plain = {lc.name: lc for lc in layer_costs(_graph(), COST, 2)}
    costs_sp = {lc.name: lc for lc in layer_costs(_graph(), COST, 2, sequence_parallel=True)}
    n_blocks = len(_blocks(plain[0]))
    others = sum(lc.activation_bytes for name, lc in costs_plain.items() if not is_block_layer(name))
    others_sp = sum(lc.activation_bytes for name, lc in costs_sp.items() if not is_block_layer(name))
    assert plain[0].activation_bytes == n_blocks * B * S * H * 4 + others
    assert sp[0].activation_bytes == n_blocks * B * S * H * 4 // 2 + others_sp


def test_split_backward_counts_the_recompute_in_both_halves():
    """I and W are two autograd passes, each recomputing the checkpointed forward (the runtime's
    count is checked in tests/runtime/test_weight_grad.py)."""
    cfg = ParallelConfig(pp=2, micro_batches=4)
    none, _ = _split("none")
    full, _ = _split("full")
    pn = placement_from_segments(none, cfg, "zb-h1")
    pf = placement_from_segments(full, dataclasses.replace(cfg, recompute="full"), "zb-h1")
    for s in full:
        i_n, i_f = pn.spec("I", s.index).duration, pf.spec("I", s.index).duration
        w_n, w_f = pn.spec("W", s.index).duration, pf.spec("W", s.index).duration
        assert i_f - i_n == pytest.approx(s.recompute_time)
        assert w_f - w_n == pytest.approx(s.recompute_time)
        assert pf.spec("F", s.index).memory == s.activation_bytes
    # each device reserves its recomputation working set
    for d, s in enumerate(full):
        assert pf.static_bytes(d) - pn.static_bytes(d) == s.recompute_transient_bytes


def test_memory_bound_sees_the_reduced_activations():
    """A limit between what one stage needs without and with full recomputation: the split
    without cannot fit (a warning), the one with it can."""
    def need(seg, inflight):
        return 4 * seg.param_bytes + seg.max_param_bytes + inflight * seg.activation_bytes + \
            seg.recompute_transient_bytes
    none, _ = _split("none", pp=1)
    full, _ = _split("full", pp=1)
    limit = (need(none[0], 1) + need(full[0], 1)) / 2
    cfg = ParallelConfig(pp=1, micro_batches=4)
    _, warn_none = split_segments(_graph(), COST, cfg, memory_limit=limit)
    _, warn_full = split_segments(_graph(), COST, dataclasses.replace(cfg, recompute="full"), memory_limit=limit)
    assert any("no split" in w for w in warn_none) and not warn_full


def test_stage_recompute_overrides_per_stage():
    cfg = ParallelConfig(pp=2, micro_batches=4)
    segs, _ = split_segments(_graph(), COST, cfg, stage_recompute=["full", "none"])
    full, _ = _split("full")
    none, _ = _split("none")
    assert [s.recompute for s in segs] == ["full", "none"]
    assert segs[0].activation_bytes == full[0].activation_bytes
    assert segs[1].activation_bytes == none[1].activation_bytes
    with pytest.raises(TransformError, match="one per segment"):
        split_segments(_graph(), COST, cfg, stage_recompute=["full", "none", "full"])
    with pytest.raises(TransformError, match="unknown recomputation"):
        split_segments(_graph(), COST, cfg, stage_recompute=["some", "none"])


def test_segment_json_has_recompute_fields_only_when_set():
    none, _ = _split("none")
    full, _ = _split("full")
    assert not {"recompute", "recompute_time", "recompute_transient_bytes"} & set(none[0].to_dict())
    d = full[0].to_dict()
    assert d["recompute"] == "full" and d["recompute_time"] == full[0].recompute_time > 0
    assert d["recompute_transient_bytes"] == full[0].recompute_transient_bytes


@pytest.mark.parametrize("split_backward", [False, True])
def test_model_shape_placement_sees_recompute(split_backward):
    g = _graph()
    pn, parts_n = model_shape_placement(g, COST, "v", 2, split_backward=split_backward)
    pf, parts_f = model_shape_placement(g, COST, "v", 2, split_backward=split_backward, recompute="full")
    costs = {lc.name: lc for lc in layer_costs(g, COST, 1)}
    for s, (a, b) in enumerate(zip(parts_n, parts_f)):
        fwd_blocks = sum(costs[name].forward_time for name in a["layers"] if is_block_layer(name))
        assert b["recompute_time"] == pytest.approx(fwd_blocks) and "recompute_time" not in a
        assert b["backward_time"] - a["backward_time"] == pytest.approx(fwd_blocks)
        assert b["activation_bytes"] < a["activation_bytes"]
        assert pf.spec("F", s).memory == b["activation_bytes"]
        if split_backward:
            assert pf.spec("I", s).duration - pn.spec("I", s).duration == pytest.approx(fwd_blocks)
            assert pf.spec("W", s).duration - pn.spec("W", s).duration == pytest.approx(fwd_blocks)
        else:
            assert pf.spec("B", s).duration - pn.spec("B", s).duration == pytest.approx(fwd_blocks)
        assert pf.static_bytes(s) - pn.static_bytes(s) == b["recompute_transient_bytes"]


def test_make_plan_with_full_recompute(monkeypatch, tmp_path):
    """End to end (``ParallelConfig.recompute`` set where ``make_plan`` builds it): a lower
    predicted peak, a longer step, the recompute in the plan JSON and hatched in the Gantt."""
    base = make_plan("gpt2-tiny", devices=2, micro_batches=4, device_type="a100")
    orig = make_mod.parallel_config
    monkeypatch.setattr(make_mod, "parallel_config",
                        lambda *a, **k: dataclasses.replace(orig(*a, **k), recompute="full"))
    res = make_plan("gpt2-tiny", devices=2, micro_batches=4, device_type="a100")
    assert res.plan.parallel.recompute == "full"
    m0, m1 = predicted_metrics(base.plan), predicted_metrics(res.plan)
    assert max(m1["peak_memory"]) < max(m0["peak_memory"])
    assert m1["makespan"] > m0["makespan"]
    path = tmp_path / "plan.json"
    save_plan(res.plan, path)
    again = load_plan(path)
    assert [s.get("recompute_time") for s in again.segments] == [s.get("recompute_time") for s in res.plan.segments]
    cols = recompute_columns(res.timeline, res.plan.segments, scale=1e3)
    n_b = sum(1 for e in res.timeline.events if e.op == "B")
    assert len(cols["left"]) == n_b > 0
    rc = {s["index"]: s["recompute_time"] * 1e3 for s in res.plan.segments}
    for left, right, seg in zip(cols["left"], cols["right"], cols["segment"]):
        assert right - left == pytest.approx(rc[seg])
    assert recompute_columns(base.timeline, base.plan.segments)["left"] == []
    from planner_ui.gantt import GanttView  # panel: imported by the one check that needs it
    from planner_ui.state import PlanState

    state = PlanState()
    state.load(res.plan)
    view = GanttView(state=state)
    view.refresh()
    assert list(view.recompute_source.data["name"]) == cols["name"]
    assert view.recompute_renderer.glyph.hatch_pattern == "/"
    assert ("recomputed forward", "@recompute{0.000} ms (@granularity)") in view.recompute_hover.tooltips


def test_a_recomputing_plan_takes_the_layer_split_the_runtime_needs():
    """``make_plan(recompute="full")`` of a decoder the layer split supports records the ``layers``
    split (checkpointing wraps eager blocks), so the runtime accepts it before any Ray work; without
    recomputation the same model keeps the tracer split."""
    from engine.plan import make_plan
    from runtime.stages.checks import check_executable

    kw = dict(device_type="cpu", devices=2, micro_batches=2, schedule="1f1b")
    for model in ("llama-tiny", "gpt2-tiny"):
        full = make_plan(model, recompute="full", **kw).plan
        plain = make_plan(model, **kw).plan
        assert (full.model.split, plain.model.split) == ("layers", "tracer"), model
        check_executable(full)


def test_a_model_without_the_layer_split_under_tensor_parallelism_is_refused_in_one_sentence(tmp_path):
    """A model whose layout the layer split does not know (OPT) keeps the tracer split even when it
    recomputes with tp=2, and the runtime refuses it naming the model and --tp 1."""
    import re

    from unsplit_model import opt_model

    from engine.plan import make_plan
    from runtime.stages import RuntimeNotSupported
    from runtime.stages.checks import check_executable

    name = opt_model(tmp_path)
    plan = make_plan(name, device_type="cpu", devices=2, tp=2, micro_batches=2, schedule="1f1b",
                     recompute="full").plan
    assert plan.model.split == "tracer"
    with pytest.raises(RuntimeNotSupported, match=rf"tp=2.*'{re.escape(name)}'.*--tp 1") as e:
        check_executable(plan)
    assert "\n" not in str(e.value)
