"""The parts of a GNN plan that making it and simulating it both read: the graph's statistics
(:class:`GraphStats`), the steps and passes of a device's streaming schedule (:class:`Step`,
:class:`Pass`) and what the simulator needs of a plan (:class:`StreamingPlan`, which
:class:`engine.gnn.plan.GNNPlan` is).

Dependency direction: :mod:`engine.gnn.plan` and :mod:`engine.gnn.simulate` import this module;
the plan imports the simulation (to choose ``P`` and predict its metrics), never the reverse.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from engine.errors import GNNPlanError
from engine.gnn.cost import GNNCostModel, LayerShape

#: Kinds of a schedule step (see :class:`Step`).
STEP_KINDS = ("pre", "chunk", "apply", "allgather", "reducescatter", "allreduce", "optim")
#: The collective step kinds.
COLLECTIVE_STEPS = ("allgather", "reducescatter", "allreduce")


@dataclass(frozen=True)
class GraphStats:
    """The statistics of a graph a plan needs.

    Attributes:
        num_vertices: vertices N.
        num_edges: directed edges E (an undirected edge counts twice), without the self-loops a
            GCN or GAT layer adds.
        feature_dim: width of the input vertex features.
        num_classes: classes of the node-classification task (the model's output width).
    """

    num_vertices: int
    num_edges: int
    feature_dim: int
    num_classes: int

    def __post_init__(self) -> None:
        for name in ("num_vertices", "feature_dim", "num_classes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise GNNPlanError(f"graph {name} must be a positive integer, got {v!r}.")
        if isinstance(self.num_edges, bool) or not isinstance(self.num_edges, int) or self.num_edges < 0:
            raise GNNPlanError(f"graph num_edges must be a non-negative integer, got {self.num_edges!r}.")

    @classmethod
    def of(cls, obj: Any) -> "GraphStats":
        """Read the statistics from a :class:`GraphStats`, a dict or an object (``tasks.graphs.graph_stats``'s
        result) with ``num_vertices``/``num_nodes``, ``num_edges``, ``feature_dim``/``num_features``
        and ``num_classes``.

        Raises:
            GNNPlanError: a field is missing or not a positive integer.
        """
        if isinstance(obj, GraphStats):
            return obj
        names = {"num_vertices": ("num_vertices", "num_nodes"), "num_edges": ("num_edges",),
                 "feature_dim": ("feature_dim", "num_features", "feature_width"),
                 "num_classes": ("num_classes", "classes")}
        out: dict[str, Any] = {}
        for key, options in names.items():
            for o in options:
                v = obj.get(o) if isinstance(obj, dict) else getattr(obj, o, None)
                if v is not None:
                    out[key] = int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                    break
            else:
                raise GNNPlanError(f"graph statistics lack {key} (looked for {', '.join(options)}); pass "
                                   "tasks.graphs.graph_stats(spec) or a GraphStats.")
        return cls(**out)

    def to_dict(self) -> dict:
        """``{"num_vertices", "num_edges", "feature_dim", "num_classes"}``."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Step:
    """One step of a device's streaming schedule.

    Attributes:
        kind: ``"pre"`` (``apply_vertex_pre`` of destination interval ``j``; its backward in a
            backward pass), ``"chunk"`` (load chunk ``(i, j)`` on the load stream, then its
            Scatter/ApplyEdge/Gather, or their recomputation and backward, on the compute stream),
            ``"apply"`` (``apply_vertex`` of interval ``j``, or its backward), ``"allgather"``
            (the layer's vertex data from every device), ``"reducescatter"`` (the source gradients
            to their owners), ``"allreduce"`` (the parameter gradients) or ``"optim"`` (the
            optimizer step).
        i: source interval of a chunk; -1 otherwise.
        j: destination interval of a chunk, ``pre`` or ``apply``; -1 otherwise.
    """

    kind: str
    i: int = -1
    j: int = -1

    def to_json(self) -> list:
        """``[kind, i, j]``."""
        return [self.kind, self.i, self.j]


@dataclass
class Pass:
    """One layer's forward or backward on one device: its steps in order.

    Attributes:
        layer: the layer index (0 = first).
        phase: ``"F"`` (forward) or ``"B"`` (backward).
        steps: the ordered steps; loads follow the order of the ``chunk`` steps, one ahead of
            the compute (double buffering).
    """

    layer: int
    phase: str
    steps: list[Step]

    def to_dict(self) -> dict:
        """``{"layer", "phase", "steps": [[kind, i, j], ...]}``."""
        return {"layer": self.layer, "phase": self.phase, "steps": [s.to_json() for s in self.steps]}


class StreamingPlan(Protocol):
    """What :func:`engine.gnn.simulate.simulate_gnn` reads of a plan (see
    :class:`engine.gnn.plan.GNNPlan` for each field): the graph, ``P`` intervals and their chunks,
    which device owns which interval, every device's passes, the budget and the cost model."""

    graph: GraphStats
    num_devices: int
    intervals: list[int]
    chunk_edges: list[list[int]]
    assignment: list[int]
    budget_bytes: int
    schedule: list[list[Pass]]
    cost: GNNCostModel

    @property
    def layers(self) -> list[LayerShape]:
        """The per-layer costs."""

    def device_intervals(self, device: int) -> list[int]:
        """The destination intervals ``device`` owns, ascending."""

    def chunks(self, device: int | None = None) -> list[tuple[int, int]]:
        """Non-empty chunks ``(i, j)`` (of the destination intervals of ``device``, or all)."""


__all__ = ["COLLECTIVE_STEPS", "STEP_KINDS", "GraphStats", "Pass", "Step", "StreamingPlan"]
