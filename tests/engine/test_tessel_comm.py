"""Communication-aware Tessel search: the transfers the simulator times are lags the search sees.

The reference is the simulator (engine.simulate) with the same cost model: a transfer lag must
equal the delay it simulates between a producer and its consumer, and a search that sees the lags
must predict the makespan the simulator then measures for its schedule.
"""

from __future__ import annotations

import pytest

from engine.baselines.generic import gpipe_any, one_f_one_b_any
from engine.cost import CostModel
from engine.dependency import lower
from engine.placement import TensorSpec
from engine.schedule import Schedule
from engine.shapes import make_shape
from engine.simulate import simulate
from engine.tessel import makespan_lower_bound, tessel_search
from engine.tessel.comm import asap_makespan, transfer_lags


class FixedLink:
    """Every transfer of a non-empty tensor between two devices takes ``seconds`` (abstract units)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def p2p_time(self, nbytes: int, src: int, dst: int) -> float:
        return self.seconds if nbytes and src != dst else 0.0

    def collective_time(self, kind: str, nbytes: int, ranks: list[int]) -> float:
        return 0.0

    def optimizer_time(self, param_bytes: int) -> float:
        return 0.0


def with_tensors(shape: str, n: int = 4, **kw):
    """The shape with a tensor on every forward output and backward input gradient."""
    probe = make_shape(shape, n, **kw)
    out = [TensorSpec((4096, 64), "float32")] * probe.num_segments
    return make_shape(shape, n, outputs=out, input_grads=out, **kw)


def starts_and_ends(schedule: Schedule, cost) -> dict:
    tl = simulate(lower(schedule), cost)
    out = {}
    for e in tl.events:
        if e.stream == "compute" and e.op in ("F", "B", "I", "W"):
            out[(e.micro_batch, e.op, e.segment)] = (e.start, e.end)
    return out


@pytest.mark.parametrize("shape", ["v", "x", "m", "nn", "k"])
def test_transfer_lags_equal_the_simulated_delays(shape):
    """One micro-batch run block by block: every consumer starts exactly its lag after its latest
    producer ends (the H100 table's NVLink/InfiniBand links), or at once where nothing crosses devices."""
    pl = with_tensors(shape, 4)
    cost = CostModel.for_device("h100")
    lags = transfer_lags(pl, cost.p2p_time)
    assert lags, "the shape sends tensors between devices"
    sched = gpipe_any(pl, 1)
    times = starts_and_ends(sched, cost)
    for i, b in enumerate(pl.blocks):
        if not b.deps:
            continue
        start = times[(0, b.kind, b.segment)][0]
        ready = max(times[(0, pl.blocks[a].kind, pl.blocks[a].segment)][1] + lags.get((a, i), 0.0) for a in b.deps)
        assert start == pytest.approx(ready, rel=1e-12, abs=1e-15), (shape, i)


def test_fan_out_to_an_all_device_block_is_serialised():
    """A single-device block feeding an all-device one sends to each other device in turn: the
    consumer waits for the last transfer (M on 4 devices: B1 on device 0 feeds B0 on all four)."""
    pl = with_tensors("m", 4)
    lags = transfer_lags(pl, FixedLink(0.5).p2p_time)
    b1 = next(i for i, b in enumerate(pl.blocks) if (b.kind, b.segment) == ("B", 1))
    b0 = next(i for i, b in enumerate(pl.blocks) if (b.kind, b.segment) == ("B", 0))
    assert lags[(b1, b0)] == pytest.approx(1.5)   # three sends of 0.5 from device 0


@pytest.mark.parametrize("shape,limit", [("v", None), ("v", 6), ("x", 6), ("k", None), ("nn", 9)])
def test_comm_aware_search_equals_its_simulation(shape, limit):
    """With transfers of 1 unit (F=1, B=2), the search's makespan is the simulated one, its own tick
    model (durations and lags, no queue of sends on a device) is never longer and within 5% of it
    (the improvement phase schedules in that model, where sends do not queue), and seeing the lags
    gives a schedule that is no longer in the simulator than the one a communication-blind search
    picks."""
    pl = with_tensors(shape, 4)
    comm = FixedLink(1.0)
    aware = tessel_search(pl, 16, memory_limit=limit, time_limit=5, comm=comm)
    simulated = simulate(lower(aware.schedule), comm).makespan
    assert aware.makespan == pytest.approx(simulated)
    assert 0.95 * simulated <= aware.solver_makespan <= simulated + 1e-9
    blind = tessel_search(pl, 16, memory_limit=limit, time_limit=5)
    assert aware.makespan <= simulate(lower(blind.schedule), comm).makespan + 1e-9
    assert blind.makespan < simulate(lower(blind.schedule), comm).makespan   # the blind search under-predicts
    assert aware.makespan_lower_bound <= aware.makespan + 1e-9


@pytest.mark.parametrize("shape,limit", [("v", 6), ("m", 6), ("x", None), ("k", None)])
def test_bound_with_lags_never_exceeds_a_simulated_schedule(shape, limit):
    pl = with_tensors(shape, 4)
    comm = FixedLink(0.5)
    lags = transfer_lags(pl, comm.p2p_time)
    for m in (4, 12):
        lb = makespan_lower_bound(pl, m, memory_limit=limit, lags=lags)
        assert lb >= makespan_lower_bound(pl, m, memory_limit=limit)
        for sched in (gpipe_any(pl, m), one_f_one_b_any(pl, m, memory_limit=limit)):
            tl = simulate(lower(sched), comm)
            if limit is None or max(tl.peak_memory()) <= limit:
                assert lb <= tl.makespan + 1e-9, (shape, m, sched.name)


def test_asap_makespan_with_tail_and_deadlock():
    pl = make_shape("v", 2)
    sched = one_f_one_b_any(pl, 2)
    index = {b.key: i for i, b in enumerate(pl.blocks)}
    orders = [[(blk.micro_batch, index[blk.key]) for blk in o] for o in sched.orders]
    durations = [1, 1, 2, 2]
    span = asap_makespan(pl, orders, durations)
    assert span == simulate(lower(sched)).makespan
    assert asap_makespan(pl, orders, durations, tail=[5, 0]) == span + 5   # device 0 ends last, then works 5
    with pytest.raises(ValueError, match="deadlock"):
        asap_makespan(pl, [list(reversed(orders[0])), orders[1]], durations)


def test_model_search_plan_makespan_is_the_plans():
    """``tessel search --model``: the search's makespan is the written plan's predicted one (its
    transfers, optimizer step and tied all-reduce included), and the search's own tick model agrees
    within the rounding of durations to ticks."""
    from engine.plan import model_search_plan, predicted_metrics

    sp = model_search_plan("gpt2-tiny", "v", 4, 8, time_limit=3)
    res = sp.result
    predicted = predicted_metrics(sp.plan)["makespan"]
    assert res.makespan == pytest.approx(predicted, rel=1e-12)
    assert sp.plan.metrics["makespan"] == pytest.approx(predicted, rel=1e-12)
    assert res.solver_makespan == pytest.approx(predicted, rel=0.02)
    assert res.makespan_lower_bound <= predicted
