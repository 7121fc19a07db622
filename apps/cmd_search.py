"""Search a schedule for a placement with Tessel and compare it with the predefined schedules.

Without ``--model`` the placement is in abstract units: F=1, B=2 time units per block, and
memory in units of one segment's activations (an F adds 1 on its devices, its B frees it), so
``--memory-limit 6`` allows six segments' activations in flight per device. With ``--model`` the
costs come from the captured model and the cost table (seconds, bytes; the limit is in GiB).
Writes ``plan.json``, ``trace.json`` and (where every block runs on one device) ``schedule.csv``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from apps.arg_types import (
    LINK_HELP,
    PRECISION_HELP,
    RECOMPUTE_HELP,
    dtype_name,
    link_name,
    memory_limit,
    positive_float,
    positive_int,
    precision_name,
    recompute_name,
)
from apps.output import facts_line, memory_line, mfu_line, report_fields, table
from engine.errors import PlacementError, PlanFormatError, TesselError
from engine.io import Plan, schedule_to_csv_text
from engine.io.atomic import atomic_write_files, check_output_folder
from engine.io.placement_json import load_placement
from engine.io.trace import timeline_to_trace
from engine.placement import Placement
from engine.plan import ScheduleMetrics, compare_baselines, plan_from_search, predicted_metrics
from engine.plan.from_search import ABSTRACT_MODEL
from engine.shapes import SHAPES, make_shape
from engine.timeline import Timeline
from engine.tp_plan import read_tp_plan

HELP = ("search a schedule for a placement (V, X, M, NN, K, interleaved, MLLM, finetune, AlphaFold or a JSON file) "
        "with Tessel")

#: Abstract memory is counted in half-units internally so interleaved segments (half a V segment) stay integral.
_HALF = 2
#: The files ``tessel search`` writes into its output folder (``schedule.csv`` only where every block runs on
#: one device; a stale one from an earlier search is removed otherwise).
OUTPUT_NAMES = ("plan.json", "trace.json", "schedule.csv")
#: ``--devices`` when not given: the shapes' device count (a placement file brings its own).
DEFAULT_DEVICES = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--placement", default="v",
                   help="a shape (" + "; ".join(f"{s.name}: {s.description}" for s in SHAPES.values())
                   + "; 'mshape' is m) or a placement JSON file")
    p.add_argument("--devices", type=positive_int, default=None,
                   help=f"devices of the shape (default {DEFAULT_DEVICES}; a placement file has its own, and a "
                        "different --devices is refused)")
    p.add_argument("--micro-batches", type=positive_int, default=16, help="micro-batches per step (default 16)")
    p.add_argument("--memory-limit", type=memory_limit, default=None,
                   help="per-device limit: activation units (abstract) or GiB (with --model); default none")
    p.add_argument("--model", default=None, help="use this model's real costs (e.g. gpt2); default abstract units")
    p.add_argument("--model-config", default=None, metavar="PATH",
                   help="use the real costs of a Hugging Face config.json (or a folder holding one), built on the "
                        "meta device, e.g. configs/hf/llama-3-8b; instead of --model")
    p.add_argument("--device-type", default="h100", help="cost table with --model (default h100)")
    p.add_argument("--link", type=link_name, default=None, help=LINK_HELP + " (with --model)")
    p.add_argument("--micro-batch-size", type=positive_int, default=1,
                   help="samples per micro-batch the model is captured and trained with (--model; default 1)")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="sequence length with --model (default: the model's)")
    p.add_argument("--precision", type=precision_name, default=None, help=PRECISION_HELP + " (with --model)")
    p.add_argument("--recompute", type=recompute_name, default="none", help=RECOMPUTE_HELP + " (with --model)")
    p.add_argument("--dtype", type=dtype_name, default=None,
                   help="with --model, the old way to say the precision: float32 (32-true), bfloat16 (bf16-true), "
                        "float16 (16-mixed); with --precision it must be its compute dtype")
    p.add_argument("--split-backward", action="store_true", help="split B into I (input grad) and W (weight grad)")
    p.add_argument("--inference", action="store_true", help="forward-only placement")
    p.add_argument("--objective", default="throughput", choices=["throughput", "latency"],
                   help="throughput (shortest period) or latency (inference: no queuing)")
    p.add_argument("--time-limit", type=positive_float, default=10.0, help="search time limit in seconds (default 10)")
    p.add_argument("--seed", type=int, default=0, help="solver seed (default 0)")
    p.add_argument("--max-window", type=positive_int, default=3, metavar="R",
                   help="most micro-batches per repetend window the search refines (default 3; the 1F1B policy's "
                        "steady state, up to 3, always competes); larger windows reach shorter periods per "
                        "micro-batch under tight memory (e.g. M on 4 devices, limit 6: 8 -> 7.67 units with 3) but "
                        "need a longer --time-limit")
    p.add_argument("--window", type=positive_int, default=None, metavar="R",
                   help="search only repetends of exactly R micro-batches per window (default: 1 to --max-window)")
    p.add_argument("--completion-stall", type=positive_float, default=None, metavar="S",
                   help="stop warmup/cooldown solves after S seconds without improvement (faster, may be a "
                        "little longer; not deterministic when it stops a solve); default: run to the time limit")
    p.add_argument("--tp-plan", metavar="FILE", default=None,
                   help="with --model, a JSON tensor-parallel plan for the all-device blocks (M, NN, X) in "
                        "transformers' base_model_tp_plan format (styles colwise, rowwise, packed_colwise:K), "
                        "replacing the model's own; recorded, costed and executed")
    p.add_argument("-o", "--output", default="out", help="output folder (default out/)")


def _from_file(args) -> bool:
    return Path(args.placement).suffix == ".json" or Path(args.placement).is_file()


def _placements(args) -> tuple[Placement, Callable[[str], Placement] | None, int, dict]:
    """The abstract placement searched: ``(placement, variant(name) for the V baselines, memory
    scale, the plan's model section)``.

    Raises:
        PlacementError: a placement file whose devices differ from ``--devices``.
        TesselError: an unknown shape, too few devices for it.
    """
    kw = {"split_backward": args.split_backward, "forward_only": args.inference}
    if _from_file(args):
        pl = load_placement(args.placement)
        if args.devices is not None and args.devices != pl.num_devices:
            raise PlacementError(f"--devices {args.devices} does not match the placement file {args.placement}, "
                                 f"which places its blocks on {pl.num_devices} devices; drop --devices or pass "
                                 f"--devices {pl.num_devices}")
        return pl, None, 1, {"name": str(args.placement), "source": "placement-json"}
    n = args.devices or DEFAULT_DEVICES
    pl = make_shape(args.placement, n, activation=_HALF, **kw)

    def variant(name: str) -> Placement:
        if name == "interleaved":
            return make_shape("interleaved", n, forward=0.5, backward=1.0, activation=_HALF // 2,
                              forward_only=args.inference)
        return make_shape("v", n, activation=_HALF, split_backward=True)

    return pl, variant, _HALF, dict(ABSTRACT_MODEL)


def _search_options(args) -> dict[str, Any]:
    """The :func:`engine.tessel.tessel_search` options of the command line (both searches)."""
    return dict(time_limit=args.time_limit, seed=args.seed, objective=args.objective,
                progress_bar=not args.json and sys.stderr.isatty(), completion_stall=args.completion_stall,
                max_window_micro_batches=args.max_window, window_micro_batches=args.window, fallback_baselines=True)


@dataclass
class _Searched:
    """One search's outcome: the result, the placement searched, the plan and its timeline, and
    what the table's rows need (``variant``, ``cost``, ``row_predict``; the model search's
    :class:`engine.plan.model_search.SearchPlan` for its plain-pipeline yardstick)."""

    result: Any
    placement: Placement
    plan: Plan
    timeline: Timeline
    variant: Callable[[str], Placement] | None
    cost: Any
    row_predict: Callable
    mem_scale: int = 1
    model_search: Any = None


def _model_search(args, limit: float | None) -> _Searched:
    """``tessel search --model``: :func:`engine.plan.model_search.model_search_plan` (a launchable plan)."""
    from engine.plan.model_search import model_search_plan

    sp = model_search_plan(
        args.model, args.placement, args.devices or DEFAULT_DEVICES, args.micro_batches,
        micro_batch_size=args.micro_batch_size, seq_len=args.seq_len, device_type=args.device_type,
        memory_limit=limit, link=args.link, split_backward=args.split_backward, forward_only=args.inference,
        precision=args.precision, recompute=args.recompute, dtype=args.dtype,
        tp_plan=read_tp_plan(args.tp_plan) if args.tp_plan else None, **_search_options(args))
    return _Searched(sp.result, sp.placement, sp.plan, sp.timeline, sp.variant, sp.cost, sp.predict, model_search=sp)


def _abstract_search(args) -> _Searched:
    """``tessel search`` on an abstract placement (a shape in units or a placement file): the
    search and its plan (:func:`engine.plan.from_search.plan_from_search`)."""
    from engine.tessel import tessel_search

    pl, variant, mem_scale, model = _placements(args)
    gib = 2**30 if args.model else 1   # --model with a placement file: the limit stays in GiB
    limit = args.memory_limit * gib * mem_scale if args.memory_limit is not None else None
    res = tessel_search(pl, args.micro_batches, memory_limit=limit, **_search_options(args))
    plan, timeline = plan_from_search(res, memory_limit=limit, memory_scale=mem_scale, model=model)

    def row_predict(schedule) -> dict:
        return predicted_metrics(replace(plan, schedule=schedule, metrics={}, meta=dict(plan.meta)))

    return _Searched(res, pl, plan, timeline, variant, None, row_predict, mem_scale=mem_scale)


def _search(args) -> _Searched:
    """The search the command line asks for, an infeasible memory limit restated in its units.

    Raises:
        TesselError: an infeasible limit (naming the smallest feasible one), or the search's own errors.
    """
    from engine.tessel import InfeasibleMemoryError

    use_model = args.model is not None and not _from_file(args)
    if args.tp_plan and not use_model:
        raise TesselError("--tp-plan shards a model's all-device blocks; give the model with --model and a shape "
                          "(--placement m, nn or x)")
    gib = 2**30 if args.model else 1
    unit = "GiB" if args.model else "units"
    mem_scale = 1 if use_model or _from_file(args) else _HALF
    try:
        if use_model:
            return _model_search(args, args.memory_limit * gib if args.memory_limit is not None else None)
        return _abstract_search(args)
    except InfeasibleMemoryError as e:  # restate in the user's units
        raise TesselError(
            f"--memory-limit {args.memory_limit:g} {unit} is infeasible: device {e.device} needs more even with one "
            f"micro-batch at a time; the smallest feasible limit is {e.smallest / mem_scale / gib:.4g} {unit}"
        ) from None


def faster_row(rows: list[ScheduleMetrics], searched) -> ScheduleMetrics | None:
    """The fastest compared row within the memory limit when it beats the searched plan (the first
    row), else ``None``."""
    ok = [r for r in rows[1:] if r.makespan is not None and not r.over_limit]
    best = min(ok, key=lambda r: float(r.makespan or 0.0), default=None)
    tess = rows[0]
    if best is None or tess.makespan is None or best.makespan >= tess.makespan * (1 - 1e-9):
        return None
    return best


def faster_note(args, row: ScheduleMetrics, tess: ScheduleMetrics, searched) -> str:
    """One line: which compared row is faster than the plan written, and how to get it as a plan."""
    where = _placement_label(row.schedule.placement, searched) if row.schedule is not None else ""
    name = row.name.split(" (")[0]
    if args.model:
        flags = [f"--model {shlex.quote(str(args.model))}", f"--schedule {name}",
                 f"--devices {args.devices or DEFAULT_DEVICES}", f"--micro-batches {args.micro_batches}",
                 f"--device-type {args.device_type}"]
        for opt in ("micro_batch_size", "seq_len", "precision", "recompute", "link", "memory_limit"):
            v = getattr(args, opt, None)
            default = {"recompute": "none", "micro_batch_size": 1}.get(opt)
            if v is not None and v != default:
                flags.append(f"--{opt.replace('_', '-')} {shlex.quote(str(v))}")
        how = f"`tessel plan {' '.join(flags)}` writes it, or `tessel tune` searches every schedule and degree"
        return (f"note: {row.name}{' ' + where if where else ''} predicts {row.makespan * 1e3:.4g} ms, "
                f"{1 - row.makespan / tess.makespan:.1%} faster than the searched plan written "
                f"({tess.makespan * 1e3:.4g} ms); {how}")
    return (f"note: {row.name}{' ' + where if where else ''} is {1 - row.makespan / tess.makespan:.1%} shorter than "
            f"the searched plan written ({row.makespan:.4g} against {tess.makespan:.4g} units)")


def _optimal_note(res) -> str:
    """", optimal" when the period is proven shortest; a window size's optimum says which size."""
    if not res.optimal:
        return ""
    if res.period_gap <= 1e-9:
        return ", optimal"
    return f", shortest for {res.repetend.micro_batches} micro-batch(es) per window"


def _placement_label(placement, searched) -> str:
    """How a table row's placement differs from the searched one ("" when it is the same)."""
    if placement is searched:
        return ""
    what = [placement.name]
    if any(b.kind in ("I", "W") for b in placement.blocks) and not any(b.kind in ("I", "W") for b in searched.blocks):
        what.append("backward split into I and W")
    return "on placement " + ", ".join(what)


def _rows(args, found: _Searched, limit: float | None) -> list[ScheduleMetrics]:
    """The table: Tessel's plan, then the baselines on the same placement, each a plan's prediction
    (:mod:`engine.plan.metrics`: the numbers `tessel show` prints for it); for a model's shape
    other than V also the same model's plain pipeline."""
    res, pl, pm = found.result, found.placement, found.plan.metrics
    tess = ScheduleMetrics("tessel", pm["makespan"], pm["bubble_ratio"], list(pm["peak_memory"]),
                           limit is not None and any(p > limit for p in pm["peak_memory"]), res.schedule)
    rows = [tess] + compare_baselines(pl, args.micro_batches, memory_limit=limit, cost=found.cost,
                                      variant=found.variant, predict=found.row_predict)
    if found.model_search is not None and pl.name != "V":   # the yardstick: the same model on a plain pipeline
        rows = [r for r in rows if r.makespan is not None or r.name not in ("interleaved", "zb-h1")]
        rows += found.model_search.v_baselines(limit)
    return rows


def _write(out: Path, found: _Searched) -> tuple[Path, Path, str | None, str]:
    """Write ``plan.json``, ``trace.json`` and (where it has one) ``schedule.csv`` into ``out``
    atomically; ``(plan path, trace path, csv path or None, why no CSV)``."""
    schedule = found.result.schedule
    files = {"plan.json": json.dumps(found.plan.to_dict(), indent=1),
             "trace.json": json.dumps(timeline_to_trace(found.timeline, metadata={
                 "schedule": "tessel", "placement": found.placement.name}))}
    csv_note = ""
    try:
        files["schedule.csv"] = schedule_to_csv_text(schedule)
    except PlanFormatError as e:
        csv_note = str(e)
    written = atomic_write_files(out, files)
    csv_path = str(written["schedule.csv"]) if "schedule.csv" in written else None
    if csv_path is None and (out / "schedule.csv").is_file():   # an earlier search's CSV: not this plan's schedule
        (out / "schedule.csv").unlink()
        csv_note += f"; removed the earlier {out / 'schedule.csv'}"
    return written["plan.json"], written["trace.json"], csv_path, csv_note


def _print_search(args, found: _Searched, rows: list[ScheduleMetrics], unit_mem: Callable) -> None:
    """The search's summary lines and its table."""
    res, pl = found.result, found.placement
    unit = "GiB" if args.model else "units"
    tscale = 1e3 if args.model else 1
    tunit = "ms" if args.model else "units"
    print(f"placement {pl.name} on {pl.num_devices} devices, {args.micro_batches} micro-batches"
          + (f", memory limit {args.memory_limit:g} {unit}" if args.memory_limit is not None else ""))
    print(f"repetend period {res.period * tscale:.4g} {tunit}/micro-batch "
          f"(lower bound for placement {pl.name} {res.period_lower_bound * tscale:.4g}, "
          f"gap {res.period_gap:.1%}{_optimal_note(res)}"
          f"{f', durations rounded up to ticks of {res.resolution * tscale:.4g} {tunit}' if res.rounded else ''}), "
          f"{res.repetend.in_flight} windows in flight, "
          f"{res.repetend.micro_batches} micro-batch(es) per window")
    fallback = res.schedule.meta.get("tessel", {}).get("equals_baseline")
    if fallback:
        print(f"the {fallback} policy on the same placement is shorter than the searched schedule "
              f"({res.schedule.meta['tessel']['pure_makespan'] * tscale:.4g} {tunit}): the plan holds it")
    others = sorted({_placement_label(r.schedule.placement, pl).removeprefix("on placement ")
                     for r in rows if r.schedule is not None and r.schedule.placement is not pl})
    print(f"makespan lower bound for placement {pl.name} {res.makespan_lower_bound * tscale:.4g} {tunit}"
          + (f" (rows on other placements: {'; '.join(others)} are not bounded by it)" if others else "")
          + f"; search {res.search_time:.2f} s + completion {res.completion_time:.2f} s = {res.total_time:.2f} s "
          + f"({res.steps} solver calls" + (", time limit hit" if res.timed_out else "")
          + (", wall-clock guard hit: may differ between runs" if res.wall_guard_hit else "") + ")")
    trows = []
    for r in rows:
        if r.makespan is None:
            trows.append([r.name, "-", "-", "-", r.note])
        else:
            notes = [n for n in ("over memory limit" if r.over_limit else "",
                                 _placement_label(r.schedule.placement, pl) if r.schedule is not None else "") if n]
            trows.append([r.name, f"{r.makespan * tscale:,.4g}", f"{r.bubble_ratio:.1%}",
                          f"{unit_mem(max(r.peak_memory)):,.4g}", "; ".join(notes)])
    print(table(["schedule", f"makespan ({tunit})", "bubble", f"peak memory ({unit})", "note"], trows))
    if found.model_search is not None:
        print(facts_line(found.plan))
        for line in (mfu_line(found.plan.metrics), memory_line(found.plan.metrics)):
            if line:
                print(line)


def run(args: argparse.Namespace) -> dict:
    if args.model_config is not None:   # the config's path is the model's name
        from engine.models.hf_config import model_choice  # builds models: loads torch
        args.model = model_choice(args.model, args.model_config)
    out = check_output_folder(args.output, OUTPUT_NAMES)   # before the search, not after it
    found = _search(args)
    res, pl, pm = found.result, found.placement, found.plan.metrics
    gib = 2**30 if args.model else 1
    limit = args.memory_limit * gib * found.mem_scale if args.memory_limit is not None else None
    rows = _rows(args, found, limit)
    tess = rows[0]

    def unit_mem(x):
        return None if x is None else x / found.mem_scale / gib

    plan_path, trace_path, csv_path, csv_note = _write(out, found)
    _print_search(args, found, rows, unit_mem)
    print(f"wrote {plan_path}, {trace_path}" + (f", {csv_path}" if csv_path else f" (no CSV: {csv_note})"))
    faster = faster_row(rows, found.placement)
    if faster is not None:
        print(faster_note(args, faster, tess, found.placement))
    return {
        "plan": str(plan_path), "trace": str(trace_path), "csv": csv_path,
        "period": res.period, "period_lower_bound": res.period_lower_bound, "bubble_ratio": tess.bubble_ratio,
        "makespan": tess.makespan, "makespan_lower_bound": res.makespan_lower_bound,
        "lower_bound_placement": pl.name, "time_unit": pm.get("time_unit"),
        "tokens_per_second": pm.get("tokens_per_second"),
        "peak_memory": [unit_mem(x) for x in tess.peak_memory], "search_time": res.search_time,
        "completion_time": res.completion_time, "total_time": res.total_time, "optimal": res.optimal,
        "optimal_at_resolution": res.optimal_at_resolution, "rounded": res.rounded, "resolution": res.resolution,
        "wall_guard_hit": res.wall_guard_hit,
        "faster_row": None if faster is None else {"schedule": faster.name, "makespan": faster.makespan},
        "timed_out": res.timed_out, "window_micro_batches": res.repetend.micro_batches,
        "baselines": {r.name: {**r.to_dict(), "peak_memory": [unit_mem(x) for x in (r.peak_memory or [])],
                               "placement": r.schedule.placement.name if r.schedule is not None else None}
                      for r in rows[1:]},
        **(report_fields(found.plan, pm) if found.model_search is not None else {}),
    }
