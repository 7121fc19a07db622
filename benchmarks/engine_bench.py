"""Engine benchmark: capture + plan time and peak RSS per model, and simulator speed.

Each model is planned in a fresh subprocess (so its peak RSS is its own) with
``tessel plan --json``; the simulation case lowers and simulates a 1F1B schedule on
64 devices x 256 micro-batches with a real cost model.

Targets (issue 2): GPT-3 175B capture under 30 s and 2 GiB RSS; the 64x256 simulation under 2 s.

Usage: ``python benchmarks/engine_bench.py [--json] [--models gpt2,gpt2-xl,gpt3-175b]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGETS = {"gpt3-175b": {"capture_s": 30.0, "rss_bytes": 2 * 2**30}, "simulate_64x256_s": 2.0}


def bench_plan(model: str, devices: int, micro_batches: int) -> dict:
    """Run ``tessel plan`` for one model in a subprocess; returns its JSON result plus wall time."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "apps.cli", "plan", "--model", model, "--devices", str(devices),
               "--micro-batches", str(micro_batches), "--schedule", "1f1b", "-o", out, "--json"]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"tessel plan --model {model} failed: {p.stderr.strip().splitlines()[-1:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    return {"model": model, "wall_s": wall, "capture_s": res["timings"]["capture"], "plan_s": res["elapsed"],
            "peak_rss_bytes": res["peak_rss"], "ops": res["ops"], "makespan_s": res["makespan"],
            "bubble_ratio": res["bubble_ratio"]}


def bench_simulation(devices: int = 64, micro_batches: int = 256) -> dict:
    """Lower + simulate 1F1B on ``devices`` x ``micro_batches`` with the H100 cost model."""
    from engine.baselines import build_schedule
    from engine.cost import CostModel
    from engine.dependency import lower
    from engine.placement import TensorSpec, pipeline_placement
    from engine.simulate import simulate

    act = TensorSpec((1, 2048, 12288), "bfloat16")
    pl = pipeline_placement(devices, forward=1e-3, backward=2e-3, activation_bytes=2**28,
                            outputs=[act] * devices, input_grads=[act] * devices)
    sched = build_schedule("1f1b", pl, micro_batches)
    cost = CostModel.for_device("h100")
    t0 = time.perf_counter()
    ex = lower(sched, dp=1)
    t1 = time.perf_counter()
    tl = simulate(ex, cost)
    t2 = time.perf_counter()
    return {"devices": devices, "micro_batches": micro_batches, "instructions": ex.num_instructions(),
            "lower_s": t1 - t0, "simulate_s": t2 - t1, "total_s": t2 - t0, "makespan_s": tl.makespan}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--models", default="gpt2,gpt2-xl,gpt3-175b")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=16)
    args = ap.parse_args(argv)

    plans = [bench_plan(m, args.devices, args.micro_batches) for m in args.models.split(",") if m]
    sim = bench_simulation()
    result = {"plans": plans, "simulation": sim, "targets": TARGETS}
    big = next((p for p in plans if p["model"] == "gpt3-175b"), None)
    if big:
        result["gpt3_175b_capture_ok"] = big["capture_s"] < TARGETS["gpt3-175b"]["capture_s"]
        result["gpt3_175b_rss_ok"] = big["peak_rss_bytes"] < TARGETS["gpt3-175b"]["rss_bytes"]
    result["simulation_ok"] = sim["total_s"] < TARGETS["simulate_64x256_s"]
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'model':<12} {'capture s':>10} {'plan s':>8} {'peak RSS MiB':>13} {'ops':>7} {'makespan ms':>12} "
          f"{'bubble':>7}")
    for p in plans:
        print(f"{p['model']:<12} {p['capture_s']:>10.2f} {p['plan_s']:>8.2f} {p['peak_rss_bytes'] / 2**20:>13,.0f} "
              f"{p['ops']:>7} {p['makespan_s'] * 1e3:>12.2f} {p['bubble_ratio']:>7.1%}")
    print(f"\nsimulation {sim['devices']} devices x {sim['micro_batches']} micro-batches: "
          f"{sim['instructions']:,} instructions, "
          f"lower {sim['lower_s']:.3f} s + simulate {sim['simulate_s']:.3f} s = {sim['total_s']:.3f} s "
          f"(target < {TARGETS['simulate_64x256_s']} s)")
    if big:
        print(f"gpt3-175b: capture {big['capture_s']:.1f} s (target < 30 s), "
              f"peak RSS {big['peak_rss_bytes'] / 2**30:.2f} GiB (target < 2 GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
