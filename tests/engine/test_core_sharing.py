"""Ranks sharing a node's cores (engine.plan.core_sharing) and the tuner's use of it."""

from __future__ import annotations

import dataclasses

import pytest

from engine.layout import RankLayout
from engine.plan import make_plan
from engine.plan.calibrate import calibrate_plan
from engine.plan.core_sharing import node_work_seconds, shared_core_step_time, uncontended_timeline
from engine.timeline import Event, Timeline
from engine.tune import TuneSpace, tune
from engine.tune.space import TuneSpaceError


def _tl(*intervals: tuple[int, float, float]) -> Timeline:
    events = [Event(r, "compute", "F", f"{r}F{i}", s, e) for i, (r, s, e) in enumerate(intervals)]
    ranks = 1 + max(e.rank for e in events)
    return Timeline(events, [[(0.0, 0)] for _ in range(ranks)], ranks)


def test_a_collective_that_every_rank_runs_at_once_is_reduced_to_its_work_too():
    """Two ranks on one core both in their all-reduce over [10, 30] ms (after 10 ms of compute
    each, also together): each did 10 ms of the all-reduce's work, as of the compute; a receive
    (a wait) is left as measured."""
    events = [Event(r, "compute", "B", f"{r}B0", 0.0, 0.010) for r in (0, 1)]
    events += [Event(r, "collective", "ALLREDUCE", f"allreduce s{r}", 0.010, 0.030) for r in (0, 1)]
    events.append(Event(1, "recv", "RECV", "0F0<0", 0.0, 0.010))
    got = uncontended_timeline(Timeline(events, [[(0.0, 0)], [(0.0, 0)]], 2), RankLayout(pp=2), 2, 1)
    assert [e.end - e.start for e in got.events] == pytest.approx([0.005, 0.005, 0.010, 0.010, 0.010])


def test_independent_ranks_on_one_core_take_their_summed_work():
    """Two ranks each computing 10 ms from time 0 on one core: processor sharing finishes both
    at 20 ms (each at half speed), which is the work bound."""
    tl = _tl((0, 0.0, 0.010), (1, 0.0, 0.010))
    pp2 = RankLayout(pp=2)
    assert shared_core_step_time(tl, pp2, devices_per_node=2, cores=1) == pytest.approx(0.020)
    assert shared_core_step_time(tl, pp2, devices_per_node=2, cores=2) == pytest.approx(0.010)   # a core each
    assert shared_core_step_time(tl, pp2, devices_per_node=1, cores=1) == pytest.approx(0.010)   # a node each


def test_replicas_and_tensor_ranks_do_their_pipeline_ranks_work():
    """A plan's timeline holds one rank per pipeline rank; dp 2 x tp 2 of one stage on one node
    of two cores do four times its work."""
    tl = _tl((0, 0.0, 0.010))
    lay = RankLayout(tp=2, dp=2, pp=1)
    assert node_work_seconds(tl, lay, 4) == pytest.approx([0.040])
    assert node_work_seconds(tl, lay, 2) == pytest.approx([0.020, 0.020])
    assert shared_core_step_time(tl, lay, 4, 2) == pytest.approx(0.020)


def test_a_pipeline_that_never_overlaps_keeps_its_makespan():
    tl = _tl((0, 0.0, 0.010), (1, 0.010, 0.020), (0, 0.020, 0.025))
    pp2 = RankLayout(pp=2)
    assert node_work_seconds(tl, pp2, 2) == pytest.approx([0.025])
    assert shared_core_step_time(tl, pp2, 2, 1) == pytest.approx(0.025)   # makespan = work
    assert node_work_seconds(tl, pp2, 1) == pytest.approx([0.015, 0.010])


def test_sends_and_collectives_are_cpu_work_and_receives_are_not():
    tl = _tl((0, 0.0, 0.010), (1, 0.0, 0.010))
    tl.events += [Event(0, "send", "SEND", "0F0>1", 0.010, 0.014), Event(1, "recv", "RECV", "0F0>1", 0.010, 0.014),
                  Event(0, "collective", "ALLREDUCE", "allreduce s0", 0.014, 0.020)]
    assert node_work_seconds(tl, RankLayout(pp=2), 2) == pytest.approx([0.030])


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="cores per node"):
        shared_core_step_time(_tl((0, 0.0, 1.0)), RankLayout(dp=2), 2, 0)
    with pytest.raises(ValueError, match="devices per node"):
        node_work_seconds(_tl((0, 0.0, 1.0)), RankLayout(dp=2), 0)
    with pytest.raises(TuneSpaceError, match="host_cores"):
        TuneSpace(gpus=2, global_batch=4, host_cores=0)


SPACE = dict(gpus=2, global_batch=4, gpus_per_node=2, micro_batch_sizes=(1,), schedules=("1f1b",),
             recompute=("none",), sharded_update=False, sequence_parallel=False, overlap_grad_sync=False, max_tp=1)


def test_the_tuner_predicts_each_candidate_with_the_work_bound_of_its_plan():
    own = tune("llama-tiny", TuneSpace(**SPACE), device_type="h100", seq_len=16)
    shared = tune("llama-tiny", TuneSpace(**SPACE, host_cores=1), device_type="h100", seq_len=16)
    assert {r.candidate.label() for r in own.fitting()} == {r.candidate.label() for r in shared.fitting()}
    by_label = {r.candidate.label(): r for r in own.fitting()}
    for r in shared.fitting():
        c = r.candidate
        plan = make_plan("llama-tiny", devices=2, dp=c.dp, tp=c.tp, dp_shard=c.dp_shard, micro_batches=c.micro_batches,
                         micro_batch_size=c.micro_batch_size, schedule=c.schedule, seq_len=16, device_type="h100")
        tl = plan.timeline
        work = c.dp * sum(e.end - e.start for e in tl.events if e.stream in ("compute", "send", "collective"))
        assert r.step_time == pytest.approx(max(tl.makespan, work))
        assert by_label[c.label()].step_time == pytest.approx(tl.makespan)
        assert r.tokens_per_second == pytest.approx(by_label[c.label()].tokens_per_second * tl.makespan / r.step_time)
    dp2 = next(r for r in shared.fitting() if r.candidate.dp == 2)
    assert dp2.step_time > by_label[dp2.candidate.label()].step_time * 1.5   # both ranks busy at once
    assert "core-bound" in dp2.reason


def test_a_measured_event_is_reduced_to_the_work_it_did_under_processor_sharing():
    """One core, rank 0 computing over [0, 15] ms and rank 1 over [5, 20] ms: alone on [0, 5] and
    [15, 20], at half speed on [5, 15], so each did 10 ms of work."""
    tl = _tl((0, 0.0, 0.015), (1, 0.005, 0.020))
    got = uncontended_timeline(tl, RankLayout(pp=2), 2, 1)
    assert [e.end - e.start for e in got.events] == pytest.approx([0.010, 0.010])
    assert [e.start for e in got.events] == [0.0, 0.005]
    assert uncontended_timeline(tl, RankLayout(pp=2), 2, 2) is tl   # a core each: as measured
    # the forward model reproduces the measured step from the work: both 10 ms at once on one core
    assert shared_core_step_time(_tl((0, 0.0, 0.010), (1, 0.0, 0.010)), RankLayout(pp=2), 2, 1) == \
        pytest.approx(0.020)


def _stretched(tl: Timeline, k: float) -> Timeline:
    return dataclasses.replace(tl, events=[dataclasses.replace(e, start=e.start * k, end=e.end * k) for e in tl.events],
                               source="measured")


def test_calibrating_steps_measured_on_shared_cores_recovers_a_ranks_own_speed():
    """dp 2 on one core: both replicas compute at once, so each block is measured at twice its
    time. Calibrated as if each had a core, the compute scale is 2; told the cores were shared,
    it is 1 and the checked prediction is the measured step."""
    res = make_plan("llama-tiny", devices=2, dp=2, micro_batches=2, seq_len=16, device_type="h100")
    measured = [_stretched(res.timeline, 2.0)] * 2
    plain = calibrate_plan(res.plan, measured)
    shared = calibrate_plan(res.plan, measured, shared_cores=1)
    scale = lambda check: check.plan.meta["calibration"]["compute_scale"]  # noqa: E731
    assert scale(plain)["F"] == pytest.approx(2.0) and scale(plain)["B"] == pytest.approx(2.0)
    assert scale(shared)["F"] == pytest.approx(1.0) and scale(shared)["B"] == pytest.approx(1.0)
    assert shared.predicted_makespan == pytest.approx(shared.measured_makespan, rel=0.05)


def test_the_step_residual_is_what_the_transferred_calibration_misses_of_the_measured_step():
    """The measured steps end 30% after their last block (time no block accounts for): the
    calibration's compute scale reproduces the blocks (1), and its step residual (1.3) the rest;
    steps measured exactly as predicted give a residual of 1."""
    from engine.cost.calibrate import Calibration

    res = make_plan("llama-tiny", devices=2, dp=2, micro_batches=2, seq_len=16, device_type="h100")
    span = res.timeline.makespan
    tail = Event(0, "recv", "RECV", "idle", span, 1.3 * span)
    late = dataclasses.replace(_stretched(res.timeline, 1.0), events=[*res.timeline.events, tail])
    for measured, want in (([_stretched(res.timeline, 1.0)] * 2, 1.0), ([late] * 2, 1.3)):
        cal = Calibration.from_dict(calibrate_plan(res.plan, measured).plan.meta["calibration"])
        assert cal.compute_scale["F"] == pytest.approx(1.0, rel=0.02)
        assert cal.step_residual == {"whole": pytest.approx(want, rel=0.02)}


def test_equal_step_times_rank_the_schedule_without_a_split_backward_first():
    """Where the work bound decides, 1F1B and ZB-H1 of one layout predict the same step; the one
    pass per block ranks first (ZB-H1 measured 7-18% slower there on 4 CPU ranks), whatever the
    peak memory; a real difference in step time still wins."""
    from engine.tune import candidates
    from engine.tune.tuner import TuneRow, _rank_key

    space = TuneSpace(**{**SPACE, "schedules": ("1f1b", "zb-h1")})
    by_schedule = {c.schedule: c for c in candidates(space) if c.pp == 2}
    zb = TuneRow(by_schedule["zb-h1"], "ok", step_time=0.1, peak_memory=1.0)
    plain = TuneRow(by_schedule["1f1b"], "ok", step_time=0.1 * (1 + 1e-14), peak_memory=2.0)
    assert sorted([zb, plain], key=_rank_key)[0] is plain
    faster = TuneRow(by_schedule["zb-h1"], "ok", step_time=0.099, peak_memory=1.0)
    assert sorted([faster, plain], key=_rank_key)[0] is faster
