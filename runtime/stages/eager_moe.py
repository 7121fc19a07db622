"""The model's own (eager) MoE layers inside traced stages, in place of the graphs ``pipeline()``
traced for them (:func:`restore_eager_moe`): they produce their aux loss and routing metrics,
follow their gates' update counters (DTS-Gate temperature), keep the gate buffers in the stage's
``state_dict``, and a worker can swap their experts for an expert-parallel version; a segment
boundary inside an MoE layer is refused."""

from __future__ import annotations

import operator

import torch
from torch import nn

from engine.models.moe.hf_moe import is_hf_moe_block
from engine.models.moe.layer import MoEFeedForward
from runtime.stages.errors import RuntimeNotSupported
from runtime.stages.tracer_split import TracedStage
from runtime.stages.types import StageModule

__all__ = ["restore_eager_moe"]


def restore_eager_moe(model: nn.Module, modules: dict[int, StageModule]) -> list[nn.Module]:
    """Put the model's own (eager) MoE layers back into the traced stages, in place of the graphs
    ``pipeline()`` traced for them: :class:`~engine.models.moe.layer.MoEFeedForward` and Hugging
    Face sparse MoE blocks (:func:`engine.models.moe.hf_moe.is_hf_moe_block`; Mixtral's
    ``MixtralSparseMoeBlock``, called as ``mlp(hidden_states [B, T, H]) -> [B, T, H]``).

    The exported graph of an MoE layer freezes what is Python state of the eager layer: DTS-Gate's
    temperature and dense/sparse phase (they follow the optimizer-update counter), and it drops
    the aux (load-balancing) loss, the routing metrics and the gate's state buffers
    (``num_updates``, ``temperature``, ``sparse``). The stage's parent graph calls the layer as a
    submodule (``call_module mlp(x)``), so the eager layer is swapped in at that path: its
    parameters get the traced copies' values (identical, same names), its buffers come with it
    (so they are in the stage's ``state_dict``), and after every forward it holds
    ``last_aux_loss``/``last_metrics`` for the worker. A worker can then replace it by an
    expert-parallel layer (:class:`runtime.expert_parallel.ExpertParallelMoE`), or an HF block's
    ``experts`` by an expert-parallel version. Only traced stages (those with ``inner``) are
    searched; the module split keeps every layer eager anyway.

    Returns:
        the eager layers now inside the stages.

    Raises:
        RuntimeNotSupported: a segment boundary falls inside an MoE layer, or the traced parent
            does not call the layer as one submodule with one tensor argument.
    """
    restored: list[nn.Module] = []
    for name, layer in model.named_modules():
        if not (isinstance(layer, MoEFeedForward) or is_hf_moe_block(layer)):
            continue
        parent_name, _, attr = name.rpartition(".")
        callers = []
        for i, sm in modules.items():
            if not isinstance(sm, TracedStage):
                continue
            try:
                parent = sm.get_submodule(parent_name) if parent_name else sm.inner
            except AttributeError:
                continue
            graph = getattr(parent, "graph", None)
            calls = [n for n in graph.nodes if n.op == "call_module" and n.target == attr] if graph is not None else []
            if calls:
                callers.append((i, sm, parent, calls))
        if not callers:
            continue   # an unused layer: nothing to restore
        if len(callers) > 1 or len(callers[0][3]) != 1:
            raise RuntimeNotSupported(
                f"the MoE layer {name} is called from segments {[c[0] for c in callers]}; put a whole "
                "MoE layer into one segment")
        i, sm, parent, (call,) = callers[0]
        if any(u.op == "call_function" and u.target is operator.getitem for u in call.users):
            raise RuntimeNotSupported(f"segment {i} uses the MoE layer {name}'s result as a tuple; the runtime "
                                      "needs a layer returning one tensor")
        if len(call.args) != 1 or call.kwargs:
            raise RuntimeNotSupported(f"segment {i} calls the MoE layer {name} with {len(call.args)} arguments "
                                      f"and kwargs {sorted(call.kwargs)}; the runtime needs layer(x)")
        traced = getattr(parent, attr)
        mine = dict(layer.named_parameters())
        with torch.no_grad():
            for pname, p in traced.named_parameters():
                if pname not in mine or mine[pname].shape != p.shape:
                    raise RuntimeNotSupported(f"the traced MoE layer {name} has a parameter {pname} "
                                              f"{tuple(p.shape)} that the model's layer lacks")
                mine[pname].copy_(p)
        setattr(parent, attr, layer)
        if not parent_name:           # a top-level layer: the StageModule registers inner's children too
            sm.add_module(attr, layer)
        restored.append(layer)
    return restored
