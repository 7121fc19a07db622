"""Static lengths of T5-style span corruption (Raffel et al., JMLR 2020, section 3.1.4).

A window of ``raw_len`` bytes gets ``noise = round(raw_len * noise_density)`` noise tokens in
``spans = max(1, round(noise / mean_span))`` spans; the encoder input keeps the other tokens and one
sentinel per span (``raw_len - noise + spans`` tokens), the target holds each span's sentinel and
its tokens (``noise + spans`` tokens). Both lengths depend only on ``raw_len``, so every batch has
the same shapes (what a pipeline's pre-allocated buffers need). Same computation as T5's
``compute_input_and_target_lengths`` (t5/data/preprocessors.py), without the EOS token: bytes
have no end-of-sequence id.
"""

from __future__ import annotations

__all__ = ["span_corruption_lengths", "NOISE_DENSITY", "MEAN_SPAN"]

NOISE_DENSITY = 0.15
MEAN_SPAN = 3.0


def _lengths(raw: int, density: float, mean_span: float) -> tuple[int, int, int]:
    noise = max(1, min(raw - 1, round(raw * density)))
    spans = max(1, round(noise / mean_span))
    return raw - noise + spans, noise + spans, noise


def span_corruption_lengths(seq_len: int, noise_density: float = NOISE_DENSITY,
                            mean_span: float = MEAN_SPAN) -> tuple[int, int]:
    """``(raw_len, target_len)``: the raw window whose corrupted input has exactly ``seq_len``
    tokens, and the target length.

    Raises:
        ValueError: ``seq_len < 2`` or no window gives exactly ``seq_len`` input tokens.
    """
    if seq_len < 2:
        raise ValueError(f"span corruption needs seq_len >= 2, got {seq_len}")
    for raw in range(seq_len, 2 * seq_len + 8):
        inp, tgt, _ = _lengths(raw, noise_density, mean_span)
        if inp == seq_len:
            return raw, tgt
    raise ValueError(f"no window length corrupts into exactly {seq_len} input tokens "
                     f"(noise density {noise_density}, mean span {mean_span})")
