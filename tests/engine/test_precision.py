"""Precision policies in the planner's memory and communication models (issue 31, item 1).

References computed here, independently of the engine: the parameter count of the built model
(``sum(p.numel())`` over its parameters, tied ones once) times Megatron-LM's bytes per parameter
(``docs/source/api-guide/dist_optimizer.md``: 16 / 18 / 20 non-distributed for fp32 / bf16 / fp16
parameters with fp32 Adam states; distributed ``8 + 8/d``, ``6 + 12/d``, ``4 + 16/d``), and
8 (``4 + 4/d`` sharded) for pure bf16 (weights, gradients and Adam's two moments in 2 bytes).
"""

from __future__ import annotations

import pytest
import torch

from engine.errors import ScheduleError, TesselError
from engine.models import build_model
from engine.models.registry import register_model
from engine.plan import make_plan
from engine.plan.metrics import memory_advice
from engine.precision import DTYPE_PRECISION, POLICIES, resolve_precision

#: Megatron-LM's bytes per parameter (weights + gradients + master weights + Adam's m, v [+ fp32
#: gradient copy]) and the distributed optimizer's ``(whole, sharded)`` split: ``whole + sharded / d``.
MEGATRON = {"32-true": (16, (8, 8)), "bf16-mixed": (18, (6, 12)), "16-mixed": (20, (4, 16)), "bf16-true": (8, (4, 4))}


def _param_count(name: str, **kw) -> int:
    module = build_model(name, **kw).module
    return sum(p.numel() for p in module.parameters())   # nn.Module.parameters() yields tied weights once


def _bytes(res) -> tuple[int, int]:
    """(weights + optimizer states, gradients) of the one pipeline rank of a pp=1 plan."""
    mb = res.plan.metrics["memory_breakdown"]
    return mb["weights_and_optimizer_states"], mb["gradients"]


@pytest.mark.parametrize("precision", list(POLICIES))
def test_bytes_per_parameter_follow_megatron_table(precision):
    n = _param_count("gpt2-tiny", seq_len=32)
    res = make_plan("gpt2-tiny", devices=1, micro_batches=2, seq_len=32, precision=precision)
    states, grads = _bytes(res)
    total, _ = MEGATRON[precision]
    assert states + grads == n * total
    assert grads == n * POLICIES[precision].grad_bytes
    assert res.plan.parallel.precision == precision
    # activations are stored in the compute dtype: the captured model is in it
    assert res.plan.model.dtype == POLICIES[precision].compute_dtype


@pytest.mark.parametrize("precision", list(POLICIES))
def test_sharded_update_divides_the_sharded_part_by_dp(precision):
    d = 2
    n = _param_count("gpt2-tiny", seq_len=32)
    res = make_plan("gpt2-tiny", devices=d, dp=d, micro_batches=2, seq_len=32, precision=precision,
                    transforms="sharded-update")
    states, grads = _bytes(res)
    whole, sharded = MEGATRON[precision][1]
    assert states + grads == pytest.approx(n * (whole + sharded / d), abs=8)


def _dp_allreduce_bytes(res) -> int:
    return sum(i.nbytes for s in res.execution.streams for i in s if i.op == "ALLREDUCE" and i.segment is not None)


def _tied_allreduce_bytes(res) -> int:
    return sum(i.nbytes for s in res.execution.streams for i in s if i.op == "ALLREDUCE" and i.segment is None)


def test_dp_and_tied_allreduce_bytes_follow_the_gradient_dtype():
    kw = dict(devices=4, dp=2, micro_batches=2, seq_len=32)
    f32 = make_plan("gpt2-tiny", precision="32-true", **kw)
    b16 = make_plan("gpt2-tiny", precision="bf16-true", **kw)
    mixed = make_plan("gpt2-tiny", precision="bf16-mixed", **kw)
    assert _dp_allreduce_bytes(f32) > 0 and _tied_allreduce_bytes(f32) > 0
    assert _dp_allreduce_bytes(b16) * 2 == _dp_allreduce_bytes(f32)
    assert _tied_allreduce_bytes(b16) * 2 == _tied_allreduce_bytes(f32)
    # bf16-mixed all-reduces fp32 gradients (Megatron's main_grad): as many bytes as 32-true
    assert _dp_allreduce_bytes(mixed) == _dp_allreduce_bytes(f32)
    # 32-true: each pipeline rank's all-reduce carries its parameter bytes, as before policies
    assert _dp_allreduce_bytes(f32) == sum(int(s["param_bytes"]) for s in f32.plan.segments)


def test_32_true_keeps_three_times_the_parameter_bytes():
    res = make_plan("gpt2-tiny", devices=1, micro_batches=2, seq_len=32, precision="32-true")
    pb = sum(int(s["param_bytes"]) for s in res.plan.segments)
    assert res.plan.placement.static_memory == (3 * pb,)
    assert res.plan.placement.grad_memory == (pb,)


def test_device_defaults_and_dtype_meaning():
    assert make_plan("gpt2-tiny", devices=1, micro_batches=1, seq_len=16).plan.parallel.precision == "bf16-mixed"
    assert make_plan("gpt2-tiny", devices=1, micro_batches=1, seq_len=16, device_type="a100"
                     ).plan.parallel.precision == "bf16-mixed"
    assert make_plan("gpt2-tiny", devices=1, micro_batches=1, seq_len=16, device_type="cpu"
                     ).plan.parallel.precision == "32-true"
    for dtype, policy in DTYPE_PRECISION.items():
        assert resolve_precision(None, dtype, "h100") == policy
    assert make_plan("gpt2-tiny", devices=1, micro_batches=1, seq_len=16, dtype="float32"
                     ).plan.parallel.precision == "32-true"
    # the cost model computes in the policy's compute dtype
    res = make_plan("gpt2-tiny", devices=1, micro_batches=1, seq_len=16, precision="16-mixed")
    assert res.plan.cost["dtype"] == "float16"


def test_contradicting_dtype_and_precision_is_refused():
    with pytest.raises(TesselError, match="contradicts"):
        make_plan("gpt2-tiny", devices=1, micro_batches=1, precision="bf16-mixed", dtype="float16")


def test_recompute_is_recorded():
    res = make_plan("gpt2-tiny", devices=1, micro_batches=1, seq_len=16, recompute="full", precision="32-true")
    assert res.plan.parallel.recompute == "full"
    with pytest.raises(TesselError):
        make_plan("gpt2-tiny", devices=1, micro_batches=1, recompute="some")


def _megatron_gpt(layers: int, hidden: int, heads: int, vocab: int, seq: int):
    """A builder of an HF GPT-2 of Megatron-LM's GPT shape (4h MLP, learned positions)."""
    def build(device, dtype):
        import transformers

        from engine.models import hf
        cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                      attn_implementation="sdpa")  # type: ignore[call-arg]
        with torch.device(device):
            module = hf.logits_only_class(transformers.GPT2LMHeadModel)(cfg)
        module.to(dtype=dtype)
        return module, hf.config_dict(cfg, "GPT2LMHeadModel")
    return build


def test_megatron_tp8_weights_and_states_at_least_16_bytes_per_parameter():
    """The 18.4B-shape check of issue 31 on a small GPT: under 16-mixed at tp 8, each GPU holds
    at least 16 bytes x params / 8 of weights and optimizer states (fp16 weights, fp32 master
    weights, Adam's m and v; the replicated layer norms make it a little more)."""
    register_model("prec-test-gpt", _megatron_gpt(2, 256, 8, 1024, 64), description="test", default_seq_len=64,
                   source="hf", vocab_size=lambda c: 1024, max_seq_len=lambda c: 64)
    n = _param_count("prec-test-gpt", seq_len=64)
    res = make_plan("prec-test-gpt", devices=8, tp=8, micro_batches=1, seq_len=64, precision="16-mixed",
                    device_type="a100")
    states, _ = _bytes(res)
    assert states >= 16 * n / 8
    assert states <= 18 * n / 8 * 1.5    # not everything replicated: the matmul weights are split 8 ways


def test_memory_advice_names_the_dominant_term_and_a_fix():
    """A plan above its memory limit: the refusal names the dominant term and the smallest fix."""
    kw = dict(devices=2, micro_batches=8, seq_len=128, precision="32-true", schedule="gpipe")
    with pytest.raises(ScheduleError, match="activations: .* per micro-batch x 8 micro-batches in flight.*"
                                            "smallest fix that fits: --schedule 1f1b") as e:
        make_plan("gpt2-tiny", memory_limit=9 * 2**20, **kw)
    assert e.value.rule == "memory" and "\n" not in str(e.value)
    res = make_plan("gpt2-tiny", **kw)
    mb = res.plan.metrics["memory_breakdown"]
    assert mb["micro_batches_in_flight"] == 8    # GPipe holds every micro-batch on the first rank
    # a limit the states alone fill: the states dominate; with dp the sharded update is the fix
    res = make_plan("gpt2-tiny", devices=2, dp=2, micro_batches=1, seq_len=16, precision="bf16-mixed")
    mb = res.plan.metrics["memory_breakdown"]
    res.plan.meta["memory_limit"] = mb["peak"] - mb["weights_and_optimizer_states"] // 4
    res.plan.metrics = {}
    text = memory_advice(res.plan)
    assert text.startswith(f"the peak (device {mb['device']}") and "weights and optimizer states" in text
    assert text.endswith("--transform sharded-update (Megatron's distributed optimizer)")
