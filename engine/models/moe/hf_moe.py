"""Hugging Face sparse mixture-of-experts blocks (Mixtral, Qwen2-MoE, Qwen3-MoE style).

transformers 5 writes these blocks as ``block.gate`` (a top-k router: ``gate(x [N, H]) ->
(router_logits [N, E], top_k_weights [N, k], top_k_index [N, k])``) and ``block.experts`` (the
experts' weights stacked in 3-D parameters, ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``,
called as ``experts(x [N, H], top_k_index, top_k_weights) -> [N, H]``). Every token runs through
exactly ``k`` experts (no capacity limit, no dropped tokens).

:func:`hf_moe_blocks` finds them so the planner counts their experts' FLOPs and plans expert
parallelism for them, and the runtime keeps them eager inside traced stages and splits their
experts over the data-parallel replicas.

Source: transformers ``models/mixtral/modeling_mixtral.py`` (``MixtralSparseMoeBlock``,
``MixtralTopKRouter``, ``MixtralExperts``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from torch import nn

__all__ = ["HFMoEBlock", "hf_moe_blocks", "is_hf_moe_block", "traceable_experts", "TRACEABLE_EXPERTS"]


@dataclass(frozen=True)
class HFMoEBlock:
    """Shape of one HF sparse MoE block.

    Attributes:
        path: module path (``model.layers.3.mlp``).
        num_experts: ``E``.
        top_k: experts per token ``k``.
        hidden: model width ``H``.
        intermediate: expert FFN width ``I``.
        expert_param_bytes: bytes of all ``E`` experts' parameters.
        dtype_bytes: bytes per parameter element.
    """

    path: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    expert_param_bytes: int
    dtype_bytes: int

    def forward_flops(self, tokens: int) -> float:
        """Experts' forward FLOPs for ``tokens`` tokens: each token runs ``k`` SwiGLU experts, two
        matmuls ``H -> 2I`` and one ``I -> H``: ``2 * tokens * k * (H*2I + I*H)`` (plus the router's
        ``2 * tokens * H * E``)."""
        per_token = 2 * self.top_k * (self.hidden * 2 * self.intermediate + self.intermediate * self.hidden)
        return float(tokens * (per_token + 2 * self.hidden * self.num_experts))


def is_hf_moe_block(m: nn.Module) -> bool:
    """``m`` has a router ``gate`` and an ``experts`` child holding 3-D ``gate_up_proj`` and
    ``down_proj`` parameters (the transformers 5 sparse MoE block layout)."""
    experts = getattr(m, "experts", None)
    gate = getattr(m, "gate", None)
    if not isinstance(experts, nn.Module) or not isinstance(gate, nn.Module):
        return False
    gu = getattr(experts, "gate_up_proj", None)
    dn = getattr(experts, "down_proj", None)
    return isinstance(gu, nn.Parameter) and isinstance(dn, nn.Parameter) and gu.dim() == 3 and dn.dim() == 3


def hf_moe_blocks(model: nn.Module) -> list[HFMoEBlock]:
    """Every HF sparse MoE block of ``model`` in module order (works on the meta device)."""
    out = []
    for path, m in model.named_modules():
        if not is_hf_moe_block(m):
            continue
        gu = m.experts.gate_up_proj
        e, two_i, h = (int(x) for x in gu.shape)
        k_attr: Any = getattr(m, "top_k", None) or getattr(m.gate, "top_k", 1)
        k = int(k_attr)
        nbytes = sum(p.numel() * p.element_size() for p in m.experts.parameters())
        out.append(HFMoEBlock(path, e, k, h, two_i // 2, int(nbytes), int(gu.element_size())))
    return out


#: experts implementations of transformers 5 that torch.export can trace with fake tensors (the
#: default ``"eager"`` loops over the experts hit by the router: data-dependent control flow)
TRACEABLE_EXPERTS = ("grouped_mm", "batched_mm")


@contextlib.contextmanager
def traceable_experts(model: nn.Module, implementation: str = "grouped_mm") -> Iterator[list[str]]:
    """Run the HF MoE blocks of ``model`` with a traceable experts implementation inside the block.

    transformers 5's default ``"eager"`` experts loop (``for expert_idx in expert_hit``) depends on
    the routing, so ``torch.export`` with fake tensors cannot trace it; ``"grouped_mm"`` (one
    grouped matmul per projection over the tokens sorted by expert) computes the same function
    with the same FLOPs (every token through its ``k`` experts) and traces. Each experts module's
    ``config._experts_implementation`` that is ``"eager"`` or unset is switched for the block and
    restored on exit; other implementations are kept.

    Args:
        model: any module (no HF MoE blocks: nothing changes).
        implementation: ``"grouped_mm"`` or ``"batched_mm"``.

    Yields:
        The paths of the blocks whose experts were switched.

    Raises:
        ValueError: ``implementation`` is not traceable.

    Source: transformers ``integrations/moe.py`` (``use_experts_implementation``).
    """
    if implementation not in TRACEABLE_EXPERTS:
        raise ValueError(f"experts implementation {implementation!r} is not traceable; use one of "
                         f"{', '.join(TRACEABLE_EXPERTS)}")
    saved: list[tuple[Any, Any]] = []
    switched: list[str] = []
    seen: set[int] = set()
    for path, m in model.named_modules():
        if not is_hf_moe_block(m):
            continue
        cfg = getattr(m.experts, "config", None)
        if cfg is None or getattr(cfg, "_experts_implementation", None) not in (None, "eager"):
            continue
        switched.append(path)
        if id(cfg) not in seen:
            seen.add(id(cfg))
            saved.append((cfg, cfg._experts_implementation))
    for cfg, _ in saved:
        cfg._experts_implementation = implementation
    try:
        yield switched
    finally:
        for cfg, old in reversed(saved):
            cfg._experts_implementation = old
