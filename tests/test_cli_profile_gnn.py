"""`tessel profile-gnn`: the stage / kernel-class tables, --json as one object, one-sentence refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from apps import cli
from apps.cmd_profile_gnn import GraphSpecError, parse_graph

ROOT = Path(__file__).resolve().parents[1]


def tessel(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "apps.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_json_prints_one_object_with_the_characterization():
    p = tessel("profile-gnn", "--model", "gat", "--graph", "er:300:6", "--hidden", "16", "--heads", "2",
               "--mode", "training", "--repeats", "2", "--warmup", "1", "--threads", "1", "--json")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["ok"] and out["model"] == "gat" and out["graph"] == "er:300:6"
    assert out["config"] == {"kind": "gat", "in_dim": 16, "hidden": 16, "out_dim": 16, "layers": 2, "heads": 2}
    c = out["characterization"]
    graph = parse_graph("er:300:6")   # same seed, same graph
    assert c["num_nodes"] == 300 and c["num_edges"] == graph.num_edges and c["repeats"] == 2 and c["threads"] == 1
    assert c["mode"] == "training" and set(c["stage_seconds"]) == {"forward", "backward"}
    assert {r["layer"] for r in c["rows"] if r["phase"] == "forward"} >= {"layer0", "layer1"}
    # the forward stage totals over the layers add up to the profiled layer ranges (the median of 2 is the mean)
    assert sum(c["stage_seconds"]["forward"].values()) == pytest.approx(sum(c["layer_total_seconds"].values()),
                                                                        rel=1e-6)


def test_table_has_a_row_per_layer(capsys):
    assert cli.main(["profile-gnn", "--model", "sage", "--graph", "er:200:4", "--hidden", "8", "--layers", "3",
                     "--repeats", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    head = out.splitlines()
    i = next(k for k, ln in enumerate(head) if ln.startswith("layer ") and "apply_edge" in ln)
    assert [ln.split()[0] for ln in head[i + 2:i + 5]] == ["layer0", "layer1", "layer2"]
    assert "gather_scatter" in out and "graph stages" in out


@pytest.mark.parametrize("spec", ["bogus", "rmat:16", "rmat:x:8", "rmat:0:8", "er:10", "er:5:10", "er:a:b",
                                  "karate:3"])
def test_bad_graph_specs_exit_2_with_one_sentence(spec, capsys):
    assert cli.main(["profile-gnn", "--model", "gcn", "--graph", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tessel profile-gnn: error: ") and "\n" not in err and err.endswith(".")
    assert spec in err
    from engine.errors import GraphError

    with pytest.raises((GraphSpecError, GraphError)):  # er: is the CLI's own form, the rest tasks.graphs'
        parse_graph(spec)


def test_bad_model_and_heads_exit_2(capsys):
    assert cli.main(["profile-gnn", "--model", "gpt", "--graph", "er:20:2", "--json"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1]) == {
        "ok": False, "error": "unknown --model 'gpt'; use one of gcn, gat, sage, gin, gated-gcn.", "exit_status": 2}
    assert cli.main(["profile-gnn", "--model", "gcn", "--heads", "4", "--graph", "er:20:2"]) == 2
    assert "heads" in capsys.readouterr().err


def test_karate_spec_is_the_karate_club():
    nx = pytest.importorskip("networkx")
    pytest.importorskip("tasks.graphs")
    g = parse_graph("karate")
    ref = nx.karate_club_graph()
    assert g.num_nodes == ref.number_of_nodes() and g.num_edges == 2 * ref.number_of_edges()
