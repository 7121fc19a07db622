"""Single-process ground truth for pipelined training runs.

:func:`reference_losses` trains the plan's model, unsplit, in one process, with exactly the
numerics a pipelined run must reproduce: the same seed (``torch.manual_seed(seed)`` right before
the model is built, as in :func:`runtime.stage.build_stages`), float32, the same micro-batches,
gradient accumulation of ``loss_j / n`` over the ``n = dp * m`` micro-batches of a batch (one
backward per micro-batch, in order), then one optimizer step per batch.

Why this equals the pipelined run: a pipeline replica accumulates ``sum_j grad(loss_j / m)`` over
its ``m`` micro-batches; the data-parallel all-reduce averages the ``dp`` replicas, giving
``sum over all dp*m micro-batches of grad(loss / (dp*m))``; the tied-embedding all-reduce makes
each copy's gradient the sum over its uses, which is what the unsplit model (one shared
parameter) computes. Differences left are float rounding (summation order, the traced graphs'
explicit attention mask vs the eager ``is_causal`` path), far below ``rtol=1e-4`` on the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["reference_losses"]


def reference_losses(plan, batches, *, seed: int = 0, lr: float = 1e-3, optimizer: str = "adam") -> list[list[float]]:
    """Train the plan's model in one process and return the per micro-batch losses.

    Args:
        plan: an :class:`engine.io.Plan` (uses ``model.name``, ``model.micro_batch_size``,
            ``model.seq_len``, ``parallel.dp`` and the schedule's ``m``).
        batches: global batches, each int64 ``[dp * m * micro_batch_size, seq_len + 1]`` (the
            same tensors given to :meth:`runtime.worker.StageWorker.step`).
        seed: model initialisation seed.
        lr: learning rate; ``optimizer``: ``"adam"`` (``torch.optim.Adam`` defaults) or ``"sgd"``.

    Returns:
        For every batch, ``dp * m`` floats: the mean cross-entropy (nats/token) of each
        micro-batch BEFORE that batch's optimizer step, in global order (replica 0's ``m``
        micro-batches, then replica 1's, ...). Compare with the concatenation of the
        ``losses`` the last-segment ranks return, ordered by replica.

    Raises:
        ValueError: a batch of the wrong shape or an unknown optimizer.
    """
    from engine.models import build_model

    mbs = int(plan.model.get("micro_batch_size") or 1)
    dp = int(plan.parallel.get("dp", 1))
    m = int(plan.schedule.num_micro_batches)
    n = dp * m
    torch.manual_seed(seed)
    bundle = build_model(plan.model["name"], batch_size=mbs, seq_len=plan.model.get("seq_len"), device="cpu",
                         dtype=torch.float32)
    model = bundle.module.float().train()
    seq = int(bundle.seq_len or bundle.example_inputs[0].shape[-1])
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}; use 'adam' or 'sgd'")
    out: list[list[float]] = []
    for i, batch in enumerate(batches):
        if batch.dim() != 2 or tuple(batch.shape) != (n * mbs, seq + 1):
            raise ValueError(f"batch {i} has shape {list(batch.shape)}, expected [{n * mbs}, {seq + 1}] "
                             f"(dp={dp}, m={m}, micro_batch_size={mbs}, seq_len={seq})")
        batch = batch.long()
        losses = []
        for j in range(n):
            rows = batch[j * mbs:(j + 1) * mbs]
            logits = model(rows[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), rows[:, 1:].reshape(-1))
            (loss / n).backward()
            losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(losses)
    return out
