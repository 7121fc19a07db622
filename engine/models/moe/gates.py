"""MoE gates: Switch (top-1), GShard top-2 and DTS-Gate (dense-to-sparse, Gumbel-softmax).

Every gate maps token features ``x`` ``[N, hidden]`` to a :class:`GateOutput` holding dense,
export-friendly routing tensors (GShard style): ``dispatch`` ``[N, E, C]`` (1 where token n
occupies slot c of expert e) and ``combine`` ``[N, E, C]`` (the same, times the combine weight),
for ``E`` experts and capacity ``C`` slots per expert. There is no data-dependent Python control
flow, so ``torch.export`` captures the routing as ordinary tensor ops.

Capacity and dropping (Switch / GShard): a token's position in its expert's buffer is its rank in
token order among the tokens routed there (a cumulative sum); tokens at position ``>= C`` are
dropped: their dispatch/combine rows are zero, so the MoE layer outputs zero for them and the
transformer's residual connection carries them through unchanged.

Gate state (all gates): the buffer ``num_updates`` (int64); DTS-Gate adds ``temperature``
(float32) and ``sparse`` (int64, 0 = dense phase, 1 = sparse phase). They are registered
buffers, so they are in ``state_dict()`` and hence in checkpoints. The update counter advances
once per *optimizer update* through an explicit :meth:`BaseGate.advance` — not per forward
(micro-batches and gradient accumulation would otherwise advance it several times per update).
The training loop calls it after ``optimizer.step()``, normally via
``GPTMoE.advance_gates()`` (:mod:`engine.models.moe.gpt_moe`).

References: Switch Transformer (Fedus et al. 2021), GShard (Lepikhin et al. 2020), DTS-Gate /
EvoMoE (Nie et al. 2021); see docs/ARCHITECTURE.md, Sources.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelArgumentError

__all__ = ["GateOutput", "BaseGate", "SwitchGate", "Top2Gate", "DTSGate", "dts_temperature",
           "load_balancing_loss", "make_gate", "GATES"]


@dataclass
class GateOutput:
    """Routing decision for ``N`` tokens over ``E`` experts with capacity ``C``.

    Attributes:
        combine_weights: ``[N, E]`` float, weight of expert e in token n's output (0 where not
            routed or dropped).
        dispatch_mask: ``[N, E]`` bool, token n is processed by expert e (after dropping).
        dispatch: ``[N, E, C]`` float 0/1, token n sits in slot c of expert e.
        combine: ``[N, E, C]`` float, ``dispatch`` times the combine weight.
        aux_loss: scalar, the weighted auxiliary (load-balancing) loss to add to the task loss.
        capacity: ``C`` (slots per expert).
        metrics: detached tensors (empty during ``torch.export``): ``temperature`` (DTS; NaN for other gates),
            ``experts_per_token`` (mean number of experts per token after dropping),
            ``load`` ``[E]`` (fraction of routed token-slots per expert), ``load_cv``
            (coefficient of variation of ``load``), ``dropped_fraction`` (fraction of wanted
            token→expert assignments that were dropped for capacity), ``balance_loss``
            (unweighted ``E·Σ f_e·P_e``).
    """

    combine_weights: torch.Tensor
    dispatch_mask: torch.Tensor
    dispatch: torch.Tensor
    combine: torch.Tensor
    aux_loss: torch.Tensor
    capacity: int
    metrics: dict = field(default_factory=dict)


def dts_temperature(step: int, tau_max: float = 2.0, tau_min: float = 0.5, D: int = 5000,
                    kind: str = "linear") -> float:
    """DTS-Gate temperature after ``step`` optimizer updates.

    linear: ``max(tau_max - step*(tau_max - tau_min)/D, tau_min)``;
    exponential: ``tau_max * (tau_min/tau_max) ** (min(step, D)/D)``. Both equal ``tau_max`` at
    step 0 and ``tau_min`` from step ``D`` on.

    Raises:
        ModelArgumentError: (a ValueError) unknown ``kind``, ``D < 1``, ``step < 0`` or non-positive temperatures.
    """
    if D < 1:
        raise ModelArgumentError(f"D (annealing updates) must be >= 1, got {D}")
    if step < 0:
        raise ModelArgumentError(f"step must be >= 0, got {step}")
    if tau_min <= 0 or tau_max <= 0:
        raise ModelArgumentError(f"temperatures must be positive, got tau_max={tau_max}, tau_min={tau_min}")
    if kind == "linear":
        return max(tau_max - step * (tau_max - tau_min) / D, tau_min)
    if kind == "exponential":
        return tau_max * (tau_min / tau_max) ** (min(step, D) / D)
    raise ModelArgumentError(f"unknown temperature schedule {kind!r}; use 'linear' or 'exponential'")


def load_balancing_loss(probs: torch.Tensor, top1_mask: torch.Tensor) -> torch.Tensor:
    """Switch load-balancing loss ``E · Σ_e f_e · P_e`` (unweighted).

    Args:
        probs: ``[N, E]`` gate probabilities.
        top1_mask: ``[N, E]`` 0/1, each token's top-1 expert (before capacity dropping).
    f_e is the fraction of tokens whose top-1 is e, P_e the mean probability of e; equals 1 for a
    perfectly uniform router.
    """
    e = probs.shape[-1]
    f = top1_mask.float().mean(0)
    p = probs.mean(0)
    return e * (f * p).sum()


def _positions(mask: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """Slot of each token in its expert's buffer, in token order: ``[N, E]`` int64."""
    pos = torch.cumsum(mask.long(), dim=0) - 1
    if offset is not None:
        pos = pos + offset.unsqueeze(0)
    return pos


def _slots(mask: torch.Tensor, pos: torch.Tensor, capacity: int) -> torch.Tensor:
    """``[N, E, C]`` one-hot of ``pos`` where ``mask`` (positions >= C give all-zero rows)."""
    ar = torch.arange(capacity, device=mask.device)
    return (pos.unsqueeze(-1) == ar).to(torch.float32) * mask.unsqueeze(-1).to(torch.float32)


def _metrics(kept: torch.Tensor, wanted: torch.Tensor, temperature: float,
             balance: torch.Tensor) -> dict:
    if torch.compiler.is_exporting():
        return {}  # metrics are eager-only; keep them out of the captured graph
    kept_f = kept.detach().float()
    total = kept_f.sum()
    load = kept_f.sum(0) / total.clamp_min(1.0)
    mean = load.mean()
    cv = load.std(unbiased=False) / mean.clamp_min(1e-12)
    want = wanted.detach().float().sum()
    return {
        "temperature": torch.tensor(float(temperature), device=kept.device),
        "experts_per_token": kept_f.sum(-1).mean(),
        "load": load,
        "load_cv": cv,
        "dropped_fraction": (want - total) / want.clamp_min(1.0),
        "balance_loss": balance.detach(),
    }


class BaseGate(nn.Module):
    """Common gate state: linear router ``w_gate`` (no bias) and the update counter.

    Args:
        hidden: token feature size.
        num_experts: E.
        aux_weight: weight of the load-balancing loss in ``GateOutput.aux_loss`` (0.01).
    """

    num_updates: torch.Tensor  # buffer (registered in __init__), int64 scalar

    def __init__(self, hidden: int, num_experts: int, aux_weight: float = 0.01):
        super().__init__()
        if num_experts < 1:
            raise ModelArgumentError(f"num_experts must be >= 1, got {num_experts}")
        self.num_experts = num_experts
        self.aux_weight = aux_weight
        self.w_gate = nn.Linear(hidden, num_experts, bias=False)
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.long))
        self._updates = 0  # Python mirror of num_updates (routing must not read tensors)

    def advance(self) -> None:
        """Count one optimizer update. Call once after each ``optimizer.step()``."""
        self._updates += 1
        self._sync_buffers()

    @property
    def updates(self) -> int:
        """Optimizer updates counted so far."""
        return self._updates

    def _sync_buffers(self) -> None:
        if self.num_updates.device.type != "meta":
            self.num_updates.fill_(self._updates)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.num_updates.device.type != "meta":
            self._updates = int(self.num_updates.item())
        self._sync_buffers()

    def capacity(self, num_tokens: int, factor: float | None, k: int = 1) -> int:
        """Slots per expert: ``ceil(factor * k * tokens / experts)``; None = no dropping (N)."""
        if factor is None:
            return num_tokens
        return max(1, math.ceil(factor * k * num_tokens / self.num_experts))


class SwitchGate(BaseGate):
    """Switch Transformer gate: softmax, top-1, capacity, token dropping, balance loss.

    Args:
        hidden, num_experts, aux_weight: see :class:`BaseGate`.
        capacity_factor: capacity = ``ceil(capacity_factor * tokens / experts)``; tokens beyond
            it (in token order) are dropped. None disables dropping.
    Combine weight = the chosen expert's softmax probability.
    """

    def __init__(self, hidden: int, num_experts: int, capacity_factor: float | None = 1.25,
                 aux_weight: float = 0.01):
        super().__init__(hidden, num_experts, aux_weight)
        self.capacity_factor = capacity_factor

    def forward(self, x: torch.Tensor) -> GateOutput:
        return self.route(self.w_gate(x))

    def route(self, logits: torch.Tensor) -> GateOutput:
        """Route from router logits ``[N, E]`` (used by tests with hand-built logits)."""
        n, e = logits.shape
        probs = F.softmax(logits.float(), dim=-1)
        idx = probs.argmax(-1)
        mask = (idx.unsqueeze(-1) == torch.arange(e, device=logits.device))
        cap = self.capacity(n, self.capacity_factor)
        pos = _positions(mask)
        kept = mask & (pos < cap)
        dispatch = _slots(kept, pos, cap)
        cw = probs * kept
        balance = load_balancing_loss(probs, mask)
        return GateOutput(cw, kept, dispatch, dispatch * cw.unsqueeze(-1),
                          self.aux_weight * balance, cap,
                          _metrics(kept, mask, float("nan"), balance))


class Top2Gate(BaseGate):
    """GShard top-2 gate.

    Each token goes to its two most probable experts with weights ``p1/(p1+p2)`` and
    ``p2/(p1+p2)``. Capacity = ``ceil(capacity_factor * 2 * tokens / experts)``; first choices
    take slots before second choices (GShard), each in token order; overflow is dropped.

    Second expert policy (``second_policy``): ``"all"`` (default) always keeps it —
    deterministic, our choice for reproducible tests and plans; ``"random"`` is GShard's random
    routing: in training the second expert is kept with probability ``min(1, 2·g2)`` (g2 its
    normalised weight). Balance loss as Switch/GShard: ``E · Σ f_e P_e`` over first choices.
    """

    def __init__(self, hidden: int, num_experts: int, capacity_factor: float | None = 1.25,
                 aux_weight: float = 0.01, second_policy: str = "all"):
        super().__init__(hidden, num_experts, aux_weight)
        if num_experts < 2:
            raise ModelArgumentError("Top2Gate needs at least 2 experts")
        if second_policy not in ("all", "random"):
            raise ModelArgumentError(f"second_policy must be 'all' or 'random', got {second_policy!r}")
        self.capacity_factor = capacity_factor
        self.second_policy = second_policy

    def forward(self, x: torch.Tensor) -> GateOutput:
        return self.route(self.w_gate(x))

    def route(self, logits: torch.Tensor) -> GateOutput:
        """Route from router logits ``[N, E]``."""
        n, e = logits.shape
        ar = torch.arange(e, device=logits.device)
        probs = F.softmax(logits.float(), dim=-1)
        idx1 = probs.argmax(-1)
        mask1 = idx1.unsqueeze(-1) == ar
        idx2 = probs.masked_fill(mask1, float("-inf")).argmax(-1)
        mask2 = idx2.unsqueeze(-1) == ar
        g1 = (probs * mask1).sum(-1)
        g2 = (probs * mask2).sum(-1)
        denom = (g1 + g2).clamp_min(torch.finfo(probs.dtype).eps)
        g1, g2 = g1 / denom, g2 / denom
        if self.second_policy == "random" and self.training:
            keep2 = torch.rand_like(g2) < 2 * g2
            mask2 = mask2 & keep2.unsqueeze(-1)
        cap = self.capacity(n, self.capacity_factor, k=2)
        pos1 = _positions(mask1)
        kept1 = mask1 & (pos1 < cap)
        pos2 = _positions(mask2, kept1.long().sum(0))
        kept2 = mask2 & (pos2 < cap)
        d1, d2 = _slots(kept1, pos1, cap), _slots(kept2, pos2, cap)
        cw = g1.unsqueeze(-1) * kept1 + g2.unsqueeze(-1) * kept2
        combine = d1 * g1[:, None, None] + d2 * g2[:, None, None]
        balance = load_balancing_loss(probs, mask1)
        kept = kept1 | kept2
        return GateOutput(cw, kept, d1 + d2, combine, self.aux_weight * balance, cap,
                          _metrics(kept, mask1 | mask2, float("nan"), balance))


class DTSGate(BaseGate):
    """DTS-Gate (dense-to-sparse): Gumbel-softmax routing with an annealed temperature.

    Dense phase (fewer than ``H`` updates): ``g = gumbel_softmax(logits, tau)``; every expert
    with ``g > threshold`` processes the token, combined with weight ``g``; no dropping
    (capacity = tokens). Sparse phase (``H`` updates on): hard top-1 on the Gumbel sample
    ``argmax g``, combined with that ``g``; capacity from ``sparse_capacity_factor`` (None =
    no dropping, the default). ``tau = dts_temperature(updates, tau_max, tau_min, D, kind)``.
    Outside training (``eval()``) the Gumbel noise is omitted (``g = softmax(logits/tau)``).
    The Switch balance loss (on ``g``'s top-1) is added with weight ``aux_weight``.

    State buffers (in ``state_dict``): ``num_updates``, ``temperature``, ``sparse`` (0/1).
    The exported graph reflects the phase current at capture time.

    Args:
        hidden, num_experts, aux_weight: see :class:`BaseGate`.
        tau_max, tau_min, D, kind: temperature schedule (authors: 2.0, 0.5, 5000, linear).
        H: updates before the hard top-1 switch (authors: 6000).
        threshold: minimum ``g`` for an expert in the dense phase (authors: 0.001).
        sparse_capacity_factor: capacity factor after the switch (None: no dropping).
    """

    temperature: torch.Tensor  # buffer (registered in __init__), float scalar
    sparse: torch.Tensor  # buffer (registered in __init__), int64 0/1

    def __init__(self, hidden: int, num_experts: int, tau_max: float = 2.0, tau_min: float = 0.5,
                 D: int = 5000, H: int = 6000, kind: str = "linear", threshold: float = 0.001,
                 sparse_capacity_factor: float | None = None, aux_weight: float = 0.01):
        super().__init__(hidden, num_experts, aux_weight)
        dts_temperature(0, tau_max, tau_min, D, kind)  # validate arguments
        if H < 0:
            raise ModelArgumentError(f"H must be >= 0, got {H}")
        self.tau_max, self.tau_min, self.D, self.H, self.kind = tau_max, tau_min, D, H, kind
        self.threshold = threshold
        self.sparse_capacity_factor = sparse_capacity_factor
        self.register_buffer("temperature", torch.tensor(float(tau_max)))
        self.register_buffer("sparse", torch.tensor(int(H == 0), dtype=torch.long))
        self._sync_buffers()

    @property
    def tau(self) -> float:
        """Current temperature (from the update counter)."""
        return dts_temperature(self._updates, self.tau_max, self.tau_min, self.D, self.kind)

    @property
    def phase(self) -> str:
        """``"dense"`` before ``H`` updates, ``"sparse"`` (hard top-1) after."""
        return "sparse" if self._updates >= self.H else "dense"

    def _sync_buffers(self) -> None:
        super()._sync_buffers()
        if hasattr(self, "temperature") and self.temperature.device.type != "meta":
            self.temperature.fill_(self.tau)
            self.sparse.fill_(int(self.phase == "sparse"))

    def forward(self, x: torch.Tensor) -> GateOutput:
        return self.route(self.w_gate(x))

    def route(self, logits: torch.Tensor) -> GateOutput:
        """Route from router logits ``[N, E]``."""
        n, e = logits.shape
        tau = self.tau
        logits = logits.float()
        if self.training:
            u = torch.rand_like(logits).clamp(1e-9, 1.0 - 1e-9)
            logits = logits - torch.log(-torch.log(u))
        g = F.softmax(logits / tau, dim=-1)
        top1 = g.argmax(-1).unsqueeze(-1) == torch.arange(e, device=g.device)
        balance = load_balancing_loss(g, top1)
        if self.phase == "dense":
            mask = g > self.threshold
            cap = n
        else:
            mask = top1
            cap = self.capacity(n, self.sparse_capacity_factor)
        pos = _positions(mask)
        kept = mask & (pos < cap)
        dispatch = _slots(kept, pos, cap)
        cw = g * kept
        return GateOutput(cw, kept, dispatch, dispatch * cw.unsqueeze(-1),
                          self.aux_weight * balance, cap, _metrics(kept, mask, tau, balance))


GATES = {"switch": SwitchGate, "top2": Top2Gate, "dts": DTSGate}


def make_gate(kind: str, hidden: int, num_experts: int, **gate_kw) -> BaseGate:
    """Build a gate by name (``"switch"``, ``"top2"``, ``"dts"``) with its keyword arguments.

    Raises:
        ModelArgumentError: (a ValueError) unknown gate name.
    """
    if kind not in GATES:
        raise ModelArgumentError(f"unknown gate {kind!r}; valid gates: {', '.join(GATES)}")
    return GATES[kind](hidden, num_experts, **gate_kw)
