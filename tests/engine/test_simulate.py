"""Dependency lowering (SuperScaler phase 3) and the discrete-event simulator."""

from __future__ import annotations

import pytest

from engine.dependency import ExecutionPlan, Instruction, lower
from engine.errors import DeadlockError
from engine.placement import BlockSpec, Placement, TensorSpec, pipeline_placement
from engine.schedule import Block, Schedule
from engine.simulate import simulate

ACT = TensorSpec((2, 16, 32), "float32")  # [micro_batch, seq, hidden]


def gpipe_orders(n, m):
    return [[Block(d, "F", i) for i in range(m)] + [Block(d, "B", i) for i in range(m)] for d in range(n)]


class LinearComm:
    """p2p: 1 s + bytes * 1e-6 s; all-reduce: 0.5 s; optimizer 0.25 s."""

    def p2p_time(self, nbytes, src, dst):
        return 1.0 + nbytes * 1e-6

    def collective_time(self, kind, nbytes, ranks):
        assert kind == "allreduce"
        return 0.5 if len(ranks) > 1 else 0.0

    def optimizer_time(self, nbytes):
        return 0.25


def test_lowering_inserts_send_recv_with_static_shapes():
    pl = pipeline_placement(2, outputs=[ACT, None], input_grads=[None, ACT])
    ex = lower(Schedule(pl, 2, gpipe_orders(2, 2)))
    r0 = [str(i) for i in ex.streams[0]]
    r1 = [str(i) for i in ex.streams[1]]
    assert r0 == ["0F0", "SEND 0F0 to 1", "0F1", "SEND 0F1 to 1", "RECV 1B0 from 1", "0B0", "RECV 1B1 from 1", "0B1",
                  "OPTIM step"]
    assert r1 == ["RECV 0F0 from 0", "1F0", "RECV 0F1 from 0", "1F1", "1B0", "SEND 1B0 to 0", "1B1", "SEND 1B1 to 0",
                  "OPTIM step"]
    sends = [i for i in ex.streams[0] if i.op == "SEND"]
    assert all(i.tensor == ACT and i.nbytes == 2 * 16 * 32 * 4 for i in sends)


def test_gpipe_makespan_and_bubble_match_closed_form():
    n, m = 4, 8
    pl = pipeline_placement(n, forward=1.0, backward=2.0)
    tl = simulate(lower(Schedule(pl, m, gpipe_orders(n, m))))
    assert tl.makespan == pytest.approx((m + n - 1) * 3.0)
    assert tl.bubble_ratio() == pytest.approx((n - 1) / (m + n - 1))


def test_transfer_time_delays_the_receiver():
    pl = pipeline_placement(2, forward=1.0, backward=2.0, outputs=[ACT, None], input_grads=[None, ACT])
    tl = simulate(lower(Schedule(pl, 1, gpipe_orders(2, 1))), LinearComm())
    f1 = next(e for e in tl.events if e.name == "1F0")
    comm = 1.0 + ACT.nbytes * 1e-6
    assert f1.start == pytest.approx(1.0 + comm)
    # F0 1 + comm + F1 1 + B1 2 + comm + B0 2 + optimizer 0.25
    assert tl.makespan == pytest.approx(6.25 + 2 * comm)


def test_dp_allreduce_runs_after_last_backward_and_gates_optimizer():
    pl = pipeline_placement(1, forward=1.0, backward=2.0)
    ex = lower(Schedule(pl, 2, gpipe_orders(1, 2)), dp=2, segment_param_bytes={0: 1000})
    ops = [i.op for i in ex.streams[0]]
    assert ops == ["F", "F", "B", "B", "ALLREDUCE", "OPTIM"]
    tl = simulate(ex, LinearComm())
    ar = next(e for e in tl.events if e.op == "ALLREDUCE")
    opt = next(e for e in tl.events if e.op == "OPTIM")
    assert ar.start == pytest.approx(6.0) and opt.start == pytest.approx(6.5)


def test_memory_curve_follows_activations():
    pl = pipeline_placement(1, activation_bytes=100, static_memory=[1000])
    tl = simulate(lower(Schedule(pl, 3, gpipe_orders(1, 3))))
    assert tl.peak_memory() == [1300]
    assert tl.memory[0][-1][1] == 1000  # everything freed at the end


def test_multi_device_block_occupies_all_devices_at_once():
    # an all-device block (e.g. shared embedding) then a per-device chain
    blocks = (
        BlockSpec("F", 0, (0, 1), 1.0),
        BlockSpec("F", 1, (1,), 1.0, deps=(0,), output=ACT),
        BlockSpec("B", 1, (1,), 2.0, deps=(1,)),
        BlockSpec("B", 0, (0, 1), 2.0, deps=(2,)),
    )
    pl = Placement(2, blocks, name="M-like")
    orders = [[Block(0, "F", 0), Block(0, "B", 0)],
              [Block(0, "F", 0), Block(1, "F", 0), Block(1, "B", 0), Block(0, "B", 0)]]
    s = Schedule(pl, 1, orders)
    s.validate()
    tl = simulate(lower(s))
    b0 = [e for e in tl.events if e.name == "0B0"]
    assert len(b0) == 2 and {e.rank for e in b0} == {0, 1}
    assert b0[0].start == b0[1].start == pytest.approx(4.0)


def test_deadlock_names_waiting_ranks():
    a = Block(0, "F", 0)
    b = Block(1, "F", 0)
    streams = [
        [Instruction("RECV", b, peer=1), Instruction("F", a, duration=1.0), Instruction("SEND", a, peer=1)],
        [Instruction("RECV", a, peer=0), Instruction("F", b, duration=1.0), Instruction("SEND", b, peer=0)],
    ]
    with pytest.raises(DeadlockError) as ei:
        simulate(ExecutionPlan(streams, [0, 0]))
    assert set(ei.value.waiting) == {0, 1}
    assert "rank 0 waits at RECV 1F0 from 1" in str(ei.value)


def test_forward_only_memory_does_not_grow_with_micro_batches():
    pl = pipeline_placement(2, activation_bytes=100, forward_only=True, static_memory=[10, 10])
    orders = [[Block(d, "F", i) for i in range(8)] for d in range(2)]
    tl = simulate(lower(Schedule(pl, 8, orders)))
    assert tl.peak_memory() == [10, 10]
