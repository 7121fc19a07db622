"""Tessel placement shapes (V, X, M, NN, K, interleaved, MLLM, finetune, AlphaFold) and custom placements.

A *shape* is the placement of ONE micro-batch: the chain (a DAG) of its forward and backward
blocks and the device set of every block. Tessel (Lin et al., "Tessel: Boosting Distributed
Execution of Large DNN Models via Flexible Schedule Search", HPCA 2024, Fig. 2 and section III)
searches schedules for these shapes; the constructors here build them on ``n`` devices:

======================  ===============================================  ================
constructor             chain of one micro-batch                          segments
======================  ===============================================  ================
:func:`v_shape`         ``F0..F(n-1) -> B(n-1)..B0`` (1F1B pipeline)       ``n``
:func:`x_shape`         two opposite V chains (Chimera-like)             ``2n``
:func:`m_shape`         all-device block, a V, mirrored                    ``n + 1``
:func:`nn_shape`        all-device blocks at the start and middle of a V   ``n + 2``
:func:`k_shape`         two V branches on halves joined by a loss block    ``n + 1``
:func:`interleaved_shape`  ``pipeline_placement(n, virtual_stages=v)``     ``n * v``
:func:`mllm_shape`      all-device blocks at both ends of a V, mirrored    ``n + 2``
:func:`finetune_shape`  frozen all-device block (no backward), then a V    ``n + 1``
:func:`alphafold_shape`  ``r`` passes without gradients, then a trained V  ``(r + 1) n``
======================  ===============================================  ================

Units and conventions (shared by every constructor):

* durations are in the caller's unit: abstract "spans" by default (``forward=1.0``,
  ``backward=2.0``, Tessel's F=1/B=2), seconds when built from a cost model;
* memory is in the caller's unit: ``activation=1`` "micro-batch activation" by default,
  bytes when built from a captured model. A block's ``memory`` is allocated (``F``) or freed
  (``B``/``I``/``W``) on EACH device of its set, so every device's deltas sum to zero;
* a multi-device block (``devices`` lists several devices) occupies all of them at once;
* the segment numbering documented in each constructor is part of the API: the per-segment
  lists ``forward_times``, ``backward_times``, ``activation_bytes``, ``outputs`` and
  ``input_grads`` are indexed by it;
* ``split_backward=True`` replaces every ``B`` by ``I`` (input gradient, on the chain) and
  ``W`` (weight gradient, depends only on its ``I``), with ``I = (1 - weight_grad_fraction)``
  and ``W = weight_grad_fraction`` of the backward time; ``I`` frees
  ``round(activation * (1 - weight_grad_fraction))`` and ``W`` the rest, exactly as
  :func:`engine.placement.pipeline_placement` does (zero-bubble pipelines, Qi et al. 2023);
* ``forward_only=True`` gives the inference placement: ``F`` blocks only, with memory delta 0
  (no activation is kept for a backward).
* a segment run without gradients (finetune's frozen block, AlphaFold's recycling passes) has
  an ``F`` block only, with memory delta 0, in training placements too.

Block order in :attr:`Placement.blocks` is a topological order of the chain (its index is the
"chain position" the generic schedulers break ties with).

Every shape is one :class:`ShapeSpec` in :data:`SHAPES` (constructor, description, model
parts for :func:`engine.shape_costs.model_shape_placement`): adding a shape
touches that one registry.

Custom placements come from :func:`custom_placement` (a list of dicts) or a JSON file
(:func:`engine.io.placement_json.load_placement` / ``save_placement``)::

    {"format": "tessel-placement", "version": 1, "name": "my-shape", "num_devices": 2,
     "static_memory": [0, 0],
     "blocks": [{"kind": "F", "segment": 0, "devices": [0, 1], "duration": 1.0, "memory": 1,
                 "deps": []},
                {"kind": "B", "segment": 0, "devices": [0, 1], "duration": 2.0, "memory": -1,
                 "deps": ["0F"]}]}

Errors: every malformed input raises :class:`engine.errors.PlacementError` with a sentence
that names the offending argument or JSON field (e.g. ``blocks[3].devices``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Sequence

from engine.envelope import is_instance
from engine.errors import PlacementError, UnknownShapeError
from engine.io.placement_json import parse_blocks
from engine.placement import MAX_DEVICES, BlockSpec, Placement, TensorSpec, pipeline_placement

__all__ = [
    "v_shape", "x_shape", "m_shape", "m_model_shape", "nn_shape", "k_shape", "interleaved_shape",
    "mllm_shape", "finetune_shape", "alphafold_shape",
    "ShapeSpec", "make_shape", "find_shape", "SHAPES", "shape_names", "custom_placement",
]


# --------------------------------------------------------------------------- helpers
def _check_devices(shape: str, n: Any, *, even: bool = False) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise PlacementError(f"the {shape} shape needs an integer number of devices, got {n!r}")
    if n < 2:
        raise PlacementError(f"the {shape} shape needs at least 2 devices, got {n}")
    if n > MAX_DEVICES:  # checked before building: 10^9 devices would exhaust the memory first
        raise PlacementError(f"the {shape} shape takes at most {MAX_DEVICES:,} devices, got {n:,}")
    if even and n % 2:
        raise PlacementError(
            f"the {shape} shape splits the devices into two halves, so it needs an even number of "
            f"devices, got {n}"
        )
    return n


def _per_segment(values, default, n_seg: int, what: str, shape: str, n: int) -> list:
    if values is None:
        return [default] * n_seg
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise PlacementError(f"{what} must be a list with one value per segment, got {values!r}")
    values = list(values)
    if len(values) != n_seg:
        raise PlacementError(
            f"{what} has {len(values)} values but the {shape} shape on {n} devices has {n_seg} "
            f"segments (0..{n_seg - 1}); give one value per segment"
        )
    return values


def _build(
    shape: str,
    n: int,
    seg_devices: Sequence[Sequence[int]],
    fwd_preds: Sequence[Sequence[int]],
    frozen: Collection[int] = (),
    /,
    *,
    order: Sequence[Sequence[int]] | None = None,
    forward: float = 1.0,
    backward: float = 2.0,
    activation: int = 1,
    split_backward: bool = False,
    weight_grad_fraction: float = 0.5,
    forward_only: bool = False,
    forward_times: Sequence[float] | None = None,
    backward_times: Sequence[float] | None = None,
    activation_bytes: Sequence[int] | None = None,
    outputs: Sequence[TensorSpec | None] | None = None,
    input_grads: Sequence[TensorSpec | None] | None = None,
    static_memory: Iterable[int] = (),
) -> Placement:
    """Build a placement from per-segment device sets and the forward DAG between segments.

    The backward mirrors the forward: ``B(s)`` (or ``I(s)``) depends on the backward of every
    segment whose forward depends on ``F(s)``; a segment no forward depends on (the end of a
    chain, e.g. the loss) has its backward depend on its own forward.

    ``order`` groups segments into chains listed one after the other in ``Placement.blocks``
    (forwards in segment order, then backwards in reverse); default: one group of all segments.

    ``frozen`` (positional only, so no shape's ``**kw`` reaches it) lists segments run without
    gradients: their forward keeps no activation (memory 0, their ``activation_bytes`` entry
    unused) and they have no backward; a backward depends only on the backwards that exist, and
    sends no input gradient when every segment feeding it is frozen (nothing upstream needs one).
    """
    n_seg = len(seg_devices)
    fwd = _per_segment(forward_times, forward, n_seg, "forward_times", shape, n)
    bwd = _per_segment(backward_times, backward, n_seg, "backward_times", shape, n)
    act = _per_segment(activation_bytes, activation, n_seg, "activation_bytes", shape, n)
    outs = _per_segment(outputs, None, n_seg, "outputs", shape, n)
    grads = _per_segment(input_grads, None, n_seg, "input_grads", shape, n)
    wf = float(weight_grad_fraction)
    if not 0.0 <= wf <= 1.0:
        raise PlacementError(f"weight_grad_fraction must be between 0 and 1, got {weight_grad_fraction}")
    succ: list[list[int]] = [[] for _ in range(n_seg)]
    for s, preds in enumerate(fwd_preds):
        for p in preds:
            succ[p].append(s)
    groups = [list(g) for g in order] if order is not None else [list(range(n_seg))]
    blocks: list[BlockSpec] = []
    f_idx: dict[int, int] = {}
    chain_idx: dict[int, int] = {}  # segment -> index of its B (or I)

    def add(b: BlockSpec) -> int:
        blocks.append(b)
        return len(blocks) - 1

    no_grad = set(frozen)
    for group in groups:
        for s in sorted(group):
            deps = tuple(f_idx[p] for p in fwd_preds[s])
            mem = 0 if forward_only or s in no_grad else int(act[s])
            f_idx[s] = add(BlockSpec("F", s, tuple(seg_devices[s]), float(fwd[s]), mem, deps, outs[s]))
        if forward_only:
            continue
        for s in sorted(group, reverse=True):
            if s in no_grad:
                continue
            trained = [t for t in succ[s] if t not in no_grad]
            deps = tuple(chain_idx[t] for t in trained) if trained else (f_idx[s],)
            dev = tuple(seg_devices[s])
            grad = grads[s] if any(p not in no_grad for p in fwd_preds[s]) else None
            if split_backward:
                free_i = int(round(int(act[s]) * (1 - wf)))
                chain_idx[s] = add(BlockSpec("I", s, dev, float(bwd[s]) * (1 - wf), -free_i, deps, grad))
                add(BlockSpec("W", s, dev, float(bwd[s]) * wf, -(int(act[s]) - free_i), (chain_idx[s],), None))
            else:
                chain_idx[s] = add(BlockSpec("B", s, dev, float(bwd[s]), -int(act[s]), deps, grad))
    return Placement(n, tuple(blocks), name=shape, static_memory=tuple(static_memory))


def _pipeline_kwargs(kw: dict) -> dict:
    """Translate the shape keyword arguments into :func:`pipeline_placement`'s."""
    kw = dict(kw)
    forward = kw.pop("forward", 1.0)
    backward = kw.pop("backward", 2.0)
    activation = kw.pop("activation", 1)
    ft = kw.pop("forward_times", None)
    bt = kw.pop("backward_times", None)
    ab = kw.pop("activation_bytes", None)
    allowed = {"split_backward", "weight_grad_fraction", "forward_only", "outputs", "input_grads", "static_memory"}
    unknown = set(kw) - allowed
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    out = dict(kw)
    out["forward"] = forward if ft is None else list(ft)
    out["backward"] = backward if bt is None else list(bt)
    out["activation_bytes"] = activation if ab is None else list(ab)
    if out.get("forward_only"):
        # inference keeps no activation for a backward; pipeline_placement would allocate
        # activation_bytes on every F and never free it
        n_act = out["activation_bytes"]
        out["activation_bytes"] = 0 if isinstance(n_act, (int, float)) else [0] * len(n_act)
    return out


# --------------------------------------------------------------------------- shapes
_COMMON_ARGS = """    Keyword Args:
        forward, backward: duration of every forward / full backward block (default 1 and 2
            abstract units; seconds from a cost model).
        activation: memory each forward allocates on each of its devices and its backward frees
            (default 1 unit; bytes from a captured model).
        split_backward: split each ``B`` into ``I`` + ``W`` (``weight_grad_fraction`` of the time,
            default 0.5, goes to ``W``).
        forward_only: inference placement, ``F`` blocks only; they allocate no memory
            (inference keeps no activation for a backward).
        forward_times, backward_times, activation_bytes: per-segment lists (indexed by the segment
            numbering above) overriding ``forward``/``backward``/``activation``.
        outputs, input_grads: per segment, the :class:`~engine.placement.TensorSpec` its forward
            sends on / its backward sends back (``None`` where nothing crosses devices).
        static_memory: resident memory per device (parameters, optimizer states).
"""


def _common_doc(f):
    """Put the keyword arguments every shape shares into ``f``'s docstring."""
    f.__doc__ = f.__doc__.replace("    {common_args}\n", "\n" + _COMMON_ARGS + "\n")
    return f


@_common_doc
def v_shape(n: int, **kw) -> Placement:
    """Tessel's V shape: the plain pipeline (1F1B's placement). Name ``"V"``.

    Segments: ``0..n-1``; segment ``i`` (forward and backward) on device ``i``. Chain:
    ``F0 -> F1 -> ... -> F(n-1) -> B(n-1) -> ... -> B0``. Identical to
    :func:`engine.placement.pipeline_placement` ``(n, activation_bytes=activation, ...)``, so the
    predefined schedules (``engine.baselines``) accept it.

    Source: Tessel (HPCA 2024), Fig. 2 (V); Narayanan et al. SC'21 (1F1B).
    {common_args}
    Raises:
        PlacementError: ``n < 2`` or a per-segment list of the wrong length.
    """
    _check_devices("V", n)
    return pipeline_placement(n, **_pipeline_kwargs(kw))


@_common_doc
def interleaved_shape(n: int, virtual_stages: int = 2, **kw) -> Placement:
    """The interleaved (looped) pipeline: ``pipeline_placement(n, virtual_stages=...)``.

    Segments: ``0..n*v-1``; segment ``s`` on device ``s % n``. Chain: ``F0 -> ... -> F(nv-1) ->
    B(nv-1) -> ... -> B0``. Name ``"interleaved"`` (``"V"`` when ``virtual_stages == 1``).

    Source: Narayanan et al., SC'21, section 2.2.2 (interleaved 1F1B).
    {common_args}
    Raises:
        PlacementError: ``n < 2``, ``virtual_stages < 1``, or a per-segment list of the wrong length.
    """
    _check_devices("interleaved", n)
    return pipeline_placement(n, virtual_stages=virtual_stages, **_pipeline_kwargs(kw))


@_common_doc
def x_shape(n: int, **kw) -> Placement:
    """Tessel's X shape: two V chains in opposite directions (Chimera-like). Name ``"X"``.

    Segments: chain A = ``0..n-1``, segment ``i`` on device ``i``; chain B = ``n..2n-1``, segment
    ``n + i`` on device ``n - 1 - i``. Chains: ``F0 -> ... -> F(n-1) -> B(n-1) -> ... -> B0`` and
    ``Fn -> ... -> F(2n-1) -> B(2n-1) -> ... -> Bn``, with NO dependency between them.

    One placement instance (one "micro-batch" of a schedule) carries TWO micro-batches of data,
    one per chain, as in Chimera's bidirectional pipelines where every device holds stage ``i`` of
    the down pipeline and stage ``n-1-i`` of the up pipeline (two model replicas): a schedule with
    ``m`` micro-batches over this placement processes ``2m`` data micro-batches. Blocks are listed
    chain A first (forwards then backwards), then chain B.

    Source: Tessel (HPCA 2024), Fig. 2 (X); Li & Hoefler, "Chimera: Efficiently Training
    Large-Scale Neural Networks with Bidirectional Pipelines", SC'21.
    {common_args}
    Raises:
        PlacementError: ``n < 2`` or a per-segment list of the wrong length (``2n`` segments).
    """
    _check_devices("X", n)
    devs = [(i,) for i in range(n)] + [(n - 1 - i,) for i in range(n)]
    preds = [[s - 1] if s % n else [] for s in range(2 * n)]
    return _build("X", n, devs, preds, order=[range(n), range(n, 2 * n)], **kw)


@_common_doc
def m_shape(n: int, **kw) -> Placement:
    """Tessel's M shape: one block on all devices, then a V, mirrored in backward. Name ``"M"``.

    Segments: ``0`` on ALL devices (e.g. a tensor-parallel shared embedding), then ``1..n``,
    segment ``i`` on device ``i - 1``. Chain: ``F0(all) -> F1 -> ... -> Fn -> Bn -> ... -> B1 ->
    B0(all)``.

    Source: Tessel (HPCA 2024), Fig. 2 (M).
    {common_args}
    Raises:
        PlacementError: ``n < 2`` or a per-segment list of the wrong length (``n + 1`` segments).
    """
    _check_devices("M", n)
    devs = [tuple(range(n))] + [(i,) for i in range(n)]
    preds: list[list[int]] = [[]] + [[s - 1] for s in range(1, n + 1)]
    return _build("M", n, devs, preds, **kw)


@_common_doc
def m_model_shape(n: int, **kw) -> Placement:
    """The M shape as a language model fills it: the embedding and the LM head on ALL devices (both
    vocab-parallel, e.g. mT5's 250k-token table), a V of transformer blocks between them. Name ``"M"``.

    Segments: ``0`` (embedding) on ALL devices; ``1..n``, segment ``i`` on device ``i - 1``;
    ``n + 1`` (final norm, LM head and loss) on ALL devices. Chain: ``F0(all) -> F1 -> ... -> Fn ->
    F(n+1)(all) -> B(n+1)(all) -> Bn -> ... -> B1 -> B0(all)``. Against the plain V, whose first and
    last stages also carry the embedding and the head (slower, more memory: where 1F1B loses),
    the large layers are split over every device. Built by
    :func:`engine.shape_costs.model_shape_placement` for ``"m"`` when the model has transformer
    blocks between its embedding and its head.

    Source: Tessel (HPCA 2024), Fig. 2 (M) and its model-derived placements (section VI).
    {common_args}
    Raises:
        PlacementError: ``n < 2`` or a per-segment list of the wrong length (``n + 2`` segments).
    """
    _check_devices("M", n)
    every = tuple(range(n))
    devs = [every] + [(i,) for i in range(n)] + [every]
    preds: list[list[int]] = [[]] + [[s - 1] for s in range(1, n + 2)]
    return _build("M", n, devs, preds, **kw)


@_common_doc
def nn_shape(n: int, **kw) -> Placement:
    """Tessel's NN shape: all-device blocks at the start and the middle of a V. Name ``"NN"``.

    Segments (``h = n / 2``): ``0`` on ALL devices; ``1..h``, segment ``i`` on device ``i - 1``;
    ``h + 1`` on ALL devices; ``h + 2..n + 1``, segment ``j`` on device ``j - 2``. Chain:
    ``F0(all) -> F1 -> ... -> Fh -> F(h+1)(all) -> F(h+2) -> ... -> F(n+1)``, then the backward in
    exact reverse order ``B(n+1) -> ... -> B0(all)``.

    Source: Tessel (HPCA 2024), Fig. 2 (NN).
    {common_args}
    Raises:
        PlacementError: ``n < 2``, odd ``n``, or a per-segment list of the wrong length
            (``n + 2`` segments).
    """
    _check_devices("NN", n, even=True)
    h = n // 2
    every = tuple(range(n))
    devs = [every] + [(i - 1,) for i in range(1, h + 1)] + [every] + [(j - 2,) for j in range(h + 2, n + 2)]
    preds: list[list[int]] = [[]] + [[s - 1] for s in range(1, n + 2)]
    return _build("NN", n, devs, preds, **kw)


@_common_doc
def k_shape(n: int, **kw) -> Placement:
    """Tessel's K shape: two V branches on disjoint halves joined by a loss block. Name ``"K"``.

    Segments (``h = n / 2``): branch A = ``0..h-1``, segment ``i`` on device ``i``; branch B =
    ``h..n-1``, segment ``i`` on device ``i``; loss = segment ``n`` on ALL devices. Forward:
    ``F0 -> ... -> F(h-1)`` and ``Fh -> ... -> F(n-1)`` run independently; ``Fn`` depends on
    ``F(h-1)`` and ``F(n-1)``. Backward: ``Bn`` depends on ``Fn``; then each branch runs in
    reverse from ``Bn``: ``Bn -> B(h-1) -> ... -> B0`` and ``Bn -> B(n-1) -> ... -> Bh``.
    (E.g. a two-tower / encoder-pair model whose towers meet at the loss.)

    Source: Tessel (HPCA 2024), Fig. 2 (K).
    {common_args}
    Raises:
        PlacementError: ``n < 2``, odd ``n``, or a per-segment list of the wrong length
            (``n + 1`` segments).
    """
    _check_devices("K", n, even=True)
    h = n // 2
    devs = [(i,) for i in range(n)] + [tuple(range(n))]
    preds = [[s - 1] if s % h else [] for s in range(n)] + [[h - 1, n - 1]]
    return _build("K", n, devs, preds, **kw)


@_common_doc
def mllm_shape(n: int, **kw) -> Placement:
    """The multi-modal LLM shape: all-device blocks at both ends of a V, mirrored. Name ``"MLLM"``.

    Segments: ``0`` on ALL devices (e.g. the vision encoder and the embeddings, spread over every
    device); ``1..n``, segment ``i`` on device ``i - 1`` (the language model's transformer blocks);
    ``n + 1`` on ALL devices (e.g. the final norm, LM head and loss). Chain: ``F0(all) -> F1 -> ...
    -> Fn -> F(n+1)(all) -> B(n+1)(all) -> Bn -> ... -> B1 -> B0(all)``: the backward mirrors the
    forward exactly.

    This is the chain and the device sets of :func:`m_model_shape` (the M shape as a language
    model fills it). It is not reused: the shape is built here under its own name (``"MLLM"``, the
    registry entry ``"mllm"``), so its errors and plans name it; a test checks that the two
    chains are equal. Every segment follows the shared defaults (F=1, B=2, activation 1, as M);
    the reference gives the all-device blocks memory 0 and a 1-unit backward, and the V's
    backward 3 units (give ``activation_bytes`` and ``backward_times`` to reproduce it). With a captured model
    (:func:`engine.shape_costs.model_shape_placement`) segment 0 holds everything before the
    model's last run of transformer blocks (its encoders and embeddings), the blocks are
    balanced over the V and segment ``n + 1`` holds the layers after them.

    Source: the Tessel authors' reference implementation (github.com/zhiqi-0/Tessel,
    ``examples/simulator/cases_tessel.py``, ``Placement.mllm``).
    {common_args}
    Raises:
        PlacementError: ``n < 2`` or a per-segment list of the wrong length (``n + 2`` segments).
    """
    _check_devices("MLLM", n)
    every = tuple(range(n))
    devs = [every] + [(i,) for i in range(n)] + [every]
    preds: list[list[int]] = [[]] + [[s - 1] for s in range(1, n + 2)]
    return _build("MLLM", n, devs, preds, **kw)


@_common_doc
def finetune_shape(n: int, **kw) -> Placement:
    """The fine-tuning shape: a frozen all-device block, then a V. Name ``"finetune"``.

    Segments: ``0`` on ALL devices, FROZEN (e.g. a pretrained encoder or embedding whose
    parameters are not trained): its forward keeps no activation (memory 0; its
    ``activation_bytes`` entry is not used) and it has NO backward block; ``1..n``, segment ``i``
    on device ``i - 1``, trained. Chain: ``F0(all) -> F1 -> ... -> Fn -> Bn -> ... -> B1``; ``B1``
    sends no input gradient (its ``input_grads`` entry is not used: nothing upstream needs it).
    With ``split_backward`` only segments ``1..n`` get ``I`` and ``W`` blocks. The reference's
    backward takes 2 units, this project's default.

    Source: the Tessel authors' reference implementation (github.com/zhiqi-0/Tessel,
    ``examples/simulator/cases_tessel.py``, ``Placement.finetune``).
    {common_args}
    Raises:
        PlacementError: ``n < 2`` or a per-segment list of the wrong length (``n + 1`` segments).
    """
    _check_devices("finetune", n)
    devs = [tuple(range(n))] + [(i,) for i in range(n)]
    preds: list[list[int]] = [[]] + [[s - 1] for s in range(1, n + 1)]
    return _build("finetune", n, devs, preds, (0,), **kw)


@_common_doc
def alphafold_shape(n: int, recycles: int = 2, **kw) -> Placement:
    """AlphaFold-style recycling: the forward passes over the devices ``recycles + 1`` times, only
    the last pass is trained. Name ``"alphafold"``.

    Segments (``r = recycles``): pass ``p = 0..r`` is segments ``p * n .. p * n + n - 1``, segment
    ``p * n + i`` on device ``i``. Passes ``0..r-1`` are recycling iterations run without gradients
    (forward only: memory 0, no backward block; their ``activation_bytes`` entries are not used);
    pass ``r`` keeps its activations and has a backward on devices ``n-1..0``. Chain: ``F0 -> F1 ->
    ... -> F((r+1)n-1) -> B((r+1)n-1) -> ... -> B(rn)`` (each pass starts from the previous pass's
    output, as AlphaFold 2 feeds its outputs back into its next iteration); ``B(rn)`` sends no input
    gradient. ``recycles=0`` is the V chain. The default, 2, is the reference's (three passes, two
    without gradients); the reference's backward takes 1 unit, this project's default 2 (pass
    ``backward=1`` to reproduce it).

    Source: the Tessel authors' reference implementation (github.com/zhiqi-0/Tessel,
    ``examples/simulator/cases_tessel.py``, ``Placement.alphafold``); Jumper et al., "Highly
    accurate protein structure prediction with AlphaFold", Nature 2021 (recycling).

    Args:
        recycles: passes run without gradients before the trained one (an integer, at least 0).
    {common_args}
    Raises:
        PlacementError: ``n < 2``, ``recycles`` not an integer >= 0, more than
            :data:`~engine.placement.MAX_DEVICES` segments, or a per-segment list of the wrong length
            (``(recycles + 1) * n`` segments).
    """
    _check_devices("alphafold", n)
    if isinstance(recycles, bool) or not isinstance(recycles, int) or recycles < 0:
        raise PlacementError(f"recycles must be an integer of at least 0 (passes without gradients before the "
                             f"trained one), got {recycles!r}")
    if (recycles + 1) * n > MAX_DEVICES:  # checked before building: the chain has (recycles + 1) * n segments
        raise PlacementError(f"the alphafold shape with recycles={recycles:,} on {n} devices has "
                             f"{(recycles + 1) * n:,} segments; at most {MAX_DEVICES:,}, so use fewer recycles")
    n_seg = (recycles + 1) * n
    devs = [(s % n,) for s in range(n_seg)]
    preds: list[list[int]] = [[s - 1] if s else [] for s in range(n_seg)]
    return _build("alphafold", n, devs, preds, range(recycles * n), **kw)


@dataclass(frozen=True)
class ShapeSpec:
    """One placement shape of the registry :data:`SHAPES`.

    Attributes:
        name: canonical name (lower case), the key in :data:`SHAPES`.
        build: the constructor ``(n, **kw) -> Placement`` (``n`` devices; its
            ``num_segments`` is the shape's segment count).
        description: one line for listings (``tessel search --help``).
        model_parts: ``n -> `` how many parts a captured sequential model is cut into for
            this shape (:func:`engine.shape_costs.model_shape_placement`); segment ``s`` runs
            part ``s % model_parts(n)`` (X holds two replicas). ``None``: the shape cannot hold
            a sequential model.
        no_model: why not, when ``model_parts`` is ``None`` (the error message).
    """

    name: str
    build: Callable[..., Placement]
    description: str
    model_parts: Callable[[int], int] | None = None
    no_model: str = ""


#: Canonical shape name -> :class:`ShapeSpec`, in listing order.
SHAPES: dict[str, ShapeSpec] = {s.name: s for s in (
    ShapeSpec("v", v_shape, "plain pipeline (1F1B)", lambda n: n),
    ShapeSpec("x", x_shape, "two opposite V chains (Chimera-like)", lambda n: n),
    ShapeSpec("m", m_shape, "all-device block, a V, mirrored", lambda n: n + 1),
    ShapeSpec("nn", nn_shape, "all-device blocks at the start and middle of a V", lambda n: n + 2),
    ShapeSpec("k", k_shape, "two V branches on halves joined by a loss block", None,
              "the K shape needs a model with two independent branches joined by a loss (e.g. "
              "two-tower-tiny); a sequential transformer has none: search K in abstract units (no --model)"),
    ShapeSpec("interleaved", interleaved_shape, "interleaved pipeline (virtual stages)",
              lambda n: 2 * n),
    ShapeSpec("mllm", mllm_shape, "all-device encoder and head around a V, mirrored (multi-modal LLM)",
              lambda n: n + 2),
    ShapeSpec("finetune", finetune_shape, "frozen all-device block (no backward), then a V", None,
              "the finetune shape needs a model whose leading part is frozen (no backward, no optimizer state, "
              "e.g. a pretrained encoder), but a captured model trains every parameter: search finetune in "
              "abstract units (no --model)"),
    ShapeSpec("alphafold", alphafold_shape, "passes without gradients, then a trained V (AlphaFold recycling)",
              None,
              "the alphafold shape needs a model that reruns its layers on its own output without gradients "
              "(AlphaFold's recycling), but a captured model runs each layer once: search alphafold in abstract "
              "units (no --model)"),
)}


def shape_names() -> list[str]:
    """The canonical shape names accepted by :func:`make_shape`."""
    return list(SHAPES)


def find_shape(name: str) -> ShapeSpec | None:
    """The :class:`ShapeSpec` called ``name`` (spelled as :func:`make_shape` accepts), or ``None``."""
    key = _canonical(name)
    return SHAPES[key] if key is not None else None


def _canonical(name: str) -> str | None:
    if not isinstance(name, str):
        return None
    key = re.sub(r"[\s_\-]", "", name.strip().lower())
    if key in SHAPES:
        return key
    if key.endswith("shape") and key[: -len("shape")] in SHAPES:
        return key[: -len("shape")]
    return None


def make_shape(name: str, n: int, **kw) -> Placement:
    """Build the shape called ``name`` on ``n`` devices.

    Names are case-insensitive and may carry a ``shape`` suffix and ``-``/``_``: ``"v"``,
    ``"vshape"``, ``"V-shape"``, ``"x"``, ``"m"``/``"mshape"``, ``"nn"``/``"nnshape"``,
    ``"k"``/``"kshape"``, ``"interleaved"`` (takes ``virtual_stages=``), ``"mllm"``, ``"finetune"``,
    ``"alphafold"`` (takes ``recycles=``).

    Raises:
        UnknownShapeError: unknown name; the message lists the valid ones (a ``TesselError``, and
            a ``ValueError`` as before).
        PlacementError: more than :data:`~engine.placement.MAX_DEVICES` devices.
        PlacementError: invalid ``n`` (``n < 2``; odd ``n`` for NN and K) or bad keyword values.
    """
    key = _canonical(name)
    if key is None:
        raise UnknownShapeError(f"unknown placement shape {name!r}; valid shapes are: {', '.join(SHAPES)}, or the "
                                "path of a placement JSON file")
    return SHAPES[key].build(n, **kw)


# --------------------------------------------------------------------------- custom / JSON
def custom_placement(
    num_devices: int,
    blocks: Sequence[dict],
    *,
    name: str = "custom",
    static_memory: Iterable[int] = (),
) -> Placement:
    """A placement from a list of block dicts (the public API for shapes not built in).

    Each dict: ``kind`` (``"F"``/``"B"``/``"I"``/``"W"``), ``segment`` (int), ``devices`` (list of
    device indices, or one int), optional ``duration`` (default 1.0, caller's time unit),
    ``memory`` (default 0, allocated (+) / freed (-) on each of its devices), ``deps`` (indices
    into ``blocks`` or names like ``"0F"`` = segment 0's forward) and ``output`` (a
    :class:`~engine.placement.TensorSpec` or ``{"shape": [...], "dtype": "float32"}``).

    Example::

        custom_placement(2, [
            {"kind": "F", "segment": 0, "devices": [0, 1], "memory": 1},
            {"kind": "F", "segment": 1, "devices": [1], "deps": ["0F"], "memory": 1},
            {"kind": "B", "segment": 1, "devices": [1], "duration": 2, "deps": ["1F"], "memory": -1},
            {"kind": "B", "segment": 0, "devices": [0, 1], "duration": 2, "deps": [2], "memory": -1},
        ])

    Raises:
        PlacementError: a malformed field (the message names it, e.g. ``blocks[3].devices``), or
            what :class:`~engine.placement.Placement` rejects (cycle, backward without forward...).
    """
    if not is_instance(num_devices, int) or num_devices < 1:
        raise PlacementError(f"num_devices must be a positive integer, got {num_devices!r}")
    specs = parse_blocks(num_devices, blocks)
    static = list(static_memory)
    for j, x in enumerate(static):
        if not is_instance(x, int):
            raise PlacementError(f"static_memory[{j}] must be an integer, got {x!r}")
    return Placement(num_devices, specs, name=str(name), static_memory=tuple(static))
