"""MoE expert parallelism in the planning engine: ALLTOALL instructions, their bytes, their
simulated cost, the plan JSON record and the CLI summary."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine.cost import CostModel
from engine.errors import PlanFormatError, TransformError
from engine.io import timeline_to_trace
from engine.io.plan import Plan, load_plan, save_plan
from engine.models.moe import DTSGate, MoEFeedForward, SwitchGate, Top2Gate
from engine.models.moe.comm import (
    MoELayer,
    all_to_all_bytes,
    find_moe_layers,
    gate_capacity,
    moe_segment_collectives,
    segment_moe_layers,
)
from engine.plan import lower_plan, make_plan, resimulate
from engine.simulate import simulate

# gpt-moe-tiny: hidden 64, 4 experts in blocks 1 and 3, Switch capacity factor 1.25, 128 tokens
HIDDEN, E, TOKENS = 64, 4, 128


@pytest.fixture(scope="module")
def pp2_dp2():
    """pp=2 (one MoE layer per segment), dp=2, 1F1B, 4 micro-batches, CPU cost table."""
    return make_plan("gpt-moe-tiny", devices=4, dp=2, micro_batches=4, device_type="cpu")


@pytest.fixture(scope="module")
def pp1_dp2():
    """One rank, one segment holding both MoE layers, dp=2."""
    return make_plan("gpt-moe-tiny", devices=2, dp=2, micro_batches=3, device_type="cpu")


def _blocks_and_a2a(stream):
    """For each ALLTOALL: (index of the last non-ALLTOALL instruction before it, that instruction)."""
    out = []
    last = None
    for _i, ins in enumerate(stream):
        if ins.op == "ALLTOALL":
            out.append((ins, last))
        else:
            last = ins
    return out


def test_bytes_match_the_runtime_formula_for_a_hand_computed_case():
    from runtime.expert_parallel import all_to_all_bytes as runtime_bytes

    # E=4 experts, C=40 slots (ceil(1.25 * 128 / 4)), hidden 64, float32: 4*40*64*4 bytes per rank
    ours = all_to_all_bytes(4, 40, 64, 2, 4)
    assert ours["bytes_total"] == 40960 and ours["bytes"] == 20480 and ours["per_layer_step"] == 4 * 20480
    for args in [(4, 40, 64, 2, 4), (8, 7, 32, 4, 2), (6, 3, 16, 3, 4)]:
        assert all_to_all_bytes(*args) == runtime_bytes(*args)
    with pytest.raises(ValueError, match="cannot be split evenly"):
        all_to_all_bytes(4, 40, 64, 3)


def test_capacity_is_what_each_gate_allocates():
    torch.manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN)
    cases = [
        (SwitchGate(HIDDEN, E, capacity_factor=1.25), math.ceil(1.25 * TOKENS / E)),        # 40
        (Top2Gate(HIDDEN, E, capacity_factor=1.25), math.ceil(1.25 * 2 * TOKENS / E)),      # 80
        (DTSGate(HIDDEN, E), TOKENS),                                                       # dense: no dropping
        (DTSGate(HIDDEN, E, H=0, sparse_capacity_factor=1.0), TOKENS // E),                 # sparse phase
        (SwitchGate(HIDDEN, E, capacity_factor=None), TOKENS),
    ]
    for gate, expected in cases:
        assert gate_capacity(gate, TOKENS) == expected
        assert gate(x).capacity == expected  # the gate's own routing allocates exactly that
    # and the layer's dispatch tensor per rank is [E, C, hidden]
    layer = MoEFeedForward(HIDDEN, 4 * HIDDEN, E, gate="top2")
    layer(x.reshape(2, 64, HIDDEN))
    assert tuple(layer.last_gate_output.dispatch.shape) == (TOKENS, E, 80)
    found = find_moe_layers(torch.nn.Sequential(layer), TOKENS)
    assert [(m.path, m.num_experts, m.capacity, m.hidden, m.gate) for m in found] == [("0", E, 80, HIDDEN, "top2")]
    assert found[0].expert_param_bytes == sum(p.numel() * 4 for p in layer.experts.parameters())


def test_collectives_order_per_block_kind():
    a = MoELayer("h.1.mlp", 4, 10, 8)   # 4*10*8*4 = 1280 bytes
    b = MoELayer("h.3.mlp", 4, 20, 8)   # 2560 bytes
    assert moe_segment_collectives([a, b], 2, "F") == [1280, 1280, 2560, 2560]   # layer order: dispatch, combine
    assert moe_segment_collectives([a, b], 2, "B") == [2560, 2560, 1280, 1280]   # reverse: combine-grad, dispatch-grad
    assert moe_segment_collectives([a, b], 2, "I") == moe_segment_collectives([a, b], 2, "B")
    assert moe_segment_collectives([a, b], 2, "W") == []
    assert moe_segment_collectives([a, b], 1, "F") == []
    segs = segment_moe_layers([a, b], [["emb", "h.0", "h.1"], ["h.2", "h.3", "head"]])
    assert segs == {0: [a], 1: [b]}


def test_alltoalls_follow_each_forward_and_backward(pp2_dp2):
    res = pp2_dp2
    C = math.ceil(1.25 * TOKENS / E)
    nbytes = all_to_all_bytes(E, C, HIDDEN, 2)["bytes_total"]
    assert [s["moe"][0]["path"] for s in res.plan.segments] == ["transformer.h.1.mlp", "transformer.h.3.mlp"]
    for r, stream in enumerate(res.execution.streams):
        pairs = _blocks_and_a2a(stream)
        computes = [i for i in stream if i.op in ("F", "B")]
        assert len(pairs) == 2 * len(computes) == 2 * 8  # 4 F + 4 B, one MoE layer: 2 each
        for ins, owner in pairs:
            assert owner.op in ("F", "B") and ins.block == owner.block   # right after its own block
            assert ins.segment == owner.block.segment == r and ins.group == 2 and ins.nbytes == nbytes
            assert ins.to_dict() == {"op": "ALLTOALL", "block": str(owner.block), "nbytes": nbytes,
                                     "segment": r, "group": 2}
        # immediately after: the next instruction after a compute block is its first ALLTOALL
        for i, ins in enumerate(stream):
            if ins.op in ("F", "B"):
                assert [x.op for x in stream[i + 1:i + 3]] == ["ALLTOALL", "ALLTOALL"]
                assert i + 3 >= len(stream) or stream[i + 3].op != "ALLTOALL"
    assert str(next(i for i in res.execution.streams[0] if i.op == "ALLTOALL")).startswith("ALLTOALL 0F0")


def test_one_segment_with_two_layers_gets_four_per_block(pp1_dp2):
    (stream,) = pp1_dp2.execution.streams
    counts = {}
    owner = None
    for ins in stream:
        if ins.op in ("F", "B"):
            owner = ins.block
            counts[owner] = 0
        elif ins.op == "ALLTOALL":
            counts[owner] += 1
    assert len(counts) == 6 and set(counts.values()) == {4}


def test_dp1_has_no_alltoall_and_bad_dp_is_refused():
    one = make_plan("gpt-moe-tiny", devices=2, dp=1, micro_batches=2, device_type="cpu")
    assert not any(i.op == "ALLTOALL" for s in one.execution.streams for i in s)
    assert one.plan.segments[0]["moe"][0]["num_experts"] == E   # recorded, but all experts local
    with pytest.raises(TransformError) as err:
        make_plan("gpt-moe-tiny", devices=3, dp=3, micro_batches=2, device_type="cpu")
    msg = str(err.value)
    assert "gpt-moe-tiny" in msg and "4 experts" in msg and "dp=3" in msg and "{1, 2, 4}" in msg


def test_experts_are_split_over_the_replicas(pp2_dp2):
    one = make_plan("gpt-moe-tiny", devices=2, dp=1, micro_batches=4, device_type="cpu")
    for s1, s2 in zip(one.plan.segments, pp2_dp2.plan.segments):
        experts = s1["moe"][0]["expert_param_bytes"]
        assert s1["param_bytes"] - s2["param_bytes"] == experts // 2   # each replica holds E/dp experts
    # the data-parallel all-reduce moves only the replicated parameters (experts are owned)
    for r, stream in enumerate(pp2_dp2.execution.streams):
        (ar,) = [i for i in stream if i.op == "ALLREDUCE" and i.segment is not None]
        seg = pp2_dp2.plan.segments[r]
        assert ar.nbytes == seg["param_bytes"] - seg["moe"][0]["expert_param_bytes"] // 2


def test_simulated_time_grows_exactly_by_the_alltoalls_on_one_rank(pp1_dp2):
    res = pp1_dp2
    cost = CostModel.from_dict(res.plan.cost)
    free = simulate(lower_plan(res.plan), _FreeAllToAll(cost))
    a2a = [e for e in res.timeline.events if e.op == "ALLTOALL"]
    assert len(a2a) == 6 * 4 and all(e.stream == "collective" for e in a2a)
    each = cost.collective_time("alltoall", a2a[0].nbytes, [0, 1])   # the dp group of rank 0: ranks 0 and 1
    assert each > 0 and all(e.duration == pytest.approx(each) for e in a2a)
    assert a2a[0].name == "a2a 0F0" and a2a[0].micro_batch == 0 and a2a[0].segment == 0
    # blocking on the compute path of the only rank: the step is longer by exactly their sum
    assert res.timeline.makespan - free.makespan == pytest.approx(sum(e.duration for e in a2a), rel=1e-9)
    # and no compute block overlaps an all-to-all of its rank
    comp = [e for e in res.timeline.events if e.stream == "compute"]
    assert not any(c.start < a.end - 1e-15 and a.start < c.end - 1e-15 for c in comp for a in a2a)


class _FreeAllToAll:
    """The plan's cost model with free all-to-alls."""

    def __init__(self, cost):
        self.cost = cost

    def p2p_time(self, nbytes, src, dst):
        return self.cost.p2p_time(nbytes, src, dst)

    def collective_time(self, kind, nbytes, ranks):
        return 0.0 if kind == "alltoall" else self.cost.collective_time(kind, nbytes, ranks)

    def optimizer_time(self, param_bytes):
        return self.cost.optimizer_time(param_bytes)


def test_pipeline_makespan_grows_with_alltoall(pp2_dp2):
    cost = CostModel.from_dict(pp2_dp2.plan.cost)
    free = simulate(lower_plan(pp2_dp2.plan), _FreeAllToAll(cost))
    assert pp2_dp2.timeline.makespan > free.makespan
    assert pp2_dp2.timeline.makespan == pytest.approx(resimulate(pp2_dp2.plan).makespan)


def test_split_backward_puts_them_on_I_not_W():
    """With I/W split, the backward all-to-alls belong to I, except on the segment fed only by
    the model's input (token ids): its I has no input gradient, so W runs its whole backward
    (as runtime.worker does)."""
    res = make_plan("gpt-moe-tiny", devices=4, dp=2, micro_batches=4, schedule="zb-h1", device_type="cpu")
    segments = [{ins.block.segment for ins in stream if ins.op == "F"} for stream in res.execution.streams]
    assert segments == [{0}, {1}]
    for stream, expected in zip(res.execution.streams, ({"F", "W"}, {"F", "I"})):
        owners = {ins.block.kind for ins, _ in _blocks_and_a2a(stream)}
        assert owners == expected
        assert all(owner.op == ins.block.kind for ins, owner in _blocks_and_a2a(stream))


def test_plan_json_round_trip_and_old_plans(pp2_dp2, tmp_path):
    path = save_plan(pp2_dp2.plan, tmp_path / "plan.json")
    back = load_plan(path)
    assert [s["moe"] for s in back.segments] == [s["moe"] for s in pp2_dp2.plan.segments]
    again = lower_plan(back)
    assert [[i.to_dict() for i in s] for s in again.streams] == \
        [[i.to_dict() for i in s] for s in pp2_dp2.execution.streams]
    assert resimulate(back).makespan == pytest.approx(pp2_dp2.timeline.makespan)
    # a plan written before the MoE record: loads, lowers with no all-to-all
    old = json.loads(path.read_text())
    for s in old["segments"]:
        del s["moe"]
    plan = Plan.from_dict(old)
    assert not any(i.op == "ALLTOALL" for s in lower_plan(plan).streams for i in s)
    assert resimulate(plan).makespan < pp2_dp2.timeline.makespan
    # a malformed record names its field
    bad = json.loads(path.read_text())
    del bad["segments"][1]["moe"][0]["capacity"]
    with pytest.raises(PlanFormatError, match=r"segments\[1\]\.moe\[0\]\.capacity"):
        Plan.from_dict(bad)


def test_perfetto_trace_has_the_alltoalls(pp2_dp2):
    tr = timeline_to_trace(pp2_dp2.timeline)
    a2a = [e for e in tr["traceEvents"] if e.get("cat") == "ALLTOALL"]
    n = sum(1 for e in pp2_dp2.timeline.events if e.op == "ALLTOALL")
    assert len(a2a) == n > 0
    tid = {e["tid"] for e in a2a}
    assert len(tid) == 1
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in tr["traceEvents"] if e.get("name") == "thread_name"}
    assert names[(0, tid.pop())] == "all-to-all"
    assert all(e["dur"] > 0 and e["args"]["bytes"] > 0 for e in a2a)
    json.dumps(tr)


def test_cli_plans_and_prints_the_alltoalls(tmp_path, capsys):
    from apps.cli import main

    assert main(["plan", "--model", "gpt-moe-tiny", "--devices", "4", "--dp", "2", "--micro-batches", "4",
                 "--device-type", "cpu", "-o", str(tmp_path), "--json"]) == 0
    out = capsys.readouterr().out
    assert "expert parallelism (ep = dp = 2): 16 all-to-alls per pipeline rank per step" in out
    assert "tied weights: transformer.wte.weight (segment 0) + lm_head.weight (segment 1)" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["alltoalls"] == [16, 16]
    plan = load_plan(tmp_path / "plan.json")
    assert all(s["moe"] for s in plan.segments)
