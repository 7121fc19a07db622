"""The captured activation memory of a GPT block against Korthikanti et al.'s formula.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022),
section 4: a transformer layer keeps, at 16 bits with 1-byte dropout masks,

- no parallelism: ``s·b·h·(34 + 5·a·s/h)`` bytes;
- tensor parallel ``t``: ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` (the LayerNorm inputs, the inputs
  of the QKV and first MLP projections and the two dropout masks, ``10·s·b·h``, stay whole on
  every rank);
- with sequence parallelism (our CoCoNet ``tp-split``): ``s·b·h·(34/t + 5·a·s/(h·t))``;
- selective recomputation (section 5) drops the attention core's ``5·a·s/h`` term, and a fused
  attention (SDPA, FlashAttention) never stores the ``s x s`` scores, so it keeps ``34·s·b·h``
  (divided as above) either way.

The model: Hugging Face GPT-2 at the three GPT shapes of Narayanan et al. (SC'21, Table 1): 1.7B
(h 2,304, 24 heads), 18.4B (6,144, 48) and 145.6B (12,288, 96), sequence 2,048, micro-batch 1,
bf16, 2 layers (the count is per layer; the graph is captured on the meta device, so the full
hidden sizes cost nothing), with ``activation_function="gelu"`` (one fused GeLU op, as Megatron's
fused bias-GeLU; GPT-2's default ``gelu_new`` is written as 8 element-wise ops that each keep a
``4·s·b·h`` tensor, which the formula does not count) and GPT-2's dropout 0.1. Each case
checks the second block (``transformer.h.1``; block 0's input is the embedding's dropout output,
which the runtime keeps whole on every rank even with ``tp-split``) on one tensor-parallel rank
(:func:`engine.transform.layer_costs`) and the selective count (:func:`engine.recompute.kept_bytes`).

Every difference from the formula, each asserted exactly:

- eager attention: none. The count is the formula to the byte: LayerNorm inputs ``2+2``, QKV
  input ``2`` and output ``6`` (Q, K for ``Q·Kᵀ``, V for ``·V``), softmax output ``2as/h``, its
  dropout mask ``as/h`` and output ``2as/h``, the output projection's input ``2``, its dropout mask
  ``1``, the MLP input ``2``, GeLU input ``8`` and output ``8``, its dropout mask ``1`` (units of
  ``s·b·h`` bytes).
- SDPA: the boolean causal mask ``[b, 1, s, s]`` that Hugging Face builds and passes to
  ``scaled_dot_product_attention``, which keeps it for its backward: ``s·s·b`` bytes, the same
  on every tensor-parallel rank (built from the inputs only). The formula assumes an implicit
  causal mask (FlashAttention's ``is_causal``). It is ``s/h`` of ``s·b·h``: 0.9 at h 2,304, 0.17 at
  h 12,288. SDPA's output and the output projection's input are one tensor (the fused kernels
  write ``[b, s, heads, d]`` and the ``transpose(1, 2).contiguous()`` is free), counted once.
- dropout 0 (one extra case): no masks (``as/h + 2`` less), and a dropout of probability 0
  returns its input, so ``·V`` keeps the softmax output itself (``2as/h`` less).

The capture bugs these checks found and that are fixed: a dropout's mask and its output were
one entry (the mask was lost, ``as/h`` short); the fused attention output was counted twice
(by SDPA and by the output projection); the saved bytes of an op were divided by the op's own
tensor-parallel split, so the replicated LayerNorm output kept by a column-parallel projection
was wrongly divided by ``t``, and the attention dropout (a ``Dropout`` module, replicated
elsewhere) was wrongly not.
"""

from __future__ import annotations

import functools

import pytest
import torch

from engine.cost import CostModel
from engine.graph import capture
from engine.models.hf import build_hf
from engine.recompute import kept_bytes, working_set_bytes
from engine.transform import layer_costs

S, B = 2048, 1
SHAPES = {"1.7B": (2304, 24), "18.4B": (6144, 48), "145.6B": (12288, 96)}
TP_MODES = {"tp1": (1, False), "tp2": (2, False), "tp-split": (2, True)}
BLOCK = "transformer.h.1"


def korthikanti(h: int, a: int, t: int, sequence_parallel: bool, *, scores: bool) -> float:
    """Bytes per layer at 16 bits (section 4, eqs. 1-3); ``scores=False`` without the ``5as/h``
    term (selective recomputation or fused attention)."""
    sbh = S * B * h
    core = 5 * a * S / h if scores else 0.0
    if t == 1:
        return sbh * (34 + core)
    if sequence_parallel:
        return sbh * (34 / t + core / t)
    return sbh * (10 + 24 / t + core / t)


@functools.lru_cache(maxsize=None)
def _graph(h: int, a: int, attn: str, dropout: float = 0.1):
    module, _ = build_hf("gpt2", dtype=torch.bfloat16, n_layer=2, n_embd=h, n_head=a, n_positions=S,
                         vocab_size=51200, activation_function="gelu", attn_implementation=attn,
                         resid_pdrop=dropout, attn_pdrop=dropout, embd_pdrop=dropout)
    return capture(module, (torch.zeros(B, S, dtype=torch.long, device="meta"),))


def _block(h: int, a: int, attn: str, t: int, sp: bool, dropout: float = 0.1):
    costs = layer_costs(_graph(h, a, attn, dropout), CostModel.for_device("a100"), t, sequence_parallel=sp)
    return next(lc for lc in costs if lc.name == BLOCK)


@pytest.mark.parametrize("mode", list(TP_MODES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_eager_attention_matches_formula(shape, mode):
    """Eager attention keeps the formula's bytes exactly; selective drops exactly ``5as/h``."""
    (h, a), (t, sp) = SHAPES[shape], TP_MODES[mode]
    lc = _block(h, a, "eager", t, sp)
    la = lc.activation()
    full = korthikanti(h, a, t, sp, scores=True)
    sel = korthikanti(h, a, t, sp, scores=False)
    assert abs(la.saved_bytes - full) <= 0.10 * full
    assert abs(kept_bytes(la, "selective") - sel) <= 0.10 * sel
    assert la.saved_bytes == pytest.approx(full, abs=8)   # integer division by t of each tensor
    assert kept_bytes(la, "selective") == pytest.approx(sel, abs=8)
    assert la.core_bytes == pytest.approx(5 * a * S * S * B / t, abs=8)
    assert working_set_bytes(la, "selective") == la.core_bytes


@pytest.mark.parametrize("mode", list(TP_MODES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_sdpa_matches_formula_without_scores(shape, mode):
    """SDPA never stores the scores: ``34`` (divided by the parallelism) plus HF's causal mask;
    selective recomputation has nothing to drop and recomputes nothing."""
    (h, a), (t, sp) = SHAPES[shape], TP_MODES[mode]
    la = _block(h, a, "sdpa", t, sp).activation()
    ref = korthikanti(h, a, t, sp, scores=False)
    mask = S * S * B  # bool [b, 1, s, s], whole on every rank
    for kept in (la.saved_bytes, kept_bytes(la, "selective")):
        assert abs(kept - ref) <= 0.10 * ref
        assert kept == pytest.approx(ref + mask, abs=8)
    assert la.core_bytes == 0 and la.core_time == 0.0


def test_no_dropout_keeps_no_masks():
    """Dropout 0: the formula less the masks (``as/h + 2``) and the dropout output (``2as/h``)."""
    h, a = SHAPES["1.7B"]
    la = _block(h, a, "eager", 1, False, dropout=0.0).activation()
    sbh = S * B * h
    ref = korthikanti(h, a, 1, False, scores=True) - sbh * (a * S / h + 2) - sbh * 2 * a * S / h
    assert la.saved_bytes == pytest.approx(ref, abs=8)


def test_145b_block_at_tp8():
    """The 145.6B shape's block at tp 8 (h 12,288, a 96, s 2,048, b 1, bf16): none, selective
    and full against the formula (full keeps the block's input, ``2·s·b·h``, whole per rank)."""
    h, a = SHAPES["145.6B"]
    sbh = S * B * h
    for attn in ("eager", "sdpa"):
        la = _block(h, a, attn, 8, False).activation()
        assert kept_bytes(la, "full") == 2 * sbh
        none_ref = korthikanti(h, a, 8, False, scores=attn == "eager")
        assert abs(la.saved_bytes - none_ref) <= 0.10 * none_ref
        sel_ref = korthikanti(h, a, 8, False, scores=False)
        assert abs(kept_bytes(la, "selective") - sel_ref) <= 0.10 * sel_ref
