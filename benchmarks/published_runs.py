"""Published runs planned through the CLI: Megatron-LM's GPT on A100s (Narayanan et al., SC'21, Table 1).

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), Table 1, trained GPT models with vocabulary V = 51,200 and sequence
s = 2,048 on A100 80 GB GPUs in fp16 mixed precision, with full activation recomputation, the
1F1B (PipeDream-Flush) schedule and micro-batch size 1. Three of its rows are planned here, each
from a GPT-2-architecture ``config.json`` (``n_layer``, ``n_embd``, ``n_head``, ``vocab_size``
51,200, ``n_positions`` 2,048) written into a temporary folder, as a user runs it::

    python -m apps.cli plan --model-config DIR/config.json --devices N --dp D --tp T
        --micro-batches M --micro-batch-size 1 --seq-len 2048 --device-type a100 --schedule 1f1b
        --precision 16-mixed --recompute full -o DIR/plan --json

==========  ======  ======  =====  ==  ==  =====  ==  =====  =======================
run         layers  hidden  heads  tp  pp  GPUs   dp  batch  published TFLOP/s/GPU
==========  ======  ======  =====  ==  ==  =====  ==  =====  =======================
1.7B        24      2,304   24     1   1   32     32  512    137
18.4B       40      6,144   48     8   1   256    32  1,024  135
145.6B      80      12,288  96     8   8   1,536  24  2,304  148
==========  ======  ======  =====  ==  ==  =====  ==  =====  =======================

Micro-batches per replica = batch / dp (16, 32, 96).

**Published seconds per iteration.** The paper counts the FLOPs of one iteration (section 5.1,
its equation for F, recomputation included: 4 forward passes' worth of the layers' matmuls) as
``F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` and reports ``F / (time x GPUs)`` as its TFLOP/s
per GPU; so the published time is ``F / (TFLOP/s x 1e12 x GPUs)``: 3.53 s, 9.40 s, 24.8 s.
Issue 31 compared plans without recomputation against 3/4 of these (2.65, 7.05, 18.6 s); the
exact work without the recomputed forward (the logit layer is never recomputed) is
``72 B s l h^2 (1 + s/(6h)) + 6 B s h V``: 2.69, 7.08, 18.6 s at the published speed. The
predicted TFLOP/s per GPU below is the paper's count: ``F / predicted time / GPUs``.

**Memory formula** (what the plan's breakdown is set beside, on the pipeline rank with the
largest predicted peak):

- weights, gradients and optimizer states: 20 bytes per parameter, Megatron-LM's count for fp16
  parameters with fp16 gradients, an fp32 gradient copy, fp32 master weights and Adam's two fp32
  moments without the distributed optimizer (Megatron-LM ``docs/source/api-guide/dist_optimizer.md``,
  "bytes per parameter"; the paper's runs predate the distributed optimizer; ZeRO, Rajbhandari et
  al. 2020, section 3.1, counts 16 by leaving out the fp32 gradient copy). Parameters on the
  first pipeline stage: ``l/p`` layers of ``(12 h^2 + 13 h) / t`` plus the word embedding
  ``V h / t`` and the position table ``s h``; on the last: its layers, the final layer norm and a
  copy of the word embedding (the tied LM head) when ``p > 1``;
- activations with full recomputation (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", sections 4 and 5): each layer keeps only its input,
  ``2 s b h`` bytes at 16 bits (whole on every tensor-parallel rank: no sequence parallelism),
  for the ``l/p`` layers of the stage, times the micro-batches in flight (1F1B: ``p`` on the first
  stage, 1 without a pipeline), plus one layer's full activations while it is recomputed,
  ``s b h (10 + 24/t + 5 a s / (h t))`` (``34 + 5 a s / h`` at ``t = 1``).

Targets (issue 31): predicted time within 10% of the published on each run; each run predicted
to fit 80 GB (the A100 table's 80 GiB); the 1,536-GPU run planned in under 30 s (the time the
plan command reports, ``planned in ... s``: capture to the written files; the table also shows
the command's wall time, interpreter start and imports included).

Also torchtitan's FSDP2 run of Llama 3 8B on 64 A100s (``llama3-8b-fsdp``, and ``llama3-8b-fsdp-norc``
without recomputation): ``benchmarks/published_fsdp.py``, its rows under ``fsdp_rows`` in the JSON.

Usage: ``python benchmarks/published_runs.py [--json] [--runs 1.7B,18.4B,145.6B,llama3-8b-fsdp] [--keep DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Table 1's common settings: vocabulary, sequence length, micro-batch size, device.
VOCAB = 51_200
SEQ_LEN = 2_048
MICRO_BATCH_SIZE = 1
DEVICE_TYPE = "a100"
#: A100 memory in the device table (bytes): 80 GiB.
A100_MEMORY = 80 * 2**30
#: A100's dense fp16/bf16 tensor-core peak (FLOP/s), for the paper's "percentage of peak".
A100_PEAK_FLOPS = 312e12
#: What the published runs trained with, as ``tessel plan`` flags.
POLICY_FLAGS = ("--precision", "16-mixed", "--recompute", "full")
#: Megatron-LM's bytes per parameter of fp16 parameters and gradients, fp32 gradient copy, master
#: weights and Adam moments (no distributed optimizer).
BYTES_PER_PARAM = 20
#: The targets: relative time error, the planning time of the 1,536-GPU run (seconds).
TIME_TOLERANCE = 0.10
PLAN_SECONDS = 30.0


@dataclass(frozen=True)
class PublishedRun:
    """One row of Narayanan et al. (SC'21), Table 1.

    Attributes:
        name: the model size as the paper labels it (``"1.7B"``).
        layers, hidden, heads: ``l``, ``h``, ``a``.
        tp, pp, gpus: tensor- and pipeline-parallel degrees and the GPU count (``dp = gpus / (tp pp)``).
        batch: the global batch ``B`` (sequences).
        tflops: the published achieved TFLOP/s per GPU.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float

    @property
    def dp(self) -> int:
        """Data-parallel degree ``gpus / (tp * pp)``."""
        return self.gpus // (self.tp * self.pp)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per replica per iteration: ``B / (dp * micro-batch size)``."""
        return self.batch // (self.dp * MICRO_BATCH_SIZE)


RUNS: tuple[PublishedRun, ...] = (
    PublishedRun("1.7B", 24, 2_304, 24, 1, 1, 32, 512, 137.0),
    PublishedRun("18.4B", 40, 6_144, 48, 8, 1, 256, 1_024, 135.0),
    PublishedRun("145.6B", 80, 12_288, 96, 8, 8, 1_536, 2_304, 148.0),
)


def paper_flops(run: PublishedRun, *, recompute: bool = True) -> float:
    """FLOPs of one iteration as the paper counts them (section 5.1): per layer and sample a forward
    of ``24 s h^2 + 4 s^2 h``, a backward of twice that and, with full recomputation, the forward
    again; the logit layer ``2 s h V`` forward and twice that backward, not recomputed. With
    recomputation this is the paper's ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``; without it
    ``72 B s l h^2 (1 + s/(6h)) + 6 B s h V``."""
    n, h, s, b = run.layers, run.hidden, SEQ_LEN, run.batch
    layers = (96 if recompute else 72) * b * s * n * h**2 * (1 + s / (6 * h))
    return layers + 6 * b * s * h * VOCAB


def published_seconds(run: PublishedRun, *, recompute: bool = True) -> float:
    """Seconds per iteration the published TFLOP/s per GPU imply: ``F / (TFLOP/s x 1e12 x GPUs)``
    (``recompute=False``: the work without the recomputed forward, at the same speed)."""
    return paper_flops(run, recompute=recompute) / (run.tflops * 1e12 * run.gpus)


def paper_tflops_per_gpu(run: PublishedRun, seconds: float) -> float:
    """TFLOP/s per GPU in the paper's count for an iteration of ``seconds``: ``F / seconds / GPUs / 1e12``."""
    return paper_flops(run) / seconds / run.gpus / 1e12


def gpt_params(run: PublishedRun) -> int:
    """Parameters of the GPT-2-architecture model: ``l (12 h^2 + 13 h) + V h + s h + 2 h`` (layers;
    tied word embedding and LM head; position table; final layer norm). The paper's
    ``12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))`` is the same less the final layer norm."""
    n, h = run.layers, run.hidden
    return n * (12 * h * h + 13 * h) + VOCAB * h + SEQ_LEN * h + 2 * h


def stage_params(run: PublishedRun) -> int:
    """Parameters on the largest pipeline stage on one tensor-parallel rank (see the module
    docstring): the first (embeddings) or the last (final norm and the tied LM head's copy); the
    layers' ``13 h`` biases and norms are counted as split over ``t`` like their matrices."""
    h, t = run.hidden, run.tp
    layers = run.layers // run.pp * (12 * h * h + 13 * h) // t
    first = layers + VOCAB * h // t + SEQ_LEN * h
    if run.pp == 1:   # one stage: the whole model, final norm included
        return first + 2 * h
    return max(first, layers + 2 * h + VOCAB * h // t)


def formula_memory(run: PublishedRun) -> dict[str, float]:
    """The formula's memory of the first pipeline stage (bytes; the module docstring's sources):
    ``weights_states`` (20 bytes per parameter), ``activations_per_micro_batch`` (the layer
    inputs kept, ``2 s b h`` per layer), ``in_flight`` (1F1B: ``p``), ``recompute_layer`` (one
    layer's full activations, ``s b h (10 + 24/t + 5 a s/(h t))``) and ``total``."""
    s, b, h, a, t = SEQ_LEN, MICRO_BATCH_SIZE, run.hidden, run.heads, run.tp
    weights = float(BYTES_PER_PARAM * stage_params(run))
    per_mb = 2.0 * s * b * h * (run.layers // run.pp)
    in_flight = min(run.pp, run.micro_batches)
    full = 34 + 5 * a * s / h if t == 1 else 10 + 24 / t + 5 * a * s / (h * t)
    layer = s * b * h * full
    return {"weights_states": weights, "activations_per_micro_batch": per_mb, "in_flight": in_flight,
            "recompute_layer": layer, "total": weights + per_mb * in_flight + layer}


def write_config(run: PublishedRun, folder: Path) -> Path:
    """Write the run's GPT-2-architecture ``config.json`` into ``folder``; its path."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": run.layers,
           "n_embd": run.hidden, "n_head": run.heads, "vocab_size": VOCAB, "n_positions": SEQ_LEN,
           "n_ctx": SEQ_LEN, "activation_function": "gelu_new", "tie_word_embeddings": True,
           "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    path = folder / "config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def plan_command(run: PublishedRun, config: Path, out: Path) -> list[str]:
    """The ``tessel plan`` command line of a run (through ``python -m apps.cli``)."""
    return [sys.executable, "-m", "apps.cli", "plan", "--model-config", str(config),
            "--devices", str(run.gpus), "--dp", str(run.dp), "--tp", str(run.tp),
            "--micro-batches", str(run.micro_batches), "--micro-batch-size", str(MICRO_BATCH_SIZE),
            "--seq-len", str(SEQ_LEN), "--device-type", DEVICE_TYPE, "--schedule", "1f1b",
            *POLICY_FLAGS, "-o", str(out), "--json"]


def in_flight(order: list[str]) -> int:
    """Most micro-batches whose forward ran and whose backward has not, over one device's order of
    action strings (``"0F3"``: segment 0, forward, micro-batch 3; ``B`` or ``I`` ends one)."""
    live, most = 0, 0
    for action in order:
        kind = next(ch for ch in action if ch.isalpha())
        live += 1 if kind == "F" else -1 if kind in "BI" else 0
        most = max(most, live)
    return most


def plan_memory(plan: dict) -> dict[str, float]:
    """The plan's memory breakdown on the pipeline rank with the largest predicted peak (bytes):
    ``rank``, ``peak``, ``weights_states`` (static memory plus the gradient buffer),
    ``activations_per_micro_batch`` (its segments' kept activations), ``in_flight`` (from its
    schedule order)."""
    peaks = plan["metrics"]["peak_memory"]
    r = max(range(len(peaks)), key=lambda i: peaks[i])
    pl = plan["placement"]
    segs = {int(b["segment"]) for b in pl["blocks"] if b["kind"] == "F" and r in b["devices"]}
    act = sum(float(s.get("activation_bytes", 0)) for s in plan["segments"] if int(s["index"]) in segs)
    grads = (pl.get("grad_memory") or [0] * len(peaks))[r]
    return {"rank": r, "peak": float(peaks[r]), "weights_states": float(pl["static_memory"][r] + grads),
            "activations_per_micro_batch": act, "in_flight": in_flight(plan["schedule"]["orders"][r])}


def run_cli(cmd: list[str], timeout: float = 900.0) -> tuple[dict, float]:
    """Run a ``tessel ... --json`` command from the repository root; its last stdout line as JSON
    and its wall time (seconds).

    Raises:
        RuntimeError: the command failed (its last stderr lines).
    """
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:])} exited {proc.returncode}: {proc.stderr.strip()[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall


def run_one(run: PublishedRun, folder: Path, timeout: float = 900.0) -> dict:
    """Plan one run through the CLI and compare it with the paper; one result dict.

    Raises:
        RuntimeError: the plan command failed (its last stderr lines).
    """
    config = write_config(run, folder / "model")
    res, wall = run_cli(plan_command(run, config, folder / "plan"), timeout)
    plan = json.loads(Path(res["plan"]).read_text())
    seconds = float(res["makespan"])
    published = published_seconds(run)
    metrics = plan.get("metrics", {})
    mfu = res.get("mfu", metrics.get("mfu"))
    return {
        "run": asdict(run), "dp": run.dp, "micro_batches": run.micro_batches,
        "num_params": plan["model"].get("num_params"), "formula_params": gpt_params(run),
        "precision": plan["parallel"].get("precision"), "recompute": plan["parallel"].get("recompute"),
        "predicted_seconds": seconds, "published_seconds": published,
        "published_seconds_without_recompute": published_seconds(run, recompute=False),
        "time_error": seconds / published - 1,
        "predicted_tflops": paper_tflops_per_gpu(run, seconds), "published_tflops": run.tflops,
        "mfu": mfu, "published_mfu": run.tflops * 1e12 / A100_PEAK_FLOPS,
        "memory": plan_memory(plan), "formula_memory": formula_memory(run), "memory_capacity": A100_MEMORY,
        "plan_elapsed": float(res.get("elapsed", 0.0)), "plan_wall": wall,
    }


def targets(row: dict) -> dict[str, bool]:
    """Issue 31's targets for one result row (the planning time only for the 1,536-GPU run)."""
    out = {"time_within_10pct": abs(row["time_error"]) <= TIME_TOLERANCE,
           "fits_80gb": row["memory"]["peak"] <= row["memory_capacity"]}
    if row["run"]["gpus"] >= 1536:
        out["planned_under_30s"] = row["plan_elapsed"] < PLAN_SECONDS
    return out


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def report(row: dict) -> str:
    """One run's table: predicted beside published (or the formula's), with the error."""
    r, m, f = row["run"], row["memory"], row["formula_memory"]
    head = (f"{r['name']}: {r['layers']} layers, hidden {r['hidden']:,}, {r['heads']} heads; tp {r['tp']} pp "
            f"{r['pp']} dp {row['dp']} on {r['gpus']:,} A100s; batch {r['batch']:,} = {row['micro_batches']} "
            f"micro-batches of {MICRO_BATCH_SIZE} x {SEQ_LEN:,}; precision {row['precision']}, recompute "
            f"{row['recompute']}; {row['num_params'] or 0:,} parameters (formula {row['formula_params']:,})")
    mfu = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
    rows = [
        ("seconds per iteration", f"{row['predicted_seconds']:.3f}", f"{row['published_seconds']:.3f}",
         f"{row['time_error']:+.1%}"),
        ("TFLOP/s per GPU (paper's count)", f"{row['predicted_tflops']:.1f}", f"{r['tflops']:.1f}",
         f"{row['predicted_tflops'] / r['tflops'] - 1:+.1%}"),
        ("MFU (plan) / published % of peak", mfu, f"{row['published_mfu']:.1%}", ""),
        (f"peak memory, pipeline rank {m['rank']}", _gb(m["peak"]), _gb(f["total"]),
         f"{m['peak'] / f['total'] - 1:+.1%}"),
        ("  weights, grads, optimizer states", _gb(m["weights_states"]), _gb(f["weights_states"]),
         f"{m['weights_states'] / f['weights_states'] - 1:+.1%}"),
        ("  activations per micro-batch", _gb(m["activations_per_micro_batch"]),
         _gb(f["activations_per_micro_batch"]), ""),
        ("  micro-batches in flight", str(m["in_flight"]), str(f["in_flight"]), ""),
        ("  one layer recomputed (formula)", "", _gb(f["recompute_layer"]), ""),
        ("memory capacity", _gb(row["memory_capacity"]), "", ""),
        ("planning time (CLI elapsed / wall)", f"{row['plan_elapsed']:.1f} s / {row['plan_wall']:.1f} s", "", ""),
    ]
    widths = [max(len(x[i]) for x in rows + [("", "predicted", "published / formula", "error")])
              for i in range(4)]
    lines = [head, "  ".join(h.ljust(w) for h, w in zip(("", "predicted", "published / formula", "error"), widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(x, widths)) for x in rows]
    lines.append("targets: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in targets(row).items()))
    return "\n".join(lines)


def plan_rows(runs, names: list[str], base: Path, *, run_one, targets, report,
              quiet: bool) -> tuple[list[dict], dict[str, str]]:
    """Plan each of ``runs`` named in ``names`` into ``base / run.name`` with ``run_one(run, folder)``;
    ``(rows, failures)``: each row with its ``targets(row)``, printed as ``report(row)`` unless
    ``quiet``; a run whose plan command failed (``RuntimeError``, a timeout) is a failure with its
    message, printed to stderr, and the others still run."""
    rows, failures = [], {}
    for run in (r for r in runs if r.name in names):
        try:
            row = run_one(run, base / run.name)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            failures[run.name] = str(e)
            print(f"{run.name}: {e}", file=sys.stderr)
            continue
        row["targets"] = targets(row)
        rows.append(row)
        if not quiet:
            print(report(row) + "\n", flush=True)
    return rows, failures


def main(argv: list[str] | None = None) -> int:
    import published_fsdp  # torchtitan's FSDP2 row(s); it imports this module's helpers

    fsdp_names = [r.name for r in published_fsdp.RUNS]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--runs", default=",".join([r.name for r in RUNS] + fsdp_names[:1]),
                    help=f"comma-separated run names (default all Megatron-LM rows and {fsdp_names[0]}; also "
                         f"{', '.join(fsdp_names[1:])}: benchmarks/published_fsdp.py)")
    ap.add_argument("--keep", default=None, help="write the configs and plans here (default a temporary folder)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in {r.name for r in RUNS} | set(fsdp_names)]
    if unknown:
        ap.error(f"unknown run(s) {', '.join(unknown)}; use {', '.join([r.name for r in RUNS] + fsdp_names)}")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.keep) if args.keep else Path(tmp)
        rows, failures = plan_rows(RUNS, names, base, run_one=run_one, targets=targets, report=report,
                                   quiet=args.json)
        fsdp_rows, fsdp_failures = published_fsdp.run_rows(names, base, quiet=args.json)
    failures.update(fsdp_failures)
    if args.json:
        print(json.dumps({"rows": rows, "fsdp_rows": fsdp_rows, "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
