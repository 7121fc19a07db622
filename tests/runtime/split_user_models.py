"""User models given as ``split_user_models:callable`` to the stage-split tests (tests/runtime)."""
from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm residual MLP block: ``x [B, T, H] -> x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class DataDependentBlock(Block):
    """A block whose forward branches on a tensor value (``torch.export`` cannot trace it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return super().forward(x)
        return x


class TinyTokenNet(nn.Module):
    """Token ids ``[B, T]`` int64 -> logits ``[B, T, vocab]``: embedding, 4 blocks, a head tied to
    the embedding (not an ``nn.Sequential``)."""

    def __init__(self, vocab: int = 64, hidden: int = 32, branchy: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            [DataDependentBlock(hidden) if branchy and i == 1 else Block(hidden) for i in range(4)])
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def make_net() -> nn.Module:
    """The traceable user model."""
    return TinyTokenNet()


def make_branchy_net() -> nn.Module:
    """The same module tree with a data-dependent branch in ``blocks.1``."""
    return TinyTokenNet(branchy=True)
