"""Activation recomputation of a plan applied to its stage modules (Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", MLSys 2023, sections 4 and 5;
:mod:`engine.recompute` names the granularities).

- ``full``: each transformer block the plan's segments list (a child of an ``nn.ModuleList``:
  ``transformer.h.3``, ``model.layers.0``, a tower's ``text.h.1``) runs under non-reentrant
  ``torch.utils.checkpoint.checkpoint``: the forward keeps only the block's input, the backward
  runs the block's forward again (torchtitan's ``activation_checkpoint.mode = "full"``, which wraps
  each block with ``checkpoint_wrapper``; we swap the block's class for a subclass whose ``forward``
  checkpoints instead, so parameter names stay the model's: tensor parallelism's plans, tied
  weights and checkpoints address them by name).
- ``selective``: the same blocks under ``checkpoint(..., context_fn=create_selective_checkpoint_contexts(policy))``
  (torch's selective activation checkpointing): the attention core, Q·Kᵀ (``bmm``/``baddbmm``),
  softmax, its dropout, ·V, or a fused SDPA kernel, is recomputed, everything else saved
  (:func:`selective_policy`).

Recomputed forwards are bit-identical to the original on the CPU (same kernels, same inputs; the
RNG state is restored, ``preserve_rng_state``), so training is unchanged; the zero-bubble split
backward works too: each of ``I`` and ``W`` is its own autograd pass and non-reentrant checkpoint
recomputes a block in every pass that needs its tensors. Selective checkpointing does not:
torch's ``_CachedTorchDispatchMode`` hands out each saved tensor once ("only allowed to backward
once on any region computed under selective activation checkpoint"), so :func:`recompute_refusal`
refuses ``selective`` with a split backward.

Where it applies: the eager stages of the ``layers`` split (:mod:`runtime.stages.layer_split`);
the tracer split's stages are exported graphs in which blocks are no longer modules that can be
called, and the module split's children are not known to be blocks, so
:func:`recompute_refusal` refuses both in one sentence before anything starts.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from engine.recompute import check_recompute, plan_granularities

__all__ = ["apply_recompute", "block_names", "recompute_refusal", "selective_policy"]

_aten = torch.ops.aten
#: the ops of the attention core that ``selective`` recomputes (eager attention decomposes to bmm,
#: softmax and dropout; SDPA dispatches to one of the fused kernels)
ATTENTION_CORE_OPS = frozenset(op for op in (
    _aten.bmm.default, _aten.baddbmm.default, _aten._softmax.default, _aten._safe_softmax.default
    if hasattr(_aten, "_safe_softmax") else None,
    _aten.native_dropout.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
) if op is not None)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """``create_selective_checkpoint_contexts``' policy of ``selective``: recompute the attention
    core (:data:`ATTENTION_CORE_OPS`), save every other op's output."""
    return CheckpointPolicy.PREFER_RECOMPUTE if op in ATTENTION_CORE_OPS else CheckpointPolicy.MUST_SAVE


def _context_fn() -> Any:
    return create_selective_checkpoint_contexts(selective_policy)


_CLASSES: dict[tuple[type, str], type] = {}


def _recompute_class(cls: type, mode: str) -> type:
    """A subclass of ``cls`` whose ``forward`` is checkpointed with ``mode``; one per (class, mode)."""
    key = (cls, mode)
    if key not in _CLASSES:
        extra = {"context_fn": _context_fn} if mode == "selective" else {}

        def forward(self, *args, **kwargs):
            if not torch.is_grad_enabled():   # evaluation: nothing to save, nothing to recompute
                return super(new, self).forward(*args, **kwargs)
            fn = functools.partial(super(new, self).forward)
            return checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)

        new = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__, "recompute": mode})
        _CLASSES[key] = new
    return _CLASSES[key]


def block_names(module: nn.Module, layers: Iterable[str]) -> list[str]:
    """The names among ``layers`` (a plan segment's ``layers``) that are transformer blocks of
    ``module``: submodules whose parent is an ``nn.ModuleList`` (``transformer.h.0``,
    ``model.layers.3``); names ``module`` does not hold are skipped."""
    out = []
    for name in layers:
        parent, _, _child = str(name).rpartition(".")
        if not parent:
            continue
        try:
            holder = module.get_submodule(parent)
            module.get_submodule(str(name))
        except AttributeError:
            continue
        if isinstance(holder, nn.ModuleList):
            out.append(str(name))
    return out


def apply_recompute(module: nn.Module, layers: Iterable[str], mode: str) -> list[str]:
    """Checkpoint each block of ``module`` named in ``layers`` (:func:`block_names`) with ``mode``
    (``"none"``: nothing; ``"full"``; ``"selective"``; see the module docstring). The blocks keep
    their parameters and names. Returns the names of the blocks wrapped.

    Raises:
        engine.errors.TransformError: an unknown ``mode``.
    """
    check_recompute(mode)
    if mode == "none":
        return []
    names = block_names(module, layers)
    for name in names:
        block = module.get_submodule(name)
        if getattr(type(block), "recompute", None) is None:
            block.__class__ = _recompute_class(type(block), mode)
    return names


def recompute_refusal(plan: Any) -> str | None:
    """One sentence saying why the runtime cannot recompute ``plan``'s activations, or ``None``:
    recomputation needs the layer split (eager decoder stages), and ``selective`` a schedule without
    the split backward (torch's selective checkpointing consumes what it saved in the first
    backward pass through a region, and zero-bubble schedules run two, ``I`` then ``W``)."""
    modes = set(plan_granularities(plan))   # every segment's: a per-stage override included
    if "selective" in modes and plan.schedule.placement.split_backward:
        return ("selective recomputation runs one backward pass through each block (torch's selective "
                "activation checkpointing), but this zero-bubble schedule splits the backward into I and W "
                "passes; use --recompute full with it, or a schedule without the split backward")
    if modes <= {"none"} or plan.model.split == "layers":
        return None
    mode = "full" if "full" in modes else "selective"
    return (f"activation recomputation {mode!r} runs on eager transformer blocks (the 'layers' split of "
            f"Llama-family and GPT-2 models and tessel-gpt), but {plan.model.name!r} is planned with the "
            f"{plan.model.split or 'default'!r} split, whose stages are exported graphs; plan with "
            "--recompute none, or a model and split that keep its blocks eager")
