"""The module split: pipeline stages of an ``nn.Sequential`` as eager slices of its children.

torchtitan's manual split (``torchtitan/distributed/pipeline.py``, ``pipeline_module_split``)
deep-copies the model and keeps, in each stage, only that stage's layers. For an
``nn.Sequential`` the forward is the composition of its children in order, so stage ``i`` is a
module holding the children of segment ``i`` under their *original* names (``"0"``, ``"7"``:
``state_dict`` keys ``"0.weight"``, ``"7.bias"`` equal the unsplit model's) that runs them in
order. Nothing is traced: dropout, batch norm and any Python in the children behave exactly as in
the unsplit model.

Which children form segment ``i``: the planner's layers of an ``nn.Sequential`` are its direct
children (:mod:`engine.graph.layering`: the outermost element of a container), so
``plan.segments[i]["layers"]`` lists child names; a child the plan does not list (it computes
nothing the capture saw, e.g. ``nn.Identity``) joins the segment of the child before it (the
first segment for leading ones).

Source: torchtitan ``torchtitan/distributed/pipeline.py`` (``pipeline_module_split``).
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn

from runtime.stages.errors import StageSplitError
from runtime.stages.types import StageModule

__all__ = ["SequentialStage", "sequential_segments", "split_sequential"]


class SequentialStage(StageModule):
    """Segment ``segment`` of an ``nn.Sequential``: its children under their original names.

    ``forward(*values) -> tuple``: one value is passed to the first child as is, several as one
    tuple (what the previous child returned); the result is returned as a tuple (a child's tuple
    result as it is, a tensor as ``(tensor,)``). Stage 0 takes the model input, e.g. images
    ``[micro_batch, 1, 8, 8]`` float; the last stage returns ``(logits [micro_batch, classes],)``.

    Attributes:
        segment: segment index.
        names: the children's names in run order.
    """

    def __init__(self, children: Sequence[tuple[str, nn.Module]], segment: int):
        super().__init__()
        self.segment = segment
        self.names = [name for name, _ in children]
        for name, child in children:
            self.add_module(name, child)

    def forward(self, *values):
        x = values[0] if len(values) == 1 else tuple(values)
        for name in self.names:
            x = self._modules[name](x)
        return x if isinstance(x, tuple) else (x,)


def sequential_segments(model: nn.Module, segment_layers: Sequence[Sequence[str]]) -> list[list[str]]:
    """Child names of each segment (see the module docstring).

    Raises:
        StageSplitError: a listed layer is not a direct child of ``model``, the segments do not
            follow the children's order, or a segment gets no child.
    """
    names = [name for name, _ in model.named_children()]
    seg_of: dict[str, int] = {}
    for i, layers in enumerate(segment_layers):
        for lay in layers:
            top = str(lay).split(".")[0]
            if top not in names:
                raise StageSplitError(
                    f"segment {i} lists layer {lay!r}, which is not a child of the nn.Sequential "
                    f"{type(model).__name__} (children {names}); re-plan the model")
            seg_of.setdefault(top, i)
    out: list[list[str]] = [[] for _ in segment_layers]
    cur = 0
    for name in names:
        s = seg_of.get(name, cur)
        if s < cur:
            raise StageSplitError(
                f"child {name!r} of the nn.Sequential is planned in segment {s} after a child of segment {cur}; "
                "the module split needs segments that follow the children's order")
        cur = s
        out[s].append(name)
    for i, kids in enumerate(out):
        if not kids:
            raise StageSplitError(f"segment {i} gets no child of the nn.Sequential; plan with fewer devices")
    return out


def split_sequential(model: nn.Module, segment_layers: Sequence[Sequence[str]]) -> dict[int, SequentialStage]:
    """Segment index -> :class:`SequentialStage` holding deep copies of that segment's children
    (``model`` is left untouched; a module shared by two children of one stage stays shared, one
    shared across stages becomes one copy per stage: a tied parameter).

    Raises:
        StageSplitError: ``model`` is not an ``nn.Sequential``, or see :func:`sequential_segments`.
    """
    if not isinstance(model, nn.Sequential):
        raise StageSplitError(f"the module split cuts an nn.Sequential, but the model is a {type(model).__name__}")
    kids = dict(model.named_children())
    stages: dict[int, SequentialStage] = {}
    with torch.no_grad():
        for i, names in enumerate(sequential_segments(model, segment_layers)):
            copies = copy.deepcopy([kids[n] for n in names])
            stages[i] = SequentialStage(list(zip(names, copies)), i)
    return stages
