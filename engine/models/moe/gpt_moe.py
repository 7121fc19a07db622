"""GPT-MoE: the in-project GPT (:mod:`engine.models.gpt`) with an MoE FFN in every other block.

Blocks ``transformer.h.{i}`` for odd ``i`` (1, 3, ...) replace their dense ``mlp`` with a
:class:`~engine.models.moe.layer.MoEFeedForward`; the others are plain GPT-2 blocks. Token ids
``[B, T]`` -> logits ``[B, T, vocab]``, as :class:`~engine.models.gpt.GPT`.

Training loop contract::

    logits = model(idx)
    loss = lm_loss(logits, targets) + model.aux_loss()   # weighted balance losses of all gates
    loss.backward(); opt.step(); opt.zero_grad()
    model.advance_gates()                                 # once per optimizer update
    model.moe_metrics()                                   # temperature, experts/token, balance, drops
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from ..gpt import GPT, GPTConfig, init_gpt2_weights
from .layer import MoEFeedForward

__all__ = ["GPTMoEConfig", "GPTMoE"]


@dataclass
class GPTMoEConfig(GPTConfig):
    """:class:`~engine.models.gpt.GPTConfig` plus MoE fields.

    Attributes:
        num_experts: experts per MoE layer.
        gate: ``"switch"``, ``"top2"`` or ``"dts"``.
        gate_kw: keyword arguments of the gate (e.g. ``{"capacity_factor": 1.25}``).
        moe_every: MoE FFN in blocks ``i`` with ``i % moe_every == moe_every - 1``.
        ffn_mult: expert hidden size = ``ffn_mult * n_embd``.
    """

    num_experts: int = 4
    gate: str = "switch"
    gate_kw: dict = field(default_factory=dict)
    moe_every: int = 2
    ffn_mult: int = 4


class GPTMoE(GPT):
    """GPT with MoE feed-forward layers in every other block (see module docstring)."""

    def __init__(self, cfg: GPTMoEConfig | None = None):
        cfg = cfg or GPTMoEConfig()
        super().__init__(cfg)
        for i, block in enumerate(cast(nn.ModuleList, self.transformer.h)):
            if i % cfg.moe_every == cfg.moe_every - 1:
                mlp = MoEFeedForward(cfg.n_embd, cfg.ffn_mult * cfg.n_embd, cfg.num_experts,
                                     gate=cfg.gate, bias=cfg.bias, **cfg.gate_kw)
                block.mlp = mlp
                init_gpt2_weights(mlp, cfg.n_layer)   # the experts' c_proj get the residual scaling

    def moe_layers(self) -> list[MoEFeedForward]:
        """The MoE FFN modules in block order."""
        return [m for m in self.modules() if isinstance(m, MoEFeedForward)]

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' weighted balance losses from the last forward (0 before any)."""
        losses = [m.last_aux_loss for m in self.moe_layers() if m.last_aux_loss is not None]
        if not losses:
            return torch.zeros((), device=self.lm_head.weight.device)
        return torch.stack(losses).sum()

    def advance_gates(self) -> None:
        """Advance every gate's update counter; call once after each ``optimizer.step()``."""
        for m in self.moe_layers():
            m.gate.advance()

    def moe_metrics(self) -> dict[str, float]:
        """Last forward's routing metrics averaged over MoE layers, as floats.

        Keys: ``temperature`` (NaN unless DTS), ``experts_per_token``, ``load_cv``,
        ``dropped_fraction``, ``balance_loss``; plus ``load_{e}`` per expert.
        """
        layers = [m.last_metrics for m in self.moe_layers() if m.last_metrics]
        if not layers:
            return {}
        out: dict[str, float] = {}
        for key in ("temperature", "experts_per_token", "load_cv", "dropped_fraction",
                    "balance_loss"):
            out[key] = float(torch.stack([lm[key].float() for lm in layers]).mean())
        load = torch.stack([lm["load"] for lm in layers]).mean(0)
        out.update({f"load_{e}": float(v) for e, v in enumerate(load)})
        return out
