"""Single-process ground truth for pipelined training runs.

:func:`reference_losses` trains the plan's model, unsplit, in one process, with exactly the
numerics a pipelined run must reproduce: the same seed (``torch.manual_seed(seed)`` right before
the model is built, as in :func:`runtime.stages.build_stages`), float32, the same micro-batches,
gradient accumulation of ``loss_j / n`` over the ``n = dp * m`` micro-batches of a batch (one
backward per micro-batch, in order), then one optimizer step per batch.

Why this equals the pipelined run: a pipeline replica accumulates ``sum_j grad(loss_j / m)`` over
its ``m`` micro-batches; the data-parallel all-reduce averages the ``dp`` replicas, giving
``sum over all dp*m micro-batches of grad(loss / (dp*m))``; the tied-embedding all-reduce makes
each copy's gradient the sum over its uses, which is what the unsplit model (one shared
parameter) computes. Differences left are float rounding (summation order, the traced graphs'
explicit attention mask vs the eager ``is_causal`` path), far below ``rtol=1e-4`` on the loss.

AdamA (``optimizer="adama"``, :class:`runtime.adama.AdamA`): every micro-batch backward is of
``loss_j / (dp*m)`` and each parameter's gradient is folded into ``m``/``v`` by a
post-accumulate-grad hook as soon as it is accumulated, EXCEPT the parameters the pipeline holds
as separate tied copies in two or more segments (:func:`runtime.stages.tied_groups`, e.g. GPT-2's
``wte``/``lm_head`` split across segments): those keep their gradient over the whole batch and are
folded once before ``step()``, which is what :class:`runtime.worker.StageWorker` does (their
gradient is the sum over copies, known only at the end of the step). A plan whose tied weight
stays inside one segment (e.g. one segment, pp=1) folds it per micro-batch like everything
else. The data-parallel worker reproduces this exactly (see the worker's module docstring).

Mixture-of-experts models (:mod:`engine.models.moe`): the objective of micro-batch ``j`` is
``CE_j + aux_j`` (:func:`runtime.moe_train.lm_objective`; ``aux_j`` = the MoE layers' weighted
load-balancing losses of that forward), each backward is of ``(CE_j + aux_j) / n``, and after each
optimizer step every gate counts one update (``BaseGate.advance``: DTS temperature, hard switch).
The pipelined worker backpropagates each stage's ``aux_j / m`` together with its output gradient
and advances its gates after ``OPTIM``, so the two agree; with expert parallelism too, because
replica ``d``'s gate routes exactly the rows of micro-batch ``d*m + j`` here (same capacity,
same aux). The reported losses are the CE alone (aux separately in :func:`reference_run`).
DTS-Gate samples Gumbel noise, so its runs match only in distribution, not bit for bit.

Tasks (:mod:`tasks`): the loss of a micro-batch is the plan's task's ``loss(model(*inputs),
*targets)`` (``plan.model.task``, causal-lm when the plan records none; ``task=`` overrides it),
exactly what the pipelined worker's last stage computes, so the reference exists for every model
and task. A batch is the task's tuple ``(*inputs, *targets)`` (``task.train_batch(step, dp * m *
micro_batch_size)``), or, for causal-lm, the legacy int64 ``[rows, seq_len + 1]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.models import build_model, task_for_plan
from engine.precision import get_policy
from runtime.adama import AdamA
from runtime.moe_train import advance_gates, has_moe, lm_objective, moe_metrics
from runtime.precision import LossScaler, apply_precision, cast_model, plan_policy
from runtime.recompute import apply_recompute
from runtime.stages import tied_groups
from runtime.worker.batches import as_batch_tuple
from runtime.worker.errors import WorkerError
from runtime.worker.optimizer import fused_adam

__all__ = ["reference_losses", "reference_run", "ReferenceRun"]


@dataclass
class ReferenceRun:
    """What :func:`reference_run` trained.

    Attributes:
        losses: per batch, the ``dp * m`` micro-batch task losses (cross-entropy in nats/token for
            the text tasks) before that batch's optimizer step, in global order (see :func:`reference_losses`).
        aux_losses: per batch, the ``dp * m`` micro-batch MoE aux losses (sum over layers,
            unscaled); empty lists for models without MoE layers.
        moe: per batch, the routing metrics averaged over micro-batches and MoE layers
            (``temperature`` (DTS only), ``experts_per_token``, ``load_cv``,
            ``dropped_fraction``, ``balance_loss``); ``{}`` without MoE layers.
        model: the trained unsplit model (compare its ``state_dict`` with
            :func:`runtime.worker.merge_model_state` of the workers' states).
    """

    losses: list[list[float]] = field(default_factory=list)
    aux_losses: list[list[float]] = field(default_factory=list)
    moe: list[dict] = field(default_factory=list)
    model: torch.nn.Module | None = None
    loss_scale: list[float] = field(default_factory=list)
    skipped: int = 0


def reference_losses(plan, batches, *, seed: int = 0, lr: float = 1e-3, optimizer: str = "adam",
                     optimizer_kw: dict | None = None, task: str | None = None, precision: str | None = None,
                     recompute: str | None = None) -> list[list[float]]:
    """Train the plan's model in one process and return the per micro-batch losses.

    Args:
        plan: an :class:`engine.io.Plan` (uses ``model.name``, ``model.micro_batch_size``,
            ``model.seq_len``, ``parallel.dp`` and the schedule's ``m``).
        batches: global batches (the same given to :meth:`runtime.worker.StageWorker.step`): each
            the task's tuple ``(*inputs, *targets)`` with first dimension ``dp * m *
            micro_batch_size``, or (causal-lm) int64 ``[dp * m * micro_batch_size, seq_len + 1]``.
        seed: model initialisation seed.
        lr: learning rate; ``optimizer``: ``"adam"`` (``torch.optim.Adam`` defaults), ``"adama"``
            (:class:`runtime.adama.AdamA` defaults, see the module docstring) or ``"sgd"``.
        optimizer_kw: extra keyword arguments of the optimizer (e.g. ``betas``, ``weight_decay``);
            the runtime's workers use the defaults.
        task: a task name overriding ``plan.model.task`` (as ``tessel launch --task`` does).
        precision, recompute: override ``plan.parallel.precision`` / ``.recompute`` (``None``: the plan's;
            see the module docstring).

    Returns:
        For every batch, ``dp * m`` floats: the task's loss (mean cross-entropy, nats/token, for
        the text tasks) of each micro-batch BEFORE that batch's optimizer step, in global order (replica 0's ``m``
        micro-batches, then replica 1's, ...). Compare with the concatenation of the
        ``losses`` the last-segment ranks return, ordered by replica.

    Raises:
        ValueError: a batch of the wrong shape, an unknown optimizer, or AdamA with a precision
            other than ``32-true``.
        engine.errors.TaskError: the task cannot be built for the model.
        engine.errors.TransformError: an unknown precision or recomputation name.
    """
    return reference_run(plan, batches, seed=seed, lr=lr, optimizer=optimizer, optimizer_kw=optimizer_kw,
                         task=task, precision=precision, recompute=recompute).losses


def reference_run(plan, batches, *, seed: int = 0, lr: float = 1e-3, optimizer: str = "adam",
                  optimizer_kw: dict | None = None, task: str | None = None, precision: str | None = None,
                  recompute: str | None = None, init_loss_scale: float = 2.0 ** 16) -> ReferenceRun:
    """:func:`reference_losses` with the aux losses, the routing metrics and the trained model.

    Same arguments and errors as :func:`reference_losses`, and ``init_loss_scale``: ``16-mixed``'s
    first loss scale (the workers' ``WorkerConfig.init_loss_scale``); returns a :class:`ReferenceRun`.
    """
    if optimizer not in ("adam", "adama", "sgd"):
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of 'adam', 'adama', 'sgd'")
    mbs = plan.model.micro_batch_size
    dp = plan.parallel.dp
    # data micro-batches per replica: X's placement instance carries one through each model replica
    m = int(plan.schedule.num_micro_batches) * plan.schedule.placement.data_per_instance
    n = dp * m
    torch.manual_seed(seed)
    task_name = task or plan.model.task
    bundle = build_model(plan.model.name, batch_size=mbs, seq_len=plan.model.seq_len, device="cpu",
                         dtype=torch.float32, task=task_name)
    model = bundle.module.float().train()
    policy = get_policy(precision) if precision is not None else plan_policy(plan)
    if optimizer == "adama" and policy.name != "32-true":
        raise ValueError(f"optimizer 'adama' trains in 32-true only, not {policy.name!r}")
    cast_model(model, policy)
    mode = recompute if recompute is not None else (getattr(plan.parallel, "recompute", "none") or "none")
    apply_recompute(model, [str(x) for s in plan.segments for x in s.get("layers") or []], mode)
    apply_precision(model, policy, upcast=True)
    scaler = LossScaler("cpu", init_scale=init_loss_scale) if policy.loss_scaling else None
    with torch.random.fork_rng(devices=[]):   # a user task may draw at construction: keep the model's RNG stream
        the_task = task_for_plan(plan, task=task_name, module=bundle.module, config=bundle.config)
    k = the_task.num_inputs
    kw = dict(optimizer_kw or {})
    unfolded: list = []
    opt: torch.optim.Optimizer
    if optimizer == "adam":
        # fused as the runtime's Adam is (runtime.worker.optimizer.fused_adam): the same update arithmetic
        fused = fused_adam(plan.parallel.tp, getattr(plan.parallel, "dp_shard", 1))
        opt = torch.optim.Adam(model.parameters(), lr=lr, **{"fused": fused, **kw})
    elif optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, **kw)
    else:
        opt, unfolded = _adama(plan, model, seed=seed, lr=lr, kw=kw)
    is_moe = has_moe(model)
    run = ReferenceRun(model=model)
    for i, batch in enumerate(batches):
        try:
            full = as_batch_tuple(batch, num_inputs=k, rows_needed=n * mbs, seq_len=bundle.seq_len,
                                  dims=f"dp={dp}, m={m}, micro_batch_size={mbs}, seq_len={bundle.seq_len}")
        except WorkerError as e:
            raise ValueError(f"batch {i}: {e}") from e
        losses, auxes, metrics = [], [], []
        for j in range(n):
            rows = tuple(t[j * mbs:(j + 1) * mbs] for t in full)
            loss, aux = lm_objective(model, rows, the_task)
            objective = (loss if aux is None else loss + aux) / n
            (objective if scaler is None else scaler.scale(objective)).backward()
            losses.append(float(loss.detach()))
            if aux is not None:
                auxes.append(float(aux.detach()))
            if is_moe:
                metrics.append(moe_metrics(model))
        if unfolded:
            opt.fold(unfolded)  # type: ignore[attr-defined]  # AdamA: pipeline-tied parameters: the batch's summed gradient, once
        if scaler is not None:
            scaler.step(opt)
            run.loss_scale.append(scaler.get_scale())
            run.skipped = scaler.skipped
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        advance_gates(model)
        run.losses.append(losses)
        run.aux_losses.append(auxes)
        run.moe.append(_mean(metrics))
    return run


def _mean(metrics: list[dict]) -> dict:
    """Mean of per-micro-batch metric dicts (keys with a finite value in every dict)."""
    keys = ("temperature", "experts_per_token", "load_cv", "dropped_fraction", "balance_loss")
    return {k: sum(d[k] for d in metrics) / len(metrics) for k in keys
            if metrics and all(k in d and math.isfinite(d[k]) for d in metrics)}


def _adama(plan, model, *, seed: int, lr: float, kw: dict):
    """AdamA over ``model`` with the pipeline's folding split: ``(optimizer, unfolded params)``.

    The parameters that :func:`runtime.stages.tied_groups` reports as copies in two or more
    segments (matched by name; in the unsplit model the names are aliases of one parameter) go to
    a second param group without a fold hook; every other parameter folds in its own hook.
    """
    with torch.random.fork_rng(devices=[]):   # tied_groups builds (and seeds) its own copy
        tied_names = {name for group in tied_groups(plan, seed=seed) for _, name in group}
    aliases: dict[int, list[str]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
        params[id(p)] = p
    folded = [params[k] for k, names in aliases.items() if not tied_names.intersection(names)]
    unfolded = [params[k] for k, names in aliases.items() if tied_names.intersection(names)]
    groups = [{"params": ps} for ps in (folded, unfolded) if ps]
    opt = AdamA(groups, lr=lr, fold=False, **kw)
    for p in folded:
        p.register_post_accumulate_grad_hook(lambda q: opt.fold([q]))
    return opt, unfolded
