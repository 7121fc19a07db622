"""GNN plans on Ray actors: a 2-rank launch trains exactly like single-process full-graph training,
a failing rank is named in one sentence, and ``tessel plan --gnn`` then ``tessel launch`` runs end to end.

The launches share one local Ray cluster (``ray_local``, tests/conftest.py) on the CPU/gloo path;
the NCCL path is the same code with one GPU per actor and runs only where there are two GPUs.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("ray")

from apps.cli import main  # noqa: E402
from engine.gnn.models import GNNConfig, build_gnn  # noqa: E402
from engine.gnn.plan import build_schedule, graph_from_spec, load_gnn_plan, make_gnn_plan, save_gnn_plan  # noqa: E402
from engine.gnn.simulate import simulate_gnn  # noqa: E402
from runtime.gnn.launcher import WEIGHT_DECAY, launch_gnn  # noqa: E402
from runtime.runner import LaunchError  # noqa: E402
from tasks.node_classification import train_full_graph  # noqa: E402

EPOCHS = 12


@pytest.fixture(scope="module")
def gat_plan():
    """GAT (2 heads) on karate, P = 4 intervals spread over 2 devices (balanced by edges)."""
    return make_gnn_plan(GNNConfig("gat", 34, 8, 4, 2, heads=2), "karate", devices=2, P=4, device_type="cpu",
                         epochs=EPOCHS, lr=0.05, seed=3)


def _reference(plan, epochs: int):
    """Single-process full-graph training: the same seed, initialisation, Adam and float64."""
    torch.manual_seed(plan.seed)
    model = build_gnn(plan.model).double()
    data = graph_from_spec(plan.graph_spec, plan.seed)
    data.x = data.x.double()
    out = train_full_graph(model, data, epochs=epochs, lr=plan.lr, seed=plan.seed, weight_decay=WEIGHT_DECAY)
    return model, out


def _check_against_reference(plan, res) -> None:
    model, ref = _reference(plan, EPOCHS)
    assert res.epochs == EPOCHS and len(res.losses) == EPOCHS
    assert res.losses[-1] < 0.8 * res.losses[0]                      # it trains
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref["losses"]), rtol=1e-6, atol=0)
    want = model.state_dict()
    assert set(res.parameters) == set(want)
    for name, value in res.parameters.items():
        torch.testing.assert_close(value, want[name], rtol=1e-4, atol=1e-7, msg=name)
    assert res.final_accuracy == pytest.approx(
        {s: ref[f"{s}_accuracy"] for s in ("train", "val", "test")}, abs=1e-6)   # its means are float32


@pytest.mark.timeout(180)
def test_two_rank_launch_trains_like_single_process_full_graph_training(gat_plan, ray_local):
    res = launch_gnn(gat_plan, EPOCHS, dtype="float64", device="cpu")
    assert res.backend == "gloo" and res.world_size == 2 and res.partitions == 4 and res.chunks_as_planned
    _check_against_reference(gat_plan, res)

    # the measured timeline: each rank's loads, computes and collectives; chunks only of its own intervals
    tl = res.timeline
    assert tl is not None and tl.source == "measured" and tl.num_devices == 2
    for rank in range(2):
        mine = [e for e in tl.events if e.rank == rank]
        assert {e.stream for e in mine} == {"load", "compute", "collective"}
        assert {e.op for e in mine} == {"LOAD", "F", "B", "OPTIM", "ALLGATHER", "REDUCESCATTER", "ALLREDUCE"}
        own = set(gat_plan.device_intervals(rank))
        chunks = [e.name for e in mine if " chunk " in e.name]
        want = {f"L{layer}{ph} chunk {i},{j}" for layer in (0, 1) for ph in "FB" for i, j in gat_plan.chunks(rank)}
        assert set(chunks) == want and len(chunks) == len(want) and {int(c.split(",")[-1]) for c in chunks} <= own
        assert sum(e.op == "ALLGATHER" for e in mine) == 2 and sum(e.op == "REDUCESCATTER" for e in mine) == 2
        assert all(e.end >= e.start >= 0 for e in mine)
    # predicted (the plan's simulation) next to measured and the calibrated prediction
    assert res.predicted_epoch_time == pytest.approx(simulate_gnn(gat_plan, check_memory=False).epoch_time)
    assert res.calibrated_plan is not None and res.calibrated_plan.cost.calibrated_from > 0
    assert res.calibrated_epoch_time == pytest.approx(res.calibrated_plan.metrics["epoch_time"])
    assert res.calibrated_epoch_time > 0 and res.measured_epoch_time > 0 and len(res.epoch_times) == EPOCHS
    json.dumps(res.to_dict())


@pytest.mark.timeout(120)
def test_a_failing_rank_is_named_in_one_sentence(gat_plan, ray_local):
    with pytest.raises(LaunchError) as info:
        launch_gnn(gat_plan, 3, device="cpu", step_timeout=30, fail_at=(1, 1))
    e = info.value
    msg = str(e)
    assert e.rank == 1 and e.step == 1 and e.kind == "raised"
    assert msg.startswith("rank 1 failed during epoch 1: RuntimeError: deliberate failure at epoch 1")
    assert "\n" not in msg


@pytest.mark.timeout(180)
def test_cli_plans_and_launches_a_gnn_end_to_end(tmp_path, capsys, ray_local):
    rc = main(["plan", "--gnn", "gcn", "--graph", "karate", "--devices", "2", "--device-type", "cpu", "--hidden",
               "8", "--epochs", "6", "--lr", "0.05", "-o", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()
    plan_path = tmp_path / "gnn_plan.json"
    rc = main(["launch", str(plan_path), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    plan = load_gnn_plan(plan_path)
    assert res["ok"] and res["epochs"] == plan.epochs == 6 and len(res["losses"]) == 6
    assert res["losses"][-1] < res["losses"][0] and res["world_size"] == 2 and res["backend"] == "gloo"
    assert res["predicted_epoch_time"] == pytest.approx(plan.metrics["epoch_time"])
    assert res["measured_epoch_time"] > 0 and res["calibrated_epoch_time"] > 0
    assert set(res["final_accuracy"]) == {"train", "val", "test"}
    rows = [r for r in map(str.split, out.splitlines()) if r and r[0].isdigit() and r[-1].endswith("x")]
    assert [int(r[0]) for r in rows] == list(range(6))
    assert [float(r[1]) for r in rows] == pytest.approx(res["losses"], abs=1e-4)
    trace = json.loads(open(res["trace_paths"]["measured"]).read())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"load", "compute", "collective"} <= tracks


def _one_sentence(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0].removeprefix("tessel launch: error: ")


def test_cli_refuses_bad_gnn_launches_in_one_sentence(tmp_path, capsys):
    plan = make_gnn_plan(GNNConfig("sage", 34, 8, 4, 2), "karate", devices=2, device_type="cpu", epochs=3)
    good = save_gnn_plan(plan, tmp_path / "gnn_plan.json")
    doc = json.loads(good.read_text())

    def launch(doc_or_path, *flags):
        path = doc_or_path
        if isinstance(doc_or_path, dict):
            path = tmp_path / "bad.json"
            path.write_text(json.dumps(doc_or_path))
        rc = main(["launch", str(path), *flags])
        return rc, _one_sentence(capsys.readouterr().err)

    rc, msg = launch({**doc, "partitions": "four"})
    assert rc == 2 and "partitions" in msg
    rc, msg = launch({**doc, "graph": {**doc["graph"], "spec": ""}})
    assert rc == 2 and "names no graph" in msg and msg.endswith(".")
    rc, msg = launch({**doc, "graph": {**doc["graph"], "num_edges": 150}})
    assert rc == 2 and "156 edges" in msg and "re-plan" in msg and msg.endswith(".")
    for flag in (["--resume"], ["--lr", "0.1"], ["--crossover"]):
        rc, msg = launch(good, *flag)
        assert rc == 2 and msg.startswith(f"{flag[0]} does not apply to a GNN plan") and msg.endswith(".")
    # a hand-edited plan that interleaves the devices' intervals (its schedule rebuilt to match) loads,
    # but the ranks' rows would not tile the vertices in rank order: refused before Ray starts
    p4 = make_gnn_plan(GNNConfig("sage", 34, 8, 4, 2), "karate", devices=2, P=4, device_type="cpu", epochs=3)
    p4.assignment = [0, 1, 0, 1]
    p4.schedule = build_schedule(p4.layers, p4.chunk_edges, p4.assignment, 2)
    rc, msg = launch(save_gnn_plan(p4, tmp_path / "interleaved.json"))
    assert rc == 2 and "contiguous run of intervals in rank order" in msg and msg.endswith(".")
    rc, msg = launch({"format": "tessel-plan", "version": 1}, "--epochs", "3")
    assert rc == 2 and msg.startswith("--epochs is for GNN plans") and msg.endswith(".")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL path needs two GPUs (one per rank); "
                                                          "this machine has fewer")
@pytest.mark.timeout(300)
def test_nccl_launch_trains_like_single_process(gat_plan, ray_local):
    res = launch_gnn(gat_plan, EPOCHS, dtype="float64", device="cuda")
    assert res.backend == "nccl"
    _check_against_reference(gat_plan, res)
