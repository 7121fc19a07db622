"""Profile-guided calibration (engine.cost.calibrate, engine.plan.calibrate.with_calibration)."""

from __future__ import annotations

import math

import pytest

from engine.cost import CostModel
from engine.cost.calibrate import CalibratedCost, Calibration, calibrate, measured_compute_scale
from engine.errors import CostModelError, TesselError
from engine.io.plan import Plan
from engine.plan import lower_plan, make_plan, resimulate, with_calibration
from engine.schedule import Schedule
from engine.simulate import simulate
from engine.timeline import Event, Timeline


@pytest.fixture(scope="module")
def plan() -> Plan:
    return make_plan("gpt2-tiny", devices=2, micro_batches=4, schedule="1f1b", device_type="cpu").plan


class _SlowOptim:
    """A 'machine' whose optimizer runs at a known rate: 3 ns per parameter byte."""

    def __init__(self, base):
        self.base = base

    def p2p_time(self, nbytes, src, dst):
        return self.base.p2p_time(nbytes, src, dst)

    def collective_time(self, kind, nbytes, ranks):
        return self.base.collective_time(kind, nbytes, ranks)

    def optimizer_time(self, param_bytes):
        return 3e-9 * param_bytes


def _measured(plan: Plan, scale: dict) -> Timeline:
    """A stand-in measurement: the plan with block durations scaled per (segment, kind)."""
    pl = plan.placement
    durations = [b.duration * scale.get((b.segment, b.kind), 1.0) for b in pl.blocks]
    sched = Schedule(pl.with_durations(durations), plan.schedule.num_micro_batches, plan.schedule.orders,
                     plan.schedule.name, dict(plan.schedule.meta))
    slow = Plan(plan.model, plan.parallel, plan.segments, sched, plan.cost, {}, {},
                tied_weights=list(plan.tied_weights))
    return simulate(lower_plan(slow), _SlowOptim(CostModel.from_dict(plan.cost)))


def test_calibration_reproduces_the_measured_step(plan):
    scale = {(0, "F"): 1.7, (0, "B"): 2.5, (1, "F"): 0.6, (1, "B"): 1.3}
    measured = _measured(plan, scale)
    cal = calibrate([measured])
    for b in plan.placement.blocks:
        assert cal.block_time(b.segment, b.kind, -1.0) == pytest.approx(b.duration * scale[(b.segment, b.kind)])
    assert cal.optimizer_seconds_per_byte == pytest.approx(3e-9)
    new, tl = with_calibration(plan, cal)
    assert tl.makespan == pytest.approx(measured.makespan, rel=1e-9)
    assert new.metrics["makespan"] == pytest.approx(measured.makespan, rel=1e-9)
    # the original prediction was different: the calibration did something
    assert not math.isclose(plan.metrics["makespan"], measured.makespan, rel_tol=1e-3)


def test_calibration_survives_json_and_resimulate(plan, tmp_path):
    from engine.io import load_plan, save_plan
    measured = _measured(plan, {(0, "F"): 2.0, (1, "B"): 3.0})
    new, tl = with_calibration(plan, calibrate(measured))
    back = load_plan(save_plan(new, tmp_path / "plan.json"))
    assert resimulate(back).makespan == pytest.approx(tl.makespan, rel=1e-9)
    assert Calibration.from_dict(back.meta["calibration"]).optimizer_seconds_per_byte == pytest.approx(3e-9)


def test_calibrated_cost_delegates_communication():
    base = CostModel.for_device("cpu")
    cal = Calibration(optimizer_seconds_per_byte=1e-9)
    cc = CalibratedCost(base, cal)
    assert cc.optimizer_time(1000) == pytest.approx(1e-6)
    assert cc.p2p_time(1 << 20, 0, 1) == base.p2p_time(1 << 20, 0, 1)
    assert cc.collective_time("allreduce", 1 << 20, [0, 1]) == base.collective_time("allreduce", 1 << 20, [0, 1])
    assert CalibratedCost(base, Calibration()).optimizer_time(4096) == base.optimizer_time(4096)


def test_errors_name_the_problem(plan):
    empty = Timeline([Event(0, "send", "SEND", "0F0>1", 0.0, 1.0, 10, 0, 0)], [[(0.0, 0)]], 1)
    with pytest.raises(CostModelError, match="no measured compute events"):
        calibrate(empty)
    with pytest.raises(TesselError, match="segments \\[7\\]"):
        with_calibration(plan, Calibration({(7, "F"): 1.0}))
    with pytest.raises(CostModelError, match="malformed calibration"):
        Calibration.from_dict({"blocks": [["x", "F", 1.0]]})


def test_trimmed_mean_drops_the_outliers():
    from engine.cost.calibrate import trimmed_mean
    assert trimmed_mean([1.0] * 9 + [100.0]) == pytest.approx(1.0)      # one preempted block of ten
    assert trimmed_mean([1.0, 2.0, 3.0]) == pytest.approx(2.0)           # too few to trim: the mean
    assert trimmed_mean([5.0]) == 5.0
    with pytest.raises(ValueError, match="no values"):
        trimmed_mean([])


def test_calibrated_cost_pickles_and_copies():
    import copy
    import pickle
    cc = CalibratedCost(CostModel.for_device("cpu"),
                        Calibration(optimizer_seconds_per_byte=2e-9, p2p_seconds={1024: 1e-3}))
    for other in (pickle.loads(pickle.dumps(cc)), copy.deepcopy(cc)):
        assert other.optimizer_time(1000) == pytest.approx(2e-6)
        assert other.p2p_time(1024, 0, 1) == pytest.approx(cc.p2p_time(1024, 0, 1))
        assert other.node_of(3) == cc.node_of(3)      # delegated to the base model


def test_p2p_overhead_is_measured_from_producer_end_to_arrival():
    """A RECV waiting for its producer: the transfer is from the producer's end (1.000 s) to the
    arrival (1.004 s), not from the receive's post (0.5 s); one that was posted after the
    producer ended counts from its post."""
    nbytes = 4096
    events = [Event(0, "compute", "F", "0F0", 0.0, 1.0, 0, 0, 0),
              Event(1, "recv", "RECV", "0F0<0", 0.5, 1.004, nbytes, 0, 0),
              Event(0, "compute", "F", "0F1", 1.0, 2.0, 0, 1, 0),
              Event(1, "recv", "RECV", "0F1<0", 2.5, 2.504, nbytes, 1, 0),
              Event(1, "compute", "F", "1F0", 1.004, 1.5, 0, 0, 1)]
    tl = Timeline(events, [[(0.0, 0)], [(0.0, 0)]], 2)
    cal = calibrate(tl)
    assert cal.p2p_seconds == {nbytes: pytest.approx(0.004)}
    base = CostModel.for_device("cpu")
    cc = CalibratedCost(base, cal)
    assert cc.p2p_overhead == pytest.approx(0.004 - base.p2p_time(nbytes, 0, 1))
    assert cc.p2p_time(nbytes, 0, 1) == pytest.approx(0.004)
    assert cc.p2p_time(nbytes, 1, 1) == 0.0      # no transfer to itself


def test_collective_overhead_is_timed_on_the_rank_that_arrived_last():
    """Rank 0 posts the all-reduce at 1.0 s and waits for rank 1, which posts it at 1.5 s; both
    finish at 1.503 s. The collective's own time is rank 1's 3 ms, not rank 0's 503 ms; a
    collective seen on one rank only is not a sample."""
    nbytes = 1 << 16
    events = [Event(0, "compute", "B", "0B0", 0.0, 1.0, 0, 0, 0),
              Event(1, "compute", "B", "1B0", 0.0, 1.5, 0, 0, 1),
              Event(0, "collective", "ALLREDUCE", "allreduce tied", 1.0, 1.503, nbytes, -1, -1),
              Event(1, "collective", "ALLREDUCE", "allreduce tied", 1.5, 1.503, nbytes, -1, -1),
              Event(1, "collective", "ALLREDUCE", "allreduce s1", 1.6, 1.7, nbytes, -1, 1)]
    cal = calibrate(Timeline(events, [[(0.0, 0)], [(0.0, 0)]], 2))
    assert cal.collectives == [("allreduce", nbytes, 2, pytest.approx(0.003))]
    assert Calibration.from_dict(cal.to_dict()).collectives == cal.collectives
    base = CostModel.for_device("cpu")
    cc = CalibratedCost(base, cal)
    assert cc.collective_overhead == pytest.approx(0.003 - base.collective_time("allreduce", nbytes, [0, 1]))
    assert cc.collective_time("allreduce", nbytes, [0, 1]) == pytest.approx(0.003)
    assert cc.collective_time("allreduce", nbytes, [1]) == base.collective_time("allreduce", nbytes, [1])


def test_a_data_parallel_gradient_sync_seen_on_one_rank_is_timed_there_with_replicas():
    """A launch's timeline holds replica 0 only, so its gradient all-reduce among replicas
    (``allreduce s1``, on rank 1 alone) is a sample only when the data-parallel degree is given:
    then it counts as a collective of that many ranks, with that rank's time."""
    nbytes = 1 << 20
    events = [Event(1, "compute", "B", "1B0", 0.0, 1.5, 0, 0, 1),
              Event(1, "collective", "ALLREDUCE", "allreduce s1", 1.6, 1.65, nbytes, -1, 1)]
    tl = Timeline(events, [[(0.0, 0)], [(0.0, 0)]], 2)
    assert calibrate(tl).collectives == []
    cal = calibrate(tl, replicas=4)
    assert cal.collectives == [("allreduce", nbytes, 4, pytest.approx(0.05))]
    base = CostModel.for_device("cpu")
    assert CalibratedCost(base, cal).collective_time("allreduce", nbytes, [0, 1, 2, 3]) == pytest.approx(0.05)


def test_reduce_scatter_and_all_gather_get_their_own_overheads():
    """CoCoNet's sharded update: a measured reduce-scatter and all-gather (each seen on both ranks)
    calibrate their own kinds; an all-reduce never measured falls back to none."""
    nbytes = 1 << 20
    events = [Event(r, "compute", "B", f"{r}B0", 0.0, 1.0, 0, 0, r) for r in (0, 1)]
    events += [Event(r, "collective", op, f"{op.lower()} s0", 1.0, 1.0 + t, nbytes, -1, 0)
               for r in (0, 1) for op, t in (("REDUCESCATTER", 0.040), ("ALLGATHER", 0.010))]
    cal = calibrate(Timeline(events, [[(0.0, 0)], [(0.0, 0)]], 2))
    assert sorted(k for k, *_ in cal.collectives) == ["allgather", "reducescatter"]
    base = CostModel.for_device("cpu")
    cc = CalibratedCost(base, cal)
    assert cc.collective_time("reducescatter", nbytes, [0, 1]) == pytest.approx(0.040)
    assert cc.collective_time("allgather", nbytes, [0, 1]) == pytest.approx(0.010)
    assert cc.collective_time("allreduce", nbytes, [0, 1]) == base.collective_time("allreduce", nbytes, [0, 1])


def test_compute_scale_is_measured_over_planned_per_kind_and_survives_json(plan):
    from engine.plan import calibrate_plan
    from engine.plan.make import transferable_scale

    scale = {(0, "F"): 1.5, (1, "F"): 2.5, (0, "B"): 2.0, (1, "B"): 2.0}
    measured = _measured(plan, scale)
    planned = {(b.segment, b.kind): b.duration for b in plan.placement.blocks}
    cal = calibrate([measured], planned=planned)
    f = [b.duration for b in plan.placement.blocks if b.kind == "F"]
    want_f = (1.5 * f[0] + 2.5 * f[1]) / (f[0] + f[1])   # summed over segments, not averaged
    assert cal.compute_scale == pytest.approx({"F": want_f, "B": 2.0})
    assert Calibration.from_dict(cal.to_dict()).compute_scale == cal.compute_scale
    assert calibrate([measured]).compute_scale == {}   # nothing planned to compare with
    # a block it measured keeps its measured time; one it did not gets planned x scale
    assert cal.block_time(0, "F", 1.0) == pytest.approx(1.5 * f[0])
    assert cal.block_time(7, "B", 1.0) == pytest.approx(2.0)
    doc = calibrate_plan(plan, [measured]).plan.meta["calibration"]
    assert doc["compute_scale"] == pytest.approx(cal.compute_scale)
    # it transfers to other plans only without the measured plan's own block times
    assert transferable_scale(doc) is None
    # a split backward's halves take the backward's scale
    moved = transferable_scale({**doc, "blocks": []})
    assert moved is not None and moved.compute_scale == pytest.approx(cal.compute_scale)
    assert [moved.scale_of(k) for k in "FBIW"] == pytest.approx([want_f, 2.0, 2.0, 2.0])
    assert transferable_scale({"compute_scale": {}}) is None
    assert Calibration(compute_scale={"B": 3.0}).scale_of("W") == 3.0
    # measured I and W (ZB-H1) stand for an unmeasured B
    split = {(0, "I"): 1.0, (0, "W"): 3.0}
    assert calibrate([measured], planned=planned).compute_scale.get("I") is None
    got = measured_compute_scale(split, {(0, "I"): 1.0, (0, "W"): 1.0})
    assert got == pytest.approx({"I": 1.0, "W": 3.0, "B": 2.0})
    assert transferable_scale(None) is None


def test_a_layouts_whole_and_split_backward_calibrations_merge_with_each_kinds_scale():
    """``Calibration.with_split_backward_of``: the whole backward's costs and ``B`` scale, the split
    backward's ``I`` and ``W`` scales; two of one kind are refused."""
    import pytest

    from engine.cost.calibrate import Calibration
    from engine.errors import CostModelError

    whole = Calibration(compute_scale={"F": 2.0, "B": 2.0}, optimizer_seconds_per_byte=1e-9,
                        block_seconds={(0, "F"): 1.0}, p2p_seconds={1024: 1e-4})
    split = Calibration(compute_scale={"F": 1.5, "B": 3.0, "I": 2.5, "W": 4.0}, optimizer_seconds_per_byte=5e-9)
    assert (whole.split_backward, split.split_backward) == (False, True)
    merged = whole.with_split_backward_of(split)
    assert merged.compute_scale == {"F": 2.0, "B": 2.0, "I": 2.5, "W": 4.0}
    assert [merged.scale_of(k) for k in "FBIW"] == [2.0, 2.0, 2.5, 4.0]
    assert whole.scale_of("I") == 2.0   # without the split launch, I takes B's scale
    assert merged.block_seconds == {} and merged.optimizer_seconds_per_byte == 1e-9
    assert merged.p2p_seconds == {1024: 1e-4}
    assert Calibration.from_dict(merged.to_dict()).compute_scale == merged.compute_scale
    for a, b in ((split, whole), (whole, whole), (split, split)):
        with pytest.raises(CostModelError, match="one measured on a whole backward"):
            a.with_split_backward_of(b)


def test_several_launches_of_one_layout_pool_to_their_median():
    """``Calibration.pooled`` / ``layout_calibration``: per compute kind, block, transfer size and for
    the optimizer the median of the launches (one slow launch of three does not move it); the
    collectives of all; two backward kinds pooled apart, then merged."""
    import pytest

    from engine.cost.calibrate import Calibration, layout_calibration
    from engine.errors import CostModelError

    a = Calibration(compute_scale={"F": 1.0, "B": 2.0}, block_seconds={(0, "F"): 1.0}, optimizer_seconds_per_byte=1e-9,
                    p2p_seconds={64: 1e-4}, collectives=[("allreduce", 8, 2, 1e-3)], samples=4, steps=2)
    b = Calibration(compute_scale={"F": 1.2, "B": 2.2}, block_seconds={(0, "F"): 1.2}, optimizer_seconds_per_byte=3e-9,
                    p2p_seconds={64: 3e-4, 128: 5e-4}, collectives=[("allreduce", 8, 2, 2e-3)], samples=4, steps=2)
    slow = Calibration(compute_scale={"F": 9.0, "B": 9.0}, block_seconds={(0, "F"): 9.0}, samples=4, steps=2)
    got = Calibration.pooled([a, b, slow])
    assert got.compute_scale == pytest.approx({"F": 1.2, "B": 2.2})
    assert got.block_seconds == pytest.approx({(0, "F"): 1.2})
    assert got.optimizer_seconds_per_byte == pytest.approx(2e-9)   # the two launches that measured it
    assert got.p2p_seconds == pytest.approx({64: 2e-4, 128: 5e-4})
    assert len(got.collectives) == 2 and (got.samples, got.steps) == (12, 6)
    assert Calibration.pooled([a]) is a
    split = Calibration(compute_scale={"F": 1.0, "B": 3.0, "I": 2.0, "W": 4.0})
    split2 = Calibration(compute_scale={"F": 1.0, "B": 3.0, "I": 4.0, "W": 6.0})
    with pytest.raises(CostModelError, match="each backward kind on their own"):
        Calibration.pooled([a, split])
    with pytest.raises(CostModelError, match="at least one"):
        Calibration.pooled([])
    merged = layout_calibration([split, a, b, split2, slow])
    assert [merged.scale_of(k) for k in "FBIW"] == pytest.approx([1.2, 2.2, 3.0, 5.0])
    assert layout_calibration([b]).compute_scale == b.compute_scale


def test_launches_of_recomputing_plans_become_the_layouts_recompute_variant():
    """``layout_calibration``: launches of a plan that recomputes activations are pooled apart and
    kept as the recompute variant, with which a recomputing candidate is predicted (its own F, B
    and residual); the backward kind it did not measure (ZB-H1's I and W, the split residual)
    takes its measured kind's value times the ratio the launches without recomputation measured.
    The variant survives the JSON form; mixed pools are refused."""
    import pytest

    from engine.cost.calibrate import Calibration, layout_calibration
    from engine.errors import CostModelError

    whole = Calibration(compute_scale={"F": 1.0, "B": 2.0}, step_residual={"whole": 1.1})
    split = Calibration(compute_scale={"F": 1.0, "B": 4.0, "I": 3.0, "W": 5.0}, step_residual={"split": 1.3})
    rc = [Calibration(compute_scale={"F": f, "B": 4.0}, step_residual={"whole": r}, recompute="full")
          for f, r in ((2.0, 0.9), (2.2, 0.8), (9.0, 0.9))]
    got = layout_calibration([rc[0], whole, split, rc[1], rc[2]])
    assert got.recompute == "none" and got.for_plan(False) is got
    assert [got.scale_of(k) for k in "FBIW"] == pytest.approx([1.0, 2.0, 3.0, 5.0])
    v = got.for_plan(True)
    assert v is got.recompute_variant and v.recompute == "full" and v.recomputes
    assert [v.scale_of(k) for k in "FBIW"] == pytest.approx([2.2, 4.0, 4.0 * 3 / 2, 4.0 * 5 / 2])
    assert v.residual_of(False) == pytest.approx(0.9)
    assert v.residual_of(True) == pytest.approx(0.9 * 1.3 / 1.1)
    back = Calibration.from_dict(got.to_dict())
    assert back.recompute_variant is not None and back.for_plan(True).compute_scale == pytest.approx(v.compute_scale)
    assert back.for_plan(True).recompute == "full" and back.for_plan(False).recompute_variant is not None
    assert layout_calibration(rc[:2]).recomputes and layout_calibration(rc[:2]).recompute_variant is None
    with pytest.raises(CostModelError, match="with and without activation recomputation"):
        Calibration.pooled([whole, rc[0]])
    with pytest.raises(CostModelError, match="recompute_variant"):
        Calibration.from_dict({"recompute_variant": 3})


def test_a_recomputing_backward_takes_the_forward_scale_for_its_recomputed_forward():
    """A segment planned at F = 1 s, B = 2 s + 1 s recomputed forward, measured on a machine whose
    forward runs 3x and backward 1x slower than planned: the measured B (2 + 3) gives a backward
    scale of 1, not 5/3, and a plan of the same model without recomputation is predicted from it
    (B 2 s), a recomputing one back at its measurement (5 s); a split backward's I and W each
    recompute."""
    import pytest

    from engine.cost.calibrate import Calibration, calibrated_durations, measured_compute_scale

    planned = {(0, "F"): 1.0, (0, "B"): 3.0}
    measured = {(0, "F"): 3.0, (0, "B"): 5.0}
    scale = measured_compute_scale(measured, planned, {0: 1.0})
    assert scale == pytest.approx({"F": 3.0, "B": 1.0})
    assert measured_compute_scale(measured, planned) == pytest.approx({"F": 3.0, "B": 5.0 / 3.0})
    cal = Calibration(compute_scale=scale)
    assert cal.scaled("B", 2.0) == pytest.approx(2.0)
    assert cal.scaled("B", 3.0, 1.0) == pytest.approx(5.0)
    assert cal.scaled("F", 1.0, 1.0) == pytest.approx(3.0)   # a forward recomputes nothing
    assert cal.scaled("I", 2.0, 1.0) == pytest.approx(4.0)   # I: 1 s own at B's scale + 1 s recompute at F's

    class Block:
        def __init__(self, segment, kind, duration):
            self.segment, self.kind, self.duration = segment, kind, duration

    blocks = [Block(0, "F", 1.0), Block(0, "B", 3.0), Block(1, "B", 3.0)]
    assert calibrated_durations(blocks, cal, [1.0]) == pytest.approx([3.0, 5.0, 3.0])
