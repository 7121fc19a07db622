"""The whole loop on this machine: plan a small GPT-2 on 4 pipeline ranks (1F1B, CPU costs
measured by profiling its ops here with one thread, as each rank runs), write out/demo/, train it
on 4 Ray actors with gloo, and compare the measured step with the prediction. The prediction
assumes one core per rank; on a machine with fewer cores than ranks the measured step is longer
by about ranks / cores."""

from __future__ import annotations

import argparse
import sys
import time

from apps.arg_types import positive_float, positive_int
from apps.cmd_launch import calibrate_plan, report
from apps.cmd_plan import OUTPUT_FILES, plan_files
from engine.io.atomic import atomic_write_files, check_output_folder

HELP = "plan a small GPT-2 on 4 CPU pipeline ranks, train it on Ray, compare with the prediction"

#: The demo's plan: model (falls back to gpt2-tiny when gpt2-small-cpu is not registered),
#: 4 pipeline ranks, 1F1B, 8 micro-batches of 2 x 64 tokens, CPU cost table with profiled ops.
DEMO = {"devices": 4, "schedule": "1f1b", "micro_batches": 8, "micro_batch_size": 2, "seq_len": 64}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=positive_int, default=30, help="training steps (default 30)")
    p.add_argument("--model", default=None, help="model (default gpt2-small-cpu, else gpt2-tiny)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: start a local cluster)")
    p.add_argument("--step-timeout", type=positive_float, default=120.0,
                   help="seconds per step before the job counts as hung")
    p.add_argument("-o", "--output", default="out/demo", help="output folder (default out/demo/)")


def demo_model() -> str:
    """``gpt2-small-cpu`` when registered, else ``gpt2-tiny``."""
    from engine.models import list_models

    return "gpt2-small-cpu" if "gpt2-small-cpu" in list_models() else "gpt2-tiny"


def run(args: argparse.Namespace) -> dict:
    from apps.launch_progress import TqdmProgress
    from engine.plan.make import make_plan
    from runtime import launch
    from runtime.config import LaunchConfig

    model = args.model or demo_model()
    out = check_output_folder(args.output, OUTPUT_FILES)
    t0 = time.perf_counter()
    print(f"[tessel] planning {model} on {DEMO['devices']} CPU pipeline ranks ({DEMO['schedule']}, profiling ops) ...",
          file=sys.stderr, flush=True)
    # the profiler times ops with one intra-op thread, as every rank runs (runtime.worker)
    res = make_plan(model, device_type="cpu", profile=True, **DEMO)
    written = atomic_write_files(out, plan_files(res))
    plan_path, trace_path, csv_path = (written[n] for n in OUTPUT_FILES)
    plan_time = time.perf_counter() - t0
    print(f"planned in {plan_time:.1f} s: wrote {plan_path}, {trace_path}, {csv_path}")
    for w in res.warnings:
        print(f"warning: {w}", file=sys.stderr)
    config = LaunchConfig(steps=args.steps, address=args.address, checkpoint_dir=out / "ckpt",
                          checkpoint_every=max(args.steps // 3, 1), eval_every=max(args.steps // 3, 1),
                          step_timeout=args.step_timeout, trace_path=out / "trace.measured.json", device="cpu",
                          keep_timelines=min(args.steps, 64))
    lr = launch(res.plan, config, callbacks=[TqdmProgress()] if not args.json or sys.stderr.isatty() else [])
    result = report(res.plan, lr, plan_dir=out)
    if len(lr.timelines) > 1:   # profile-guided prediction: the real costs of this machine
        result["calibration"] = calibrate_plan(res.plan, lr, out / "plan.calibrated.json")
    result.update({"model": model, "plan": str(plan_path), "csv": str(csv_path), "plan_time": plan_time})
    return result
