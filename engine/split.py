"""Which stage-construction method the runtime uses for a model (recorded as ``plan.model.split``).

Two well-kept anchors cut a model into pipeline stages (``runtime.stage.build_stages``):

- ``"tracer"``: ``torch.distributed.pipelining.pipeline`` traces the whole model with
  ``torch.export`` and splits the graph between the plan's segments. It handles any forward that
  exports (Hugging Face transformers, the zoo, most user modules), including values that skip
  stages (attention masks, rotary tables, T5's position bias).
- ``"module"``: torchtitan's manual split (``torchtitan/distributed/pipeline.py``,
  ``pipeline_module_split``): each stage is a copy of the model that keeps only its own layers and
  runs them eagerly. It needs a model whose forward is the composition of its layers in order,
  which an ``nn.Sequential`` is by definition (a CNN, an MLP); nothing is traced, so dropout,
  batch norm and any Python in the layers behave exactly as in the unsplit model.

Source: torch.distributed.pipelining (``pipeline``, ``SplitPoint``); torchtitan
``torchtitan/distributed/pipeline.py``.
"""

from __future__ import annotations

from typing import Literal, get_args

from torch import nn

__all__ = ["SplitMethod", "SPLIT_METHODS", "choose_split"]

SplitMethod = Literal["tracer", "module"]
"""How the runtime builds a plan's stages (see the module docstring)."""

SPLIT_METHODS: tuple[str, ...] = get_args(SplitMethod)


def choose_split(module: nn.Module) -> SplitMethod:
    """``"module"`` for an ``nn.Sequential`` model (its layers run in order, so a stage is a slice
    of them), ``"tracer"`` for every other model."""
    return "module" if isinstance(module, nn.Sequential) else "tracer"
