"""Load a plan JSON (or a torch pipelining CSV against a plan's placement), validate it,
re-simulate it and print its metrics."""

from __future__ import annotations

import argparse

from apps.output import fmt_gib, fmt_ms, table

HELP = "validate and re-simulate a plan file"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="path to plan.json")
    p.add_argument("--csv", default=None, help="replace the plan's schedule by this torch pipelining CSV")
    p.add_argument("--memory-limit", type=float, default=None, help="GiB per device to validate against")


def run(args: argparse.Namespace) -> dict:
    from engine.io import load_plan, read_torch_csv
    from engine.planner import resimulate

    plan = load_plan(args.plan)
    if args.csv:
        plan.schedule = read_torch_csv(args.csv, plan.placement)
    plan.schedule.validate(args.memory_limit * 2**30 if args.memory_limit else None)
    tl = resimulate(plan)
    m = tl.metrics()
    if not args.json:
        rows = [[f"device {d}", f"{b:.1%}", fmt_gib(p)]
                for d, (b, p) in enumerate(zip(m["bubble_ratios"], m["peak_memory"]))]
        print(f"{args.plan}: schedule {plan.schedule.name}, valid")
        print(table(["device", "bubble", "peak memory"], rows))
        print(f"makespan {fmt_ms(m['makespan'])}, bubble ratio {m['bubble_ratio']:.1%}")
    return {"valid": True, "schedule": plan.schedule.name, **m}
