"""Tied weights across pipeline ranks (GPT-2's wte / lm_head): detection, the tied ALLREDUCE
instruction before OPTIM, its simulation as a cross-rank barrier, and the plan JSON record."""

from __future__ import annotations

import json

import pytest

from engine.baselines import build_schedule
from engine.dependency import Instruction, TiedGroup, lower
from engine.errors import DeadlockError, PlanFormatError
from engine.io.plan import Plan, load_plan, save_plan
from engine.models import build_model
from engine.placement import pipeline_placement
from engine.plan import lower_plan, make_plan, resimulate
from engine.schedule import Block
from engine.simulate import simulate
from engine.transform import tied_parameter_groups


def _wte_bytes(name: str = "gpt2-tiny") -> int:
    p = dict(build_model(name).module.named_parameters())["transformer.wte.weight"]
    return p.numel() * p.element_size()


def _tied(stream):
    return [i for i in stream if i.op == "ALLREDUCE" and i.ranks]


@pytest.mark.parametrize("pp", [2, 4])
def test_first_and_last_rank_all_reduce_the_tied_gradient_before_the_step(pp):
    res = make_plan("gpt2-tiny", devices=pp, micro_batches=4, device_type="cpu")
    wte = _wte_bytes()
    assert res.plan.tied_weights == [{"members": [[0, "transformer.wte.weight"], [pp - 1, "lm_head.weight"]],
                                      "nbytes": wte}]
    for r, stream in enumerate(res.execution.streams):
        tied = _tied(stream)
        if r in (0, pp - 1):
            (ins,) = tied
            assert stream[-1].op == "OPTIM" and stream[-2] is ins   # just before the optimizer step
            assert ins.nbytes == wte and ins.ranks == (0, pp - 1) and ins.group == 2 and ins.segment is None
            assert str(ins) == f"ALLREDUCE tied weights with ranks 0,{pp - 1}"
            assert ins.to_dict() == {"op": "ALLREDUCE", "nbytes": wte, "group": 2, "ranks": [0, pp - 1]}
        else:
            assert tied == []
    ev = [e for e in res.timeline.events if e.name == "allreduce tied"]
    assert sorted(e.rank for e in ev) == [0, pp - 1]
    assert all(e.stream == "collective" and e.op == "ALLREDUCE" for e in ev)
    assert ev[0].start == ev[1].start and ev[0].end == ev[1].end > ev[0].start   # one collective, both ranks
    # the last stage holds its own copy: its parameter bytes count it (the graph counts it once, at wte)
    first_use = sum(res.graph.nodes[n].get("param_bytes", 0) for n in res.graph.nodes
                    if res.graph.nodes[n].get("layer") in res.plan.segments[-1]["layers"])
    assert res.plan.segments[-1]["param_bytes"] == first_use + wte


def test_no_tied_all_reduce_on_one_rank_or_without_tied_weights():
    one = make_plan("gpt2-tiny", devices=1, micro_batches=2, device_type="cpu")
    assert one.plan.tied_weights == [] and not _tied(one.execution.streams[0])
    # ZB-V's V shape puts segment 0 and the last segment on rank 0: two copies, no communication
    v = make_plan("gpt2-tiny", devices=2, micro_batches=4, schedule="zb-v", device_type="cpu")
    (g,) = v.plan.tied_weights
    assert [m[0] for m in g["members"]] == [0, 3]
    assert v.plan.placement.spec("F", 0).devices == v.plan.placement.spec("F", 3).devices == (0,)
    assert not any(_tied(s) for s in v.execution.streams)
    # llama-tiny does not tie its embeddings
    llama = make_plan("llama-tiny", devices=2, micro_batches=2, device_type="cpu")
    assert llama.plan.tied_weights == [] and not any(_tied(s) for s in llama.execution.streams)
    assert "tied_weights" not in llama.plan.to_dict()


def test_detection_from_named_parameters():
    m = build_model("gpt2-tiny").module
    groups = tied_parameter_groups(m, [["transformer.wte", "transformer.h.0"], ["transformer.h.1", "lm_head"]])
    assert groups == [TiedGroup(((0, "transformer.wte.weight"), (1, "lm_head.weight")), _wte_bytes())]
    assert tied_parameter_groups(m, [["transformer.wte", "transformer.h.0", "lm_head"]]) == []  # one copy


def test_data_parallel_keeps_one_tied_instruction_per_holder():
    res = make_plan("gpt2-tiny", devices=4, dp=2, micro_batches=4, device_type="cpu")
    for stream in res.execution.streams:
        (t,) = _tied(stream)
        dp_ar = [i for i in stream if i.op == "ALLREDUCE" and i.segment is not None]
        assert t.ranks == (0, 1) and len(dp_ar) == 1
        # Adam: the data-parallel all-reduce of the segment includes its tied copy's gradient
        assert dp_ar[0].nbytes == res.plan.segments[dp_ar[0].segment]["param_bytes"]
        assert stream.index(dp_ar[0]) < stream.index(t) < len(stream) - 1


class _Cost:
    """Collectives take ``coll`` seconds per all-reduce; everything else is free."""

    def __init__(self, coll: float = 2.0):
        self.coll = coll

    def p2p_time(self, nbytes, src, dst):
        return 0.0

    def collective_time(self, kind, nbytes, ranks):
        return self.coll if len(set(ranks)) > 1 else 0.0

    def optimizer_time(self, param_bytes):
        return 0.5


def _two_rank_streams(fast: float, slow: float, tied_on_1: bool = True):
    from engine.dependency import ExecutionPlan

    a, b = Block(0, "F", 0), Block(1, "F", 0)
    tied = Instruction("ALLREDUCE", None, nbytes=100, group=2, ranks=(0, 1))
    s0 = [Instruction("F", a, duration=fast), tied, Instruction("OPTIM", None, nbytes=10)]
    s1 = [Instruction("F", b, duration=slow)] + ([tied] if tied_on_1 else []) + [Instruction("OPTIM", None, nbytes=10)]
    return ExecutionPlan([s0, s1], [0, 0])


def test_simulated_barrier_waits_for_the_later_rank():
    tl = simulate(_two_rank_streams(1.0, 5.0), _Cost(2.0))
    ev = {e.rank: e for e in tl.events if e.name == "allreduce tied"}
    assert ev[0].start == ev[1].start == 5.0 and ev[0].end == ev[1].end == 7.0   # rank 0 waited 4 s
    optim = {e.rank: e for e in tl.events if e.op == "OPTIM"}
    assert optim[0].start == optim[1].start == 7.0
    assert tl.makespan == 7.5


def test_barrier_also_waits_for_pending_data_parallel_all_reduces():
    from engine.dependency import ExecutionPlan

    a, b = Block(0, "B", 0), Block(1, "B", 0)
    tied = Instruction("ALLREDUCE", None, nbytes=100, group=2, ranks=(0, 1))
    s0 = [Instruction("B", a, duration=1.0), Instruction("ALLREDUCE", None, nbytes=9, segment=0, group=2), tied,
          Instruction("OPTIM", None)]
    s1 = [Instruction("B", b, duration=2.0), tied, Instruction("OPTIM", None)]
    # dp=2: rank 0's DP all-reduce (group [0, 2]) runs 1 -> 3 asynchronously; the worker waits for it first
    tl = simulate(ExecutionPlan([s0, s1], [0, 0], dp=2), _Cost(2.0))
    ev = [e for e in tl.events if e.name == "allreduce tied"]
    assert {e.start for e in ev} == {3.0} and {e.end for e in ev} == {5.0}


def test_deadlock_names_the_rank_waiting_at_the_tied_all_reduce():
    with pytest.raises(DeadlockError) as err:
        simulate(_two_rank_streams(1.0, 5.0, tied_on_1=False), _Cost())
    assert err.value.waiting == {0: "ALLREDUCE tied weights with ranks 0,1"}
    assert "rank 0 waits at ALLREDUCE tied weights with ranks 0,1" in str(err.value)


def test_lower_emits_it_only_for_training_streams_of_holders():
    pl = pipeline_placement(3, forward=[1, 1, 1], backward=[2, 2, 2])
    g = TiedGroup(((0, "a.w"), (2, "b.w")), 64)
    ex = lower(build_schedule("1f1b", pl, 3), tied=[g])
    assert [len(_tied(s)) for s in ex.streams] == [1, 0, 1]
    assert not any(_tied(s) for s in lower(build_schedule("1f1b", pl, 3), tied=[g], optimizer=False).streams)
    # AdamA with dp: m and v of the folded parameters plus the tied gradient once
    ex = lower(build_schedule("1f1b", pl, 3), dp=2, segment_param_bytes={0: 1000, 1: 500, 2: 1000},
               optimizer_kind="adama", tied=[g])
    ar = {i.segment: i.nbytes for s in ex.streams for i in s if i.op == "ALLREDUCE" and i.segment is not None}
    assert ar == {0: 2 * (1000 - 64) + 64, 1: 1000, 2: 2 * (1000 - 64) + 64}
    assert [i.nbytes for s in ex.streams for i in _tied(s)] == [64, 64]


def test_plan_json_round_trip_and_old_plans(tmp_path):
    res = make_plan("gpt2-tiny", devices=2, micro_batches=4, device_type="cpu")
    back = load_plan(save_plan(res.plan, tmp_path / "plan.json"))
    assert back.tied_weights == res.plan.tied_weights
    assert [[i.to_dict() for i in s] for s in lower_plan(back).streams] == \
        [[i.to_dict() for i in s] for s in res.execution.streams]
    assert resimulate(back).makespan == pytest.approx(res.timeline.makespan)
    old = json.loads((tmp_path / "plan.json").read_text())
    del old["tied_weights"]
    plan = Plan.from_dict(old)
    assert plan.tied_weights == [] and not any(_tied(s) for s in lower_plan(plan).streams)
    assert resimulate(plan).makespan < res.timeline.makespan   # the tied all-reduce costs time
    bad = json.loads((tmp_path / "plan.json").read_text())
    bad["tied_weights"][0]["nbytes"] = "big"
    with pytest.raises(PlanFormatError, match=r"tied_weights\[0\]\.nbytes"):
        Plan.from_dict(bad)
    bad["tied_weights"][0] = {"members": [[0]], "nbytes": 4}
    with pytest.raises(PlanFormatError, match=r"tied_weights\[0\]\.members\[0\]"):
        Plan.from_dict(bad)
