"""The task API: what a plan's model is trained on (data), with which loss, counted in which unit.

A task (:class:`Task`) gives batches as tuples of tensors that share their first dimension
(rows = samples): the first ``len(task.input_names)`` are the model's positional inputs, the rest
are targets. The runtime cuts a global batch into replicas and micro-batches along that first
dimension, feeds ``inputs`` to the model (stage 0), and the last stage's output to
``task.loss(output, *targets)``. Nothing else about the data is assumed, so a user's own task
(``tessel launch --task package.module:callable``) is any object with this interface.

Built-in tasks (``tasks.get_task``): ``causal-lm`` (next-byte prediction on the CPython
sources), ``masked-lm`` (BERT-style masking of the same bytes), ``seq2seq`` (T5-style span
corruption of the same bytes) and ``image-classification`` (scikit-learn's bundled
``load_digits`` 8x8 images, 10 classes). All data exists on every machine; nothing is downloaded.

Determinism: batches depend only on ``(seed, step)`` (or ``(seed, index)`` for validation), so
every rank draws the same global batch, the single-process reference sees the same rows, and
resuming at step ``s`` needs nothing but ``s``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Task", "TaskContext", "Unit"]

Unit = Literal["tokens", "samples"]
"""What a task's throughput counts: ``tokens`` (language tasks) or ``samples`` (everything else)."""


@dataclass(frozen=True)
class TaskContext:
    """What a task may need to know about the model and run it feeds.

    Attributes:
        seq_len: tokens per sample of the model's input (``None`` for non-sequence models).
        vocab_size: the model's vocabulary size (``None`` when it has none). Byte-level text tasks
            need ``>= 256``; masked LM needs room for a ``[MASK]`` id and seq2seq for sentinel ids
            above the bytes (ids ``vocab_size - 1``, ``vocab_size - 2``, ...).
        seed: the data seed: batches are a function of ``(seed, step)``.
        model_name: the plan's model (for messages).
    """

    seq_len: int | None = None
    vocab_size: int | None = None
    seed: int = 0
    model_name: str = "model"


class Task(abc.ABC):
    """A training task: data, loss and throughput unit (see the module docstring).

    Attributes:
        name: the task's name as written in a plan (``causal-lm``, ``package.module:callable``).
        unit: what throughput counts (:data:`Unit`).
        input_names: names of the model's positional inputs, in order (``("input_ids",)``,
            ``("input_ids", "decoder_input_ids")``, ``("pixel_values",)``); their number is how
            many leading batch tensors are model inputs.
        vocab_parallel_loss: the loss is ``torch.nn.functional.cross_entropy`` over the output's
            last dimension (``reshape``/``float`` before it are fine), so it accepts logits sharded
            over the vocabulary inside ``torch.distributed.tensor.parallel.loss_parallel()``: a
            tensor-parallel LM head then never gathers ``[B, T, vocab]`` (torchtitan's loss
            parallel). ``False`` (the default, and every user task): the head's logits are
            all-gathered and the loss sees a plain tensor.
    """

    name: str = "task"
    unit: Unit = "samples"
    input_names: tuple[str, ...] = ("input",)
    vocab_parallel_loss: bool = False

    @property
    def num_inputs(self) -> int:
        """How many leading tensors of a batch are model inputs."""
        return len(self.input_names)

    @abc.abstractmethod
    def train_batch(self, step: int, rows: int) -> tuple[torch.Tensor, ...]:
        """The global training batch of ``step``: ``(*inputs, *targets)``, every tensor with first
        dimension ``rows``, CPU, deterministic in ``(seed, step)``."""

    @abc.abstractmethod
    def val_batch(self, index: int, rows: int) -> tuple[torch.Tensor, ...]:
        """Validation batch ``index`` (same layout as :meth:`train_batch`), from held-out data."""

    @abc.abstractmethod
    def loss(self, output: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of one micro-batch (a float32 scalar with a gradient): ``output`` is the
        model's (last stage's) output for the micro-batch, ``targets`` its target tensors."""

    def example_inputs(self, rows: int) -> tuple[torch.Tensor, ...]:
        """Model inputs of ``rows`` samples, for capture and stage construction (default: the
        inputs of training batch 0)."""
        return tuple(self.train_batch(0, rows)[: self.num_inputs])

    def count(self, *targets: torch.Tensor) -> int:
        """Units (tokens or samples) that a micro-batch with these targets trains on; default: its
        rows for ``samples``, ``rows x seq`` of the first target for ``tokens``."""
        t = targets[0]
        if self.unit == "tokens" and t.dim() >= 2:
            return int(t.shape[0] * t.shape[1])
        return int(t.shape[0])
