"""engine.crossover: co-located data-parallel jobs (CrossoverScheduler) predicted on one Timeline."""

from __future__ import annotations

import json

import pytest

from engine.crossover import (
    COMM_CPU_SHARE,
    MODES,
    ColocatedPrediction,
    JobProfile,
    compare_modes,
    compare_profiles,
    ideal_pair_cycle,
    job_profile,
    predict_colocated,
    predict_profiles,
)
from engine.errors import CrossoverError, TesselError
from engine.io.trace import timeline_to_trace
from engine.plan import make_plan
from engine.timeline import Event, Timeline


@pytest.fixture(scope="module")
def dp2_plan():
    return make_plan("gpt2-tiny", devices=2, dp=2, micro_batches=1, device_type="cpu").plan


def pair(c, m, o=0.0, n=2, names="AB"):
    return [JobProfile.synthetic(x, c, m, o, num_devices=n, tokens_per_step=100) for x in names]


def token_events(pred, rank=0):
    return sorted((e for e in pred.timeline.events if e.rank == rank and e.op in ("F", "B", "I", "W")),
                  key=lambda e: e.start)


def assert_exclusive(pred):
    for r in range(pred.num_devices):
        evs = token_events(pred, r)
        for a, b in zip(evs, evs[1:]):
            assert b.start >= a.end - 1e-12, (a, b)


# ------------------------------------------------------------------ the ideal cycles
@pytest.mark.parametrize("c,m", [(1.0, 1.0), (1.0, 2.0), (2.0, 1.0), (1.0, 0.4), (0.3, 1.0)])
def test_pair_cycle_crossover_vs_sequential(c, m):
    res = compare_profiles(pair(c, m), steps=6)
    ideal = ideal_pair_cycle(c, m)
    assert res["crossover"].cycle_time == pytest.approx(ideal["crossover"], rel=1e-9)
    assert res["sequential"].cycle_time == pytest.approx(ideal["sequential"], rel=1e-9)
    # the steady state shows in the job's step interval too: job A starts a step every 2·max(C, M)
    starts = [e.start for e in res["crossover"].timeline.events if e.rank == 0 and e.name == "A 0F0"]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[-1] == pytest.approx(2 * max(c, m))
    # sequential: exactly steps * sum of solo steps
    assert res["sequential"].makespan == pytest.approx(6 * 2 * (c + m))
    assert res["crossover"].aggregate_tokens_per_second > res["sequential"].aggregate_tokens_per_second


def test_uncoordinated_slower_than_crossover_when_comm_equals_compute():
    res = compare_profiles(pair(1.0, 1.0, 0.05), steps=4)
    cx, un = res["crossover"], res["uncoordinated"]
    assert un.makespan > 1.5 * cx.makespan
    assert un.aggregate_tokens_per_second < cx.aggregate_tokens_per_second
    # processor sharing: both jobs run at half speed while they overlap -> each F/B lasts 2x
    f = [e for e in un.timeline.events if e.rank == 0 and e.name == "A 0F0"][0]
    assert f.duration == pytest.approx(2 * (1.0 / 3.0))
    # and their all-reduces share the link: 2x as long as solo
    ar = [e for e in un.timeline.events if e.rank == 0 and e.op == "ALLREDUCE" and e.job == "A"][0]
    assert ar.duration == pytest.approx(2.0)


def test_token_exclusivity_and_fifo_handover():
    pred = predict_profiles(pair(1.0, 0.7, 0.1), "crossover", 5)
    assert_exclusive(pred)
    # the token alternates A, B, A, B... (fair FIFO): order of first forwards
    firsts = [e.job for e in token_events(pred) if e.op == "F"]
    assert firsts == ["A", "B"] * 5
    # the token is released when the all-reduce starts: B's forward starts at A's all-reduce start
    ar = [e for e in pred.timeline.events if e.rank == 0 and e.op == "ALLREDUCE" and e.job == "A"][0]
    bf = [e for e in pred.timeline.events if e.rank == 0 and e.name == "B 0F0"][0]
    assert bf.start == pytest.approx(ar.start)


def test_three_jobs_rotate():
    pred = predict_profiles(pair(1.0, 1.0, n=4, names="ABC"), "crossover", 4)
    assert pred.jobs == ["A", "B", "C"]
    assert_exclusive(pred)
    firsts = [e.job for e in token_events(pred) if e.op == "F"]
    assert firsts == ["A", "B", "C"] * 4
    # 3 jobs with C = M: the compute token is the bottleneck, one round = 3·C
    assert pred.cycle_time == pytest.approx(3.0)
    assert {e.rank for e in pred.timeline.events} == {0, 1, 2, 3}
    assert len(pred.per_job_tokens_per_second) == 3
    assert sum(pred.per_job_tokens_per_second.values()) == pytest.approx(pred.aggregate_tokens_per_second)
    for mode in ("uncoordinated", "sequential"):
        other = predict_profiles(pair(1.0, 1.0, n=4, names="ABC"), mode, 4)
        assert other.aggregate_tokens_per_second < pred.aggregate_tokens_per_second


def test_sequential_runs_jobs_one_after_the_other():
    pred = predict_profiles(pair(1.0, 0.5, 0.1), "sequential", 3)
    a_end = max(e.end for e in pred.timeline.events if e.job == "A")
    b_start = min(e.start for e in pred.timeline.events if e.job == "B")
    assert b_start == pytest.approx(a_end)
    assert pred.step_times["A"] == pytest.approx(1.6)
    assert pred.makespan == pytest.approx(2 * 3 * 1.6)


# ------------------------------------------------------------------ real plans
def test_real_plans(dp2_plan):
    prof = job_profile(dp2_plan, "A")
    assert prof.num_devices == 2
    assert prof.compute_time > 0 and prof.comm_time > 0 and prof.optim_time > 0
    assert prof.tokens_per_step == dp2_plan.model.batch_size * dp2_plan.model.seq_len == 256
    res = compare_modes([dp2_plan, dp2_plan], steps=4)
    assert set(res) == set(MODES)
    cx, sq, un = res["crossover"], res["sequential"], res["uncoordinated"]
    for p in res.values():
        assert isinstance(p, ColocatedPrediction)
        assert p.timeline.num_devices == 2
        assert {e.job for e in p.timeline.events} == {"A", "B"}
        assert all(e.name.startswith(e.job + " ") for e in p.timeline.events)
        assert {e.op for e in p.timeline.events} == {"F", "B", "ALLREDUCE", "OPTIM"}
        assert {e.stream for e in p.timeline.events} == {"compute", "collective"}
        # 2 jobs x 4 steps x (F, B, ALLREDUCE, OPTIM) on each of 2 devices
        assert len(p.timeline.events) == 2 * 4 * 4 * 2
        assert p.tokens_per_step == {"A": 256, "B": 256}
        assert p.aggregate_tokens_per_second == pytest.approx(2 * 4 * 256 / p.makespan)
    assert_exclusive(cx)
    c, m, o = prof.compute_time, prof.comm_time, prof.optim_time
    assert sq.makespan == pytest.approx(2 * 4 * (c + m + o))
    # M < C here: the compute token bounds the crossover cycle (2C plus a little optimizer overlap,
    # plus the processor time of the other job's gloo all-reduce that overlaps the compute: CPU plan)
    share = COMM_CPU_SHARE["loopback"]
    assert 2 * max(c, m) <= cx.cycle_time <= 2 * max(c, m) + 2 * o + 2 * share * m + 1e-12
    assert cx.aggregate_tokens_per_second > sq.aggregate_tokens_per_second
    assert cx.aggregate_tokens_per_second > un.aggregate_tokens_per_second
    # memory: both jobs' parameters resident; uncoordinated holds both jobs' activations at once
    assert cx.timeline.static_memory == [2 * prof.static_memory] * 2
    assert un.timeline.peak_memory()[0] > cx.timeline.peak_memory()[0] >= 2 * prof.static_memory
    json.dumps(cx.to_dict())
    named = predict_colocated([dp2_plan, dp2_plan], "crossover", 2, names=["resnet", "bert"])
    assert named.jobs == ["resnet", "bert"] and "resnet 0F0" in {e.name for e in named.timeline.events}


def test_invalid_inputs(dp2_plan):
    pipe = make_plan("gpt2-tiny", devices=2, dp=1, micro_batches=2, device_type="cpu").plan
    with pytest.raises(TesselError, match="pp=2"):
        predict_colocated([dp2_plan, pipe])
    dp4 = make_plan("gpt2-tiny", devices=4, dp=4, micro_batches=1, device_type="cpu").plan
    with pytest.raises(CrossoverError, match="uses 4 devices but job A uses 2"):
        predict_colocated([dp2_plan, dp4])
    with pytest.raises(TesselError, match="unknown co-location mode"):
        predict_colocated([dp2_plan, dp2_plan], mode="round-robin")
    with pytest.raises(TesselError, match="steps"):
        predict_colocated([dp2_plan, dp2_plan], steps=0)
    with pytest.raises(TesselError, match="no jobs"):
        predict_colocated([])
    with pytest.raises(TesselError, match="unique"):
        predict_colocated([dp2_plan, dp2_plan], names=["A", "A"])
    with pytest.raises(TesselError, match="devices"):
        predict_profiles([JobProfile.synthetic("A", 1, 1, num_devices=2),
                          JobProfile.synthetic("B", 1, 1, num_devices=3)])


# ------------------------------------------------------------------ Event.job and the trace
def test_event_job_round_trip_and_old_dicts():
    e = Event(1, "compute", "F", "A 0F0", 0.0, 1.0, 0, 0, 0, job="A")
    d = e.to_dict()
    assert d["job"] == "A"
    assert Event(**d) == e
    tl = Timeline([e, Event(0, "compute", "B", "0B0", 1.0, 2.0)], [[(0.0, 5)], [(0.0, 5)]], 2, [5, 5])
    back = Timeline.from_dict(json.loads(json.dumps(tl.to_dict())))
    assert [x.job for x in back.events] == ["A", ""]
    old = tl.to_dict()
    for ev in old["events"]:
        del ev["job"]
    assert [x.job for x in Timeline.from_dict(old).events] == ["", ""]
    assert Timeline.from_dict(old).events[0].name == "A 0F0"


def test_perfetto_trace_with_job_events():
    pred = predict_profiles(pair(1e-3, 1e-3, 1e-4), "crossover", 2)
    tr = timeline_to_trace(pred.timeline, metadata=pred.summary())
    json.dumps(tr)
    xs = [x for x in tr["traceEvents"] if x["ph"] == "X"]
    assert len(xs) == len(pred.timeline.events)
    names = {x["name"] for x in xs}
    assert {"A 0F0", "B 0B0", "A allreduce s0", "B optimizer"} <= names
    coll = [x for x in xs if x["cat"] == "ALLREDUCE"]
    assert coll and all(x["tid"] == 3 for x in coll)
    assert tr["metadata"]["mode"] == "crossover"


def test_an_all_reduce_that_uses_the_processor_slows_overlapped_compute():
    """gloo on CPU ranks: the all-reduce keeps the processor busy (COMM_CPU_SHARE), so crossover
    gains less than with a free link; a job alone is not affected."""
    from dataclasses import replace

    from engine.crossover import JobProfile, compare_profiles, predict_profiles

    def job(name, share):
        p = JobProfile.synthetic(name, compute=1.0, comm=1.0)
        return replace(p, tasks=tuple(replace(t, cpu_share=share) if t.op == "ALLREDUCE" else t for t in p.tasks))

    free = compare_profiles([job("A", 0.0), job("B", 0.0)], steps=6)
    busy = compare_profiles([job("A", 0.65), job("B", 0.65)], steps=6)
    gain_free = free["sequential"].cycle_time / free["crossover"].cycle_time
    gain_busy = busy["sequential"].cycle_time / busy["crossover"].cycle_time
    assert gain_free == pytest.approx(2.0)                  # 2*(C+M) -> 2*max(C, M)
    assert 1.0 < gain_busy < gain_free                      # overlap still helps, less
    assert busy["crossover"].aggregate_tokens_per_second < free["crossover"].aggregate_tokens_per_second
    assert busy["sequential"].makespan == pytest.approx(free["sequential"].makespan)  # alone: unchanged
    solo = predict_profiles([job("A", 0.65)], "crossover", steps=3)
    assert solo.makespan == pytest.approx(3 * 2.0)


def test_cpu_plans_get_the_loopback_cpu_share():
    from engine.crossover import COMM_CPU_SHARE, job_profile
    from engine.plan import make_plan

    cpu = job_profile(make_plan("gpt2-tiny", devices=2, dp=2, micro_batches=1, device_type="cpu").plan)
    gpu = job_profile(make_plan("gpt2-tiny", devices=2, dp=2, micro_batches=1, device_type="h100").plan)
    assert {t.cpu_share for t in cpu.tasks if t.op == "ALLREDUCE"} == {COMM_CPU_SHARE["loopback"]}
    assert {t.cpu_share for t in gpu.tasks if t.op == "ALLREDUCE"} == {0.0}


def test_job_profile_counts_moe_all_to_alls_as_token_time():
    """An expert-parallel MoE job's all-to-alls block its compute path (the runtime runs them
    inside the F/B blocks, holding the token): the profile's compute time includes them."""
    from engine.plan import make_plan, resimulate

    plan = make_plan("gpt-moe-tiny", devices=2, dp=2, micro_batches=2, device_type="cpu").plan
    evs = [e for e in resimulate(plan).events if e.rank == 0]
    a2a = sum(e.duration for e in evs if e.op == "ALLTOALL")
    blocks = sum(e.duration for e in evs if e.stream == "compute" and e.op in ("F", "B", "I", "W"))
    assert a2a > 0
    prof = job_profile(plan, "moe")
    assert prof.compute_time == pytest.approx(blocks + a2a, rel=1e-9)
    # the tasks stay one per block, in order, and the last compute task ends where its a2a ends
    assert len([t for t in prof.tasks if t.op in ("F", "B", "I", "W")]) == \
        len([e for e in evs if e.stream == "compute" and e.op in ("F", "B", "I", "W")])
