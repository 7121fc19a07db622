"""Expert-parallel all-to-all traffic of MoE layers, for the planner (and the runtime's byte log).

Convention (GShard, Lepikhin et al. 2020, section 2.2; DeepSpeed-MoE, Rajbhandari et al. 2022):
the expert-parallel (EP) group of a pipeline segment is its data-parallel group, ``ep = dp``:
the ``dp`` replicas of one pipeline rank each hold ``num_experts / dp`` experts of every MoE layer
(the gate and all non-expert parameters stay replicated) and exchange tokens with all-to-alls.
With ``dp == 1`` every expert is local and there is no all-to-all.

Per MoE layer and micro-batch (see :mod:`runtime.expert_parallel` for the execution)::

    forward :  dispatch all-to-all  (expert_in  [E, C, hidden] -> the experts' owners)
               combine  all-to-all  (expert_out [E, C, hidden] -> back to the tokens' rank)
    backward:  combine-grad all-to-all, then dispatch-grad all-to-all (the transposes, same sizes)

so a segment with ``L`` MoE layers runs ``2 L`` all-to-alls after each forward block and ``2 L``
after each backward block (``B``, or ``I`` with a split backward; ``W`` has none: the weight
gradient of the experts needs no token exchange).

Bytes of one all-to-all (:func:`all_to_all_bytes`, the same arithmetic as
``runtime.expert_parallel.all_to_all_bytes``): the whole send buffer of one rank,
``E * C * hidden * element_size`` (``"bytes_total"``); the rank keeps its own ``1/P`` slice, so
``(P-1)/P`` of it crosses the wire (``"bytes"``). The planner's ``ALLTOALL`` instructions carry
``bytes_total``: :func:`engine.cost.comm.collective_time` ("alltoall") takes the full send
buffer and applies the ``(P-1)/P`` factor itself.

Capacity ``C`` (:func:`gate_capacity`) is what the layer allocates for the rank's own tokens
(``micro_batch_size * seq_len``), exactly as the gate computes it
(:meth:`engine.models.moe.gates.BaseGate.capacity`): Switch ``ceil(f * N / E)`` (k = 1), GShard
top-2 ``ceil(f * 2 N / E)`` (k = 2), DTS-Gate ``N`` in its dense phase (no dropping) and
``capacity(N, sparse_capacity_factor)`` in its sparse phase (``N`` with the default
``None``). A DTS plan uses the phase of the gate at planning time (dense for a fresh model),
as the captured graph does.

Hugging Face sparse MoE blocks (Mixtral, Qwen-MoE style, :mod:`engine.models.moe.hf_moe`) route
every token to exactly ``k`` experts with no capacity limit; under expert parallelism
(``runtime.expert_parallel_hf``) each rank sends its ``N * k`` (token, expert) rows with a
variable-size all-to-all, so one all-to-all's send buffer is ``N * k * hidden * element_size``
(:attr:`MoELayer.rows` = ``N * k``; ``capacity`` records the balanced load ``ceil(N k / E)``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from torch import nn

from engine.errors import TransformError

from .gates import BaseGate, DTSGate, SwitchGate, Top2Gate
from .hf_moe import HFMoEBlock, hf_moe_blocks
from .layer import MoEFeedForward

__all__ = ["MoELayer", "all_to_all_bytes", "gate_capacity", "find_moe_layers", "hf_moe_layer", "HF_GATE",
           "segment_moe_layers",
           "check_expert_parallel", "valid_ep_degrees", "moe_segment_collectives", "expert_param_bytes_per_rank"]


def all_to_all_bytes(num_experts: int, capacity: int, hidden: int, world: int,
                     element_size: int = 4) -> dict[str, int]:
    """Traffic of one expert-parallel all-to-all (pure arithmetic).

    The exchanged tensor is ``[E, C, hidden]`` per rank (``element_size`` bytes per value); a rank
    keeps its own ``1/P`` and sends the rest. Each MoE layer does 2 all-to-alls in forward and 2
    in backward per micro-batch.

    Args:
        num_experts: ``E`` (global experts of the layer).
        capacity: ``C`` slots per expert for the rank's tokens (:func:`gate_capacity`).
        hidden: token feature size.
        world: ``P``, ranks of the expert-parallel group.
        element_size: bytes per value of the dispatched tensor (the activation dtype).

    Returns:
        ``{"bytes_total": E*C*hidden*element_size (one rank's send buffer), "bytes": bytes sent to
        other ranks (bytes_total * (P-1) // P), "per_layer_step": 4 * bytes}``.

    Raises:
        ValueError: ``num_experts`` not divisible by ``world`` or a non-positive size.
    """
    if min(num_experts, capacity, hidden, world, element_size) < 1:
        raise ValueError("all sizes must be positive")
    if num_experts % world:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {world} ranks")
    total = num_experts * capacity * hidden * element_size
    sent = total * (world - 1) // world
    return {"bytes_total": total, "bytes": sent, "per_layer_step": 4 * sent}


def gate_capacity(gate: BaseGate, num_tokens: int) -> int:
    """Slots per expert ``C`` the gate allocates for ``num_tokens`` tokens (module docstring).

    Raises:
        ValueError: ``num_tokens < 1``.
    """
    n = int(num_tokens)
    if n < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if isinstance(gate, Top2Gate):
        return gate.capacity(n, gate.capacity_factor, k=2)
    if isinstance(gate, SwitchGate):
        return gate.capacity(n, gate.capacity_factor)
    if isinstance(gate, DTSGate):
        return n if gate.phase == "dense" else gate.capacity(n, gate.sparse_capacity_factor)
    # another BaseGate subclass: top-1 with its capacity_factor attribute (None = no dropping)
    return gate.capacity(n, getattr(gate, "capacity_factor", None))


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer as the planner sees it (JSON-able via :meth:`to_dict`).

    Attributes:
        path: module path, e.g. ``"transformer.h.1.mlp"``.
        num_experts: ``E`` (global).
        capacity: ``C`` for one micro-batch on one rank (:func:`gate_capacity`).
        hidden: token feature size.
        element_size: bytes per value of the dispatched tensor.
        gate: ``"switch"``, ``"top2"``, ``"dts"`` (the layer's ``gate_kind``), ``"hf-topk"``
            (a Hugging Face sparse MoE block, :data:`HF_GATE`).
        expert_param_bytes: parameter bytes of ALL experts of the layer (each rank holds
            ``1/ep`` of them under expert parallelism).
        rows: rows of one rank's all-to-all send buffer when it is not the padded ``[E, C]``
            (HF blocks: ``N * k``, the variable all-to-all); ``None``: ``E * C``.
    """

    path: str
    num_experts: int
    capacity: int
    hidden: int
    element_size: int = 4
    gate: str = "switch"
    expert_param_bytes: int = 0
    rows: int | None = None

    def all_to_all_bytes(self, ep: int) -> int:
        """``bytes_total`` of one all-to-all of this layer over ``ep`` ranks: :func:`all_to_all_bytes`
        (``E * C * hidden * element_size``), or ``rows * hidden * element_size`` when :attr:`rows`
        is set.

        Raises:
            ValueError: the experts do not divide by ``ep`` or a non-positive size.
        """
        if self.rows is None:
            return all_to_all_bytes(self.num_experts, self.capacity, self.hidden, ep, self.element_size)["bytes_total"]
        all_to_all_bytes(self.num_experts, 1, self.hidden, ep, self.element_size)  # the same checks
        return int(self.rows) * self.hidden * self.element_size

    def to_dict(self) -> dict:
        """JSON form; ``rows`` only when set (plans of the built-in MoE are unchanged)."""
        d = asdict(self)
        if self.rows is None:
            d.pop("rows")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MoELayer":
        """Inverse of :meth:`to_dict`. Raises KeyError/TypeError/ValueError on a malformed dict."""
        rows = d.get("rows")
        return cls(str(d["path"]), int(d["num_experts"]), int(d["capacity"]), int(d["hidden"]),
                   int(d.get("element_size", 4)), str(d.get("gate", "switch")), int(d.get("expert_param_bytes", 0)),
                   None if rows is None else int(rows))


#: ``MoELayer.gate`` of a Hugging Face sparse MoE block (top-k routing, no capacity limit)
HF_GATE = "hf-topk"


def hf_moe_layer(block: HFMoEBlock, num_tokens: int) -> MoELayer:
    """The :class:`MoELayer` of an HF sparse MoE block for ``num_tokens`` tokens per rank.

    Every token goes to ``k`` experts (no dropping): the all-to-all sends ``rows = N * k`` rows of
    ``hidden`` values (``runtime.expert_parallel_hf``); ``capacity`` is the balanced per-expert
    load ``ceil(N * k / E)`` (informational: the bytes follow ``rows``).

    Raises:
        ValueError: ``num_tokens < 1``.
    """
    n = int(num_tokens)
    if n < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    rows = n * block.top_k
    return MoELayer(block.path, block.num_experts, -(-rows // block.num_experts), block.hidden,
                    block.dtype_bytes, HF_GATE, block.expert_param_bytes, rows)


def find_moe_layers(module: nn.Module, num_tokens: int) -> list[MoELayer]:
    """Every MoE layer of ``module`` in module order: the built-in
    :class:`~engine.models.moe.layer.MoEFeedForward` layers and Hugging Face sparse MoE blocks
    (:func:`~engine.models.moe.hf_moe.hf_moe_blocks`, as :func:`hf_moe_layer`).

    Works on meta-device models (only shapes and dtypes are read).

    Args:
        module: the model.
        num_tokens: tokens of one micro-batch on one rank (``micro_batch_size * seq_len``).
    """
    hf = {b.path: b for b in hf_moe_blocks(module)}
    out = []
    for name, m in module.named_modules():
        if name in hf:
            out.append(hf_moe_layer(hf[name], num_tokens))
            continue
        if not isinstance(m, MoEFeedForward):
            continue
        gate = m.gate
        w = gate.w_gate.weight
        experts = sum(p.numel() * p.element_size() for p in m.experts.parameters())
        local_experts = getattr(m, "local_experts", None)
        if local_experts:  # an already expert-parallel layer holds E/P experts
            experts = experts * gate.num_experts // int(local_experts)
        out.append(MoELayer(name, int(gate.num_experts), gate_capacity(gate, num_tokens), int(w.shape[1]),
                            int(w.element_size()), str(getattr(m, "gate_kind", type(gate).__name__)), int(experts)))
    return out


def _inside(path: str, layer: str) -> bool:
    return path == layer or path.startswith(layer + ".")


def segment_moe_layers(layers: Iterable[MoELayer], segment_layers: Sequence[Sequence[str]]
                       ) -> dict[int, list[MoELayer]]:
    """Group MoE layers by the segment whose layer list contains their module path.

    Args:
        layers: from :func:`find_moe_layers`.
        segment_layers: ``segment_layers[s]`` = the module paths of segment ``s`` (``Segment.layers``).

    Returns:
        ``{segment: [MoELayer, ...]}`` in module order; segments without MoE layers are absent, and
        so is a MoE layer outside every segment's layers (it cannot be placed).
    """
    out: dict[int, list[MoELayer]] = {}
    for ml in layers:
        for s, names in enumerate(segment_layers):
            if any(_inside(ml.path, str(x)) for x in names):
                out.setdefault(s, []).append(ml)
                break
    return out


def valid_ep_degrees(num_experts: int) -> list[int]:
    """Expert-parallel degrees that split ``num_experts`` evenly (its divisors)."""
    return [d for d in range(1, int(num_experts) + 1) if num_experts % d == 0]


def check_expert_parallel(layers: Iterable[MoELayer], ep: int, model: str = "the model") -> None:
    """Raise unless every MoE layer's experts split evenly over ``ep`` (= dp) replicas.

    Raises:
        TransformError: names the model, its expert count, ``dp`` and the dp
            values that work.
    """
    for ml in layers:
        if ml.num_experts % ep:
            ok = ", ".join(str(d) for d in valid_ep_degrees(ml.num_experts))
            raise TransformError(
                f"{model} has {ml.num_experts} experts per MoE layer ({ml.path}), which cannot be split evenly "
                f"over dp={ep} data-parallel replicas (expert parallelism uses the data-parallel group: each "
                f"replica holds num_experts/dp experts); use dp in {{{ok}}}")


def moe_segment_collectives(layers: Sequence[MoELayer], ep: int, kind: str = "F") -> list[int]:
    """Bytes (``bytes_total``) of every all-to-all a block of a segment runs, in execution order.

    Args:
        layers: the segment's MoE layers in module (forward) order.
        ep: expert-parallel group size (= dp); ``1`` -> no all-to-all.
        kind: block kind: ``"F"`` (per layer in order: dispatch, combine), ``"B"``/``"I"``
            (per layer in reverse order: combine-grad, dispatch-grad), ``"W"`` (none).

    Returns:
        A list of ``2 * len(layers)`` byte counts (empty for ``W`` or ``ep == 1``).

    Raises:
        ValueError: unknown ``kind``; experts not divisible by ``ep`` (:func:`all_to_all_bytes`).
    """
    if kind not in ("F", "B", "I", "W"):
        raise ValueError(f"unknown block kind {kind!r}; use F, B, I or W")
    if ep <= 1 or kind == "W":
        return []
    order = list(layers) if kind == "F" else list(reversed(layers))
    out: list[int] = []
    for ml in order:
        n = ml.all_to_all_bytes(ep)
        out += [n, n]  # dispatch + combine (forward), combine-grad + dispatch-grad (backward)
    return out


def expert_param_bytes_per_rank(layers: Iterable[MoELayer], ep: int) -> int:
    """Parameter bytes of the experts one rank holds under expert parallelism over ``ep`` ranks
    (``expert_param_bytes / ep`` per layer; exact when the layer's experts divide by ``ep``)."""
    return sum(ml.expert_param_bytes // max(1, int(ep)) for ml in layers)
