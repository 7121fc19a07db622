"""Tessel search benchmark: abstract shapes on 4-32 devices under memory limits, real models with
transfers, and exact optima for small m.

(a) ``abstract``: V, X, M, NN, K (``--shapes``) on 4, 8, 16 and 32 devices (``--devices``), F=1,
B=2 per block, memory in units of one segment's activations (counted in halves internally, so
interleaved half-segments stay integral). Two limits per case: ``loose`` = the peak of the
memory-aware 1F1B policy for 16 micro-batches, ``tight`` = halfway between the memory floor (one
micro-batch at a time) and that. Each search gets the time limit of its device count
(``--time-limits``, default 4=1,8=10,16=10,32=30 seconds: the targets). Per row: the search's own
phases (``search s``: repetend; ``total s``: with the completion, as ``tessel_search`` measures
them), the period against its bound (busiest device, Little's law on memory), the makespan for
``m`` micro-batches of Tessel's own schedule (``tessel``) and of what ``tessel_search(...,
fallback_baselines=True)`` returns (``final``: the memory-aware 1F1B or GPipe policy where one is
shorter and fits the limit), the makespan lower bound (``lb``) and the gap to it.

(b) ``models``: ``gpt2`` and ``llama-7b`` (``--models``; ``MODEL@LINK`` for another link between
the ranks, by default also gpt2 over a 10 Gbit/s Ethernet link and llama-7b over InfiniBand) on
the H100 table with its links, shapes
``--model-shapes`` on ``--model-devices`` devices, through ``engine.plan.model_search.model_search_plan``
as ``tessel search --model`` runs it. ``search ms`` is the search's makespan (the step it
predicts, transfers, optimizer step and tied all-reduce included), ``plan ms`` the written plan's
predicted makespan after ``save_plan``/``load_plan`` (what ``tessel show`` prints), ``solver ms``
the search's own tick model (durations and transfer lags in solver ticks) and ``blind ms`` the
plan a communication-blind search (``comm=None``) writes, predicted the same way.

(c) ``exact``: on 4 devices, the exact optimum (``engine.tessel.exact_schedule``, CP-SAT on the
whole schedule) for a small ``m`` (``--exact-m``) next to the bound and Tessel for that ``m``: where
the exact optimum is above the bound, that part of the gap is the bound's.

Targets (issue 21): makespan at m=64 within 5% of the makespan lower bound (or of the exact
optimum where the bound is shown loose); search + completion under 1 s on 4 devices, 10 s on 8 and
16, 30 s on 32; the search's makespan equal to the written plan's.

Usage: ``python benchmarks/tessel_bench.py [--json] [--part abstract,models,exact] [--shapes v,x,m,nn,k]
[--devices 4,8,16,32] [--time-limits 4=1,8=10,16=10,32=30] [--micro-batches 64] [--models gpt2,llama-7b]
[--model-shapes v,m,x] [--model-devices 4] [--exact-m 8] [--exact-time-limit 30]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.baselines.generic import gpipe_any, one_f_one_b_any  # noqa: E402
from engine.plan.compare import measure  # noqa: E402
from engine.shapes import make_shape  # noqa: E402
from engine.tessel import exact_schedule, makespan_lower_bound, memory_floor, tessel_search  # noqa: E402

HALF = 2
GAP_TARGET = 0.05
TIME_TARGETS = {4: 1.0, 8: 10.0, 16: 10.0, 32: 30.0}


def limits_for(pl) -> list[tuple[str, float]]:
    """``[("loose", limit), ("tight", limit)]`` in the placement's half units."""
    loose = float(max(measure(one_f_one_b_any(pl, 16)).peak_memory))
    floor = float(max(memory_floor(pl)))
    tight = float(max(floor, HALF * round((floor + loose) / 2 / HALF)))
    return [("loose", loose), ("tight", tight)]


def best_policy(pl, m: int, limit: float) -> tuple[str | None, float | None]:
    """The shortest of the memory-aware 1F1B and GPipe policies that fits ``limit``."""
    best: tuple[str | None, float | None] = (None, None)
    policies = (("1f1b", lambda: one_f_one_b_any(pl, m, memory_limit=limit)), ("gpipe", lambda: gpipe_any(pl, m)))
    for name, build in policies:
        try:
            t = measure(build(), limit)
        except Exception:  # noqa: BLE001 - a policy that cannot run under the limit is not a candidate
            continue
        if not t.over_limit and (best[1] is None or t.makespan < best[1]):
            best = (name, t.makespan)
    return best


def abstract_case(shape: str, n: int, limit_name: str, limit: float, time_limit: float, m: int) -> dict:
    pl = make_shape(shape, n, activation=HALF)
    t0 = time.perf_counter()
    res = tessel_search(pl, m, memory_limit=limit, time_limit=time_limit, fallback_baselines=True)
    wall = time.perf_counter() - t0
    final = measure(res.schedule, limit)
    assert not final.over_limit, (shape, n, limit_name)
    tmeta = res.schedule.meta["tessel"]
    own = tmeta["pure_makespan"]
    lb = res.makespan_lower_bound
    base_name, base_mk = best_policy(pl, m, limit)
    return {
        "shape": shape.upper(), "devices": n, "limit_name": limit_name, "memory_limit": limit / HALF, "m": m,
        "time_limit": time_limit, "search_s": res.search_time, "completion_s": res.completion_time,
        "total_s": res.total_time, "wall_s": wall, "period": res.period, "period_lb": res.period_lower_bound,
        "window_micro_batches": res.repetend.micro_batches, "optimal": res.optimal, "timed_out": res.timed_out,
        "wall_guard_hit": res.wall_guard_hit, "tessel": own, "final": final.makespan,
        "final_is": tmeta.get("equals_baseline", "tessel"), "completion": tmeta["completion"],
        "lower_bound": lb, "gap": final.makespan / lb - 1, "tessel_gap": own / lb - 1,
        "best_policy": base_name, "best_policy_makespan": base_mk,
        "gap_met": final.makespan <= (1 + GAP_TARGET) * lb + 1e-9,
        "time_met": res.total_time <= TIME_TARGETS.get(n, time_limit) + 1e-9,
    }


def exact_case(shape: str, n: int, limit_name: str, limit: float, m: int, time_limit: float,
               search_time_limit: float) -> dict:
    pl = make_shape(shape, n, activation=HALF)
    res = tessel_search(pl, m, memory_limit=limit, time_limit=search_time_limit, fallback_baselines=True)
    tessel = measure(res.schedule, limit).makespan
    ex = exact_schedule(pl, m, memory_limit=limit, time_limit=time_limit, hint=res.schedule)
    lb = makespan_lower_bound(pl, m, memory_limit=limit)
    return {"shape": shape.upper(), "devices": n, "limit_name": limit_name, "memory_limit": limit / HALF, "m": m,
            "lower_bound": lb, "tessel": tessel, "exact_status": ex.status, "exact": ex.makespan,
            "exact_lower_bound": ex.lower_bound, "exact_wall_s": ex.wall_time,
            "bound_gap": (ex.lower_bound / lb - 1) if lb else None,
            "tessel_vs_exact": (tessel / ex.makespan - 1) if ex.makespan else None}


def model_case(model: str, shape: str, n: int, m: int, time_limit: float, device_type: str,
               link: str | None = None) -> dict:
    from engine.io import load_plan, save_plan
    from engine.plan.metrics import predicted_metrics
    from engine.plan.model_search import model_search_plan

    t0 = time.perf_counter()
    sp = model_search_plan(model, shape, n, m, device_type=device_type, time_limit=time_limit, link=link)
    wall = time.perf_counter() - t0
    res = sp.result
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        save_plan(sp.plan, path)
        plan_mk = predicted_metrics(load_plan(path))["makespan"]
    blind = model_search_plan(model, shape, n, m, device_type=device_type, time_limit=time_limit, link=link,
                              comm=None, tail=None, evaluate=None)
    blind_mk = predicted_metrics(blind.plan)["makespan"]
    return {"model": model, "link": link or "default", "shape": shape.upper(), "devices": n, "m": m,
            "device_type": device_type,
            "time_limit": time_limit, "search_makespan": res.makespan, "plan_makespan": plan_mk,
            "solver_makespan": res.solver_makespan, "blind_search_makespan": blind.result.makespan,
            "blind_plan_makespan": blind_mk, "lower_bound": res.makespan_lower_bound, "resolution": res.resolution,
            "period": res.period, "period_lb": res.period_lower_bound, "search_s": res.search_time,
            "total_s": res.total_time, "wall_s": wall,
            "search_equals_plan": abs(res.makespan - plan_mk) <= 1e-9 * plan_mk,
            "solver_vs_plan": res.solver_makespan / plan_mk - 1, "gain_vs_blind": blind_mk / plan_mk - 1,
            "gap": plan_mk / res.makespan_lower_bound - 1}


def parse_time_limits(text: str) -> dict[int, float]:
    out = {}
    for item in text.split(","):
        k, v = item.split("=")
        out[int(k)] = float(v)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--part", default="abstract,models,exact")
    ap.add_argument("--shapes", default="v,x,m,nn,k")
    ap.add_argument("--devices", default="4,8,16,32")
    ap.add_argument("--time-limits", default="4=1,8=10,16=10,32=30")
    ap.add_argument("--micro-batches", type=int, default=64)
    ap.add_argument("--models", default="gpt2,gpt2@10gbit,llama-7b,llama-7b@infiniband",
                    help="MODEL or MODEL@LINK (engine.cost.parse_link: nvlink, pcie, infiniband, 10gbit@5us, ...)")
    ap.add_argument("--model-shapes", default="v,m,x")
    ap.add_argument("--model-devices", default="4")
    ap.add_argument("--model-time-limit", type=float, default=10.0)
    ap.add_argument("--device-type", default="h100")
    ap.add_argument("--exact-m", type=int, default=8)
    ap.add_argument("--exact-time-limit", type=float, default=30.0)
    args = ap.parse_args(argv)
    parts = set(args.part.split(","))
    limits = parse_time_limits(args.time_limits)
    shapes = args.shapes.split(",")
    log = (lambda s: None) if args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    out: dict = {"abstract": [], "models": [], "exact": []}
    if "abstract" in parts:
        for n in (int(x) for x in args.devices.split(",")):
            for shape in shapes:
                pl = make_shape(shape, n, activation=HALF)
                for name, lim in limits_for(pl):
                    r = abstract_case(shape, n, name, lim, limits.get(n, 10.0), args.micro_batches)
                    out["abstract"].append(r)
                    log(f"  {r['shape']:<2} n={n:<2} {name:<5} {r['memory_limit']:>4g}: total {r['total_s']:.2f} s, "
                        f"period {r['period']:.3g} ({r['period_lb']:.3g}), final {r['final']:.0f} "
                        f"lb {r['lower_bound']:.0f} gap {r['gap']:.1%}")
    if "exact" in parts and args.exact_m > 0:
        for shape in shapes:
            pl = make_shape(shape, 4, activation=HALF)
            for name, lim in limits_for(pl):
                r = exact_case(shape, 4, name, lim, args.exact_m, args.exact_time_limit, limits.get(4, 1.0))
                out["exact"].append(r)
                log(f"  exact {r['shape']:<2} {name:<5} m={r['m']}: lb {r['lower_bound']:.1f} "
                    f"exact {r['exact_status']} {r['exact']} (>= {r['exact_lower_bound']:.1f}) "
                    f"tessel {r['tessel']:.0f}")
    if "models" in parts:
        for spec in args.models.split(","):
            model, _, link = spec.partition("@")
            for shape in args.model_shapes.split(","):
                for n in (int(x) for x in args.model_devices.split(",")):
                    r = model_case(model, shape, n, args.micro_batches, args.model_time_limit, args.device_type,
                                   link or None)
                    out["models"].append(r)
                    log(f"  {model} {r['shape']} n={n}: search {r['search_makespan'] * 1e3:.3f} ms plan "
                        f"{r['plan_makespan'] * 1e3:.3f} ms solver {r['solver_makespan'] * 1e3:.3f} ms blind "
                        f"{r['blind_plan_makespan'] * 1e3:.3f} ms")
    rows = out["abstract"]
    summary = {
        "abstract_cases": len(rows),
        "within_5pct_of_bound": sum(r["gap_met"] for r in rows),
        "within_time_target": sum(r["time_met"] for r in rows),
        "max_total_s_by_devices": {str(n): max(r["total_s"] for r in rows if r["devices"] == n)
                                   for n in sorted({r["devices"] for r in rows})},
        "model_cases": len(out["models"]),
        "search_equals_plan": sum(r["search_equals_plan"] for r in out["models"]),
        "max_solver_vs_plan": max((abs(r["solver_vs_plan"]) for r in out["models"]), default=None),
        "exact_cases": len(out["exact"]),
        "exact_above_bound": sum(1 for r in out["exact"] if r["exact_status"] in ("optimal", "optimal_at_resolution")
                                 and r["exact"] > r["lower_bound"] * (1 + 1e-9)),
    }
    out["summary"] = summary
    if args.json:
        print(json.dumps(out))
        return 0
    if rows:
        hdr = (f"{'shape':<5} {'n':>2} {'limit':>10} {'T s':>4} {'search s':>8} {'total s':>7} {'period (lb)':>13} "
               f"{'r':>2} {'tessel':>7} {'final':>11} {'lb':>7} {'gap':>6} {'best policy':>12}")
        print(hdr)
        print("-" * len(hdr))
        for r in rows:
            fin = f"{r['final']:.0f}" + ("" if r["final_is"] == "tessel" else f" {r['final_is']}")
            pol = f"{r['best_policy']} {r['best_policy_makespan']:.0f}" if r["best_policy"] else "-"
            print(f"{r['shape']:<5} {r['devices']:>2} {r['limit_name'] + ' ' + format(r['memory_limit'], 'g'):>10} "
                  f"{r['time_limit']:>4g} {r['search_s']:>8.2f} {r['total_s']:>7.2f} "
                  f"{format(r['period'], '.3g') + ' (' + format(r['period_lb'], '.3g') + ')':>13} "
                  f"{r['window_micro_batches']:>2} {r['tessel']:>7.0f} {fin:>11} {r['lower_bound']:>7.1f} "
                  f"{r['gap']:>6.1%} {pol:>12}")
        print()
    if out["exact"]:
        hdr = (f"{'shape':<5} {'limit':>10} {'m':>3} {'lb':>7} {'exact':>8} {'proven >=':>9} {'tessel':>7} "
               f"{'exact s':>7}")
        print(hdr)
        print("-" * len(hdr))
        for r in out["exact"]:
            ex = "-" if r["exact"] is None else f"{r['exact']:.0f}"
            print(f"{r['shape']:<5} {r['limit_name'] + ' ' + format(r['memory_limit'], 'g'):>10} {r['m']:>3} "
                  f"{r['lower_bound']:>7.1f} {ex + ('*' if r['exact_status'].startswith('optimal') else ''):>8} "
                  f"{r['exact_lower_bound']:>9.1f} {r['tessel']:>7.0f} {r['exact_wall_s']:>7.1f}")
        print("(* proven optimal)")
        print()
    if out["models"]:
        hdr = (f"{'model':<9} {'link':<10} {'shape':<5} {'n':>2} {'search ms':>10} {'plan ms':>10} {'solver ms':>10} "
               f"{'blind ms':>10} {'lb ms':>10} {'total s':>7}")
        print(hdr)
        print("-" * len(hdr))
        for r in out["models"]:
            print(f"{r['model']:<9} {r['link']:<10} {r['shape']:<5} {r['devices']:>2} "
                  f"{r['search_makespan'] * 1e3:>10.3f} "
                  f"{r['plan_makespan'] * 1e3:>10.3f} {r['solver_makespan'] * 1e3:>10.3f} "
                  f"{r['blind_plan_makespan'] * 1e3:>10.3f} {r['lower_bound'] * 1e3:>10.3f} {r['total_s']:>7.2f}")
        print()
    for k, v in summary.items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
