"""Choose the parallel configuration: search tensor, pipeline and data-parallel degrees (data
parallelism replicated, fully sharded or hybrid), virtual stages, micro-batch size, schedule,
recomputation and CoCoNet's transformations for a model on a cluster, rank them by predicted
throughput, and write the best as ``plan.json`` (ready for ``tessel launch``), its trace and
schedule, the whole table as ``tune.csv``, and the winner as a torchtitan job config and
Megatron-LM arguments."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm import tqdm

from apps.arg_types import (
    LINK_HELP,
    PRECISION_HELP,
    link_name,
    memory_limit,
    positive_float,
    positive_int,
    precision_name,
    recompute_names,
)
from apps.cmd_plan import plan_files
from apps.output import table
from engine.baselines import SCHEDULES
from engine.cost import CostModel
from engine.cost.calibrate import Calibration, layout_calibration
from engine.errors import NothingFitsError, TesselError, TuneError
from engine.io import load_plan
from engine.io.atomic import atomic_write_files, check_output_folder
from engine.tune.export import runtime_config_texts
from engine.tune.report import TABLE_HEADERS, csv_text, nothing_fits_advice, table_row, why_runner_up_loses
from engine.tune.space import DEFAULT_SCHEDULES, TuneSpace

HELP = "choose tp/pp/dp (FSDP, HSDP), micro-batch size, schedule and recomputation for a model on N GPUs"

#: The files ``tessel tune`` writes into its ``-o`` folder, all or none.
OUTPUT_FILES = ("plan.json", "trace.json", "schedule.csv", "tune.csv", "torchtitan.toml", "megatron_args.sh")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive whole numbers separated by commas, got {text!r}")
    return values


def _schedule_list(text: str) -> tuple[str, ...]:
    names = tuple(x.strip().lower() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in SCHEDULES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown schedule(s) {', '.join(bad) or text!r}; "
                                         f"valid: {', '.join(SCHEDULES)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="built-in name (see `tessel models`) or module:callable")
    p.add_argument("--model-config", default=None, metavar="PATH",
                   help="a Hugging Face config.json (or a folder holding one), e.g. configs/hf/llama-3-8b")
    p.add_argument("--gpus", type=positive_int, required=True, help="devices in all (tp x pp x dp)")
    p.add_argument("--gpus-per-node", type=positive_int, default=8,
                   help="devices per node; tensor parallelism stays inside a node (default 8)")
    p.add_argument("--device-type", default="h100", help="cost table: h100, a100, cpu (default h100)")
    p.add_argument("--global-batch", type=positive_int, required=True,
                   help="sequences (samples) per optimizer step, the same for every configuration")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sample (model default)")
    p.add_argument("--precision", type=precision_name, default=None, help=PRECISION_HELP)
    p.add_argument("--memory-limit", type=memory_limit, default=None,
                   help="GiB per device (default: the device's capacity)")
    p.add_argument("--link", type=link_name, default=None, help=LINK_HELP)
    p.add_argument("--micro-batch-sizes", type=_int_list, default=(1, 2, 4), metavar="B[,B...]",
                   help="micro-batch sizes to try (default 1,2,4)")
    p.add_argument("--schedules", type=_schedule_list, default=None, metavar="S[,S...]",
                   help="schedules to try (default gpipe,1f1b,interleaved,zb-h1,looped-bfs,dualpipev)")
    p.add_argument("--recompute", type=recompute_names, default=("none", "selective", "full"), metavar="G[,G...]",
                   help="recomputation granularities to try (default none,selective,full)")
    p.add_argument("--max-tp", type=positive_int, default=None, help="largest tensor degree (default: GPUs per node)")
    p.add_argument("--max-pp", type=positive_int, default=None, help="largest pipeline degree")
    p.add_argument("--host-cores", type=positive_int, default=None, metavar="N",
                   help="CPU cores each node's ranks share (CPU ranks, e.g. 2 for 4 ranks on this machine): a "
                        "step is then at least the node's CPU work over N cores (default: a core per rank)")
    p.add_argument("--no-sharded-update", action="store_true", help="do not try the sharded update (ZeRO-1)")
    p.add_argument("--no-sequence-parallel", action="store_true", help="do not try tp-split (sequence parallelism)")
    p.add_argument("--no-overlap-grad-sync", action="store_true", help="do not try overlapped gradient sync")
    p.add_argument("--no-fully-sharded", action="store_true",
                   help="do not try fully sharded data parallelism (by default tried where dp > 1: FSDP2/ZeRO-3 "
                        "over every data-parallel rank, and HSDP sharded over a node's GPUs and replicated across "
                        "nodes; torchtitan's data_parallel_shard_degree and data_parallel_replicate_degree)")
    p.add_argument("--adama", action="store_true", help="also try AdamA (gradients folded into Adam's states)")
    p.add_argument("--profile", action="store_true",
                   help="time the model's ops on this machine (cached) and rank with the measured times "
                        "(with --device-type cpu here)")
    p.add_argument("--calibration", default=None, metavar="PLAN", action="append",
                   help="a plan calibrated by `tessel launch PLAN --calibrate` (its .calibrated.json): rank with its "
                        "cost model (op profile included), its measured communication and optimizer costs and its "
                        "measured compute scale; repeat it with launches of other layouts: each candidate takes "
                        "the one of its (dp, tp, pp) and micro-batch size, else of its (dp, tp, pp), else of its pp, "
                        "else of its dp, else the first; several launches of one layout are pooled (their median), and "
                        "a layout launched both with a split backward (ZB-H1) and without predicts each backward "
                        "kind with its own compute scale, and a launch of a recomputing plan its recomputing "
                        "candidates")
    p.add_argument("--launchable", action="store_true",
                   help="rank only configurations `tessel launch` runs here (the others are listed as refused, "
                        "with the runtime's reason)")
    p.add_argument("--time-limit", type=positive_float, default=None,
                   help="seconds for the search; candidates not visited by then are reported as such")
    p.add_argument("--top", type=positive_int, default=10, help="rows of the ranked table to print (default 10)")
    p.add_argument("--task", default=None, help="training task (default: the model's own)")
    p.add_argument("-o", "--output", default="out", help="output folder (default out/)")


def _space(args: argparse.Namespace) -> TuneSpace:
    return TuneSpace(gpus=args.gpus, global_batch=args.global_batch, gpus_per_node=args.gpus_per_node,
                     micro_batch_sizes=tuple(args.micro_batch_sizes),
                     schedules=tuple(args.schedules or DEFAULT_SCHEDULES), recompute=tuple(args.recompute),
                     sharded_update=not args.no_sharded_update, sequence_parallel=not args.no_sequence_parallel,
                     overlap_grad_sync=not args.no_overlap_grad_sync, fully_sharded=not args.no_fully_sharded,
                     optimizers=("adam", "adama") if args.adama else ("adam",), max_tp=args.max_tp, max_pp=args.max_pp,
                     host_cores=args.host_cores)


def _calibrated(paths: list[str] | None):
    """(cost model of the first file, ``{(dp, tp, pp, micro_batch_size): calibration}``) of calibrated plan files, or
    ``(None, None)`` without one. Several files of one layout and backward kind (repeated profiling
    launches) are pooled (:meth:`Calibration.pooled`: the median of the launches); one layout's
    launches with a split backward (ZB-H1) and without become one calibration
    (:func:`layout_calibration`), each candidate predicted with its own kind's scale; launches of a
    recomputing plan become the layout's recompute variant (its recomputing candidates' calibration).

    Raises:
        TuneError: a plan holds no cost model or no calibration, or one file is given twice (one
            sentence naming the fix).
        TesselError: a file is not a readable plan.
    """
    if not paths:
        return None, None
    cost = None
    launches: dict[tuple, list[Calibration]] = {}
    seen: set[Path] = set()
    for path in paths:
        resolved = Path(path).resolve()
        if resolved in seen:
            raise TuneError(f"--calibration {path} is given twice; give each profiling launch's calibrated plan "
                            "once (several launches of one layout are pooled)")
        seen.add(resolved)
        plan = load_plan(path)
        cal = plan.meta.get("calibration")
        if not plan.cost or not cal:
            raise TuneError(f"--calibration {path} holds no {'cost model' if not plan.cost else 'calibration'}; give "
                            "the plan that `tessel launch PLAN --calibrate` wrote (PLAN.calibrated.json)")
        par = plan.parallel
        key = (int(par.dp), int(par.tp), int(par.pp), int(plan.model.micro_batch_size))
        cost = cost or CostModel.from_dict(plan.cost)
        launches.setdefault(key, []).append(Calibration.from_dict(cal))
    return cost, {key: layout_calibration(c) for key, c in launches.items()}


def _launch_refusal(plan) -> str:
    """Why ``tessel launch`` would refuse ``plan`` before Ray starts
    (:func:`runtime.stages.checks.check_executable`), or ``""``: the tuner plans for the cost
    model's devices, some of which this runtime does not execute yet."""
    from runtime.stages.checks import check_executable  # the runtime's check: loads its stage code

    try:
        check_executable(plan)
    except TesselError as e:
        return " ".join(str(e).split())
    return ""


def _output_texts(result, folder) -> dict[str, str]:
    """The texts of :data:`OUTPUT_FILES`: the best plan's (as ``tessel plan`` writes them), every
    row as CSV, and the plan as torchtitan and Megatron-LM take it (:mod:`engine.tune.export`)."""
    files = plan_files(result.best)
    files["tune.csv"] = csv_text(result)
    files.update(runtime_config_texts(result.best.plan, folder))   # its schedule.csv is the plan's
    return files


def run(args: argparse.Namespace) -> dict:
    """``tessel tune``: search, print the ranked table and the runner-up line, write :data:`OUTPUT_FILES`.

    Raises:
        TuneError: an empty space; :class:`NothingFitsError` when no candidate fits (the
            sentence names the smallest change that would).
        TesselError: an unknown model, precision or device.
    """
    from engine.models.hf_config import model_choice  # builds models: loads torch
    from engine.tune.tuner import tune  # captures models: loads torch

    model = model_choice(args.model, args.model_config)
    if model is None:
        raise TuneError("tessel tune needs a model: give --model NAME or --model-config PATH")
    out = check_output_folder(args.output, OUTPUT_FILES)
    space = _space(args)
    bar = None
    if not args.json and sys.stderr.isatty():
        bar = tqdm(unit="config", desc="tune", file=sys.stderr, leave=False)

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)

    t0 = time.perf_counter()
    limit = args.memory_limit * 2**30 if args.memory_limit is not None else None
    cost, calibration = _calibrated(args.calibration)
    try:
        result = tune(model, space, device_type=args.device_type, precision=args.precision, seq_len=args.seq_len,
                      task=args.task, memory_limit=limit, time_limit=args.time_limit, link=args.link,
                      keep=args.top, progress=progress, profile=args.profile, cost=cost, calibration=calibration,
                      admit=_launch_refusal if args.launchable else None)
    finally:
        if bar is not None:
            bar.close()
    if result.best is None:
        raise NothingFitsError(nothing_fits_advice(result))
    written = atomic_write_files(out, _output_texts(result, out))
    launchable = _launch_refusal(result.best.plan)
    counts = result.counts()
    print(f"{result.best.plan.model.name} on {space.gpus} x {args.device_type} ({space.gpus_per_node} per node), "
          f"global batch {space.global_batch}: {len(result.rows)} configurations, {counts['ok']} fit, "
          f"{counts['over memory'] + counts['memory bound']} over {result.memory_limit / 2**30:.1f} GiB, "
          f"{counts['dominated']} dominated by the bounds, {counts['refused']} refused"
          + (f", {counts['not visited']} not visited (time limit)" if counts["not visited"] else "")
          + (f"; {space.gpus_per_node} ranks per node share {space.host_cores} cores"
             if space.shares_cores else ""))
    shown = result.fitting()[:args.top]
    print(table(TABLE_HEADERS, [table_row(i + 1, r) for i, r in enumerate(shown)]))
    line = why_runner_up_loses(result)
    if line:
        print(line)
    print(f"Pareto front (throughput against peak memory): rows {', '.join(str(i + 1) for i in result.pareto)}")
    print(f"wrote {written['plan.json']} (tessel launch it), {written['trace.json']}, {written['tune.csv']}, "
          f"{written['torchtitan.toml']}, {written['megatron_args.sh']}")
    if launchable:
        print(f"warning: tessel launch cannot run the best plan on this runtime: {launchable}", file=sys.stderr)
    print(f"tuned in {time.perf_counter() - t0:.1f} s (captures: micro-batch sizes "
          f"{', '.join(map(str, result.captures))})")
    best = result.rows[0]
    return {"plan": str(written["plan.json"]), "files": {k: str(v) for k, v in written.items()},
            "best": best.to_dict(), "runner_up": line, "counts": counts, "wall_time": result.wall_time,
            "timed_out": result.timed_out, "pareto": [result.rows[i].to_dict() for i in result.pareto],
            "top": [r.to_dict() for r in shown], "launch_refusal": launchable or None}
