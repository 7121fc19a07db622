"""Activation recomputation granularities of a plan (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", MLSys 2023, sections 4 and 5).

- ``none``: every tensor the backward needs is kept from the forward.
- ``selective``: the attention core (Q·Kᵀ, softmax, its dropout, ·V) is not kept but
  recomputed in the backward; what it saves is the ``5·a·s/h`` term of the paper's per-layer
  ``s·b·h·(34 + 5·a·s/h)`` bytes (nothing where a fused kernel, SDPA or FlashAttention, never
  stored the scores).
- ``full``: each transformer layer keeps only its input; the whole layer's forward runs again
  inside its backward (torchtitan's ``activation_checkpoint.mode = "full"``, Megatron-LM's
  ``--recompute-granularity full --recompute-method uniform``).

The runtime applies them with ``torch.utils.checkpoint`` (non-reentrant); the planner's memory
and time models count what each keeps and what each recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence, get_args

from engine.errors import TransformError

RecomputeName = Literal["none", "selective", "full"]
"""A plan's activation recomputation granularity."""

RECOMPUTE: tuple[str, ...] = get_args(RecomputeName)

#: Suffix of a dropout mask's entry in a captured op's ``saved`` list (``"dropout_1.mask"``): the
#: mask is a tensor of its own beside the dropout's output (which a consumer may save, keyed by the
#: op itself), so a per-layer count keyed by storage counts both (:mod:`engine.graph.capture`).
MASK_SUFFIX = ".mask"


def check_recompute(name: str) -> str:
    """``name`` if it is a granularity (:data:`RECOMPUTE`).

    Raises:
        TransformError: any other value (the message lists the three).
    """
    if name not in RECOMPUTE:
        raise TransformError(f"unknown recomputation {name!r}; use one of {', '.join(RECOMPUTE)}")
    return name




# ---------------------------------------------------------------------------------------------
# the attention core of a captured transformer block
# ---------------------------------------------------------------------------------------------
#: op kinds between ``Q·Kᵀ`` and ``·V`` in an eager attention: scale, mask, softmax, casts, dropout
_CORE_PATH_KINDS = frozenset({"elementwise", "view", "movement", "dropout", "softmax"})


def attention_core_ops(graph, ops: Sequence[str]) -> tuple[frozenset[str], frozenset[str]]:
    """The attention core of one transformer block's ops: ``(core, interior)``.

    The core is what Korthikanti et al. (2022, section 5, "selective activation recomputation")
    recompute: from the ``Q·Kᵀ`` matmul through the scale, the mask, the softmax and its dropout to
    the ``·V`` matmul. ``core`` holds all of these ops (their forward time is what selective
    recomputation runs again); ``interior`` is ``core`` without the ``·V`` matmul, the ops whose
    saved tensors selective recomputation drops (the ``5·a·s²·b`` bytes of section 4: the softmax
    output, its dropout mask and the dropout output the ``·V`` matmul keeps; ``Q``, ``K``, ``V``
    and the ``·V`` output stay, they are the core's inputs and output).

    Found from each ``softmax`` op of ``ops``: backwards through element-wise ops, views, casts
    and dropouts to the matmul producing its input, forwards to the matmul consuming it. A fused
    attention (``aten.scaled_dot_product_attention``: SDPA, FlashAttention) has no softmax op and
    never stores the ``s x s`` scores, so its core is empty: nothing to drop, nothing recomputed.

    Args:
        graph: the :class:`~engine.graph.OpGraph`.
        ops: one layer's op ids (:attr:`~engine.graph.LayerSummary.ops`).

    Returns:
        Two frozensets of op ids (both empty when the layer has no eager attention).
    """
    mine = set(ops)
    core: set[str] = set()
    interior: set[str] = set()
    for sm in ops:
        if graph.nodes[sm].get("kind") != "softmax":
            continue
        back, start = _walk_to_matmul(graph, sm, mine, graph.predecessors)
        fwd, end = _walk_to_matmul(graph, sm, mine, graph.successors)
        if start is None or end is None:
            continue
        interior |= back | fwd | {sm, start}
        core |= back | fwd | {sm, start, end}
    return frozenset(core), frozenset(interior)


def _walk_to_matmul(graph, origin: str, mine: set[str], step) -> tuple[set[str], str | None]:
    """Ops reached from ``origin`` along ``step`` (predecessors or successors) through
    :data:`_CORE_PATH_KINDS` inside ``mine``, and the first matmul met (``None``: none)."""
    seen: set[str] = set()
    todo = [origin]
    found: str | None = None
    while todo:
        for nb in step(todo.pop()):
            if nb not in mine or nb in seen:
                continue
            kind = graph.nodes[nb].get("kind")
            if kind == "matmul":
                found = found or nb
            elif kind in _CORE_PATH_KINDS:
                seen.add(nb)
                todo.append(nb)
    return seen, found


# ---------------------------------------------------------------------------------------------
# what each granularity keeps and recomputes, per layer and per segment
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerActivation:
    """One layer's activation facts on one tensor-parallel rank, per micro-batch.

    Attributes:
        name: the layer's module path.
        block: a transformer block (recomputable); embedding, head and loss layers are not.
        saved_bytes: bytes its ops keep for the backward with no recomputation.
        core_bytes: of them, the attention core's (:func:`attention_core_ops`, ``interior``).
        input_bytes: bytes of the hidden state entering the block (0 for a non-block layer).
        forward_time: seconds of its forward, tensor-parallel collectives included.
        core_time: seconds of its attention core's forward.
    """

    name: str
    block: bool
    saved_bytes: int
    core_bytes: int = 0
    input_bytes: int = 0
    forward_time: float = 0.0
    core_time: float = 0.0


def kept_bytes(layer: LayerActivation, recompute: str) -> int:
    """Bytes ``layer`` keeps from its forward to its backward per micro-batch under ``recompute``.

    - ``none``: :attr:`~LayerActivation.saved_bytes` (Korthikanti et al. 2022, section 4,
      ``s·b·h·(34 + 5·a·s/h)`` at 16 bits for a GPT block);
    - ``selective``: without the attention core's tensors (section 5: the ``5·a·s/h`` term goes);
    - ``full``: only the block's input (section 5, "full activation recomputation": ``2·s·b·h``
      per layer at 16 bits; divided by ``t`` with sequence parallelism).

    A non-block layer keeps its saved bytes under every granularity.

    Raises:
        TransformError: an unknown granularity.
    """
    check_recompute(recompute)
    if not layer.block or recompute == "none":
        return layer.saved_bytes
    if recompute == "selective":
        return layer.saved_bytes - layer.core_bytes
    return layer.input_bytes


def recompute_seconds(layer: LayerActivation, recompute: str) -> float:
    """Seconds of forward ``layer``'s backward runs again under ``recompute``: the whole forward
    with its tensor-parallel collectives (``full``), the attention core's forward (``selective``;
    0 for a fused attention, which drops nothing), else 0 (Korthikanti et al. 2022, section 5).

    Raises:
        TransformError: an unknown granularity.
    """
    check_recompute(recompute)
    if not layer.block or recompute == "none":
        return 0.0
    return layer.forward_time if recompute == "full" else (layer.core_time if layer.core_bytes else 0.0)


def working_set_bytes(layer: LayerActivation, recompute: str) -> int:
    """Bytes live only while ``layer``'s backward runs, recomputed for it: its whole saved
    activations (``full``: one layer's recomputation working set), its attention core's
    (``selective``), else 0.

    Raises:
        TransformError: an unknown granularity.
    """
    check_recompute(recompute)
    if not layer.block or recompute == "none":
        return 0
    return layer.saved_bytes if recompute == "full" else layer.core_bytes


@dataclass(frozen=True)
class SegmentRecompute:
    """What a segment of layers keeps and recomputes per micro-batch under one granularity.

    Attributes:
        recompute: the granularity (:data:`RECOMPUTE`).
        kept_bytes: activation bytes held from its forward to its backward (sum of
            :func:`kept_bytes`).
        recompute_time: seconds of forward its backward runs again (sum of
            :func:`recompute_seconds`); inside the backward (the ``I`` block when it is split).
        working_set_bytes: bytes live only during its backward: the largest layer's
            :func:`working_set_bytes` (layers are recomputed one at a time).
    """

    recompute: str
    kept_bytes: int
    recompute_time: float
    working_set_bytes: int


def segment_recompute(layers: Sequence[LayerActivation], recompute: str) -> SegmentRecompute:
    """:class:`SegmentRecompute` of contiguous ``layers`` under ``recompute``.

    Raises:
        TransformError: an unknown granularity.
    """
    check_recompute(recompute)
    return SegmentRecompute(
        recompute,
        sum(kept_bytes(la, recompute) for la in layers),
        sum(recompute_seconds(la, recompute) for la in layers),
        max((working_set_bytes(la, recompute) for la in layers), default=0),
    )


def stage_granularities(default: str, num_segments: int, pp: int,
                        stage_recompute: Sequence[str] | None = None) -> list[str]:
    """The granularity of each of ``num_segments`` segments: ``default`` for all, or the
    per-stage override ``stage_recompute`` (one per segment, or one per pipeline rank ``pp``,
    which then applies to the rank's segments ``s`` with ``s % pp == rank``).

    Raises:
        TransformError: an unknown granularity, or an override of another length.
    """
    check_recompute(default)
    if stage_recompute is None:
        return [default] * num_segments
    names = [check_recompute(str(x)) for x in stage_recompute]
    if len(names) == num_segments:
        return names
    if len(names) == pp:
        return [names[s % pp] for s in range(num_segments)]
    raise TransformError(f"stage_recompute has {len(names)} values; give one per segment ({num_segments}) "
                         f"or one per pipeline stage ({pp})")


def plan_granularities(plan: Any) -> list[str]:
    """The granularity each segment of a loaded plan recomputes with: the segment's own
    ``"recompute"`` where the plan records one (a per-stage override, or any granularity other
    than ``none``), else ``plan.parallel.recompute`` (``none`` for a plan written before
    recomputation existed). One entry per ``plan.segments`` item, in order.

    Raises:
        TransformError: a recorded value that is not a granularity.
    """
    default = getattr(plan.parallel, "recompute", "none") or "none"
    return [check_recompute(str(seg.get("recompute", default))) for seg in plan.segments]


__all__ = ["MASK_SUFFIX", "RECOMPUTE", "LayerActivation", "RecomputeName", "SegmentRecompute", "attention_core_ops",
           "check_recompute", "kept_bytes", "plan_granularities", "recompute_seconds", "segment_recompute",
           "stage_granularities", "working_set_bytes"]
