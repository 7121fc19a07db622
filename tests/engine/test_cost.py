"""Tests of engine.cost: device tables, roofline, alpha-beta communication, CostModel, profiler."""

from __future__ import annotations

import json
import logging
import math

import pytest

from engine.cost import (
    DEVICES,
    LINKS,
    CostModel,
    DeviceSpec,
    LinkSpec,
    ProfileTable,
    collective_time,
    get_device,
    get_link,
    op_time,
    p2p_time,
    profile_ops,
    profiler,
    ridge_intensity,
    signature,
)
from engine.errors import TesselError


def mm_node(n=256, dtype="float32", param=False):
    b = {"param": "fc.weight", "shape": [n, n], "dtype": dtype} if param else {"shape": [n, n], "dtype": dtype}
    nbytes = n * n * 4
    return {
        "target": "aten.mm.default", "flops": 2.0 * n ** 3,
        "input_bytes": nbytes * (1 if param else 2), "output_bytes": nbytes, "param_bytes": nbytes if param else 0,
        "dtypes": [dtype], "shapes": [[n, n]],
        "args": [{"shape": [n, n], "dtype": dtype}, b], "kwargs": {},
    }


# ------------------------------------------------------------------ devices

def test_device_and_link_tables():
    h100, a100 = get_device("h100"), get_device("A100")
    assert h100.peak("bf16") == 989e12 and h100.peak("torch.float32") == 67e12 and h100.peak("tf32") == 495e12
    assert a100.peak("bfloat16") == 312e12 and a100.peak("float32") == 19.5e12
    assert h100.mem_bandwidth == 3.35e12 and h100.mem_capacity == 80 * 2 ** 30
    cpu = DEVICES["cpu"]
    assert cpu.peak("float32") > 1e9 and cpu.mem_capacity > 2 ** 30
    assert get_link("nvlink").bandwidth == 450e9 and {"pcie", "infiniband", "loopback"} <= set(LINKS)
    hash(h100)  # frozen dataclasses are usable as dict keys


def test_bad_names_list_valid_ones():
    with pytest.raises(ValueError, match="h100"):
        get_device("tpu")
    with pytest.raises(ValueError, match="nvlink"):
        get_link("carrier-pigeon")
    with pytest.raises(ValueError, match="bfloat16"):
        get_device("h100").peak("int4")
    with pytest.raises(TesselError):
        get_device("tpu")


# ------------------------------------------------------------------ roofline

def test_roofline_switches_regime_at_ridge():
    dev = DeviceSpec("toy", {"float32": 100.0}, mem_bandwidth=10.0, mem_capacity=1, flop_efficiency=1.0,
                     bw_efficiency=1.0, launch_overhead=0.0)
    assert ridge_intensity(dev, "float32") == 10.0
    # memory-bound below the ridge: time tracks bytes, not flops
    assert op_time(50, 100, dev) == pytest.approx(10.0)
    assert op_time(90, 100, dev) == pytest.approx(10.0)
    # exactly at the ridge both terms agree
    assert op_time(1000, 100, dev) == pytest.approx(10.0)
    # compute-bound above: time tracks flops
    assert op_time(2000, 100, dev) == pytest.approx(20.0)
    assert op_time(2000, 150, dev) == pytest.approx(20.0)
    # efficiencies and launch overhead
    dev2 = DeviceSpec("toy2", {"float32": 100.0}, 10.0, 1, flop_efficiency=0.5, bw_efficiency=0.5, launch_overhead=1.0)
    assert op_time(2000, 100, dev2) == pytest.approx(41.0)
    assert op_time(0, 0, dev2) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        op_time(-1, 0, dev)


def test_h100_faster_than_a100():
    for flops, nbytes in [(2 * 4096 ** 3, 3 * 4096 * 4096 * 2), (1e6, 1e9)]:  # compute-bound and memory-bound
        for dt in ("bfloat16", "float32"):
            assert op_time(flops, nbytes, get_device("h100"), dt) < op_time(flops, nbytes, get_device("a100"), dt)
    # real regime check: a 4096^3 bf16 GEMM is compute-bound on H100, an elementwise op memory-bound
    h = get_device("h100")
    assert 2 * 4096 ** 3 / (3 * 4096 * 4096 * 2) > ridge_intensity(h, "bf16")
    assert 1e6 / 1e9 < ridge_intensity(h, "bf16")


# ------------------------------------------------------------------ communication

def test_alpha_beta_formulas_by_hand():
    link = LinkSpec("toy", bandwidth=1e9, latency=1e-5)
    n = 1e9
    # ring allreduce, p=4: 2*3/4 * 1 s + 2*3 * 10 us = 1.5 + 6e-5
    assert collective_time("allreduce", n, 4, link) == pytest.approx(1.50006)
    # p=2: 2*1/2 * 1 + 2 * 1e-5
    assert collective_time("all_reduce", n, 2, link) == pytest.approx(1.00002)
    # allgather / reducescatter / alltoall p=8: 7/8 * 1 + 7e-5
    for kind in ("allgather", "reducescatter", "alltoall", "reduce_scatter"):
        assert collective_time(kind, n, 8, link) == pytest.approx(0.875 + 7e-5)
    assert collective_time("broadcast", n, 4, link) == pytest.approx(1.0 + 3e-5)
    assert p2p_time(n, link) == pytest.approx(1.00001)
    assert p2p_time(0, link) == 0.0


def test_group_of_one_and_bad_kind():
    link = get_link("nvlink")
    for kind in ("allreduce", "allgather", "reducescatter", "broadcast", "alltoall"):
        assert collective_time(kind, 1 << 30, 1, link) == 0.0
    with pytest.raises(ValueError, match="allreduce.*allgather"):
        collective_time("gossip", 10, 4, link)
    with pytest.raises(ValueError):
        collective_time("allreduce", 10, 0, link)
    with pytest.raises(ValueError):
        p2p_time(-1, link)


# ------------------------------------------------------------------ cost model

def test_for_device_links_and_errors():
    m = CostModel.for_device("h100")
    assert m.intra_link.name == "nvlink" and m.inter_link.name == "infiniband"
    assert CostModel.for_device("cpu").intra_link.name == "loopback" == CostModel.for_device("cpu").inter_link.name
    assert CostModel.for_device("a100", "pcie").intra_link.name == "pcie"
    assert CostModel.for_device("h100", dtype="bf16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="a100"):
        CostModel.for_device("v100")
    with pytest.raises(ValueError, match="nvlink"):
        CostModel.for_device("h100", "ethernet-over-smoke")
    with pytest.raises(ValueError):
        CostModel.for_device("h100", dtype="int3")


def test_links_and_collectives_across_nodes():
    m = CostModel.for_device("h100", devices_per_node=8)
    assert m.link_between(0, 7).name == "nvlink" and m.link_between(7, 8).name == "infiniband"
    n = 64 << 20
    assert m.p2p_time(n, 3, 3) == 0.0
    assert m.p2p_time(n, 0, 1) == pytest.approx(2e-6 + n / 450e9)
    assert m.p2p_time(n, 0, 9) == pytest.approx(5e-6 + n / 50e9)
    intra = m.collective_time("allreduce", n, [0, 1, 2, 3])
    assert intra == pytest.approx(collective_time("allreduce", n, 4, get_link("nvlink")))
    # spanning two nodes: the slowest link (infiniband) bounds the ring
    cross = m.collective_time("allreduce", n, [0, 1, 8, 9])
    assert cross == pytest.approx(collective_time("allreduce", n, 4, get_link("infiniband")))
    assert cross > intra
    assert m.collective_time("allreduce", n, [5]) == 0.0
    assert m.collective_time("allreduce", n, [5, 5]) == 0.0


def test_op_forward_backward_optimizer_times():
    m = CostModel.for_device("h100")
    node = mm_node(4096)
    expect = op_time(node["flops"], node["input_bytes"] + node["output_bytes"], m.device, "float32")
    assert m.op_time(node) == pytest.approx(expect)
    view = {"target": "aten.view.default", "flops": 0, "input_bytes": 1 << 20, "output_bytes": 1 << 20,
            "param_bytes": 0}
    assert m.op_time(view) == 0.0
    big = mm_node(8192)  # compute-bound on H100: a quarter shard takes ~1/4 (plus launch overhead)
    assert m.op_time(big, shard=4) == pytest.approx((m.op_time(big) - 4e-6) / 4 + 4e-6)
    with pytest.raises(ValueError):
        m.op_time(node, shard=0)
    f = m.forward_time([node, node, view])
    assert f == pytest.approx(2 * expect)
    assert m.block_time([node], "B") == pytest.approx(2 * expect)
    assert m.block_time([node], "I") == pytest.approx(expect) == m.block_time([node], "W")
    with pytest.raises(ValueError, match="F"):
        m.block_time([node], "X")
    # Adam is memory-bound: 7 param-sized passes
    p = 1 << 30
    assert m.optimizer_time(p) == pytest.approx(7 * p / (3.35e12 * 0.8) + m.device.launch_overhead)
    assert m.optimizer_time(0) == 0.0


def test_json_round_trip_with_profile():
    table = ProfileTable("cpu|X|threads=1|torch=0", {signature(mm_node()): 1.25e-4}, {"aten.bogus|{}": "no such op"})
    for m in (CostModel.for_device("h100", dtype="bf16", devices_per_node=4, profile=table),
              CostModel.for_device("cpu"), CostModel.for_device("a100", "pcie", inter_link="nvlink")):
        d = m.to_dict()
        text = json.dumps(d)
        back = CostModel.from_dict(json.loads(text))
        assert back == m
        assert back.to_dict() == d
    with pytest.raises(ValueError, match=r"cost\.device\.peak_flops"):
        bad = CostModel.for_device("h100").to_dict()
        del bad["device"]["peak_flops"]
        CostModel.from_dict(bad)
    with pytest.raises(ValueError, match=r"cost\.version"):
        CostModel.from_dict({**CostModel.for_device("h100").to_dict(), "version": 99})


def test_signature_is_deterministic_and_ignores_param_names():
    a, b = mm_node(param=True), mm_node(param=True)
    b["args"][1]["param"] = "other.weight"
    b["kwargs"] = {}
    assert signature(a) == signature(b) == signature(json.loads(json.dumps(a)))
    assert signature(mm_node(128)) != signature(mm_node(256))
    assert signature(mm_node(dtype="bfloat16")) != signature(mm_node())
    assert signature(mm_node()).startswith("aten.mm.default|")


# ------------------------------------------------------------------ profiler

@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_profiler_times_mm_and_uses_cache(cache_env, monkeypatch):
    calls = []
    real = profiler._time_one
    monkeypatch.setattr(profiler, "_time_one", lambda *a, **k: calls.append(a[0]["target"]) or real(*a, **k))

    nodes = [mm_node(256), mm_node(256, param=True)]  # same signature: timed once
    t1 = profile_ops(nodes, progress=False)
    sig = signature(nodes[0])
    assert calls == ["aten.mm.default"] and t1.timed == 1 and t1.cache_hits == 0
    assert 0 < t1.get(sig) < 1.0
    path = profiler.default_cache_path(t1.device_key)
    assert path.parent == cache_env and path.exists()
    on_disk = json.loads(path.read_text())  # valid JSON
    assert on_disk["times"][sig] == t1.get(sig) and on_disk["device_key"] == t1.device_key
    assert not list(cache_env.glob("*.tmp"))

    t2 = profile_ops(nodes, progress=False)
    assert calls == ["aten.mm.default"]  # no re-timing
    assert t2.timed == 0 and t2.cache_hits == 1 and t2 == t1


def test_profiler_skips_bogus_op_and_reports(cache_env, caplog):
    bogus = {"target": "aten.definitely_not_an_op.default", "args": [{"shape": [2], "dtype": "float32"}], "kwargs": {}}
    foreign = {"target": "_operator.getitem", "args": [[1, 2], 0], "kwargs": {}}
    bad_shapes = {"target": "aten.mm.default", "args": [{"shape": [2, 3], "dtype": "float32"},
                                                         {"shape": [4, 5], "dtype": "float32"}], "kwargs": {}}
    neg = {"target": "aten.relu.default", "args": [{"shape": [-3], "dtype": "float32"}], "kwargs": {}}
    huge = {"target": "aten.relu.default", "args": [{"shape": [1 << 20, 1 << 20], "dtype": "float32"}], "kwargs": {}}
    t0 = profile_ops([neg, huge], progress=False)
    assert t0.timed == 0 and set(t0.skipped) == {signature(neg), signature(huge)}
    assert "max_bytes" in t0.skipped[signature(huge)]
    with caplog.at_level(logging.WARNING, logger="engine.cost.profiler"):
        t = profile_ops([bogus, foreign, bad_shapes, mm_node(8)], progress=False)
    assert t.timed == 1 and len(t.times) == 1
    assert set(t.skipped) == {signature(bogus), signature(foreign), signature(bad_shapes)}
    assert "3 op signature" in caplog.text and "definitely_not_an_op" in caplog.text
    # skipped ops fall back to the roofline
    m = CostModel.for_device("cpu", profile=t)
    node = {**bogus, "flops": 0, "input_bytes": 8, "output_bytes": 8, "param_bytes": 0}
    assert m.op_time(node) == pytest.approx(m.roofline_time(node))


def test_profiler_ignores_cache_of_other_device(tmp_path):
    path = tmp_path / "p.json"
    node = mm_node(16)
    ProfileTable("cuda|Some GPU|torch=0", {signature(node): 123.0}).save(path)
    t = profile_ops([node], cache_path=path, progress=False)
    assert t.timed == 1 and t.get(signature(node)) != 123.0
    assert ProfileTable.load(path).device_key == t.device_key  # rewritten for this device


def test_profiler_replays_literals_and_integer_inputs(cache_env):
    nodes = [
        {"target": "aten.embedding.default",
         "args": [{"param": "emb", "shape": [10, 4], "dtype": "float32"}, {"shape": [3, 5], "dtype": "int64"}],
         "kwargs": {}},
        {"target": "aten.sum.dim_IntList", "args": [{"shape": [4, 4], "dtype": "float32"}, [1]],
         "kwargs": {"dtype": "torch.float64"}},
        {"target": "aten.ones.default", "args": [[2, 2]], "kwargs": {"dtype": "torch.float32", "device": "meta"}},
        {"target": "aten.where.self", "args": [{"shape": [3], "dtype": "bool"}, {"shape": [3], "dtype": "float32"},
                                               {"shape": [3], "dtype": "float32"}], "kwargs": {}},
    ]
    t = profile_ops(nodes, cache=False, progress=False)
    assert t.timed == 4, t.skipped
    assert not list(cache_env.iterdir())  # cache=False writes nothing


def test_cost_model_prefers_profiled_time(cache_env):
    node = mm_node(256)
    table = profile_ops([node], progress=False)
    measured = table.get(signature(node))
    m = CostModel.for_device("cpu", profile=table)
    plain = CostModel.for_device("cpu")
    assert m.op_time(node) == measured
    assert plain.op_time(node) == pytest.approx(plain.roofline_time(node))
    assert not math.isclose(m.op_time(node), plain.op_time(node), rel_tol=1e-12)
    # an op the profile lacks uses the roofline
    other = mm_node(64)
    assert m.op_time(other) == pytest.approx(m.roofline_time(other))
    # tensor-parallel shards divide the measured time
    assert m.op_time(node, shard=4) == pytest.approx(measured / 4)


def test_profile_table_load_rejects_garbage(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ProfileTable.load(p)
    p.write_text(json.dumps({"format": "tessel-profile", "version": 7, "device_key": "k"}))
    with pytest.raises(ValueError, match="version"):
        ProfileTable.load(p)


def test_links_from_their_spelling():
    """Table names, the emulated network (a shared medium at the loopback's latency) and a
    RATE@LATENCY link; wrong spellings are one sentence."""
    from engine.cost import emulated_link, parse_link, parse_rate
    from engine.errors import CostModelError

    assert parse_link("NVLink") is LINKS["nvlink"]
    e = parse_link("emulated:1gbit")
    assert e == emulated_link("1gbit") and e.shared and e.bandwidth == 125e6 and e.latency == LINKS["loopback"].latency
    x = parse_link("10gbit@20us")
    assert (x.bandwidth, x.shared) == (10e9 / 8, False) and x.latency == pytest.approx(20e-6)
    assert parse_rate("800mbit") == 8e8 and parse_rate(1e9) == 1e9
    for bad, msg in (("1gbps", "unknown link"), ("emulated:fast", "not a positive rate"), ("1gbit@soon", "duration")):
        with pytest.raises(CostModelError, match=msg):
            parse_link(bad)


def test_a_shared_medium_carries_every_ranks_share():
    """On a shared medium the p ranks' concurrent sends queue: a ring all-reduce of n bytes costs
    2(p-1) n / bw (each rank's 2(p-1)/p n, p times) instead of 2(p-1)/p n / bw."""
    shared = LinkSpec("bus", bandwidth=1e9, latency=1e-5, shared=True)
    duplex = LinkSpec("duplex", bandwidth=1e9, latency=1e-5)
    n = 8e6
    for p in (2, 3, 4):
        assert collective_time("allreduce", n, p, shared) == pytest.approx(2 * (p - 1) * n / 1e9 + 2 * (p - 1) * 1e-5)
        assert collective_time("allgather", n, p, shared) == pytest.approx(
            p * collective_time("allgather", n, p, duplex) - (p - 1) * (p - 1) * 1e-5)
    assert p2p_time(n, shared) == p2p_time(n, duplex)


def test_cost_models_keep_their_link_through_json():
    cost = CostModel.for_device("cpu", link="emulated:1gbit", inter_link="emulated:1gbit")
    again = CostModel.from_dict(cost.to_dict())
    assert again.intra_link == cost.intra_link and again.inter_link.shared
    old = cost.to_dict()
    del old["intra_link"]["shared"]   # plans written before the field: a full-duplex link
    assert CostModel.from_dict(old).intra_link.shared is False


def test_gloo_reduce_scatter_costs_an_all_reduce():
    """On the cpu device (the gloo backend) a reduce-scatter is an all-reduce plus a copy of the
    shard; on GPUs (NCCL) it is half of one."""
    cpu, gpu = CostModel.for_device("cpu"), CostModel.for_device("h100")
    n = 20 * 2**20
    assert cpu.collective_time("reduce_scatter", n, [0, 1]) == cpu.collective_time("allreduce", n, [0, 1])
    assert gpu.collective_time("reducescatter", n, [0, 1]) < gpu.collective_time("allreduce", n, [0, 1])
    assert cpu.collective_time("allgather", n, [0, 1]) < cpu.collective_time("allreduce", n, [0, 1])
