"""Vertex-parallel chunk streaming on 2 gloo ranks equals single-process full-graph execution.

One ``torch.multiprocessing`` spawn (2 CPU processes, 1 thread each, gloo over 127.0.0.1) runs
every scenario on Zachary's karate club in float64: GCN and GAT, P in {2, 4}, balanced and uneven
interval assignments and one where rank 1 owns no interval; GraphSAGE (mean) and GIN, whose first
layer reads the features every rank has (no collective) and whose second all-gathers its input.
Per scenario each rank compares with the full-graph model (``GNNModel.forward``, the PyG-tested
reference): the gathered output, the gradients of the parameters and of the features (summed over
the ranks) and three Adam steps (losses, accuracies, parameters). The tests below assert on the differences it reports.
"""

from __future__ import annotations

import copy
import datetime
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from engine.errors import GNNError

WORLD = 2
SCENARIOS = [  # (kind, P, assignment)
    ("gcn", 2, [0, 1]),
    ("gcn", 4, [0, 0, 1, 1]),
    ("gcn", 4, [0, 0, 0, 1]),
    ("gat", 2, [0, 1]),
    ("gat", 4, [0, 1, 1, 1]),
    ("gat", 2, [0, 0]),
    ("sage", 4, [0, 0, 1, 1]),
    ("gin", 2, [0, 1]),
]
STEPS = 3


def _key(kind: str, p: int, assignment: list[int]) -> str:
    return f"{kind}/P{p}/" + "".join(map(str, assignment))


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max()) if a.numel() else 0.0


def _scenario(kind: str, p: int, assignment: list[int], res: dict) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from engine.gnn.models import GNNConfig, build_gnn
    from engine.gnn.partition import partition_for_model
    from runtime.gnn.distributed import CollectiveRecord, DistributedStreamedGNN
    from tasks.graphs import karate_club

    key = _key(kind, p, assignment)
    data = karate_club()
    x = data.x.double()
    ei, y = data.edge_index, data.y
    n = x.shape[0]
    masks = {"train": data.train_mask, "val": data.val_mask, "test": data.test_mask}
    torch.manual_seed(0)
    model = build_gnn(GNNConfig(kind, x.shape[1], 8, 4, 2, 2 if kind == "gat" else 1)).double()
    ref = copy.deepcopy(model)
    part = partition_for_model(model, ei, n, p)
    dsg = DistributedStreamedGNN(model, part, assignment)

    # forward: the gathered output equals the full graph's
    xd = x.clone().requires_grad_()
    out_own = dsg(xd)
    xr = x.clone().requires_grad_()
    out_ref = ref(xr, ei)
    res[f"{key}/rows"] = int(out_own.shape[0])
    res[f"{key}/own_rows"] = _maxdiff(out_own, out_ref[dsg.vertex_ids])
    res[f"{key}/out"] = _maxdiff(dsg.gather_output(out_own), out_ref)

    # backward of a weighted sum: parameter and feature gradients summed over the ranks
    w = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    (out_own * w[dsg.vertex_ids]).sum().backward()
    (out_ref * w).sum().backward()
    params = [q for q in model.parameters()]
    dsg.all_reduce_gradients(params)
    gx = xd.grad.clone()
    dist.all_reduce(gx)
    res[f"{key}/dx"] = _maxdiff(gx, xr.grad)
    res[f"{key}/dparams"] = max(_maxdiff(a.grad, b.grad) for a, b in zip(params, ref.parameters()))
    res[f"{key}/grad_scale"] = max(float(b.grad.abs().max()) for b in ref.parameters())
    layer_chunks = [(r.layer, r.phase, r.i, r.j) for r in dsg.reset_records()
                    if r.kind == "compute" and r.i >= 0]

    # three Adam steps against the full-graph training (mean cross-entropy over the training mask)
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=0.05)
    losses, ref_losses, accs, ref_accs, records = [], [], [], [], []
    for _ in range(STEPS):
        step = dsg.train_step(x, y, masks, opt)
        losses.append(step.loss)
        accs.append(step.accuracy)
        records.append(step.records)
        opt_ref.zero_grad(set_to_none=True)
        logits = ref(x, ei)
        loss = F.cross_entropy(logits[masks["train"]], y[masks["train"]])
        loss.backward()
        opt_ref.step()
        ref_losses.append(float(loss))
        pred = logits.argmax(1)
        ref_accs.append({s: float((pred[m] == y[m]).double().mean()) for s, m in masks.items()})
    res[f"{key}/losses"] = losses
    res[f"{key}/ref_losses"] = ref_losses
    res[f"{key}/accs"] = accs
    res[f"{key}/ref_accs"] = ref_accs
    res[f"{key}/params"] = max(_maxdiff(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    res[f"{key}/eval"] = dsg.evaluate(x, y, masks)
    with torch.no_grad():
        pred = ref(x, ei).argmax(1)
    res[f"{key}/ref_eval"] = {s: float((pred[m] == y[m]).double().mean()) for s, m in masks.items()}

    # what the records say (the last step's)
    recs = records[-1]
    res[f"{key}/collectives"] = sorted((r.layer, r.phase, r.op) for r in recs if isinstance(r, CollectiveRecord))
    res[f"{key}/kinds"] = sorted({r.kind for r in recs})
    res[f"{key}/chunks"] = sorted((r.layer, r.phase, r.i, r.j) for r in recs if r.kind == "compute" and r.i >= 0)
    res[f"{key}/first_chunks"] = sorted(layer_chunks)
    res[f"{key}/loads"] = sorted((r.layer, r.phase, r.i, r.j) for r in recs if r.kind == "load")
    res[f"{key}/intervals"] = dsg.intervals
    counts = part.chunk_edges()
    res[f"{key}/nonempty"] = [(i, j) for i in range(p) for j in range(p) if int(counts[i, j]) > 0]
    res[f"{key}/ordered"] = all(a.start <= b.start for a, b in zip(recs, recs[1:]))
    res[f"{key}/nonnegative"] = all(r.end >= r.start and r.bytes >= 0 for r in recs)


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    res: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        for kind, p, assignment in SCENARIOS:
            _scenario(kind, p, assignment, res)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test with it
        res["error"] = traceback.format_exc()
    path = os.path.join(out_dir, f"rank{rank}.pt")
    torch.save(res, path + ".tmp")
    os.replace(path + ".tmp", path)
    # skip interpreter teardown: gloo's background threads can abort in C++ static destructors
    os._exit(0)


def _spawn() -> list[dict]:
    from runtime.cluster import free_port

    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_worker, args=(free_port("127.0.0.1"), d), nprocs=WORLD, join=False,
                                 start_method="spawn")
        deadline = time.time() + 150
        crash = None
        try:
            while not ctx.join(timeout=2):
                if time.time() > deadline:
                    for proc in ctx.processes:
                        proc.kill()
                    pytest.fail("the distributed GNN workers timed out")
        except ProcessException as exc:
            crash = f"{type(exc).__name__}: {exc}"
        out = []
        for r in range(WORLD):
            path = os.path.join(d, f"rank{r}.pt")
            out.append(torch.load(path, weights_only=False) if os.path.exists(path)
                       else {"error": f"rank {r} wrote no results ({crash or 'no exit status'})"})
        return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    out = _spawn()
    for r, res in enumerate(out):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind,p,assignment", SCENARIOS)
def test_two_ranks_compute_what_the_full_graph_computes(results, kind, p, assignment):
    key = _key(kind, p, assignment)
    for res in results:
        assert res[f"{key}/own_rows"] < 1e-12 and res[f"{key}/out"] < 1e-12
        # gradients of O(1): float64 summation-order noise only
        assert res[f"{key}/grad_scale"] > 1e-3
        assert res[f"{key}/dparams"] <= 1e-10 * res[f"{key}/grad_scale"]
        assert res[f"{key}/dx"] < 1e-10
    assert sum(res[f"{key}/rows"] for res in results) == 34


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind,p,assignment", SCENARIOS)
def test_two_ranks_train_like_the_full_graph(results, kind, p, assignment):
    key = _key(kind, p, assignment)
    for res in results:
        torch.testing.assert_close(torch.tensor(res[f"{key}/losses"]), torch.tensor(res[f"{key}/ref_losses"]),
                                   rtol=1e-5, atol=0)
        assert res[f"{key}/params"] < 1e-8
        for got, want in zip(res[f"{key}/accs"], res[f"{key}/ref_accs"]):
            assert got == pytest.approx(want, abs=1e-12)
        assert res[f"{key}/eval"] == pytest.approx(res[f"{key}/ref_eval"], abs=1e-12)
    assert results[0][f"{key}/losses"] == results[1][f"{key}/losses"]
    assert results[0][f"{key}/ref_losses"][-1] < results[0][f"{key}/ref_losses"][0]  # training moved


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind,p,assignment", SCENARIOS)
def test_each_rank_streams_its_own_chunks_and_records_the_collectives(results, kind, p, assignment):
    key = _key(kind, p, assignment)
    for rank, res in enumerate(results):
        own = [j for j, a in enumerate(assignment) if a == rank]
        assert res[f"{key}/intervals"] == own
        mine = sorted((i, j) for i, j in res[f"{key}/nonempty"] if j in own)
        want = sorted((layer, ph, i, j) for layer in (0, 1) for ph in "FB" for i, j in mine)
        assert res[f"{key}/chunks"] == want and res[f"{key}/first_chunks"] == want
        assert res[f"{key}/loads"] == want
        # GCN and GAT transform their input first: each layer all-gathers h and reduce-scatters its
        # gradient; SAGE and GIN scatter their input, which the first layer has on every rank; the
        # step all-reduces the parameter gradients (B) and the loss and counts (F)
        layers = (0, 1) if kind in ("gcn", "gat") else (1,)
        assert res[f"{key}/collectives"] == sorted(
            [(layer, "F", "allgather") for layer in layers] + [(layer, "B", "reducescatter") for layer in layers]
            + [(-1, "B", "allreduce"), (-1, "F", "allreduce")])
        # (a rank without intervals still runs the collectives and the optimizer)
        assert res[f"{key}/kinds"] == (["collective", "compute", "load"] if own else ["collective", "compute"])
        assert res[f"{key}/ordered"] and res[f"{key}/nonnegative"]


def test_owned_rows_tile_the_vertices_in_rank_order():
    from runtime.gnn.distributed import owned_rows

    assert owned_rows([0, 3, 5, 9, 12], [0, 0, 1, 1], 2) == [(0, 5), (5, 12)]
    assert owned_rows([0, 3, 5, 9, 12], [0, 1, 1, 1], 3) == [(0, 3), (3, 12), (12, 12)]
    assert owned_rows([0, 3, 5], [1, 1], 2) == [(0, 0), (0, 5)]


@pytest.mark.parametrize("bounds,assignment,world,words", [
    ([0, 3, 5, 9, 12], [0, 1, 0, 1], 2, "contiguous run of intervals in rank order"),
    ([0, 3, 5], [0, 2], 2, "outside the 2 ranks"),
    ([0, 3, 5], [0, 1, 1], 2, "has 3 entries but the partition has P=2"),
])
def test_bad_assignments_are_refused_in_one_sentence(bounds, assignment, world, words):
    from runtime.gnn.distributed import owned_rows

    with pytest.raises(GNNError) as info:
        owned_rows(bounds, assignment, world)
    msg = str(info.value)
    assert words in msg and msg.endswith(".") and ". " not in msg


def test_restricted_partition_keeps_the_edges_into_its_intervals():
    from engine.gnn.partition import GraphPartition
    from runtime.gnn.distributed import restrict_partition
    from tasks.graphs import karate_club

    data = karate_club()
    part = GraphPartition.build(data.edge_index, 34, 4)
    sub = restrict_partition(part, [1, 2])
    full, kept = part.chunk_edges(), sub.chunk_edges()
    assert torch.equal(kept[:, 1:3], full[:, 1:3]) and int(kept[:, [0, 3]].sum()) == 0
    for i in range(4):
        for j in (1, 2):
            a, b = part.chunk(i, j), sub.chunk(i, j)
            assert torch.equal(a.src, b.src) and torch.equal(a.dst, b.dst) and torch.equal(a.edge_ids, b.edge_ids)
    assert restrict_partition(part, []).num_edges == 0
    with pytest.raises(GNNError, match="not a contiguous ascending run"):
        restrict_partition(part, [0, 2])
