"""Model FLOPs utilization of a plan (issue 31, item 7), against hand computations.

References: Megatron-LM's model FLOPs (Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC'21, section 5.1): a GPT step of batch ``B``,
sequence ``s``, ``l`` layers, hidden ``h``, vocabulary ``V`` without recomputation is
``72 B s l h^2 (1 + s/(6h) + V/(16 l h))`` FLOPs (forward + backward = 3 x forward; their 96 counts
the recomputed forward, which is not model FLOPs); the ``6 N`` FLOPs per token approximation
(Kaplan et al. 2020) for ``N`` parameters when ``s << 6h``. The H100 SXM's dense bf16 peak is
989 TFLOP/s (NVIDIA's datasheet).
"""

from __future__ import annotations

import pytest

from engine.models import build_model
from engine.plan import make_plan, predicted_metrics
from engine.plan.metrics import MEMORY_BREAKDOWN_KEYS, METRIC_KEYS

H100_BF16_PEAK = 989e12


def test_mfu_equals_the_hand_computation_from_the_segments():
    m, dp, tp = 4, 2, 2
    res = make_plan("gpt2-tiny", devices=2 * dp * tp, dp=dp, tp=tp, micro_batches=m, seq_len=64)
    plan, met = res.plan, res.plan.metrics
    forward = sum(float(s["flops"]) for s in plan.segments) * tp
    flops = 3 * forward * m * dp
    assert met["model_flops"] == pytest.approx(flops, rel=1e-12)
    tflops = flops / met["makespan"] / (dp * tp * 2) / 1e12
    assert met["tflops_per_device"] == pytest.approx(tflops, rel=1e-12)
    assert plan.parallel.precision == "bf16-mixed"
    assert met["mfu"] == pytest.approx(tflops * 1e12 / H100_BF16_PEAK, rel=1e-12)
    assert set(METRIC_KEYS) <= set(met) and set(MEMORY_BREAKDOWN_KEYS) == set(met["memory_breakdown"])


def test_model_flops_match_megatron_formula_for_a_gpt():
    seq, m = 128, 4
    cfg = build_model("gpt2-tiny", seq_len=seq).config
    h, layers, vocab = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"]
    megatron = 72 * m * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))
    for tp in (1, 2):
        res = make_plan("gpt2-tiny", devices=2 * tp, tp=tp, micro_batches=m, seq_len=seq)
        # the formula leaves out layer norms, softmax, GELU and the residual adds (a few %)
        assert res.plan.metrics["model_flops"] == pytest.approx(megatron, rel=0.05)


def test_model_flops_are_about_6_n_per_token_for_a_short_sequence():
    seq, m = 16, 4
    module = build_model("gpt2-tiny", seq_len=seq).module
    n = sum(p.numel() for p in module.parameters())
    res = make_plan("gpt2-tiny", devices=2, micro_batches=m, seq_len=seq)
    assert res.plan.metrics["model_flops"] == pytest.approx(6 * n * m * seq, rel=0.1)


def test_recomputation_is_not_model_flops():
    kw = dict(devices=2, micro_batches=2, seq_len=32)
    none = make_plan("gpt2-tiny", recompute="none", **kw).plan.metrics
    full = make_plan("gpt2-tiny", recompute="full", **kw).plan.metrics
    assert full["model_flops"] == none["model_flops"] > 0


def test_metrics_of_a_saved_plan_equal_the_planned_ones(tmp_path):
    from engine.io import load_plan, save_plan

    res = make_plan("gpt2-tiny", devices=2, micro_batches=2, seq_len=32)
    save_plan(res.plan, tmp_path / "plan.json")
    m = predicted_metrics(load_plan(tmp_path / "plan.json"))
    for k in ("model_flops", "tflops_per_device", "mfu", "memory_breakdown"):
        assert m[k] == res.plan.metrics[k]
