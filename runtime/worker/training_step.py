"""One training step of a stage worker: the loop over its instruction stream with error
wrapping, co-location hooks, memory sampling and the step result (``docs/runtime-worker.md``,
"What a rank does in a step", "Instrumentation", "Failure modes")."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.dependency import Op
from runtime.worker.errors import step_error
from runtime.worker.interpreter import execute
from runtime.worker.metrics import MemorySampler, mean_metrics
from runtime.worker.send_waiter import SendWaiter
from runtime.worker.step_state import StepState

if TYPE_CHECKING:
    from runtime.worker.stage_worker import StageWorker

__all__ = ["run_step"]

#: the ops after which parameter gradients can have grown
_GRAD_OPS = (Op.B, Op.I, Op.W, Op.ALLREDUCE)


def run_step(w: StageWorker, step: int, model_inputs: list[tuple[torch.Tensor, ...]],
             targets: list[tuple[torch.Tensor, ...]]) -> dict:
    """:meth:`StageWorker.step` after the batch was split: run the stream, wait the sends and
    all-reduces, and assemble the result. Raises :class:`~runtime.worker.errors.StepError`."""
    cfg = w.config
    fail_at = tuple(cfg.fail_at) if cfg.fail_at is not None else None
    if cfg.on_compute_start is not None:
        cfg.on_compute_start(step)
    st = StepState(model_inputs, targets)
    w.meter.reset()
    for layer in w.ep_layers:   # collectives outside a step (evaluate) are not events
        layer.comm_log.clear()
    st.start_clock()
    where = f"rank {w.rank} (pipeline rank {w.pp_rank}, replica {w.dp_index})"
    mem = MemorySampler(w.meter, w.device if w._cuda else None)
    w.opt.begin_replica_step(w.dp_index)   # AdamA replicas > 0 start m, v from zero
    w.grad_sync.begin_step()   # overlap-grad-sync: no bucket posted yet
    st.sends = SendWaiter(st.now, w.timeout, device=w.device if w._cuda else None)
    try:
        if cfg.prepost_receives:
            w.p2p.post_all(w.stream, st)
        for idx, ins in enumerate(w.stream):
            try:
                if fail_at is not None and (int(step), idx) == fail_at:
                    raise RuntimeError("deliberate failure requested by fail_at")
                w.grad_sync.before_instruction(idx, st)   # a segment's last backward arms its bucket hooks
                execute(w, ins, st)
                w.grad_sync.after_instruction(idx, st)
                if idx == w._sync_index and cfg.on_sync_start is not None:
                    cfg.on_sync_start(step)
            except Exception as e:
                raise step_error(f"{where} failed at step {step}, instruction {idx} ({ins}): "
                                 f"{type(e).__name__}: {e}", rank=w.rank, pp_rank=w.pp_rank,
                                 dp_index=w.dp_index, step=int(step), index=idx,
                                 instruction=f"{idx} ({ins})") from e
            mem.sample(st.now())
            if cfg.track_activations and ins.op in _GRAD_OPS:   # the ops that grow .grad
                mem.sample_grads(w._grad_bytes())
    except BaseException:
        st.sends.abandon()
        raise
    try:
        st.sends.close()
        w.grad_sync.finish(st)   # no-op after OPTIM (lower() always ends training with it)
    except Exception as e:
        raise step_error(f"{where} failed at step {step} waiting for its sends/all-reduces: "
                         f"{type(e).__name__}: {e}", rank=w.rank, pp_rank=w.pp_rank,
                         dp_index=w.dp_index, step=int(step), index=None, instruction=None) from e
    out = {
        "rank": w.rank, "pp_rank": w.pp_rank, "dp_index": w.dp_index, "step": int(step),
        "losses": [st.losses[j] for j in sorted(st.losses)] if w.has_loss else [],
        "loss_micro_batches": sorted(st.losses) if w.has_loss else [],
        "events": [e.to_dict() for e in st.events], "time": st.now(), "start": st.t0,
        "optimizer_state_bytes": w.opt.state_bytes(),
        **mem.result(),
    }
    if st.moe:
        out["aux_losses"] = [sum(st.aux[(s, j)] for s in w.segments if (s, j) in st.aux) for j in range(w.m)]
        out["moe"] = mean_metrics(st.moe)
    return out
