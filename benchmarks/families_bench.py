"""Model families through the CLI: plan, train 30 steps on Ray, calibrate, predicted vs measured.

For every model x schedule it runs what a user runs, as subprocesses:

    tessel plan --model M --devices 2 --schedule S --device-type cpu --micro-batches 4
                --micro-batch-size MBS --seq-len T -o OUT/M-S --json
    tessel launch OUT/M-S/plan.json --steps 30 --calibrate --checkpoint-every 0 --eval-every 0 --json

and prints one row per run: the task and its unit, the stage split the plan chose (``tracer`` /
``module``), the loss of the first and the last step, throughput in the task's unit (tokens/s or
samples/s, first step left out), and the step time predicted by the plan calibrated on the first
half of the measured steps against the median of the second half (``tessel launch --calibrate``).

Two pipeline ranks (one core each on a 2-core machine). Models: llama-tiny, mixtral-tiny,
bert-tiny, t5-tiny (their tasks: causal LM, causal LM, masked LM, span-corruption seq2seq, all on
the CPython sources' bytes) and cnn-digits (image classification on scikit-learn's load_digits).

Usage: ``python benchmarks/families_bench.py [--json] [--steps 30] [--models a,b] [--schedules 1f1b,zb-h1]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("llama-tiny", "mixtral-tiny", "bert-tiny", "t5-tiny", "cnn-digits")
SCHEDULES = ("1f1b", "zb-h1")


def _tessel(*args: str) -> dict:
    """Run ``tessel ARGS --json`` and return its JSON object (the last stdout line)."""
    exe = Path(sys.executable).with_name("tessel")
    cmd = [str(exe) if exe.exists() else "tessel", *args, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_one(model: str, schedule: str, steps: int, out: Path, mbs: int, seq: int) -> dict:
    """Plan and launch one model x schedule; one result row."""
    folder = out / f"{model}-{schedule}"
    plan_args = ["plan", "--model", model, "--devices", "2", "--schedule", schedule, "--device-type", "cpu",
                 "--micro-batches", "4", "--micro-batch-size", str(mbs), "-o", str(folder)]
    if model != "cnn-digits":
        plan_args += ["--seq-len", str(seq)]
    planned = _tessel(*plan_args)
    res = _tessel("launch", str(folder / "plan.json"), "--steps", str(steps), "--calibrate",
                  "--checkpoint-every", "0", "--eval-every", "0")
    plan = json.loads((folder / "plan.json").read_text())
    cal = res.get("calibration") or {}
    losses = res.get("losses") or []
    unit = res.get("unit", "tokens")
    return {
        "model": model, "schedule": schedule, "task": plan["model"].get("task"), "split": plan["model"].get("split"),
        "unit": unit, "first_loss": losses[0] if losses else None, "loss": losses[-1] if losses else None,
        "units_per_second": res.get("units_per_second", res.get("tokens_per_second")),
        "predicted_step_s": cal.get("predicted_makespan"), "measured_step_s": cal.get("measured_makespan"),
        "error": cal.get("error"), "planned_step_s": (planned.get("metrics") or {}).get("makespan"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tessel-families-") as tmp:
        for model in args.models.split(","):
            for schedule in args.schedules.split(","):
                try:
                    rows.append(run_one(model, schedule, args.steps, Path(tmp), args.micro_batch_size, args.seq_len))
                except Exception as e:  # report the failure in the table, go on with the others
                    rows.append({"model": model, "schedule": schedule, "error_message": str(e)[-400:]})
    if args.json:
        print(json.dumps({"steps": args.steps, "rows": rows}))
        return 0
    head = (f"{'model':<13} {'schedule':<7} {'task':<21} {'split':<7} {'loss 1 -> last':>15} "
            f"{'throughput':>18} {'pred ms':>8} {'meas ms':>8} {'err':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error_message" in r:
            print(f"{r['model']:<13} {r['schedule']:<7} FAILED: {r['error_message']}")
            continue
        thr = f"{r['units_per_second']:.0f} {r['unit']}/s" if r["units_per_second"] else "-"
        pm = f"{r['predicted_step_s'] * 1e3:.1f}" if r["predicted_step_s"] else "-"
        mm = f"{r['measured_step_s'] * 1e3:.1f}" if r["measured_step_s"] else "-"
        err = f"{r['error']:+.1%}" if r["error"] is not None else "-"
        print(f"{r['model']:<13} {r['schedule']:<7} {r['task'] or '-':<21} {r['split'] or '-':<7} "
              f"{r['first_loss']:>6.3f} -> {r['loss']:<6.3f} {thr:>18} {pm:>8} {mm:>8} {err:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
