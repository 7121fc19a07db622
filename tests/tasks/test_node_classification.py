"""tasks.node_classification: the loss and accuracies against a hand computation, refusals, the
full-graph trainer (deterministic, RNG-neutral, learns the karate club), and a 2-layer GCN that
beats the features-only MLP on the CPython code graph (PyG's GCN, and ours from engine.gnn.models)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.nn import GCN

from engine.errors import TaskError
from engine.gnn.models import GNNConfig, build_gnn
from tasks.graphs import cpython_code_graph, karate_club
from tasks.node_classification import NodeClassificationTask, features_only_mlp, train_full_graph

# the recipe of the GCN-vs-MLP comparison: one width, one budget for both
HIDDEN, EPOCHS, LR = 32, 60, 0.03


@pytest.fixture(scope="module")
def code_graph(code_graph_cache):
    return cpython_code_graph(cache_dir=code_graph_cache)


def test_loss_and_accuracy_against_a_hand_computation():
    data = karate_club()
    task = NodeClassificationTask(data)
    assert (task.num_nodes, task.num_features, task.num_classes) == (34, 34, 4)
    logits = torch.randn(34, 4, generator=torch.Generator().manual_seed(0))
    idx = data.train_mask.nonzero().flatten().tolist()
    by_hand = -sum(torch.log_softmax(logits[i], 0)[data.y[i]] for i in idx) / len(idx)
    assert torch.allclose(task.loss(logits), by_hand, atol=1e-6)
    for split, mask in (("train", data.train_mask), ("val", data.val_mask), ("test", data.test_mask)):
        rows = mask.nonzero().flatten().tolist()
        hits = sum(int(logits[i].argmax()) == int(data.y[i]) for i in rows)
        assert task.accuracy(logits, split) == pytest.approx(hits / len(rows))
    perfect = F.one_hot(data.y, 4).float()
    assert task.evaluate(perfect) == {"train_accuracy": 1.0, "val_accuracy": 1.0, "test_accuracy": 1.0}


def test_task_refuses_malformed_data_and_outputs():
    data = karate_club()
    task = NodeClassificationTask(data)
    with pytest.raises(TaskError, match=r"logits \[34, >= 4\]"):
        task.loss(torch.zeros(34, 3))
    with pytest.raises(TaskError, match="unknown split 'dev'"):
        task.accuracy(torch.zeros(34, 4), "dev")  # type: ignore[arg-type]
    empty = data.clone()
    empty.train_mask = torch.zeros(34, dtype=torch.bool)
    with pytest.raises(TaskError, match="selects no vertex"):
        NodeClassificationTask(empty)
    bad = data.clone()
    bad.y = bad.y.float()
    with pytest.raises(TaskError, match="int64"):
        NodeClassificationTask(bad)
    with pytest.raises(TaskError, match="epochs=0"):
        train_full_graph(GCN(34, 8, 2, 4), data, epochs=0)


def test_train_full_graph_learns_karate_deterministically_and_leaves_the_rng_alone():
    data = karate_club()

    def run():
        torch.manual_seed(1)
        model = GCN(34, 16, 2, 4, dropout=0.5)
        state = torch.random.get_rng_state()
        out = train_full_graph(model, data, epochs=100, lr=0.01, seed=3)
        assert torch.equal(torch.random.get_rng_state(), state)     # fork_rng: the caller's RNG untouched
        return out

    a, b = run(), run()
    assert a["losses"] == b["losses"] and a["test_accuracy"] == b["test_accuracy"]
    assert len(a["losses"]) == a["epochs"] == 100
    assert a["losses"][-1] < 0.5 * a["losses"][0]
    assert a["train_accuracy"] == 1.0


def _gcn(kind: str, data):
    classes = len(data.class_names)
    torch.manual_seed(0)
    if kind == "pyg":
        return GCN(data.num_features, HIDDEN, num_layers=2, out_channels=classes, dropout=0.5)
    return build_gnn(GNNConfig(kind="gcn", in_dim=data.num_features, hidden=HIDDEN, out_dim=classes, layers=2))


@pytest.fixture(scope="module")
def mlp_result(code_graph):
    return features_only_mlp(code_graph, hidden=HIDDEN, epochs=EPOCHS, lr=LR, seed=0)


@pytest.mark.parametrize("kind", ["pyg", "ours"])
def test_gcn_beats_the_features_only_mlp_on_the_code_graph(kind, code_graph, mlp_result):
    gcn = train_full_graph(_gcn(kind, code_graph), code_graph, epochs=EPOCHS, lr=LR, seed=0)
    majority = torch.bincount(code_graph.y[code_graph.test_mask]).max().item() / int(code_graph.test_mask.sum())
    msg = (f"{kind} GCN test {gcn['test_accuracy']:.3f} (val {gcn['val_accuracy']:.3f}) vs features-only MLP "
           f"test {mlp_result['test_accuracy']:.3f} (val {mlp_result['val_accuracy']:.3f}); majority {majority:.3f}")
    print(msg)
    assert mlp_result["test_accuracy"] > 2 * majority, msg               # the features carry the label
    assert gcn["test_accuracy"] > mlp_result["test_accuracy"] + 0.05, msg  # and the edges add to them
