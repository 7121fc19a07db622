"""``tessel tune`` on the published Megatron-LM runs (Narayanan et al., SC'21, Table 1).

For each of the three rows of :mod:`benchmarks.published_runs` (GPT, vocabulary 51,200, sequence
2,048, A100 80 GB, fp16 mixed precision, the row's GPUs and global batch) the tuner runs twice
through the CLI (``tessel tune --model-config ... --json``):

- **paper knobs**: the knobs the paper fixed for all its runs (full recomputation, micro-batch
  size 1, the 1F1B schedule, no CoCoNet transformation) and the degrees (tp, pp, dp) searched. The
  tuner's best must be predicted at least as fast as the published configuration and the
  published configuration within 10% of it (issue 34);
- **full space**: every knob of ``tessel tune``'s default space (micro-batch sizes 1 and 2 here,
  to keep the captures within the time limit), with a time limit of 110 s.

The published configuration's prediction is ``tessel plan`` with its knobs (the same numbers as
``benchmarks/published_runs.py``). Printed: the tuner's best and its step time, the published
configuration's, their ratio, the candidates per status and the tuner's wall time (target: the
1,536-GPU row under 120 s).

Usage: ``python benchmarks/tune_bench.py [--json] [--runs 1.7B,18.4B,145.6B] [--spaces paper,full]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from published_runs import RUNS, SEQ_LEN, PublishedRun, plan_command, run_cli, write_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: Each space's ``tessel tune`` flags (after the common ones).
SPACES = {
    "paper": ["--micro-batch-sizes", "1", "--schedules", "1f1b", "--recompute", "full", "--no-sharded-update",
              "--no-sequence-parallel", "--no-overlap-grad-sync", "--no-fully-sharded"],
    "full": ["--micro-batch-sizes", "1,2", "--time-limit", "110"],
}
#: Targets: the published configuration within this fraction of the tuner's best (paper knobs);
#: the tuner's wall time of the 1,536-GPU row (seconds).
WITHIN = 0.10
WALL_SECONDS = 120.0


def tune_one(run: PublishedRun, space: str, folder: Path) -> dict:
    """Tune one row in one space; the published configuration planned beside it."""
    config = write_config(run, folder / "model")
    cmd = [sys.executable, "-m", "apps.cli", "tune", "--model-config", str(config), "--gpus", str(run.gpus),
           "--gpus-per-node", "8", "--device-type", "a100", "--global-batch", str(run.batch), "--seq-len",
           str(SEQ_LEN), "--precision", "16-mixed", *SPACES[space], "-o", str(folder / f"tune-{space}"), "--json"]
    tuned, wall = run_cli(cmd, 1800.0)
    published, _ = run_cli(plan_command(run, config, folder / "published"), 1800.0)
    best = tuned["best"]
    ratio = published["makespan"] / best["step_time"]
    return {"run": run.name, "space": space, "gpus": run.gpus, "best": best["label"],
            "best_seconds": best["step_time"], "best_mfu": best["mfu"], "best_peak_gib": best["peak_memory"] / 2**30,
            "published": f"tp{run.tp} pp{run.pp} dp{run.dp} mbs1x{run.micro_batches} 1f1b rc=full",
            "published_seconds": published["makespan"], "published_over_best": ratio,
            "counts": tuned["counts"], "timed_out": tuned["timed_out"], "tuner_seconds": tuned["wall_time"],
            "command_seconds": wall, "runner_up": tuned["runner_up"],
            "targets": {"best_at_least_as_fast": ratio >= 1 - 1e-9,
                        "published_within_10pct": ratio <= 1 + WITHIN if space == "paper" else None,
                        "under_120s": tuned["wall_time"] < WALL_SECONDS if run.gpus >= 1536 else None}}


def report(rows: list[dict]) -> str:
    """The table of results."""
    head = (f"{'run':>7} {'space':>5} {'GPUs':>5}  {'tuner best':<52} {'s/step':>7} {'MFU':>6}  "
            f"{'published s':>11} {'pub/best':>8} {'tuner s':>8}  candidates")
    lines = [head, "-" * len(head)]
    for r in rows:
        c = r["counts"]
        lines.append(f"{r['run']:>7} {r['space']:>5} {r['gpus']:>5}  {r['best']:<52} {r['best_seconds']:7.3f} "
                     f"{(r['best_mfu'] or 0):6.1%}  {r['published_seconds']:11.3f} {r['published_over_best']:8.3f} "
                     f"{r['tuner_seconds']:8.1f}  {sum(c.values())} ({c['ok']} fit, {c['dominated']} dominated, "
                     f"{c['not visited']} not visited)")
    lines.append("published: Narayanan et al. (SC'21) Table 1 configurations, predicted by tessel plan; targets: "
                 f"best at least as fast; published within {WITHIN:.0%} of the best with the paper's knobs; "
                 f"1,536 GPUs tuned in under {WALL_SECONDS:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--runs", default=",".join(r.name for r in RUNS), help="rows to tune (default all three)")
    ap.add_argument("--spaces", default="paper,full", help="paper, full or both (default both)")
    args = ap.parse_args(argv)
    names = [x.strip() for x in args.runs.split(",") if x.strip()]
    runs = [r for r in RUNS if r.name in names]
    if len(runs) != len(names):
        ap.error(f"unknown run in {args.runs!r}; runs are {', '.join(r.name for r in RUNS)}")
    spaces = [x.strip() for x in args.spaces.split(",") if x.strip()]
    if any(s not in SPACES for s in spaces):
        ap.error(f"unknown space in {args.spaces!r}; spaces are {', '.join(SPACES)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            for space in spaces:
                rows.append(tune_one(run, space, Path(tmp) / f"{run.name}-{space}"))
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
