"""The ``seq2seq`` task: T5-style span corruption of CPython source bytes (Raffel et al., JMLR
2020, section 3.1.4; ``random_spans_noise_mask`` and ``noise_span_to_unique_sentinel`` of
google-research/text-to-text-transfer-transformer, ``t5/data/preprocessors.py``).

Lengths (:func:`tasks.span.span_corruption_lengths`): for an encoder length ``T`` a raw window
of ``raw_len`` bytes holds ``noise`` noise bytes in ``spans`` spans (``T = raw_len - noise +
spans``, ``T' = noise + spans``). Per row the window is cut at random into ``spans`` non-empty
non-noise runs and ``spans`` non-empty noise runs, interleaved non-noise first (as T5's
``_random_segmentation``; mean noise span length 3). Sentinel ``k`` is id ``vocab_size - 1 - k``
(T5's ``<extra_id_k>``).

Batch ``(input_ids [rows, T], decoder_input_ids [rows, T'], labels [rows, T'])``, int64:

- ``input_ids``: each non-noise run followed by the sentinel of the span that replaced it;
- ``labels``: for each span its sentinel, then its bytes;
- ``decoder_input_ids``: ``labels`` shifted right by one, starting with id 0 (T5's
  ``decoder_start_token_id``, the pad id).

Loss: mean cross-entropy of logits ``[rows, T', V]`` against ``labels``. Throughput counts the
encoder tokens, ``rows * T`` (the planner's tokens). Needs ``vocab_size >= 256 + spans`` so the
sentinels stay above the byte ids.
"""

from __future__ import annotations

import torch

from engine.errors import TaskError
from tasks import _seed
from tasks.base import Task, TaskContext, Unit
from tasks.span import MEAN_SPAN, NOISE_DENSITY, _lengths, span_corruption_lengths
from tasks.text import _seq_len, byte_corpus, token_loss

__all__ = ["SpanCorruption", "DECODER_START_ID"]

DECODER_START_ID = 0
"""First decoder input id (T5's ``decoder_start_token_id`` = the pad id 0)."""


def _segments(n: int, k: int, gen: torch.Generator) -> list[int]:
    """``n`` items cut into ``k`` non-empty runs at random: the run lengths (sum ``n``)."""
    if k == 1:
        return [n]
    cuts = (torch.randperm(n - 1, generator=gen)[:k - 1] + 1).sort().values.tolist()
    bounds = [0, *cuts, n]
    return [b - a for a, b in zip(bounds, bounds[1:])]


class SpanCorruption(Task):
    """T5 span corruption (see the module docstring).

    Args:
        ctx: ``seq_len`` (the encoder length ``T``), ``vocab_size``, ``seed``.

    Raises:
        TaskError: no ``seq_len``, no window corrupting into exactly ``T`` tokens, or a
            vocabulary without room for the sentinels above the 256 bytes.
    """

    name = "seq2seq"
    unit: Unit = "tokens"
    input_names = ("input_ids", "decoder_input_ids")
    vocab_parallel_loss = True

    def __init__(self, ctx: TaskContext):
        self.seq_len = _seq_len(ctx, self.name)
        try:
            self.raw_len, self.target_len = span_corruption_lengths(self.seq_len)
        except ValueError as e:
            raise TaskError(f"task seq2seq cannot corrupt windows into {self.seq_len} tokens: {e}") from e
        inp, tgt, self.noise = _lengths(self.raw_len, NOISE_DENSITY, MEAN_SPAN)
        self.spans = tgt - self.noise
        if self.raw_len - self.noise < self.spans:
            raise TaskError(f"task seq2seq: a window of {self.raw_len} bytes has too few non-noise bytes for "
                            f"{self.spans} spans; use a longer seq_len")
        if ctx.vocab_size is None or ctx.vocab_size < 256 + self.spans:
            raise TaskError(f"task seq2seq needs {self.spans} sentinel ids above the 256 byte ids, but "
                            f"{ctx.model_name} has vocab_size={ctx.vocab_size}; use a model with "
                            f"vocab_size >= {256 + self.spans} (e.g. t5-tiny)")
        self.vocab_size = int(ctx.vocab_size)
        self.seed = int(ctx.seed)
        self.corpus = byte_corpus(self.raw_len, self.seed)

    def sentinel(self, k: int) -> int:
        """Id of sentinel ``k`` (``vocab_size - 1 - k``)."""
        return self.vocab_size - 1 - k

    def corrupt(self, raw: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        """``(input_ids [rows, T], decoder_input_ids [rows, T'], labels [rows, T'])`` of byte
        windows ``raw`` int64 ``[rows, raw_len]`` (random spans drawn from ``gen``)."""
        rows = raw.shape[0]
        inputs = torch.empty(rows, self.seq_len, dtype=torch.long)
        labels = torch.empty(rows, self.target_len, dtype=torch.long)
        for r in range(rows):
            keep = _segments(self.raw_len - self.noise, self.spans, gen)
            drop = _segments(self.noise, self.spans, gen)
            src = raw[r].tolist()
            enc: list[int] = []
            dec: list[int] = []
            pos = 0
            for k, (a, b) in enumerate(zip(keep, drop)):
                enc += src[pos:pos + a]
                enc.append(self.sentinel(k))
                pos += a
                dec.append(self.sentinel(k))
                dec += src[pos:pos + b]
                pos += b
            inputs[r] = torch.tensor(enc)
            labels[r] = torch.tensor(dec)
        decoder = torch.full_like(labels, DECODER_START_ID)
        decoder[:, 1:] = labels[:, :-1]
        return inputs, decoder, labels

    def train_batch(self, step: int, rows: int) -> tuple[torch.Tensor, ...]:
        """``(input_ids, decoder_input_ids, labels)`` of training step ``step``."""
        return self.corrupt(self.corpus.train_batch(step, rows), _seed.generator(self.seed, step, _seed.TRAIN))

    def val_batch(self, index: int, rows: int) -> tuple[torch.Tensor, ...]:
        """Like :meth:`train_batch` from the validation files."""
        return self.corrupt(self.corpus.val_batch(index, rows), _seed.generator(self.seed, index, _seed.VAL))

    def loss(self, output: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (nats/token) of logits ``[rows, T', V]`` against ``labels [rows, T']``."""
        return token_loss(output, targets[0])

    def count(self, *targets: torch.Tensor) -> int:
        """Encoder tokens: ``rows * T``."""
        return int(targets[0].shape[0]) * self.seq_len
