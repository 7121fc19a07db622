"""Forward-only evaluation of a stage worker (GPipe forward order over the pipeline ranks;
``docs/runtime-worker.md``, "Evaluation"). A segment on several devices (a tensor-parallel block)
runs on each of them; its first device sends its output to the next segment's devices outside
its set, as ``engine.dependency.lower`` does in training."""

from __future__ import annotations

from typing import Any, Callable

import torch

from runtime.worker.compute import loss_context, loss_value
from runtime.worker.context import LocalStages, RankCoords, Transport
from runtime.worker.dataflow import Dataflow

__all__ = ["evaluate_loss"]


def evaluate_loss(model_inputs: list[tuple[torch.Tensor, ...]], targets: list[tuple[torch.Tensor, ...]], *,
                  coords: RankCoords, flow: Dataflow, local: LocalStages, transport: Transport,
                  loss: Callable[..., torch.Tensor]) -> float:
    """Run every micro-batch through this rank's segments (receiving and sending boundary
    activations) and return the sum over micro-batches of the task's loss
    (``loss(output, *targets_j)``; 0 where this rank does not hold the last segment).
    ``coords``: this rank; ``flow``: the placement's DAG; ``local``: its segments; ``transport``:
    its buffers and point-to-point matching. Raises ``RuntimeError`` naming the rank, chained to
    the cause."""
    total = 0.0
    pending: list[tuple[Any, torch.Tensor]] = []
    devs = flow.seg_devices
    p2p, m = transport.p2p, flow.num_micro_batches
    try:
        for j in range(len(model_inputs)):
            outs_of: dict[int, tuple] = {}
            for s in flow.chains[0]:   # model replicas (X) are identical: evaluate the first
                if coords.pp_rank not in devs[s]:
                    continue
                outs = local.modules[s](*_stage_inputs(s, j, model_inputs, outs_of, coords=coords, flow=flow,
                                                       transport=transport))
                if s in flow.loss_segments:
                    with loss_context(s in local.loss_parallel):
                        total += loss_value(loss(outs[0], *targets[j]))
                    continue
                c = flow.succ[s]
                if coords.pp_rank == devs[s][0] and c is not None:   # the first device sends to the consumer's others
                    for d in devs[c]:
                        if d in devs[s]:
                            continue
                        dst = p2p.world(d)
                        for q, t in enumerate(outs):
                            t = t.contiguous()
                            pending.append((p2p.eval_send(t, dst, s, j % m, q), t))
                outs_of[s] = outs
            # wait this micro-batch's sends before the next one reuses the tags
            for wk, _ in pending:
                wk.wait(transport.timeout)
            pending.clear()
    except Exception as e:
        raise RuntimeError(f"{coords.where()} failed in evaluate: {type(e).__name__}: {e}") from e
    finally:
        for s in local.segments:   # routing of the last forward: not part of training
            for _, layer in local.moe_layers[s]:
                layer.last_aux_loss, layer.last_gate_output, layer.last_metrics = None, None, {}
        for layer in local.ep_layers:
            layer.comm_log.clear()
    return total


def _stage_inputs(s: int, j: int, model_inputs: list[tuple[torch.Tensor, ...]], outs_of: dict[int, tuple], *,
                  coords: RankCoords, flow: Dataflow, transport: Transport) -> tuple:
    """Segment ``s``'s inputs for micro-batch ``j``: the task's model inputs (those the plan gives it),
    or each producer's outputs (``flow.preds[s]``): local, or received into the buffers of slot
    ``j % m`` (fresh ones if none)."""
    if s in flow.input_segments:
        row = model_inputs[j]
        return tuple(row[k] for k in flow.seg_inputs[s]) if s in flow.seg_inputs else tuple(row)
    m = flow.num_micro_batches
    parts: list = []
    for p in flow.preds[s]:
        if coords.pp_rank in flow.seg_devices[p] and p in outs_of:
            parts.extend(outs_of[p])
            continue
        bufs = transport.buffers.act.get((p, j % m))
        if bufs is None:
            bufs = [transport.empty(meta) for meta in flow.boundaries[p]]
        src = transport.p2p.world(flow.seg_devices[p][0])
        for wk in transport.p2p.eval_recv(bufs, src, p, j % m):
            wk.wait(transport.timeout)
        parts.extend(bufs)
    return tuple(parts)
