"""A plan's precision policy applied to the modules of one rank (and to the single-process reference).

The policies are :mod:`engine.precision`'s (PyTorch Lightning's names); here is how a rank runs them:

- ``32-true``: nothing changes (float32 weights, compute, gradients, Adam's states).
- ``bf16-mixed`` / ``16-mixed``: the weights stay float32 (they are the master weights the
  optimizer steps, with float32 gradients and Adam states); every stage's forward runs under
  ``torch.autocast(device_type, dtype=compute dtype)`` (:func:`apply_precision`), so matmuls run in
  bfloat16 / float16 and the activations they produce are stored in it; the task's loss is computed
  in float32 on upcast logits. Lightning's ``MixedPrecision`` plugin does the same
  (``lightning.pytorch.plugins.precision.amp``: ``torch.autocast`` around the step, fp32 weights).
- ``16-mixed`` also scales the loss (:class:`LossScaler`): PyTorch's dynamic loss scaler with
  ``torch.amp.GradScaler``'s rule and defaults (initial scale 2**16; after an optimizer step with
  an inf/nan gradient, the step is skipped and the scale halved; after 2,000 clean steps it
  doubles). The worker uses torch's ``ShardedGradScaler``
  (``torch.distributed.fsdp.sharded_grad_scaler``, GradScaler's subclass that supports the CPU and
  all-reduces its inf/nan flag over a process group), over every rank of the run, so all pipeline
  stages, tensor ranks and replicas skip the same steps and stay in step; the single-process
  reference uses ``torch.amp.GradScaler`` itself. Both work on the CPU in torch 2.13.
- ``bf16-true``: the whole model is cast to bfloat16 before it is split (:func:`cast_model`), so
  parameters, gradients and Adam's states are bfloat16 (Lightning's ``HalfPrecision``); the loss is
  still computed in float32 on upcast logits.

Float16 autocast on the CPU exists since torch 2.3 (earlier versions warned and ran float32);
:func:`precision_refusal` checks it at launch (:func:`fp16_autocast_works`) and refuses ``16-mixed``
in one sentence where it does not.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from engine.precision import PrecisionPolicy, get_policy

__all__ = ["LossScaler", "apply_precision", "autocast", "cast_model", "fp16_autocast_works", "plan_policy",
           "precision_refusal", "upcast_output"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def plan_policy(plan: Any) -> PrecisionPolicy:
    """The :class:`~engine.precision.PrecisionPolicy` of ``plan`` (``plan.parallel.precision``;
    ``32-true`` for a plan object without the field)."""
    return get_policy(getattr(plan.parallel, "precision", None) or "32-true")


def autocast(policy: PrecisionPolicy, device_type: str) -> contextlib.AbstractContextManager:
    """``torch.autocast(device_type, dtype=policy's compute dtype)`` for a mixed policy; a no-op
    context for ``32-true`` and ``bf16-true``."""
    if not policy.mixed:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=_DTYPES[policy.compute_dtype])


@functools.lru_cache(maxsize=None)
def fp16_autocast_works(device_type: str = "cpu") -> bool:
    """Whether ``torch.autocast(device_type, dtype=torch.float16)`` really computes a matmul in
    float16 (older CPU builds warned and stayed in float32)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autocast(device_type, dtype=torch.float16):
                y = torch.ones(2, 2, device=device_type) @ torch.ones(2, 2, device=device_type)
    except (RuntimeError, AssertionError):
        return False
    return y.dtype == torch.float16


def precision_refusal(policy: PrecisionPolicy, *, device_type: str = "cpu", optimizer: str = "adam",
                      transforms: Any = ()) -> str | None:
    """One sentence saying why the runtime cannot train with ``policy`` here, or ``None``.

    Refused: ``16-mixed`` where float16 autocast does not work on ``device_type``; any policy but
    ``32-true`` with AdamA (its folded moments are float32 sums of the gradients); ``16-mixed`` and
    ``bf16-true`` with ``sharded-update`` (its flat float32 shards are neither scaled nor bfloat16).
    """
    if policy.name == "32-true":
        return None
    if policy.compute_dtype == "float16" and not fp16_autocast_works(device_type):
        return (f"precision {policy.name!r} needs float16 autocast on {device_type!r}, which this torch "
                f"{torch.__version__} does not run; plan with --precision bf16-mixed")
    if optimizer == "adama":
        return (f"precision {policy.name!r} with optimizer 'adama' is not supported (AdamA folds float32 "
                "gradients into its moments); use optimizer 'adam' or precision 32-true")
    if "sharded-update" in tuple(transforms) and policy.name in ("16-mixed", "bf16-true"):
        return (f"precision {policy.name!r} with the sharded update is not supported (its flat float32 "
                "shards are neither loss-scaled nor bfloat16); plan with bf16-mixed or without sharded-update")
    return None


def cast_model(module: nn.Module, policy: PrecisionPolicy) -> nn.Module:
    """``bf16-true``: cast every parameter and floating buffer of ``module`` to bfloat16 in place
    (``module.to(torch.bfloat16)``); other policies keep float32. Returns ``module``."""
    if not policy.mixed and policy.compute_dtype != "float32":
        module.to(_DTYPES[policy.compute_dtype])
    return module


def upcast_output(out: Any) -> Any:
    """A module's output with its (first) floating tensor in float32: a tensor, or a tuple/list whose
    first element is one (the logits the loss takes). Other values are returned unchanged."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() else out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) and out[0].is_floating_point():
        return type(out)([out[0].float(), *out[1:]]) if isinstance(out, list) else (out[0].float(), *out[1:])
    return out


_CLASSES: dict[tuple, type] = {}


def _device_type(args: tuple, kwargs: dict) -> str:
    """The device type of the first tensor argument (``"cpu"`` without one)."""
    return next((a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), "cpu")


def _precision_class(cls: type, policy_name: str, upcast: bool) -> type:
    """A subclass of ``cls`` whose ``forward`` runs under the policy's autocast (on its inputs'
    device type) and (``upcast``) returns float32 logits; created once per key. Parameter names and
    ``isinstance`` stay those of ``cls``."""
    key = (cls, policy_name, upcast)
    if key not in _CLASSES:
        policy = get_policy(policy_name)

        def forward(self, *args, **kwargs):
            with autocast(policy, _device_type(args, kwargs)):
                out = super(new, self).forward(*args, **kwargs)
            return upcast_output(out) if upcast else out

        new = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                          "precision_policy": policy_name})
        _CLASSES[key] = new
    return _CLASSES[key]


def apply_precision(module: nn.Module, policy: PrecisionPolicy, *, upcast: bool = False) -> nn.Module:
    """Make ``module``'s forward run with ``policy``: under ``torch.autocast`` on the device type of
    its inputs (mixed policies; the stages are built on the CPU and may move to CUDA later) and,
    with ``upcast`` (the module whose output is the loss's input: the last stage, the unsplit
    model), returning its logits in float32 so the loss is computed in float32. The module keeps its
    parameters, names and ``isinstance``; its class is swapped for a subclass (so ``copy.deepcopy``
    keeps the behaviour). ``32-true``: unchanged. Returns ``module``."""
    if policy.name == "32-true" or getattr(type(module), "precision_policy", None) is not None:
        return module
    module.__class__ = _precision_class(type(module), policy.name, upcast)
    return module


class _LocalGrads:
    """What ``GradScaler.unscale_`` and ``step`` read of an optimizer, with every gradient as this
    rank's local tensor: a DTensor parameter is stood in for by a detached alias of its local shard
    whose ``.grad`` is the local shard of its gradient (the same storage, so unscaling it unscales
    the DTensor's), so the unscale and inf check run on plain tensors; ``step()`` steps the real
    optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.param_groups = [{"params": [_local(p) for p in g["params"] if p.grad is not None]}
                             for g in optimizer.param_groups]

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self.optimizer.step(*args, **kwargs)


def _local(p: torch.Tensor) -> torch.Tensor:
    """``p`` itself, or for a DTensor a detached alias of its local shard carrying its local gradient."""
    if not hasattr(p, "to_local"):
        return p
    alias = p.to_local().detach()
    grad: Any = p.grad
    alias.grad = grad.to_local() if hasattr(grad, "to_local") else grad
    return alias


class LossScaler:
    """The dynamic loss scaler of ``16-mixed`` for one rank (GradScaler's rule and defaults).

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        group: the process group over which the inf/nan flag is summed (every rank of the run, so
            all skip the same steps); ``None``: one process (``torch.amp.GradScaler``).
        init_scale: the first scale (GradScaler's default 2**16).

    Use: the backward of :meth:`scale` ``(loss)``; at the optimizer step :meth:`step` (unscale the
    gradients, skip the step if any rank found an inf/nan, else step) and the scale update.
    """

    def __init__(self, device_type: str = "cpu", group: Any = None, *, init_scale: float = 2.0 ** 16):
        if group is None:
            self.scaler: Any = torch.amp.GradScaler(device_type, init_scale=init_scale)
        else:
            self.scaler = ShardedGradScaler(device_type, init_scale=init_scale, process_group=group)
        # the scale is created lazily by the first scale(); a stage without a loss never calls it
        self.scaler.scale(torch.zeros((), device=device_type))
        self.skipped = 0
        """Optimizer steps skipped for an inf/nan gradient so far."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale (``GradScaler.scale``)."""
        return self.scaler.scale(loss)

    def get_scale(self) -> float:
        """The current scale."""
        return float(self.scaler.get_scale())

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale ``optimizer``'s gradients, step unless an inf/nan was found (on any rank of the
        group), update the scale. Returns whether the step was taken. Tensor-parallel parameters'
        gradients (DTensors) are unscaled through their local shards (:class:`_LocalGrads`)."""
        before = self.get_scale()
        view = _LocalGrads(optimizer)
        self.scaler.unscale_(view)
        self.scaler.step(view)
        self.scaler.update()
        taken = self.get_scale() >= before   # GradScaler lowers the scale exactly when it skipped the step
        self.skipped += 0 if taken else 1
        return taken

    def state_dict(self) -> dict:
        """The scale and its growth tracker (``GradScaler.state_dict``) and the skipped steps."""
        return {**self.scaler.state_dict(), "skipped": self.skipped}

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict`."""
        sd = dict(sd)
        self.skipped = int(sd.pop("skipped", 0))
        self.scaler.load_state_dict(sd)
