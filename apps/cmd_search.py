"""Search a schedule for a placement with Tessel and compare it with the predefined schedules.

Without ``--model`` the placement is in abstract units: F=1, B=2 time units per block, and
memory in units of one segment's activations (an F adds 1 on its devices, its B frees it), so
``--memory-limit 6`` allows six segments' activations in flight per device. With ``--model`` the
costs come from the captured model and the cost table (seconds, bytes; the limit is in GiB).
Writes ``plan.json``, ``trace.json`` and (where every block runs on one device) ``schedule.csv``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from apps.arg_types import LINK_HELP, link_name, positive_int
from apps.output import table
from engine.shapes import SHAPES

HELP = "search a schedule for a placement (V, X, M, NN, K, interleaved or a JSON file) with Tessel"

#: Abstract memory is counted in half-units internally so interleaved segments (half a V segment) stay integral.
_HALF = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--placement", default="v",
                   help="a shape (" + "; ".join(f"{s.name}: {s.description}" for s in SHAPES.values())
                   + "; 'mshape' is m) or a placement JSON file")
    p.add_argument("--devices", type=int, default=4, help="devices of the shape (default 4)")
    p.add_argument("--micro-batches", type=int, default=16, help="micro-batches per step (default 16)")
    p.add_argument("--memory-limit", type=float, default=None,
                   help="per-device limit: activation units (abstract) or GiB (with --model); default none")
    p.add_argument("--model", default=None, help="use this model's real costs (e.g. gpt2); default abstract units")
    p.add_argument("--device-type", default="h100", help="cost table with --model (default h100)")
    p.add_argument("--link", type=link_name, default=None, help=LINK_HELP + " (with --model)")
    p.add_argument("--micro-batch-size", type=positive_int, default=1,
                   help="samples per micro-batch the model is captured and trained with (--model; default 1)")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="sequence length with --model (default: the model's)")
    p.add_argument("--split-backward", action="store_true", help="split B into I (input grad) and W (weight grad)")
    p.add_argument("--inference", action="store_true", help="forward-only placement")
    p.add_argument("--objective", default="throughput", choices=["throughput", "latency"],
                   help="throughput (shortest period) or latency (inference: no queuing)")
    p.add_argument("--time-limit", type=float, default=10.0, help="search time limit in seconds (default 10)")
    p.add_argument("--seed", type=int, default=0, help="solver seed (default 0)")
    p.add_argument("--max-window", type=positive_int, default=2, metavar="R",
                   help="most micro-batches per repetend window the search refines (default 2; the 1F1B policy's "
                        "steady state, up to 3, always competes); 3-4 can reach shorter periods per micro-batch "
                        "(e.g. M on 4 devices: 7 -> 6.33 units) but need a longer --time-limit (about 60 s)")
    p.add_argument("--completion-stall", type=float, default=None, metavar="S",
                   help="stop warmup/cooldown solves after S seconds without improvement (faster, may be a "
                        "little longer; not deterministic when it stops a solve); default: run to the time limit")
    p.add_argument("-o", "--output", default="out", help="output folder (default out/)")


def _placements(args):
    """(placement, variant(name) for the V baselines, memory scale, model dict, cost, parts)."""
    from engine.io.placement_json import load_placement
    from engine.shapes import make_shape

    kw = {"split_backward": args.split_backward, "forward_only": args.inference}
    if Path(args.placement).suffix == ".json" or Path(args.placement).is_file():
        pl = load_placement(args.placement)
        return pl, None, 1, {"name": str(args.placement), "source": "placement-json"}, None, []
    if args.model is None:
        pl = make_shape(args.placement, args.devices, activation=_HALF, **kw)

        def variant(name: str):
            if name == "interleaved":
                return make_shape("interleaved", args.devices, forward=0.5, backward=1.0, activation=_HALF // 2,
                                  forward_only=args.inference)
            return make_shape("v", args.devices, activation=_HALF, split_backward=True)

        return pl, variant, _HALF, {"name": "abstract", "source": "units", "forward": 1.0, "backward": 2.0}, None, []
    return None, None, 1, None, None, []


def _model_search(args, limit):
    """``tessel search --model``: :func:`engine.search_plan.model_search_plan` (a launchable plan)."""
    from engine.search_plan import model_search_plan

    return model_search_plan(
        args.model, args.placement, args.devices, args.micro_batches, micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len, device_type=args.device_type, memory_limit=limit, link=args.link,
        split_backward=args.split_backward, forward_only=args.inference, time_limit=args.time_limit,
        seed=args.seed, objective=args.objective, progress_bar=not args.json and sys.stderr.isatty(),
        completion_stall=args.completion_stall, max_window_micro_batches=args.max_window)


def run(args: argparse.Namespace) -> dict:
    from engine.compare import compare_baselines, measure
    from engine.config import ModelRef, ParallelConfig
    from engine.dependency import lower
    from engine.errors import PlanFormatError, TesselError
    from engine.io import Plan, save_plan, write_torch_csv, write_trace
    from engine.simulate import simulate
    from engine.tessel import InfeasibleMemoryError, tessel_search

    from_file = Path(args.placement).suffix == ".json" or Path(args.placement).is_file()
    use_model = args.model is not None and not from_file
    pl, variant, mem_scale, model, cost, parts = _placements(args) if not use_model else (None,) * 6
    mem_scale = mem_scale or 1
    gib = 2**30 if args.model else 1
    limit = args.memory_limit * gib * mem_scale if args.memory_limit is not None else None
    unit = "GiB" if args.model else "units"
    searched = None
    try:
        if use_model:
            searched = _model_search(args, limit)
            res, pl, cost, variant = searched.result, searched.placement, searched.cost, searched.variant
        else:
            res = tessel_search(pl, args.micro_batches, memory_limit=limit, time_limit=args.time_limit,
                                seed=args.seed, objective=args.objective,
                                progress_bar=not args.json and sys.stderr.isatty(),
                                completion_stall=args.completion_stall, max_window_micro_batches=args.max_window)
    except InfeasibleMemoryError as e:  # restate in the user's units
        raise TesselError(
            f"--memory-limit {args.memory_limit:g} {unit} is infeasible: device {e.device} needs more even with one "
            f"micro-batch at a time; the smallest feasible limit is {e.smallest / mem_scale / gib:.4g} {unit}"
        ) from None
    tess = measure(res.schedule, limit, cost)
    tessel_tl = searched.timeline if searched is not None else simulate(lower(res.schedule), cost)
    rows = [tess] + compare_baselines(pl, args.micro_batches, memory_limit=limit, cost=cost, variant=variant)
    if searched is not None and pl.name != "V":   # the yardstick: the same model on a plain pipeline
        rows = [r for r in rows if r.makespan is not None or r.name not in ("interleaved", "zb-h1")]
        rows += searched.v_baselines(limit)

    def unit_mem(x):
        return None if x is None else x / mem_scale / gib

    out = Path(args.output)
    if searched is not None:
        plan = searched.plan
    else:
        plan = Plan(model=ModelRef.from_dict(model),
                    parallel=ParallelConfig.from_dict({"dp": 1, "tp": 1, "pp": pl.num_devices,
                                                       "micro_batches": args.micro_batches,
                                                       "devices": pl.num_devices, "optimizer": "adam"}),
                    segments=[{"index": i, **p} for i, p in enumerate(parts)], schedule=res.schedule,
                    cost=cost.to_dict() if cost else {}, metrics={**tessel_tl.metrics(), **res.summary()},
                    meta={"memory_unit": f"1/{mem_scale} activation unit"})
    plan_path = save_plan(plan, out / "plan.json")
    trace_path = write_trace(tessel_tl, out / "trace.json", metadata={"schedule": "tessel", "placement": pl.name})
    try:
        csv_path = str(write_torch_csv(res.schedule, out / "schedule.csv"))
    except PlanFormatError as e:
        csv_path = None
        csv_note = str(e)
    tscale = 1e3 if args.model else 1
    tunit = "ms" if args.model else "units"
    print(f"placement {pl.name} on {pl.num_devices} devices, {args.micro_batches} micro-batches"
          + (f", memory limit {args.memory_limit:g} {unit}" if args.memory_limit is not None else ""))
    print(f"repetend period {res.period * tscale:.4g} {tunit}/micro-batch "
          f"(lower bound {res.period_lower_bound * tscale:.4g}, "
          f"gap {res.period_gap:.1%}{', optimal' if res.optimal else ''}), {res.repetend.in_flight} windows in flight, "
          f"{res.repetend.micro_batches} micro-batch(es) per window")
    print(f"makespan lower bound {res.makespan_lower_bound * tscale:.4g} {tunit}; search took {res.search_time:.2f} s "
          f"({res.steps} solver calls{', time limit hit' if res.timed_out else ''})")
    trows = []
    for r in rows:
        if r.makespan is None:
            trows.append([r.name, "-", "-", "-", r.note])
        else:
            note = "over memory limit" if r.over_limit else ""
            trows.append([r.name, f"{r.makespan * tscale:,.4g}", f"{r.bubble_ratio:.1%}",
                          f"{unit_mem(max(r.peak_memory)):,.4g}", note])
    print(table(["schedule", f"makespan ({tunit})", "bubble", f"peak memory ({unit})", "note"], trows))
    print(f"wrote {plan_path}, {trace_path}" + (f", {csv_path}" if csv_path else f" (no CSV: {csv_note})"))
    return {
        "plan": str(plan_path), "trace": str(trace_path), "csv": csv_path,
        "period": res.period, "period_lower_bound": res.period_lower_bound, "bubble_ratio": tess.bubble_ratio,
        "makespan": tess.makespan, "makespan_lower_bound": res.makespan_lower_bound,
        "peak_memory": [unit_mem(x) for x in tess.peak_memory], "search_time": res.search_time, "optimal": res.optimal,
        "timed_out": res.timed_out, "window_micro_batches": res.repetend.micro_batches,
        "baselines": {r.name: {**r.to_dict(), "peak_memory": [unit_mem(x) for x in (r.peak_memory or [])]}
                      for r in rows[1:]},
    }
