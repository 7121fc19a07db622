"""The byte-level text tasks ``causal-lm`` and ``masked-lm`` on the CPython standard library
sources (:class:`tasks.corpus.ByteCorpus`: bytes 0..255 are the token ids, no tokenizer).

- ``causal-lm`` (:class:`CausalLM`, GPT-style next-token prediction): a batch is
  ``(input_ids [rows, T], labels [rows, T])``, both int64, from windows of ``T + 1`` bytes:
  ``input_ids = window[:, :-1]``, ``labels = window[:, 1:]``; the loss is the mean
  cross-entropy of logits ``[rows, T, V]`` (float32) over all ``rows * T`` positions.
- ``masked-lm`` (:class:`MaskedLM`, BERT's masked language model, Devlin et al., NAACL 2019,
  section 3.1; ``create_pretraining_data.py`` of google-research/bert): windows of ``T`` bytes;
  exactly ``max(1, round(0.15 * T))`` positions per row are selected (as BERT's
  ``num_to_predict``), of which 80% become the ``[MASK]`` id ``vocab_size - 1``, 10% a random byte
  and 10% stay; ``labels`` hold the original byte at selected positions and ``-100`` elsewhere.
  The loss is cross-entropy with ``ignore_index=-100``: the mean over the selected positions of
  the micro-batch. Needs ``vocab_size > 256`` (room for ``[MASK]`` above the bytes).

Both count throughput in tokens (``rows * T`` per batch) and are deterministic in
``(seed, step)``; validation batches come from the held-out files of the corpus.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.errors import DataError, TaskError
from tasks import _seed
from tasks.base import Task, TaskContext, Unit
from tasks.corpus import ByteCorpus

__all__ = ["CausalLM", "MaskedLM", "byte_corpus", "split_rows", "token_loss", "MASK_PROB", "IGNORE_INDEX"]

MASK_PROB = 0.15
"""Share of positions selected for prediction (BERT's ``masked_lm_prob``)."""

IGNORE_INDEX = -100
"""Label of positions without a target (``torch.nn.functional.cross_entropy``'s default)."""


@functools.lru_cache(maxsize=16)
def byte_corpus(window: int, seed: int) -> ByteCorpus:
    """The standard-library :class:`ByteCorpus` whose rows hold ``window`` bytes (its ``seq_len``
    is ``window - 1``), cached per ``(window, seed)``.

    Raises:
        TaskError: the corpus cannot be built (no standard library sources, too little text).
    """
    try:
        return ByteCorpus(seq_len=window - 1, seed=seed)
    except (DataError, ValueError) as e:
        raise TaskError(f"the byte corpus cannot be built: {e}") from e


def split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of byte windows ``rows`` int64 ``[B, T + 1]``: ``rows[:, :-1]`` and
    ``rows[:, 1:]``, contiguous ``[B, T]`` (the causal-lm batch of a legacy single-tensor batch)."""
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def token_loss(logits: torch.Tensor, labels: torch.Tensor, **kw) -> torch.Tensor:
    """Mean cross-entropy of logits ``[..., V]`` against int64 labels ``[...]`` (float32)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), **kw)


def _seq_len(ctx: TaskContext, task: str) -> int:
    if ctx.seq_len is None or ctx.seq_len < 1:
        raise TaskError(f"task {task} needs a model with a sequence length, but {ctx.model_name} has "
                        f"seq_len={ctx.seq_len}; plan it with --seq-len or choose a task that fits")
    return int(ctx.seq_len)


class CausalLM(Task):
    """Next-byte prediction (see the module docstring for shapes and loss).

    Args:
        ctx: ``seq_len`` (``T``, required), ``vocab_size`` (``>= 256`` when known), ``seed``.

    Raises:
        TaskError: no ``seq_len``, a vocabulary smaller than 256, or no corpus.
    """

    name = "causal-lm"
    unit: Unit = "tokens"
    input_names = ("input_ids",)
    vocab_parallel_loss = True

    def __init__(self, ctx: TaskContext):
        self.seq_len = _seq_len(ctx, self.name)
        if ctx.vocab_size is not None and ctx.vocab_size < 256:
            raise TaskError(f"task causal-lm trains on bytes (ids 0..255) but {ctx.model_name} has a vocabulary "
                            f"of {ctx.vocab_size}; use a model with vocab_size >= 256")
        self.seed = int(ctx.seed)
        self.corpus = byte_corpus(self.seq_len + 1, self.seed)

    def train_batch(self, step: int, rows: int) -> tuple[torch.Tensor, ...]:
        """``(input_ids, labels)``, int64 ``[rows, T]`` each: the windows of
        ``ByteCorpus.train_batch(step, rows)`` shifted by one byte."""
        return split_rows(self.corpus.train_batch(step, rows))

    def val_batch(self, index: int, rows: int) -> tuple[torch.Tensor, ...]:
        """Like :meth:`train_batch` from the validation files (``ByteCorpus.val_batch``)."""
        return split_rows(self.corpus.val_batch(index, rows))

    def loss(self, output: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (nats/token) of logits ``[rows, T, V]`` against ``labels [rows, T]``."""
        return token_loss(output, targets[0])


class MaskedLM(Task):
    """BERT-style masked language modelling on bytes (see the module docstring).

    Args:
        ctx: ``seq_len`` (``T``), ``vocab_size`` (``> 256``; ``[MASK]`` = ``vocab_size - 1``), ``seed``.

    Raises:
        TaskError: no ``seq_len``, no vocabulary above the 256 bytes, or no corpus.
    """

    name = "masked-lm"
    unit: Unit = "tokens"
    input_names = ("input_ids",)
    vocab_parallel_loss = True

    def __init__(self, ctx: TaskContext):
        self.seq_len = _seq_len(ctx, self.name)
        if ctx.vocab_size is None or ctx.vocab_size <= 256:
            raise TaskError(f"task masked-lm needs a [MASK] id above the 256 byte ids, but {ctx.model_name} has "
                            f"vocab_size={ctx.vocab_size}; use a model with vocab_size > 256 (e.g. bert-tiny)")
        self.vocab_size = int(ctx.vocab_size)
        self.mask_id = self.vocab_size - 1
        self.num_predict = max(1, round(MASK_PROB * self.seq_len))
        self.seed = int(ctx.seed)
        self.corpus = byte_corpus(self.seq_len, self.seed)

    def mask(self, raw: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)`` of byte windows ``raw`` int64 ``[rows, T]`` (draws from ``gen``)."""
        rows, t = raw.shape
        order = torch.rand(rows, t, generator=gen).argsort(dim=1)
        selected = torch.zeros(rows, t, dtype=torch.bool)
        selected.scatter_(1, order[:, :self.num_predict], True)
        u = torch.rand(rows, t, generator=gen)
        random_bytes = torch.randint(0, 256, (rows, t), generator=gen)
        to_mask = selected & (u < 0.8)
        to_random = selected & (u >= 0.8) & (u < 0.9)
        inputs = raw.clone()
        inputs[to_mask] = self.mask_id
        inputs[to_random] = random_bytes[to_random]
        labels = torch.full_like(raw, IGNORE_INDEX)
        labels[selected] = raw[selected]
        return inputs, labels

    def train_batch(self, step: int, rows: int) -> tuple[torch.Tensor, ...]:
        """``(input_ids, labels)``, int64 ``[rows, T]`` each (labels ``-100`` where not selected)."""
        return self.mask(self.corpus.train_batch(step, rows), _seed.generator(self.seed, step, _seed.TRAIN))

    def val_batch(self, index: int, rows: int) -> tuple[torch.Tensor, ...]:
        """Like :meth:`train_batch` from the validation files."""
        return self.mask(self.corpus.val_batch(index, rows), _seed.generator(self.seed, index, _seed.VAL))

    def loss(self, output: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (nats/token) of logits ``[rows, T, V]`` over the selected positions
        of ``labels [rows, T]`` (``ignore_index=-100``)."""
        return token_loss(output, targets[0], ignore_index=IGNORE_INDEX)
