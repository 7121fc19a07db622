"""Splitting a global batch into one replica's micro-batches (``docs/runtime-worker.md``,
"What a rank does in a step").

A global batch is a task's tuple ``(*inputs, *targets)`` (:class:`tasks.base.Task`): every tensor
has first dimension ``rows = dp * k * micro_batch_size``, the same on every rank. The legacy form,
a single integer tensor ``[rows, seq_len + 1]`` of byte windows (``ByteCorpus.train_batch``), is
the causal-lm batch ``(rows[:, :-1], rows[:, 1:])``.
"""

from __future__ import annotations

from typing import Any

import torch

from runtime.worker.errors import WorkerError
from tasks.text import split_rows

__all__ = ["MicroBatch", "as_batch_tuple", "split_batch"]

MicroBatch = tuple[torch.Tensor, ...]
"""One micro-batch's model inputs (or targets), each tensor ``[micro_batch_size, ...]``."""


def _legacy(batch: torch.Tensor, *, rows_needed: int | None, mult: int, seq_len: int | None,
            dims: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of a legacy ``[rows, seq_len + 1]`` integer batch, shape-checked."""
    if batch.dim() != 2 or batch.dtype.is_floating_point:
        raise WorkerError(f"the batch must be an integer tensor [rows, seq_len + 1] or a task's tuple "
                          f"(*inputs, *targets), got {batch.dtype} {tuple(batch.shape)}")
    if (seq_len is not None and batch.shape[1] != seq_len + 1) or \
            (rows_needed is not None and batch.shape[0] != rows_needed) or batch.shape[0] % mult:
        cols = "seq_len + 1" if seq_len is None else seq_len + 1
        want = f"[{rows_needed if rows_needed else 'dp*k*micro_batch_size'}, {cols}]"
        raise WorkerError(f"the global batch has shape {list(batch.shape)}, expected {want} ({dims})")
    return split_rows(batch.long())


def as_batch_tuple(batch: Any, *, num_inputs: int, rows_needed: int | None = None, mult: int = 1,
                   seq_len: int | None = None, dims: str = "") -> tuple[torch.Tensor, ...]:
    """The global batch as a task tuple ``(*inputs, *targets)``, checked.

    Args:
        batch: a task's tuple (or list) of tensors, or the legacy causal-lm integer tensor
            ``[rows, seq_len + 1]``.
        num_inputs: how many leading tensors are model inputs (at least one target must follow).
        rows_needed: the exact rows required (``None``: any multiple of ``mult``).
        seq_len: the static sequence length: a legacy tensor must have ``seq_len + 1`` columns, and
            an integer 2-d first input ``seq_len`` columns (``None``: unchecked).
        dims: the degrees, for messages (``"dp=2, micro_batch_size=2, seq_len=32"``).

    Raises:
        WorkerError: not tensors, too few of them, or rows / sequence length that do not fit.
    """
    if isinstance(batch, torch.Tensor):
        if num_inputs != 1:
            raise WorkerError(f"a single-tensor batch is the causal-lm form, but the task has {num_inputs} model "
                              "inputs; pass the task's tuple (*inputs, *targets)")
        return _legacy(batch, rows_needed=rows_needed, mult=mult, seq_len=seq_len, dims=dims)
    if not isinstance(batch, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in batch):
        raise WorkerError("the batch must be a task's tuple of tensors (*inputs, *targets), got "
                          f"{type(batch).__name__}")
    batch = tuple(batch)
    if len(batch) <= num_inputs:
        raise WorkerError(f"the batch has {len(batch)} tensor(s) but the task has {num_inputs} model input(s) "
                          "and at least one target")
    rows = {int(t.shape[0]) if t.dim() else -1 for t in batch}
    n = next(iter(rows))
    if len(rows) != 1 or n < 1 or (rows_needed is not None and n != rows_needed) or n % mult:
        want = rows_needed if rows_needed is not None else "dp*k*micro_batch_size"
        raise WorkerError(f"the global batch's tensors have shapes {[list(t.shape) for t in batch]}; every one "
                          f"needs first dimension {want} ({dims})")
    first = batch[0]
    if seq_len is not None and first.dim() == 2 and not first.dtype.is_floating_point and first.shape[1] != seq_len:
        raise WorkerError(f"the batch's first input has shape {list(first.shape)}, expected [{n}, {seq_len}] ({dims})")
    return batch


def split_batch(batch: Any, *, dp: int, dp_index: int, mbs: int, seq_len: int | None, per_replica: int | None,
                device: torch.device | None, num_inputs: int = 1) -> tuple[list[MicroBatch], list[MicroBatch]]:
    """Replica ``dp_index``'s micro-batches of a global batch.

    Args:
        batch: a task tuple ``(*inputs, *targets)`` with first dimension ``dp * k * mbs``, the same
            on every rank, or the legacy integer tensor ``[dp * k * mbs, seq_len + 1]``; replica
            ``d`` takes rows ``d*k*mbs .. (d+1)*k*mbs - 1`` and micro-batch ``j`` the ``j``-th
            ``mbs`` rows of those, of every tensor.
        per_replica: ``k`` required (a training step's ``m``), ``None``: any ``k >= 1``.
        device: move the rows there (CUDA), ``None``: leave them.
        num_inputs: leading tensors of the tuple that are model inputs (1 for the legacy form).

    Returns:
        ``(inputs, targets)``: per micro-batch, the tuple of its model-input slices and the tuple
        of its target slices (contiguous, ``[mbs, ...]``).

    Raises:
        WorkerError: a malformed batch or the wrong shape.
    """
    rows_needed = None if per_replica is None else dp * per_replica * mbs
    dims = f"dp={dp}, micro_batch_size={mbs}, seq_len={seq_len}"
    full = as_batch_tuple(batch, num_inputs=num_inputs, rows_needed=rows_needed, mult=dp * mbs, seq_len=seq_len,
                          dims=dims)
    per = full[0].shape[0] // dp
    mine = [t[dp_index * per:(dp_index + 1) * per] for t in full]
    if device is not None:
        mine = [t.to(device) for t in mine]
    k = per // mbs
    cut = [tuple(t[j * mbs:(j + 1) * mbs].contiguous() for t in mine) for j in range(k)]
    return [c[:num_inputs] for c in cut], [c[num_inputs:] for c in cut]
