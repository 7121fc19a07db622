"""Runtime benchmark: predicted vs measured step time, and pre-allocated transfers vs Ray's object store.

(b) Plan ``gpt2-small-cpu`` and predict its step four ways: "op costs": aten ops profiled one
    at a time on this machine (one intra-op thread, as each rank runs), backward = 2x forward;
    "segments": each segment's real forward + backward timed alone (``runtime.profile``);
    "calibrated": block, optimizer and p2p costs from a separate short profiling launch
    (``engine.cost.calibrate``, ``engine.planner.with_calibration``), which carries what only the
    running system shows (ranks sharing cores, Python/autograd overheads, the real optimizer
    speed); "same launch": calibrated from the first steps of the measured launch itself (as an
    autotuner profiles its first iterations), which also removes launch-to-launch variation (how
    the OS places the rank processes on cores). Measured: the median makespan of the measured
    launch's later steps; the driver's wall clock per step, which adds Ray dispatch, is shown
    too. Two configurations: 2 pipeline ranks (no more ranks than cores) and 4 (the demo: twice
    as many ranks as cores). Target: within 15%.
(c) A 4 MiB tensor through a pre-allocated gloo buffer vs Ray's object store (``transfer_bench.py``).
    Target: >= 3x faster.
(a) Our step time vs PyTorch's ``_PipelineScheduleRuntime`` on the same CSV: ``torch_runtime_bench.py``.

Usage: ``python benchmarks/runtime_bench.py [--json] [--steps 12] [--profile-steps 6]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def predicted_vs_measured(devices: int, steps: int, profile_steps: int = 4) -> dict:
    from engine.cost.calibrate import calibrate
    from engine.planner import make_plan, with_calibration, with_segment_times
    from runtime import launch
    from runtime.config import LaunchConfig
    from runtime.profile import measure_segment_times

    # op costs profiled with one intra-op thread (as every rank runs) ...
    res = make_plan("gpt2-small-cpu", devices=devices, micro_batches=8, schedule="1f1b", device_type="cpu",
                    micro_batch_size=2, seq_len=64, profile=True)
    # ... each segment's real forward + backward timed alone on this machine ...
    seg_plan, seg_tl = with_segment_times(res.plan, measure_segment_times(res.plan))
    # ... and calibrated from a separate short profiling launch (its first step left out)
    prof = launch(res.plan, LaunchConfig(steps=profile_steps, device="cpu", eval_every=0,
                                       keep_timelines=profile_steps))
    cal_plan, cal_tl = with_calibration(res.plan, calibrate(prof.timelines[1:]))
    # the measured run: a fresh launch of profile_steps + steps steps; its first profile_steps
    # (warm-up left out) calibrate the "same launch" prediction of the steps after them
    total = profile_steps + steps
    lr = launch(res.plan, LaunchConfig(steps=total, device="cpu", eval_every=0, keep_timelines=total))
    _, online_tl = with_calibration(res.plan, calibrate(lr.timelines[1:profile_steps]))
    measured_steps = [t.makespan for t in lr.timelines[profile_steps:]]
    measured = statistics.median(measured_steps)
    wall = statistics.median(lr.step_times[profile_steps:])
    out = {"devices": devices, "predicted_ops_s": res.timeline.makespan, "predicted_segments_s": seg_tl.makespan,
           "predicted_calibrated_s": cal_tl.makespan, "predicted_online_s": online_tl.makespan, "measured_s": measured,
           "measured_min_s": min(measured_steps), "measured_max_s": max(measured_steps),
           "driver_step_s": wall, "loss_start": lr.losses[0], "loss_end": lr.losses[-1],
           "tokens_per_second": lr.tokens_per_second, "profile_steps": profile_steps,
           "measured_steps": len(measured_steps)}
    for k in ("ops", "segments", "calibrated", "online"):
        out[f"error_{k}"] = measured / out[f"predicted_{k}_s"] - 1
    out["within_15pct"] = abs(out["error_online"]) <= 0.15
    out["within_15pct_separate_launch"] = abs(out["error_calibrated"]) <= 0.15
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=12, help="measured steps (default 12), after the profiling steps")
    ap.add_argument("--profile-steps", type=int, default=6,
                    help="profiling steps the calibration is taken from (default 6; the first, warm-up, is left out)")
    args = ap.parse_args(argv)
    import contextlib
    import io

    import transfer_bench

    rows = [predicted_vs_measured(d, args.steps, args.profile_steps) for d in (2, 4)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        transfer_bench.main(["--json"])
    transfer = json.loads(buf.getvalue().strip().splitlines()[-1])
    result = {"predicted_vs_measured": rows, "transfer": transfer, "pytorch_runtime_comparison": None}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'ranks':>5} {'op costs':>9} {'segments':>9} {'calibrated':>11} {'same launch':>12} "
          f"{'measured median (min-max)':>27} {'error':>7} {'error sep.':>10} {'tokens/s':>9} {'loss':>15}")
    for r in rows:
        def ms(k: str, r: dict = r) -> str:  # this row, bound as a default
            return f"{r[k] * 1e3:.0f} ms"
        rng = f"{ms('measured_s')} ({r['measured_min_s'] * 1e3:.0f}-{r['measured_max_s'] * 1e3:.0f})"
        print(f"{r['devices']:>5} {ms('predicted_ops_s'):>9} {ms('predicted_segments_s'):>9} "
              f"{ms('predicted_calibrated_s'):>11} {ms('predicted_online_s'):>12} "
              f"{rng:>27} "
              f"{r['error_online']:>+7.1%} {r['error_calibrated']:>+10.1%} {r['tokens_per_second']:>9,.0f} "
              f"{r['loss_start']:>7.3f}->{r['loss_end']:.3f}")
    print("predicted step makespan: op costs / segments timed alone / calibrated from a separate profiling launch /"
          " calibrated from the first steps of the measured launch ('same launch'); measured: median of the later"
          " steps. error = measured / same-launch prediction - 1 (target within 15%); error sep. = against the"
          " separate launch")
    print(f"\n4 MiB transfer: pre-allocated {transfer['preallocated_p2p_s'] * 1e3:.2f} ms vs object store "
          f"{transfer['object_store_s'] * 1e3:.2f} ms = {transfer['speedup']:.1f}x (target >= 3x)")
    print("vs PyTorch _PipelineScheduleRuntime on the same CSV: see benchmarks/torch_runtime_bench.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
