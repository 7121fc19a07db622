"""Load a plan JSON (or a torch pipelining CSV against a plan's placement), validate it,
re-simulate it and print its metrics: :func:`engine.plan.metrics.predicted_metrics`, the numbers
``tessel plan`` and ``tessel search`` print for the same plan. An abstract plan (``tessel search``
without ``--model``) is shown in its units, not in milliseconds and GiB."""

from __future__ import annotations

import argparse

from apps.arg_types import memory_limit
from apps.output import facts_line, fmt_gib, fmt_ms, memory_line, mfu_line, report_fields, table
from engine.io import load_plan, read_torch_csv
from engine.plan import check_plan, is_abstract, predicted_metrics

HELP = "validate and re-simulate a plan file"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="path to plan.json")
    p.add_argument("--csv", default=None, help="replace the plan's schedule by this torch pipelining CSV")
    p.add_argument("--memory-limit", type=memory_limit, default=None,
                   help="GiB per device to validate against (activation units for an abstract plan)")


def _fmt_units(x: float) -> str:
    return f"{x:,.4g} units"


def _abstract_memory_scale(plan) -> float:
    """Internal memory counts per activation unit of an abstract plan: ``tessel search`` records
    ``meta.memory_unit = "1/N activation unit"`` (N half-units); 1 for any other plan."""
    unit = str(plan.meta.get("memory_unit", ""))
    head = unit.split(" ", 1)[0]
    if head.startswith("1/") and head[2:].isdigit() and int(head[2:]) > 0:
        return float(int(head[2:]))
    return 1.0


def run(args: argparse.Namespace) -> dict:
    plan = load_plan(args.plan)
    if args.csv:
        plan.schedule = read_torch_csv(args.csv, plan.placement)
    if args.memory_limit is None:
        limit = None
    elif is_abstract(plan):
        limit = args.memory_limit * _abstract_memory_scale(plan)
    else:
        limit = args.memory_limit * 2**30
    check_plan(plan, name=args.plan, memory_limit=limit)
    m = predicted_metrics(plan)
    abstract = is_abstract(plan)
    fmt_time = _fmt_units if abstract else fmt_ms
    scale = _abstract_memory_scale(plan) if abstract else 1.0

    def fmt_mem(x: float) -> str:
        return f"{x / scale:,.4g} activation units" if abstract else fmt_gib(x)
    if not args.json:
        rows = [[f"device {d}", f"{b:.1%}", fmt_mem(p)]
                for d, (b, p) in enumerate(zip(m["bubble_ratios"], m["peak_memory"]))]
        print(f"{args.plan}: schedule {plan.schedule.name}, valid"
              + (" (abstract plan: times and memory in the placement's units)" if abstract else ""))
        print(table(["device", "bubble", "peak memory"], rows))
        tps = (f", {m['tokens_per_second']:,.0f} tokens/s predicted" if m["tokens_per_second"] > 0
               else "")
        print(f"makespan {fmt_time(m['makespan'])}, bubble ratio {m['bubble_ratio']:.1%}{tps}")
        if not abstract:
            print(facts_line(plan))
            for line in (mfu_line(m), memory_line(m)):
                if line:
                    print(line)
    return {"valid": True, "schedule": plan.schedule.name, **m, **({} if abstract else report_fields(plan, m))}
