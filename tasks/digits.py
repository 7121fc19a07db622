"""The ``image-classification`` task: scikit-learn's bundled handwritten digits
(``sklearn.datasets.load_digits``: 1797 images of 8x8 pixels with values 0..16, 10 classes; the
UCI "Optical Recognition of Handwritten Digits" test set, shipped inside scikit-learn, so nothing
is downloaded).

- Split: the 1797 samples are shuffled once with a generator seeded by ``seed``; the first
  :data:`TRAIN_SIZE` (1500) are the training split, the other 297 the validation split.
- ``train_batch(step, rows)``: ``rows`` training samples drawn with a generator seeded by
  ``(seed, step)`` (without replacement while ``rows <= 1500``, else with replacement);
  ``val_batch(i, rows)``: validation samples ``i*rows .. i*rows + rows - 1`` (wrapping around).
- Batch ``(images float32 [rows, 1, 8, 8] = pixels / 16, labels int64 [rows])``.
- Loss: mean cross-entropy of logits ``[rows, 10]`` (float32). Unit: samples.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.errors import TaskError
from tasks import _seed
from tasks.base import Task, TaskContext, Unit

__all__ = ["Digits", "load_digits_tensors", "TRAIN_SIZE", "NUM_CLASSES"]

TRAIN_SIZE = 1500
"""Training samples of the split (the remaining 297 are validation)."""

NUM_CLASSES = 10


@functools.lru_cache(maxsize=1)
def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 digits: ``(images float32 [1797, 1, 8, 8] in [0, 1], labels int64 [1797])``.

    Raises:
        TaskError: scikit-learn is not installed.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise TaskError("task image-classification reads scikit-learn's bundled digits; install "
                        "scikit-learn (pip install scikit-learn)") from e
    d = load_digits()
    images = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(d.target, dtype=torch.long)
    return images, labels


class Digits(Task):
    """8x8 digit classification (see the module docstring).

    Args:
        ctx: ``seed`` (split and batches); the rest is unused.

    Raises:
        TaskError: scikit-learn is not installed.
    """

    name = "image-classification"
    unit: Unit = "samples"
    input_names = ("pixel_values",)

    def __init__(self, ctx: TaskContext):
        self.seed = int(ctx.seed)
        images, labels = load_digits_tensors()
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.seed))
        self.train_index = order[:TRAIN_SIZE]
        self.val_index = order[TRAIN_SIZE:]
        self._images, self._labels = images, labels

    def _take(self, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._images[idx].contiguous(), self._labels[idx].contiguous()

    def train_batch(self, step: int, rows: int) -> tuple[torch.Tensor, ...]:
        """``(images [rows, 1, 8, 8], labels [rows])`` of training step ``step``."""
        if rows < 1 or step < 0:
            raise TaskError(f"need step >= 0 and rows >= 1, got step={step}, rows={rows}")
        gen = _seed.generator(self.seed, step, _seed.TRAIN)
        n = len(self.train_index)
        pick = torch.randperm(n, generator=gen)[:rows] if rows <= n else torch.randint(0, n, (rows,), generator=gen)
        return self._take(self.train_index[pick])

    def val_batch(self, index: int, rows: int) -> tuple[torch.Tensor, ...]:
        """Validation samples ``index*rows ..`` (wrapping around), same layout as :meth:`train_batch`."""
        if rows < 1 or index < 0:
            raise TaskError(f"need index >= 0 and rows >= 1, got index={index}, rows={rows}")
        n = len(self.val_index)
        pick = torch.tensor([(index * rows + j) % n for j in range(rows)])
        return self._take(self.val_index[pick])

    def loss(self, output: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of logits ``[rows, 10]`` against ``labels [rows]`` (float32)."""
        return F.cross_entropy(output.reshape(output.shape[0], -1).float(), targets[0])
