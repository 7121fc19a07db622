"""The shapes of the Tessel authors' reference cases: MLLM, finetune and AlphaFold recycling.

Their chains (devices, dependencies, memory, which segments have a backward), the registry and
model-part decisions, the makespan lower bound and memory floor against real schedules (GPipe and
1F1B policies, simulated), and a short Tessel search per shape.
"""

from __future__ import annotations

import random

import pytest

from engine.baselines.generic import gpipe_any, one_f_one_b_any
from engine.errors import PlacementError, TesselError
from engine.io.placement_json import placement_from_dict, placement_to_dict
from engine.placement import Placement, TensorSpec
from engine.plan import measure
from engine.shapes import (
    SHAPES,
    alphafold_shape,
    finetune_shape,
    m_model_shape,
    m_shape,
    make_shape,
    mllm_shape,
    shape_names,
    v_shape,
)
from engine.tessel import tessel_search
from engine.tessel.bounds import makespan_lower_bound, memory_floor

NEW = ("mllm", "finetune", "alphafold")


def n_segments(shape: str, n: int) -> int:
    return {"mllm": n + 2, "finetune": n + 1, "alphafold": 3 * n}[shape]


def trained(shape: str, n: int) -> set[int]:
    """The segments with a backward (default arguments)."""
    return {"mllm": set(range(n + 2)), "finetune": set(range(1, n + 1)),
            "alphafold": set(range(2 * n, 3 * n))}[shape]


def chain(pl: Placement) -> list[tuple[str, tuple[int, ...], int, tuple[str, ...]]]:
    """Every block as ``(name, devices, memory, dep names)``, in placement order."""
    name = [f"{b.segment}{b.kind}" for b in pl.blocks]
    return [(name[i], b.devices, b.memory, tuple(name[d] for d in b.deps)) for i, b in enumerate(pl.blocks)]


ALL4 = (0, 1, 2, 3)


# ------------------------------------------------------------------ chains on 4 devices
def test_mllm_chain_on_four_devices():
    assert chain(mllm_shape(4)) == [
        ("0F", ALL4, 1, ()), ("1F", (0,), 1, ("0F",)), ("2F", (1,), 1, ("1F",)), ("3F", (2,), 1, ("2F",)),
        ("4F", (3,), 1, ("3F",)), ("5F", ALL4, 1, ("4F",)),
        ("5B", ALL4, -1, ("5F",)), ("4B", (3,), -1, ("5B",)), ("3B", (2,), -1, ("4B",)), ("2B", (1,), -1, ("3B",)),
        ("1B", (0,), -1, ("2B",)), ("0B", ALL4, -1, ("1B",)),
    ]


def test_finetune_chain_on_four_devices():
    assert chain(finetune_shape(4)) == [
        ("0F", ALL4, 0, ()), ("1F", (0,), 1, ("0F",)), ("2F", (1,), 1, ("1F",)), ("3F", (2,), 1, ("2F",)),
        ("4F", (3,), 1, ("3F",)),
        ("4B", (3,), -1, ("4F",)), ("3B", (2,), -1, ("4B",)), ("2B", (1,), -1, ("3B",)), ("1B", (0,), -1, ("2B",)),
    ]


def test_alphafold_chain_on_four_devices():
    fwd = [(f"{s}F", (s % 4,), 0 if s < 8 else 1, (f"{s - 1}F",) if s else ()) for s in range(12)]
    bwd = [("11B", (3,), -1, ("11F",)), ("10B", (2,), -1, ("11B",)), ("9B", (1,), -1, ("10B",)),
           ("8B", (0,), -1, ("9B",))]
    assert chain(alphafold_shape(4)) == fwd + bwd


# ------------------------------------------------------------------ every device count
@pytest.mark.parametrize("shape", NEW)
@pytest.mark.parametrize("n", [2, 3, 4, 8, 16, 32])
def test_structure_on_any_device_count(shape, n):
    pl = make_shape(shape, n)
    assert pl.num_devices == n and pl.num_segments == n_segments(shape, n)
    assert {b.segment for b in pl.blocks if b.kind == "B"} == trained(shape, n)
    assert {b.kind for b in pl.blocks} == {"F", "B"}
    for i, b in enumerate(pl.blocks):
        assert all(d < i for d in b.deps)                          # listed in a topological order
        assert b.devices == pl.spec("F", b.segment).devices        # a backward runs where its forward ran
        if b.kind == "F":
            assert b.memory == (1 if b.segment in trained(shape, n) else 0)
    busy = {"mllm": 9.0, "finetune": 4.0, "alphafold": 5.0}[shape]
    for d in range(n):
        assert sum(pl.blocks[i].memory for i in pl.blocks_on(d)) == 0
        assert pl.busy_time(d) == pytest.approx(busy)
    # one forward chain through every segment (one model replica, one data micro-batch per instance)
    assert pl.chains() == [list(range(n_segments(shape, n)))]
    # segments without a backward survive the placement JSON form
    assert placement_from_dict(placement_to_dict(pl)) == pl and pl.data_per_instance == 1


@pytest.mark.parametrize("shape", NEW)
@pytest.mark.parametrize("n", [2, 5])
def test_split_backward_and_forward_only(shape, n):
    pl = make_shape(shape, n, split_backward=True, activation=4, weight_grad_fraction=0.25)
    assert pl.split_backward
    assert {b.segment for b in pl.blocks if b.kind == "I"} == {b.segment for b in pl.blocks if b.kind == "W"} \
        == trained(shape, n)
    for s in trained(shape, n):
        i, w = pl.spec("I", s), pl.spec("W", s)
        assert (i.memory, w.memory) == (-3, -1) and w.deps == (pl.index("I", s),)
        assert i.duration == pytest.approx(1.5) and w.duration == pytest.approx(0.5)
    for d in range(n):
        assert sum(pl.blocks[i].memory for i in pl.blocks_on(d)) == 0
    inf = make_shape(shape, n, forward_only=True)
    assert inf.forward_only and inf.num_segments == n_segments(shape, n)
    assert all(b.memory == 0 for b in inf.blocks)
    # the forward chain is the training one's
    train_f = [(b.segment, b.devices, b.deps) for b in make_shape(shape, n).blocks if b.kind == "F"]
    assert [(b.segment, b.devices, b.deps) for b in inf.blocks] == train_f


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("forward_only", [False, True])
def test_mllm_is_the_model_aware_m_chain_under_its_own_name(split, forward_only):
    for n in (2, 4, 8, 16, 32):
        pl = mllm_shape(n, split_backward=split, forward_only=forward_only)
        ref = m_model_shape(n, split_backward=split, forward_only=forward_only)
        assert pl.name == "MLLM" and ref.name == "M"
        assert pl.blocks == ref.blocks
    with pytest.raises(PlacementError, match=r"forward_times has 5 values but the MLLM shape on 4 devices has 6"):
        mllm_shape(4, forward_times=[1] * 5)


def test_frozen_segments_keep_no_activation_and_get_no_gradient():
    t = TensorSpec((2, 8), "float16")
    pl = finetune_shape(3, activation_bytes=[7, 1, 2, 3], input_grads=[t] * 4, outputs=[t] * 4)
    assert pl.spec("F", 0).memory == 0 and not pl.has("B", 0)
    assert [pl.spec("F", s).memory for s in (1, 2, 3)] == [1, 2, 3]
    assert pl.spec("F", 0).output == t                      # the frozen block still sends its activation on
    assert pl.spec("B", 1).output is None and pl.spec("B", 2).output == t   # nothing upstream needs 1B's gradient
    af = alphafold_shape(2, recycles=1, input_grads=[t] * 4)
    assert af.spec("B", 2).output is None and af.spec("B", 3).output == t
    assert not af.has("B", 0) and not af.has("B", 1)
    # the frozen-segment parameter of the shared builder is not reachable through a shape's keywords
    for build in (m_shape, mllm_shape, finetune_shape):
        with pytest.raises(TypeError):
            build(4, frozen=[0])


def test_alphafold_recycles():
    assert alphafold_shape(4, recycles=0).blocks == v_shape(4).blocks
    assert alphafold_shape(4).blocks == alphafold_shape(4, recycles=2).blocks
    for r in (1, 3):
        pl = make_shape("alphafold", 3, recycles=r)
        assert pl.num_segments == 3 * (r + 1)
        assert {b.segment for b in pl.blocks if b.kind == "B"} == set(range(3 * r, 3 * r + 3))
        assert pl.spec("F", 3 * r).deps == (pl.index("F", 3 * r - 1),)   # each pass starts from the previous one
    for bad in (-1, 1.5, True, "2", None):
        with pytest.raises(PlacementError, match=r"recycles must be an integer of at least 0 .*got"):
            alphafold_shape(4, recycles=bad)
    with pytest.raises(PlacementError, match=r"recycles=40,000 on 2 devices has 80,002 segments; at most 65,536"):
        alphafold_shape(2, recycles=40_000)
    with pytest.raises(PlacementError, match=r"activation_bytes has 4 values but the alphafold shape on 4 devices "
                                             r"has 12 segments"):
        alphafold_shape(4, activation_bytes=[1] * 4)


# ------------------------------------------------------------------ registry
def test_registry_names_and_model_parts():
    assert shape_names()[-3:] == list(NEW)
    for name, want in [("MLLM", "MLLM"), ("mllm-shape", "MLLM"), ("Fine_Tune", "finetune"),
                       ("AlphaFold", "alphafold"), ("alphafold shape", "alphafold")]:
        assert make_shape(name, 4).name == want
    assert make_shape("alphafold", 2, recycles=1).num_segments == 4
    assert SHAPES["mllm"].model_parts is not None and SHAPES["mllm"].model_parts(4) == 6 and not SHAPES["mllm"].no_model
    for name in ("finetune", "alphafold"):
        spec = SHAPES[name]
        assert spec.model_parts is None
        # one sentence naming the shape and pointing at abstract units (the search tab rewrites that phrase)
        assert spec.no_model.startswith(f"the {name} shape needs a model")
        assert spec.no_model.endswith(f"search {name} in abstract units (no --model)")
        assert "." not in spec.no_model.replace("e.g.", "")
    for name in NEW:
        with pytest.raises(PlacementError, match="at least 2 devices"):
            make_shape(name, 1)


# ------------------------------------------------------------------ bounds against real schedules
def _variants(shape: str, n: int, rng: random.Random) -> list[dict]:
    ns = make_shape(shape, n).num_segments
    uneven = {"forward_times": [rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(ns)],
              "backward_times": [rng.choice([0.5, 1.0, 2.0, 4.0]) for _ in range(ns)],
              "activation_bytes": [rng.choice([1, 2, 3]) for _ in range(ns)]}
    return [{}, {"split_backward": True}, {"forward_only": True}, uneven]


@pytest.mark.parametrize("shape", NEW)
def test_bound_and_memory_floor_hold_for_real_schedules(shape):
    rng = random.Random(shape)
    for n in (2, 3, 4):
        for kw in _variants(shape, n, rng):
            pl = make_shape(shape, n, **kw)
            floor = memory_floor(pl)
            limit = max(floor) + 2
            for m in (1, 3, 8):
                runs = [(gpipe_any(pl, m), None), (one_f_one_b_any(pl, m), None),
                        (one_f_one_b_any(pl, m, limit), limit)]
                for sched, lim in runs:
                    got = measure(sched)
                    bound = makespan_lower_bound(pl, m, lim)
                    assert bound <= got.makespan + 1e-9, (shape, n, kw, m, sched.name, lim)
                    assert bound >= m * max(pl.busy_time(d) for d in range(n)) - 1e-9
                    assert all(f <= p for f, p in zip(floor, got.peak_memory)), (shape, n, kw, m, sched.name)
                    if lim is not None:
                        assert max(got.peak_memory) <= lim


@pytest.mark.parametrize("shape,floor", [("mllm", 3), ("finetune", 1), ("alphafold", 1)])
def test_memory_floor_and_gpipe_peak(shape, floor):
    n, m = 4, 5
    pl = make_shape(shape, n)
    assert memory_floor(pl) == [floor] * n
    # GPipe holds every micro-batch's activations at once: m times one micro-batch's allocation
    assert measure(gpipe_any(pl, m)).peak_memory == [m * floor] * n


# ------------------------------------------------------------------ Tessel
@pytest.mark.parametrize("shape", NEW)
def test_tessel_search_gives_a_valid_schedule_within_the_bounds(shape):
    pl = make_shape(shape, 4)
    limit = max(memory_floor(pl)) + 2
    res = tessel_search(pl, 16, memory_limit=limit, time_limit=1.0)
    sched = res.schedule
    sched.validate(limit)
    got = measure(sched)
    assert max(got.peak_memory) <= limit
    assert makespan_lower_bound(pl, 16, limit) <= got.makespan + 1e-9
    assert res.makespan_lower_bound <= got.makespan + 1e-9
    # every micro-batch runs exactly the placement's blocks: no backward for a frozen segment
    for d, order in enumerate(sched.orders):
        assert sorted((b.micro_batch, b.segment, b.kind) for b in order) == sorted(
            (mb, pl.blocks[i].segment, pl.blocks[i].kind) for mb in range(16) for i in pl.blocks_on(d))


# ------------------------------------------------------------------ MLLM with a model's layers
def test_mllm_with_a_model_puts_the_encoders_and_the_head_on_every_device(monkeypatch):
    """engine.shape_costs cuts a model for MLLM around its LAST run of blocks (here a multi-modal
    model: a vision encoder with its own blocks, a projector, the LM's blocks, a head); the
    all-device parts cost what the model's layers cost tensor-parallel over every device. The
    layer costs are given (as ``engine.transform.layer_costs`` returns them for a captured
    graph), so the test needs no capture."""
    from types import SimpleNamespace

    import engine.shape_costs as sc
    from engine.transform import PARAM_STATE_FACTOR, LayerCost

    names = ["patch", "vision.0", "vision.1", "proj", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    comm = 0.1   # per layer, tensor-parallel only

    def layer_costs(graph, cost, tp=1, **kw):
        return [LayerCost(name, 1.0 / tp + (comm if tp > 1 else 0.0), 0.0, 100, 8 // tp, comm if tp > 1 else 0.0,
                          None, 100) for name in names]

    monkeypatch.setattr(sc, "layer_costs", layer_costs)
    cost = SimpleNamespace(backward_factor=2.0)
    pl, parts = sc.model_shape_placement(None, cost, "mllm", 2, optimizer="adam")
    assert pl.name == "MLLM" and pl.num_segments == 4
    assert [p["layers"] for p in parts] == [names[:4], ["layers.0", "layers.1"], ["layers.2", "layers.3"], ["head"]]
    assert [pl.spec("F", s).devices for s in range(4)] == [(0, 1), (0,), (1,), (0, 1)]
    assert [pl.spec("F", s).duration for s in range(4)] == pytest.approx([4 * 0.6, 2.0, 2.0, 0.6])
    assert [pl.spec("B", s).duration for s in range(4)] == pytest.approx([2 * 2.0 + 0.4, 4.0, 4.0, 2 * 0.5 + 0.1])
    assert [pl.spec("F", s).memory for s in range(4)] == [16, 16, 16, 4]
    # parameters and optimizer states: an all-device part split over both devices, a V part on its own
    each = PARAM_STATE_FACTOR * (400 // 2 + 200 + 100 // 2)
    assert pl.static_memory == (each, each)
    # the same chain as the model-aware M on a decoder LM (one run of blocks): the cut M makes there
    decoder = ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    names[:] = decoder
    m_pl, m_parts = sc.model_shape_placement(None, cost, "m", 2)
    mllm_pl, mllm_parts = sc.model_shape_placement(None, cost, "mllm", 2)
    assert m_pl.name == "M" and mllm_pl.blocks == m_pl.blocks and mllm_parts == m_parts
    # M cannot cut the multi-modal model this way (its blocks are two runs): a balanced cut instead
    names[:] = ["patch", "vision.0", "vision.1", "proj", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    assert sc.model_shape_placement(None, cost, "m", 2)[0].num_segments == 3
    # finetune and AlphaFold take no model: one sentence each
    for name in ("finetune", "alphafold"):
        with pytest.raises(TesselError, match=rf"^the {name} shape needs a model .* \(no --model\)$"):
            sc.model_shape_placement(None, cost, name, 2)
