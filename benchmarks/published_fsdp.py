"""torchtitan's published FSDP2 run, planned through the CLI: Llama 3 8B on 64 A100 80 GB.

torchtitan's ``docs/performance.md`` ("Llama 3 performance numbers") trains Llama 3 8B with FSDP2
(1-D parallelism: ``fully_shard`` per transformer block over all 64 GPUs) at local batch size 1
and sequence length 8,192 in bf16 (``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``), reporting with selective op activation checkpointing **2,973 tokens/s
per GPU and MFU 58.2%** (selective layer: 2,904 and 56.8%). One step is one sequence of 8,192
tokens per GPU, so the published step time is ``8,192 / 2,973 = 2.755 s``. Its MFU counts
``6 N + 12 l h s`` FLOPs per token with ``N`` every parameter (8.03 B): ``61.1 GFLOP x 2,973 /
312 TFLOP/s = 58.2%``.

Planned here, as a user runs it::

    python -m apps.cli plan --model-config configs/hf/llama-3-8b --devices 64 --dp-shard 64
        --micro-batches 1 --micro-batch-size 1 --seq-len 8192 --device-type a100
        --precision bf16-mixed --recompute selective --schedule 1f1b -o DIR --json

and again with ``--recompute none`` (no published number: the memory breakdown says whether it
fits 80 GB). Eight A100s per node over NVLink, InfiniBand between nodes (the planner's default
links; torchtitan does not say which network its cluster had).

**Recomputation differs.** torchtitan's "selective op" policy saves the outputs of the matmuls
and attention except every second ``mm`` and recomputes the rest; the planner's ``selective`` is
Korthikanti et al.'s (2022) attention core, which a model running fused SDPA attention (as this
one does) does not keep apart, so the planner's selective plan recomputes nothing and predicts the
same step as without recomputation. torchtitan's recomputed matmuls (about half of the forward's)
are in its measured time and not in the prediction.

Measured here (``python benchmarks/published_fsdp.py``): 3,129 tokens/s per GPU predicted against
2,973 published (+5.3%), MFU 61.2% against 58.2%; peak 67.3 GB per GPU (80 GiB capacity): 2.0 GB of
shards, 60.5 GB of activations, 4.7 GB of gathered units (the root with the embeddings and LM head,
two blocks with their gradients); without recomputation the same. Planned in 6 s.

**Memory formula** (FSDP2 under ``bf16-mixed``, per GPU): the shards of the fp32 parameters, fp32
gradients and Adam's two fp32 moments, ``16 N / 64`` bytes; plus the gathered bf16 parameters of
the root (embeddings, final norm, LM head: FSDP2 keeps the root gathered from forward to
backward) and of two blocks at a time (the block computing and the one prefetched), with their
fp32 gradients in the backward; plus the activations one micro-batch keeps.

Targets (issue 33): predicted tokens/s per GPU within 10% of the published with selective
recomputation, and fits 80 GB.

Usage: ``python benchmarks/published_fsdp.py [--json] [--keep DIR]`` (also run by
``benchmarks/published_runs.py --runs llama3-8b-fsdp``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from published_runs import A100_MEMORY, A100_PEAK_FLOPS, ROOT, _gb, plan_rows, run_cli

#: torchtitan's model: Llama 3 8B (``configs/hf/llama-3-8b``).
MODEL_CONFIG = ROOT / "configs" / "hf" / "llama-3-8b"
LAYERS, HIDDEN, VOCAB, FFN = 32, 4_096, 128_256, 14_336
HEADS, KV_HEADS = 32, 8
SEQ_LEN = 8_192
GPUS = 64
#: bytes per parameter FSDP2 keeps sharded under bf16-mixed: fp32 parameter, gradient, Adam m and v
SHARDED_BYTES_PER_PARAM = 16
TIME_TOLERANCE = 0.10


@dataclass(frozen=True)
class FsdpRun:
    """One planned configuration of the torchtitan run.

    Attributes:
        name: the row's name (``llama3-8b-fsdp``).
        recompute: the planner's recomputation granularity.
        tokens_per_gpu: the published tokens/s per GPU (``None``: not published).
        mfu: the published MFU (``None``: not published).
        source: where the published numbers are.
    """

    name: str
    recompute: str
    tokens_per_gpu: float | None
    mfu: float | None
    source: str


RUNS: tuple[FsdpRun, ...] = (
    FsdpRun("llama3-8b-fsdp", "selective", 2_973.0, 0.582,
            "torchtitan docs/performance.md, Llama 3 8B, 64 A100, FSDP2, local batch 1, selective op AC"),
    FsdpRun("llama3-8b-fsdp-norc", "none", None, None, "(not published: the same run without recomputation)"),
)


def llama_params() -> int:
    """Llama 3 8B's parameters: per layer ``4 h^2 (q, o) + 2 h (h kv/heads) (k, v) + 3 h f`` and two
    norms ``2 h``; embeddings ``V h`` and an untied LM head ``V h``; the final norm ``h``."""
    kv = HIDDEN * KV_HEADS // HEADS
    layer = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * kv + 3 * HIDDEN * FFN + 2 * HIDDEN
    return LAYERS * layer + 2 * VOCAB * HIDDEN + HIDDEN


def flops_per_token() -> float:
    """torchtitan's count of training FLOPs per token: ``6 N + 12 l h s``."""
    return 6.0 * llama_params() + 12.0 * LAYERS * HIDDEN * SEQ_LEN


def formula_memory() -> dict[str, float]:
    """The module docstring's formula without activations (bytes per GPU): ``shards``,
    ``gathered`` (root plus two blocks in bf16, with their fp32 gradients) and ``total``."""
    n = llama_params()
    layer = (n - 2 * VOCAB * HIDDEN - HIDDEN) // LAYERS
    root = 2 * VOCAB * HIDDEN + HIDDEN
    shards = SHARDED_BYTES_PER_PARAM * n / GPUS
    gathered = 2.0 * root + (2 + 4) * 2 * layer
    return {"shards": shards, "gathered": gathered, "total": shards + gathered}


def plan_command(run: FsdpRun, out: Path) -> list[str]:
    """The ``tessel plan`` command line of a run (through ``python -m apps.cli``)."""
    return [sys.executable, "-m", "apps.cli", "plan", "--model-config", str(MODEL_CONFIG), "--devices", str(GPUS),
            "--dp-shard", str(GPUS), "--micro-batches", "1", "--micro-batch-size", "1", "--seq-len", str(SEQ_LEN),
            "--device-type", "a100", "--precision", "bf16-mixed", "--recompute", run.recompute,
            "--schedule", "1f1b", "-o", str(out), "--json"]


def plan_memory(plan: dict) -> dict[str, float]:
    """The plan's memory breakdown (``metrics["memory_breakdown"]``, bytes): ``peak``, ``states``
    (the shards of the parameters and Adam's states), ``gradients`` (the gradient buffer),
    ``activations`` (one micro-batch's kept activations) and ``other`` (the rest of the peak:
    the gathered units with their unsharded gradients and the recomputation's working set)."""
    mb = plan["metrics"]["memory_breakdown"]
    acts = float(mb["activations_per_micro_batch"]) * float(mb["micro_batches_in_flight"])
    states, grads, peak = (float(mb[k]) for k in ("weights_and_optimizer_states", "gradients", "peak"))
    return {"peak": peak, "states": states, "gradients": grads, "activations": acts,
            "other": max(0.0, peak - states - grads - acts)}


def run_one(run: FsdpRun, folder: Path, timeout: float = 900.0) -> dict:
    """Plan one run through the CLI and compare it with the published numbers; one result dict.

    Raises:
        RuntimeError: the plan command failed (its last stderr lines).
    """
    res, wall = run_cli(plan_command(run, folder / "plan"), timeout)
    plan = json.loads(Path(res["plan"]).read_text())
    seconds = float(res["makespan"])
    tokens = SEQ_LEN / seconds   # one sequence per GPU per step
    published_seconds = SEQ_LEN / run.tokens_per_gpu if run.tokens_per_gpu else None
    return {
        "run": asdict(run), "parallel": plan["parallel"], "num_params": plan["model"].get("num_params"),
        "formula_params": llama_params(), "predicted_seconds": seconds, "published_seconds": published_seconds,
        "predicted_tokens_per_gpu": tokens, "published_tokens_per_gpu": run.tokens_per_gpu,
        "tokens_error": tokens / run.tokens_per_gpu - 1 if run.tokens_per_gpu else None,
        "predicted_mfu_torchtitan": flops_per_token() * tokens / A100_PEAK_FLOPS, "published_mfu": run.mfu,
        "plan_mfu": plan.get("metrics", {}).get("mfu"), "memory": plan_memory(plan),
        "formula_memory": formula_memory(), "memory_capacity": A100_MEMORY,
        "plan_elapsed": float(res.get("elapsed", 0.0)), "plan_wall": wall,
    }


def targets(row: dict) -> dict[str, bool]:
    """Issue 33's targets for a row: tokens/s per GPU within 10% (where published) and fits 80 GB."""
    out = {"fits_80gb": row["memory"]["peak"] <= row["memory_capacity"]}
    if row["tokens_error"] is not None:
        out["tokens_within_10pct"] = abs(row["tokens_error"]) <= TIME_TOLERANCE
    return out


def report(row: dict) -> str:
    """One row's table: predicted beside published (or the formula's)."""
    r, m, f = row["run"], row["memory"], row["formula_memory"]
    pub = row["published_tokens_per_gpu"]
    rows = [
        ("seconds per step", f"{row['predicted_seconds']:.3f}",
         "-" if row["published_seconds"] is None else f"{row['published_seconds']:.3f}", ""),
        ("tokens/s per GPU", f"{row['predicted_tokens_per_gpu']:,.0f}", "-" if pub is None else f"{pub:,.0f}",
         "" if row["tokens_error"] is None else f"{row['tokens_error']:+.1%}"),
        ("MFU (torchtitan's count)", f"{row['predicted_mfu_torchtitan']:.1%}",
         "-" if row["published_mfu"] is None else f"{row['published_mfu']:.1%}", ""),
        ("peak memory per GPU", _gb(m["peak"]), _gb(f["total"] + m["activations"]), "(formula + plan's activations)"),
        ("  parameter and Adam shards + gradient", _gb(m["states"] + m["gradients"]), _gb(f["shards"]), ""),
        ("  activations of the micro-batch", _gb(m["activations"]), "", ""),
        ("  gathered units, recomputation, other", _gb(m["other"]), _gb(f["gathered"]), ""),
        ("memory capacity", _gb(row["memory_capacity"]), "", ""),
        ("planning time (CLI elapsed / wall)", f"{row['plan_elapsed']:.1f} s / {row['plan_wall']:.1f} s", "", ""),
    ]
    head = (f"{r['name']}: Llama 3 8B ({row['num_params'] or 0:,} parameters, formula {row['formula_params']:,}), "
            f"FSDP2 over {GPUS} A100s, local batch 1 x {SEQ_LEN:,}, bf16-mixed, recompute {r['recompute']}; "
            f"published: {r['source']}")
    cols = ("", "predicted", "published / formula", "error")
    widths = [max(len(x[i]) for x in rows + [cols]) for i in range(3)]
    lines = [head, "  ".join(h.ljust(w) for h, w in zip(cols, widths)) + "  " + cols[3]]
    lines += ["  ".join(c.ljust(w) for c, w in zip(x[:3], widths)) + "  " + x[3] for x in rows]
    lines.append("targets: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in targets(row).items()))
    return "\n".join(lines)


def run_rows(names: list[str], base: Path, *, quiet: bool) -> tuple[list[dict], dict[str, str]]:
    """Plan the named rows into ``base``; ``(rows, failures)`` (:func:`published_runs.plan_rows`)."""
    return plan_rows(RUNS, names, base, run_one=run_one, targets=targets, report=report, quiet=quiet)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--runs", default=",".join(r.name for r in RUNS), help="comma-separated row names")
    ap.add_argument("--keep", default=None, help="write the plans here (default a temporary folder)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in {r.name for r in RUNS}]
    if unknown:
        ap.error(f"unknown run(s) {', '.join(unknown)}; use {', '.join(r.name for r in RUNS)}")
    with tempfile.TemporaryDirectory() as tmp:
        rows, failures = run_rows(names, Path(args.keep) if args.keep else Path(tmp), quiet=args.json)
    if args.json:
        print(json.dumps({"rows": rows, "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
