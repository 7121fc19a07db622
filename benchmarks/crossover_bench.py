"""CrossoverScheduler benchmark: data-parallel jobs co-located on the same Ray actors, on this
machine's loopback and on an emulated cluster network.

Two or three identical jobs (by default ``gpt2-small-cpu``, ~4.9M parameters = 19.5 MB of float32
gradients, micro-batch 4 x 64 tokens) train on the same 2 actors in each mode of
:func:`runtime.crossover.launch_crossover`:

- ``sequential``: the jobs' steps one job after the other (the baseline);
- ``uncoordinated``: all jobs free-running on the same actors (no token);
- ``crossover``: the per-device compute token passed at the gradient all-reduce.

Links (``--links``): ``unshaped`` is this machine's loopback, where gloo's all-reduce is CPU work
(no wire to wait on, so there is little for another job to fill); ``1gbit`` / ``10gbit`` run the
whole measurement (Ray cluster, actors, gloo) inside a fresh network namespace whose loopback is
shaped to that rate by tc (``benchmarks/emulated_network.py``): the gradient all-reduce then waits
on the wire while the processors idle, the regime of a real cluster and of the paper. The plans are
made for the same link (``make_plan(link="emulated:1gbit")``: a medium shared by the ranks).

For each link, job count and mode: the measured aggregate throughput (tokens of every job's timed
steps / timed wall time, ``--warmup`` steps per job excluded), its ratio to sequential, whether
every job's final parameters and optimizer states are bit-identical to the sequential run's (each
job as if run alone), and two predictions of :func:`engine.crossover.predict_colocated`:

- ``pred(plan)``: from the plans' own cost model (the ``cpu`` device table and the link);
- ``pred(C/M)``: the same model fed with the compute ``C`` (F+B), all-reduce ``M`` and optimizer
  times measured in the sequential run (each job alone), i.e. calibrated on this machine.

Target (issue 18): crossover on the emulated 1 Gbit/s link at least 1.2x sequential, parameters
identical, prediction within 15%. Use ``--json`` for one JSON object on the last line.

Run: ``python benchmarks/crossover_bench.py [--links unshaped 1gbit 10gbit] [--jobs 2 3] [--steps 20] [--json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODES = ("sequential", "uncoordinated", "crossover")


def measured_parts(res) -> dict:
    """Mean per-step compute (F/B/I/W), all-reduce and optimizer seconds of one device, from a
    run's timeline (events of the timed steps of every job, device 0)."""
    tl = res.timeline
    if tl is None:
        return {"compute": 0.0, "comm": 0.0, "optim": 0.0}
    steps = sum(j.timed_steps for j in res.jobs) or 1
    ev = [e for e in tl.events if e.rank == 0]
    comp = sum(e.duration for e in ev if e.op in ("F", "B", "I", "W")) / steps
    comm = sum(e.duration for e in ev if e.op == "ALLREDUCE") / steps
    opt = sum(e.duration for e in ev if e.op == "OPTIM") / steps
    return {"compute": comp, "comm": comm, "optim": opt}


class CpuMeter:
    """Share of the machine's CPU time that was busy (``psutil.cpu_times``, all cores) over a
    mode's timed steps: sampled after every step (``on_step``); the window runs from the first
    step after the warm-up to the last step (in ``sequential`` mode: over job A's timed steps,
    i.e. one job alone on the actors)."""

    def __init__(self, mode: str, warmup: int):
        self.mode, self.warmup = mode, warmup
        self.first = self.last = None

    def __call__(self, job: int, step: int, _loss: float) -> None:
        import psutil

        if self.mode == "sequential" and job != 0:
            return
        if step == self.warmup - 1 and self.first is None:
            self.first = psutil.cpu_times()
        elif step >= self.warmup:
            self.last = psutil.cpu_times()

    def busy(self) -> float | None:
        if self.first is None or self.last is None:
            return None
        def busy(c):
            return sum(getattr(c, k, 0.0) for k in ("user", "system", "nice", "irq", "softirq", "steal"))
        def total(c):
            return busy(c) + c.idle + getattr(c, "iowait", 0.0)
        span = total(self.last) - total(self.first)
        return (busy(self.last) - busy(self.first)) / span if span > 0 else None


def predictions(plans, mode: str, steps: int, parts: dict | None, tokens_per_step: int, devices: int) -> dict:
    """Aggregate tokens/s predicted by engine.crossover from the plans and from measured C/M."""
    out = {"plan": None, "measured_cm": None}
    try:
        from engine.crossover import JobProfile, predict_colocated, predict_profiles
    except ImportError:
        return out
    try:
        out["plan"] = float(predict_colocated(list(plans), mode, steps=steps).aggregate_tokens_per_second)
    except Exception as e:  # noqa: BLE001 - report, do not fail the benchmark
        out["plan_error"] = f"{type(e).__name__}: {e}"
    if parts:
        profs = [JobProfile.synthetic(chr(ord("A") + j), parts["compute"], parts["comm"], parts["optim"],
                                      num_devices=devices, tokens_per_step=tokens_per_step) for j in range(len(plans))]
        out["measured_cm"] = float(predict_profiles(profs, mode, steps).aggregate_tokens_per_second)
    return out


def _same_parameters(dirs_a: list, dirs_b: list) -> bool:
    """Every job's final checkpoint (parameters and optimizer states of every rank) bit-identical
    between two runs."""
    import torch

    from runtime import checkpoint as ck

    for da, db in zip(dirs_a, dirs_b):
        a, b = ck.load_checkpoint(da), ck.load_checkpoint(db)
        for r in range(a.world_size):
            sa, sb = a.rank_state(r), b.rank_state(r)
            for seg, tensors in sa["segments"].items():
                if any(not torch.equal(t, sb["segments"][seg][k]) for k, t in tensors.items()):
                    return False
            for k, st in sa["optimizer"]["state"].items():
                for kk, v in st.items():
                    if isinstance(v, torch.Tensor) and not torch.equal(v, sb["optimizer"]["state"][k][kk]):
                        return False
    return True


def run_link(params: dict) -> list[dict]:
    """Every job count and mode on one link, in this process's network (a namespace when
    ``params["link"]`` is emulated; run there by :func:`emulated_network.run_function`): the rows
    of the table. Plans use the link (``make_plan(link=...)``), so ``predicted (plan)`` is the
    planner's own prediction for that network."""
    import tempfile
    from pathlib import Path

    import ray

    from engine.plan.make import make_plan
    from runtime.crossover import CrossoverConfig, launch_crossover
    from runtime.session import StepCallback

    ns = params["link"] != "unshaped"
    link = f"emulated:{params['link']}" if ns else None
    ray.init(address="local", include_dashboard=False, logging_level="WARNING",
             **({"_node_ip_address": "127.0.0.1"} if ns else {}))
    rows = []
    try:
        for jobs in params["jobs"]:
            names = [chr(ord("A") + j) for j in range(jobs)]
            for n in params["actors"]:
                t0 = time.perf_counter()
                plan = make_plan(params["model"], devices=n, dp=n, micro_batches=params["micro_batches"],
                                 device_type="cpu", seq_len=params["seq_len"],
                                 micro_batch_size=params["micro_batch_size"], link=link).plan
                plan_s = time.perf_counter() - t0
                results, dirs, cpu, parts = {}, {}, {}, None
                with tempfile.TemporaryDirectory(prefix="tessel-crossover-") as tmp:
                    for mode in MODES:
                        meter = CpuMeter(mode, params["warmup"])
                        dirs[mode] = [str(Path(tmp) / mode / name) for name in names]
                        config = CrossoverConfig(steps=params["steps"], mode=mode, warmup_steps=params["warmup"],
                                                 optimizer=params["optimizer"], eval_every=None,
                                                 step_timeout=params["step_timeout"], names=names,
                                                 checkpoint_dirs=dirs[mode])
                        res = launch_crossover([plan] * jobs, config,
                                               callbacks=[StepCallback(lambda r, m=meter: m(r.job, r.step, r.loss))])
                        results[mode], cpu[mode] = res, meter.busy()
                        if mode == "sequential":
                            parts = measured_parts(res)
                    same = {m: _same_parameters([j.checkpoint for j in results[m].jobs],
                                                [j.checkpoint for j in results["sequential"].jobs]) for m in MODES}
                tps = results["sequential"].jobs[0].tokens_per_step
                base = results["sequential"].aggregate_tokens_per_second
                for mode in MODES:
                    res = results[mode]
                    pred = predictions([plan] * jobs, mode, params["steps"] - params["warmup"], parts, tps, n)
                    rows.append({
                        "link": params["link"], "jobs": jobs, "actors": n, "mode": mode,
                        "tokens_per_second": res.aggregate_tokens_per_second,
                        "vs_sequential": res.aggregate_tokens_per_second / base if base else None,
                        "predicted_plan": pred["plan"], "predicted_measured_cm": pred["measured_cm"],
                        "wall_time": res.wall_time, "total_tokens": res.total_tokens,
                        "job_tokens_per_second": [j.tokens_per_second for j in res.jobs],
                        "mean_step": [statistics.fmean(j.step_times[params["warmup"]:] or [0.0]) for j in res.jobs],
                        "token_wait_per_step": [j.token_wait / max(1, len(j.step_times)) for j in res.jobs],
                        "overlapping_sections": len(res.overlaps()), "max_holders": res.max_holders,
                        "losses_equal_sequential": [j.losses for j in res.jobs]
                        == [j.losses for j in results["sequential"].jobs],
                        "parameters_equal_sequential": same[mode],
                        "measured_parts_alone": parts, "plan_seconds": plan_s, "cpu_busy": cpu[mode],
                        "cpu_bound_speedup": (1.0 / cpu["sequential"]) if cpu.get("sequential") else None,
                        "setup_seconds": res.setup_time,
                    })
    finally:
        ray.shutdown()
    return rows


def run(args) -> dict:
    """Every link of ``args.links``: unshaped in this process, the emulated ones each inside a fresh
    namespace (``benchmarks/emulated_network.py``); links that cannot be emulated here are reported
    with the harness's sentence."""
    import emulated_network as en

    params = {k: getattr(args, k) for k in ("model", "seq_len", "micro_batch_size", "micro_batches", "actors",
                                            "steps", "warmup", "optimizer", "step_timeout", "jobs")}
    rows, skipped = [], {}
    for name in args.links:
        if name == "unshaped":
            rows += run_link({**params, "link": name})
            continue
        reason = en.unavailable_reason()
        if reason is not None:
            skipped[name] = reason
            continue
        with en.emulated_link(name) as link:
            rows += en.run_function(run_link, {**params, "link": name}, link=link, timeout=3600)
    return {"model": args.model, "optimizer": args.optimizer, "seq_len": args.seq_len,
            "micro_batch_size": args.micro_batch_size, "micro_batches": args.micro_batches, "steps": args.steps,
            "warmup": args.warmup, "cpus": os.cpu_count(), "rows": rows, "skipped_links": skipped}


def print_table(out: dict) -> None:
    print(f"{out['model']} ({out['optimizer']}), micro-batch {out['micro_batch_size']} x {out['seq_len']} tokens, "
          f"{out['micro_batches']} micro-batch(es)/step, {out['steps']} steps per job ({out['warmup']} warm-up), "
          f"{out['cpus']} CPU cores")
    for name, why in out.get("skipped_links", {}).items():
        print(f"\nlink {name}: skipped: {why}")
    last = None

    def fmt(v: float | None) -> str:
        return f"{v:,.0f}" if v else "-"

    def err(pred: float | None, meas: float) -> str:
        return f"{pred / meas - 1:+.0%}" if pred and meas else "-"

    for r in out["rows"]:
        key = (r["link"], r["jobs"], r["actors"])
        if key != last:
            p = r["measured_parts_alone"] or {}
            c, m, o = p.get("compute", 0.0), p.get("comm", 0.0), p.get("optim", 0.0)
            link = "unshaped loopback" if r["link"] == "unshaped" else f"emulated {r['link']} link"
            print(f"\n{link}, {r['jobs']} jobs on {r['actors']} actors; one job alone per step: compute "
                  f"{c * 1e3:.1f} ms, all-reduce {m * 1e3:.1f} ms ({m / (c + m + o) * 100 if c + m + o else 0:.0f}% "
                  f"of the step), optimizer {o * 1e3:.1f} ms; CPU "
                  f"{100 / r['cpu_bound_speedup']:.0f}% busy with one job alone" if r.get("cpu_bound_speedup") else "")
            print(f"{'mode':<14}{'tokens/s':>10}{'vs seq':>8}{'pred(plan)':>12}{'err':>6}{'pred(C/M)':>11}{'err':>6}"
                  f"{'step ms (per job)':>20}{'wait/step ms':>14}{'CPU busy':>9}{'same params':>12}")
            last = key
        steps = "/".join(f"{s * 1e3:.0f}" for s in r["mean_step"])
        waits = "/".join(f"{w * 1e3:.0f}" for w in r["token_wait_per_step"])
        busy = f"{r['cpu_busy'] * 100:.0f}%" if r["cpu_busy"] is not None else "-"
        tps = r["tokens_per_second"]
        print(f"{r['mode']:<14}{tps:>10,.0f}{r['vs_sequential']:>7.2f}x"
              f"{fmt(r['predicted_plan']):>12}{err(r['predicted_plan'], tps):>6}"
              f"{fmt(r['predicted_measured_cm']):>11}{err(r['predicted_measured_cm'], tps):>6}{steps:>20}{waits:>14}"
              f"{busy:>9}{r['parameters_equal_sequential']!s:>12}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-small-cpu")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--actors", type=int, nargs="+", default=[2])
    ap.add_argument("--jobs", type=int, nargs="+", default=[2, 3], help="co-located jobs (default 2 3)")
    ap.add_argument("--links", nargs="+", default=["unshaped", "1gbit", "10gbit"],
                    help="unshaped, and emulated link rates (tc spelling; default unshaped 1gbit 10gbit)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--optimizer", default="adam", choices=("adam", "adama", "sgd"))
    ap.add_argument("--step-timeout", type=float, default=120.0)
    ap.add_argument("--json", action="store_true", help="one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.warmup >= args.steps:
        ap.error("--warmup must be smaller than --steps")
    out = run(args)
    print_table(out)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
