"""Tessel on model-aware placements against the predefined schedules on the same model's plain pipeline.

The yardstick (issue 16) is what a user would otherwise run: the same model cut into a plain
pipeline (the V placement) with GPipe, 1F1B, interleaved 1F1B or ZB-H1. Tessel searches the
placement the model suggests (``engine.plan.model_search.model_search_plan``): M for a large-vocabulary
language model (the embedding and the LM head vocab-parallel over all devices, a pipeline of
blocks between them), K for a two-tower model (each tower on half of the devices, the contrastive
head on all), and X and NN for comparison.

(a) ``predicted``: the H100 cost model on 4 and 8 devices. Models: ``llama-250k`` (a Llama with
mT5-base's width and 250k vocabulary; sequence 1024, micro-batch 1) and ``two-tower-base``
(BERT-base towers; sequence 256, micro-batch 8). Tessel searches the placement with the plain
backward and with the backward split into I and W (the better counts); the baselines are
simulated with the same cost model for the same data per step (X's instances carry two
micro-batches). Target: Tessel at least 1.3x faster than 1F1B on V.

(b) ``measured``: 2 CPU ranks (one core each), through the CLI as a user runs it::

    tessel search --model M --placement P --devices 2 --device-type cpu ... -o OUT/tessel
    tessel plan   --model M --schedule S --devices 2 --device-type cpu ... -o OUT/S
    tessel launch OUT/X/plan.json --steps N --calibrate --checkpoint-every 0 --eval-every 0 --json

for ``llama-32k-cpu`` (M; Llama-2's vocabulary on a 4-layer, 128-wide model) and ``two-tower-tiny``
(K). ``meas ms`` is the median step makespan of the second half of the steps, ``cal ms`` the
plan calibrated on the first half (``tessel launch --calibrate``). Targets: the Tessel plan no
slower than the best predefined schedule, its calibrated prediction within 15%.

Usage: ``python benchmarks/placement_bench.py [--json] [--part predicted|measured|both] [--devices 4,8]
[--micro-batches 8,16] [--shapes m,k,x,nn] [--steps 30] [--time-limit 20]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: (model, shape, micro-batch size, sequence length) of the predicted part
PREDICTED = (("llama-250k", "m", 1, 1024), ("llama-250k", "x", 1, 1024), ("llama-250k", "nn", 1, 1024),
             ("two-tower-base", "k", 8, 256))
#: (model, shape, micro-batch size, sequence length, micro-batches) of the measured part
MEASURED = (("llama-32k-cpu", "m", 4, 64, 4), ("two-tower-tiny", "k", 32, 64, 4))
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


# ----------------------------------------------------------------------------- (a) predicted
def predicted_case(model: str, shape: str, n: int, m: int, mbs: int, seq: int, time_limit: float) -> dict:
    """Tessel on ``shape`` (plain and split backward) against the V baselines of ``model``, simulated
    with the H100 cost model; one row (times in seconds)."""
    from engine.plan.compare import measure
    from engine.plan.model_search import model_search_plan

    best, sp_best, search_s = None, None, 0.0
    for split in (False, True):
        t0 = time.perf_counter()
        sp = model_search_plan(model, shape, n, m, micro_batch_size=mbs, seq_len=seq, device_type="h100",
                               split_backward=split, time_limit=time_limit)
        search_s += time.perf_counter() - t0
        mk = measure(sp.result.schedule, None, sp.cost).makespan
        if best is None or mk < best:
            best, sp_best = mk, sp
    assert sp_best is not None and best is not None
    base = {r.name.removesuffix(" (V)"): r.makespan for r in sp_best.v_baselines()}
    valid = {k: v for k, v in base.items() if v}
    name, fastest = min(valid.items(), key=lambda kv: kv[1])
    return {"model": model, "shape": shape.upper(), "devices": n, "micro_batches": m,
            "split_backward": sp_best.placement.split_backward, "tessel_s": best, "baselines_s": base,
            "best_baseline": name, "speedup_vs_1f1b": base["1f1b"] / best, "speedup_vs_best": fastest / best,
            "search_s": search_s}


def run_predicted(devices: list[int], micro_batches: list[int], shapes: set[str], time_limit: float) -> list[dict]:
    rows = []
    for model, shape, mbs, seq in PREDICTED:
        if shape not in shapes:
            continue
        for n in devices:
            for m in micro_batches:
                try:
                    rows.append(predicted_case(model, shape, n, m, mbs, seq, time_limit))
                except Exception as e:   # report it in the table, go on
                    rows.append({"model": model, "shape": shape.upper(), "devices": n, "micro_batches": m,
                                 "error_message": str(e)[-300:]})
    return rows


# ----------------------------------------------------------------------------- (b) measured
def _tessel(*args: str) -> dict:
    """Run ``tessel ARGS --json``; its JSON object (the last stdout line)."""
    cmd = [sys.executable, "-m", "apps.cli", *args, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])} exited {proc.returncode}: {proc.stderr.strip()[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _launch(plan: Path, steps: int) -> dict:
    res = _tessel("launch", str(plan), "--steps", str(steps), "--calibrate", "--checkpoint-every", "0",
                  "--eval-every", "0")
    cal = res.get("calibration") or {}
    losses = res.get("losses") or []
    return {"measured_s": cal.get("measured_makespan"), "calibrated_s": cal.get("predicted_makespan"),
            "error": cal.get("error"), "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None, "units_per_second": res.get("units_per_second"),
            "unit": res.get("unit")}


def measured_case(model: str, shape: str, mbs: int, seq: int, m: int, steps: int, out: Path) -> dict:
    """Search ``shape`` and plan the predefined schedules for ``model`` on 2 CPU ranks, launch each
    for ``steps`` steps with calibration; one case with a row per schedule."""
    common = ["--devices", "2", "--micro-batches", str(m), "--micro-batch-size", str(mbs), "--seq-len", str(seq),
              "--device-type", "cpu"]
    runs: dict[str, dict] = {}
    searched = _tessel("search", "--model", model, "--placement", shape, *common, "--time-limit", "10",
                       "-o", str(out / f"{model}-tessel"))
    runs["tessel"] = {"planned_s": searched["makespan"], **_launch(out / f"{model}-tessel" / "plan.json", steps)}
    for s in SCHEDULES:
        try:
            planned = _tessel("plan", "--model", model, "--schedule", s, *common, "-o", str(out / f"{model}-{s}"))
            runs[s] = {"planned_s": planned.get("makespan"), **_launch(out / f"{model}-{s}" / "plan.json", steps)}
        except RuntimeError as e:
            runs[s] = {"error_message": str(e)[-300:]}
    done = {k: v for k, v in runs.items() if k != "tessel" and v.get("measured_s")}
    best = min(done, key=lambda k: done[k]["measured_s"]) if done else None
    t = runs["tessel"]
    return {"model": model, "shape": shape.upper(), "micro_batches": m, "runs": runs, "best_baseline": best,
            "tessel_vs_best": (done[best]["measured_s"] / t["measured_s"]) if best and t.get("measured_s") else None,
            "tessel_error": t.get("error")}


def run_measured(steps: int, shapes: set[str], out: Path) -> list[dict]:
    rows = []
    for model, shape, mbs, seq, m in MEASURED:
        if shape in shapes:
            rows.append(measured_case(model, shape, mbs, seq, m, steps, out))
    return rows


# ----------------------------------------------------------------------------- output
def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:,.1f}"


def print_predicted(rows: list[dict]) -> None:
    print("(a) predicted, H100 cost model: Tessel on the model's placement vs the predefined schedules on its "
          "plain pipeline (V)")
    head = (f"{'model':<15} {'shape':<5} {'dev':>3} {'m':>3} {'tessel ms':>10} {'gpipe':>9} {'1f1b':>9} "
            f"{'interl.':>9} {'zb-h1':>9} {'x 1F1B':>7} {'x best':>7} {'search s':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error_message" in r:
            print(f"{r['model']:<15} {r['shape']:<5} {r['devices']:>3} {r['micro_batches']:>3} FAILED: "
                  f"{r['error_message']}")
            continue
        b = r["baselines_s"]
        print(f"{r['model']:<15} {r['shape']:<5} {r['devices']:>3} {r['micro_batches']:>3} "
              f"{_ms(r['tessel_s']):>10}{'*' if r['split_backward'] else ' '}"
              f"{_ms(b.get('gpipe')):>8} {_ms(b.get('1f1b')):>9} {_ms(b.get('interleaved')):>9} "
              f"{_ms(b.get('zb-h1')):>9} {r['speedup_vs_1f1b']:>6.2f}x {r['speedup_vs_best']:>6.2f}x "
              f"{r['search_s']:>8.1f}")
    print("(* Tessel's plan splits the backward into I and W)")


def print_measured(rows: list[dict]) -> None:
    print("(b) measured on 2 CPU ranks: median step of the second half (meas), the plan calibrated on the first half "
          "(cal), uncalibrated plan (plan)")
    head = (f"{'model':<15} {'schedule':<15} {'plan ms':>9} {'cal ms':>9} {'meas ms':>9} {'cal err':>8} "
            f"{'loss first -> last':>19}")
    print(head)
    print("-" * len(head))
    for c in rows:
        for name, r in c["runs"].items():
            label = f"{name} ({c['shape']})" if name == "tessel" else f"{name} (V)"
            if "error_message" in r:
                print(f"{c['model']:<15} {label:<15} FAILED: {r['error_message']}")
                continue
            err = f"{r['error']:+.1%}" if r.get("error") is not None else "-"
            loss = (f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}" if r.get("loss_first") is not None else "-")
            print(f"{c['model']:<15} {label:<15} {_ms(r.get('planned_s')):>9} {_ms(r.get('calibrated_s')):>9} "
                  f"{_ms(r.get('measured_s')):>9} {err:>8} {loss:>19}")
        ratio = f"{c['tessel_vs_best']:.2f}x" if c["tessel_vs_best"] else "-"
        print(f"  -> Tessel {c['shape']} vs the best predefined schedule ({c['best_baseline']}): {ratio} "
              "(>= 1 is no slower)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--part", choices=("predicted", "measured", "both"), default="both")
    ap.add_argument("--devices", default="4,8", help="devices of the predicted part (default 4,8)")
    ap.add_argument("--micro-batches", default="8,16", help="micro-batches of the predicted part (default 8,16)")
    ap.add_argument("--shapes", default="m,k,x,nn", help="placements to run (default m,k,x,nn; measured: m,k)")
    ap.add_argument("--steps", type=int, default=40, help="training steps per measured launch (default 40)")
    ap.add_argument("--time-limit", type=float, default=20.0, help="Tessel search time limit, s (default 20)")
    args = ap.parse_args(argv)
    shapes = set(args.shapes.split(","))
    result: dict = {}
    if args.part in ("predicted", "both"):
        result["predicted"] = run_predicted([int(x) for x in args.devices.split(",")],
                                            [int(x) for x in args.micro_batches.split(",")], shapes, args.time_limit)
    if args.part in ("measured", "both"):
        with tempfile.TemporaryDirectory(prefix="tessel-placement-") as tmp:
            result["measured"] = run_measured(args.steps, shapes, Path(tmp))
    if args.json:
        print(json.dumps(result))
        return 0
    if "predicted" in result:
        print_predicted(result["predicted"])
    if "measured" in result:
        if "predicted" in result:
            print()
        print_measured(result["measured"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
