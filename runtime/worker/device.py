"""Moving a stage worker's tensors between devices (CPU checkpoints, CUDA stages).

Source: ``torch.nn.Module.to`` / ``Module._apply`` semantics (buffers are replaced, not moved in
place), https://pytorch.org/docs/stable/generated/torch.nn.Module.html.
"""

from __future__ import annotations

import torch

__all__ = ["cpu_copy", "module_to"]


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy (a clone on CPU, a device-to-host copy on CUDA)."""
    t = t.detach()
    return t.clone() if t.device.type == "cpu" else t.to("cpu")


def module_to(module: torch.nn.Module, device: torch.device) -> None:
    """Move a stage module to ``device``, including its traced ``inner`` graph module.

    A :class:`runtime.stage.StageModule` registers ``inner``'s own parameters and buffers on
    itself too (names stay unprefixed), so ``module.to()`` alone would leave ``inner``'s buffer
    slots on the old device (``Module._apply`` replaces buffers by new tensors); this moves both
    and re-links the outer slots to ``inner``'s tensors, and moves plain tensor attributes (traced
    constants) as well, so no tensor of the stage stays behind.
    """
    inner = getattr(module, "inner", None)
    roots = [module]
    if isinstance(inner, torch.nn.Module):
        inner.to(device)
        roots.append(inner)
    module.to(device)
    if isinstance(inner, torch.nn.Module):
        for name, p in inner._parameters.items():
            if p is not None and name in module._parameters:
                module._parameters[name] = p
        for name, b in inner._buffers.items():
            if b is not None and name in module._buffers:
                module._buffers[name] = b
    for root in roots:
        for sub in root.modules():
            for k, v in list(vars(sub).items()):
                if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and v.device != device:
                    sub.__dict__[k] = v.to(device)
