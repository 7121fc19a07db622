"""MoE feed-forward layer: a gate (:mod:`engine.models.moe.gates`) plus a ModuleList of MLPs.

Dispatch/combine follow GShard's dense formulation, which ``torch.export`` captures without
data-dependent control flow::

    expert_in[e]  = einsum("nec,nd->ecd", dispatch, x)      # [E, C, hidden]
    expert_out[e] = experts[e](expert_in[e])                 # one op group per expert
    y             = einsum("nec,ecd->nd", combine, expert_out)

Dropped tokens (over capacity) get a zero output, so in a residual block they pass through on
the residual path. Module paths of the experts: ``<layer>.experts.{e}.c_fc`` / ``c_proj``.
"""
from __future__ import annotations

import torch
from torch import nn

from .gates import BaseGate, GateOutput, make_gate

__all__ = ["ExpertMLP", "MoEFeedForward"]


class ExpertMLP(nn.Module):
    """One expert: ``Linear(hidden, ffn_hidden) -> GELU -> Linear(ffn_hidden, hidden)``."""

    def __init__(self, hidden: int, ffn_hidden: int, bias: bool = True):
        super().__init__()
        self.c_fc = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(ffn_hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class MoEFeedForward(nn.Module):
    """Mixture-of-experts FFN ``[..., hidden] -> [..., hidden]`` with a pluggable gate.

    Args:
        hidden: feature size.
        ffn_hidden: hidden size of each expert MLP.
        num_experts: E.
        gate: ``"switch"`` (top-1, capacity, dropping), ``"top2"`` (GShard) or ``"dts"``
            (DTS-Gate).
        bias: biases in the expert Linears.
        **gate_kw: passed to the gate class (e.g. ``capacity_factor``, ``tau_max``, ``D``, ``H``).

    After each forward (eager, not during ``torch.export``): ``last_aux_loss`` (scalar tensor,
    weighted balance loss, part of the autograd graph) and ``last_metrics`` (dict of detached
    tensors, see :class:`~engine.models.moe.gates.GateOutput`); ``last_gate_output`` holds the
    full routing.

    Raises:
        ValueError: unknown gate name or invalid gate arguments.
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, gate: str = "switch",
                 bias: bool = True, **gate_kw):
        super().__init__()
        self.gate_kind = gate
        self.gate: BaseGate = make_gate(gate, hidden, num_experts, **gate_kw)
        self.experts = nn.ModuleList(ExpertMLP(hidden, ffn_hidden, bias) for _ in range(num_experts))
        self.last_aux_loss: torch.Tensor | None = None
        self.last_metrics: dict = {}
        self.last_gate_output: GateOutput | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        out = self.gate(xf)
        dispatch = out.dispatch.to(xf.dtype)
        combine = out.combine.to(xf.dtype)
        expert_in = torch.einsum("nec,nd->ecd", dispatch, xf)
        expert_out = torch.stack([exp(expert_in[i]) for i, exp in enumerate(self.experts)])
        y = torch.einsum("nec,ecd->nd", combine, expert_out)
        if not torch.compiler.is_exporting():
            self.last_aux_loss = out.aux_loss
            self.last_metrics = out.metrics
            self.last_gate_output = out
        return y.reshape(shape)
