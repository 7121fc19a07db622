"""Activation recomputation granularities of a plan (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", MLSys 2023, sections 4 and 5).

- ``none``: every tensor the backward needs is kept from the forward.
- ``selective``: the attention core (Q·Kᵀ, softmax, its dropout, ·V) is not kept but
  recomputed in the backward; what it saves is the ``5·a·s/h`` term of the paper's per-layer
  ``s·b·h·(34 + 5·a·s/h)`` bytes (nothing where a fused kernel, SDPA or FlashAttention, never
  stored the scores).
- ``full``: each transformer layer keeps only its input; the whole layer's forward runs again
  inside its backward (torchtitan's ``activation_checkpoint.mode = "full"``, Megatron-LM's
  ``--recompute-granularity full --recompute-method uniform``).

The runtime applies them with ``torch.utils.checkpoint`` (non-reentrant); the planner's memory
and time models count what each keeps and what each recomputes.
"""

from __future__ import annotations

from typing import Literal, get_args

from engine.errors import TransformError

RecomputeName = Literal["none", "selective", "full"]
"""A plan's activation recomputation granularity."""

RECOMPUTE: tuple[str, ...] = get_args(RecomputeName)


def check_recompute(name: str) -> str:
    """``name`` if it is a granularity (:data:`RECOMPUTE`).

    Raises:
        TransformError: any other value (the message lists the three).
    """
    if name not in RECOMPUTE:
        raise TransformError(f"unknown recomputation {name!r}; use one of {', '.join(RECOMPUTE)}")
    return name


__all__ = ["RECOMPUTE", "RecomputeName", "check_recompute"]
