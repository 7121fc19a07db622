"""Train a plan on Ray actors (one per rank; gloo on CPU, NCCL on GPUs) for some steps and
compare the measured step with the prediction: per-rank step time, loss, validation loss,
tokens/s, a measured Perfetto trace next to the predicted one, and atomic checkpoints that
``--resume`` continues from."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from apps.output import fmt_gib, fmt_ms, table

HELP = "train a plan on Ray actors and compare measured with predicted step times"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="path to plan.json (from `tessel plan` or `tessel search`)")
    p.add_argument("--steps", type=int, default=50,
                   help="total training steps; with --resume the checkpointed steps count (default 50)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--address", default=None, help="Ray cluster address (default: start a local cluster)")
    p.add_argument("--checkpoint-dir", default=None, help="checkpoint folder (default: ckpt/ next to the plan)")
    p.add_argument("--checkpoint-every", type=int, default=10, help="checkpoint every N steps; 0: only at the end (default 10)")
    p.add_argument("--eval-every", type=int, default=10, help="validation loss every N steps; 0: only at the end (default 10)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation seed (default 0)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--step-timeout", type=float, default=120.0,
                   help="seconds a rank may take for one step before the job counts as hung (default 120)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: NCCL on GPUs when the cluster has one per rank, else gloo on CPU (default auto)")
    p.add_argument("--optimizer", default=None, choices=("adam", "adama", "sgd"),
                   help="optimizer of the workers: adam, adama (AdamA: micro-batch gradients folded into "
                        "Adam's states and freed, less memory) or sgd (default: the plan's, adam)")
    p.add_argument("--trace", default=None, help="measured trace path (default: trace.measured.json next to the plan)")


def report(plan, res, *, plan_dir: Path, out=sys.stdout) -> dict:
    """Print the summary of a launch and return its JSON-able result.

    Args:
        plan: the launched ``engine.io.Plan``.
        res: the :class:`runtime.LaunchResult`.
        plan_dir: folder of the plan (where the predicted ``trace.json`` lives).
    """
    par = plan.parallel
    pp = res.pp
    say = lambda *a: print(*a, file=out)  # noqa: E731
    ran = len(res.losses)
    say(f"{plan.model.get('name')}: {res.world_size} ranks (dp={res.dp}, pp={pp}), schedule {plan.schedule.name}, "
        f"{par.get('micro_batches')} micro-batches of {plan.model.get('micro_batch_size')} x {plan.model.get('seq_len')} tokens, "
        f"{res.backend} on {'GPUs' if res.backend == 'nccl' else 'CPU'}; steps {res.start_step}..{res.steps - 1} "
        f"in {res.elapsed:.1f} s (setup {res.setup_time:.1f} s)")
    rows = []
    for r in range(pp):
        p_t, m_t = res.predicted_step_time[r], res.measured_step_time[r]
        ratio = f"{m_t / p_t:.2f}x" if p_t and not math.isnan(p_t) and p_t > 0 else "-"
        rows.append([f"rank {r}", fmt_ms(p_t), fmt_ms(m_t), ratio, fmt_ms(res.predicted_busy[r]),
                     fmt_ms(res.measured_busy[r]), fmt_gib(res.peak_memory[r]) if r < len(res.peak_memory) else "-"])
    say(table(["pipeline rank", "predicted step", "measured step", "measured/predicted", "predicted busy",
               "measured busy", "peak RSS"], rows))
    pred_tps = float(plan.metrics.get("tokens_per_second", 0.0) or 0.0)
    if ran:
        say(f"loss {res.losses[0]:.4f} (step {res.start_step}) -> {res.losses[-1]:.4f} (step {res.steps - 1})")
    if res.val_losses:
        say("validation loss " + ", ".join(f"{v:.4f} after {s} steps" for s, v in res.val_losses))
    say(f"{res.tokens_per_second:,.0f} tokens/s measured ({res.tokens_per_step:,} tokens per step), "
        f"{pred_tps:,.0f} tokens/s predicted; step makespan {fmt_ms(res.measured_makespan)} measured vs "
        f"{fmt_ms(res.predicted_makespan)} predicted")
    predicted_trace = plan_dir / "trace.json"
    traces = dict(res.trace_paths)
    if predicted_trace.is_file():
        traces.setdefault("predicted", str(predicted_trace))
    if traces:
        say("traces (open in ui.perfetto.dev): " + ", ".join(f"{k} {v}" for k, v in traces.items()))
    if res.checkpoint:
        say(f"checkpoint {res.checkpoint} (continue with --resume)")
    d = res.to_dict()
    d["trace_paths"] = traces
    d["predicted_tokens_per_second"] = pred_tps
    d["loss_start"] = res.losses[0] if ran else None
    d["loss_end"] = res.losses[-1] if ran else None
    d["val_loss"] = res.val_losses[-1][1] if res.val_losses else None
    return d


def run(args: argparse.Namespace) -> dict:
    from engine.io import load_plan
    from runtime import launch

    plan_path = Path(args.plan)
    plan = load_plan(plan_path)
    plan_dir = plan_path.parent
    ckdir = Path(args.checkpoint_dir) if args.checkpoint_dir else plan_dir / "ckpt"
    trace = Path(args.trace) if args.trace else plan_dir / "trace.measured.json"
    res = launch(plan, steps=args.steps, address=args.address, checkpoint_dir=ckdir,
                 checkpoint_every=args.checkpoint_every, eval_every=args.eval_every, resume=args.resume,
                 seed=args.seed, lr=args.lr, progress=not args.json or sys.stderr.isatty(),
                 step_timeout=args.step_timeout, trace_path=trace, device=args.device,
                 optimizer=args.optimizer)
    out = report(plan, res, plan_dir=plan_dir)
    out["plan"] = str(plan_path)
    return out
