"""AdamA: Adam accumulation — fold each micro-batch's gradient into Adam's states and free it.

Zhang et al., "AdamA: Adam Accumulation" (ECAI 2023); the update below is the paper's. With ``N``
micro-batches per optimizer step ``t`` and micro-batch gradients ``g_1..g_N`` (already scaled by
``1/N``, i.e. the backward of ``loss_i / N``):

- first micro-batch of a step: ``m <- b1*m + (1-b1)*g_1``, ``v <- b2*v + (1-b2)*g_1**2``
- later micro-batches:        ``m <- m + (1-b1)*g_i``,     ``v <- v + (1-b2)*g_i**2``
- ``step()``: ``t <- t+1``, ``p <- p - lr*wd*p`` (decoupled weight decay, AdamW),
  ``p <- p - lr * (m / (1-b1**t)) / (sqrt(v / (1-b2**t)) + eps)``

``m`` equals Adam-with-gradient-accumulation's first moment exactly; ``v`` holds the sum of the
squared micro-batch gradients instead of the square of their sum. Each gradient is folded by a
per-parameter ``Tensor.register_post_accumulate_grad_hook`` (PyTorch "How to save memory by
fusing the optimizer step into the backward pass") and released (``p.grad = None``) at once, so
no model-sized gradient buffer lives across micro-batches.

Step protocol (N micro-batches per step)::

    opt = AdamA(model.parameters(), lr=1e-3)
    for step in range(steps):
        for x in micro_batches:              # N of them
            (loss_fn(model(x)) / N).backward()   # hooks fold g into m, v; p.grad is None after
        opt.step()                           # apply the update; the next fold starts a new step
        # no zero_grad needed (it is a no-op)

Data parallelism (the design used by ``runtime.worker``): every replica folds its own
micro-batch gradients locally; before ``step()`` the states are averaged across replicas with
:meth:`AdamA.state_tensors` + one ``all_reduce`` each (``m`` then ``v``; :meth:`AdamA.sync_states`
does it for a process group). ``m`` then equals Adam-with-accumulation's ``m`` of the global
mean gradient exactly, and ``v <- b2*v + (1-b2) * mean_r(sum_i g_{r,i}**2)`` with ``g_{r,i}``
replica ``r``'s micro-batch gradient scaled by ``1/(dp*N)``: the squares are taken per replica
micro-batch. Communication: 2x the parameter bytes per step (Adam all-reduces 1x), once per step.

Not supported, with a clear error: gradient clipping of the full gradient (it never exists:
:meth:`AdamA.clip_grad_norm_` raises; ``torch.nn.utils.clip_grad_norm_`` would silently see no
gradients), ``torch.amp.GradScaler`` (it unscales and checks gradients that were already folded:
``step(grad_scaler=...)`` raises), closures, sparse gradients, and ``amsgrad``.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from engine.errors import TesselError

__all__ = ["AdamA", "AdamAError"]


class AdamAError(TesselError, RuntimeError):
    """An operation AdamA cannot support (full-gradient clipping, GradScaler, sparse gradients).

    A :class:`~engine.errors.TesselError`; still a ``RuntimeError`` for existing handlers."""


class AdamA(Optimizer):
    """Adam accumulation: per-parameter hooks fold every micro-batch gradient into ``m`` and ``v``
    and free it; :meth:`step` applies the bias-corrected update.

    Args:
        params: parameters or parameter groups (``torch.optim`` conventions); each parameter gets a
            post-accumulate-grad hook (it must be a leaf that requires grad).
        lr: learning rate.
        betas: ``(b1, b2)``.
        eps: added to the denominator.
        weight_decay: decoupled weight decay (AdamW style, ``p <- p - lr*wd*p`` each step).
        fold: ``False`` leaves gradients in ``p.grad`` (a parameter kept out of folding, e.g. a
            pipeline-tied copy that must be summed first); fold them later with :meth:`fold`.

    State per parameter: ``exp_avg`` (m) and ``exp_avg_sq`` (v), fp32 like the parameter, ``step``.

    Raises:
        ValueError: a bad hyper-parameter, or a parameter that does not require grad.
        AdamAError: see the module docstring.
    """

    _step_supports_amp_scaling = True  # so GradScaler.step hands itself to step() and we can refuse it

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, fold: bool = True):
        if lr < 0:
            raise ValueError(f"AdamA: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamA: betas must be in [0, 1), got {betas}")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"AdamA: eps and weight_decay must be >= 0, got eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self._hooks = []
        self._group_of: dict[torch.Tensor, dict] = {}   # parameter -> its param group (betas, lr, ...)
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    raise ValueError("AdamA: every parameter must require grad (its gradient is folded by a hook)")
                st = self.state[p]
                st["step"] = 0
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["fresh"] = True   # the next fold is the first of a step: decay first
                self._group_of[p] = group
                if fold:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))

    # ------------------------------------------------------------------ folding
    def _hook(self, p: torch.Tensor) -> None:
        g = p.grad
        if g is None:
            return
        self.fold_gradient(p, g)
        p.grad = None

    @torch.no_grad()
    def fold_gradient(self, p: torch.Tensor, g: torch.Tensor) -> None:
        """Fold one micro-batch gradient ``g`` (shape of ``p``) into ``p``'s ``m`` and ``v``.

        Raises:
            AdamAError: ``g`` is sparse.
        """
        if g.is_sparse:
            raise AdamAError("AdamA does not support sparse gradients")
        st = self.state[p]
        b1, b2 = self._group_of[p]["betas"]
        m, v = st["exp_avg"], st["exp_avg_sq"]
        if st["fresh"]:
            m.mul_(b1)
            v.mul_(b2)
            st["fresh"] = False
        m.add_(g, alpha=1 - b1)
        v.addcmul_(g, g, value=1 - b2)

    def fold(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Fold the gradients left in ``p.grad`` (parameters built with ``fold=False``, or all of
        ``params``) as ONE micro-batch each, then free them."""
        ps = params if params is not None else [p for g in self.param_groups for p in g["params"]]
        for p in ps:
            if p.grad is not None:
                self.fold_gradient(p, p.grad)
                p.grad = None

    def begin_step(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Decay ``m``, ``v`` now (``b1*m``, ``b2*v``) for parameters no gradient was folded into
        yet this step (the first fold does it otherwise); used before summing states across ranks."""
        ps = params if params is not None else [p for g in self.param_groups for p in g["params"]]
        with torch.no_grad():
            for p in ps:
                st = self.state[p]
                if st["fresh"]:
                    b1, b2 = self._group_of[p]["betas"]
                    st["exp_avg"].mul_(b1)
                    st["exp_avg_sq"].mul_(b2)
                    st["fresh"] = False

    def state_tensors(self, params: Iterable[torch.Tensor] | None = None
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``([m...], [v...])`` of ``params`` (all by default), in parameter order, for collectives."""
        ps = params if params is not None else [p for g in self.param_groups for p in g["params"]]
        return [self.state[p]["exp_avg"] for p in ps], [self.state[p]["exp_avg_sq"] for p in ps]

    def sync_states(self, group=None, params: Iterable[torch.Tensor] | None = None) -> None:
        """Average ``m`` and ``v`` over the data-parallel process ``group`` (``torch.distributed``,
        one flat ``all_reduce`` each) before :meth:`step`; see the module docstring for the formula."""
        ps = list(params) if params is not None else [p for g in self.param_groups for p in g["params"]]
        if not ps:
            return
        self.begin_step(ps)
        world = dist.get_world_size(group)
        for tensors in self.state_tensors(ps):
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.div_(world)
            o = 0
            for t in tensors:
                t.copy_(flat[o:o + t.numel()].view_as(t))
                o += t.numel()

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None, *, grad_scaler=None):  # noqa: D401 - torch.optim signature
        """Apply the update with the states folded since the last step; returns ``None``.

        A parameter no gradient reached this step is decayed as if its gradient were zero
        (Adam's behaviour for a zero gradient), so all parameters share one step count.

        Raises:
            AdamAError: a ``closure`` or a ``GradScaler`` is given, or gradients are still held
                by parameters with folding on (a backward ran with hooks removed).
        """
        if closure is not None:
            raise AdamAError("AdamA.step does not take a closure: gradients are folded during backward")
        if grad_scaler is not None:
            raise AdamAError("AdamA cannot be used with torch.amp.GradScaler: gradients are folded into m and v "
                             "during backward, before the scaler could unscale or check them. Use bfloat16 "
                             "autocast (no loss scaling) or torch.optim.Adam with gradient accumulation.")
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                st = self.state[p]
                if st["fresh"]:          # nothing folded: zero gradient this step
                    st["exp_avg"].mul_(b1)
                    st["exp_avg_sq"].mul_(b2)
                st["step"] += 1
                t = st["step"]
                if wd:
                    p.mul_(1 - lr * wd)
                bc1 = 1 - b1 ** t
                bc2 = 1 - b2 ** t
                denom = (st["exp_avg_sq"] / bc2).sqrt_().add_(eps)
                p.addcdiv_(st["exp_avg"], denom, value=-lr / bc1)
                st["fresh"] = True
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are freed by the hooks already; frees any left (``fold=False`` parameters)."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def clip_grad_norm_(self, *args, **kwargs):
        """Refused: AdamA never holds the full gradient, so its norm cannot be clipped.

        Raises:
            AdamAError: always, with what to do instead.
        """
        raise AdamAError("AdamA cannot clip the full gradient: each micro-batch gradient is folded into m and v "
                         "and freed during backward, so the summed gradient never exists. Clip per micro-batch "
                         "inside a hook, or use torch.optim.Adam with gradient accumulation.")

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (e.g. before handing the parameters to another optimizer)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ checkpoints
    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim`` loading, then re-link every parameter to its (rebuilt) group."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                self._group_of[p] = group
                st = self.state[p]
                st.setdefault("fresh", True)
                st["step"] = int(st["step"])

    def __repr__(self) -> str:
        n = sum(len(g["params"]) for g in self.param_groups)
        g = self.param_groups[0] if self.param_groups else {}
        return f"AdamA({n} params, lr={g.get('lr')}, betas={g.get('betas')}, weight_decay={g.get('weight_decay')})"
