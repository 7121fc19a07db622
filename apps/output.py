"""Console output helpers for the CLI: tables, units, the final JSON line."""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

from engine.plan.metrics import plan_facts


def fmt_ms(seconds: float) -> str:
    """Seconds as milliseconds text."""
    return f"{seconds * 1e3:,.3f} ms"


def fmt_gib(nbytes: float) -> str:
    """Bytes as GiB text."""
    return f"{nbytes / 2**30:,.2f} GiB"


def fmt_bytes(nbytes: float) -> str:
    """Bytes as GiB text from 1 GiB up, else MiB."""
    return fmt_gib(nbytes) if nbytes >= 2**30 else f"{nbytes / 2**20:,.2f} MiB"


def facts_line(plan: Any) -> str:
    """:func:`engine.plan.metrics.plan_facts` as one line: ``precision bf16-mixed, sequence length 1,024, global batch 8
    sequences, recomputation none``."""
    f = plan_facts(plan)
    seq = f"{f['seq_len']:,}" if f["seq_len"] else "-"
    rc = f"per stage {','.join(f['stage_recompute'])}" if f.get("stage_recompute") else f["recompute"]
    return (f"precision {f['precision']}, sequence length {seq}, global batch {f['global_batch']:,} sequences, "
            f"recomputation {rc}")


def mfu_line(metrics: dict) -> str:
    """Model FLOPs utilization as one line (``""`` for a plan without model FLOPs)."""
    if not metrics.get("model_flops"):
        return ""
    mfu = metrics.get("mfu")
    return (f"model FLOPs {metrics['model_flops'] / 1e12:,.4g} TFLOP per step, "
            f"{metrics['tflops_per_device']:,.2f} TFLOP/s per device"
            + (f", MFU {mfu:.2%}" if mfu is not None else "")
            + " (Megatron-LM's count: 3 x forward; recomputation not counted)")


def memory_line(metrics: dict) -> str:
    """The peak device's memory broken down as one line (``""`` without a breakdown)."""
    mb = metrics.get("memory_breakdown")
    if not mb:
        return ""
    return (f"memory of device {mb['device']} at its peak {fmt_bytes(mb['peak'])}: weights and optimizer states "
            f"{fmt_bytes(mb['weights_and_optimizer_states'])}, gradients {fmt_bytes(mb['gradients'])}, activations "
            f"{fmt_bytes(mb['activations_per_micro_batch'])} per micro-batch x "
            f"{mb['micro_batches_in_flight']:g} micro-batches in flight")


def report_fields(plan: Any, metrics: dict) -> dict:
    """The ``--json`` fields every planning command adds: :func:`engine.plan.metrics.plan_facts` and the metrics'
    ``model_flops``, ``tflops_per_device``, ``mfu`` and ``memory_breakdown``."""
    return {**plan_facts(plan), **{k: metrics.get(k) for k in ("model_flops", "tflops_per_device", "mfu",
                                                                 "memory_breakdown")}}


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def emit_json(obj: dict) -> None:
    """Print ``obj`` as one JSON line: the last line of stdout for ``--json``."""
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()
