"""Boundary metadata of freshly split stages, found by running one real micro-batch forward and
backward through the placement's DAG (:func:`probe_boundaries`).

A chain's segment ``i`` takes segment ``i - 1``'s outputs; Tessel's K joins two branches in its
loss block, which takes both branches' ends. Each boundary tensor's :class:`TensorMeta` says its
shape, dtype and whether a gradient flows back across it; receive buffers are allocated from them
once (static shapes: the "pre-allocated receive buffers" insight of Xue et al., EuroSys 2019;
docs/ARCHITECTURE.md, Sources). The probe leaves parameter gradients behind: the caller reads
them (unused leftover parameters get none) and then clears them.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from runtime.stages.errors import RuntimeNotSupported
from runtime.stages.types import StageModule, TensorMeta

__all__ = ["probe_boundaries"]


def probe_boundaries(modules: Mapping[int, StageModule], example: Sequence[Any], preds: Mapping[int, list[int]],
                     given: Mapping[int, list[int]], name: str
                     ) -> tuple[list[list[TensorMeta]], list[TensorMeta], TensorMeta]:
    """Run ``example`` (the model's inputs for one micro-batch) forward through segments
    ``0 .. S-1`` and backward from the last one's logits.

    Args:
        modules: segment -> stage module (``S`` of them, one model replica).
        example: the model's example inputs (e.g. ``input_ids [micro_batch, seq]``).
        preds: segment -> the segments whose outputs it takes, in order (``[]``: it takes model inputs).
        given: segment -> indices of the model inputs it takes (the plan segment's ``inputs``;
            absent: all of them).
        name: the model's name, for messages.

    Returns:
        ``(boundaries, inputs, output)``: ``boundaries[s]`` the metas of segment ``s``'s outputs
        (``s`` in ``0 .. S-2``), ``inputs`` those of every model input, ``output`` that of the logits.

    Raises:
        RuntimeNotSupported: the last stage does not return exactly one tensor, or a segment
            outputs something other than tensors.
    """
    S = len(modules)
    records: dict[int, tuple[tuple, tuple]] = {}
    for i in range(S):
        if preds[i]:
            vals: tuple = tuple(v for p in preds[i] for v in records[p][1])
        else:
            vals = tuple(example[k] for k in given[i]) if i in given else tuple(example)
        # a producer's output carries a gradient only where it does in training: computed from
        # parameters (a rotary table or mask passed through a stage does not, so no stage may
        # expect a gradient for it: interleaved Llama stages forward cos/sin untouched)
        ins = tuple(v.detach().requires_grad_(v.is_floating_point() and (not preds[i] or v.requires_grad))
                    if isinstance(v, torch.Tensor) else v for v in vals)
        records[i] = (ins, modules[i](*ins))
    vals = records[S - 1][1]
    logits = vals[0] if len(vals) == 1 else None
    if not isinstance(logits, torch.Tensor):
        raise RuntimeNotSupported(
            f"the last stage of {name!r} returns {len(vals)} value(s) "
            f"({', '.join(type(v).__name__ for v in vals)}); the runtime needs exactly one tensor (the logits)")
    torch.autograd.backward(logits.float().square().mean())
    # each producer's outputs against the inputs of its consumer they became (consumers come later)
    fed: dict[int, list[tuple[Any, Any]]] = {}
    for c in range(S):
        at = 0
        for p in preds[c]:
            outs = records[p][1]
            fed[p] = list(zip(outs, records[c][0][at:at + len(outs)]))
            at += len(outs)
    for i in range(S - 1, -1, -1):
        pairs = [(o, x.grad) for o, x in fed.get(i, [])
                 if isinstance(o, torch.Tensor) and o.requires_grad and x.grad is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    boundaries: list[list[TensorMeta]] = []
    for i in range(S - 1):
        metas = []
        for o, x in fed.get(i, []):
            if not isinstance(o, torch.Tensor):
                raise RuntimeNotSupported(f"segment {i} outputs a {type(o).__name__}; only tensors can be sent")
            metas.append(TensorMeta(tuple(o.shape), o.dtype,
                                    bool(o.requires_grad and x.grad is not None)))
        boundaries.append(metas)
    inputs = [TensorMeta(tuple(v.shape), v.dtype, False) for v in example]
    output = TensorMeta(tuple(logits.shape), logits.dtype, True)
    return boundaries, inputs, output
