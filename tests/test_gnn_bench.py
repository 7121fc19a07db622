"""Smoke test of ``benchmarks/gnn_bench.py`` (issue 19's measured targets): its PyG full-graph reference
is the model the streamed executor runs (same widths, same weights: equal outputs and gradients),
and a ``--quick --json`` run prints one JSON object whose rows are consistent with themselves and
with an independent ``choose_partitions``. No speed or memory target is asserted (the bench reports
them; timing is not a test's business)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gnn_bench  # noqa: E402

from engine.gnn.models import build_gnn  # noqa: E402
from engine.gnn.partition import choose_partitions  # noqa: E402
from runtime.gnn.streaming import StreamedGNN  # noqa: E402


@pytest.mark.parametrize("kind", ["gat", "gcn"])
def test_the_pyg_reference_is_the_streamed_model(kind):
    case = gnn_bench.Case(kind, 7, 4)
    data = case.graph()
    torch.manual_seed(0)
    ref = gnn_bench.PyGNet(case.config())
    ours = gnn_bench.saga_copy(ref)
    # the widths build_gnn gives the configuration
    assert [p.shape for p in ours.parameters()] == [p.shape for p in build_gnn(case.config()).parameters()]
    from engine.gnn.partition import partition_for_model

    streamed = StreamedGNN(ours, partition_for_model(ours, data.edge_index, data.num_nodes, 4))
    out_ref = ref(data.x, data.edge_index)
    out = streamed(data.x)
    torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-5)
    F.cross_entropy(out_ref[data.train_mask], data.y[data.train_mask]).backward()
    F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_quick_run_prints_one_consistent_json_object(capsys):
    assert gnn_bench.main(["--quick", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    res = json.loads(out[0])
    budget = res["budget_bytes"]
    assert budget == gnn_bench.QUICK["budget_mib"] * 2**20 and res["threads"] == 1
    rows = res["memory"]
    assert [r["graph"] for r in rows] == [f"rmat:{s}:8" for s in gnn_bench.QUICK["scales"]][:len(rows)]
    stopped = False
    for r in rows:
        if stopped:   # the full-graph series stops after its first miss
            assert r["full_peak_bytes"] is None and "stopped" in r["full_note"]
        else:
            assert r["full_peak_bytes"] > 0 and r["full_fits"] == (r["full_peak_bytes"] <= budget)
            stopped = not r["full_fits"]
        if r["streamed_peak_bytes"] is not None:
            assert r["streamed_fits"] == (r["streamed_peak_bytes"] <= budget)
            # P is the smallest power of two choose_partitions finds for the budget, counted independently here
            case = gnn_bench.Case("gat", *map(int, r["graph"].split(":")[1:]))
            data = case.graph()
            prepared = build_gnn(case.config()).layers[0].prepare_edges(data.edge_index, data.num_nodes)
            assert r["num_edges"] == data.edge_index.shape[1] and r["num_nodes"] == data.num_nodes
            assert r["partitions"] == choose_partitions(data.num_nodes, prepared.shape[1], case.config(), budget,
                                                        edge_index=prepared)
    both = [r["graph"] for r in rows if r["full_fits"] and r["streamed_fits"]]
    assert [t["graph"] for t in res["throughput"]] == both and both
    for t in res["throughput"]:
        assert len(t["full_epochs_s"]) == len(t["streamed_epochs_s"]) == res["epochs"]
        assert t["streamed_epoch_s"] == statistics.median(t["streamed_epochs_s"][2:]) == t["measured_s"]
        assert t["full_epoch_s"] == statistics.median(t["full_epochs_s"][2:])
        assert t["streamed_edges_per_s"] == pytest.approx(t["num_edges"] / t["streamed_epoch_s"])
        assert t["throughput_ratio"] == pytest.approx(t["streamed_edges_per_s"] / t["full_edges_per_s"])
        assert t["throughput_met"] == (t["throughput_ratio"] >= gnn_bench.THROUGHPUT_TARGET)
        assert t["max_loss_diff"] < 1e-4   # the same model, trained from the same weights
        assert t["predicted_s"] > 0 and t["calibrated_s"] > 0 and t["plan_error"] is None
        assert t["prediction_error"] == pytest.approx(t["calibrated_s"] / t["measured_s"] - 1)
    (cap,) = res["capacity"]
    fit_full = [r for r in rows if r["full_fits"]]
    fit_streamed = [r for r in rows if r["streamed_fits"]]
    if cap["ratio"] is not None:
        assert cap["ratio"] == pytest.approx(fit_streamed[-1]["num_edges"] / fit_full[-1]["num_edges"])
        assert res["targets"]["capacity"]["met"] == (cap["ratio"] >= gnn_bench.CAPACITY_TARGET)
    assert res["targets"]["throughput"]["met"] == all(t["throughput_met"] for t in res["throughput"])
    # the table is printed from the same object
    gnn_bench._print_table(res)
    table = capsys.readouterr().out
    assert all(r["graph"] in table for r in rows) and "targets: capacity >= 10x" in table


def _row(graph, edges, full, streamed, budget=100):
    return {"model": "gat", "graph": graph, "num_nodes": edges // 10, "num_edges": edges,
            "full_peak_bytes": full, "full_fits": None if full is None else full <= budget,
            "streamed_peak_bytes": streamed, "streamed_fits": None if streamed is None else streamed <= budget,
            "predicted_vertex_bytes": edges // 10 * 3, "streamed_note": None if streamed else "not run"}


def test_capacity_compares_the_largest_fits_and_says_when_it_cannot():
    rows = [_row("a", 1000, 50, 60), _row("b", 2000, 150, 70), _row("c", 30000, None, 90), _row("d", 60000, None, None)]
    cap = gnn_bench.capacity(rows, 100)
    assert (cap["largest_full"], cap["largest_streamed"]) == ("a", "c")
    assert cap["ratio"] == 30.0 and cap["met"] is True and cap["note"].startswith("the streamed series stops at d")
    everything = gnn_bench.capacity([_row("a", 1000, 50, 60), _row("b", 2000, 60, 70)], 100)
    assert everything["ratio"] is None and everything["met"] is None and "extend --scales" in everything["note"]


@pytest.mark.parametrize("argv, message", [
    (["--models", "sage"], "--models 'sage'"),
    (["--scales", "14-12"], "--scales '14-12'"),
    (["--epochs", "2"], "--epochs >= 3"),
    (["--budget-mib", "0"], "--budget-mib must be positive"),
])
def test_bad_arguments_are_refused_in_one_sentence(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gnn_bench.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
