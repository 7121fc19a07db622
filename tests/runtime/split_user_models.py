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


class KeywordOnlyTokenNet(nn.Module):
    """A token model whose forward takes its input as a keyword-only argument, as many user models
    (and anything called with a tokenizer's output) do: ``forward(*, input_ids [B, T]) -> logits
    [B, T, vocab]``."""

    def __init__(self, vocab: int = 256, hidden: int = 16, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, *, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_keyword_only_net(batch_size: int = 2, seq_len: int | None = 16):
    """``(KeywordOnlyTokenNet, {"input_ids": ...})``: example inputs as keyword arguments."""
    torch.manual_seed(0)
    return KeywordOnlyTokenNet(), {"input_ids": torch.randint(0, 256, (batch_size, seq_len or 16))}
