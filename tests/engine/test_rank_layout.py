"""Ranks laid out as a cluster lays them out (issue 31, item 5): Megatron-LM's ``tp-dp-pp`` order,
the data-parallel all-reduce of a dp 8 x tp 8 plan timed over the inter-node link, and the same
groups in the simulator, the lowering, the runtime's process groups and the launcher's bundles."""

from __future__ import annotations

import json
from itertools import product
from pathlib import Path

import pytest

from engine.cost import CostModel, comm
from engine.errors import PlanFormatError, TransformError
from engine.io import Plan, load_plan
from engine.layout import DEFAULT_ORDER, LAYOUTS, LEGACY, WORLD_ORDER, RankLayout, world_devices
from engine.plan import make_plan
from engine.plan.lowering import lower_plan
from engine.plan.metrics import predict, predicted_metrics
from engine.simulate import SimState

DATA = Path(__file__).resolve().parents[1] / "data"


# ----------------------------------------------------------------------------- engine.layout
def test_megatron_docstring_example_16_gpus_tp2_pp4():
    """``megatron/core/parallel_state.py``, ``initialize_model_parallel``'s docstring: 16 GPUs,
    tensor 2, pipeline 4 (so data 2), groups copied from it."""
    lay = RankLayout(tp=2, dp=2, pp=4)
    assert lay.order == DEFAULT_ORDER == "tp-dp-pp"
    assert lay.groups("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert lay.groups("data") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert lay.groups("pipeline") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


@pytest.mark.parametrize("order", [o for o in LAYOUTS if o != LEGACY])
def test_device_ids_follow_the_order_and_invert(order):
    tp, dp, pp = 2, 3, 4
    lay = RankLayout(tp, dp, pp, order)
    size = {"tp": tp, "dp": dp, "pp": pp}
    dims = order.split("-")
    seen = set()
    for t, d, p in product(range(tp), range(dp), range(pp)):
        idx = {"tp": t, "dp": d, "pp": p}
        # the formula, written out: fastest dimension first
        expected = idx[dims[0]] + size[dims[0]] * (idx[dims[1]] + size[dims[1]] * idx[dims[2]])
        dev = lay.device(t, d, p)
        assert dev == expected and lay.coords(dev) == (t, d, p)
        seen.add(dev)
    assert seen == set(range(tp * dp * pp))
    for kind in ("tensor", "data", "pipeline"):   # every device in exactly one group of each kind
        flat = sorted(x for g in lay.groups(kind) for x in g)
        assert flat == list(range(tp * dp * pp))


def test_legacy_and_world_orders_are_the_old_formulas():
    legacy = RankLayout(tp=4, dp=3, pp=2, order=LEGACY)   # the old simulator: p + pp*d, tp folded
    assert [legacy.device(0, d, 1) for d in range(3)] == [1 + 2 * d for d in range(3)]
    world = RankLayout(tp=4, dp=3, pp=2, order=WORLD_ORDER)   # the runtime: (d*tp + t)*pp + p
    assert all(world.device(t, d, p) == (d * 4 + t) * 2 + p for t, d, p in product(range(4), range(3), range(2)))
    assert world_devices(4, 3, 2, LEGACY) == list(range(24))


def test_bad_layouts_are_refused_in_one_sentence():
    with pytest.raises(TransformError, match="unknown rank layout 'dp-tp'"):
        RankLayout(2, 2, 2, "dp-tp")
    with pytest.raises(TransformError, match="tp must be a positive integer"):
        RankLayout(0, 2, 2)
    with pytest.raises(TransformError, match="unknown group kind"):
        RankLayout(2, 2, 2).groups("expert")
    d = Plan.from_dict(json.loads((DATA / "plan_v1_gpt2_tiny_1f1b.json").read_text())).to_dict()
    d["parallel"]["layout"] = "tp-pp"
    with pytest.raises(PlanFormatError, match="parallel.layout"):
        Plan.from_dict(d)


# ----------------------------------------------------------------------------- dp 8 x tp 8 on nodes of 8
@pytest.fixture(scope="module")
def dp8_tp8():
    return make_plan("llama-tiny", devices=64, dp=8, tp=8, micro_batches=2, device_type="h100")


def _dp_allreduce(timeline):
    evs = [e for e in timeline.events if e.stream == "collective" and e.name.startswith("allreduce s")]
    assert len(evs) == 1
    return evs[0]


def test_dp8_tp8_gradient_allreduce_is_timed_over_the_inter_node_link(dp8_tp8, tmp_path):
    plan = dp8_tp8.plan
    assert plan.parallel.layout == "tp-dp-pp"
    cost = CostModel.from_dict(plan.cost)
    assert cost.devices_per_node == 8 and cost.inter_link.bandwidth < cost.intra_link.bandwidth
    ev = _dp_allreduce(dp8_tp8.timeline)
    real = [8 * d for d in range(8)]   # tensor rank 0 of each replica: device t + 8*d, one per node
    assert len({cost.node_of(r) for r in real}) == 8
    assert ev.end - ev.start == pytest.approx(cost.collective_time("allreduce", ev.nbytes, real), rel=1e-12)
    # ... which is a ring all-reduce of 8 over InfiniBand (engine.cost.comm, the alpha-beta model)
    assert ev.end - ev.start == pytest.approx(comm.collective_time("allreduce", ev.nbytes, 8, cost.inter_link),
                                              rel=1e-12)
    assert cost.inter_link.name == "infiniband"
    # the old grouping (r + k*n over the pipeline ranks: devices 0..7, one node, NVLink) was faster
    old = cost.collective_time("allreduce", ev.nbytes, list(range(8)))
    assert ev.end - ev.start > 2 * old
    # the same plan without parallel.layout is an older plan: it keeps its old (legacy) numbers
    d = plan.to_dict()
    del d["parallel"]["layout"]
    legacy = Plan.from_dict(d)
    assert legacy.parallel.layout == LEGACY and "layout" not in legacy.to_dict()["parallel"]
    tl, metrics = predict(legacy)
    lev = _dp_allreduce(tl)
    assert lev.end - lev.start == pytest.approx(old, rel=1e-12)
    assert metrics["makespan"] < plan.metrics["makespan"]


# ----------------------------------------------------------------------------- one layout everywhere
@pytest.fixture(scope="module")
def dp2_tp2_pp2():
    return make_plan("llama-tiny", devices=8, dp=2, tp=2, micro_batches=4, device_type="h100").plan


def _recorded_runtime_groups(monkeypatch, *, tp, dp, pp, rank, seg_rank, pair_orders):
    """``build_groups``'s groups for one world rank, with ``dist.new_group`` recording its ranks."""
    from runtime.worker import groups as G

    made: list[list[int]] = []

    def new_group(ranks):
        made.append(list(ranks))
        return tuple(ranks)

    monkeypatch.setattr(G.dist, "new_group", new_group)
    monkeypatch.setattr(G.DeviceMesh, "from_group", staticmethod(lambda g, *a, **k: g))
    out = G.build_groups(rank=rank, pp=pp, dp=dp, expert_parallel=False, tied=[], seg_rank=seg_rank,
                         pair_orders=pair_orders, tp=tp)
    return out, made


def test_dp2_tp2_pp2_groups_agree_between_simulator_lowering_and_runtime(dp2_tp2_pp2, monkeypatch):
    pytest.importorskip("ray")
    from runtime.cluster import rank_bundles

    plan = dp2_tp2_pp2
    par = plan.parallel
    tp, dp, pp = par.tp, par.dp, par.pp
    assert (tp, dp, pp) == (2, 2, 2) and par.layout == DEFAULT_ORDER
    lay = RankLayout(tp, dp, pp, par.layout)
    # the lowering records the layout, and its device groups are the layout's
    ex = lower_plan(plan)
    assert (ex.layout, ex.tp, ex.dp, ex.num_ranks) == (par.layout, tp, dp, pp)
    sim = SimState.start(ex, CostModel.from_dict(plan.cost))
    for r in range(pp):
        dev = lay.device(0, 0, r)
        assert ex.device_of(r) == sim.device(r) == dev == 4 * r
        assert ex.device_group("data", r) == sim.dp_group(r) == lay.group_of("data", dev) == [4 * r, 4 * r + 2]
        assert ex.device_group("tensor", r) == lay.group_of("tensor", dev) == [4 * r, 4 * r + 1]
    # the runtime's groups (world ranks), on the devices the launcher gives them, are the layout's
    devices = world_devices(tp, dp, pp, par.layout)
    seg_rank = {0: 0, 1: 1}
    groups, made = _recorded_runtime_groups(monkeypatch, tp=tp, dp=dp, pp=pp, rank=0, seg_rank=seg_rank,
                                            pair_orders={(0, 1): [], (1, 0): []})
    as_devices = sorted(sorted(devices[w] for w in g) for g in made)
    expected = sorted([g for g in lay.groups("data")] + [g for g in lay.groups("tensor")]
                      + [[lay.device(t, d, a), lay.device(t, d, b)] for t in range(tp) for d in range(dp)
                         for a, b in ((0, 1), (1, 0))])
    assert as_devices == sorted(sorted(g) for g in expected)
    assert sorted(devices[w] for w in groups.dp) == sim.dp_group(0)   # world rank 0 is device 0
    # the launcher: bundles numbered node by node, rank w on the bundle of its device, so each
    # tensor group (and here each pipeline stage's 4 devices) shares a node of 4
    nodes = {b: ("n1" if b % 2 else "n0") for b in range(8)}   # Ray interleaved the bundles
    bundles = rank_bundles(8, nodes, devices)
    for g in lay.groups("tensor"):
        world = [devices.index(x) for x in g]
        assert len({nodes[bundles[w]] for w in world}) == 1
    assert [nodes[bundles[devices.index(x)]] for x in range(8)] == ["n0"] * 4 + ["n1"] * 4


def test_gantt_rows_name_pp_dp_tp(dp2_tp2_pp2):
    from planner_ui.sources import row_labels

    par = dp2_tp2_pp2.parallel
    labels = row_labels(2, tp=par.tp, dp=par.dp, layout=par.layout)
    assert labels == {0: "pp 0 · dp 0 · tp 0-1 (devices 0-1)", 1: "pp 1 · dp 0 · tp 0-1 (devices 4-5)"}
    assert row_labels(3) == {i: f"device {i}" for i in range(3)}


# ----------------------------------------------------------------------------- older plans
@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("plan_v1_*.json")))
def test_older_plans_load_legacy_and_predict_their_recorded_metrics(name):
    text = (DATA / name).read_text()
    plan = load_plan(DATA / name)
    assert plan.parallel.layout == LEGACY
    assert json.loads(json.dumps(plan.to_dict())) == json.loads(text)   # re-saved identically
    if not plan.metrics.get("makespan") or "search" in name:
        return   # a search plan records the search's own makespan, not the simulator's (as before)
    now = predicted_metrics(plan)
    for key in ("makespan", "bubble_ratio", "peak_memory", "tokens_per_second"):
        assert now[key] == pytest.approx(plan.metrics[key], rel=1e-9), key
