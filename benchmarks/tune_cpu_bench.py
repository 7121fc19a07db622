"""``tessel tune``'s ranking checked by measurement on this machine's CPU ranks (issue 34).

For each model and rank count, the tuner ranks a small space (pp x dp, micro-batch size 1 and 2,
GPipe / 1F1B / ZB-H1 / interleaved, no or full recomputation; tp 1: tensor parallelism on CPU
ranks is left to the model-family issue) with op times measured here (``tune(...,
profile=True)``, the cost model of ``tessel plan --profile``); then EVERY fitting candidate is
launched on Ray (gloo, one process per rank, ``torch.set_num_threads(1)``) for a few steps and
its median measured step time (steps after the first) is set beside the prediction.

Calibrated ranking (the default; ``--no-calibration`` leaves it out): profiling launches per
layout and micro-batch size ``(dp, tp, pp, mbs)`` of the space (of its first candidate in the
profiled ranking with a whole backward, of its first with a split backward, ZB-H1, and of its first
that recomputes activations; ``--profile-repeats`` launches of each, default ``--repeats``, pooled
into their median) are calibrated (``engine.plan.calibrate_plan``: the measured point-to-point, collective and optimizer
costs, and per block kind the measured over planned compute time), and the space is tuned again
with those calibrations (``tune(..., calibration={(dp, tp, pp, mbs): ...})``, as ``tessel tune
--calibration A.calibrated.json --calibration B.calibrated.json``); both rankings are compared
with the same measurements (the profiling launches are not among them).

Printed per model and rank count: the candidates, the tuner's pick and its measured time, the
measured best, the pick's distance from it (target: within 5%), Spearman's rank correlation of
predicted against measured step times (target: at least 0.8) and the tuner's wall time.

A candidate the planner accepts but the runtime cannot run (recomputation on a model whose stages
are exported graphs: the model-family issue; GPT-2, Llama and the two-tower model all recompute)
is listed as not executable and left out.

Ranks that outnumber the cores (4 ranks on 2 cores) share them; the space says so
(``TuneSpace.host_cores``, this machine's cores), and a candidate's predicted step is at least
its ranks' summed compute over the cores (:mod:`engine.plan.core_sharing`), the calibrated one
likewise.

Usage: ``python benchmarks/tune_cpu_bench.py [--json] [--models llama-32k-cpu,two-tower-tiny,gpt2-small-cpu]
[--ranks 2,4] [--steps 5] [--micro-batch-sizes 1,2] [--repeats 1] [--profile-repeats R]
[--measured-from JSON] [--no-calibration]``; ``--report JSON ...`` prints the table of earlier runs.

One launch's median step is a noisy measurement here: the same candidate measured twice differs by
10-25% (ranks sharing two cores, Python, the allocator), and the machine's speed can drift (by
20-30% within one run of 35 minutes). ``--repeats R`` launches every candidate R times and ranks against the
median; the launches run in passes, each every candidate and every profiled plan once in an order
shuffled per pass, so the drift falls on calibrations and measurements alike. The table's
``retest`` column is the Spearman of the first pass against the second, which bounds what any
predictor can reach against one pass; ``p`` says whether the pick's launches are measurably
slower than the best's (a one-sided Mann-Whitney U test).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402
from scipy.stats import mannwhitneyu, spearmanr  # noqa: E402

from engine.baselines import placement_requirements  # noqa: E402
from engine.cost.calibrate import Calibration, layout_calibration  # noqa: E402
from engine.errors import TesselError  # noqa: E402
from engine.layout import RankLayout  # noqa: E402
from engine.plan import calibrate_plan, make_plan, with_calibration  # noqa: E402
from engine.plan.core_sharing import shared_core_step_time  # noqa: E402
from engine.tune import TuneSpace, tune  # noqa: E402
from engine.tune.tuner import calibration_for  # noqa: E402
from runtime import launch  # noqa: E402
from runtime.config import LaunchConfig  # noqa: E402
from runtime.stages.checks import check_executable  # noqa: E402

#: Per model: global batch (samples) and sequence length of the space.
MODELS = {"llama-32k-cpu": (8, 64), "two-tower-tiny": (8, 64), "gpt2-small-cpu": (8, 64)}
#: Targets: the pick's measured time within this fraction of the measured best; Spearman at least.
PICK_WITHIN = 0.05
SPEARMAN = 0.8
#: The pick is measurably slower than the measured best when a one-sided Mann-Whitney U test of
#: their launches rejects "not slower" at this level (with three launches each: every launch of
#: the pick slower than every launch of the best, p = 1/20).
SIGNIFICANCE = 0.05


def _space(ranks: int, batch: int, mbs: tuple[int, ...] = (1, 2)) -> TuneSpace:
    """The space on ``ranks`` ranks of this machine, whose cores they share (``host_cores``)."""
    return TuneSpace(gpus=ranks, global_batch=batch, gpus_per_node=ranks, micro_batch_sizes=mbs,
                     host_cores=os.cpu_count() or 1,
                     schedules=("gpipe", "1f1b", "zb-h1", "interleaved"), recompute=("none", "full"), max_tp=1,
                     sharded_update=False, sequence_parallel=False, overlap_grad_sync=False, fully_sharded=False)


def _plan(model: str, c, seq: int):
    return make_plan(model, devices=c.gpus, dp=c.dp, tp=c.tp, dp_shard=c.dp_shard, micro_batches=c.micro_batches,
                     micro_batch_size=c.micro_batch_size, schedule=c.schedule, virtual_stages=c.virtual_stages,
                     recompute=c.recompute, seq_len=seq, device_type="cpu", profile=True).plan


def _launch(plan, steps: int, keep: int = 0):
    return launch(plan, LaunchConfig(steps=steps, device="cpu", keep_timelines=keep or steps, step_timeout=300))


def _profiled_candidates(res, plan_of) -> list:
    """The candidates profiled per layout and micro-batch size ``(dp, tp, pp, mbs)`` of the
    fitting ones: its first in the profiled ranking that the runtime runs
    (``runtime.stages.checks.check_executable``) with a whole backward (``B``), its first with a
    split one (``I``, ``W``) and its first that recomputes activations (of either kind; its
    layout's recompute variant), where the space has them. ``plan_of(candidate)``: its plan."""
    chosen: dict[tuple, list] = {}
    for r in res.fitting():
        c = r.candidate
        key = (c.dp, c.tp, c.pp, c.micro_batch_size)
        kind = (placement_requirements(c.schedule).split_backward, c.recompute != "none")
        if any(k == kind or (k[1] and kind[1]) for k, _ in chosen.get(key, [])):
            continue
        try:
            check_executable(plan_of(c))
        except TesselError:
            continue
        chosen.setdefault(key, []).append((kind, c))
    return [c for got in chosen.values() for _, c in got]


def _profiling_check(plan, out, c) -> tuple[Calibration, dict]:
    """One profiling launch's calibration (``calibrate_plan`` of its steps after the first) and its
    check (``CalibrationCheck.to_dict`` with the step residual)."""
    cores = os.cpu_count() or 1
    check = calibrate_plan(plan, out.timelines[1:], shared_cores=cores if c.gpus > cores else None)
    cal = Calibration.from_dict(check.plan.meta["calibration"])
    return cal, {"label": c.label(), **check.to_dict(), "step_residual": cal.step_residual,
                 "recompute": cal.recompute}


def _for(cal: Calibration | None, c) -> Calibration | None:
    """The calibration candidate ``c`` is predicted with (its recompute variant where it recomputes)."""
    return None if cal is None else cal.for_plan(c.recompute != "none")


def _calibrated(plan, cal: Calibration | None) -> float:
    """The plan's step time with ``cal`` as the tuner applies it (its per-segment block times left
    out, times its step residual; ``tune(..., calibration=)`` predicts each candidate so, checked in
    tests/engine/test_tune.py);
    NaN without a calibration."""
    if cal is None:
        return math.nan
    tl = with_calibration(plan, cal.transferable())[1]
    par, cores = plan.parallel, os.cpu_count() or 1
    return shared_core_step_time(tl, RankLayout(par.tp, par.dp, par.pp, par.layout), par.devices,
                                 cores) * cal.residual_of(plan.placement.split_backward)


def _ranking(rows: list[dict], key: str, order: list[str]) -> dict:
    """Spearman of ``rows[key]`` against the measured times, and the tuner's pick: the first label
    of ``order`` (the tuner's ranking, its tie-breaks included) among the launched rows; its
    p-value against the measured best (:func:`_slower_p`), and how many candidates (the best
    included) are not measurably slower than the best (NaN p-values, one launch each, count)."""
    pred = [x[key] for x in rows]
    meas = [x["measured"] for x in rows]
    rho = float(spearmanr(pred, meas).statistic) if len(rows) > 2 else float("nan")
    best = min(rows, key=lambda x: x["measured"])
    by_label = {x["label"]: x for x in rows}
    pick = next(by_label[label] for label in order if label in by_label)
    gap = pick["measured"] / best["measured"] - 1
    p = _slower_p(pick["runs"], best["runs"]) if pick is not best else 1.0
    ties = _ties(rows, best)
    return {"pick": pick, "measured_best": best, "pick_gap": gap, "spearman": rho, "pick_slower_p": p,
            "not_measurably_slower_than_best": ties,
            "targets": {"pick_within_5pct": gap <= PICK_WITHIN, "spearman_0_8": rho >= SPEARMAN,
                        "at_least_12": len(rows) >= 12, "pick_not_measurably_slower": p > SIGNIFICANCE}}


def _ties(rows: list[dict], best: dict) -> int:
    """How many of ``rows`` (the best included) are not measurably slower than ``best``
    (:func:`_slower_p` above :data:`SIGNIFICANCE`, or NaN)."""
    return sum(1 for x in rows if x["label"] == best["label"] or not _slower_p(x["runs"], best["runs"]) <= SIGNIFICANCE)


def _slower_p(pick: list[float], best: list[float]) -> float:
    """The p-value of "the pick's launches are slower than the best's": a one-sided exact
    Mann-Whitney U test (``scipy.stats.mannwhitneyu``) of the two candidates' measured step times
    (seconds, one per launch). Small: the pick is measurably slower; with three launches each the
    smallest possible value is 1/20, every launch of the pick slower than every launch of the best.
    The best was chosen as the fastest median of all candidates, which biases the test towards
    "slower"; NaN with fewer than two launches of either."""
    if len(pick) < 2 or len(best) < 2:
        return math.nan
    return float(mannwhitneyu(pick, best, alternative="greater", method="exact").pvalue)


def _repeat_oracle(rows: list[dict], checks: list[dict]) -> dict | None:
    """The noise floor of the pick: among the profiled candidates, the one whose profiling
    launches measured fastest (their median), and its measured time's distance from the measured
    best. It is the pick of an oracle that knows each of those plans from its own profiling
    launches (``--profile-repeats`` of them), what no predictor calibrated on them can beat;
    ``None`` without profiling launches."""
    by_label = {x["label"]: x for x in rows}
    launches: dict[str, list[float]] = {}
    for c in checks:
        if c["label"] in by_label:
            launches.setdefault(c["label"], []).append(c["measured_makespan"])
    if not launches:
        return None
    label = min(launches, key=lambda k: statistics.median(launches[k]))
    best = min(rows, key=lambda x: x["measured"])
    pick = by_label[label]
    return {"pick": label, "profiling_median": statistics.median(launches[label]),
            "measured": pick["measured"], "pick_gap": pick["measured"] / best["measured"] - 1,
            "pick_slower_p": _slower_p(pick["runs"], best["runs"]) if pick is not best else 1.0}


def _test_retest(rows: list[dict]) -> float:
    """Spearman of the first against the second repeat's measured times (NaN with one repeat): how
    well one launch's measurement ranks the candidates the same way again, the ceiling a predictor
    compared with one measurement can reach (about its square root)."""
    if len(rows) < 3 or any(len(x["runs"]) < 2 for x in rows):
        return float("nan")
    return float(spearmanr([x["runs"][0] for x in rows], [x["runs"][1] for x in rows]).statistic)


def measure(model: str, ranks: int, steps: int, calibrated: bool = True, mbs: tuple[int, ...] = (1, 2),
            repeats: int = 1, profile_repeats: int = 1, measured: dict | None = None) -> dict:
    """Tune ``model`` on ``ranks`` CPU ranks (profiled op times), launch every fitting candidate
    ``repeats`` times and compare with the median of its launches; with ``calibrated``, also launch
    the profiled candidates (:func:`_profiled_candidates`) ``profile_repeats`` times each, pool
    each layout's launches (``layout_calibration``, as ``tessel tune --calibration A --calibration
    B ...`` takes them) and tune again with them. With ``measured`` (an earlier result of this
    model and rank count) its candidates' measured launches are taken instead of launching them
    again.

    The launches run in passes, each pass every candidate once (while ``repeats`` lasts) and every
    profiled candidate once (while ``profile_repeats`` lasts), in an order shuffled per pass: this
    machine's speed can drift, and a calibration from launches made before the measured ones
    would carry the drift into the calibrated ranking (it did: in one run every profiling launch
    measured 20-30% slower than the same plan's measured launches after it)."""
    batch, seq = MODELS[model]
    t0 = time.perf_counter()
    res = tune(model, _space(ranks, batch, mbs), device_type="cpu", seq_len=seq, profile=True)
    tune_s = time.perf_counter() - t0
    plans: dict[str, object] = {}

    def plan_of(c):
        if c.label() not in plans:
            plans[c.label()] = _plan(model, c, seq)
        return plans[c.label()]

    profiled = _profiled_candidates(res, plan_of) if calibrated else []
    fitting = list(res.fitting())
    by_label: dict[str, dict] = {}
    refused: list[dict] = list(measured["not_executable"]) if measured else []
    earlier = {x["label"]: x["runs"] for x in measured["rows"]} if measured else {}
    launches: dict[tuple, list[Calibration]] = {}
    checks: list[dict] = []
    for rep in range(max(1 if measured else repeats, profile_repeats if profiled else 0)):
        jobs = [("profile", c) for c in profiled if rep < profile_repeats]
        jobs += [("measure", r) for r in fitting if rep < (1 if measured else repeats)]
        random.Random(rep).shuffle(jobs)
        for what, job in jobs:
            if what == "profile":
                try:
                    out = _launch(plan_of(job), max(steps, 4))
                except TesselError:
                    continue
                cal, check = _profiling_check(plan_of(job), out, job)
                launches.setdefault((job.dp, job.tp, job.pp, job.micro_batch_size), []).append(cal)
                checks.append(check)
                continue
            c = job.candidate
            if c.label() in {x["label"] for x in refused} or (measured and c.label() not in earlier):
                continue
            if measured:
                runs = earlier[c.label()]
            else:
                try:
                    out = _launch(plan_of(c), steps)
                except TesselError as e:   # planned, but the runtime cannot run it
                    refused.append({"label": c.label(), "why": " ".join(str(e).split())[:200]})
                    print(f"[tune_cpu_bench] {model}: {c.label()} not executable: {refused[-1]['why']}",
                          file=sys.stderr)
                    continue
                runs = [statistics.median([tl.makespan for tl in out.timelines[1:]] or [out.measured_makespan])]
            row = by_label.setdefault(c.label(), {"label": c.label(), "predicted": job.step_time, "runs": []})
            row["runs"].extend(runs)
            row["measured"] = statistics.median(row["runs"])
            print(f"[tune_cpu_bench] {model} on {ranks} ranks, pass {rep + 1}: {c.label()} predicted "
                  f"{job.step_time * 1e3:.1f} ms, measured {row['runs'][-1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    cals = {key: layout_calibration(got) for key, got in launches.items()}
    cal_res = None
    if cals:
        t0 = time.perf_counter()
        cal_res = tune(model, _space(ranks, batch, mbs), device_type="cpu", seq_len=seq, profile=True, calibration=cals)
        tune_s_cal = time.perf_counter() - t0
    rows = [by_label[r.candidate.label()] for r in fitting if r.candidate.label() in by_label]
    for r in fitting:
        if r.candidate.label() in by_label:
            by_label[r.candidate.label()]["calibrated"] = _calibrated(plan_of(r.candidate),
                                                                      _for(calibration_for(cals, r.candidate),
                                                                           r.candidate))
    order = [r.candidate.label() for r in fitting]
    out_d = {"model": model, "ranks": ranks, "candidates": len(rows), "not_executable": refused,
             "tune_seconds": tune_s, "rows": rows, "repeats": len(rows[0]["runs"]) if rows else 0,
             "profile_repeats": profile_repeats, "measured_from": bool(measured),
             "test_retest_spearman": _test_retest(rows),
             "profiled": _ranking(rows, "predicted", order)}
    if cal_res is not None:
        out_d.update(calibrated=_ranking(rows, "calibrated", [r.candidate.label() for r in cal_res.fitting()]),
                     profiling_launches=[c.label() for c in profiled], profiling_checks=checks,
                     repeat_oracle=_repeat_oracle(rows, checks),
                     calibrations={"x".join(map(str, k)): v.to_dict() for k, v in cals.items()},
                     tune_seconds_calibrated=tune_s_cal,
                     calibrated_pick=next((r.candidate.label() for r in cal_res.fitting()), None))
    return out_d


def report(results: list[dict]) -> str:
    """The table: per model and rank count, the ranking by profiled op times and by the calibrated ones."""
    head = (f"{'model':<16} {'ranks':>5} {'cands':>5} {'costs':<10} {'tuner pick':<40} {'pick ms':>8} {'best ms':>8} "
            f"{'gap':>6} {'p':>5} {'ties':>4} {'Spearman':>8} {'retest':>6} {'oracle':>6} {'tune s':>6}")
    lines = [head, "-" * len(head)]
    for r in results:
        for costs, key, secs in (("profiled", "profiled", r["tune_seconds"]),
                                 ("calibrated", "calibrated", r.get("tune_seconds_calibrated", math.nan))):
            k = r.get(key)
            if k is None:
                continue
            p, ties = k.get("pick_slower_p"), k.get("not_measurably_slower_than_best")
            if p is None:   # an earlier run's result
                same = k["pick"]["label"] == k["measured_best"]["label"]
                p = 1.0 if same else _slower_p(k["pick"].get("runs", []), k["measured_best"].get("runs", []))
            if ties is None:
                ties = _ties(r["rows"], k["measured_best"])
            lines.append(f"{r['model']:<16} {r['ranks']:>5} {r['candidates']:>5} {costs:<10} {k['pick']['label']:<40} "
                         f"{k['pick']['measured'] * 1e3:8.1f} {k['measured_best']['measured'] * 1e3:8.1f} "
                         f"{k['pick_gap']:6.1%} {p:5.2f} {ties:4d} "
                         f"{k['spearman']:8.2f} "
                         f"{r.get('test_retest_spearman', math.nan):6.2f} "
                         f"{(r.get('repeat_oracle') or {}).get('pick_gap', math.nan):6.1%} {secs:6.1f}")
    lines.append(f"targets: the pick within {PICK_WITHIN:.0%} of the measured best, Spearman >= {SPEARMAN}, "
                 "at least 12 candidates; measured: median step (after the first) on Ray gloo ranks, the median "
                 "of --repeats launches; p: the one-sided Mann-Whitney p-value of the pick's launches being "
                 f"slower than the best's (at most {SIGNIFICANCE}: measurably slower); ties: the candidates not "
                 "measurably slower than the best, the best included; retest: Spearman of the first "
                 "launches against the second (the noise ceiling); oracle: the gap of the profiled plan whose "
                 "profiling launches were fastest (the pick of an oracle that knows those plans from launches of "
                 "their own); calibrated: tuned again with the calibrations of the profiling launches")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--models", default=",".join(MODELS), help="models (default all three)")
    ap.add_argument("--ranks", default="2,4", help="rank counts (default 2,4)")
    ap.add_argument("--steps", type=int, default=5, help="steps per launch, the first not measured (default 5)")
    ap.add_argument("--micro-batch-sizes", default="1,2", help="micro-batch sizes of the space (default 1,2)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="launches per candidate, measured as their median (default 1); with 2 or more the table "
                         "gives the test-retest Spearman of the first two and the pick's p-value")
    ap.add_argument("--profile-repeats", type=int, default=None,
                    help="profiling launches per layout and backward kind, pooled into its calibration (their "
                         "median; default: --repeats)")
    ap.add_argument("--measured-from", default=None, metavar="JSON",
                    help="rank against the measured launches of an earlier --json run of the same models and rank "
                         "counts instead of launching every candidate again (the profiling launches are new)")
    ap.add_argument("--report", default=None, metavar="JSON", action="append",
                    help="print the table of earlier --json runs (repeatable) and launch nothing")
    ap.add_argument("--no-calibration", action="store_true",
                    help="rank with profiled op times only (no profiling launch, no calibrated ranking)")
    args = ap.parse_args(argv)
    if args.report:
        try:
            results = [r for path in args.report for r in json.loads(Path(path).read_text())["results"]]
            for r in results:
                if r.get("profiling_checks") and "repeat_oracle" not in r:
                    r["repeat_oracle"] = _repeat_oracle(r["rows"], r["profiling_checks"])
            text = json.dumps({"results": results}) if args.json else report(results)
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--report: not a tune_cpu_bench --json result ({e})")
        print(text)
        return 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if any(m not in MODELS for m in models):
        ap.error(f"models are {', '.join(MODELS)}")
    ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    if args.repeats < 1 or (args.profile_repeats is not None and args.profile_repeats < 1):
        ap.error(f"--repeats and --profile-repeats must be at least 1, got {args.repeats} and {args.profile_repeats}")
    earlier = {}
    if args.measured_from:
        try:
            earlier = {(r["model"], r["ranks"]): r for r in json.loads(Path(args.measured_from).read_text())["results"]}
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--measured-from {args.measured_from} is not a tune_cpu_bench --json result ({e})")
        missing = [f"{m} on {r} ranks" for m in models for r in ranks if (m, r) not in earlier]
        if missing:
            ap.error(f"--measured-from {args.measured_from} holds no measurement of {', '.join(missing)}")
    mbs = tuple(int(x) for x in args.micro_batch_sizes.split(",") if x.strip())
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING")
    try:
        results = [measure(m, r, args.steps, not args.no_calibration, mbs, args.repeats,
                           args.profile_repeats or args.repeats, earlier.get((m, r))) for m in models for r in ranks]
    finally:
        ray.shutdown()
    print(json.dumps({"results": results}) if args.json else report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
