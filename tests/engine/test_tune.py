"""``engine.tune``: the tuner's best equals exhaustive enumeration with ``make_plan`` (fully sharded
and hybrid data parallelism included), its bounds never exceed what it simulates, the space's
rules, the time limit and the nothing-fits sentence."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from engine.errors import CostModelError, TesselError, TuneError
from engine.plan import make_plan
from engine.tune import Candidate, TuneRow, TuneSpace, candidates, pareto_front, tune
from engine.tune.report import TABLE_HEADERS, nothing_fits_advice, table_row, why_runner_up_loses

MODEL = "llama-tiny"
SEQ = 32
SPACE = TuneSpace(gpus=4, global_batch=8, gpus_per_node=4, micro_batch_sizes=(1, 2), schedules=("1f1b", "zb-h1"),
                  recompute=("none", "full"), sequence_parallel=False, overlap_grad_sync=False)


def _reference(c: Candidate, limit: float | None, devices_per_node: int = 4):
    """``c`` planned on its own by make_plan (``devices_per_node``: the space's GPUs per node, which
    the tuner's cost model takes): (makespan, peak) or None when refused or over the limit."""
    try:
        r = make_plan(MODEL, devices=c.gpus, dp=c.dp, tp=c.tp, dp_shard=c.dp_shard, micro_batches=c.micro_batches,
                      micro_batch_size=c.micro_batch_size, schedule=c.schedule, virtual_stages=c.virtual_stages,
                      recompute=c.recompute, transforms=c.transforms, optimizer=c.optimizer, seq_len=SEQ,
                      device_type="h100", memory_limit=limit, devices_per_node=devices_per_node)
    except TesselError:
        return None
    peak = max(r.plan.metrics["peak_memory"])
    if limit is not None and peak > limit:
        return None
    return r.plan.metrics["makespan"], peak


@pytest.fixture(scope="module")
def unlimited():
    return tune(MODEL, SPACE, device_type="h100", seq_len=SEQ)


#: A smaller space for the memory-limited comparison (its reference plans every candidate again).
SMALL = TuneSpace(gpus=4, global_batch=4, gpus_per_node=4, micro_batch_sizes=(1,), schedules=("1f1b", "zb-h1"),
                  recompute=("none", "full"), sequence_parallel=False, overlap_grad_sync=False)


@pytest.fixture(scope="module")
def limited():
    free = tune(MODEL, SMALL, device_type="h100", seq_len=SEQ)
    peaks = sorted(r.peak_memory for r in free.fitting())
    limit = peaks[len(peaks) // 2]   # about half the simulated candidates fit
    return limit, tune(MODEL, SMALL, device_type="h100", seq_len=SEQ, memory_limit=limit)


#: Two GPUs per node: on 4 GPUs, dp 4 is tried replicated, fully sharded (fsdp4) and hybrid (hsdp2x2).
HYBRID = TuneSpace(gpus=4, global_batch=4, gpus_per_node=2, micro_batch_sizes=(1,), schedules=("1f1b", "zb-h1"),
                   recompute=("none",), sequence_parallel=False, overlap_grad_sync=False, sharded_update=False)


@pytest.fixture(scope="module")
def hybrid():
    return tune(MODEL, HYBRID, device_type="h100", seq_len=SEQ)


@pytest.mark.parametrize("which", ["unlimited", "limited", "hybrid"])
def test_the_tuners_best_equals_exhaustive_enumeration(which, unlimited, limited, hybrid):
    limit, result = {"unlimited": (None, unlimited), "limited": limited, "hybrid": (None, hybrid)}[which]
    assert {c.sharding()[:4] for c in candidates(result.space)} >= ({"", "fsdp", "hsdp"} if which == "hybrid"
                                                                   else {"", "fsdp"})
    ref = {}
    for c in candidates(result.space):
        got = _reference(c, limit, result.space.gpus_per_node)
        if got is not None:
            ref[c] = got
    assert ref, "the reference found nothing that fits"
    best = min(ref, key=lambda c: (ref[c][0], ref[c][1], c.label()))
    row = result.rows[0]
    assert row.fits and row.candidate == best
    assert row.step_time == pytest.approx(ref[best][0], rel=1e-12)
    assert row.peak_memory == pytest.approx(ref[best][1], rel=1e-12)
    assert result.best is not None and result.best.plan.metrics["makespan"] == pytest.approx(ref[best][0], rel=1e-12)
    # every simulated candidate predicts what make_plan predicts for it; none the reference has is lost
    fitting = {r.candidate: r for r in result.fitting()}
    for c, r in fitting.items():
        assert c in ref and r.step_time == pytest.approx(ref[c][0], rel=1e-12)
    skipped = {r.candidate for r in result.rows if r.status == "dominated"}
    assert set(ref) <= set(fitting) | skipped
    if which == "limited":
        assert result.counts()["memory bound"] + result.counts()["over memory"] > 0
    # the fully sharded candidates were planned, not all pruned: some are simulated (under the limit
    # make_plan refuses them all: its schedule's memory check counts replicated weights and states)
    if which != "limited":
        assert any(r.candidate.dp_shard > 1 and r.step_time is not None for r in result.rows)


def test_bounds_never_exceed_the_simulation():
    """On every predefined schedule (split backward, virtual stages, the V shape), both
    recomputations and replicated, fully sharded and hybrid data parallelism, no bound is above
    what the simulator then predicts (no pruning: no limit, and a space too small for dominance to
    skip much)."""
    space = TuneSpace(gpus=4, global_batch=8, gpus_per_node=2, micro_batch_sizes=(1,), recompute=("none", "full"),
                      sequence_parallel=False, overlap_grad_sync=False, sharded_update=False)
    res = tune(MODEL, space, device_type="h100", seq_len=SEQ)
    sim = [r for r in res.rows if r.step_time is not None]
    assert len(sim) >= 10 and {r.candidate.schedule for r in sim} >= {"1f1b", "zb-h1", "interleaved", "dualpipev"}
    assert {r.candidate.sharding()[:4] for r in sim} == {"", "fsdp", "hsdp"}
    assert {r.candidate.schedule for r in sim if r.candidate.dp_shard > 1 and r.candidate.pp > 1} >= {"1f1b", "zb-h1"}
    for r in sim:
        assert r.time_bound is not None and r.time_bound <= r.step_time * (1 + 1e-9), r.candidate.label()
        assert r.memory_bound is not None and r.memory_bound <= r.peak_memory * (1 + 1e-9), r.candidate.label()


def test_the_pareto_front_is_every_undominated_fitting_row(unlimited):
    fit = [(i, r) for i, r in enumerate(unlimited.rows) if r.fits]
    front = set(unlimited.pareto)
    for i, r in fit:
        beaten = any(o.step_time <= r.step_time and o.peak_memory <= r.peak_memory
                     and (o.step_time, o.peak_memory) != (r.step_time, r.peak_memory) for _, o in fit)
        if beaten:
            assert i not in front
    assert unlimited.pareto[0] == 0 and unlimited.pareto == pareto_front(unlimited.rows)
    steps = [unlimited.rows[i].step_time for i in unlimited.pareto]
    mems = [unlimited.rows[i].peak_memory for i in unlimited.pareto]
    assert steps == sorted(steps) and mems == sorted(mems, reverse=True)


def test_the_runner_up_line_names_how_much_slower_and_why(unlimited):
    line = why_runner_up_loses(unlimited)
    a, b = unlimited.fitting()[:2]
    assert b.candidate.label() in line and "differs in" in line
    if b.step_time > a.step_time:
        assert f"{b.step_time / a.step_time - 1:.1%} slower" in line


def test_the_space_follows_the_degrees_rules():
    space = TuneSpace(gpus=16, global_batch=32, gpus_per_node=4, heads=6, layers=4)
    cs = candidates(space)
    assert cs and all(c.tp * c.pp * c.dp == 16 for c in cs)
    assert {c.tp for c in cs} == {1, 2}          # divides 4 GPUs per node and 6 heads
    assert all(c.pp * c.virtual_stages <= 4 for c in cs)
    assert all(c.micro_batch_size * c.micro_batches * c.dp == 32 for c in cs)
    assert all(c.schedule == "1f1b" for c in cs if c.pp == 1)
    assert not any("tp-split" in c.transforms for c in cs if c.tp == 1)
    assert not any("sharded-update" in c.transforms and "overlap-grad-sync" in c.transforms for c in cs)
    with pytest.raises(TuneError, match="global batch"):
        candidates(TuneSpace(gpus=3, global_batch=4, gpus_per_node=1, max_pp=1))
    with pytest.raises(TuneError, match="unknown schedule"):
        TuneSpace(gpus=4, global_batch=4, schedules=("1f1c",))


def test_the_space_tries_fsdp_and_hsdp_by_the_rules():
    """dp_shard = dp (FSDP) wherever dp > 1, and gpus_per_node // tp (HSDP: a node's shard group,
    replicated across nodes) where it divides dp and lies strictly between 1 and dp; only with
    Adam and without sharded-update / overlap-grad-sync, tp-split allowed; off with fully_sharded
    False. Each fully sharded candidate comes after its replicated twin."""
    space = TuneSpace(gpus=16, global_batch=32, gpus_per_node=4, heads=4, layers=4, optimizers=("adam", "adama"))
    cs = candidates(space)
    sharded = [c for c in cs if c.dp_shard > 1]
    assert sharded and all(c.dp % c.dp_shard == 0 and c.dp_shard in (c.dp, 4 // c.tp) for c in sharded)
    assert {(c.tp, c.dp, c.dp_shard) for c in sharded if c.dp_shard < c.dp} == {(1, 8, 4), (1, 16, 4), (2, 8, 2),
                                                                                 (2, 4, 2)}
    assert {(c.tp, c.pp, c.dp) for c in sharded if c.dp_shard == c.dp} == {(t, p, d) for t, p, d in space.degrees()
                                                                           if d > 1}
    assert all(c.optimizer == "adam" for c in sharded)
    assert not any({"sharded-update", "overlap-grad-sync"} & set(c.transforms) for c in sharded)
    assert any("tp-split" in c.transforms for c in sharded)
    index = {c: i for i, c in enumerate(cs)}
    for c in sharded:
        twin = Candidate(c.tp, c.pp, c.dp, c.virtual_stages, c.micro_batch_size, c.micro_batches, c.schedule,
                         c.recompute, c.transforms, c.optimizer)
        assert index[twin] < index[c]
    off = candidates(TuneSpace(gpus=16, global_batch=32, gpus_per_node=4, heads=4, layers=4, fully_sharded=False))
    assert not any(c.dp_shard > 1 for c in off) and set(off) == {c for c in cs if c.dp_shard == 1 and
                                                                  c.optimizer == "adam"}
    # the knob in the label, the knobs and the table; old constructions are replicated
    old = Candidate(1, 1, 8, 1, 1, 4, "1f1b", "none")
    assert old.dp_shard == 1 and old.sharding() == "" and old.knobs()["dp_shard"] == 1
    fsdp, hsdp = replace(old, dp_shard=8), replace(old, dp_shard=4)
    assert fsdp.label().startswith("tp1 pp1 dp8 (fsdp8) ") and hsdp.label().startswith("tp1 pp1 dp8 (hsdp2x4) ")
    assert hsdp.dp_replicate == 2 and hsdp.knobs()["dp_shard"] == 4
    assert table_row(1, TuneRow(hsdp, "ok"))[TABLE_HEADERS.index("dp")] == "8 hsdp2x4"


def test_a_space_where_only_fully_sharded_fits_picks_it():
    """A memory limit between the sharded candidates' predicted peaks and the replicated ones':
    the best is fully sharded, as make_plan with its degrees predicts it, and every fitting row is
    sharded; with fully_sharded off nothing fits and the advice names the flag."""
    space = TuneSpace(gpus=4, global_batch=4, gpus_per_node=2, micro_batch_sizes=(1,), schedules=("1f1b",),
                      recompute=("full",), max_tp=1, max_pp=1, sharded_update=False, sequence_parallel=False,
                      overlap_grad_sync=False)
    free = tune(MODEL, space, device_type="h100", seq_len=SEQ)
    assert all(r.fits for r in free.rows), [(r.candidate.label(), r.status, r.reason) for r in free.rows]
    peaks = {r.candidate.dp_shard: r.peak_memory for r in free.rows}
    assert set(peaks) == {1, 2, 4} and max(peaks[2], peaks[4]) < peaks[1]
    limit = (max(peaks[2], peaks[4]) + peaks[1]) / 2
    res = tune(MODEL, space, device_type="h100", seq_len=SEQ, memory_limit=limit)
    assert res.best is not None and res.rows[0].candidate.dp_shard > 1
    assert res.best.plan.parallel.dp_shard == res.rows[0].candidate.dp_shard
    assert {r.candidate.dp_shard for r in res.fitting()} == {2, 4}
    assert next(r for r in res.rows if r.candidate.dp_shard == 1).status in ("over memory", "memory bound")
    c = res.rows[0].candidate
    assert res.rows[0].step_time == pytest.approx(_reference(c, limit, 2)[0], rel=1e-12)
    off = tune(MODEL, replace(space, fully_sharded=False), device_type="h100", seq_len=SEQ, memory_limit=limit)
    assert off.best is None and "drop --no-fully-sharded" in nothing_fits_advice(off)


def test_a_time_limit_stops_the_search_and_says_so():
    res = tune(MODEL, SPACE, device_type="h100", seq_len=SEQ, time_limit=1e-9)
    assert res.timed_out and res.best is None
    assert all(r.status == "not visited" for r in res.rows)
    assert "larger --time-limit" in nothing_fits_advice(res)


def test_nothing_fits_names_the_smallest_change():
    space = TuneSpace(gpus=2, global_batch=4, gpus_per_node=2, micro_batch_sizes=(2,), schedules=("1f1b",),
                      recompute=("none",), sequence_parallel=False, overlap_grad_sync=False)
    res = tune(MODEL, space, device_type="h100", seq_len=SEQ, memory_limit=2**20)
    assert res.best is None and not res.fitting()
    advice = nothing_fits_advice(res)
    assert advice.startswith("nothing fits in 0.0 GiB per device") and "full recomputation" in advice
    assert "\n" not in advice and math.isfinite(res.memory_limit)


def test_a_candidate_whose_plan_equals_a_simulated_ones_takes_its_prediction():
    """On GPT-2 (tracer split) selective recomputation keeps what none keeps: the tuner simulates
    one of each pair and gives the other the same prediction, which make_plan confirms."""
    space = TuneSpace(gpus=2, global_batch=4, gpus_per_node=2, micro_batch_sizes=(1,), schedules=("1f1b",),
                      recompute=("none", "selective"), sequence_parallel=False, overlap_grad_sync=False,
                      sharded_update=False)
    res = tune("gpt2-tiny", space, device_type="h100", seq_len=SEQ)
    twins = [r for r in res.rows if r.reason.startswith("predicted as")]
    assert twins
    for r in twins:
        c = r.candidate
        ref = make_plan("gpt2-tiny", devices=c.gpus, dp=c.dp, tp=c.tp, dp_shard=c.dp_shard,
                        micro_batches=c.micro_batches,
                        schedule=c.schedule, recompute=c.recompute, seq_len=SEQ, device_type="h100")
        assert r.step_time == pytest.approx(ref.plan.metrics["makespan"], rel=1e-12)
        assert r.peak_memory == pytest.approx(max(ref.plan.metrics["peak_memory"]), rel=1e-12)
    best = res.rows[0]
    assert res.best is not None and res.best.plan.parallel.recompute == best.candidate.recompute


def test_a_profiled_tune_ranks_with_the_measured_op_times_as_make_plan_does():
    space = TuneSpace(gpus=2, global_batch=4, gpus_per_node=2, micro_batch_sizes=(1, 2), schedules=("1f1b",),
                      recompute=("none",), sequence_parallel=False, overlap_grad_sync=False, sharded_update=False)
    res = tune(MODEL, space, device_type="cpu", seq_len=SEQ, profile=True)
    assert res.best is not None and res.best.plan.cost.get("profile")
    for r in res.fitting():
        c = r.candidate
        ref = make_plan(MODEL, devices=c.gpus, dp=c.dp, tp=c.tp, dp_shard=c.dp_shard, micro_batches=c.micro_batches,
                        micro_batch_size=c.micro_batch_size, schedule=c.schedule, seq_len=SEQ, device_type="cpu",
                        profile=True)
        assert r.step_time == pytest.approx(ref.plan.metrics["makespan"], rel=1e-9)


def test_a_calibrated_tune_predicts_each_candidate_as_its_calibrated_plan():
    """The communication and optimizer costs of a profiling launch apply to every candidate (its
    per-segment block times, which belong to the launched plan, do not): each fitting row's step
    time is make_plan's plan with that calibration (engine.plan.with_calibration)."""
    from engine.cost.calibrate import Calibration
    from engine.plan import with_calibration

    cal = Calibration(block_seconds={(0, "F"): 1.0}, optimizer_seconds_per_byte=2e-9,
                      p2p_seconds={4096: 5e-4}, collectives=[("allreduce", 1 << 20, 2, 4e-3)])
    space = TuneSpace(gpus=2, global_batch=4, gpus_per_node=2, micro_batch_sizes=(1,), schedules=("1f1b",),
                      recompute=("none",), sequence_parallel=False, overlap_grad_sync=False, sharded_update=False)
    plain = tune(MODEL, space, device_type="cpu", seq_len=SEQ)
    res = tune(MODEL, space, device_type="cpu", seq_len=SEQ, calibration=cal)
    assert res.best is not None and "calibration" in res.best.plan.meta
    assert not res.best.plan.meta["calibration"]["blocks"]
    by_label = {r.candidate.label(): r for r in plain.fitting()}
    for r in res.fitting():
        c = r.candidate
        ref = make_plan(MODEL, devices=c.gpus, dp=c.dp, tp=c.tp, dp_shard=c.dp_shard,
                        micro_batches=c.micro_batches, schedule=c.schedule,
                        seq_len=SEQ, device_type="cpu").plan
        calibrated, _ = with_calibration(ref, Calibration(block_seconds={}, optimizer_seconds_per_byte=2e-9,
                                                          p2p_seconds={4096: 5e-4},
                                                          collectives=[("allreduce", 1 << 20, 2, 4e-3)]))
        assert r.step_time == pytest.approx(calibrated.metrics["makespan"], rel=1e-9)
        assert r.step_time > by_label[c.label()].step_time   # the measured overheads are not free


def test_a_calibrations_step_residual_multiplies_each_candidates_step_by_its_backward_kind():
    """The step residual of a profiling launch (measured over predicted step of its plan) scales
    every candidate's predicted step: 1F1B rows by the whole backward's, ZB-H1 rows by the split
    one's; the ranking follows (ZB-H1 behind 1F1B of its layout), and the row says why."""
    from engine.cost.calibrate import Calibration
    from engine.plan import with_calibration

    space = TuneSpace(gpus=2, global_batch=4, gpus_per_node=2, micro_batch_sizes=(1,), schedules=("1f1b", "zb-h1"),
                      recompute=("none",), sequence_parallel=False, overlap_grad_sync=False, sharded_update=False)
    base = Calibration(compute_scale={"F": 1.5, "B": 2.0})
    cal = Calibration(compute_scale={"F": 1.5, "B": 2.0}, step_residual={"whole": 1.25, "split": 3.0})
    res = tune(MODEL, space, device_type="cpu", seq_len=SEQ, calibration=cal)
    assert {r.candidate.schedule for r in res.fitting()} == {"1f1b", "zb-h1"}
    for r in res.fitting():
        c = r.candidate
        ref = make_plan(MODEL, devices=c.gpus, dp=c.dp, tp=c.tp, dp_shard=c.dp_shard,
                        micro_batches=c.micro_batches, schedule=c.schedule,
                        seq_len=SEQ, device_type="cpu").plan
        factor = 3.0 if c.schedule == "zb-h1" else 1.25
        assert r.step_time == pytest.approx(with_calibration(ref, base)[0].metrics["makespan"] * factor, rel=1e-9)
        assert "step residual" in r.reason
    steps = [r.step_time for r in res.fitting()]
    assert steps == sorted(steps)
    by_layout: dict = {}
    for r in res.fitting():
        by_layout.setdefault((r.candidate.dp, r.candidate.dp_shard, r.candidate.pp), {})[r.candidate.schedule] = \
            r.step_time
    both = [k for k in by_layout.values() if len(k) == 2]
    assert both and all(k["zb-h1"] > k["1f1b"] for k in both)
    assert Calibration.from_dict(cal.to_dict()).step_residual == {"whole": 1.25, "split": 3.0}
    assert Calibration(step_residual={"whole": 1.25}).residual_of(True) == 1.25   # the other kind's
    assert Calibration().residual_of(False) == 1.0
    with pytest.raises(CostModelError, match="step_residual"):
        Calibration.from_dict({"step_residual": {"whole": -1.0}})


def test_a_recomputing_candidate_is_predicted_with_its_layouts_recompute_variant():
    """A calibration with a recompute variant (launches of a recomputing plan): the recomputing
    candidates are predicted with the variant's scales and residual, the others with the base's,
    each as ``with_calibration`` predicts the plan with that calibration."""
    from engine.cost.calibrate import Calibration
    from engine.plan import with_calibration

    space = TuneSpace(gpus=2, global_batch=4, gpus_per_node=2, micro_batch_sizes=(1,), schedules=("1f1b",),
                      recompute=("none", "full"), sequence_parallel=False, overlap_grad_sync=False,
                      sharded_update=False)
    # block times of the plans they were measured on (segment 0's), which other plans do not take
    variant = Calibration(compute_scale={"F": 3.0, "B": 0.5}, step_residual={"whole": 0.7}, recompute="full",
                          block_seconds={(0, "F"): 9.0, (0, "B"): 9.0})
    cal = Calibration(compute_scale={"F": 1.5, "B": 2.0}, step_residual={"whole": 1.25}, recompute_variant=variant,
                      block_seconds={(0, "F"): 7.0, (0, "B"): 7.0})
    res = tune(MODEL, space, device_type="cpu", seq_len=SEQ, calibration=cal)
    assert {r.candidate.recompute for r in res.fitting()} == {"none", "full"}
    for r in res.fitting():
        c = r.candidate
        ref = make_plan(MODEL, devices=c.gpus, dp=c.dp, tp=c.tp, dp_shard=c.dp_shard,
                        micro_batches=c.micro_batches, schedule=c.schedule,
                        recompute=c.recompute, seq_len=SEQ, device_type="cpu").plan
        own = variant.transferable() if c.recompute == "full" else Calibration(compute_scale={"F": 1.5, "B": 2.0})
        factor = 0.7 if c.recompute == "full" else 1.25
        assert r.step_time == pytest.approx(with_calibration(ref, own)[0].metrics["makespan"] * factor, rel=1e-9)


def test_plans_that_can_no_longer_be_kept_are_dropped_and_the_kept_ones_are_right(monkeypatch):
    import engine.tune.tuner as tuner

    monkeypatch.setattr(tuner, "PLANS_SLACK", 0)   # prune after every simulated candidate
    res = tune(MODEL, SMALL, device_type="h100", seq_len=SEQ, keep=2)
    kept = set(range(2)) | set(res.pareto)
    assert set(res.plans) == {k for k in kept if res.rows[k].fits}
    for k, plan in res.plans.items():
        assert plan.plan.metrics["makespan"] == pytest.approx(res.rows[k].step_time, rel=1e-12)
        assert plan.plan.parallel.pp == res.rows[k].candidate.pp


def test_a_calibrations_compute_scale_multiplies_every_candidates_blocks():
    """The measured compute scale of a profiling launch (measured over planned block time, per kind)
    applies to every candidate's blocks: each row is make_plan's plan with that calibration."""
    from engine.cost.calibrate import Calibration
    from engine.plan import with_calibration

    cal = Calibration(compute_scale={"F": 1.5, "B": 2.0})
    space = TuneSpace(gpus=2, global_batch=4, gpus_per_node=2, micro_batch_sizes=(1,), schedules=("1f1b", "zb-h1"),
                      recompute=("none", "full"), sequence_parallel=False, overlap_grad_sync=False,
                      sharded_update=False)
    plain = tune(MODEL, space, device_type="cpu", seq_len=SEQ)
    res = tune(MODEL, space, device_type="cpu", seq_len=SEQ, calibration=cal)
    by_label = {r.candidate.label(): r for r in plain.fitting()}
    assert {r.candidate.label() for r in res.fitting()} == set(by_label)
    for r in res.fitting():
        c = r.candidate
        ref = make_plan(MODEL, devices=c.gpus, dp=c.dp, tp=c.tp, dp_shard=c.dp_shard,
                        micro_batches=c.micro_batches, schedule=c.schedule,
                        recompute=c.recompute, seq_len=SEQ, device_type="cpu").plan
        calibrated, _ = with_calibration(ref, cal)
        assert r.step_time == pytest.approx(calibrated.metrics["makespan"], rel=1e-9)
        assert r.step_time > 1.4 * by_label[c.label()].step_time
    assert {r.candidate.recompute for r in res.fitting()} == {"none", "full"}


def test_a_plan_the_caller_does_not_admit_is_never_the_best_and_keeps_its_prediction():
    """``admit`` (tessel tune --launchable passes the runtime's check) refuses plans after they are
    predicted: the best is the exhaustive best among the admitted candidates (pipeline degree 1
    here), and every refused row is a pipelined one with its own prediction and the reason."""
    why = "stages on one device only"
    res = tune(MODEL, SMALL, device_type="h100", seq_len=SEQ, admit=lambda plan: why if plan.parallel.pp > 1 else "")
    ref = {c: got for c in candidates(res.space) if c.pp == 1 and (got := _reference(c, None)) is not None}
    best = min(ref, key=lambda c: (ref[c][0], ref[c][1], c.label()))
    assert res.rows[0].candidate == best and res.best is not None and res.best.plan.parallel.pp == 1
    assert res.best.plan.metrics["makespan"] == pytest.approx(ref[best][0], rel=1e-12)
    refused = [r for r in res.rows if r.status == "refused" and why in r.reason]
    assert refused and all(r.candidate.pp > 1 and r.step_time is not None for r in refused)
    assert all(res.rows[k].candidate.pp == 1 for k in res.pareto)
