"""Single-process training loop for the GPT-MoE models (and their dense baseline) on real text.

Data: :class:`runtime.data.ByteCorpus` (the CPython standard library sources as bytes, split into
training and validation by file). Model: a registry name (``gpt-moe-tiny``, ``gpt-moe-tiny-top2``,
``gpt-moe-tiny-dts``, ``gpt-dense-tiny`` = the dense baseline below) or an ``nn.Module`` mapping
token ids ``[B, T]`` to logits ``[B, T, 256]``.

Loop (one optimizer update per step, no gradient accumulation)::

    ce, aux = lm_objective(model, batch)               # CE of model(x) vs y; aux None for dense
    (ce + aux).backward(); opt.step(); opt.zero_grad()
    advance_gates(model)                               # once per optimizer update (MoE only)

The training objective of one micro-batch is ``CE + aux`` (:func:`lm_objective`), and a step's
gradient is that of the MEAN over its ``n`` micro-batches (each backward of
``(CE_j + aux_j) / n``; here ``n = 1``). :func:`runtime.reference.reference_losses` (``n = dp * m``)
and the pipelined :class:`runtime.worker.StageWorker` (each stage backpropagates its own MoE
layers' ``aux_j / m`` next to the output gradient, replicas averaged) use the same objective
with the same scaling, and all of them REPORT the loss as the CE alone, the aux loss separately.

Optimizer: ``torch.optim.AdamW(lr, weight_decay=0)``, constant learning rate after a linear
warm-up of ``warmup`` steps. Logged per step: the LM loss (``train_loss``, without the aux
term), the weighted aux loss, and the routing metrics of that step's forward
(:meth:`engine.models.moe.gpt_moe.GPTMoE.moe_metrics`: ``temperature``, ``experts_per_token``,
``load_cv``, ``dropped_fraction``, ``balance_loss``, ``load_{e}``); the metrics are from the
forward *before* the step's ``advance_gates()``, so ``metrics[s]["temperature"] ==
dts_temperature(s, ...)``. Validation every ``eval_every`` steps (and after the last step): mean
LM loss over ``val_batches`` fixed validation batches in ``eval()`` mode (DTS-Gate then routes
without Gumbel noise), with the training wall time so far (validation time excluded).

Threads: ``torch.set_num_threads(threads)`` (default 1, so that runs are comparable on a shared
2-core machine); the previous setting is restored afterwards.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.errors import ModelArgumentError
from engine.models.gpt import GPT, GPTConfig, lm_loss
from engine.models.moe.gpt_moe import GPTMoE, GPTMoEConfig
from engine.models.moe.layer import MoEFeedForward
from runtime.data import ByteCorpus
from tasks.text import split_rows, token_loss

logger = logging.getLogger(__name__)

__all__ = ["MoETrainResult", "train_moe", "build_tiny", "dense_tiny_config", "TINY_MODELS", "lm_objective",
           "moe_aux_loss", "advance_gates", "moe_metrics", "has_moe"]


def _moe_layers(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def has_moe(model: nn.Module) -> bool:
    """Whether ``model`` has :class:`~engine.models.moe.layer.MoEFeedForward` layers."""
    return bool(_moe_layers(model))


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the MoE layers' weighted aux (load-balancing) losses of the last forward (a scalar
    in the autograd graph), ``None`` for a model without MoE layers (or before any forward)."""
    losses = [m.last_aux_loss for m in _moe_layers(model) if m.last_aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def advance_gates(model: nn.Module) -> None:
    """Count one optimizer update in every gate (``BaseGate.advance``); no-op without MoE layers."""
    for m in _moe_layers(model):
        m.gate.advance()


def moe_metrics(model: nn.Module) -> dict[str, float]:
    """Routing metrics of the last forward averaged over MoE layers (see
    :meth:`engine.models.moe.gpt_moe.GPTMoE.moe_metrics`); ``{}`` without MoE layers."""
    layers = [m.last_metrics for m in _moe_layers(model) if m.last_metrics]
    if not layers:
        return {}
    out = {k: float(torch.stack([lm[k].float() for lm in layers]).mean())
           for k in ("temperature", "experts_per_token", "load_cv", "dropped_fraction", "balance_loss")}
    load = torch.stack([lm["load"] for lm in layers]).mean(0)
    out.update({f"load_{e}": float(v) for e, v in enumerate(load)})
    return out


def lm_objective(model: nn.Module, batch: Any, task: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One micro-batch's training objective terms: ``(loss, aux)``.

    Args:
        model: maps the task's inputs to its output (token ids ``[B, T]`` to logits ``[B, T, V]``
            for causal LM); a tuple/list output counts by its first element.
        batch: int64 ``[B, T + 1]`` (causal LM: inputs ``batch[:, :-1]``, targets ``batch[:, 1:]``),
            or a task's micro-batch tuple ``(*inputs, *targets)`` (``task.num_inputs`` inputs;
            one input without a task).
        task: a :class:`tasks.base.Task` whose ``loss(output, *targets)`` is the loss; ``None``:
            next-token cross-entropy (the original objective).

    Returns:
        ``loss``: the task's loss (mean next-token cross-entropy, nats/token in float32, without a
        task); ``aux``: the sum of the MoE layers' weighted aux losses of this forward, ``None``
        for dense models. The objective is ``loss + aux`` (see the module docstring for the
        scaling over micro-batches).
    """
    if isinstance(batch, torch.Tensor):
        ids, labels = split_rows(batch)
        inputs: tuple = (ids,)
        targets: tuple = (labels,)
    else:
        k = task.num_inputs if task is not None else 1
        inputs, targets = tuple(batch[:k]), tuple(batch[k:])
    out = model(*inputs)
    if isinstance(out, (tuple, list)):
        out = out[0]
    loss = task.loss(out, *targets) if task is not None else token_loss(out, targets[0])
    return loss, moe_aux_loss(model)

#: Registry-style names accepted by :func:`train_moe` -> gate (None = dense baseline).
TINY_MODELS = {"gpt-dense-tiny": None, "gpt-moe-tiny": "switch", "gpt-moe-tiny-top2": "top2",
               "gpt-moe-tiny-dts": "dts"}


def dense_tiny_config() -> GPTConfig:
    """The dense baseline at equal *active* parameters to ``gpt-moe-tiny`` (Switch, top-1).

    Same shape as the tiny MoE models (4 layers, 4 heads, hidden 64, byte vocab, 128 positions);
    every FFN is a dense ``4·64`` GELU MLP, the same width as one expert (``ffn_mult=4``), so a
    token passes through the same number of weights as under a top-1 gate.
    """
    return GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=256, block_size=128)


def build_tiny(name: str, **gate_kw) -> nn.Module:
    """Build a tiny model by name (see :data:`TINY_MODELS`) with gate keyword overrides.

    Same configuration as the registry entries ``gpt-moe-tiny*`` (4 layers, hidden 64, 4 experts
    in layers 1 and 3), but ``gate_kw`` (e.g. DTS ``D``, ``H``) can be set.

    Raises:
        ValueError: unknown name, or ``gate_kw`` given for the dense model.
    """
    if name not in TINY_MODELS:
        raise ModelArgumentError(f"unknown model {name!r}; valid: {', '.join(TINY_MODELS)}")
    gate = TINY_MODELS[name]
    if gate is None:
        if gate_kw:
            raise ModelArgumentError(f"the dense model takes no gate arguments, got {sorted(gate_kw)}")
        return GPT(dense_tiny_config())
    cfg = GPTMoEConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=256, block_size=128,
                       num_experts=4, gate=gate, gate_kw=dict(gate_kw))
    return GPTMoE(cfg)


@dataclass
class MoETrainResult:
    """What :func:`train_moe` measured.

    Attributes:
        name: model name (or the module's class name).
        steps: optimizer updates run.
        train_loss: LM loss per step (without the aux loss).
        aux_loss: weighted aux (balance) loss per step (0.0 for dense models).
        metrics: per step, the routing metrics dict (empty dicts for dense models).
        val_steps: steps after which validation ran (number of updates done).
        val_loss: mean validation LM loss at each of ``val_steps``.
        val_time: training wall seconds (validation excluded) at each of ``val_steps``.
        step_time: wall seconds per step.
        params: total parameters; ``active_params``: parameters one token passes through at
            the end of training (nominal: MoE layers count 1 expert for Switch and sparse-phase
            DTS, 2 for top-2, all for dense-phase DTS; routers included).
        threads: torch intra-op threads used.
        model: the trained module (for checkpoints / further inspection).
    """

    name: str
    steps: int
    train_loss: list[float] = field(default_factory=list)
    aux_loss: list[float] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    val_time: list[float] = field(default_factory=list)
    step_time: list[float] = field(default_factory=list)
    params: int = 0
    active_params: int = 0
    threads: int = 1
    model: nn.Module | None = None

    def metric(self, key: str) -> list[float]:
        """One routing metric per step (NaN where absent)."""
        return [m.get(key, float("nan")) for m in self.metrics]

    def to_dict(self) -> dict:
        """JSON-able dict of everything but the model."""
        return {k: getattr(self, k) for k in ("name", "steps", "train_loss", "aux_loss", "metrics",
                                                "val_steps", "val_loss", "val_time", "step_time",
                                                "params", "active_params", "threads")}


def _active_params(model: nn.Module) -> int:
    total = sum(p.numel() for p in model.parameters())
    for m in model.modules():
        if isinstance(m, MoEFeedForward):
            per_expert = sum(p.numel() for p in m.experts[0].parameters())
            gate = m.gate
            if m.gate_kind == "top2":
                k = 2
            elif m.gate_kind == "dts" and gate.phase == "dense":
                k = len(m.experts)  # dense phase: up to every expert (threshold 0.001)
            else:
                k = 1
            total -= per_expert * (len(m.experts) - k)
    return int(total)


@torch.no_grad()
def _validate(model: nn.Module, corpus: ByteCorpus, batches: int, batch_size: int) -> float:
    was = model.training
    model.eval()
    tot = 0.0
    for i in range(batches):
        b = corpus.val_batch(i, batch_size)
        tot += float(lm_loss(model(b[:, :-1]), b[:, 1:]))
    model.train(was)
    return tot / batches


def train_moe(model: str | nn.Module, steps: int = 300, batch_size: int = 16, seq_len: int = 64,
              lr: float = 3e-3, eval_every: int = 25, seed: int = 0, *, val_batches: int = 8,
              warmup: int = 20, threads: int = 1, corpus: ByteCorpus | None = None,
              log_every: int = 0, **gate_kw) -> MoETrainResult:
    """Train ``model`` on the byte-level CPython-source LM for ``steps`` optimizer updates.

    Args:
        model: a :data:`TINY_MODELS` name (built with ``gate_kw`` by :func:`build_tiny`) or a
            module (``gate_kw`` must then be empty).
        steps: optimizer updates (>= 1).
        batch_size, seq_len: training/validation batch shape (``seq_len`` <= 128 for the tiny
            models).
        lr: peak AdamW learning rate (linear warm-up over ``warmup`` steps, then constant).
        eval_every: validate every this many steps (and after the last step); 0 = only at the end.
        seed: seeds the weights (``torch.manual_seed``), the data split and batches, and the
            Gumbel noise.
        val_batches: validation batches per evaluation (the same fixed batches every time).
        threads: ``torch.set_num_threads`` during the run.
        corpus: a prebuilt :class:`ByteCorpus` (its ``seq_len`` wins); default
            ``ByteCorpus(seq_len=seq_len, seed=seed)``.
        log_every: log a progress line (``logging`` INFO, logger ``runtime.moe_train``) every this
            many steps (0 = silent).
        **gate_kw: gate arguments (e.g. DTS ``D``, ``H``, ``tau_max``, ``tau_min``).

    Returns:
        :class:`MoETrainResult`.

    Raises:
        ValueError: ``steps < 1``, unknown model name, gate arguments with a module.
        runtime.data.DataError: the corpus cannot be built.
    """
    if steps < 1:
        raise ModelArgumentError(f"steps must be >= 1, got {steps}")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        if isinstance(model, str):
            name = model
            model = build_tiny(model, **gate_kw)
        else:
            if gate_kw:
                raise ModelArgumentError("gate arguments are only accepted with a model name; configure "
                                 "the module's gates when building it")
            name = type(model).__name__
        corpus = corpus or ByteCorpus(seq_len=seq_len, seed=seed)
        is_moe = has_moe(model)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        res = MoETrainResult(name=name, steps=steps, threads=threads, model=model,
                             params=sum(p.numel() for p in model.parameters()))
        model.train()
        elapsed = 0.0
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr * min(1.0, (step + 1) / max(1, warmup))
            batch = corpus.train_batch(step, batch_size)
            t0 = time.perf_counter()
            task, aux = lm_objective(model, batch)
            if aux is None:
                aux = torch.zeros(())
            (task + aux).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            metrics = moe_metrics(model) if is_moe else {}
            advance_gates(model)
            dt = time.perf_counter() - t0
            elapsed += dt
            res.step_time.append(dt)
            res.train_loss.append(float(task.detach()))
            res.aux_loss.append(float(aux.detach()))
            res.metrics.append(metrics)
            done = step + 1
            if (eval_every and done % eval_every == 0) or done == steps:
                res.val_steps.append(done)
                res.val_loss.append(_validate(model, corpus, val_batches, batch_size))
                res.val_time.append(elapsed)
            if log_every and done % log_every == 0:
                logger.info("[%s] step %d/%d loss %.3f%s", name, done, steps, res.train_loss[-1],
                            f" val {res.val_loss[-1]:.3f}" if res.val_steps and res.val_steps[-1] == done else "")
        res.active_params = _active_params(model)
        return res
    finally:
        torch.set_num_threads(old_threads)
