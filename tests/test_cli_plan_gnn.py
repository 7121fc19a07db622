"""``tessel plan --gnn``: writes a GNN plan that loads back equal to the engine's own, a Perfetto trace
with a load track per device, a per-device table, and one-sentence errors."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from apps.cli import main
from engine.gnn.models import GNNConfig
from engine.gnn.plan import load_gnn_plan, make_gnn_plan
from engine.gnn.plan_parts import GraphStats
from tasks.graphs import karate_club


def tessel(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_writes_a_plan_that_loads_back_equal(tmp_path, capsys):
    rc, out, err = tessel(capsys, "plan", "--gnn", "sage", "--graph", "karate", "--devices", "2", "--device-type",
                          "cpu", "--hidden", "8", "--epochs", "30", "-o", str(tmp_path), "--json")
    assert rc == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    plan = load_gnn_plan(tmp_path / "gnn_plan.json")
    # Zachary's karate club as PyG ships it: 34 members, 78 friendships both ways, one-hot ids, 4 communities
    assert plan.graph == GraphStats(34, 156, 34, 4)
    ref = make_gnn_plan(GNNConfig("sage", 34, 8, 4, 2), GraphStats(34, 156, 34, 4), 2, None, None, "cpu",
                        edge_index=karate_club().edge_index, epochs=30, graph_spec="karate",
                        meta={"command": "tessel plan --gnn"})
    assert plan == ref
    assert res["ok"] and res["partitions"] == plan.partitions == 2 and res["num_devices"] == 2
    assert res["epoch_time"] == plan.metrics["epoch_time"] and res["peak_memory"] == plan.metrics["peak_memory"]
    assert res["budget_bytes"] == plan.budget_bytes == plan.cost.base.device.mem_capacity
    assert plan.chunk_source == res["chunk_source"] == "partition"


def test_cli_table_and_trace(tmp_path, capsys):
    rc, out, err = tessel(capsys, "plan", "--gnn", "gat", "--graph", "karate", "--devices", "3", "--heads", "2",
                          "--hidden", "8", "--memory-budget", "0.01", "-o", str(tmp_path))
    assert rc == 0, err
    plan = load_gnn_plan(tmp_path / "gnn_plan.json")
    assert plan.partitions == 4 and plan.model.heads == 2 and plan.budget_bytes == int(0.01 * 2**30)
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("device ") and ln.split()[1].isdigit()]
    assert [r[1] for r in rows] == ["0", "1", "2"] and all(r[-1] == "yes" for r in rows)
    assert f"epoch {plan.metrics['epoch_time'] * 1e3:,.3f} ms predicted" in out and "P = 4" in out
    trace = json.loads((tmp_path / "gnn_trace.json").read_text())
    names = {(e["pid"], e["args"]["name"]): e["tid"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    slices = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            slices[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["cat"]))
    for dev in range(3):
        loads = slices[(dev, names[(dev, "load")])]
        assert loads and {c for *_, c in loads} == {"LOAD"}
        assert {c for *_, c in slices[(dev, names[(dev, "compute")])]} >= {"F", "B", "OPTIM"}
    for track in slices.values():         # slices of one track never overlap (Perfetto nests them)
        track.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(track, track[1:]))


@pytest.mark.parametrize("args,words", [
    (("--gnn", "gcn", "--graph", "nosuch"), "graph 'nosuch' is not one this planner knows"),
    (("--gnn", "gcn", "--graph", "karate", "--memory-budget", "0.00001"), "too small"),
    (("--gnn", "gcn", "--graph", "karate", "--heads", "2"), "--heads is for --gnn gat only"),
    (("--gnn", "mlp", "--graph", "karate"), "is not a GNN kind"),
    (("--gnn", "gcn", "--graph", "karate", "--partitions", "2"), "between the 4 devices"),
])
def test_cli_mistakes_are_one_sentence(tmp_path, capsys, args, words):
    rc, out, err = tessel(capsys, "plan", *args, "-o", str(tmp_path))
    assert rc == 2
    msg = err.strip().removeprefix("tessel plan: error: ")
    assert words in msg and msg.endswith(".") and ". " not in msg and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "gnn_plan.json").exists()
