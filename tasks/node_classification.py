"""Node classification (issue 19, docs/gnn.md): the task, a full-graph trainer for any GNN, and the
features-only MLP baseline a GNN must beat to show that the edges carry information.

The setting is transductive, as for Cora (Kipf and Welling, "Semi-Supervised Classification with
Graph Convolutional Networks", ICLR 2017, section 5): the model sees every vertex's features and
every edge; the loss is the cross-entropy of the training vertices only (``data.train_mask``);
accuracy is measured on the validation and test vertices. Graphs come from :mod:`tasks.graphs`
(or any :class:`torch_geometric.data.Data` with ``x``, ``edge_index``, ``y`` and the three masks).

This is not a :class:`tasks.base.Task`: that API cuts batches of independent rows, while a GNN
step needs the whole graph (``edge_index`` has no row dimension). Streaming a graph through a
budget is the job of ``engine.gnn.partition`` and ``runtime.gnn.streaming``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.data import Data

from engine.errors import TaskError

__all__ = ["NodeClassificationTask", "Split", "features_only_mlp", "train_full_graph"]

log = logging.getLogger(__name__)

Split = Literal["train", "val", "test"]


class NodeClassificationTask:
    """Cross-entropy on the training vertices, accuracy on any split.

    Args:
        data: ``x`` float32 ``[N, F]``, ``edge_index`` int64 ``[2, E]``, ``y`` int64 ``[N]`` in
            ``0 .. C-1``, bool masks ``train_mask`` / ``val_mask`` / ``test_mask`` ``[N]`` (the
            training mask non-empty).

    Attributes:
        name: ``"node-classification"``.
        num_nodes, num_features, num_classes: N, F and C (``len(data.class_names)`` when present,
            else ``max(y) + 1``).

    Raises:
        TaskError: a field is missing or has the wrong shape or dtype, or no vertex is in the
            training mask.
    """

    name = "node-classification"

    def __init__(self, data: Data):
        x, y = getattr(data, "x", None), getattr(data, "y", None)
        ei = getattr(data, "edge_index", None)
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
            raise TaskError("node classification needs data.x, a float tensor [N, F] of vertex features")
        n = x.shape[0]
        if not isinstance(ei, torch.Tensor) or ei.dim() != 2 or ei.shape[0] != 2 or ei.dtype != torch.int64:
            raise TaskError("node classification needs data.edge_index, an int64 tensor [2, E]")
        if not isinstance(y, torch.Tensor) or y.shape != (n,) or y.dtype != torch.int64:
            raise TaskError(f"node classification needs data.y, an int64 tensor [{n}] of class labels")
        self.masks: dict[str, torch.Tensor] = {}
        for split in ("train", "val", "test"):
            m = getattr(data, f"{split}_mask", None)
            if not isinstance(m, torch.Tensor) or m.shape != (n,) or m.dtype != torch.bool:
                raise TaskError(f"node classification needs data.{split}_mask, a bool tensor [{n}]")
            self.masks[split] = m
        if not bool(self.masks["train"].any()):
            raise TaskError("data.train_mask selects no vertex; the loss needs at least one labelled vertex")
        names = getattr(data, "class_names", None)
        self.data = data
        self.num_nodes = int(n)
        self.num_features = int(x.shape[1])
        self.num_classes = len(names) if names is not None else int(y.max()) + 1
        if n and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
            raise TaskError(f"data.y holds labels outside 0..{self.num_classes - 1}")

    def _check_logits(self, logits: torch.Tensor) -> None:
        if logits.dim() != 2 or logits.shape[0] != self.num_nodes or logits.shape[1] < self.num_classes:
            raise TaskError(f"the model's output must be logits [{self.num_nodes}, >= {self.num_classes}], "
                            f"got {list(logits.shape)}; set the last layer's width to the number of classes")

    def loss(self, logits: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the training vertices: ``logits`` ``[N, C]`` -> float32 scalar.

        Raises:
            TaskError: ``logits`` is not ``[N, >= C]``.
        """
        self._check_logits(logits)
        m = self.masks["train"].to(logits.device)
        return F.cross_entropy(logits[m], self.data.y.to(logits.device)[m])

    def accuracy(self, logits: torch.Tensor, split: Split) -> float:
        """Share of the ``split`` vertices whose arg-max logit is their label (``nan`` for an empty split).

        Raises:
            TaskError: ``split`` is not train/val/test, or ``logits`` is not ``[N, >= C]``.
        """
        if split not in self.masks:
            raise TaskError(f"unknown split {split!r}; valid: 'train', 'val', 'test'")
        self._check_logits(logits)
        m = self.masks[split].to(logits.device)
        if not bool(m.any()):
            return float("nan")
        pred = logits[m].argmax(dim=1)
        return float((pred == self.data.y.to(logits.device)[m]).float().mean())

    def evaluate(self, logits: torch.Tensor) -> dict[str, float]:
        """``{"train_accuracy", "val_accuracy", "test_accuracy"}`` of one output ``[N, C]``."""
        return {f"{s}_accuracy": self.accuracy(logits, s) for s in ("train", "val", "test")}


def train_full_graph(model: nn.Module, data: Data, epochs: int = 200, lr: float = 0.01, seed: int = 0,
                     weight_decay: float = 5e-4) -> dict[str, Any]:
    """Train ``model`` on the whole graph with Adam, one step per epoch (Kipf and Welling's recipe).

    Each epoch: ``model.train()``, ``logits = model(x, edge_index)`` (``[N, C]``), the task's loss,
    backward, Adam step. After the last epoch the model is evaluated once in ``eval()`` mode under
    ``torch.no_grad``. The global RNG (dropout) is seeded with ``seed`` inside
    ``torch.random.fork_rng``, so the caller's RNG state is untouched; the model's initial weights
    are the caller's. Tensors are moved to the device of the model's first parameter.

    Args:
        model: any module with ``forward(x [N, F], edge_index [2, E]) -> [N, C]``.
        data: the graph (see :class:`NodeClassificationTask`).
        epochs: optimisation steps, >= 1.
        lr, weight_decay: Adam's learning rate and L2 penalty.
        seed: seeds dropout.

    Returns:
        ``{"train_accuracy", "val_accuracy", "test_accuracy"}`` (floats in [0, 1], after the last
        epoch), ``"losses"`` (the training loss of every epoch, floats), ``"epochs"``, and
        ``"seconds"`` (wall time of the training loop).

    Raises:
        TaskError: ``epochs < 1``, ``model`` has no parameters, or the data or the model's output
            is malformed (see :class:`NodeClassificationTask`).
    """
    if epochs < 1:
        raise TaskError(f"epochs={epochs} must be >= 1")
    params = list(model.parameters())
    if not params:
        raise TaskError("the model has no parameters to train")
    task = NodeClassificationTask(data)
    device = params[0].device
    x, edge_index = data.x.to(device), data.edge_index.to(device)
    losses: list[float] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
        t0 = time.perf_counter()
        for _ in range(epochs):
            model.train()
            opt.zero_grad(set_to_none=True)
            loss = task.loss(model(x, edge_index))
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        seconds = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        result: dict[str, Any] = task.evaluate(model(x, edge_index))
    result.update(losses=losses, epochs=epochs, seconds=seconds)
    log.info("%s on %s: train %.3f val %.3f test %.3f after %d epochs (%.1f s)", type(model).__name__,
             getattr(data, "name", "graph"), result["train_accuracy"], result["val_accuracy"],
             result["test_accuracy"], epochs, seconds)
    return result


class _FeaturesOnly(nn.Module):
    """Adapts an MLP on ``x`` to the ``forward(x, edge_index)`` signature; ignores the edges."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def features_only_mlp(data: Data, hidden: int = 64, epochs: int = 200, seed: int = 0, lr: float = 0.01,
                      dropout: float = 0.5, weight_decay: float = 5e-4) -> dict[str, Any]:
    """The features-only baseline: a 2-layer MLP on ``x`` that never sees the edges.

    ``nn.Sequential(Linear(F, hidden), ReLU, Dropout(dropout), Linear(hidden, C))``, initialised
    under ``torch.manual_seed(seed)`` (inside ``fork_rng``) and trained by :func:`train_full_graph`
    with the same recipe as a GNN (Adam, full batch, cross-entropy on the training mask), so a GNN
    of the same width compared with it differs only in using the graph.

    Returns:
        What :func:`train_full_graph` returns.

    Raises:
        TaskError: ``hidden < 1``, ``dropout`` outside [0, 1), or malformed data.
    """
    if hidden < 1:
        raise TaskError(f"hidden={hidden} must be >= 1")
    if not 0.0 <= dropout < 1.0:
        raise TaskError(f"dropout={dropout} must be in [0, 1)")
    task = NodeClassificationTask(data)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mlp = nn.Sequential(nn.Linear(task.num_features, hidden), nn.ReLU(), nn.Dropout(dropout),
                            nn.Linear(hidden, task.num_classes))
    return train_full_graph(_FeaturesOnly(mlp), data, epochs=epochs, lr=lr, seed=seed, weight_decay=weight_decay)
