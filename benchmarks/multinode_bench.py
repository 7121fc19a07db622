"""Predicted against measured step time on a two-node Ray cluster (issue 32).

The cluster is :mod:`benchmarks.emulated_cluster`'s: two network namespaces on this machine, a
veth pair between them shaped to the inter-node rate (1 and 10 Gbit/s here), each node's loopback
unshaped, ``ray start`` in each. For each rate and plan:

- **dp 2**: one replica per node (``--devices-per-node 1``): the gradient all-reduce crosses the link;
- **pp 2**: one stage per node: the activations and their gradients cross the link;
- **tp 2 within, pp 2 across**: two nodes of two devices; each tensor group inside a node, the
  pipeline's sends across (four ranks share this machine's two cores: the calibration
  de-contends them, :mod:`engine.plan.core_sharing`).

Each plan is made with the link's rate as its inter-node link (``tessel plan --inter-link RATE
--devices-per-node N``) and launched from the head node (``tessel launch --address``) for
``--steps`` steps. Printed: the plan's prediction, the calibrated prediction (the first half of
the measured steps calibrates, the second half is compared: ``engine.plan.calibrate_plan``), the
measured median step and the calibrated error (target: within 15%).

Usage: ``python benchmarks/multinode_bench.py [--json] [--rates 1gbit,10gbit] [--plans dp2,pp2,tp2pp2]
[--steps 8] [--model llama-tiny]``. Needs root (network namespaces); otherwise it says why and
exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from emulated_cluster import emulated_cluster, run_on_node  # noqa: E402
from emulated_network import NetworkEmulationUnavailable, unavailable_reason  # noqa: E402

#: plan name -> (dp, tp, devices, devices per node, Ray CPUs per node)
PLANS = {"dp2": (2, 1, 2, 1), "pp2": (1, 1, 2, 1), "tp2pp2": (1, 2, 4, 2)}
WITHIN = 0.15
M, MBS, SEQ = 4, 2, 64


def _make(model: str, name: str, rate: str, folder: Path) -> Path:
    from engine.io import save_plan
    from engine.plan import make_plan

    dp, tp, devices, per_node = PLANS[name]
    res = make_plan(model, devices=devices, dp=dp, tp=tp, micro_batches=M, micro_batch_size=MBS, seq_len=SEQ,
                    device_type="cpu", profile=True, inter_link=rate, devices_per_node=per_node)
    path = folder / f"{name}-{rate}" / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_plan(res.plan, path)
    return path


def measure_here(plan_path: str, address: str, steps: int) -> dict:
    """Inside the head node's namespace: launch the plan on the cluster and calibrate it from the
    measured steps (the first one left out); the figures of the table."""
    import math

    from engine.io import load_plan
    from engine.plan.calibrate import calibrate_plan
    from runtime import launch
    from runtime.config import LaunchConfig

    plan = load_plan(plan_path)
    res = launch(plan, LaunchConfig(steps=steps, device="cpu", address=address, keep_timelines=steps,
                                    step_timeout=300, eval_every=0, checkpoint_every=0))
    tls = res.timelines[1:]
    cores = os.cpu_count() or 1
    check = calibrate_plan(plan, tls, shared_cores=cores if plan.parallel.devices > cores else None)
    return {"predicted": res.predicted_makespan, "calibrated": check.predicted_makespan,
            "measured": check.measured_makespan, "error": check.error, "held_out": check.held_out,
            "rank_nodes": res.rank_nodes, "loss": [res.losses[0], res.losses[-1]],
            "nan": math.isnan(check.error)}


def run(model: str, rates: list[str], plans: list[str], steps: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for rate in rates:
            cpus = max(PLANS[p][3] for p in plans)
            with emulated_cluster(rate, cpus_per_node=cpus) as cluster:
                for name in plans:
                    path = _make(model, name, rate, folder)
                    p = run_on_node(cluster, 0, [sys.executable, __file__, "--measure", str(path), cluster.ray,
                                                 str(steps)], timeout=900, capture_output=True, text=True, cwd=ROOT)
                    if p.returncode != 0:
                        raise RuntimeError(f"{name} at {rate}: {p.stderr.strip()[-1500:]}")
                    got = json.loads(p.stdout.strip().splitlines()[-1])
                    rows.append({"plan": name, "rate": rate, **got,
                                 "within_15pct": abs(got["error"]) <= WITHIN})
                    print(f"[multinode_bench] {name} at {rate}: calibrated {got['calibrated'] * 1e3:.1f} ms, "
                          f"measured {got['measured'] * 1e3:.1f} ms ({got['error']:+.1%})", file=sys.stderr, flush=True)
    return rows


def report(rows: list[dict]) -> str:
    head = (f"{'plan':<8} {'link':>7} {'predicted ms':>12} {'calibrated ms':>13} {'measured ms':>11} "
            f"{'error':>7}  ranks by node")
    lines = [head, "-" * len(head)]
    for r in rows:
        nodes = ", ".join(f"r{x['rank']}->n{x['node']}" for x in r["rank_nodes"])
        lines.append(f"{r['plan']:<8} {r['rate']:>7} {r['predicted'] * 1e3:12.1f} {r['calibrated'] * 1e3:13.1f} "
                     f"{r['measured'] * 1e3:11.1f} {r['error']:+7.1%}  {nodes}")
    lines.append(f"target: calibrated within {WITHIN:.0%} of the measured median step (held-out steps); two Ray "
                 "nodes in network namespaces joined by a tc-tbf-shaped veth pair (benchmarks/emulated_cluster.py)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--measure"]:   # the child inside the head node's namespace
        print(json.dumps(measure_here(argv[1], argv[2], int(argv[3]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--rates", default="1gbit,10gbit", help="inter-node link rates (default 1gbit,10gbit)")
    ap.add_argument("--plans", default=",".join(PLANS), help=f"plans (default {','.join(PLANS)})")
    ap.add_argument("--steps", type=int, default=8, help="steps per launch (default 8)")
    ap.add_argument("--model", default="llama-tiny", help="model (default llama-tiny)")
    args = ap.parse_args(argv)
    plans = [p for p in args.plans.split(",") if p]
    bad = [p for p in plans if p not in PLANS]
    if bad:
        ap.error(f"unknown plan(s) {bad}; choose from {', '.join(PLANS)}")
    why = unavailable_reason()
    if why is not None:
        print(f"multinode_bench: {why}", file=sys.stderr)
        return 2
    try:
        rows = run(args.model, [r for r in args.rates.split(",") if r], plans, args.steps)
    except NetworkEmulationUnavailable as e:
        print(f"multinode_bench: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"rows": rows}) if args.json else report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
