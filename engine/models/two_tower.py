"""A two-tower (dual-encoder) model: two transformer encoders joined by a contrastive head.

The model Tessel's K placement is made for (Tessel, Lin et al., HPCA 2024, section III: "K" is
two branches joined by a block): a ``text`` tower encodes a docstring, a ``code`` tower encodes a
function body, and the parameter-free ``head`` scores every (text, code) pair of a micro-batch,
as CLIP-style dual encoders do (Radford et al., "Learning Transferable Visual Models From
Natural Language Supervision", 2021, section 2.3; CodeSearchNet's neural bag / self-attention
baselines, Husain et al., 2019). The towers are independent until the head, so each can run on
its own devices; the head needs both embeddings.

Module paths (what the planner's layers and the runtime's layer split read,
:func:`engine.split.supports_layer_split`, ``runtime.stages.layer_split.split_two_towers``):

- ``text.wte`` / ``code.wte``: byte embeddings ``[vocab, n_embd]``; ``text.wpe`` / ``code.wpe``:
  positions ``[block_size, n_embd]``;
- ``text.h.{i}`` / ``code.h.{i}``: pre-LayerNorm transformer blocks with bidirectional attention
  (:class:`engine.models.gpt.Block`, ``causal=False``);
- ``text.ln_f`` / ``code.ln_f``, then a mean over the sequence and ``text.proj`` / ``code.proj``
  (``n_embd -> proj_dim``);
- ``head``: :class:`ContrastiveHead`, no parameters.

Shapes: ``forward(text_ids [B, T], code_ids [B, T])`` (int64, byte ids, 0 = padding) returns the
similarity logits ``[B, B]`` (float): row ``i`` scores text ``i`` against every code of the batch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelArgumentError

from .gpt import Block, GPTConfig, init_gpt2_weights

__all__ = ["TwoTowerConfig", "Tower", "ContrastiveHead", "TwoTower"]


@dataclass
class TwoTowerConfig:
    """Shape of a :class:`TwoTower`.

    Attributes:
        vocab_size: token ids of both towers (256 = raw bytes; byte 0 pads).
        block_size: longest sequence either tower takes (size of the position tables).
        n_layer: transformer blocks per tower.
        n_head, n_embd: attention heads and hidden size of every block (``n_embd % n_head == 0``).
        proj_dim: size of the embedding each tower returns.
        temperature: the softmax temperature of the head's cosine similarities (CLIP's initial
            0.07); fixed, not learned, so the head has no parameters.
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    proj_dim: int = 32
    temperature: float = 0.07

    def to_dict(self) -> dict:
        """JSON-able dict of the fields."""
        return asdict(self)

    def block_config(self) -> GPTConfig:
        """The :class:`~engine.models.gpt.GPTConfig` of a tower's blocks (bidirectional, no dropout)."""
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd, dropout=0.0, causal=False)


class Tower(nn.Module):
    """One encoder: byte ids ``[B, T]`` (int64) -> embedding ``[B, proj_dim]``.

    Embeddings (``wte`` + ``wpe``), ``n_layer`` bidirectional blocks (``h``), ``ln_f``, the mean over
    the ``T`` positions, and ``proj``. ``runtime.stages.layer_split.TowerStage`` runs a contiguous run of
    it with exactly these operations.

    Raises:
        ModelArgumentError (a ValueError; in forward): ``T > block_size``.
    """

    def __init__(self, cfg: TwoTowerConfig):
        super().__init__()
        bc = cfg.block_config()
        self.block_size = cfg.block_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList([Block(bc) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.proj_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.block_size:
            raise ModelArgumentError(f"sequence length {t} > block_size {self.block_size}; use a --seq-len of at "
                                     f"most {self.block_size}")
        x = self.wte(ids) + self.wpe(torch.arange(t, device=ids.device))
        for block in cast(nn.ModuleList, self.h):
            x = block(x)
        return self.proj(self.ln_f(x).mean(dim=1))


class ContrastiveHead(nn.Module):
    """Cosine-similarity logits of two embedding batches: ``a [B, P]``, ``b [B, P]`` ->
    ``[B, B]`` with entry ``(i, j) = cos(a_i, b_j) / temperature``. No parameters (the temperature
    is a fixed float), so a placement may replicate it on several devices."""

    def __init__(self, temperature: float):
        super().__init__()
        if not temperature > 0:
            raise ModelArgumentError(f"temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).transpose(0, 1) / self.temperature


class TwoTower(nn.Module):
    """Text and code towers joined by the contrastive head (see the module docstring):
    ``(text_ids [B, T], code_ids [B, T]) -> logits [B, B]``."""

    def __init__(self, cfg: TwoTowerConfig | None = None):
        super().__init__()
        cfg = cfg or TwoTowerConfig()
        self.config = cfg
        self.text = Tower(cfg)
        self.code = Tower(cfg)
        self.head = ContrastiveHead(cfg.temperature)
        init_gpt2_weights(self, cfg.n_layer)

    def forward(self, text_ids: torch.Tensor, code_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.text(text_ids), self.code(code_ids))
