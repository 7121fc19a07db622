"""Tessel GPT: a small nanoGPT-style decoder-only transformer in pure torch.

Module paths mirror HF GPT-2 so graph layers look alike: ``transformer.wte``,
``transformer.wpe``, ``transformer.drop``, ``transformer.h.{i}`` (an ``nn.ModuleList`` of
:class:`Block`), ``transformer.ln_f``, ``lm_head`` (weight tied to ``transformer.wte`` by
default). Attention is ``F.scaled_dot_product_attention(..., is_causal=True)``, so no mask
tensor exists and the tensor between two blocks is exactly the hidden state
``[batch, seq, n_embd]``.

Based on Karpathy's nanoGPT (MIT licence) model.py, simplified (no flash/slow-path switch,
no ``generate``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelArgumentError, ModelConfigError

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "MLP", "init_gpt2_weights", "lm_loss"]


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`.

    Attributes:
        vocab_size: number of token ids (256 = raw bytes).
        block_size: maximum sequence length (size of the position table).
        n_layer, n_head, n_embd: depth, attention heads, hidden size (``n_embd % n_head == 0``).
        dropout: dropout probability on embeddings, attention weights and residual branches.
        bias: whether Linear and LayerNorm layers have biases.
        tie_weights: share ``lm_head.weight`` with ``transformer.wte.weight``.
        causal: causal (decoder) attention; ``False`` lets every position attend to every other
            (an encoder, e.g. the towers of :mod:`engine.models.two_tower`).
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    causal: bool = True

    def to_dict(self) -> dict:
        """JSON-able dict of the fields."""
        return asdict(self)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention, causal unless ``GPTConfig.causal`` is off: ``[B, T, C] -> [B, T, C]``.

    The fused projection ``c_attn`` (``C -> 3C``) lays its outputs out per head, Megatron-LM's
    layout: head ``h`` owns the rows ``[h*3*hd, (h+1)*3*hd)`` of ``c_attn.weight``, holding its
    query, key and value (``hd = C / n_head``). Heads are found with ``view(B, T, -1, 3*hd)``, so a
    column-parallel ``c_attn`` (``torch.distributed.tensor.parallel.ColwiseParallel``: a contiguous
    row block of the weight per rank) gives each rank whole heads, and the row-parallel ``c_proj``
    takes their ``[B, T, C/tp]`` output: the module runs unchanged under tensor parallelism
    (Shoeybi et al., "Megatron-LM", 2019, section 3: attention heads split across ranks).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ModelConfigError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout
        self.causal = cfg.causal
        self.head_dim = cfg.n_embd // cfg.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.head_dim
        # per-head [q | k | v] (Megatron's layout); -1 heads: all of them, or this rank's under TP
        qkv = self.c_attn(x).view(b, t, -1, 3 * hd).transpose(1, 2)
        q, k, v = qkv.split(hd, dim=3)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=self.causal)
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward ``[B, T, C] -> [B, T, C]`` with a 4·C GELU hidden layer."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block ``[B, T, C] -> [B, T, C]``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only language model: token ids ``[B, T]`` (int64) -> logits ``[B, T, vocab]``.

    Raises:
        ModelArgumentError (a ValueError; in forward): ``T > block_size``.
    """

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        cfg = cfg or GPTConfig()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = cast(nn.Embedding, self.transformer.wte).weight
        init_gpt2_weights(self, cfg.n_layer)

    def num_params(self) -> int:
        """Number of parameters (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ModelArgumentError(f"sequence length {t} > block_size {self.config.block_size}; use a --seq-len "
                                     f"of at most {self.config.block_size}")
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        tr = self.transformer  # a ModuleDict: its attributes are typed Tensor | Module
        wte, wpe = cast(nn.Embedding, tr.wte), cast(nn.Embedding, tr.wpe)
        x = cast(nn.Dropout, tr.drop)(wte(idx) + wpe(pos))
        for block in cast(nn.ModuleList, tr.h):
            x = block(x)
        return self.lm_head(cast(nn.LayerNorm, tr.ln_f)(x))


def init_gpt2_weights(model: nn.Module, n_layer: int) -> None:
    """GPT-2's initialisation (Radford et al., 2019, section 2.3; nanoGPT): every ``nn.Linear`` and
    ``nn.Embedding`` weight from N(0, 0.02), biases zero, and the residual projections
    (``*.c_proj.weight``) from N(0, 0.02 / sqrt(2 n_layer))."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    for pn, p in model.named_parameters():
        if pn.endswith("c_proj.weight"):
            nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits ``[B, T, V]``, targets ``[B, T]`` int64 -> scalar."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
