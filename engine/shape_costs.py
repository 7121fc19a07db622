"""Tessel placement shapes with a captured model's real costs.

A shape fixes how many segments one micro-batch has and which run on all devices; this module
cuts the model's layers into that many balanced parts (:func:`engine.transform.balanced_partition`)
and fills the shape's durations, activation memory, boundary tensors and static memory from the
cost model. A segment that runs on all ``n`` devices is tensor-parallel across them: its work
and activations are divided by ``n`` and it pays an all-reduce of its output.

Segment-to-part mapping (:attr:`engine.shapes.ShapeSpec.model_parts`): V, M, NN and interleaved
number their segments in model order (segment ``s`` is part ``s``); X holds two replicas of the
model (segment ``s`` is part ``s mod n``). M follows the model where it can: a model of leading
layers (the embedding), transformer blocks and trailing layers (final norm, LM head) gets
:func:`engine.shapes.m_model_shape`, the embedding and the head each on all devices (tensor-
parallel, vocab-parallel) and the blocks balanced over a V between them (``n + 2`` segments).
MLLM (:func:`engine.shapes.mllm_shape`, the same chain) cuts the model the same way around its
LAST run of transformer blocks: everything before it (a multi-modal model's encoders and
projector, the embeddings) in segment 0 on all devices, the blocks a V, the rest (final norm, LM
head) in segment ``n + 1`` on all devices. K needs a model with two independent branches, which
a sequential transformer is not; finetune needs a frozen leading part and AlphaFold a recycling
model, which a captured model has neither of (their ``model_parts`` are ``None``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.errors import TesselError
from engine.placement import Placement, TensorSpec, recompute_in_split_backward
from engine.recompute import check_recompute, segment_recompute
from engine.shapes import SHAPES, find_shape, m_model_shape
from engine.transform import (
    balanced_partition,
    check_optimizer,
    gradient_bytes,
    is_block_layer,
    layer_costs,
    resident_state_bytes,
    tied_copy_bytes,
    tied_parameter_groups,
)


def model_shape_placement(graph, cost, shape: str, n: int, *, split_backward: bool = False,
                          forward_only: bool = False, optimizer: str = "adam",
                          loss_parallel: bool = False, tied_module: Any = None,
                          recompute: str = "none", precision: str = "32-true",
                          tp_plan: dict[str, str] | None = None) -> tuple[Placement, list[dict]]:
    """The ``shape`` placement on ``n`` devices with the captured model's costs.

    Args:
        graph: the :class:`~engine.graph.OpGraph` of one micro-batch.
        cost: the :class:`~engine.cost.CostModel`.
        shape: ``v``, ``x``, ``m``, ``nn``, ``interleaved``, ``mllm``, or ``k`` (a two-branch model).
        n: devices.
        optimizer: ``adam`` or ``adama``: static memory is weights, master weights and Adam's
            m and v either way (:func:`engine.transform.resident_state_bytes`; ``32-true``: 3x the
            parameter bytes); the gradient buffer / transient per segment follow
            :func:`engine.transform.gradient_bytes` (divided among the devices of an all-device
            segment, like its parameters).
        precision: the precision policy (:mod:`engine.precision`) whose bytes per parameter the
            static memory and gradient buffers count; the graph is captured in its compute dtype.
        loss_parallel: the task's loss takes vocab-sharded logits, so an all-device LM head pays
            no all-gather of its logits (:func:`engine.transform.layer_costs`).
        tied_module: the captured ``nn.Module``, to count tied weights as the runtime holds them:
            every part holding a tied parameter (GPT-2's ``wte``/``lm_head``) after the first keeps
            its own copy, added to its ``param_bytes`` (``max_param_bytes`` raised to it) and
            recorded as ``tied_copy_bytes``
            (:func:`engine.transform.tied_parameter_groups`, as :func:`engine.plan.make.make_plan`
            counts them with ``add_tied_copies``), so static memory and gradient buffers include
            it. ``None``: parameters are counted once, at first use.
        tp_plan: a user's tensor-parallel plan for the blocks (:mod:`engine.tp_plan`) by which the
            all-device parts' ops are costed (:func:`engine.transform.layer_costs`); ``None``: the model's own.
        recompute: activation recomputation (:data:`engine.recompute.RECOMPUTE`): each part keeps
            what the granularity keeps (``activation_bytes``), its backward includes the recomputed
            forward (``recompute_time``; in ``I`` with ``split_backward``), and each device's static
            memory holds its largest recomputation working set (``recompute_transient_bytes``), as
            :func:`engine.transform.split_segments` and :func:`engine.plan.make.placement_from_segments`
            count them for ``make_plan``.

    An all-device segment with parameters is tensor-parallel over its ``n`` devices and costs what
    :func:`engine.transform.layer_costs` gives at ``tp = n`` (per-op sharding, Megatron's
    all-reduces; backward = ``backward_factor`` x compute + the same communication), as a
    ``tp = n`` stage of :func:`engine.plan.make.make_plan` does.

    Returns:
        ``(placement, parts)``: the placement (seconds, bytes) and per model part its ``layers``,
        ``flops`` (forward FLOPs of one micro-batch, the whole part), ``forward_time``,
        ``backward_time``, ``activation_bytes``, ``param_bytes``, ``max_param_bytes`` (and
        ``recompute_time``, ``recompute_transient_bytes`` when not 0).

    Raises:
        TesselError: the K shape on a model that is not two branches joined by a head, too few
            layers for the shape, an unknown optimizer or recomputation granularity.
    """
    check_optimizer(optimizer)
    check_recompute(recompute)
    spec = find_shape(shape)
    if spec is None:
        usable = [s.name for s in SHAPES.values() if s.model_parts is not None or s.name == "k"]
        raise TesselError(f"unknown shape {shape!r} for a model; use one of {', '.join(usable)}")
    layers = layer_costs(graph, cost, 1)
    times = [lc.forward_time for lc in layers]
    build = spec.build
    names = [lc.name for lc in layers]
    around = _around_blocks(names) if spec.name == "m" else _around_last_run(names) if spec.name == "mllm" else None
    if spec.name == "k":   # a two-tower model: each tower over half of the devices, the join on all
        ranges = _k_ranges([lc.name for lc in layers], times, n)
        k = n + 1
    elif around is not None and around[1] - around[0] >= n:
        # the model's M (or MLLM): embedding (encoders) and head each on all devices, the blocks between them a V
        lo, hi = around
        ranges = [(0, lo)] + [(lo + i, lo + j) for i, j in balanced_partition(times[lo:hi], n)] + [(hi, len(layers))]
        k, build = n + 2, (m_model_shape if spec.name == "m" else build)
    elif spec.model_parts is None:
        raise TesselError(spec.no_model)
    else:
        k = spec.model_parts(n)
        ranges = balanced_partition(times, k)
    parts: list[dict[str, Any]] = []
    for i, j in ranges:
        chunk = layers[i:j]
        parts.append({
            "layers": [lc.name for lc in chunk],
            "flops": sum(lc.flops for lc in chunk),
            "forward_time": sum(lc.forward_time for lc in chunk),
            **_recompute_fields(chunk, recompute),
            "param_bytes": sum(lc.param_bytes for lc in chunk),
            "max_param_bytes": max((lc.max_param_bytes for lc in chunk), default=0),
            "output": chunk[-1].output,
            "grad": chunk[-1].grad,
        })
    if tied_module is not None:   # as add_tied_copies counts them for make_plan's segments
        extra, largest = tied_copy_bytes(tied_parameter_groups(tied_module, [p["layers"] for p in parts]))
        for seg, nbytes in extra.items():
            parts[seg].update(param_bytes=parts[seg]["param_bytes"] + nbytes, tied_copy_bytes=nbytes,
                              max_param_bytes=max(parts[seg]["max_param_bytes"], largest[seg]))
    probe = build(n)
    n_seg = probe.num_segments

    def part_of(s: int) -> int:
        return s % k  # X holds two replicas of the model; the other shapes have one segment per part
    all_dev = {b.segment for b in probe.blocks if len(b.devices) == n and n > 1}
    # an all-device part with parameters is tensor-parallel over the n devices (per-rank costs);
    # one without parameters (K's loss head) runs replicated: full time, no collective
    tp_parts = {part_of(s) for s in all_dev if parts[part_of(s)]["param_bytes"]}
    tp_layers = layer_costs(graph, cost, n, loss_parallel=loss_parallel, tp_plan=tp_plan) if tp_parts else []
    for q in tp_parts:
        chunk = tp_layers[ranges[q][0]:ranges[q][1]]
        comm = sum(lc.tp_comm_time for lc in chunk)
        parts[q].update(forward_time=sum(lc.forward_time for lc in chunk), tp_comm_time=comm,
                        **_recompute_fields(chunk, recompute))
    fwd, bwd, act, outs, grads = [], [], [], [], []
    static = [0] * n
    working = [0] * n
    grad_buf, grad_tr = [], []
    for s in range(n_seg):
        p = parts[part_of(s)]
        f, a = p["forward_time"], p["activation_bytes"]
        out: TensorSpec | None = p["output"]
        comm = p.get("tp_comm_time", 0.0)
        fwd.append(f)
        bwd.append(cost.backward_factor * (f - comm) + comm + p["recompute_time"])
        act.append(a)
        outs.append(out)
        prev = part_of(s) - 1
        grads.append(parts[prev]["grad"] if prev >= 0 else None)
        devs = probe.spec("F", s).devices
        held = p["param_bytes"] if forward_only else resident_state_bytes(p["param_bytes"], precision)
        for d in devs:
            static[d] += held // len(devs)
            working[d] = max(working[d], 0 if forward_only else p["recompute_transient_bytes"])
        buf, tr = gradient_bytes(optimizer, p["param_bytes"], p["max_param_bytes"], precision)
        grad_buf.append(buf // len(devs))
        grad_tr.append(tr // len(devs))
    static = [x + w for x, w in zip(static, working)]
    pl = build(n, forward_times=fwd, backward_times=bwd, activation_bytes=act, outputs=outs,
                    input_grads=grads, split_backward=split_backward, forward_only=forward_only, static_memory=static)
    if not forward_only:
        pl = replace(pl, grad_memory=tuple(grad_buf), grad_transient=tuple(grad_tr))
        pl = recompute_in_split_backward(pl, [parts[part_of(s)]["recompute_time"] for s in range(n_seg)])
    for p in parts:
        comm = p.setdefault("tp_comm_time", 0.0)
        p["backward_time"] = cost.backward_factor * (p["forward_time"] - comm) + comm + p["recompute_time"]
        for key in ("recompute_time", "recompute_transient_bytes"):
            if not p[key]:
                del p[key]
        p["output"] = p["output"].to_dict() if p["output"] else None
        p["grad"] = p["grad"].to_dict() if p["grad"] else None
    return pl, parts


def _recompute_fields(chunk: list, recompute: str) -> dict[str, Any]:
    """A part's ``activation_bytes``, ``recompute_time`` and ``recompute_transient_bytes`` under
    ``recompute`` (:func:`engine.recompute.segment_recompute` of its layers' costs)."""
    rc = segment_recompute([lc.activation() for lc in chunk], recompute)
    return {"activation_bytes": rc.kept_bytes, "recompute_time": rc.recompute_time,
            "recompute_transient_bytes": rc.working_set_bytes}


def _around_blocks(names: list[str]) -> tuple[int, int] | None:
    """``(first block, one past the last block)`` of a model's layer list when it is leading layers
    (the embedding), a run of transformer blocks, then trailing layers (final norm, LM head), each
    part non-empty; ``None`` otherwise."""
    idx = [i for i, name in enumerate(names) if is_block_layer(name)]
    if not idx or idx != list(range(idx[0], idx[-1] + 1)) or idx[0] == 0 or idx[-1] == len(names) - 1:
        return None
    return idx[0], idx[-1] + 1


def _around_last_run(names: list[str]) -> tuple[int, int] | None:
    """``(first block, one past the last block)`` of a model's LAST run of transformer blocks (blocks
    of one module list, e.g. the language model of a multi-modal model, whose encoders come first)
    when layers precede and follow it; ``None`` otherwise. Equals :func:`_around_blocks` on a model
    with one run of blocks."""
    idx = [i for i, name in enumerate(names) if is_block_layer(name)]
    if not idx:
        return None
    hi = idx[-1] + 1
    lo = hi - 1
    parent = names[lo].rsplit(".", 1)[0]
    while lo > 0 and is_block_layer(names[lo - 1]) and names[lo - 1].rsplit(".", 1)[0] == parent:
        lo -= 1
    if lo == 0 or hi == len(names):
        return None
    return lo, hi


def _two_branches(names: list[str]) -> tuple[tuple[int, int], tuple[int, int], int] | None:
    """``((a_lo, a_hi), (b_lo, b_hi), join_lo)`` when a model's layers are two branches (runs of
    layers under two different top-level modules, e.g. ``text.*`` then ``code.*``) followed by
    the layers joining them (e.g. ``head``); ``None`` otherwise."""
    groups: list[tuple[str, int, int]] = []
    for i, name in enumerate(names):
        top = name.split(".", 1)[0]
        if groups and groups[-1][0] == top:
            groups[-1] = (top, groups[-1][1], i + 1)
        else:
            groups.append((top, i, i + 1))
    if len(groups) < 3 or len({g[0] for g in groups}) != len(groups):
        return None
    (_, a_lo, a_hi), (_, b_lo, b_hi) = groups[0], groups[1]
    return (a_lo, a_hi), (b_lo, b_hi), groups[2][1]


def _k_ranges(names: list[str], times: list[float], n: int) -> list[tuple[int, int]]:
    """Tessel's K shape as a two-tower model fills it: each tower balanced over half of the
    devices (``engine.shapes.k_shape``: segments ``0..h-1`` and ``h..n-1``), the layers joining
    them (the contrastive loss head) in segment ``n``, on all devices. Raises :class:`TesselError`
    for a model that is not two branches and a join, or branches with fewer layers than ``n / 2``."""
    split = _two_branches(names)
    h = n // 2
    if split is None:
        raise TesselError(SHAPES["k"].no_model)
    (a_lo, a_hi), (b_lo, b_hi), join = split
    if min(a_hi - a_lo, b_hi - b_lo) < h:
        raise TesselError(f"the K shape on {n} devices puts each branch on {h} devices, but the model's branches have "
                          f"{a_hi - a_lo} and {b_hi - b_lo} layers; use fewer devices")
    return ([(a_lo + i, a_lo + j) for i, j in balanced_partition(times[a_lo:a_hi], h)]
            + [(b_lo + i, b_lo + j) for i, j in balanced_partition(times[b_lo:b_hi], h)]
            + [(join, len(names))])
