"""CrossoverScheduler benchmark: two data-parallel jobs co-located on the same Ray actors.

Two identical jobs (by default ``gpt2-small-cpu``, ~4.9M parameters = 19.5 MB of float32
gradients, micro-batch 1 x 16 tokens: little compute, a large gradient all-reduce over gloo)
train on the same 2 (and, with ``--actors 2 4``, 4) actors in each mode of
:func:`runtime.crossover.launch_crossover`:

- ``sequential``: job A's steps, then job B's (the baseline the target is relative to);
- ``uncoordinated``: both jobs free-running on the same actors (no token);
- ``crossover``: the per-device compute token passed at the gradient all-reduce.

For each mode it reports the measured aggregate throughput (tokens of both jobs' timed steps /
timed wall time, ``--warmup`` steps per job excluded), its ratio to sequential, and two
predictions of :func:`engine.crossover.predict_colocated`'s co-location model:

- ``predicted (plan)``: from the plans' own cost model (the ``cpu`` device table);
- ``predicted (measured C/M)``: the same model fed with the compute ``C`` (F+B), all-reduce ``M``
  and optimizer times measured in the sequential run (each job alone on the actors), i.e. what the
  model says once it knows this machine's real durations.

Honesty notes: this machine may have as few as 2 cores shared by every actor; gloo's all-reduce is
not "free" communication here, it copies and sums on the same cores the other job computes on,
and its ring needs every rank's CPU at once. The table therefore shows what co-location buys on
THIS machine, not on GPUs with a network. Use ``--json`` for one JSON object on the last line.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/crossover_bench.py [--actors 2 4] [--steps 10] [--json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
        profs = [JobProfile.synthetic(n, parts["compute"], parts["comm"], parts["optim"], num_devices=devices,
                                      tokens_per_step=tokens_per_step) for n in ("A", "B")]
        out["measured_cm"] = float(predict_profiles(profs, mode, steps).aggregate_tokens_per_second)
    return out


def run(args) -> dict:
    import ray

    from engine.planner import make_plan
    from runtime.crossover import CrossoverConfig, launch_crossover
    from runtime.session import StepCallback

    ray.init(include_dashboard=False, logging_level="WARNING")
    rows = []
    try:
        for n in args.actors:
            t0 = time.perf_counter()
            plan = make_plan(args.model, devices=n, dp=n, micro_batches=args.micro_batches, device_type="cpu",
                             seq_len=args.seq_len, micro_batch_size=args.micro_batch_size).plan
            plan_s = time.perf_counter() - t0
            results = {}
            parts = None
            cpu = {}
            for mode in MODES:
                meter = CpuMeter(mode, args.warmup)
                config = CrossoverConfig(steps=args.steps, mode=mode, warmup_steps=args.warmup,
                                         optimizer=args.optimizer, eval_every=None, step_timeout=args.step_timeout,
                                         names=["A", "B"])
                res = launch_crossover([plan, plan], config,
                                       callbacks=[StepCallback(lambda r, m=meter: m(r.job, r.step, r.loss))])
                results[mode] = res
                cpu[mode] = meter.busy()
                if mode == "sequential":
                    parts = measured_parts(res)
            tps = res.jobs[0].tokens_per_step
            base = results["sequential"].aggregate_tokens_per_second
            for mode in MODES:
                res = results[mode]
                pred = predictions([plan, plan], mode, args.steps - args.warmup, parts, tps, n)
                rows.append({
                    "actors": n, "mode": mode, "tokens_per_second": res.aggregate_tokens_per_second,
                    "vs_sequential": res.aggregate_tokens_per_second / base if base else None,
                    "predicted_plan": pred["plan"], "predicted_measured_cm": pred["measured_cm"],
                    "wall_time": res.wall_time, "total_tokens": res.total_tokens,
                    "job_tokens_per_second": [j.tokens_per_second for j in res.jobs],
                    "mean_step": [sum(j.step_times[args.warmup:]) / max(1, len(j.step_times[args.warmup:]))
                                  for j in res.jobs],
                    "token_wait_per_step": [j.token_wait / max(1, len(j.step_times)) for j in res.jobs],
                    "overlapping_sections": len(res.overlaps()), "max_holders": res.max_holders,
                    "losses_equal_sequential": [j.losses for j in res.jobs]
                    == [j.losses for j in results["sequential"].jobs],
                    "measured_parts_alone": parts, "plan_seconds": plan_s, "cpu_busy": cpu[mode],
                    "cpu_bound_speedup": (1.0 / cpu["sequential"]) if cpu.get("sequential") else None,
                    "setup_seconds": res.setup_time,
                })
    finally:
        ray.shutdown()
    return {"model": args.model, "optimizer": args.optimizer, "seq_len": args.seq_len,
            "micro_batch_size": args.micro_batch_size, "micro_batches": args.micro_batches, "steps": args.steps,
            "warmup": args.warmup, "cpus": os.cpu_count(), "rows": rows}


def print_table(out: dict) -> None:
    print(f"{out['model']} ({out['optimizer']}), micro-batch {out['micro_batch_size']} x {out['seq_len']} tokens, "
          f"{out['micro_batches']} micro-batch(es)/step, 2 jobs, {out['steps']} steps each "
          f"({out['warmup']} warm-up), {out['cpus']} CPU cores")
    last = None
    for r in out["rows"]:
        if r["actors"] != last:
            p = r["measured_parts_alone"] or {}
            c, m, o = p.get("compute", 0.0), p.get("comm", 0.0), p.get("optim", 0.0)
            print(f"\n{r['actors']} actors; one job alone per step: compute {c * 1e3:.1f} ms, all-reduce "
                  f"{m * 1e3:.1f} ms ({m / (c + m + o) * 100 if c + m + o else 0:.0f}% of the step), "
                  f"optimizer {o * 1e3:.1f} ms")
            if r.get("cpu_bound_speedup"):
                print(f"the machine's CPU is {100 / r['cpu_bound_speedup']:.0f}% busy with one job alone: "
                      f"no co-location can exceed ~{r['cpu_bound_speedup']:.2f}x sequential here "
                      "(gloo's all-reduce is CPU work)")
            print(f"{'mode':<14}{'tokens/s':>10}{'vs seq':>8}{'pred(plan)':>12}{'pred(C/M)':>11}"
                  f"{'step A/B ms':>15}{'wait/step ms':>14}{'CPU busy':>9}{'overlaps':>9}{'same loss':>10}")
            last = r["actors"]

        def fmt(v: float | None) -> str:
            return f"{v:,.0f}" if v else "-"

        steps = "/".join(f"{s * 1e3:.0f}" for s in r["mean_step"])
        waits = "/".join(f"{w * 1e3:.0f}" for w in r["token_wait_per_step"])
        busy = f"{r['cpu_busy'] * 100:.0f}%" if r["cpu_busy"] is not None else "-"
        print(f"{r['mode']:<14}{r['tokens_per_second']:>10,.0f}{r['vs_sequential']:>7.2f}x"
              f"{fmt(r['predicted_plan']):>12}{fmt(r['predicted_measured_cm']):>11}{steps:>15}{waits:>14}"
              f"{busy:>9}"
              f"{r['overlapping_sections']:>9}{r['losses_equal_sequential']!s:>10}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-small-cpu")
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--actors", type=int, nargs="+", default=[2])
    ap.add_argument("--steps", type=int, default=30)
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
