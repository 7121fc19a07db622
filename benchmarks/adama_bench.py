"""AdamA vs gradient accumulation with ``torch.optim.Adam``: peak memory, step throughput, the
planner's predicted peak, and a loss comparison, single process on CPU.

Setup. GPT-2 (Hugging Face, byte vocabulary 256) at two sizes: the registry's ``gpt2-small-cpu``
(6 layers x 256 hidden, 4.9M parameters) and ``gpt2-12x512-cpu`` registered here (12 layers x
512 hidden, 8 heads, 38.1M parameters, 145 MiB of fp32 weights); micro-batches of 2 x 128 tokens
of real text (``runtime.data.ByteCorpus``: the CPython standard library sources as bytes), N = 4
and 8 micro-batches per optimizer step, fp32, ``torch.set_num_threads(1)`` (``--threads``).
Both optimizers run the same loop: ``(loss_i / N).backward()`` per micro-batch, then
``opt.step(); opt.zero_grad(set_to_none=True)``; ``lr=1e-3``, default betas/eps, no weight decay.
``torch.optim.Adam`` runs its CPU default (single-tensor, not foreach/fused).

Memory (each optimizer in its own fresh subprocess):

- **peak**: the peak of live bytes allocated through PyTorch's CPU allocator, from
  ``torch.profiler`` memory events (``profile_memory=True``: every allocation and free with its
  size), counted from before the model is built, so parameters, optimizer states, gradients,
  activations, autograd buffers and kernel temporaries are all in it; the peak is taken over the
  second optimizer step (Adam creates its states lazily in the first).
- **RSS**: peak resident set size (``ru_maxrss``) minus the RSS after imports, from a separate
  subprocess without the profiler. Secondary: the glibc allocator keeps freed pages, so RSS
  differences are noisy.
- **predicted**: ``engine.plan.make.make_plan(model, devices=1, micro_batches=N, optimizer=...,
  device_type="cpu")``'s ``peak_memory`` (the planner's memory model: parameters + m + v, Adam's
  gradient buffer from the first backward to the step, transient gradient of the largest
  tensor, activations from the captured graph).

Throughput: one subprocess per (model, N) holds two identical copies of the model, one per
optimizer, and alternates their steps (which goes first alternates too) so that load from other
processes on the machine hits both alike; tokens/s = N x 2 x 128 / step time, median over
``--steps`` steps after one warm-up step each.

Loss: ``gpt2-small-cpu``, N = 4 micro-batches of 2 x 128 tokens, 200 steps (``--loss-steps``),
lr 1e-3 after a 20-step linear warm-up, same seed (same initial weights) and the same batches
for both; reported: first/final losses (mean of the last 10 steps) and the largest and mean
relative difference of the two loss curves after the warm-up, per step and of 10-step moving
averages.

Targets (issue 6): AdamA's peak lower by at least the gradient bytes that no longer stay resident
(the reduction in % and the gradients' share of Adam's peak are reported), throughput >= 0.98x.

Usage: ``python benchmarks/adama_bench.py [--json] [--steps 5] [--loss-steps 200] [--threads 1] [--quick]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("gpt2-small-cpu", "gpt2-12x512-cpu")
MICRO_BATCHES = (4, 8)
MBS, SEQ, LR = 2, 128, 1e-3
WARMUP = 20  # steps of linear learning-rate warm-up in the loss comparison
THROUGHPUT_TARGET = 0.98


def register_large() -> None:
    """Register ``gpt2-12x512-cpu`` (HF GPT-2, 12 layers, hidden 512, 8 heads, byte vocab 256,
    256 positions, no dropout) with :func:`engine.models.register_model`, once."""
    from engine.models import registry

    if "gpt2-12x512-cpu" in registry.list_models():
        return
    registry.register_model("gpt2-12x512-cpu", registry.byte_gpt2_builder(n_layer=12, n_embd=512, n_head=8),
                            default_seq_len=128, source="hf",
                            description="HF GPT-2, 12 layers, hidden 512, 8 heads, byte vocab 256 (38M params)",
                            vocab_size=lambda c: int(c["vocab_size"]), max_seq_len=lambda c: int(c["n_positions"]))


# ----------------------------------------------------------------------------- the training loop
def _build(name: str, seed: int = 0):
    import torch

    from engine.models import build_model

    register_large()
    torch.manual_seed(seed)
    return build_model(name, batch_size=MBS, seq_len=SEQ, device="cpu").module.train()


def _optimizer(kind: str, model):
    import torch

    from runtime.adama import AdamA

    if kind == "adama":
        return AdamA(model.parameters(), lr=LR)
    return torch.optim.Adam(model.parameters(), lr=LR)


def _batches(corpus, step: int, n: int) -> list:
    """Micro-batches of optimizer step ``step``: deterministic (ByteCorpus depends on the step only)."""
    return [corpus.train_batch(step * n + i, MBS) for i in range(n)]


def train_step(model, opt, batches) -> float:
    """One optimizer step over ``batches`` (each int64 ``[mbs, seq+1]``); returns the mean loss.

    Both optimizers: ``(loss_i / N).backward()`` per micro-batch, then ``step`` and
    ``zero_grad(set_to_none=True)`` (a no-op for AdamA, whose hooks freed every gradient).
    """
    import torch.nn.functional as F

    n = len(batches)
    total = 0.0
    for xb in batches:
        logits = model(xb[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), xb[:, 1:].reshape(-1))
        (loss / n).backward()
        total += float(loss.detach())
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total / n


# ----------------------------------------------------------------------------- subprocess workers
def _worker_memory(model_name: str, kind: str, n: int) -> dict:
    """Peak live allocator bytes over the second step (torch.profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from runtime.data import ByteCorpus

    corpus = ByteCorpus(seq_len=SEQ)
    batches = [_batches(corpus, s, n) for s in range(2)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = _build(model_name)
        opt = _optimizer(kind, model)
        for s in range(2):
            with record_function(f"adama_bench_step{s}"):
                train_step(model, opt, batches[s])
    events = prof.profiler.kineto_results.events()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    window = next((e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() == "adama_bench_step1")
    cur = peak_all = peak = 0
    for t, nb in mem:
        cur += nb
        peak_all = max(peak_all, cur)
        if window[0] <= t <= window[1]:
            peak = max(peak, cur)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    return {"peak_bytes": peak, "peak_bytes_all_steps": peak_all, "param_bytes": params,
            "largest_param_bytes": largest, "num_params": sum(p.numel() for p in model.parameters()),
            "end_bytes": cur}


def _worker_rss(model_name: str, kind: str, n: int) -> dict:
    """Peak RSS increase over 2 steps without the profiler (bytes)."""
    import psutil

    from runtime.data import ByteCorpus

    corpus = ByteCorpus(seq_len=SEQ)
    batches = [_batches(corpus, s, n) for s in range(2)]
    base = psutil.Process(os.getpid()).memory_info().rss
    model = _build(model_name)
    opt = _optimizer(kind, model)
    for s in range(2):
        train_step(model, opt, batches[s])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"rss_peak_delta_bytes": peak - base}


def _worker_throughput(model_name: str, n: int, steps: int) -> dict:
    """Alternate Adam and AdamA steps on two identical model copies; per-step seconds of each."""
    from runtime.data import ByteCorpus

    corpus = ByteCorpus(seq_len=SEQ)
    runs = {}
    for kind in ("adam", "adama"):
        model = _build(model_name)
        runs[kind] = (model, _optimizer(kind, model))
    times: dict[str, list[float]] = {"adam": [], "adama": []}
    for s in range(steps + 1):
        batches = _batches(corpus, s, n)
        order = ("adam", "adama") if s % 2 == 0 else ("adama", "adam")
        for kind in order:
            model, opt = runs[kind]
            t0 = time.perf_counter()
            train_step(model, opt, batches)
            times[kind].append(time.perf_counter() - t0)
    return {k: v[1:] for k, v in times.items()}  # drop the warm-up step


def _run_worker(mode: str, **kw) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps({"mode": mode, **kw}),
           "--threads", str(kw.get("threads", 1))]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       check=False)
    if p.returncode != 0:
        raise RuntimeError(f"adama_bench worker {mode} {kw} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- measurements
def predicted_peak(model_name: str, kind: str, n: int) -> int:
    """The planner's predicted peak bytes on one CPU device (``make_plan(..., optimizer=kind)``)."""
    from engine.plan.make import make_plan

    register_large()
    res = make_plan(model_name, devices=1, micro_batches=n, schedule="1f1b", device_type="cpu",
                    micro_batch_size=MBS, seq_len=SEQ, optimizer=kind)
    return int(res.plan.metrics["peak_memory"][0])


def memory_and_throughput(model_name: str, n: int, steps: int, threads: int) -> dict:
    """One row of the table: measured/predicted peaks, RSS, throughput for ``model_name`` x ``n``."""
    row: dict = {"model": model_name, "micro_batches": n, "tokens_per_step": n * MBS * SEQ}
    for kind in ("adam", "adama"):
        mem = _run_worker("memory", model=model_name, kind=kind, n=n, threads=threads)
        rss = _run_worker("rss", model=model_name, kind=kind, n=n, threads=threads)
        row[kind] = {**mem, **rss, "predicted_peak_bytes": predicted_peak(model_name, kind, n)}
    tp = _run_worker("throughput", model=model_name, n=n, steps=steps, threads=threads)
    for kind in ("adam", "adama"):
        med = statistics.median(tp[kind])
        row[kind].update(step_s=med, step_times_s=tp[kind], tokens_per_second=row["tokens_per_step"] / med)
    a, b = row["adam"], row["adama"]
    params = a["param_bytes"]
    row.update(
        param_bytes=params,
        num_params=a["num_params"],
        saved_bytes=a["peak_bytes"] - b["peak_bytes"],
        reduction=1 - b["peak_bytes"] / a["peak_bytes"],
        grad_share_of_adam_peak=params / a["peak_bytes"],
        saved_over_grad_bytes=(a["peak_bytes"] - b["peak_bytes"]) / params,
        predicted_saved_bytes=a["predicted_peak_bytes"] - b["predicted_peak_bytes"],
        throughput_ratio=b["tokens_per_second"] / a["tokens_per_second"],
    )
    row["meets_memory_target"] = row["saved_bytes"] >= params
    row["meets_throughput_target"] = row["throughput_ratio"] >= THROUGHPUT_TARGET
    return row


def loss_curves(model_name: str = "gpt2-small-cpu", steps: int = 200, n: int = 4, seed: int = 0) -> dict:
    """Adam (gradient accumulation) and AdamA from the same initial weights on the same batches.

    Learning rate: linear warm-up over the first ``WARMUP`` steps to ``LR``, then constant (without
    it both optimizers spike in the first 20 steps at 1e-3). Differences are relative to Adam's
    loss, per step and of 10-step moving averages, over the steps after the warm-up.
    """
    import torch

    from runtime.data import ByteCorpus

    corpus = ByteCorpus(seq_len=SEQ)
    out = {}
    for kind in ("adam", "adama"):
        model = _build(model_name, seed)
        opt = _optimizer(kind, model)
        losses = []
        for s in range(steps):
            for g in opt.param_groups:
                g["lr"] = LR * min(1.0, (s + 1) / WARMUP)
            losses.append(train_step(model, opt, _batches(corpus, s, n)))
        out[kind] = losses
        del model, opt
        torch.manual_seed(seed)
    a, b = out["adam"], out["adama"]
    skip = min(WARMUP, steps - 1)
    rel = [abs(x - y) / x for x, y in zip(a[skip:], b[skip:])]

    def smooth(c):
        return [statistics.fmean(c[max(0, i - 9):i + 1]) for i in range(len(c))]

    sa, sb = smooth(a), smooth(b)
    rel_s = [abs(x - y) / x for x, y in zip(sa[skip:], sb[skip:])]
    tail = min(10, steps)
    fa, fb = statistics.fmean(a[-tail:]), statistics.fmean(b[-tail:])
    return {"model": model_name, "steps": steps, "micro_batches": n, "lr": LR, "warmup_steps": WARMUP,
            "adam": a, "adama": b, "first": {"adam": a[0], "adama": b[0]}, "final": {"adam": fa, "adama": fb},
            "final_rel_diff": abs(fa - fb) / fa, "max_rel_diff": max(rel), "mean_rel_diff": statistics.fmean(rel),
            "max_rel_diff_smoothed": max(rel_s)}


# ----------------------------------------------------------------------------- main
def _mib(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per optimizer for throughput (default 5)")
    ap.add_argument("--loss-steps", type=int, default=200, help="steps of the loss comparison (default 200)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--quick", action="store_true", help="the small model only, N=4, 3 steps, 30 loss steps")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.worker:
        kw = json.loads(args.worker)
        mode = kw.pop("mode")
        kw.pop("threads", None)
        fn = {"memory": _worker_memory, "rss": _worker_rss, "throughput": _worker_throughput}[mode]
        if mode == "throughput":
            print(json.dumps(fn(kw["model"], kw["n"], kw["steps"])))
        else:
            print(json.dumps(fn(kw["model"], kw["kind"], kw["n"])))
        return 0

    models = MODELS[:1] if args.quick else MODELS
    ns = MICRO_BATCHES[:1] if args.quick else MICRO_BATCHES
    steps = 3 if args.quick else args.steps
    loss_steps = 30 if args.quick else args.loss_steps
    t0 = time.perf_counter()
    rows = [memory_and_throughput(m, n, steps, args.threads) for m in models for n in ns]
    loss = loss_curves(steps=loss_steps)
    result = {"threads": args.threads, "micro_batch": [MBS, SEQ], "rows": rows, "loss": loss,
              "memory_measure": "peak live bytes of PyTorch's CPU allocator (torch.profiler memory events), 2nd step",
              "elapsed_s": time.perf_counter() - t0}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"AdamA vs Adam with gradient accumulation, CPU, {args.threads} thread(s), "
          f"micro-batch {MBS} x {SEQ} tokens, fp32")
    print("peak = live bytes of PyTorch's CPU allocator (torch.profiler memory events) over a steady step; MiB\n")
    hdr = (f"{'model':<16} {'N':>2} {'params':>7} {'Adam peak':>10} {'AdamA peak':>10} {'saved':>7} {'reduct.':>7} "
           f"{'grad share':>10} {'pred Adam':>9} {'pred AdamA':>10} {'RSS Adam':>8} {'RSS AdamA':>9} "
           f"{'Adam tok/s':>10} {'AdamA tok/s':>11} {'ratio':>6}")
    print(hdr)
    for r in rows:
        a, b = r["adam"], r["adama"]
        print(f"{r['model']:<16} {r['micro_batches']:>2} {r['num_params'] / 1e6:>6.1f}M {_mib(a['peak_bytes']):>10} "
              f"{_mib(b['peak_bytes']):>10} {_mib(r['saved_bytes']):>7} {r['reduction']:>7.1%} "
              f"{r['grad_share_of_adam_peak']:>10.1%} {_mib(a['predicted_peak_bytes']):>9} "
              f"{_mib(b['predicted_peak_bytes']):>10} "
              f"{_mib(a['rss_peak_delta_bytes']):>8} {_mib(b['rss_peak_delta_bytes']):>9} "
              f"{a['tokens_per_second']:>10,.0f} {b['tokens_per_second']:>11,.0f} {r['throughput_ratio']:>6.3f}")
    print("\nsaved = Adam peak - AdamA peak (target: >= the gradient bytes, i.e. saved/params >= 1); "
          "grad share = parameter bytes / Adam peak; ratio = AdamA / Adam tokens/s (target >= 0.98)")
    for r in rows:
        print(f"  {r['model']} N={r['micro_batches']}: saved/grad bytes = {r['saved_over_grad_bytes']:.3f} "
              f"(predicted saving {_mib(r['predicted_saved_bytes'])} MiB), "
              f"memory target {'met' if r['meets_memory_target'] else 'MISSED'}, "
              f"throughput target {'met' if r['meets_throughput_target'] else 'MISSED'}")
    print(f"\nloss, {loss['model']}, N={loss['micro_batches']} x {MBS} x {SEQ} tokens, {loss['steps']} steps, "
          f"lr {loss['lr']} "
          f"after {loss['warmup_steps']} warm-up steps, same initial weights and batches:\n"
          f"  Adam {loss['first']['adam']:.3f} -> {loss['final']['adam']:.3f}, AdamA {loss['first']['adama']:.3f} -> "
          f"{loss['final']['adama']:.3f} (final = mean of the last 10 steps; difference {loss['final_rel_diff']:.2%})\n"
          f"  after the warm-up: max relative difference per step {loss['max_rel_diff']:.2%} "
          f"(mean {loss['mean_rel_diff']:.2%}), "
          f"of 10-step moving averages {loss['max_rel_diff_smoothed']:.2%}")
    print(f"\nbenchmark took {result['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
