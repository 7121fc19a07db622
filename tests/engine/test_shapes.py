"""Tessel placement shapes (V, X, M, NN, K, interleaved), custom placements and their JSON form."""

from __future__ import annotations

import json

import pytest

from engine.errors import PlacementError
from engine.io.placement_json import (
    PLACEMENT_FORMAT,
    load_placement,
    placement_from_dict,
    placement_to_dict,
    save_placement,
)
from engine.placement import Placement, TensorSpec, pipeline_placement
from engine.shapes import (
    custom_placement,
    interleaved_shape,
    k_shape,
    m_shape,
    make_shape,
    nn_shape,
    shape_names,
    v_shape,
    x_shape,
)

#: shape -> (segments on n devices, busy time per device per micro-batch with F=1, B=2, name)
SHAPES = {
    "v": (lambda n: n, 3.0, "V"),
    "x": (lambda n: 2 * n, 6.0, "X"),
    "m": (lambda n: n + 1, 6.0, "M"),
    "nn": (lambda n: n + 2, 9.0, "NN"),
    "k": (lambda n: n + 1, 6.0, "K"),
    "interleaved": (lambda n: 2 * n, 6.0, "interleaved"),
}


def cases(ns=(2, 4, 8)):
    return [(s, n) for s in SHAPES for n in ns]


def devices_of(pl: Placement) -> dict[str, tuple[int, ...]]:
    return {f"{b.segment}{b.kind}": b.devices for b in pl.blocks}


def deps_of(pl: Placement, kind: str, seg: int) -> set[str]:
    return {f"{pl.blocks[i].segment}{pl.blocks[i].kind}" for i in pl.spec(kind, seg).deps}


# ------------------------------------------------------------------ every shape
@pytest.mark.parametrize("shape,n", cases())
@pytest.mark.parametrize("split", [False, True])
def test_shape_validates_balances_memory_and_busy_time(shape, n, split):
    n_seg, busy, name = SHAPES[shape]
    pl = make_shape(shape, n, split_backward=split)
    assert isinstance(pl, Placement)
    assert pl.name == name and pl.num_devices == n and pl.num_segments == n_seg(n)
    assert pl.split_backward == split
    kinds = ("F", "I", "W") if split else ("F", "B")
    assert {b.key for b in pl.blocks} == {(k, s) for k in kinds for s in range(n_seg(n))}
    for d in range(n):
        assert pl.busy_time(d) == pytest.approx(busy)
        assert sum(pl.blocks[i].memory for i in pl.blocks_on(d)) == 0
    # blocks are listed in a topological order (their index is the chain position)
    for i, b in enumerate(pl.blocks):
        assert all(dep < i for dep in b.deps)
    # a backward runs on the devices of its forward
    for b in pl.blocks:
        assert b.devices == pl.spec("F", b.segment).devices


@pytest.mark.parametrize("shape,n", cases((2, 4)))
def test_forward_only(shape, n):
    pl = make_shape(shape, n, forward_only=True)
    assert pl.forward_only and all(b.kind == "F" for b in pl.blocks)
    assert pl.num_segments == SHAPES[shape][0](n)
    assert all(b.memory == 0 for b in pl.blocks)
    for d in range(n):
        assert pl.busy_time(d) == pytest.approx(SHAPES[shape][1] / 3)


def test_v_and_interleaved_equal_pipeline_placement():
    assert v_shape(4) == pipeline_placement(4, activation_bytes=1)
    assert v_shape(4, split_backward=True, activation=8) == pipeline_placement(4, activation_bytes=8,
                                                                                split_backward=True)
    assert interleaved_shape(4) == pipeline_placement(4, virtual_stages=2, activation_bytes=1)
    assert interleaved_shape(2, virtual_stages=3, forward=0.5).num_segments == 6
    assert v_shape(3, forward_times=[1, 2, 3]).spec("F", 2).duration == 3.0


# ------------------------------------------------------------------ documented device sets and chains
def test_x_shape_devices_and_chains():
    n = 4
    pl = x_shape(n)
    dev = devices_of(pl)
    for i in range(n):
        assert dev[f"{i}F"] == dev[f"{i}B"] == (i,)
        assert dev[f"{n + i}F"] == dev[f"{n + i}B"] == (n - 1 - i,)
    assert deps_of(pl, "F", 0) == set() and deps_of(pl, "F", n) == set()
    assert deps_of(pl, "B", n - 1) == {f"{n - 1}F"} and deps_of(pl, "B", 2 * n - 1) == {f"{2 * n - 1}F"}
    assert deps_of(pl, "B", 0) == {"1B"} and deps_of(pl, "B", n) == {f"{n + 1}B"}
    # no dependency between the chains
    g = pl.dependency_graph()
    import networkx as nx

    a = {pl.index("F", 0)} | nx.descendants(g, pl.index("F", 0))
    b = {pl.index("F", n)} | nx.descendants(g, pl.index("F", n))
    assert not a & b and len(a) == len(b) == 2 * n


def test_m_shape_devices_and_chain():
    n = 4
    pl = m_shape(n)
    dev = devices_of(pl)
    assert dev["0F"] == dev["0B"] == (0, 1, 2, 3)
    for i in range(1, n + 1):
        assert dev[f"{i}F"] == dev[f"{i}B"] == (i - 1,)
    assert deps_of(pl, "F", 1) == {"0F"} and deps_of(pl, "B", n) == {f"{n}F"}
    assert deps_of(pl, "B", 0) == {"1B"}


def test_nn_shape_devices_and_chain():
    n = 8
    pl = nn_shape(n)
    dev = devices_of(pl)
    every = tuple(range(n))
    assert dev["0F"] == dev["5F"] == dev["0B"] == dev["5B"] == every
    assert [dev[f"{s}F"] for s in range(1, 5)] == [(0,), (1,), (2,), (3,)]
    assert [dev[f"{s}F"] for s in range(6, 10)] == [(4,), (5,), (6,), (7,)]
    assert deps_of(pl, "F", 5) == {"4F"} and deps_of(pl, "F", 6) == {"5F"}
    assert deps_of(pl, "B", 9) == {"9F"} and deps_of(pl, "B", 5) == {"6B"} and deps_of(pl, "B", 4) == {"5B"}
    # backward in exact reverse order of the forward
    bwd = [b.segment for b in pl.blocks if b.kind == "B"]
    assert bwd == list(reversed(range(n + 2)))


def test_k_shape_devices_and_chain():
    n = 8
    pl = k_shape(n)
    dev = devices_of(pl)
    for i in range(n):
        assert dev[f"{i}F"] == dev[f"{i}B"] == (i,)
    assert dev["8F"] == dev["8B"] == tuple(range(n))
    assert deps_of(pl, "F", 0) == set() and deps_of(pl, "F", 4) == set()
    assert deps_of(pl, "F", 3) == {"2F"} and deps_of(pl, "F", 7) == {"6F"}
    assert deps_of(pl, "F", 8) == {"3F", "7F"}
    assert deps_of(pl, "B", 8) == {"8F"}
    assert deps_of(pl, "B", 3) == {"8B"} and deps_of(pl, "B", 7) == {"8B"}
    assert deps_of(pl, "B", 0) == {"1B"} and deps_of(pl, "B", 4) == {"5B"}


def test_per_segment_lists_and_outputs():
    t = TensorSpec((2, 16, 64), "float16")
    pl = m_shape(2, forward_times=[0.5, 1, 2], backward_times=[1, 2, 4], activation_bytes=[10, 20, 30],
                 outputs=[t, t, None], input_grads=[None, t, t])
    assert pl.spec("F", 0).devices == (0, 1) and pl.spec("F", 0).memory == 10
    assert pl.spec("B", 2).memory == -30 and pl.spec("B", 2).duration == 4
    assert pl.spec("F", 1).output == t and pl.spec("F", 2).output is None
    assert pl.spec("B", 0).output is None and pl.spec("B", 1).output == t
    assert pl.busy_time(0) == pytest.approx(0.5 + 1 + 1 + 2)
    split = k_shape(2, backward_times=[2, 2, 4], activation_bytes=[4, 4, 6], split_backward=True)
    assert split.spec("I", 2).duration == split.spec("W", 2).duration == 2
    assert split.spec("I", 2).memory + split.spec("W", 2).memory == -6
    assert split.spec("W", 2).deps == (split.index("I", 2),)
    with pytest.raises(PlacementError, match=r"forward_times has 2 values .* 5 segments"):
        m_shape(4, forward_times=[1, 2])
    with pytest.raises(PlacementError, match="activation_bytes"):
        x_shape(2, activation_bytes=[1, 1, 1])


# ------------------------------------------------------------------ make_shape
def test_make_shape_names():
    assert shape_names() == ["v", "x", "m", "nn", "k", "interleaved", "mllm", "finetune", "alphafold"]
    for name, want in [("v", "V"), ("VShape", "V"), ("v-shape", "V"), ("X", "X"), ("mshape", "M"), ("M", "M"),
                       ("nn", "NN"), ("NNShape", "NN"), ("k", "K"), ("kshape", "K"), ("Interleaved", "interleaved")]:
        assert make_shape(name, 4).name == want
    assert make_shape("interleaved", 2, virtual_stages=3).num_segments == 6
    with pytest.raises(ValueError, match="valid shapes are: v, x, m, nn, k, interleaved") as e:
        make_shape("zigzag", 4)
    assert not isinstance(e.value, PlacementError)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_too_few_devices(shape):
    for n in (0, 1):
        with pytest.raises(PlacementError, match="at least 2 devices"):
            make_shape(shape, n)
    with pytest.raises(PlacementError, match="integer"):
        make_shape(shape, 2.0)


@pytest.mark.parametrize("shape", ["nn", "k"])
def test_odd_devices_rejected_for_half_splits(shape):
    with pytest.raises(PlacementError, match="even number of devices, got 5"):
        make_shape(shape, 5)


# ------------------------------------------------------------------ custom placements and errors
def chain_blocks():
    return [
        {"kind": "F", "segment": 0, "devices": [0, 1], "duration": 1.0, "memory": 1, "deps": []},
        {"kind": "F", "segment": 1, "devices": [1], "duration": 1.0, "memory": 1, "deps": ["0F"]},
        {"kind": "B", "segment": 1, "devices": [1], "duration": 2.0, "memory": -1, "deps": ["1F"]},
        {"kind": "B", "segment": 0, "devices": [0, 1], "duration": 2.0, "memory": -1, "deps": [2]},
    ]


def test_custom_placement_deps_by_index_or_name():
    pl = custom_placement(2, chain_blocks(), name="mine", static_memory=[5, 5])
    assert pl.name == "mine" and pl.static_memory == (5, 5)
    assert pl.spec("F", 1).deps == (0,) and pl.spec("B", 0).deps == (2,)
    assert pl.busy_time(0) == 3.0 and pl.busy_time(1) == 6.0
    one = custom_placement(1, [{"kind": "f", "segment": 0, "devices": 0}])
    assert one.blocks[0].devices == (0,) and one.blocks[0].kind == "F"


@pytest.mark.parametrize("mutate,match", [
    (lambda b: b[1].update(devices=[2]), r"blocks\[1\]\.devices names device 2, outside 0\.\.1"),
    (lambda b: b[1].update(devices=[]), r"blocks\[1\]\.devices must be a non-empty list"),
    (lambda b: b[2].update(kind="Q"), r"blocks\[2\]\.kind"),
    (lambda b: b[0].update(segment=-1), r"blocks\[0\]\.segment"),
    (lambda b: b[0].update(duration="1"), r"blocks\[0\]\.duration"),
    (lambda b: b[0].update(memory=0.5), r"blocks\[0\]\.memory"),
    (lambda b: b[3].update(deps=["7F"]), r"blocks\[3\]\.deps\[0\] names block '7F'"),
    (lambda b: b[3].update(deps=[9]), r"blocks\[3\]\.deps\[0\] is block index 9"),
    (lambda b: b[3].update(deps=["F-zero"]), r"blocks\[3\]\.deps\[0\] must be"),
    (lambda b: b[0].update(dep=[]), r"blocks\[0\]\.dep is not a block field"),
    (lambda b: b[0].pop("devices"), r"blocks\[0\]\.devices is missing"),
    (lambda b: b[0].update(output={"shape": [2], "dtype": "float7"}), r"blocks\[0\]\.output\.dtype"),
    (lambda b: b.append(dict(b[0])), r"blocks\[4\] repeats block 0F"),
])
def test_custom_placement_field_errors(mutate, match):
    blocks = chain_blocks()
    mutate(blocks)
    with pytest.raises(PlacementError, match=match):
        custom_placement(2, blocks)


def test_placement_rules_raise_placement_error():
    # device out of range (checked by Placement itself too)
    from engine.placement import BlockSpec

    with pytest.raises(PlacementError, match="outside 0..1"):
        Placement(2, (BlockSpec("F", 0, (2,)),))
    # cycle
    blocks = chain_blocks()
    blocks[0]["deps"] = ["0B"]
    with pytest.raises(PlacementError, match="cycle"):
        custom_placement(2, blocks)
    # backward without forward
    with pytest.raises(PlacementError, match="backward without its forward"):
        custom_placement(2, [{"kind": "F", "segment": 0, "devices": [0]},
                             {"kind": "B", "segment": 1, "devices": [1], "deps": ["0F"]}])
    # weight-gradient without input-gradient
    with pytest.raises(PlacementError, match="needs 0I"):
        custom_placement(1, [{"kind": "F", "segment": 0, "devices": [0]},
                             {"kind": "W", "segment": 0, "devices": [0], "deps": ["0F"]}])


# ------------------------------------------------------------------ JSON
@pytest.mark.parametrize("shape,n", cases((2, 4)))
def test_json_round_trip(tmp_path, shape, n):
    t = TensorSpec((4, 8), "bfloat16")
    n_seg = SHAPES[shape][0](n)
    pl = make_shape(shape, n, split_backward=(n == 4), outputs=[t] * n_seg, static_memory=[3] * n,
                    forward_times=[0.1 * (s + 1) for s in range(n_seg)])
    path = save_placement(pl, tmp_path / "sub" / f"{shape}.json")
    d = json.loads(path.read_text())
    assert d["format"] == PLACEMENT_FORMAT and d["version"] == 1 and d["num_devices"] == n
    assert load_placement(path) == pl
    assert placement_from_dict(placement_to_dict(pl)) == pl


def test_custom_placement_from_json(tmp_path):
    doc = {"format": "tessel-placement", "version": 1, "name": "hand-made", "num_devices": 2,
           "blocks": chain_blocks()}
    path = tmp_path / "custom.json"
    path.write_text(json.dumps(doc))
    pl = load_placement(path)
    assert pl == custom_placement(2, chain_blocks(), name="hand-made")
    # saved form uses indices and loads back identically
    assert load_placement(save_placement(pl, tmp_path / "again.json")) == pl


@pytest.mark.parametrize("doc,match", [
    ({"format": "tessel-plan", "version": 1, "num_devices": 2, "blocks": []}, "format is 'tessel-plan'"),
    ({"format": "tessel-placement", "version": 2, "num_devices": 2, "blocks": []}, "version is 2"),
    ({"format": "tessel-placement", "version": 1, "num_devices": "2", "blocks": []}, "num_devices"),
    ({"format": "tessel-placement", "version": 1, "num_devices": 2}, "blocks is missing"),
    ({"format": "tessel-placement", "version": 1, "num_devices": 2, "blocks": {}}, "blocks must be a list"),
    ({"format": "tessel-placement", "version": 1, "num_devices": 2, "blocks": [], "static_memory": [1]},
     "static_memory has 1 values"),
    ({"format": "tessel-placement", "version": 1, "num_devices": 2, "blocks": [],
      "static_memory": [1, "x"]}, r"static_memory\[1\]"),
    ({"format": "tessel-placement", "version": 1, "num_devices": 2, "blocks": [], "extra": 1},
     "extra is not a placement field"),
    ({"format": "tessel-placement", "version": 1, "num_devices": 2,
      "blocks": [{"kind": "F", "segment": 0, "devices": [0]}, {"kind": "F", "segment": 1, "devices": "1"}]},
     r"blocks\[1\]\.devices"),
    ([1, 2], "JSON object"),
])
def test_malformed_json_names_the_field(tmp_path, doc, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlacementError, match=match) as e:
        load_placement(path)
    assert "bad.json" in str(e.value)


def test_not_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(PlacementError, match="not valid JSON"):
        load_placement(path)


def test_predefined_schedules_accept_v_shape():
    from engine.baselines import build_schedule

    s = build_schedule("1f1b", v_shape(4), 8)
    s.validate()
