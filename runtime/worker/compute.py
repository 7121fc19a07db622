"""The compute instructions of a stage worker: stage forward (``F``), full backward (``B``) and
the zero-bubble split backward (``I`` input gradients, ``W`` weight gradients), with the task's
loss (:attr:`ExecContext.loss <runtime.worker.context.ExecContext.loss>`: cross-entropy for the
language tasks), the MoE aux losses and activation accounting (``docs/runtime-worker.md``, "What a
rank does in a step"). Every function reads the rank's :class:`~runtime.worker.context.ExecContext`."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.tensor.parallel import loss_parallel

from runtime.fsdp import before_backward, reduce_gradients
from runtime.vocab_parallel_loss import VocabParallelCrossEntropy
from runtime.worker.context import ExecContext
from runtime.worker.metrics import metric_floats
from runtime.worker.step_state import StepState
from runtime.worker.weight_grad import backward_weight as backward_weight_pass

__all__ = ["backward", "backward_input", "backward_weight", "forward", "loss_context", "loss_value"]


def loss_context(vocab_sharded: bool) -> contextlib.AbstractContextManager:
    """For a segment whose LM head keeps its logits vocab-sharded (``vocab_sharded``, a segment of
    :attr:`LocalStages.loss_parallel <runtime.worker.context.LocalStages.loss_parallel>`): the task's
    cross-entropy and its backward run on the shards, all-reducing only the softmax statistics
    (:class:`runtime.vocab_parallel_loss.VocabParallelCrossEntropy`, Megatron's vocab-parallel loss,
    for plain ``F.cross_entropy``; ``torch.distributed.tensor.parallel.loss_parallel()`` for any
    other use of the sharded logits); a no-op context otherwise."""
    if not vocab_sharded:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(loss_parallel())
    stack.enter_context(VocabParallelCrossEntropy())
    return stack


def loss_value(loss: torch.Tensor) -> float:
    """A loss as a float; a loss-parallel loss is a replicated ``DTensor`` (its local value)."""
    to_local = getattr(loss, "to_local", None)
    return float((to_local() if to_local is not None else loss).detach())


def forward(ctx: ExecContext, s: int, j: int, st: StepState) -> None:
    """``F`` of segment ``s``, micro-batch ``j``: inputs are the model inputs (a segment no forward
    feeds: the task's input tensors of the micro-batch, in ``task.input_names`` order, or the ones
    the plan gives it, ``flow.seg_inputs``), else the outputs of its producers (``flow.preds[s]``, in
    order: the previous segment of a chain; K's loss block: both branches' ends), each from the
    receive buffers (producer elsewhere) or the producer's local detached outputs; keeps the
    context its backward needs and counts the saved activations."""
    flow = ctx.flow
    if s in flow.input_segments:
        row = st.model_inputs[flow.data_index(s, j)]
        ins: tuple = tuple(row[k] for k in flow.seg_inputs[s]) if s in flow.seg_inputs else tuple(row)
    else:
        parts: list = []
        for p in flow.preds[s]:
            src = ctx.transport.buffers.act.get((p, j))
            if src is None:                       # the producer ran on this rank
                src = st.outputs.pop((p, j))
            parts.extend(t.detach().requires_grad_(True) if meta.requires_grad else t.detach()
                         for t, meta in zip(src, flow.boundaries[p]))
        ins = tuple(parts)
    meter = ctx.meter
    if ctx.track_activations and s not in meter.per_segment:
        with meter.hooks():   # the step's first forward of this segment: count what it saves
            outs, loss, aux = _run_stage(ctx, s, j, ins, st)
        meter.add((s, j), segment=s)
    else:
        outs, loss, aux = _run_stage(ctx, s, j, ins, st)
        if ctx.track_activations:   # static shapes: every micro-batch saves what the first did
            meter.add((s, j), nbytes=meter.per_segment[s])
    if s not in flow.loss_segments:
        st.outputs[(s, j)] = outs
    st.ctx[(s, j)] = (ins, outs, loss, aux)


def _run_stage(ctx: ExecContext, s: int, j: int, ins: tuple, st: StepState) -> tuple[Any, Any, Any]:
    """Run segment ``s`` on micro-batch ``j``: ``(outputs, scaled task loss or None, scaled MoE aux
    loss or None)`` (the stage module runs its precision policy's autocast itself and a loss
    segment returns float32 logits, :func:`runtime.precision.apply_precision`; ``16-mixed`` also
    multiplies both losses by the loss scale, :meth:`WorkerOptimizer.scale_loss
    <runtime.worker.optimizer.WorkerOptimizer.scale_loss>`); a chain's last segment's loss is
    ``task.loss(outputs[0], *targets_d)`` for its data micro-batch ``d = flow.data_index(s, j)``
    (X: each model replica carries its own micro-batch); scale ``1/m`` (``1/(dp*m)`` with AdamA,
    whose folded gradients are the single-process ``grad(loss / (dp * m))``)."""
    outs = ctx.local.modules[s](*ins)
    aux = _collect_moe(ctx, s, j, st)
    if s not in ctx.flow.loss_segments:
        return outs, None, aux
    d = ctx.flow.data_index(s, j)
    with loss_context(s in ctx.local.loss_parallel):
        loss = ctx.loss(outs[0], *st.targets[d])
    st.losses[d] = loss_value(loss)
    return outs, ctx.opt.scale_loss(loss * ctx.loss_scale), aux


def _collect_moe(ctx: ExecContext, s: int, j: int, st: StepState) -> torch.Tensor | None:
    """After segment ``s``'s forward of micro-batch ``j``: the sum of its MoE layers' aux
    (load-balancing) losses times the loss scale (``None`` without MoE layers), and their
    routing metrics into ``st.moe``. Drops the layers' references to the routing tensors."""
    layers = ctx.local.moe_layers.get(s)
    if not layers:
        return None
    auxes = []
    for _, layer in layers:
        if layer.last_aux_loss is not None:
            auxes.append(layer.last_aux_loss)
        if layer.last_metrics:
            st.moe.append(metric_floats(layer.last_metrics))
        layer.last_aux_loss, layer.last_gate_output = None, None
    if not auxes:
        return None
    aux = torch.stack(auxes).sum()
    st.aux[(s, j)] = float(aux.detach())
    return ctx.opt.scale_loss(aux * ctx.loss_scale)


def _roots(ctx: ExecContext, s: int, j: int, st: StepState) -> tuple[list, list | None]:
    """(tensors, grad_tensors) the backward of (s, j) starts from."""
    flow = ctx.flow
    _ins, outs, loss, aux = st.ctx[(s, j)]
    if s in flow.loss_segments:
        return [loss if aux is None else loss + aux], None
    grads = ctx.transport.buffers.grad.get((s, j))
    if grads is None:                          # the consumer ran on this rank: its slice for s
        c = flow.succ[s]
        assert c is not None   # only loss segments have no consumer
        lo, hi = flow.grad_slices[c][s]
        grads = st.in_grads[(c, j)][lo:hi]
    tensors = [o for o, meta in zip(outs, flow.boundaries[s]) if meta.requires_grad]
    grads = list(grads)
    if aux is not None:   # the stage's MoE aux loss is a second root of its backward
        tensors.append(aux)
        grads.append(torch.ones_like(aux))
    return tensors, grads


def _diff_inputs(ctx: ExecContext, s: int, ins: tuple) -> list:
    if s in ctx.flow.input_segments:
        return []
    return [x for x, meta in zip(ins, ctx.flow.in_metas[s]) if meta.requires_grad]


def _fsdp_before(ctx: ExecContext, s: int, j: int, kind: str) -> bool:
    """An FSDP segment's flags before its backward block ``kind`` of micro-batch ``j``
    (:func:`runtime.fsdp.before_backward`); returns whether this block reduces its gradients."""
    local = ctx.local
    if s not in local.fsdp:
        return False
    reduce = (s, j, kind) in local.fsdp_reduce
    before_backward(local.modules[s], kind, reduce=reduce, reshard_after_forward=local.fsdp_reshard)
    return reduce


def backward(ctx: ExecContext, s: int, j: int, st: StepState) -> None:
    """``B``: ``torch.autograd.backward`` from the received (or local) output gradients (the
    scaled loss on the last segment); keeps the input gradients to send. An FSDP segment's block
    that reduces (:attr:`LocalStages.fsdp_reduce <runtime.worker.context.LocalStages.fsdp_reduce>`)
    reduce-scatters each unit's gradients in FSDP's hooks while it runs."""
    _fsdp_before(ctx, s, j, "B")
    tensors, grads = _roots(ctx, s, j, st)
    ins = st.ctx.pop((s, j))[0]
    with loss_context(s in ctx.local.loss_parallel):
        torch.autograd.backward(tensors, grads)
    ctx.meter.free((s, j))
    if s not in ctx.flow.input_segments:
        st.in_grads[(s, j)] = [x.grad if x.grad is not None else torch.zeros_like(x)
                               for x in _diff_inputs(ctx, s, ins)]


def backward_input(ctx: ExecContext, s: int, j: int, st: StepState) -> None:
    """``I``: input gradients only (``torch.distributed.pipelining``'s ``stage_backward_input``);
    a segment without differentiable inputs leaves the whole backward to its ``W``."""
    _fsdp_before(ctx, s, j, "I")
    tensors, grads = _roots(ctx, s, j, st)
    xs = _diff_inputs(ctx, s, st.ctx[(s, j)][0])
    if not xs:   # nothing to send (segment 0): W runs the whole backward
        st.wstate[(s, j)] = ("full", tensors, grads)
        return
    # stage_backward_input detaches its roots in place, which a view refuses ("Can't detach views
    # in-place": a stage output that is a view, e.g. of a passed-through input); a view's clone is
    # the same root for the backward
    tensors = [t.clone() if t._base is not None else t for t in tensors]
    with loss_context(s in ctx.local.loss_parallel):
        dinputs, groups = stage_backward_input(tensors, grads, xs, iter(ctx.local.compute_params(s)))
    st.wstate[(s, j)] = ("groups", groups)
    st.in_grads[(s, j)] = [g if g is not None else torch.zeros_like(x) for x, g in zip(xs, dinputs)]


def backward_weight(ctx: ExecContext, s: int, j: int, st: StepState) -> None:
    """``W``: weight gradients (on a segment with recomputation in one pass,
    :func:`runtime.worker.weight_grad.backward_weight`; else torch's ``stage_backward_weight``), or
    the full backward after a no-op ``I``;
    with AdamA the segment's folded parameters are folded explicitly (no hooks fire here); an FSDP
    segment's reducing ``W`` reduce-scatters the accumulated gradients afterwards
    (:func:`runtime.fsdp.reduce_gradients`)."""
    reduce = _fsdp_before(ctx, s, j, "W")
    state = st.wstate.pop((s, j))
    sharded = s in ctx.local.loss_parallel
    if state[0] == "full":
        with loss_context(sharded):
            torch.autograd.backward(state[1], state[2])
    else:
        with loss_context(sharded):
            if s in ctx.local.recompute:
                # one autograd pass over every parameter group (runtime.worker.weight_grad): torch's
                # per-group passes recompute a checkpointed segment once per group
                backward_weight_pass(iter(ctx.local.compute_params(s)), state[1])
            else:
                # torch's per-group passes: each runs only its group's nodes. One merged pass also
                # re-runs the nodes between two groups' intermediates (an MoE layer's all-to-alls).
                # retain_graph: groups can share graph nodes (T5's position bias feeds every block;
                # BERT's head); the graph is released when the context is dropped right below.
                stage_backward_weight(iter(ctx.local.compute_params(s)), state[1], retain_graph=True)
        if ctx.opt.adama:   # the weight pass assigns .grad without firing the fold hooks
            ctx.opt.fold(ctx.opt.folded[s])
    if reduce:
        reduce_gradients(ctx.local.modules[s])
    st.ctx.pop((s, j), None)
    ctx.meter.free((s, j))
