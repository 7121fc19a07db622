"""Parameters of split stages: unused leftovers pruned (:func:`prune_leftovers`), tied copies
found and shared (:func:`tied_copies`), model replicas copied (:func:`replicate_chains`).

- **Tied weights.** GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight``; after the split
  the first and last stage hold separate copies. :attr:`PipelineStages.tied
  <runtime.stages.types.PipelineStages.tied>` lists them so the worker can all-reduce (sum) their
  gradients between the ranks that hold them before the optimizer step, Megatron-LM's embedding
  group (Narayanan et al., SC'21, section on tied embeddings / "embedding all-reduce"). The copies
  start equal and get the same summed gradient, so with the same optimizer they stay equal.
- **Leftover parameters.** ``pipeline()`` can leave an unused copy of a tied parameter in a stage
  that does not call its module (stage 0 keeps an ``lm_head`` it never runs). Parameters that get
  no gradient AND lie outside the segment's layers are removed, so they are neither optimised nor
  checkpointed.
- **Model replicas** (Tessel's X shape, Chimera): the second chain's stages are copies of the
  first's, every parameter tied across its copies.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from torch import nn

from engine.errors import TesselError
from runtime.stages.errors import RuntimeNotSupported
from runtime.stages.tracer_split import TracedStage
from runtime.stages.types import StageModule, TensorMeta

__all__ = ["prune_leftovers", "replicate_chains", "tie_sets", "tied_copies"]

#: tied-parameter groups: lists of ``(segment, parameter name)``
TiedGroups = list[list[tuple[int, str]]]


def tie_sets(model: nn.Module) -> list[set[str]]:
    """The names of each parameter ``model`` holds under several names (2+ names each)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [set(v) for v in names.values() if len(v) > 1]


def prune_leftovers(modules: dict[int, StageModule], segment_layers: Sequence[Sequence[Any]]) -> list[tuple[int, str]]:
    """Remove every parameter that got no gradient in the probe and lies outside its segment's
    layers (``segment_layers[i]``, the plan's ``segments[i]["layers"]``). Returns the removed
    ``(segment, parameter name)``."""
    removed: list[tuple[int, str]] = []
    for i, m in modules.items():
        layers = [str(x) for x in segment_layers[i]]
        for name, p in list(m.named_parameters()):
            inside = any(name == lay or name.startswith(lay + ".") for lay in layers)
            if p.grad is None and not inside:
                owner_path, _, leaf = name.rpartition(".")
                owner = m.get_submodule(owner_path) if owner_path else m
                delattr(owner, leaf)
                if not owner_path and isinstance(m, TracedStage):
                    m.inner._parameters.pop(leaf, None)
                removed.append((i, name))
    return removed


def _share_tied_copies(m: StageModule, sets: list[set[str]]) -> int:
    """Make the copies of one tied parameter inside one stage the same ``Parameter`` again
    (``pipeline()`` can give T5's ``encoder.embed_tokens.weight`` and ``decoder.embed_tokens.weight``,
    one tensor in the model, separate copies in stage 0), so their gradients accumulate in one
    tensor as in the unsplit model. Returns how many names were re-pointed."""
    n = 0
    for names in sets:
        members = [(name, p) for name, p in m.named_parameters(remove_duplicate=False) if name in names]
        if len({id(p) for _, p in members}) < 2:
            continue
        keep = members[0][1]
        for name, p in members[1:]:
            if p is keep:
                continue
            if not torch.equal(p, keep):
                raise TesselError(f"tied parameter copies {members[0][0]} and {name} differ after the split")
            owner_path, _, leaf = name.rpartition(".")
            owner = m.get_submodule(owner_path) if owner_path else m
            owner._parameters[leaf] = keep
            if not owner_path and isinstance(m, TracedStage):
                m.inner._parameters[leaf] = keep
            n += 1
    return n


def tied_copies(modules: dict[int, StageModule], sets: list[set[str]]) -> TiedGroups:
    """Share the copies of a tied parameter within each stage, then return the groups of copies
    across stages (``[[(segment, name), ...], ...]``, 2+ members each, sorted). Call it after
    :func:`prune_leftovers` (unused leftover copies are gone by then).

    Raises:
        TesselError: two copies of one tied parameter differ.
    """
    for m in modules.values():
        _share_tied_copies(m, sets)
    tied: TiedGroups = []
    for names in sets:
        members = [(i, n) for i, m in modules.items() for n, _ in m.named_parameters() if n in names]
        if len(members) > 1:
            ref = dict(modules[members[0][0]].named_parameters())[members[0][1]]
            for i, n in members[1:]:
                if not torch.equal(dict(modules[i].named_parameters())[n], ref):
                    raise TesselError(f"tied parameter copies {members[0]} and {(i, n)} differ after the split")
            tied.append(sorted(members))
    return tied


def replicate_chains(modules: dict[int, StageModule], boundaries: list[list[TensorMeta]], tied: TiedGroups,
                     chains: list[list[int]]) -> tuple[dict[int, StageModule], list[list[TensorMeta]], TiedGroups]:
    """Copy the first chain's stages into every other chain (model replicas, the X shape): segment
    ``k`` of chain ``c`` is ``c * L + k``, a deep copy of segment ``k`` (same weights). Boundaries are
    repeated per chain (a chain's end has no outgoing boundary: ``[]``). Every parameter becomes tied
    across its copies (their gradients are summed at the optimizer step, so the replicas stay
    equal: Chimera's per-stage gradient all-reduce), tied groups of the model (GPT's ``wte`` /
    ``lm_head``) across all their copies.

    Raises:
        RuntimeNotSupported: a stage cannot be deep-copied (traced graphs keep fake tensors).
    """
    L = len(chains[0])
    out = dict(modules)
    for c in range(1, len(chains)):
        for k in range(L):
            try:
                out[c * L + k] = copy.deepcopy(modules[k])
            except Exception as e:   # traced graphs keep fake tensors in their metadata
                raise RuntimeNotSupported(
                    f"the placement runs {len(chains)} model replicas (the X shape), made by copying the first "
                    f"replica's stages, and a {type(modules[k]).__name__} stage cannot be copied ({type(e).__name__}); "
                    "plan it with the layer split (Llama-family and GPT-2 models, tessel-gpt: `tessel search --model` "
                    "records it) or search another shape") from None
    bounds = [list(boundaries[k]) if k < L - 1 else [] for _c in range(len(chains)) for k in range(L)][:-1]
    grouped = {m for g in tied for m in g}
    groups = [sorted((s + c * L, n) for c in range(len(chains)) for s, n in g) for g in tied]
    for k in range(L):
        for n, _ in modules[k].named_parameters():
            if (k, n) not in grouped:
                groups.append([(k + c * L, n) for c in range(len(chains))])
    return out, bounds, groups
