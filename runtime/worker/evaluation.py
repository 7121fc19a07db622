"""Forward-only evaluation of a stage worker (GPipe forward order over the pipeline ranks;
``docs/runtime-worker.md``, "Evaluation"). A segment on several devices (a tensor-parallel block)
runs on each of them; its first device sends its output to the next segment's devices outside
its set, as ``engine.dependency.lower`` does in training."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from runtime.worker.compute import loss_context, loss_value

if TYPE_CHECKING:
    from runtime.worker.stage_worker import StageWorker

__all__ = ["evaluate_loss"]


def evaluate_loss(w: StageWorker, model_inputs: list[tuple[torch.Tensor, ...]],
                  targets: list[tuple[torch.Tensor, ...]]) -> float:
    """Run every micro-batch through this rank's segments (receiving and sending boundary
    activations) and return the sum over micro-batches of the task's loss
    (``w.task.loss(output, *targets_j)``; 0 where this rank does not hold the last segment).
    Raises ``RuntimeError`` naming the rank, chained to the cause."""
    total = 0.0
    pending: list[tuple[Any, torch.Tensor]] = []
    devs = w.seg_devices
    try:
        for j in range(len(model_inputs)):
            outs_of: dict[int, tuple] = {}
            for s in w.chains[0]:   # model replicas (X) are identical: evaluate the first
                if w.pp_rank not in devs[s]:
                    continue
                outs = w.modules[s](*_stage_inputs(w, s, j, model_inputs, outs_of))
                if s in w.loss_segments:
                    with loss_context(w, s):
                        total += loss_value(w.task.loss(outs[0], *targets[j]))
                    continue
                c = w.succ[s]
                if w.pp_rank == devs[s][0] and c is not None:   # the first device sends to the consumer's others
                    for d in devs[c]:
                        if d in devs[s]:
                            continue
                        dst = w.p2p.world(d)
                        for q, t in enumerate(outs):
                            t = t.contiguous()
                            pending.append((w.p2p.eval_send(t, dst, s, j % w.m, q), t))
                outs_of[s] = outs
            # wait this micro-batch's sends before the next one reuses the tags
            for wk, _ in pending:
                wk.wait(w.timeout)
            pending.clear()
    except Exception as e:
        raise RuntimeError(f"rank {w.rank} (pipeline rank {w.pp_rank}, replica {w.dp_index}) "
                           f"failed in evaluate: {type(e).__name__}: {e}") from e
    finally:
        for s in w.segments:   # routing of the last forward: not part of training
            for _, layer in w.moe_layers[s]:
                layer.last_aux_loss, layer.last_gate_output, layer.last_metrics = None, None, {}
        for layer in w.ep_layers:
            layer.comm_log.clear()
    return total


def _stage_inputs(w: StageWorker, s: int, j: int, model_inputs: list[tuple[torch.Tensor, ...]],
                  outs_of: dict[int, tuple]) -> tuple:
    """Segment ``s``'s inputs for micro-batch ``j``: the task's model inputs (those the plan gives it),
    or each producer's outputs (``w.preds[s]``): local, or received into the buffers of slot
    ``j % m`` (fresh ones if none)."""
    if s in w.input_segments:
        row = model_inputs[j]
        return tuple(row[k] for k in w.seg_inputs[s]) if s in w.seg_inputs else tuple(row)
    parts: list = []
    for p in w.preds[s]:
        if w.pp_rank in w.seg_devices[p] and p in outs_of:
            parts.extend(outs_of[p])
            continue
        bufs = w.buffers.act.get((p, j % w.m))
        if bufs is None:
            bufs = [w._empty(meta) for meta in w.boundaries[p]]
        src = w.p2p.world(w.seg_devices[p][0])
        for wk in w.p2p.eval_recv(bufs, src, p, j % w.m):
            wk.wait(w.timeout)
        parts.extend(bufs)
    return tuple(parts)
