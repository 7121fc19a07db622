"""Ranks placed by node (runtime.node_placement), without Ray: which node each device gets, the
refusals, the table and the line printed at launch; and ``tessel plan --devices-per-node``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.node_placement import (
    ClusterNode,
    NodePlacementError,
    alive_nodes,
    bundle_label_selectors,
    node_of_devices,
    rank_node_table,
    ranks_by_node_text,
)

ROOT = Path(__file__).resolve().parents[2]

RAY_NODES = [
    {"Alive": True, "NodeID": "bb", "NodeManagerAddress": "10.0.0.9", "Resources": {"CPU": 2.0}},
    {"Alive": False, "NodeID": "dd", "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8.0}},
    {"Alive": True, "NodeID": "aa", "NodeManagerAddress": "10.0.0.5",
     "Resources": {"CPU": 2.0, "GPU": 2.0, "node:__internal_head__": 1.0}},
    {"Alive": True, "NodeID": "cc", "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 1.0}},
]


def test_alive_nodes_come_head_first_then_by_address():
    nodes = alive_nodes(RAY_NODES)
    assert [n.node_id for n in nodes] == ["aa", "cc", "bb"]
    assert nodes[0].head and nodes[0].devices(use_gpu=True) == 2 and nodes[1].devices(use_gpu=False) == 1


def test_device_i_runs_on_node_i_over_devices_per_node():
    nodes = alive_nodes(RAY_NODES)
    got = node_of_devices(3, 1, nodes, use_gpu=False)
    assert [n.node_id for n in got] == ["aa", "cc", "bb"]
    two = [ClusterNode("aa", "10.0.0.5", 2, 0, True), ClusterNode("bb", "10.0.0.9", 2, 0)]
    got = node_of_devices(4, 2, two, use_gpu=False)
    assert [n.node_id for n in got] == ["aa", "aa", "bb", "bb"]
    assert bundle_label_selectors(got) == [{"ray.io/node-id": x} for x in ("aa", "aa", "bb", "bb")]
    assert node_of_devices(4, 8, two, use_gpu=False) is None   # fits on one node: packed anywhere


def test_too_few_nodes_or_devices_are_refused_in_one_sentence():
    two = [ClusterNode("aa", "10.0.0.5", 2, 0, True), ClusterNode("bb", "10.0.0.9", 1, 0)]
    with pytest.raises(NodePlacementError, match=r"on 4 nodes of 1 devices .* has 2 alive nodes"):
        node_of_devices(4, 1, two, use_gpu=False)
    with pytest.raises(NodePlacementError, match=r"puts 2 ranks on node 1 \(10.0.0.9\), which has 1 CPUs"):
        node_of_devices(4, 2, two, use_gpu=False)
    with pytest.raises(NodePlacementError, match="which has 0 GPUs"):
        node_of_devices(2, 1, two, use_gpu=True)


def test_the_table_and_the_line_name_each_ranks_node():
    two = [ClusterNode("aa", "10.0.0.5", 2, 0, True), ClusterNode("bb", "10.0.0.9", 2, 0)]
    device_nodes = node_of_devices(4, 2, two, use_gpu=False)
    rows = rank_node_table([0, 2, 1, 3], device_nodes)   # tp 2 x pp 2: world rank -> device
    assert [(r["rank"], r["device"], r["node"], r["address"]) for r in rows] == [
        (0, 0, 0, "10.0.0.5"), (1, 2, 1, "10.0.0.9"), (2, 1, 0, "10.0.0.5"), (3, 3, 1, "10.0.0.9")]
    assert ranks_by_node_text(rows) == "ranks by node: node 0 (10.0.0.5): ranks 0, 2; node 1 (10.0.0.9): ranks 1, 3"
    assert all(r["node"] is None for r in rank_node_table([0, 1], None))


def test_tessel_plan_records_devices_per_node_and_the_inter_node_link(tmp_path):
    p = subprocess.run([sys.executable, "-m", "apps.cli", "plan", "--model", "llama-tiny", "--devices", "2", "--dp",
                        "2", "--devices-per-node", "1", "--inter-link", "1gbit", "--device-type", "cpu",
                        "--micro-batches", "2", "--seq-len", "16", "-o", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    cost = json.loads((tmp_path / "plan.json").read_text())["cost"]
    assert cost["devices_per_node"] == 1 and cost["inter_link"]["bandwidth"] == pytest.approx(1e9 / 8)
    bad = subprocess.run([sys.executable, "-m", "apps.cli", "plan", "--model", "llama-tiny", "--devices-per-node", "0",
                          "-o", str(tmp_path / "bad")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 2 and "--devices-per-node" in bad.stderr
