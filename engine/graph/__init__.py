"""Graph capture: ``nn.Module`` -> :class:`OpGraph` (aten ops with shapes, FLOPs, bytes).

Public API::

    from engine.graph import capture, OpGraph, LayerSummary
    g = capture(module, example_inputs, name="gpt2")   # torch.export, strict=False, meta tensors
"""
from .capture import capture
from .opgraph import LayerSummary, OpGraph

__all__ = ["capture", "OpGraph", "LayerSummary"]
