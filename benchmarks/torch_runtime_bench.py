"""Our runtime's step time vs PyTorch's ``_PipelineScheduleRuntime`` on the same schedule CSV.

For each schedule (1f1b, gpipe) the plan ``gpt2-small-cpu`` (2 pipeline ranks, m = 8 micro-batches of
2 x 64 tokens, Adam lr 1e-3) is exported with ``engine.io.write_torch_csv`` (compute_only format).
Two plain spawned processes (one per pipeline rank, ``torch.set_num_threads(1)`` each, gloo over
localhost, no Ray) then hold BOTH runtimes side by side:

- ours: ``runtime.worker.StageWorker`` (its own stage copy from ``build_stages``, its own Adam);
- PyTorch: another ``build_stages`` copy of the same split (same seed, so the same initial weights)
  wrapped in ``torch.distributed.pipelining.PipelineStage(stage_module, stage_index, 2, cpu)``,
  driven by ``_PipelineScheduleRuntime([stage], n_microbatches=m, loss_fn=cross_entropy)`` that
  ``_load_csv``-ed our CSV (format ``compute_only``; PyTorch lowers it with its own send/recv
  passes), then the same Adam step. Like ours, the tied ``wte``/``lm_head`` copies get their
  gradients summed across the two ranks before the optimizer step, so both do the same work.

Both use the same global batch per step (``ByteCorpus(seq_len=64).train_batch(step, m*mbs)``).
Steps alternate (ours then PyTorch on even steps, PyTorch then ours on odd ones) so background
noise on the shared cores hits both alike.
A step's time is the slower rank's wall time (barrier before, max over ranks after). 2 warm-up
steps, then ``--steps`` (8) timed; the table gives the medians and ours/PyTorch (target <= 1.0).
The first step's loss of both runtimes is printed as a sanity check (same weights, same batch).

If PyTorch's runtime fails on this split (e.g. the stage returns the bool attention mask as an extra
boundary tensor), the exact error is printed instead of its number.

Usage: ``python benchmarks/torch_runtime_bench.py [--json] [--steps 8] [--warmup 2]``
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL, MBS, SEQ, M, PP = "gpt2-small-cpu", 2, 64, 8, 2
TIMEOUT = 900.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_side(plan, rank: int, world: int, lr: float):
    """PipelineStage + _PipelineScheduleRuntime + Adam for this rank (PyTorch's runtime)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from runtime.stages import build_stages

    st = build_stages(plan, seed=0)
    pl = plan.schedule.placement
    segs = [s for s in range(pl.num_segments) if pl.spec("F", s).devices[0] == rank]
    if len(segs) != 1:
        raise RuntimeError(f"rank {rank} holds segments {segs}; this benchmark expects one per rank")
    s = segs[0]
    mod = st.modules[s]
    stage = PipelineStage(mod, s, pl.num_segments, device=torch.device("cpu"))

    def loss_fn(out, target):
        logits = out[0] if isinstance(out, (tuple, list)) else out
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))

    sched = _PipelineScheduleRuntime([stage], n_microbatches=plan.schedule.num_micro_batches, loss_fn=loss_fn)
    opt = torch.optim.Adam(list(mod.parameters()), lr=lr)
    named = dict(mod.named_parameters())
    tied = [named[n] for g in st.tied for (seg, n) in g if seg == s]
    return sched, opt, tied, s == 0, s == pl.num_segments - 1


def _rank_main(rank: int, world: int, port: int, plan_dict: dict, csv_path: str, steps: int, warmup: int,
               lr: float, results) -> None:
    try:
        import warnings
        warnings.filterwarnings("ignore")
        import torch
        torch.set_num_threads(1)
        import torch.distributed as dist

        from engine.io.plan import Plan
        from runtime.data import ByteCorpus
        from runtime.worker import StageWorker, WorkerConfig

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        plan = Plan.from_dict(plan_dict, source="bench")
        m = plan.schedule.num_micro_batches
        ours = StageWorker(plan_dict, rank, world, "127.0.0.1", port, WorkerConfig(lr=lr))   # reuses the process group
        ours.setup()

        torch_err = None
        try:
            sched, opt, tied, first, last = _torch_side(plan, rank, world, lr)
            sched._load_csv(csv_path, format="compute_only")
        except Exception as e:  # noqa: BLE001 - reported, not fatal for our side
            torch_err = f"{type(e).__name__}: {e}"
            sched = None

        corpus = ByteCorpus(seq_len=SEQ)
        t_ours: list[float] = []
        t_torch: list[float] = []
        loss0 = {"ours": None, "torch": None}

        def torch_step(batch):
            inp, tgt = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
            losses: list = []
            args = (inp,) if first else ()
            sched.step(*args, target=tgt if last else None, losses=losses if last else None,
                       return_outputs=False)
            for p in tied:   # same tied-embedding gradient sum as ours does
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(g)
                p.grad = g
            opt.step()
            opt.zero_grad(set_to_none=True)
            return [float(x.detach()) for x in losses]

        def run_ours(i, batch):
            dist.barrier()
            t0 = time.perf_counter()
            out = ours.step(i, batch)
            dt = time.perf_counter() - t0
            if i == 0 and out.get("losses"):
                loss0["ours"] = statistics.fmean(out["losses"])
            if i >= warmup:
                t_ours.append(dt)

        def run_torch(i, batch):
            nonlocal torch_err
            if sched is None or torch_err is not None:
                return
            dist.barrier()
            try:
                t0 = time.perf_counter()
                ls = torch_step(batch)
                dt = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001
                torch_err = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
                results.put((rank, "torch_error", torch_err))
                raise
            if i == 0 and ls:
                loss0["torch"] = statistics.fmean(ls)
            if i >= warmup:
                t_torch.append(dt)

        for i in range(warmup + steps):
            batch = corpus.train_batch(i, m * MBS)
            order = (run_ours, run_torch) if i % 2 == 0 else (run_torch, run_ours)   # alternate who goes first
            for f in order:
                f(i, batch)
        # slower rank per step
        to = torch.tensor(t_ours, dtype=torch.float64)
        dist.all_reduce(to, op=dist.ReduceOp.MAX)
        tt = torch.tensor(t_torch or [0.0] * steps, dtype=torch.float64)
        if t_torch:
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        results.put((rank, "ok", {"ours": to.tolist(), "torch": tt.tolist() if t_torch else None,
                                  "torch_error": torch_err, "loss0": loss0}))
        ours.shutdown()
    except BaseException as e:  # noqa: BLE001
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        results.close()
        results.join_thread()
        os._exit(1)


def bench_schedule(schedule: str, steps: int, warmup: int, lr: float, tmpdir: Path) -> dict:
    import torch

    from engine.io import write_torch_csv
    from engine.plan.make import make_plan

    plan = make_plan(MODEL, devices=PP, micro_batches=M, schedule=schedule, device_type="cpu",
                     micro_batch_size=MBS, seq_len=SEQ).plan
    csv_path = tmpdir / f"{schedule}.csv"
    write_torch_csv(plan.schedule, csv_path)
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, PP, port, plan.to_dict(), str(csv_path), steps, warmup, lr,
                                                   results), daemon=True) for r in range(PP)]
    for p in procs:
        p.start()
    got: dict[int, tuple] = {}
    torch_error = None
    deadline = time.monotonic() + TIMEOUT
    try:
        while len(got) < PP:
            try:
                rank, status, payload = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{schedule}: no result within {TIMEOUT}s") from None
                if all(not p.is_alive() for p in procs) and results.empty():
                    raise RuntimeError(f"{schedule}: rank processes exited without a result") from None
                continue
            if status == "torch_error":
                torch_error = torch_error or payload
                continue
            got[rank] = (status, payload)
            if status == "error":
                break
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    errors = {r: p for r, (s, p) in got.items() if s != "ok"}
    row = {"schedule": schedule, "csv": csv_path.read_text().strip().splitlines(), "steps": steps,
           "warmup": warmup}
    if errors:
        row["error"] = torch_error or "\n".join(f"rank {r}: {p}" for r, p in errors.items())
        row["ours_s"] = row["torch_s"] = row["ratio"] = None
        return row
    res = got[0][1]
    ours = statistics.median(res["ours"])
    row["ours_s"] = ours
    row["ours_steps_s"] = res["ours"]
    for side in ("ours", "torch"):
        row[f"loss0_{side}"] = next((got[r][1]["loss0"][side] for r in got
                                     if got[r][1]["loss0"][side] is not None), None)
    terr = next((got[r][1]["torch_error"] for r in got if got[r][1]["torch_error"]), None)
    if res["torch"] is None or terr:
        row["torch_s"] = row["ratio"] = None
        row["error"] = terr or "PyTorch runtime produced no timings"
    else:
        row["torch_s"] = statistics.median(res["torch"])
        row["torch_steps_s"] = res["torch"]
        row["ratio"] = ours / row["torch_s"]
        row["meets_target"] = row["ratio"] <= 1.0
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per runtime (default 8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps (default 2)")
    ap.add_argument("--schedules", default="1f1b,gpipe")
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args(argv)
    import tempfile
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    with tempfile.TemporaryDirectory() as d:
        rows = [bench_schedule(s.strip(), args.steps, args.warmup, args.lr, Path(d))
                for s in args.schedules.split(",") if s.strip()]
    out = {"benchmark": "ours vs torch _PipelineScheduleRuntime", "model": MODEL, "pp": PP, "micro_batches": M,
           "micro_batch_size": MBS, "seq_len": SEQ, "torch": torch.__version__, "threads_per_rank": 1,
           "backend": "gloo", "cpu_count": os.cpu_count(), "rows": rows}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{MODEL}, pp={PP}, m={M}, micro-batch {MBS}x{SEQ}, gloo, 1 thread/rank, torch {torch.__version__}, "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'schedule':<9} {'ours (ms)':>10} {'pytorch (ms)':>13} {'ours/pytorch':>13}  {'target<=1':>9}  "
          "loss0 ours/torch")
    for r in rows:
        ours = f"{r['ours_s'] * 1e3:10.1f}" if r.get("ours_s") is not None else f"{'-':>10}"
        if r.get("torch_s") is not None:
            tv, ra = f"{r['torch_s'] * 1e3:13.1f}", f"{r['ratio']:13.3f}"
            ok = "yes" if r["meets_target"] else "no"
        else:
            tv, ra, ok = f"{'ERROR':>13}", f"{'-':>13}", "-"
        l0 = (f"{r['loss0_ours']:.4f}/{r['loss0_torch']:.4f}" if r.get("loss0_ours") is not None
              and r.get("loss0_torch") is not None else "-")
        print(f"{r['schedule']:<9} {ours} {tv} {ra}  {ok:>9}  {l0}")
    for r in rows:
        if r.get("error"):
            print(f"\n{r['schedule']}: PyTorch runtime error:\n{r['error']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
