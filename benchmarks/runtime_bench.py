"""Runtime benchmark: predicted vs measured step time, and pre-allocated transfers vs Ray's object store.

(b) Plan ``gpt2-small-cpu`` and predict its step four ways: "op costs": aten ops profiled one
    at a time on this machine (one intra-op thread, as each rank runs), backward = 2x forward;
    "segments": each segment's real forward + backward timed alone (``runtime.profile``);
    "calibrated": block, optimizer and p2p costs from a separate short profiling launch
    (``engine.cost.calibrate``, ``engine.plan.calibrate.with_calibration``), which carries what only the
    running system shows (ranks sharing cores, Python/autograd overheads, the real optimizer
    speed); "same launch": calibrated from the first steps of the measured launch itself (as an
    autotuner profiles its first iterations), which also removes launch-to-launch variation (how
    the OS places the rank processes on cores). Measured: the median makespan of the measured
    launch's later steps; the driver's wall clock per step, which adds Ray dispatch, is shown
    too. Configurations (``--configs``): ``pp2`` / ``pp4``, a 1F1B pipeline of 2 / 4 ranks (4:
    the demo, twice as many ranks as cores), and ``dp2``, two data-parallel replicas whose step
    ends in an all-reduce of every gradient (~19 MB). Target: within 15%.

    Links (``--links``, default ``unshaped,1gbit,10gbit``): ``unshaped`` is this machine's
    loopback, where gloo's transfers are memory copies; on an emulated link ``RATE`` the plan is
    made with ``link="emulated:RATE"`` (the cost model prices every p2p and all-reduce on one
    medium of that rate shared by all ranks: a 2-rank all-reduce of n bytes moves 2n bytes through
    it) and both launches run inside a namespace whose loopback is shaped to RATE
    (``emulated_network``: one Ray node there, the ranks' gloo traffic crosses the shaped link).
    The calibrations are taken on the same link, so they carry what the link costs beyond the
    cost model (gloo's software path, the ranks waiting for each other). There, ``pp2`` shows the
    pipeline's small activations (128 KiB per micro-batch) and ``dp2`` a step whose all-reduce is a
    large part of it (~0.3 s at 1 Gbit/s). Where namespaces cannot be made, the emulated links are
    skipped with the harness's sentence.
(c) A 4 MiB tensor through a pre-allocated gloo buffer vs Ray's object store, per link
    (``transfer_bench.py``: on an emulated link, between two Ray nodes). Target: >= 3x faster.
(a) Our step time vs PyTorch's ``_PipelineScheduleRuntime`` on the same CSV: ``torch_runtime_bench.py``.

Usage: ``python benchmarks/runtime_bench.py [--json] [--steps 12] [--profile-steps 6]
[--links unshaped,1gbit,10gbit] [--configs pp2,dp2] [--no-transfer]``
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


#: The configurations: name -> (devices, data-parallel degree). ``pp2`` / ``pp4``: a plain 1F1B
#: pipeline of 2 / 4 ranks (small activations: communication is a few percent of the step);
#: ``dp2``: two data-parallel replicas of the whole model, whose step ends in an all-reduce of every
#: gradient (~19 MB for the ~4.8M parameters: ~0.3 s on a shared 1 Gbit/s medium).
CONFIGS = {"pp2": (2, 1), "pp4": (4, 1), "dp2": (2, 2)}
LINKS = ("unshaped", "1gbit", "10gbit")


def _launches(plan: dict, profile_steps: int, total: int, *, own_ray: bool = False) -> tuple[list, object]:
    """The profiling launch (its measured timelines) and the measured launch (its LaunchResult) of
    ``plan``; with ``own_ray``, both on one Ray node started here on 127.0.0.1 (run it inside an
    emulated link's namespace with :func:`emulated_network.run_function`)."""
    from runtime import launch
    from runtime.config import LaunchConfig

    if own_ray:
        import ray

        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING")
    try:
        prof = launch(plan, LaunchConfig(steps=profile_steps, device="cpu", eval_every=0,
                                         keep_timelines=profile_steps))
        lr = launch(plan, LaunchConfig(steps=total, device="cpu", eval_every=0, keep_timelines=total))
    finally:
        if own_ray:
            ray.shutdown()
    return prof.timelines, lr


def predicted_vs_measured(devices: int, steps: int, profile_steps: int = 4, *, dp: int = 1,
                          link: str = "unshaped", config: str | None = None) -> dict:
    """Predicted (four ways) and measured step time of ``gpt2-small-cpu`` on ``devices`` ranks
    with data-parallel degree ``dp``, on ``link``: ``unshaped`` (this machine's loopback) or a tc
    rate (planned with ``link="emulated:RATE"`` and launched inside a namespace shaped to it)."""
    from engine.cost.calibrate import calibrate
    from engine.plan import make_plan, with_calibration, with_segment_times
    from runtime.profile import measure_segment_times

    emulated = link != "unshaped"
    # op costs profiled with one intra-op thread (as every rank runs); on an emulated link the
    # cost model's link is the shaped loopback (a shared medium), so p2p and all-reduces are priced on it ...
    res = make_plan("gpt2-small-cpu", devices=devices, dp=dp, micro_batches=8, schedule="1f1b", device_type="cpu",
                    micro_batch_size=2, seq_len=64, profile=True, link=f"emulated:{link}" if emulated else None)
    # ... each segment's real forward + backward timed alone on this machine ...
    seg_plan, seg_tl = with_segment_times(res.plan, measure_segment_times(res.plan))
    # ... and calibrated from a separate short profiling launch (its first step left out).
    # The measured run: a fresh launch of profile_steps + steps steps; its first profile_steps
    # (warm-up left out) calibrate the "same launch" prediction of the steps after them
    total = profile_steps + steps
    if emulated:
        import emulated_network as en

        with en.emulated_link(link) as shaped:
            prof_tls, lr = en.run_function(_launches, res.plan.to_dict(), profile_steps, total, own_ray=True,
                                           link=shaped, timeout=1800)
    else:
        prof_tls, lr = _launches(res.plan, profile_steps, total)
    cal_plan, cal_tl = with_calibration(res.plan, calibrate(prof_tls[1:]))
    _, online_tl = with_calibration(res.plan, calibrate(lr.timelines[1:profile_steps]))
    measured_steps = [t.makespan for t in lr.timelines[profile_steps:]]
    measured = statistics.median(measured_steps)
    wall = statistics.median(lr.step_times[profile_steps:])
    out = {"config": config or f"{'dp' if dp > 1 else 'pp'}{devices}", "link": link, "devices": devices, "dp": dp,
           "pp": devices // dp,
           "predicted_ops_s": res.timeline.makespan, "predicted_segments_s": seg_tl.makespan,
           "predicted_calibrated_s": cal_tl.makespan, "predicted_online_s": online_tl.makespan, "measured_s": measured,
           "measured_min_s": min(measured_steps), "measured_max_s": max(measured_steps),
           "driver_step_s": wall, "loss_start": lr.losses[0], "loss_end": lr.losses[-1],
           "tokens_per_second": lr.tokens_per_second, "profile_steps": profile_steps,
           "measured_steps": len(measured_steps), "predicted_allreduce_s": _collective_seconds(res.timeline),
           "measured_allreduce_s": statistics.median(_collective_seconds(t) for t in lr.timelines[profile_steps:])}
    for k in ("ops", "segments", "calibrated", "online"):
        out[f"error_{k}"] = measured / out[f"predicted_{k}_s"] - 1
    out["within_15pct"] = abs(out["error_online"]) <= 0.15
    out["within_15pct_separate_launch"] = abs(out["error_calibrated"]) <= 0.15
    return out


def _collective_seconds(tl) -> float:
    """Seconds of rank 0's all-reduces in one step's timeline (measured: waiting for the peer included)."""
    return sum(e.end - e.start for e in tl.events if e.rank == 0 and e.op == "ALLREDUCE")


def _parse_links(ap: argparse.ArgumentParser, text: str) -> list[str]:
    import emulated_network as en

    try:
        return en.parse_links(text)
    except ValueError as e:
        ap.error(str(e))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=12, help="measured steps (default 12), after the profiling steps")
    ap.add_argument("--profile-steps", type=int, default=6,
                    help="profiling steps the calibration is taken from (default 6; the first, warm-up, is left out)")
    ap.add_argument("--links", default=",".join(LINKS),
                    help="comma-separated: 'unshaped' and/or tc rates of emulated links (default %(default)s; "
                         "emulated links are skipped, with the reason, where namespaces cannot be made)")
    ap.add_argument("--configs", default=None,
                    help=f"comma-separated configurations of {', '.join(CONFIGS)} (default: pp2,pp4,dp2 on the "
                         "unshaped loopback, pp2,dp2 on emulated links)")
    ap.add_argument("--no-transfer", action="store_true", help="leave out the transfer benchmark (c)")
    args = ap.parse_args(argv)
    import emulated_network as en
    import transfer_bench

    links = _parse_links(ap, args.links)
    chosen = None if args.configs is None else [x.strip() for x in args.configs.split(",") if x.strip()]
    for c in chosen or ():
        if c not in CONFIGS:
            ap.error(f"--configs {c!r}: not one of {', '.join(CONFIGS)}")
    why = en.unavailable_reason() if any(x != "unshaped" for x in links) else None
    rows = []
    for link in links:
        if link != "unshaped" and why is not None:
            continue
        for c in chosen or (["pp2", "pp4", "dp2"] if link == "unshaped" else ["pp2", "dp2"]):
            devices, dp = CONFIGS[c]
            try:
                rows.append(predicted_vs_measured(devices, args.steps, args.profile_steps, dp=dp, link=link,
                                                  config=c))
            except en.NetworkEmulationUnavailable as e:   # e.g. a kernel without sch_tbf
                why = str(e)
                break
    run_links = [x for x in links if x == "unshaped" or why is None]
    transfer = None if args.no_transfer else transfer_bench.measure_links(run_links, 4.0, 50)
    result = {"predicted_vs_measured": rows, "transfer": transfer, "pytorch_runtime_comparison": None,
              "emulation_unavailable": why}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'link':>9} {'config':>6} {'op costs':>9} {'segments':>9} {'calibrated':>11} {'same launch':>12} "
          f"{'measured median (min-max)':>27} {'error':>7} {'error sep.':>10} {'all-reduce':>13} {'tokens/s':>9} "
          f"{'loss':>15}")
    for r in rows:
        def ms(k: str, r: dict = r) -> str:  # this row, bound as a default
            return f"{r[k] * 1e3:.0f} ms"
        rng = f"{ms('measured_s')} ({r['measured_min_s'] * 1e3:.0f}-{r['measured_max_s'] * 1e3:.0f})"
        ar = "-" if not r["dp"] > 1 else (f"{r['predicted_allreduce_s'] * 1e3:.0f}/"
                                          f"{r['measured_allreduce_s'] * 1e3:.0f} ms")
        print(f"{r['link']:>9} {r['config']:>6} {ms('predicted_ops_s'):>9} {ms('predicted_segments_s'):>9} "
              f"{ms('predicted_calibrated_s'):>11} {ms('predicted_online_s'):>12} "
              f"{rng:>27} "
              f"{r['error_online']:>+7.1%} {r['error_calibrated']:>+10.1%} {ar:>13} {r['tokens_per_second']:>9,.0f} "
              f"{r['loss_start']:>7.3f}->{r['loss_end']:.3f}")
    print("predicted step makespan: op costs / segments timed alone / calibrated from a separate profiling launch /"
          " calibrated from the first steps of the measured launch ('same launch'); measured: median of the later"
          " steps. error = measured / same-launch prediction - 1 (target within 15%); error sep. = against the"
          " separate launch. pp2/pp4: 1F1B pipeline of 2/4 ranks; dp2: 2 data-parallel replicas. Emulated links"
          " (RATE): planned with link='emulated:RATE' and launched in a namespace whose loopback is shaped to RATE"
          " (one medium shared by all ranks); all-reduce: rank 0's gradient all-reduce per step, predicted by the"
          " uncalibrated cost model / measured (median; waiting for the peer included)")
    if why:
        print(f"emulated links skipped: {why}")
    if transfer is not None:
        print()
        for t in transfer["links"]:
            wire = "" if t["wire_s"] is None else f"; bytes/rate {t['wire_s'] * 1e3:.2f} ms"
            print(f"4 MiB transfer, {t['link']} ({t['ray_nodes']} Ray node{'s' if t['ray_nodes'] > 1 else ''}): "
                  f"pre-allocated {t['preallocated_p2p_s'] * 1e3:.2f} ms vs object store "
                  f"{t['object_store_s'] * 1e3:.2f} ms = {t['speedup']:.1f}x (target >= 3x){wire}")
    print("vs PyTorch _PipelineScheduleRuntime on the same CSV: see benchmarks/torch_runtime_bench.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
