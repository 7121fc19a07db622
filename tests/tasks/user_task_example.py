"""An example user task (``tessel launch --task user_task_example:make_task``; see ``tasks.user``).

"Predict the byte class": a causal language model reads byte windows of this file's own source
and, at every position, predicts the class of the byte there: 0 letter, 1 digit, 2 whitespace,
3 anything else, from the first 4 of its logits. It needs no data set (the module reads its own
source) and is deterministic in ``(seed, step)``.

Protocol (shapes): ``input_names = ("input_ids",)``; ``train_batch(step, rows)`` ->
``(input_ids int64 [rows, T], classes int64 [rows, T])``; ``loss(logits [rows, T, V], classes)``
-> the mean cross-entropy over ``logits[..., :4]``; ``unit = "tokens"``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

NUM_CLASSES = 4


def byte_class(ids: torch.Tensor) -> torch.Tensor:
    """Class of each byte id: 0 letter, 1 digit, 2 whitespace, 3 other (int64, same shape)."""
    letter = ((ids >= 65) & (ids <= 90)) | ((ids >= 97) & (ids <= 122))
    digit = (ids >= 48) & (ids <= 57)
    space = (ids == 32) | (ids == 9) | (ids == 10) | (ids == 13)
    out = torch.full_like(ids, 3)
    out[space] = 2
    out[digit] = 1
    out[letter] = 0
    return out


class ByteClassTask:
    """The task object (any object with these attributes works; no base class is needed)."""

    input_names = ("input_ids",)
    unit = "tokens"

    def __init__(self, seq_len: int, seed: int = 0):
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        text = Path(__file__).read_bytes()
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        half = len(self.data) * 3 // 4          # first 3/4 train, the rest validation
        self.train, self.val = self.data[:half], self.data[half:]

    def _windows(self, src: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.seq_len)[None, :]
        ids = src[idx]
        return ids, byte_class(ids)

    def train_batch(self, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + step)
        starts = torch.randint(0, len(self.train) - self.seq_len, (rows,), generator=gen)
        return self._windows(self.train, starts)

    def val_batch(self, index: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = (len(self.val) - self.seq_len) // self.seq_len
        starts = torch.tensor([((index * rows + j) % n) * self.seq_len for j in range(rows)])
        return self._windows(self.val, starts)

    def loss(self, logits: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[..., :NUM_CLASSES].reshape(-1, NUM_CLASSES).float(), classes.reshape(-1))


def make_task(seq_len: int, seed: int = 0) -> ByteClassTask:
    """The entry point named on the command line: called with the context fields it accepts."""
    return ByteClassTask(seq_len, seed)


def no_loss_task(seq_len: int):
    """A broken task for the error tests: no ``loss``."""
    class Broken:
        input_names = ("input_ids",)

        def train_batch(self, step, rows):
            return torch.zeros(rows, seq_len, dtype=torch.long), torch.zeros(rows, seq_len, dtype=torch.long)

        def val_batch(self, index, rows):
            return self.train_batch(index, rows)
    return Broken()


def ragged_task(seq_len: int):
    """A broken task for the error tests: its batch's tensors disagree on the rows."""
    task = ByteClassTask(seq_len)
    task.train_batch = lambda step, rows: (torch.zeros(rows, seq_len, dtype=torch.long),  # type: ignore[method-assign]
                                           torch.zeros(rows + 1, seq_len, dtype=torch.long))
    return task


def needs_tokenizer(tokenizer_path: str):
    """A broken task for the error tests: asks for an argument the runtime does not give."""
    raise AssertionError("never called")
