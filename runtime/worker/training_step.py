"""One training step of a stage worker: the loop over its instruction stream with error
wrapping, co-location hooks, memory sampling and the step result (``docs/runtime-worker.md``,
"What a rank does in a step", "Instrumentation", "Failure modes")."""

from __future__ import annotations

from typing import Sequence

import torch

from engine.dependency import Instruction, Op
from runtime.worker.config import WorkerConfig
from runtime.worker.context import ExecContext
from runtime.worker.errors import describe_exception, step_error
from runtime.worker.interpreter import execute
from runtime.worker.metrics import MemorySampler, mean_metrics
from runtime.worker.send_waiter import SendWaiter
from runtime.worker.step_state import StepState

__all__ = ["run_step"]

#: the ops after which parameter gradients can have grown
_GRAD_OPS = (Op.B, Op.I, Op.W, Op.ALLREDUCE)


def run_step(ctx: ExecContext, stream: Sequence[Instruction], step: int, model_inputs: list[tuple[torch.Tensor, ...]],
             targets: list[tuple[torch.Tensor, ...]], *, config: WorkerConfig, sync_index: int) -> dict:
    """:meth:`StageWorker.step` after the batch was split: run ``stream`` (this rank's instructions),
    wait the sends and all-reduces, and assemble the result. ``config``: the worker's options (hooks,
    ``fail_at``, ``prepost_receives``, ``track_activations``); ``sync_index``: the instruction after
    which ``on_sync_start`` fires. Raises :class:`~runtime.worker.errors.StepError`."""
    cfg = config
    coords, tr = ctx.coords, ctx.transport
    fail_at = tuple(cfg.fail_at) if cfg.fail_at is not None else None
    if cfg.on_compute_start is not None:
        cfg.on_compute_start(step)
    st = StepState(model_inputs, targets)
    ctx.meter.reset()
    for layer in ctx.local.ep_layers:   # collectives outside a step (evaluate) are not events
        layer.comm_log.clear()
    st.start_clock()
    where = coords.where()
    mem = MemorySampler(ctx.meter, tr.device if tr.cuda else None)
    ctx.opt.begin_replica_step(coords.dp_index)   # AdamA replicas > 0 start m, v from zero
    ctx.grad_sync.begin_step()   # overlap-grad-sync: no bucket posted yet
    st.sends = SendWaiter(st.now, tr.timeout, device=tr.device if tr.cuda else None)
    try:
        if cfg.prepost_receives:
            tr.p2p.post_all(stream, st)
        for idx, ins in enumerate(stream):
            try:
                if fail_at is not None and (int(step), idx) == fail_at:
                    raise RuntimeError("deliberate failure requested by fail_at")
                ctx.grad_sync.before_instruction(idx, st)   # a segment's last backward arms its bucket hooks
                execute(ctx, ins, st)
                ctx.grad_sync.after_instruction(idx, st)
                if idx == sync_index and cfg.on_sync_start is not None:
                    cfg.on_sync_start(step)
            except Exception as e:
                raise step_error(f"{where} failed at step {step}, instruction {idx} ({ins}): "
                                 f"{describe_exception(e)}", rank=coords.rank, pp_rank=coords.pp_rank,
                                 dp_index=coords.dp_index, step=int(step), index=idx,
                                 instruction=f"{idx} ({ins})") from e
            mem.sample(st.now())
            if cfg.track_activations and ins.op in _GRAD_OPS:   # the ops that grow .grad
                mem.sample_grads(ctx.local.grad_bytes())
    except BaseException:
        st.sends.abandon()
        raise
    try:
        st.sends.close()
        ctx.grad_sync.finish(st)   # no-op after OPTIM (lower() always ends training with it)
    except Exception as e:
        raise step_error(f"{where} failed at step {step} waiting for its sends/all-reduces: "
                         f"{describe_exception(e)}", rank=coords.rank, pp_rank=coords.pp_rank,
                         dp_index=coords.dp_index, step=int(step), index=None, instruction=None) from e
    out = {
        "rank": coords.rank, "pp_rank": coords.pp_rank, "dp_index": coords.dp_index, "step": int(step),
        "losses": [st.losses[j] for j in sorted(st.losses)] if ctx.has_loss else [],
        "loss_micro_batches": sorted(st.losses) if ctx.has_loss else [],
        "events": [e.to_dict() for e in st.events], "time": st.now(), "start": st.t0,
        "optimizer_state_bytes": ctx.opt.state_bytes(),
        **mem.result(),
    }
    if st.moe:
        out["aux_losses"] = [sum(st.aux[(s, j)] for s in ctx.local.segments if (s, j) in st.aux)
                             for j in range(ctx.flow.num_micro_batches)]
        out["moe"] = mean_metrics(st.moe)
    return out
