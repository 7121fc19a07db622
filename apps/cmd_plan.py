"""Plan a model: capture it, split it into pipeline segments, build a schedule, simulate it,
and write ``plan.json``, ``trace.json`` (Perfetto) and ``schedule.csv`` (torch pipelining)."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from apps.arg_types import (
    LINK_HELP,
    PRECISION_HELP,
    RECOMPUTE_HELP,
    RESHARD_AFTER_FORWARD,
    data_parallel_degrees,
    dtype_name,
    link_name,
    memory_limit,
    positive_float,
    positive_int,
    precision_name,
    recompute_name,
    recompute_names,
    transform_help,
    transform_names,
)
from apps.output import facts_line, fmt_gib, fmt_ms, memory_line, mfu_line, report_fields, table
from apps.plan_gnn import add_gnn_arguments, run_gnn
from engine.baselines import SCHEDULES
from engine.errors import CoCoNetError
from engine.io import trace as trace_io
from engine.io.atomic import atomic_write_files, check_output_folder
from engine.io.torch_csv import schedule_to_csv_text
from engine.placement import TensorSpec, dtype_bytes
from engine.precision import get_policy
from engine.tp_plan import read_tp_plan

HELP = "plan a model on N devices with a predefined schedule and write plan/trace/csv"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="built-in name (see `tessel models`) or module:callable (default gpt2)")
    p.add_argument("--model-config", default=None, metavar="PATH",
                   help="plan a Hugging Face config.json (or a folder holding one) built on the meta device, "
                        "e.g. configs/hf/llama-3-8b; instead of --model")
    p.add_argument("--devices", type=positive_int, default=4, help="total devices = dp * tp * pp (default 4)")
    p.add_argument("--micro-batches", type=positive_int, default=8, help="micro-batches per step (default 8)")
    p.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)} (default 1f1b)")
    p.add_argument("--device-type", default="h100", help="cost table: h100, a100, cpu (default h100)")
    p.add_argument("--link", type=link_name, default=None, help=LINK_HELP)
    p.add_argument("--inter-link", type=link_name, default=None,
                   help="the link between nodes, in --link's spellings (default: --link, else the device's own)")
    p.add_argument("--devices-per-node", type=positive_int, default=8,
                   help="devices on one node: device i on node i // N; tessel launch --address runs each rank on "
                        "that node of the Ray cluster (default 8)")
    p.add_argument("--dp", type=positive_int, default=None,
                   help="data-parallel degree, dp_replicate x dp_shard (default 1, or their product)")
    p.add_argument("--dp-shard", type=positive_int, default=None,
                   help="fully sharded data parallelism (FSDP2, ZeRO-3): parameters, gradients and Adam states "
                        "split over this many of the dp ranks, each transformer block all-gathered before its "
                        "forward and backward (torchtitan's data_parallel_shard_degree; default 1)")
    p.add_argument("--dp-replicate", type=positive_int, default=None,
                   help="replicas of the shard group (HSDP with --dp-shard; torchtitan's "
                        "data_parallel_replicate_degree; default dp / dp-shard)")
    p.add_argument("--reshard-after-forward", choices=("default", "always", "never"), default="default",
                   help="FSDP2's reshard_after_forward, torchtitan's spelling: free each block's gathered "
                        "parameters after its forward (always) or keep them for the backward (never); default: "
                        "always without a pipeline, never with one")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--virtual-stages", type=positive_int, default=None,
                   help="segments per device for interleaved (default 2)")
    p.add_argument("--micro-batch-size", type=positive_int, default=1, help="samples per micro-batch (default 1)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sample (model default)")
    p.add_argument("--task", default=None,
                   help="training task recorded in the plan: causal-lm, masked-lm, seq2seq, image-classification "
                        "or package.module:callable (default: the model's own)")
    p.add_argument("--precision", type=precision_name, default=None, help=PRECISION_HELP)
    p.add_argument("--recompute", type=recompute_name, default="none", help=RECOMPUTE_HELP)
    p.add_argument("--stage-recompute", type=recompute_names, default=None, metavar="G[,G...]",
                   help="per-stage recomputation overriding --recompute: one granularity per pipeline stage "
                        "(e.g. full,full,none,none: the first stages, which hold the most micro-batches in "
                        "flight under 1F1B, recompute) or per segment")
    p.add_argument("--dtype", type=dtype_name, default=None,
                   help="the old way to say the precision: float32 (32-true), bfloat16 (bf16-true), float16 "
                        "(16-mixed); with --precision it must be its compute dtype (default: from --precision)")
    p.add_argument("--memory-limit", type=memory_limit, default=None,
                   help="GiB per device (default: the device's capacity)")
    p.add_argument("--optimizer", choices=("adam", "adama"), default="adam",
                   help="memory model of the optimizer: adam (gradient accumulation: a gradient buffer per stage "
                        "from its first backward to the step) or adama (AdamA: gradients folded into Adam's states "
                        "and freed) "
                        "(default adam)")
    p.add_argument("--profile", action="store_true",
                   help="time the model's ops on this machine (cached) and plan with measured costs")
    p.add_argument("--transform", type=transform_names, default=(), metavar="T[,T...]", help=transform_help())
    p.add_argument("--bucket-mib", type=positive_float, default=25.0,
                   help="gradient bucket size of overlap-grad-sync, MiB (default 25, PyTorch DDP's)")
    p.add_argument("--overlap-chunks", type=positive_int, default=4,
                   help="chunks of chunked-overlap (default 4)")
    p.add_argument("--tp-plan", metavar="FILE", default=None,
                   help="a JSON tensor-parallel plan for the transformer blocks in transformers' base_model_tp_plan "
                        "format (e.g. {\"layers.*.self_attn.q_proj\": \"colwise\", ...}; styles colwise, rowwise, "
                        "packed_colwise:K), replacing the model's own; recorded, costed and executed")
    p.add_argument("-o", "--output", default="out", help="output folder (default out/)")
    add_gnn_arguments(p)


def _bucket_bytes(mib: float) -> int:
    """``--bucket-mib`` in bytes, a multiple of 4 (float32 elements); a non-positive size is a user error."""
    if not mib > 0:
        raise CoCoNetError(f"--bucket-mib must be positive, got {mib:g}")
    return max(4, int(mib * 2**20) // 4 * 4)


#: The files ``tessel plan`` writes into its ``-o`` folder, all or none (:func:`plan_files`).
OUTPUT_FILES = ("plan.json", "trace.json", "schedule.csv")


def plan_files(res) -> dict[str, str]:
    """The texts of ``plan.json`` (as :func:`engine.io.save_plan` writes it), ``trace.json``
    (Perfetto, :func:`engine.io.trace.timeline_to_trace`, with the schedule and the plan's scalar
    metrics as metadata) and ``schedule.csv`` (torch pipelining, :func:`engine.io.torch_csv.schedule_to_csv_text`)
    of a :class:`engine.plan.make.PlanResult`, for :func:`engine.io.atomic.atomic_write_files`."""
    meta = {"schedule": res.plan.schedule.name, **{k: v for k, v in res.plan.metrics.items() if k != "bubble_ratios"}}
    return {"plan.json": json.dumps(res.plan.to_dict(), indent=1),
            "trace.json": json.dumps(trace_io.timeline_to_trace(res.timeline, metadata=meta)),
            "schedule.csv": schedule_to_csv_text(res.plan.schedule)}


def run(args: argparse.Namespace) -> dict:
    """``tessel plan``: plan, print the tables, write :data:`OUTPUT_FILES` into ``-o`` all-or-nothing.

    Raises:
        OutputPathError: ``-o`` is an existing file or one of the files is a folder (checked
            before planning; the folder is then left as it was).
        TesselError: every planning mistake (:func:`engine.plan.make.make_plan`).
    """
    if args.gnn is not None:
        return run_gnn(args)
    from engine.models.hf_config import model_choice  # builds models: loads torch
    from engine.plan.make import make_plan  # captures the model: loads torch

    model = model_choice(args.model, args.model_config) or "gpt2"   # --model-config: the path is the name
    out = check_output_folder(args.output, OUTPUT_FILES)

    t0 = time.perf_counter()
    quiet = args.json

    def progress(phase: str) -> None:
        if not quiet:
            print(f"[tessel] {phase} ...", file=sys.stderr, flush=True)

    limit = args.memory_limit * 2**30 if args.memory_limit is not None else None
    dp, dp_shard = data_parallel_degrees(args.dp, args.dp_shard, args.dp_replicate)
    res = make_plan(
        model, devices=args.devices, micro_batches=args.micro_batches, schedule=args.schedule,
        device_type=args.device_type, dp=dp, tp=args.tp, dp_shard=dp_shard,
        reshard_after_forward=RESHARD_AFTER_FORWARD[args.reshard_after_forward], virtual_stages=args.virtual_stages,
        micro_batch_size=args.micro_batch_size, seq_len=args.seq_len, dtype=args.dtype, precision=args.precision,
        recompute=args.recompute, stage_recompute=args.stage_recompute, memory_limit=limit,
        optimizer=args.optimizer, profile=args.profile, task=args.task, link=args.link,
        inter_link=args.inter_link, devices_per_node=args.devices_per_node, transforms=args.transform,
        grad_bucket_bytes=_bucket_bytes(args.bucket_mib),
        overlap_chunks=args.overlap_chunks, tp_plan=read_tp_plan(args.tp_plan) if args.tp_plan else None,
        progress=progress,
    )
    written = atomic_write_files(out, plan_files(res))
    plan_path, trace_path, csv_path = (written[n] for n in OUTPUT_FILES)
    elapsed = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    m = res.plan.metrics
    par = res.plan.parallel
    g = res.graph
    print(f"{res.plan.model.name}: {g.graph.get('num_params', 0) / 1e6:,.1f}M parameters, {g.number_of_nodes()} ops, "
          f"{len(res.plan.segments)} segments; dp={par.dp}"
          + (f" (dp_replicate={par.dp_replicate} x dp_shard={par.dp_shard}, fully sharded)" if par.fully_sharded
             else "") + f" tp={par.tp} pp={par.pp}, "
          f"{par.micro_batches} micro-batches, schedule {res.plan.schedule.name} on {args.device_type}, "
          f"optimizer {par.optimizer}" + (f"; transformations {', '.join(par.transforms)}" if par.transforms else ""))
    print(facts_line(res.plan))
    if par.tp > 1 or par.dp > 1:
        print(f"one row per pipeline rank: each is a group of tp={par.tp} devices, replicated dp={par.dp} times")
    rows = [[f"rank {d}", fmt_ms(m['makespan'] * (1 - b)), f"{b:.1%}", fmt_gib(p)]
            for d, (b, p) in enumerate(zip(m["bubble_ratios"], m["peak_memory"]))]
    print(table(["pipeline rank", "busy", "bubble", "peak memory"], rows))
    stages = stage_rows(res.plan)
    print(stage_table(stages))
    print(f"makespan {fmt_ms(m['makespan'])}, bubble ratio {m['bubble_ratio']:.1%}, "
          f"{m['tokens_per_second']:,.0f} tokens/s predicted")
    for line in (mfu_line(m), memory_line(m)):
        if line:
            print(line)
    comm = collective_summary(res)
    for line in comm["lines"]:
        print(line)
    moe = moe_flops(res)
    for line in moe["lines"]:
        print(line)
    for w in res.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(f"wrote {plan_path}, {trace_path} (open in ui.perfetto.dev), {csv_path}")
    print(f"planned in {elapsed:.2f} s, peak RSS {rss / 2**20:,.0f} MiB")
    return {
        "plan": str(plan_path), "trace": str(trace_path), "csv": str(csv_path),
        "makespan": m["makespan"], "bubble_ratio": m["bubble_ratio"], "bubble_ratios": m["bubble_ratios"],
        "peak_memory": m["peak_memory"], "tokens_per_second": m["tokens_per_second"],
        "segments": len(res.plan.segments), "ops": g.number_of_nodes(), "parallel": par.to_dict(),
        "timings": res.timings, "elapsed": elapsed, "peak_rss": rss, "warnings": res.warnings,
        "alltoalls": comm["alltoalls"], "tied_weights": res.plan.tied_weights, "stages": stages,
        "moe_flops": moe["flops"], **report_fields(res.plan, m),
    }


def moe_flops(res) -> dict:
    """Forward FLOPs of each MoE layer of a planned model (router + experts, one micro-batch on
    one rank, from the captured graph: the ops whose module path is inside the layer), as
    ``flops`` (``{path: FLOPs}``) and a summary line (empty for dense models)."""
    layers = [ml for seg in res.plan.segments for ml in seg.get("moe") or []]
    if not layers:
        return {"flops": {}, "lines": []}
    g = res.graph
    per: dict[str, float] = {str(ml["path"]): 0.0 for ml in layers}
    for _, d in g.nodes(data=True):
        mp = str(d.get("module_path") or "")
        for path in per:
            if mp == path or mp.startswith(path + "."):
                per[path] += float(d.get("flops", 0.0) or 0.0)
                break
    first = layers[0]
    vals = list(per.values())
    line = (f"MoE layers: {len(layers)} ({first.get('gate', '?')}, {first['num_experts']} experts), forward FLOPs "
            f"per layer per micro-batch (router + experts): {min(vals) / 1e6:,.3f}"
            + (f"..{max(vals) / 1e6:,.3f}" if max(vals) > min(vals) * 1.0005 else "") + " MFLOPs")
    return {"flops": per, "lines": [line]}


def stage_rows(plan) -> list[dict]:
    """One dict per pipeline stage (segment) of ``plan``: ``stage``, ``rank`` (the pipeline rank
    running its forward), ``first_layer``/``last_layer`` (module paths) and ``num_layers``,
    ``params`` (parameter count on one device: parameter bytes / bytes per element of the plan's
    dtype; under expert parallelism the rank's own experts only), ``flops`` (forward FLOPs per
    micro-batch on one tensor-parallel rank), ``forward_ms``/``backward_ms``
    (one micro-batch), ``activation_bytes`` (kept for backward per micro-batch) and
    ``boundary_bytes`` (sent to the next stage per micro-batch, every tensor crossing the cut; 0
    for the last). Works on loaded plans (a plan without ``boundary_bytes`` uses its ``output``
    tensors)."""
    try:
        elem = dtype_bytes(str(plan.model.dtype or "float32"))
    except ValueError:
        elem = 4
    pl = plan.placement
    rows = []
    for seg in plan.segments:
        i = int(seg["index"])
        layers = [str(x) for x in seg.get("layers") or []]
        boundary = seg.get("boundary_bytes")
        if boundary is None:
            out = seg.get("output")
            boundary = TensorSpec.from_dict(out).nbytes if out else 0
        rank = pl.spec("F", i).devices[0] if pl.has("F", i) else None
        rows.append({
            "stage": i, "rank": rank, "first_layer": layers[0] if layers else "",
            "last_layer": layers[-1] if layers else "", "num_layers": len(layers),
            "params": int(seg.get("param_bytes", 0)) // elem,
            "flops": float(seg.get("flops", 0.0)),
            "forward_ms": float(seg.get("forward_time", 0.0)) * 1e3,
            "backward_ms": float(seg.get("backward_time", 0.0)) * 1e3,
            "activation_bytes": int(seg.get("activation_bytes", 0)), "boundary_bytes": int(boundary),
        })
    return rows


def stage_table(stages: list[dict]) -> str:
    """The per-stage table of :func:`stage_rows` as plain text (the CLI's table style)."""
    rows = []
    for r in stages:
        span = r["first_layer"] if r["num_layers"] <= 1 else f"{r['first_layer']}..{r['last_layer']}"
        rows.append([f"stage {r['stage']}", "" if r["rank"] is None else str(r["rank"]), span, f"{r['params']:,}",
                     f"{r['flops'] / 1e6:,.2f}", f"{r['forward_ms']:,.3f}", f"{r['backward_ms']:,.3f}",
                     _fmt_bytes(r["activation_bytes"]),
                     _fmt_bytes(r["boundary_bytes"]) if r["boundary_bytes"] else "-"])
    return table(["stage", "rank", "layers (first..last)", "parameters", "MFLOPs fwd", "forward ms", "backward ms",
                  "activations", "boundary out"], rows)


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def collective_summary(res) -> dict:
    """Lines describing the MoE all-to-alls and tied-weight all-reduces of a planned step, and
    ``alltoalls``: ALLTOALL instructions per pipeline rank (``[]`` entries 0 without MoE/dp)."""
    ex, tl = res.execution, res.timeline
    per_rank = [sum(1 for i in s if i.op == "ALLTOALL") for s in ex.streams]
    lines = []
    if any(per_rank):
        sizes = sorted({i.nbytes for s in ex.streams for i in s if i.op == "ALLTOALL"})
        secs = [sum(e.duration for e in tl.events if e.rank == r and e.op == "ALLTOALL") for r in range(tl.num_devices)]
        lines.append(f"expert parallelism (ep = dp = {ex.dp}): {max(per_rank)} all-to-alls per pipeline rank per step "
                     f"({', '.join(_fmt_bytes(b) for b in sizes)} send buffer each), "
                     f"{fmt_ms(max(secs))} of blocking all-to-all on the busiest rank")
    pol = get_policy(res.plan.parallel.precision)
    for g in res.plan.tied_weights:
        names = " + ".join(f"{n} (segment {seg})" for seg, n in g["members"])
        ranks = sorted({e.rank for e in tl.events if e.name == "allreduce tied"})
        where = f"across pipeline ranks {', '.join(map(str, ranks))}" if ranks else "on one rank (no communication)"
        lines.append(f"tied weights: {names}, {_fmt_bytes(pol.scale(g['nbytes'], pol.grad_bytes))} of gradients "
                     f"({pol.grad_dtype}) all-reduced {where} "
                     "before the optimizer step")
    return {"lines": lines, "alltoalls": per_rank}
