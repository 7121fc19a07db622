"""Splitting a global batch into one replica's micro-batches (``docs/runtime-worker.md``,
"What a rank does in a step")."""

from __future__ import annotations

import torch

from runtime.worker.errors import WorkerError

__all__ = ["split_batch"]


def split_batch(batch: torch.Tensor, *, dp: int, dp_index: int, mbs: int, seq_len: int, per_replica: int | None,
                device: torch.device | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Replica ``dp_index``'s micro-batches of a global batch.

    Args:
        batch: int64 ``[dp * k * mbs, seq_len + 1]``, the same on every rank; replica ``d`` takes
            rows ``d*k*mbs .. (d+1)*k*mbs - 1`` and micro-batch ``j`` the ``j``-th ``mbs`` rows of those.
        per_replica: ``k`` required (a training step's ``m``), ``None``: any ``k >= 1``.
        device: move the rows there (CUDA), ``None``: leave them.

    Returns:
        ``(inputs, targets)``: per micro-batch ``rows[:, :-1]`` and ``rows[:, 1:]``, ``[mbs, seq_len]``.

    Raises:
        WorkerError: not an integer 2-d tensor, or the wrong shape.
    """
    if not isinstance(batch, torch.Tensor) or batch.dim() != 2 or batch.dtype.is_floating_point:
        raise WorkerError(f"the batch must be an integer tensor [rows, seq_len + 1], got "
                          f"{getattr(batch, 'dtype', type(batch).__name__)} {tuple(getattr(batch, 'shape', ()))}")
    rows_needed = None if per_replica is None else dp * per_replica * mbs
    if batch.shape[1] != seq_len + 1 or (rows_needed is not None and batch.shape[0] != rows_needed) \
            or batch.shape[0] % (dp * mbs):
        want = f"[{rows_needed if rows_needed else 'dp*k*micro_batch_size'}, {seq_len + 1}]"
        raise WorkerError(f"the global batch has shape {list(batch.shape)}, expected {want} "
                          f"(dp={dp}, micro_batch_size={mbs}, seq_len={seq_len})")
    per = batch.shape[0] // dp
    rows = batch[dp_index * per:(dp_index + 1) * per].long()
    if device is not None:
        rows = rows.to(device)
    k = per // mbs
    inputs = [rows[j * mbs:(j + 1) * mbs, :-1].contiguous() for j in range(k)]
    targets = [rows[j * mbs:(j + 1) * mbs, 1:].contiguous() for j in range(k)]
    return inputs, targets
