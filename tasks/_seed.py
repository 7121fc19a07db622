"""Deterministic random generators of the built-in tasks: one ``torch.Generator`` per
``(seed, step, stream)``, so a batch depends on nothing but those numbers."""

from __future__ import annotations

import torch

__all__ = ["generator"]

#: independent streams of one task (training and validation batches never share draws)
TRAIN, VAL = 1, 2


def generator(seed: int, index: int, stream: int) -> torch.Generator:
    """A CPU generator seeded from ``(seed, index, stream)`` (a 63-bit mix; distinct triples of
    small non-negative integers give distinct seeds)."""
    mixed = ((int(seed) * 1_000_003 + int(index)) * 7919 + int(stream)) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)
