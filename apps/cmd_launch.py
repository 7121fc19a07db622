"""Train a plan on Ray actors (one per rank; gloo on CPU, NCCL on GPUs) for some steps and
compare the measured step with the prediction: per-rank step time, loss, validation loss,
tokens/s, a measured Perfetto trace next to the predicted one, and atomic checkpoints that
``--resume`` continues from. The data and loss are the plan's task (``--task`` overrides it:
``causal-lm``, ``masked-lm``, ``seq2seq``, ``image-classification`` or ``package.module:callable``);
throughput is reported in the task's unit (tokens/s, samples/s).

Several plans (``tessel launch a.json b.json --crossover``) are co-located on the same actors with
the CrossoverScheduler (``runtime.crossover``): pure data-parallel plans (pp = 1) of the same
world size; while one job all-reduces its gradients the other computes, through a per-device
compute token. ``--mode uncoordinated`` (no token) and ``--mode sequential`` (one job after the
other on the same actors) are the baselines. Several plans without ``--crossover``/``--mode`` are
refused (a user error, exit status 2) rather than silently run one way or the other. Each job
checkpoints into its own folder: ``<plan folder>/ckpt-<plan name>`` (or
``<--checkpoint-dir>/job<i>-<plan name>``). The report gives each job's and the aggregate
tokens/s, and the simulator's prediction (``engine.crossover``) where it is available.

A GNN plan (``tessel plan --gnn``, format ``tessel-gnn-plan``) is trained with
``runtime.gnn.launcher.launch_gnn`` for ``--epochs`` full-graph epochs (default: the plan's; its
learning rate and seed are the plan's): a table of every epoch's loss, accuracies and epoch time
measured against the plan's prediction, and a measured Perfetto trace (``gnn_trace.measured.json``
next to the plan, or ``--trace``).

Before any Ray work the plan is validated as ``tessel show`` does (``runtime.launcher.check_launchable``):
a deadlock, a backward before its forward or a micro-batch count its orders do not hold is one
sentence and exit status 2. ``--resume`` needs the folder to exist and hold a checkpoint; a damaged
checkpoint (a file that does not match the size and SHA-256 its ``meta.json`` recorded) is skipped
for the previous one with a warning. A rank that crashes or hangs, or a checkpoint that cannot be
written, exits with status 3. Ctrl-C lets the current step finish, checkpoints it and prints the
command that resumes from it (exit status 130; a second Ctrl-C stops at once). With ``--json`` the
output of Ray and its workers goes to stderr, so stdout holds the report and, last, the JSON object."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Iterator, TextIO

from apps.arg_types import non_negative_int, positive_float, positive_int
from apps.output import facts_line, fmt_bytes, fmt_ms, table
from engine.crossover import predict_colocated
from engine.errors import TesselError
from engine.gnn.plan import GNN_PLAN_FORMAT, load_gnn_plan
from engine.io import load_plan, save_plan, write_trace
from engine.plan.calibrate import calibrate_plan as calibrate_measured
from runtime.node_placement import ranks_by_node_text
from runtime.runner import LaunchInterrupted

HELP = "train a plan on Ray actors and compare measured with predicted step times"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", nargs="+",
                   help="path to plan.json (from `tessel plan` or `tessel search`); several with --crossover")
    p.add_argument("--crossover", action="store_true",
                   help="co-locate several data-parallel plans on the same actors, passing a per-device compute "
                        "token at their gradient all-reduces (same as --mode crossover)")
    p.add_argument("--mode", default=None, choices=("crossover", "uncoordinated", "sequential"),
                   help="how several plans share the actors: crossover (token), uncoordinated (free-running) or "
                        "sequential (one job after the other)")
    p.add_argument("--warmup-steps", type=non_negative_int, default=1,
                   help="co-located jobs: first steps of each job left out of tokens/s (default 1)")
    p.add_argument("--steps", type=positive_int, default=50,
                   help="total training steps; with --resume the checkpointed steps count (default 50)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--address", default=None, help="Ray cluster address (default: start a local cluster)")
    p.add_argument("--checkpoint-dir", default=None, help="checkpoint folder (default: ckpt/ next to the plan)")
    p.add_argument("--checkpoint-every", type=non_negative_int, default=10,
                   help="checkpoint every N steps; 0: only at the end (default 10)")
    p.add_argument("--eval-every", type=non_negative_int, default=10,
                   help="validation loss every N steps; 0: only at the end (default 10)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation seed (default 0)")
    p.add_argument("--task", default=None,
                   help="train on this task instead of the plan's: causal-lm, masked-lm, seq2seq, "
                        "image-classification, or package.module:callable (see `tasks.user`)")
    p.add_argument("--data-seed", type=int, default=0,
                   help="seed of the task's data split and batches (default 0)")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--step-timeout", type=positive_float, default=120.0,
                   help="seconds a rank may take for one step before the job counts as hung (default 120)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: NCCL on GPUs when the cluster has one per rank, else gloo on CPU (default auto)")
    p.add_argument("--optimizer", default=None, choices=("adam", "adama", "sgd"),
                   help="optimizer of the workers: adam, adama (AdamA: micro-batch gradients folded into "
                        "Adam's states and freed, less memory) or sgd (default: the plan's, adam)")
    p.add_argument("--calibrate", action="store_true",
                   help="after the run, calibrate the plan's block and optimizer times from the measured steps "
                        "(the first step excluded) and write <plan>.calibrated.json with the re-simulated prediction")
    p.add_argument("--epochs", type=positive_int, default=None,
                   help="GNN plans (`tessel plan --gnn`): full-graph training epochs (default: the plan's); the "
                        "learning rate and seed are the plan's")
    p.add_argument("--trace", default=None, help="measured trace path (default: trace.measured.json next to the plan; "
                                                 "co-located: crossover.measured.json next to the first plan)")
    p.add_argument("--release-freed-memory", action="store_true",
                   help="CPU ranks return freed tensors to the system, so the measured peak RSS follows the live "
                        "tensors and the 'RSS over baseline' column compares with the predicted peak (slower steps)")


def report(plan, res, *, plan_dir: Path, out: TextIO | None = None) -> dict:
    """Print the summary of a launch and return its JSON-able result.

    Args:
        plan: the launched ``engine.io.Plan``.
        res: the :class:`runtime.LaunchResult`.
        plan_dir: folder of the plan (where the predicted ``trace.json`` lives).
        out: where the summary is printed; ``None``: ``sys.stdout`` as it is at the call.
    """
    par = plan.parallel
    pp = res.pp
    say = lambda *a: print(*a, file=out)  # noqa: E731
    ran = len(res.losses)
    shape = f"{plan.model.micro_batch_size} x {plan.model.seq_len} tokens" if plan.model.seq_len \
        else f"{plan.model.micro_batch_size} samples"
    tp = f", tp={par.tp}" if par.tp > 1 else ""
    say(f"{plan.model.name}: {res.world_size} ranks (dp={res.dp}{tp}, pp={pp}), schedule {plan.schedule.name}, "
        f"task {res.task}, {par.micro_batches} micro-batches of {shape}, {facts_line(plan)}, "
        f"{res.backend} on {'GPUs' if res.backend == 'nccl' else 'CPU'}; "
        f"steps {res.start_step}..{res.steps - 1} "
        f"in {res.elapsed:.1f} s (setup {res.setup_time:.1f} s)")
    placed = ranks_by_node_text(getattr(res, "rank_nodes", None) or [])   # a result without it: older callers
    if placed:
        say(placed)
    rows = []
    predicted_peak = plan.metrics.get("peak_memory") or []
    for r in range(pp):
        p_t, m_t = res.predicted_step_time[r], res.measured_step_time[r]
        ratio = f"{m_t / p_t:.2f}x" if p_t and not math.isnan(p_t) and p_t > 0 else "-"
        peak = res.peak_memory[r] if r < len(res.peak_memory) else None
        baseline = getattr(res, "memory_baseline", None) or []   # a result without it (older callers)
        base = baseline[r] if r < len(baseline) else None
        rows.append([f"rank {r}", fmt_ms(p_t), fmt_ms(m_t), ratio, fmt_ms(res.predicted_busy[r]),
                     fmt_ms(res.measured_busy[r]), fmt_bytes(peak) if peak is not None else "-",
                     fmt_bytes(peak - base) if peak is not None and base else "-",
                     fmt_bytes(predicted_peak[r]) if r < len(predicted_peak) else "-"])
    say(table(["pipeline rank", "predicted step", "measured step", "measured/predicted", "predicted busy",
               "measured busy", "peak RSS", "RSS over baseline", "predicted peak"], rows))
    pred_tps = res.predicted_units_per_second   # None: the plan holds no prediction
    if ran:
        say(f"loss {res.losses[0]:.4f} (step {res.start_step}) -> {res.losses[-1]:.4f} (step {res.steps - 1})")
    if res.val_losses:
        say("validation loss " + ", ".join(f"{v:.4f} after {s} steps" for s, v in res.val_losses))
    if res.moe:
        say(moe_summary(res))
    unit = res.unit
    pred_mk = res.predicted_makespan
    has_mk = pred_mk is not None and math.isfinite(pred_mk) and pred_mk > 0
    say(f"{res.units_per_second:,.0f} {unit}/s measured ({res.units_per_step:,} {unit} per step), "
        + (f"{pred_tps:,.0f} {unit}/s predicted" if pred_tps is not None else "no prediction in the plan")
        + f"; step makespan {fmt_ms(res.measured_makespan)} measured"
        + (f" vs {fmt_ms(pred_mk)} predicted" if has_mk else ""))
    predicted_trace = plan_dir / "trace.json"
    traces = dict(res.trace_paths)
    if predicted_trace.is_file():
        traces.setdefault("predicted", str(predicted_trace))
    if traces:
        say("traces (open in ui.perfetto.dev): " + ", ".join(f"{k} {v}" for k, v in traces.items()))
    if res.checkpoint:
        say(f"checkpoint {res.checkpoint} (continue with --resume)")
    d = res.to_dict()
    d["trace_paths"] = traces
    d["predicted_tokens_per_second"] = pred_tps if unit == "tokens" else None
    d["predicted_units_per_second"] = pred_tps
    d["loss_start"] = res.losses[0] if ran else None
    d["loss_end"] = res.losses[-1] if ran else None
    d["val_loss"] = res.val_losses[-1][1] if res.val_losses else None
    return d


@contextlib.contextmanager
def _stdout_for_json(args: argparse.Namespace) -> Iterator[None]:
    """With ``--json``, everything printed to ``sys.stdout`` while the block runs goes to stderr:
    Ray's forwarded worker output and its "worker died" / OOM notices (Ray prints both to
    ``sys.stdout``), so stdout keeps only the report and the JSON object."""
    if not getattr(args, "json", False):
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield


def resume_command(args: argparse.Namespace, checkpoint_dir: Path | None) -> str:
    """The shell command that resumes an interrupted ``tessel launch`` with the same options
    (those given at a value other than their default) from ``checkpoint_dir`` (``None``: the
    default folders, as a co-located launch without ``--checkpoint-dir`` uses)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    defaults = vars(parser.parse_args(["plan.json"]))
    where = ["--checkpoint-dir", str(checkpoint_dir)] if checkpoint_dir is not None else []
    words = ["tessel", "launch", *map(str, args.plan), "--resume", *where, "--steps", str(args.steps)]
    for dest, default in defaults.items():
        value = getattr(args, dest, default)
        if dest in ("plan", "resume", "checkpoint_dir", "steps") or value == default:
            continue
        flag = "--" + dest.replace("_", "-")
        words += [flag] if value is True else [flag, str(value)]
    words += [f for f, on in (("--json", getattr(args, "json", False)), ("--verbose", getattr(args, "verbose", False)))
              if on]
    return shlex.join(words)


def _say_interrupted(args: argparse.Namespace, e, checkpoint_dir: Path | None) -> None:
    """Tell (stderr) where an interrupted launch's checkpoint is and the exact command resuming it."""
    print(f"tessel launch: {e}", file=sys.stderr)
    if e.checkpoint:
        print(f"resume with: {resume_command(args, checkpoint_dir)}", file=sys.stderr)


_MOE_FIELDS = (("temperature", "temperature", "{:.4f}"), ("experts_per_token", "experts/token", "{:.2f}"),
               ("load_cv", "load CV", "{:.3f}"), ("dropped_fraction", "dropped", "{:.2%}"),
               ("aux_loss", "aux loss", "{:.4f}"))


def moe_summary(res) -> str:
    """One line: the MoE gate metrics of the first and last step of a launch (``res.moe``), and
    the measured step's expert-parallel all-to-alls (count, bytes, seconds on pipeline rank 0
    of replica 0) when there are any."""
    first, last = res.moe[0], res.moe[-1]
    parts = [f"{label} {fmt.format(first[k])} -> {fmt.format(last[k])}" for k, label, fmt in _MOE_FIELDS
             if k in first and k in last]
    line = f"MoE gates, step {first['step']} -> {last['step']}: " + ", ".join(parts)
    a2a = [e for e in (res.timeline.events if res.timeline is not None else []) if e.op == "ALLTOALL"]
    if a2a:
        mine = [e for e in a2a if e.rank == 0]
        line += (f"; expert-parallel all-to-alls on rank 0: {len(mine)} per step, "
                 f"{sum(e.nbytes for e in mine) / 2**20:.2f} MiB of send buffers, "
                 f"{fmt_ms(sum(e.duration for e in mine))}")
    return line


def _mode(args: argparse.Namespace) -> str | None:
    """The co-location mode asked for, or ``None`` for a plain single-plan launch.

    Raises:
        engine.errors.TesselError: several plans without ``--crossover``/``--mode``, or ``--crossover`` with
            another ``--mode``.
    """
    if args.crossover and args.mode not in (None, "crossover"):
        raise TesselError(f"--crossover and --mode {args.mode} contradict each other; give one of them")
    mode = "crossover" if args.crossover else args.mode
    if len(args.plan) > 1 and mode is None:
        raise TesselError(f"{len(args.plan)} plans given: co-locate them with --crossover (or --mode uncoordinated / "
                         "--mode sequential), or launch one plan at a time")
    return mode


def checkpoint_dirs(plan_paths: list[Path], checkpoint_dir: str | None) -> list[Path]:
    """One checkpoint folder per co-located job: ``<checkpoint_dir>/job<i>-<stem>`` when given,
    else ``<plan folder>/ckpt-<stem>`` (``-<i>`` appended where two jobs would share one)."""
    if checkpoint_dir:
        return [Path(checkpoint_dir) / f"job{i}-{p.stem}" for i, p in enumerate(plan_paths)]
    out: list[Path] = []
    for i, p in enumerate(plan_paths):
        d = p.parent / f"ckpt-{p.stem}"
        if d.resolve() in {x.resolve() for x in out}:
            d = p.parent / f"ckpt-{p.stem}-{i}"
        out.append(d)
    return out


def report_crossover(res, predicted: dict | None = None, out: TextIO | None = None) -> dict:
    """Print the summary of a co-located launch and return its JSON-able result.

    Args:
        res: the :class:`runtime.crossover.CrossoverResult`.
        predicted: ``{"aggregate_tokens_per_second": ..., "per_job_tokens_per_second": [...]}`` of
            the simulator, or ``None``.
        out: where the summary is printed; ``None``: ``sys.stdout`` as it is at the call.
    """
    say = lambda *a: print(*a, file=out)  # noqa: E731
    say(f"{len(res.jobs)} jobs co-located on {res.world_size} actors ({res.backend}), mode {res.mode}; "
        f"{res.elapsed:.1f} s in all (setup {res.setup_time:.1f} s)")
    rows = []
    for j in res.jobs:
        mean_step = sum(j.step_times) / len(j.step_times) if j.step_times else math.nan
        loss = f"{j.losses[0]:.4f} -> {j.losses[-1]:.4f}" if j.losses else "-"
        rows.append([f"{j.label} {j.name}", f"{j.start_step}..{j.start_step + len(j.losses) - 1}" if j.losses else "-",
                     loss, fmt_ms(mean_step), fmt_ms(j.token_wait / max(1, len(j.step_times))),
                     f"{j.tokens_per_second:,.0f}", "ok" if j.ok else "FAILED"])
    say(table(["job", "steps", "loss", "mean step", "token wait/step", "tokens/s", "status"], rows))
    for j in res.jobs:
        if j.error:
            say(f"job {j.label} ({j.name}) failed: {j.error}")
    pred = (predicted or {}).get("aggregate_tokens_per_second")
    say(f"aggregate {res.aggregate_tokens_per_second:,.0f} tokens/s measured ({res.total_tokens:,} tokens in "
        f"{res.wall_time:.2f} s after {res.warmup_steps} warm-up step(s) per job)"
        + (f", {pred:,.0f} tokens/s predicted" if pred else ""))
    if res.mode == "crossover":
        say(f"compute token: {len(res.intervals)} holds, {len(res.overlaps())} overlapping between jobs")
    for j in res.jobs:
        if j.checkpoint:
            say(f"job {j.label} checkpoint {j.checkpoint}")
    d = res.to_dict()
    d.pop("intervals", None)
    d["num_intervals"] = len(res.intervals)
    d["predicted"] = predicted
    return d


def _predict(plans: list, mode: str, steps: int) -> dict | None:
    """The simulator's prediction of the co-located run (``engine.crossover``), or ``None``."""
    try:
        p = predict_colocated(list(plans), mode, steps=max(1, steps))
    except Exception:  # a prediction is a bonus: never fail the launch for it
        return None
    return {"aggregate_tokens_per_second": float(p.aggregate_tokens_per_second),
            "per_job_tokens_per_second": [float(v) for v in p.per_job_tokens_per_second.values()]}


def run_crossover(args: argparse.Namespace, mode: str) -> dict:
    """``tessel launch a.json b.json --crossover``: :func:`runtime.crossover.launch_crossover`."""
    from runtime.config import CrossoverConfig
    from runtime.crossover import launch_crossover
    from runtime.launcher import check_launchable

    paths = [Path(p) for p in args.plan]
    plans = [load_plan(p) for p in paths]
    for p, plan in zip(paths, plans):
        check_launchable(plan, name=f"the plan {p}")
    ckdirs = checkpoint_dirs(paths, args.checkpoint_dir)
    config = CrossoverConfig(steps=args.steps, mode=mode, address=args.address, checkpoint_dirs=ckdirs,
                             checkpoint_every=args.checkpoint_every, eval_every=args.eval_every, resume=args.resume,
                             seed=args.seed, lr=args.lr, optimizer=args.optimizer, warmup_steps=args.warmup_steps,
                             step_timeout=args.step_timeout, device=args.device, names=[str(p) for p in paths])
    with _stdout_for_json(args):
        from apps.launch_progress import LineProgress

        try:
            res = launch_crossover(plans, config, callbacks=[LineProgress()] if _show_progress(args) else [])
        except LaunchInterrupted as e:   # each job's last step checkpointed; exit status 130
            _say_interrupted(args, e, Path(args.checkpoint_dir) if args.checkpoint_dir else None)
            raise
    out = report_crossover(res, _predict(plans, mode, args.steps))
    if res.timeline is not None:
        trace = Path(args.trace) if args.trace else paths[0].parent / "crossover.measured.json"
        out["trace_paths"] = {"measured": str(write_trace(res.timeline, trace, metadata={
            "mode": mode, "jobs": [str(p) for p in paths], "measured": True}))}
        print(f"co-located trace (open in ui.perfetto.dev): {trace}")
    out["plans"] = [str(p) for p in paths]
    return out


def _show_progress(args: argparse.Namespace) -> bool:
    """Progress on stderr: always without ``--json``, with it only on a terminal."""
    return not args.json or sys.stderr.isatty()


def run(args: argparse.Namespace) -> dict:
    from runtime import launch
    from runtime.config import LaunchConfig
    from runtime.launcher import check_launchable, shared_cores
    if any(_is_gnn_plan(Path(p)) for p in args.plan):
        return run_gnn(args)
    if args.epochs is not None:
        raise TesselError("--epochs is for GNN plans (`tessel plan --gnn`); train this plan for a number of --steps.")
    mode = _mode(args)
    if mode is not None:
        if args.task is not None:
            raise TesselError("--task applies to a single-plan launch; co-located jobs train the plans' own tasks")
        return run_crossover(args, mode)
    plan_path = Path(args.plan[0])
    plan = load_plan(plan_path)
    check_launchable(plan, name=f"the plan {plan_path}")
    plan_dir = plan_path.parent
    ckdir = Path(args.checkpoint_dir) if args.checkpoint_dir else plan_dir / "ckpt"
    trace = Path(args.trace) if args.trace else plan_dir / "trace.measured.json"
    config = LaunchConfig(steps=args.steps, address=args.address, checkpoint_dir=ckdir,
                          checkpoint_every=args.checkpoint_every, eval_every=args.eval_every, resume=args.resume,
                          seed=args.seed, lr=args.lr, step_timeout=args.step_timeout, trace_path=trace,
                          device=args.device, optimizer=args.optimizer, task=args.task, data_seed=args.data_seed,
                          keep_timelines=min(args.steps, 64) if args.calibrate else 8,
                          release_freed_memory=args.release_freed_memory)
    try:
        with _stdout_for_json(args):
            from apps.launch_progress import TqdmProgress

            res = launch(plan, config, callbacks=[TqdmProgress()] if _show_progress(args) else [])
    except LaunchInterrupted as e:
        _say_interrupted(args, e, ckdir)
        raise
    out = report(plan, res, plan_dir=plan_dir)
    out["plan"] = str(plan_path)
    if args.calibrate:
        out["calibration"] = calibrate_plan(plan, res, plan_path.with_name(plan_path.stem + ".calibrated.json"),
                                            shared_cores=shared_cores(plan.parallel.devices, config))
    return out


def calibrate_plan(plan, res, path: Path, out: TextIO | None = None, shared_cores: int | None = None) -> dict:
    """Calibrate ``plan`` from a launch's measured steps, save it, and check it on later steps
    (:func:`engine.plan.calibrate.calibrate_plan`, then the saving and the line printed here).

    Uses the launch's kept timelines (``LaunchResult.timelines``), the launch's first step
    (warm-up) left out. With at least 4 of them, the first half calibrates and the prediction is
    compared with the median makespan of the second half (steps the calibration did not see);
    with fewer, the calibration is compared with the steps it came from. The saved plan is
    calibrated from all of them. The plan is written atomically to ``path``; the line saying so is
    printed to ``out`` (``None``: ``sys.stdout`` as it is at the call). ``shared_cores``: the local
    ranks shared this many cores (:func:`runtime.launcher.shared_cores`); the calibration then
    describes a rank with a core of its own and the check predicts the shared step
    (:func:`engine.plan.calibrate.calibrate_plan`).

    Returns:
        ``{"path", "predicted_makespan", "measured_makespan", "error", "steps", "held_out"}``
        (seconds; ``error`` = measured / predicted - 1; ``held_out``: whether the measured steps
        were not used for the checked prediction).

    Raises:
        CostModelError: the launch kept no measured timeline.
    """
    tls = list(res.timelines)
    if len(tls) > 1 and res.start_step == 0 and len(tls) == len(res.losses):
        tls = tls[1:]
    check = calibrate_measured(plan, tls, shared_cores=shared_cores)
    save_plan(check.plan, path)
    n = check.checked
    how = (f"calibrated on {check.steps - n} steps, checked on the {n} later ones" if check.held_out else
           f"calibrated from {n} measured step{'s' if n != 1 else ''}")
    residual = check.plan.meta["calibration"].get("step_residual", {})
    said = "".join(f"; step residual x{v:.2f} ({k} backward: `tessel tune --calibration` multiplies this layout's "
                   "candidates by it)" for k, v in residual.items())
    print(f"{how}: step makespan {fmt_ms(check.predicted_makespan)} predicted vs {fmt_ms(check.measured_makespan)} "
          f"measured (median), {check.error:+.1%}{said}; calibrated plan: {path}", file=out)
    return {"path": str(path), **check.to_dict(), "step_residual": residual}


# ----------------------------------------------------------------------------------------- GNN plans
#: The ``tessel launch`` options a GNN launch takes (the others are refused when given a value
#: other than their default: a GNN plan holds its own learning rate, seed and task).
_GNN_OPTIONS = ("plan", "epochs", "address", "device", "step_timeout", "trace", "json", "verbose")


def _gnn_refused(args: argparse.Namespace) -> str | None:
    """The first option given (not at its default) that a GNN launch does not take, as its flag, or ``None``."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    defaults = vars(parser.parse_args(["plan.json"]))
    for dest, default in defaults.items():
        if dest not in _GNN_OPTIONS and getattr(args, dest, default) != default:
            return "--" + dest.replace("_", "-")
    return None


def _is_gnn_plan(path: Path) -> bool:
    """Whether ``path`` is a JSON file whose ``format`` is ``tessel-gnn-plan`` (anything else is left
    to the pipeline plan's loader and its errors)."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and d.get("format") == GNN_PLAN_FORMAT


def _rows_shown(n: int, most: int = 20) -> list[int]:
    """The epochs a table shows: all up to ``most``, else every k-th and the last."""
    if n <= most:
        return list(range(n))
    k = math.ceil(n / most)
    return sorted(set(range(0, n, k)) | {n - 1})


def report_gnn(res, out=None) -> None:
    """Print a GNN launch (to ``out``, default ``sys.stdout``): one row per epoch (loss, accuracies,
    epoch time measured vs predicted) and the predicted against the measured busy time per stream and rank."""
    say = lambda *a: print(*a, file=out or sys.stdout)  # noqa: E731
    pred = res.predicted_epoch_time
    say(f"{res.world_size} ranks ({res.backend} on {'GPUs' if res.backend == 'nccl' else 'CPU'}), P = "
        f"{res.partitions} ({res.order} order{'' if res.chunks_as_planned else ', chunk sizes counted at launch'}), "
        f"{res.dtype}; {res.epochs} epochs in {res.elapsed:.1f} s (setup {res.setup_time:.1f} s)")
    rows = []
    for e in _rows_shown(res.epochs):
        t = res.epoch_times[e]
        rows.append([e, f"{res.losses[e]:.4f}", f"{res.train_accuracy[e]:.3f}", f"{res.val_accuracy[e]:.3f}",
                     f"{res.test_accuracy[e]:.3f}", fmt_ms(t), fmt_ms(pred), f"{t / pred:.2f}x" if pred > 0 else "-"])
    say(table(["epoch", "loss", "train acc", "val acc", "test acc", "epoch measured", "predicted",
               "measured/predicted"], rows))
    fa = res.final_accuracy
    say(f"after the last epoch: train {fa['train']:.3f}, val {fa['val']:.3f}, test {fa['test']:.3f} accuracy")
    cal = res.calibrated_epoch_time
    cal_epoch = 1 if res.epochs > 2 else 0
    later = f"epochs {cal_epoch + 1}-{res.epochs - 1}" if res.epochs > cal_epoch + 1 else "all epochs"
    say(f"epoch time {fmt_ms(res.measured_epoch_time)} measured (median of {later}), {fmt_ms(pred)} predicted by "
        "the plan, "
        + (f"{fmt_ms(cal)} predicted after calibrating on epoch {cal_epoch}" if not math.isnan(cal)
           else "no calibration"))
    busy = []
    for r in range(res.world_size):
        busy.append([f"rank {r}"] + [f"{fmt_ms(res.predicted_busy[s][r])} / {fmt_ms(res.measured_busy[s][r])}"
                                     for s in ("compute", "load", "collective")])
    say(table(["busy (predicted / measured)", "compute", "load", "collective"], busy))


def run_gnn(args: argparse.Namespace) -> dict:
    """``tessel launch gnn_plan.json``: :func:`runtime.gnn.launcher.launch_gnn`, the table and the trace.

    Raises:
        engine.errors.TesselError: several plans, or a flag that does not apply to a GNN plan (one sentence).
        LaunchError, PlanFormatError: from the launch (one sentence; exit status 2).
    """
    from runtime.gnn.launcher import launch_gnn

    if len(args.plan) > 1:
        raise TesselError(f"{len(args.plan)} plans given, one of them a GNN plan; launch a GNN plan alone.")
    flag = _gnn_refused(args)
    if flag is not None:
        raise TesselError(f"{flag} does not apply to a GNN plan (its learning rate, seed and task are the plan's); "
                         "leave it out (a GNN launch takes --epochs, --device, --address, --step-timeout and --trace).")
    plan_path = Path(args.plan[0])
    with _stdout_for_json(args):
        res = launch_gnn(plan_path, epochs=args.epochs, address=args.address, device=args.device,
                         step_timeout=args.step_timeout)
    report_gnn(res)
    planned_for = load_gnn_plan(plan_path).device_type
    ran_on = "cpu" if res.backend == "gloo" else "cuda"
    if (planned_for == "cpu") != (ran_on == "cpu"):
        print(f"note: the plan predicts a {planned_for} and this ran on {ran_on}; re-plan with "
              f"--device-type {'cpu' if ran_on == 'cpu' else 'h100'} to compare prediction and measurement here "
              "(the calibrated prediction already uses this machine).")
    out = res.to_dict()
    out["plan"] = str(plan_path)
    if res.timeline is not None:
        trace = Path(args.trace) if args.trace else plan_path.parent / "gnn_trace.measured.json"
        out["trace_paths"] = {"measured": str(write_trace(res.timeline, trace, name="tessel-gnn", metadata={
            "format": "tessel-gnn-plan", "measured": True, "epoch": res.epochs - 1, "plan": str(plan_path)}))}
        print(f"measured trace of the last epoch (open in ui.perfetto.dev): {trace}")
    return out
