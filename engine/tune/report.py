"""What ``tessel tune`` says about its result: the ranked table's cells, why the runner-up loses
to the winner, and, when nothing fits, the smallest change that would (shared by the CLI, the
app's Tune tab and the Python API)."""

from __future__ import annotations

import csv
import io
import math
from typing import TYPE_CHECKING

from engine.tune.space import Candidate

if TYPE_CHECKING:
    from engine.tune.tuner import TuneResult, TuneRow

__all__ = ["TABLE_HEADERS", "table_row", "why_runner_up_loses", "nothing_fits_advice", "csv_text"]

#: Column names of the ranked table (:func:`table_row`).
TABLE_HEADERS = ("#", "tp", "pp", "dp", "v", "mbs x m", "schedule", "recompute", "transforms", "step ms",
                 "tokens/s", "MFU", "peak GiB", "bubble")


def table_row(rank: int, r: TuneRow) -> list[str]:
    """The table cells of row ``r`` (times in ms, memory in GiB, MFU and bubble in percent; the
    ``dp`` cell names fully sharded data parallelism: ``8 fsdp8``, ``8 hsdp2x4``)."""
    c = r.candidate

    def num(x: float | None, fmt: str, unit: str = "") -> str:
        return "-" if x is None or not math.isfinite(x) else format(x, fmt) + unit

    dp = f"{c.dp} {c.sharding()}" if c.dp_shard > 1 else str(c.dp)
    return [str(rank), str(c.tp), str(c.pp), dp, str(c.virtual_stages),
            f"{c.micro_batch_size} x {c.micro_batches}", c.schedule, c.recompute, ",".join(c.transforms) or "-",
            num(None if r.step_time is None else r.step_time * 1e3, ".4g"), num(r.tokens_per_second, ",.0f"),
            num(None if r.mfu is None else r.mfu * 100, ".1f", "%"),
            num(None if r.peak_memory is None else r.peak_memory / 2**30, ".2f"),
            num(None if r.bubble_ratio is None else r.bubble_ratio * 100, ".1f", "%")]


def _differences(a: Candidate, b: Candidate) -> list[str]:
    """The knobs where ``b`` differs from ``a``, as ``knob a -> b``."""
    out = []
    for k, va in a.knobs().items():
        vb = b.knobs()[k]
        if va != vb:
            out.append(f"{k} {va or '-'} -> {vb or '-'}")
    return out


def why_runner_up_loses(result: TuneResult) -> str:
    """One sentence: how much slower the second fitting row is than the first and what makes it so
    (its pipeline bubble or its busy time per device: more computation, recomputation or
    communication), naming the knobs that differ. Empty when fewer than two rows fit."""
    fit = result.fitting()
    if len(fit) < 2:
        return ""
    w, r = fit[0], fit[1]
    assert w.step_time and r.step_time is not None and w.bubble_ratio is not None and r.bubble_ratio is not None
    slower = r.step_time / w.step_time - 1
    busy_w, busy_r = w.step_time * (1 - w.bubble_ratio), r.step_time * (1 - r.bubble_ratio)
    idle_w, idle_r = w.step_time - busy_w, r.step_time - busy_r
    diff = "; ".join(_differences(w.candidate, r.candidate)) or "no knob"
    if slower <= 0:
        return (f"the runner-up ({r.candidate.label()}) predicts the same step time; it needs "
                f"{(r.peak_memory or 0) / 2**30:.2f} GiB against {(w.peak_memory or 0) / 2**30:.2f} GiB ({diff})")
    if idle_r - idle_w >= busy_r - busy_w:
        why = (f"its devices idle longer (bubble {r.bubble_ratio:.1%} against {w.bubble_ratio:.1%}: "
               f"{(idle_r - idle_w) * 1e3:.4g} ms more per step)")
    else:
        why = (f"each device is busy longer ({busy_r * 1e3:.4g} ms against {busy_w * 1e3:.4g} ms: more computation, "
               f"recomputation or communication per device)")
    return f"the runner-up ({r.candidate.label()}) is {slower:.1%} slower: {why}; it differs in {diff}"


def nothing_fits_advice(result: TuneResult) -> str:
    """One sentence for a search where nothing fits: the limit, the closest candidate, and the
    smallest change that would fit: recomputation or a smaller micro-batch where the space left
    them out, fully sharded data parallelism, the sharded update, else more GPUs (the parameters'
    state shrinks as ``1 / (tp pp)``, so the GPUs needed scale with the closest candidate's
    excess)."""
    limit = result.memory_limit
    if result.rows and all(r.status == "not visited" for r in result.rows):
        return (f"the time limit ended the search before any of the {len(result.rows)} configurations was planned; "
                "give a larger --time-limit")
    sim = [r for r in result.rows if r.peak_memory is not None]
    bound = [r for r in result.rows if r.status in ("memory bound", "over memory") and r.memory_bound is not None]
    space = result.space
    head = f"nothing fits in {limit / 2**30:.1f} GiB per device"
    if sim:
        best = min(sim, key=lambda r: r.peak_memory or math.inf)
        peak = best.peak_memory or 0.0
        head += f": the smallest predicted peak is {peak / 2**30:.1f} GiB ({best.candidate.label()})"
    elif bound:
        best = min(bound, key=lambda r: r.memory_bound or math.inf)
        peak = best.memory_bound or 0.0
        head += (f": the smallest candidate needs at least {peak / 2**30:.1f} GiB for its weights, optimizer "
                 f"states and gradients ({best.candidate.label()})")
    else:
        reasons = sorted({r.reason for r in result.rows if r.status == "refused"})
        return head + ("; every candidate was refused, e.g. " + reasons[0] if reasons else "")
    if "full" not in space.recompute:
        fix = "allow full recomputation (--recompute none,selective,full)"
    elif min(space.micro_batch_sizes) > 1:
        fix = "allow a micro-batch size of 1 (--micro-batch-sizes 1,...)"
    elif not space.fully_sharded and space.gpus > 1:
        fix = "allow fully sharded data parallelism (drop --no-fully-sharded)"
    elif not space.sharded_update and space.gpus > 1:
        fix = "allow the sharded update (drop --no-sharded-update)"
    else:
        need = space.gpus * math.ceil(peak / limit) if limit > 0 else space.gpus * 2
        fix = f"use more GPUs (about {need}) or a larger --memory-limit"
    return f"{head}; {fix}"


def csv_text(result: TuneResult) -> str:
    """Every row of ``result`` as CSV (header first; seconds, bytes), in rank order."""
    buf = io.StringIO()
    rows = [r.to_dict() for r in result.rows]
    keys = list(rows[0]) if rows else ["label", "status"]
    w = csv.DictWriter(buf, fieldnames=["rank", *keys], lineterminator="\n")
    w.writeheader()
    for i, d in enumerate(rows, 1):
        w.writerow({"rank": i, **d})
    return buf.getvalue()
