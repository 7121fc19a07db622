"""The GNN characterization profiler: time per layer x SAGA-NN stage and per kernel class.

This reproduces the measurement of *Architectural Implications of Graph Neural Networks*
(Zhang et al., IEEE CAL 2020): GNN time is broken
down by the stages of NGra's SAGA-NN abstraction (Ma et al., USENIX ATC'19, section 3: Scatter,
ApplyEdge, Gather, ApplyVertex) and by the kind of kernel that runs (irregular, memory-bound
gathers/scatters versus dense matrix multiplication versus elementwise work), per model, per
layer, and for inference (the paper's setting) and training (forward + loss + backward, our
extension).

How it is measured (``torch.profiler``, the library's own hierarchical events):

- every layer of the model runs inside ``record_function("gnn.layer{k}")`` (forward pre/post
  hooks installed here, so the model code is untouched) and every SAGA stage inside the layer's
  own ``saga.scatter`` / ``saga.apply_edge`` / ``saga.gather`` / ``saga.apply_vertex`` ranges
  (``engine.gnn.saga``); the forward pass, the loss and the backward run in ``gnn.forward``,
  ``gnn.loss`` and ``gnn.backward``;
- each profiled event contributes its SELF time once (CPU: ``self_cpu_time_total``; CUDA:
  ``self_device_time_total``, the kernels it launched itself), so nothing is counted twice and
  the cells of a layer add up to the layer range's inclusive time;
- an event's stage is its innermost enclosing ``saga.*`` range (``"other"`` when it is in a
  layer but outside every stage, e.g. a bias add or an activation the layer runs itself), its
  layer the enclosing ``gnn.layer{k}`` (``"outside"`` for work between layers, e.g. the ReLU of
  :class:`engine.gnn.models.GNNModel`; ``"loss"`` for the loss);
- its kernel class comes from the op name (:func:`kernel_class`);
- backward ops are attributed to the forward stage that created them through autograd's sequence
  numbers: an ``autograd::engine::evaluate_function: XBackward0`` event carries the
  ``sequence_nr`` (and forward thread) of the forward op whose node it runs, so every op under it
  goes to that op's (layer, stage). Backward work no forward op owns (``AccumulateGrad`` of the
  parameters, the gradient seed) goes to (``"outside"``, ``"other"``);
  :attr:`Characterization.backward_attributed` is the attributed fraction.

All times are in seconds. Under the CPU profiler every op also pays the profiler's own
per-op bookkeeping, so small graphs look more overhead-heavy than they run unprofiled: read the
shares, not the absolute numbers, and compare models on the same machine.
"""

from __future__ import annotations

import logging
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import networkx as nx
import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from engine.errors import CharacterizeError

log = logging.getLogger(__name__)

#: SAGA-NN stages in execution order (NGra, section 3), then ``"other"`` (in a layer, outside every stage).
STAGES = ("scatter", "apply_edge", "gather", "apply_vertex", "other")
#: The graph-bound stages of the study (irregular memory access, one row per edge).
GRAPH_STAGES = ("scatter", "apply_edge", "gather")
#: Kernel classes: irregular gathers/scatters, dense matmuls, the remaining ATen ops, and the host
#: overhead (the self time of the profiler ranges and autograd nodes: Python and dispatch between ops).
KERNEL_CLASSES = ("gather_scatter", "matmul", "elementwise", "overhead")
#: Phases of a profiled step: the model's forward, the loss (training), the backward (training).
PHASES = ("forward", "loss", "backward")
MODES = ("inference", "training")
#: Layer label of the time outside every layer (activations between layers, grad seed, AccumulateGrad).
OUTSIDE = "outside"
#: Layer label of the loss (forward and its backward).
LOSS = "loss"

_GATHER_SCATTER = re.compile(
    r"^(index|index_select|index_select_backward|index_add|index_put|_index_put_impl|index_copy|index_reduce|"
    r"index_fill|take|put|gather|gather_backward|scatter\w*|_scatter\w*|segment\w*|_segment\w*|"
    r"embedding|embedding_backward|embedding_dense_backward|spmm\w*|_spmm\w*|sparse\w*|_sparse\w*|"
    r"sampled\w*|csr\w*|_csr\w*|sort|argsort|unique\w*|_unique\w*|bincount|histc)$")
_MATMUL = re.compile(
    r"^(mm|addmm|_addmm_activation|bmm|baddbmm|addbmm|matmul|linear|addmv|mv|dot|vdot|einsum|tensordot|"
    r"bilinear|_trilinear|segment_matmul|grouped_matmul|_grouped_mm|mkldnn_linear|_mkldnn\w*|mkldnn_matmul)$")
#: Namespaces of real tensor ops (anything else is a profiler range, an autograd node or runtime glue).
_OP_NAMESPACES = ("aten", "prims", "torch_scatter", "torch_sparse", "torch_cluster", "pyg", "quantized")

_LAYER_RANGE = re.compile(r"^gnn\.layer(\d+)$")
_EVALUATE = "autograd::engine::evaluate_function:"


def kernel_class(name: str) -> str:
    """The kernel class of a profiled event, from its name alone.

    ``gather_scatter``: ``index_select``, ``index``, ``index_add``, ``index_put``, ``gather``,
    ``scatter*`` (``scatter_add``, ``scatter_reduce``), ``segment*`` and sparse ops (the study's
    "graph" kernels); ``matmul``: ``mm``, ``addmm``, ``bmm``, ``matmul``, ``linear`` and their
    relatives; ``elementwise``: every other op of an op namespace (``aten::``, ``prims::``,
    ``torch_scatter::``, ...); ``overhead``: everything else (``record_function`` ranges, autograd
    nodes such as ``MulBackward0``, ``autograd::engine::evaluate_function: ...``).
    An in-place suffix ``_`` is ignored (``aten::index_add_`` is ``index_add``).
    """
    ns, sep, base = name.partition("::")
    if not sep or ns not in _OP_NAMESPACES:
        return "overhead"
    base = base.split(".")[0]
    if base.endswith("_") and not base.startswith("__"):
        base = base[:-1]
    if _GATHER_SCATTER.match(base):
        return "gather_scatter"
    if _MATMUL.match(base):
        return "matmul"
    return "elementwise"


@dataclass(frozen=True)
class ProfileGraph:
    """A graph to characterize on: ``edge_index: [2, E]`` (int64; row 0 source, row 1 destination,
    PyG's convention) over ``num_nodes`` vertices, with a display ``name``."""

    name: str
    edge_index: torch.Tensor
    num_nodes: int

    def __post_init__(self) -> None:
        ei = self.edge_index
        if not isinstance(ei, torch.Tensor) or ei.dim() != 2 or ei.size(0) != 2:
            raise CharacterizeError(f"graph {self.name!r}: edge_index must be a [2, E] tensor, got "
                                    f"{tuple(ei.shape) if isinstance(ei, torch.Tensor) else type(ei).__name__}.")
        if self.num_nodes < 1:
            raise CharacterizeError(f"graph {self.name!r}: num_nodes must be at least 1, got {self.num_nodes}.")
        if ei.numel() and (int(ei.min()) < 0 or int(ei.max()) >= self.num_nodes):
            raise CharacterizeError(f"graph {self.name!r}: edge_index refers to vertices outside "
                                    f"0..{self.num_nodes - 1}; pass the right num_nodes.")

    @property
    def num_edges(self) -> int:
        return int(self.edge_index.size(1))

    @property
    def avg_degree(self) -> float:
        """Average in-degree (= out-degree) E / N."""
        return self.num_edges / self.num_nodes

    @classmethod
    def erdos_renyi(cls, num_nodes: int, avg_degree: float, seed: int = 0, name: str | None = None) -> ProfileGraph:
        """A directed G(n, p) graph with ``p = avg_degree / (num_nodes - 1)`` (expected in/out-degree
        ``avg_degree``), from ``networkx.fast_gnp_random_graph`` (O(N + E), unlike PyG's O(N^2)
        ``erdos_renyi_graph``).

        Raises:
            CharacterizeError: ``num_nodes < 2`` or ``avg_degree`` outside ``(0, num_nodes - 1]``.
        """
        if num_nodes < 2:
            raise CharacterizeError(f"an Erdos-Renyi graph needs at least 2 vertices, got {num_nodes}.")
        if not 0 < avg_degree <= num_nodes - 1:
            raise CharacterizeError(f"the average degree of an Erdos-Renyi graph on {num_nodes} vertices must be in "
                                    f"(0, {num_nodes - 1}], got {avg_degree}.")
        g = nx.fast_gnp_random_graph(num_nodes, avg_degree / (num_nodes - 1), seed=seed, directed=True)
        return cls.from_networkx(g, name or f"er:{num_nodes}:{avg_degree:g}")

    @classmethod
    def from_networkx(cls, graph: Any, name: str) -> ProfileGraph:
        """A networkx graph (vertices relabelled 0..N-1 in iteration order; an undirected edge
        becomes both directions, as ``torch_geometric.utils.from_networkx`` does)."""
        g = nx.convert_node_labels_to_integers(graph)
        if not g.is_directed():
            g = g.to_directed()
        edges = list(g.edges())
        ei = torch.tensor(edges, dtype=torch.long).t().contiguous() if edges else torch.empty(2, 0, dtype=torch.long)
        return cls(name, ei, g.number_of_nodes())


Cell = tuple[str, str, str, str]  # (phase, layer, stage, kernel class)


@dataclass
class Characterization:
    """The profile of one model on one graph: seconds per (phase, layer, stage, kernel class).

    Attributes:
        model: the model's label (e.g. ``"gat"``).
        mode: ``"inference"`` (forward under ``no_grad``) or ``"training"`` (forward, loss, backward).
        device: ``"cpu"`` or ``"cuda"``; ``time_basis`` says which clock the seconds are
            (``"cpu self time"`` or ``"cuda kernel time"``).
        num_nodes, num_edges, in_dim: the input's ``N``, ``E`` and ``F_in``.
        layers: the layer labels ``["layer0", ...]``.
        samples: one dict per profiled repeat, ``(phase, layer, stage, kernel_class) -> seconds``
            (:data:`PHASES`, ``layer{k}`` / :data:`OUTSIDE` / :data:`LOSS`, :data:`STAGES`,
            :data:`KERNEL_CLASSES`); zero cells are left out.
        layer_totals: one dict per repeat, ``layer -> seconds``: the inclusive time of the
            forward ``gnn.layer{k}`` range as the profiler reports it (the independent total the
            stage cells must add up to).
        wall_seconds: the wall-clock time of each profiled step (profiler overhead included).
        backward_attributed: per repeat, the fraction of the backward time attributed to a forward
            op through autograd's sequence numbers (1.0 in inference).
        graph: the graph's name; ``meta``: free-form extra columns copied into :meth:`rows`.

    The accessors return the MEDIAN over repeats of the requested aggregate (so an aggregate is
    not the sum of per-cell medians, only nearly).
    """

    model: str
    mode: str
    device: str
    time_basis: str
    num_nodes: int
    num_edges: int
    in_dim: int
    layers: list[str]
    repeats: int
    warmup: int
    samples: list[dict[Cell, float]]
    layer_totals: list[dict[str, float]]
    wall_seconds: list[float]
    backward_attributed: list[float]
    graph: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def avg_degree(self) -> float:
        return self.num_edges / max(1, self.num_nodes)

    def _median(self, fn: Callable[[dict[Cell, float]], float]) -> float:
        return float(statistics.median(fn(s) for s in self.samples))

    def seconds(self, *, phase: str | None = None, layer: str | None = None, stage: str | None = None,
                kernel_class: str | None = None) -> float:
        """Median over repeats of the summed cells matching every given key (``None``: any)."""
        key = (phase, layer, stage, kernel_class)

        def total(s: dict[Cell, float]) -> float:
            return sum(v for c, v in s.items() if all(k is None or k == ck for k, ck in zip(key, c)))

        return self._median(total)

    def stage_seconds(self, phase: str = "forward") -> dict[str, dict[str, float]]:
        """``layer -> stage -> seconds`` of one phase (every layer, every stage, zeros included)."""
        labels = self.layers + [OUTSIDE] + ([LOSS] if phase != "forward" and self.mode == "training" else [])
        return {lay: {st: self.seconds(phase=phase, layer=lay, stage=st) for st in STAGES} for lay in labels}

    def class_seconds(self, phase: str | None = None) -> dict[str, dict[str, float]]:
        """``layer -> kernel class -> seconds`` of one phase (``None``: all phases)."""
        labels = self.layers + [OUTSIDE] + ([LOSS] if self.mode == "training" else [])
        return {lay: {k: self.seconds(phase=phase, layer=lay, kernel_class=k) for k in KERNEL_CLASSES}
                for lay in labels}

    def layers_stage_seconds(self, phase: str, stage: str) -> float:
        """Median over repeats of ``stage``'s time summed over the layers (not :data:`OUTSIDE` / :data:`LOSS`)."""
        def total(s: dict[Cell, float]) -> float:
            return sum(v for c, v in s.items() if c[0] == phase and c[2] == stage and c[1] in self.layers)

        return self._median(total)

    def layer_total_seconds(self) -> dict[str, float]:
        """``layer -> seconds``: median of the forward ``gnn.layer{k}`` range's own inclusive time."""
        return {lay: float(statistics.median(t.get(lay, 0.0) for t in self.layer_totals)) for lay in self.layers}

    def total_seconds(self) -> float:
        """Median over repeats of the whole profiled step (every phase)."""
        return self.seconds()

    def graph_stage_share(self, phase: str | None = "forward") -> float:
        """Fraction of the layers' time (``phase``; ``None``: forward + backward) spent in the graph
        stages (scatter, apply_edge, gather): the study's headline number per model."""
        def share(s: dict[Cell, float]) -> float:
            cells = [(c, v) for c, v in s.items() if (phase is None or c[0] == phase) and c[1] in self.layers]
            tot = sum(v for _, v in cells)
            return sum(v for c, v in cells if c[2] in GRAPH_STAGES) / tot if tot > 0 else 0.0

        return self._median(share)

    def class_share(self, kernel_class: str, phase: str | None = None) -> float:
        """Fraction of the step (``phase``; ``None``: all) spent in ``kernel_class``."""
        def share(s: dict[Cell, float]) -> float:
            cells = [(c, v) for c, v in s.items() if phase is None or c[0] == phase]
            tot = sum(v for _, v in cells)
            return sum(v for c, v in cells if c[3] == kernel_class) / tot if tot > 0 else 0.0

        return self._median(share)

    def header(self) -> dict[str, Any]:
        """The metadata columns every row carries."""
        return {"model": self.model, "graph": self.graph, "num_nodes": self.num_nodes, "num_edges": self.num_edges,
                "avg_degree": self.avg_degree, "in_dim": self.in_dim, "mode": self.mode, "device": self.device,
                **self.meta}

    def rows(self) -> list[dict[str, Any]]:
        """Tidy JSON-able rows, one per non-zero (phase, layer, stage, kernel class) cell:
        :meth:`header` + ``phase``, ``layer``, ``stage``, ``kernel_class``, ``seconds`` (median)."""
        cells = sorted({c for s in self.samples for c in s}, key=_cell_order)
        head = self.header()
        out = []
        for c in cells:
            sec = float(statistics.median(s.get(c, 0.0) for s in self.samples))
            if sec > 0:
                out.append({**head, "phase": c[0], "layer": c[1], "stage": c[2], "kernel_class": c[3],
                            "seconds": sec})
        return out

    def summary(self) -> dict[str, Any]:
        """One JSON-able dict: :meth:`header`, totals per stage (over the layers) and per kernel
        class, per phase, the graph-stage share, the layer totals and the wall time (seconds)."""
        phases = [p for p in PHASES if self.mode == "training" or p == "forward"]
        out: dict[str, Any] = self.header()
        out.update({
            "time_basis": self.time_basis, "repeats": self.repeats, "layers": list(self.layers),
            "total_seconds": self.total_seconds(),
            "wall_seconds": float(statistics.median(self.wall_seconds)),
            "stage_seconds": {p: {st: self.layers_stage_seconds(p, st) for st in STAGES}
                              for p in phases if p != "loss"},
            "class_seconds": {p: {k: self.seconds(phase=p, kernel_class=k) for k in KERNEL_CLASSES} for p in phases},
            "outside_seconds": {p: self.seconds(phase=p, layer=OUTSIDE) for p in phases},
            "graph_stage_share": self.graph_stage_share("forward"),
            "layer_total_seconds": self.layer_total_seconds(),
            "backward_attributed": float(statistics.median(self.backward_attributed)),
        })
        if self.mode == "training":
            out["loss_seconds"] = self.seconds(layer=LOSS)
            out["graph_stage_share_training"] = self.graph_stage_share(None)
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: :meth:`summary` plus ``rows``."""
        return {**self.summary(), "rows": self.rows()}


def _cell_order(c: Cell) -> tuple:
    lay = c[1]
    m = re.match(r"layer(\d+)$", lay)
    lay_key = (0, int(m.group(1))) if m else (1 if lay == OUTSIDE else 2, 0)
    return (PHASES.index(c[0]), lay_key, STAGES.index(c[2]), KERNEL_CLASSES.index(c[3]))


def find_layers(model: nn.Module) -> list[nn.Module]:
    """The model's layers in order: ``model.layers`` (a ``ModuleList`` of SAGA layers, as
    :class:`engine.gnn.models.GNNModel` has), else the model itself as one layer.

    Raises:
        CharacterizeError: ``model.layers`` exists but holds no module.
    """
    layers = getattr(model, "layers", None)
    if layers is None:
        return [model]
    found = [m for m in layers if isinstance(m, nn.Module)]
    if not found:
        raise CharacterizeError(f"{type(model).__name__}.layers holds no nn.Module; pass a model whose "
                                "layers attribute lists its SAGA layers.")
    return found


@contextmanager
def layer_ranges(layers: Sequence[nn.Module]) -> Iterator[None]:
    """Run every call of ``layers[k]`` inside ``record_function(f"gnn.layer{k}")`` (forward pre-hook
    opens it, an ``always_call`` forward hook closes it), and remove the hooks afterwards."""
    open_ranges: list[record_function] = []
    handles = []

    def opener(k: int) -> Callable:
        def hook(_mod: nn.Module, _args: Any) -> None:
            rf = record_function(f"gnn.layer{k}")
            rf.__enter__()
            open_ranges.append(rf)
        return hook

    def closer(_mod: nn.Module, _args: Any, _out: Any) -> None:
        if open_ranges:
            open_ranges.pop().__exit__(None, None, None)

    try:
        for k, lay in enumerate(layers):
            handles.append(lay.register_forward_pre_hook(opener(k)))
            handles.append(lay.register_forward_hook(closer, always_call=True))
        yield
    finally:
        for h in handles:
            h.remove()
        while open_ranges:
            open_ranges.pop().__exit__(None, None, None)


@dataclass
class _Ctx:
    phase: str | None = None
    layer: str = OUTSIDE
    stage: str = "other"
    node: Any = None  # the enclosing autograd::engine::evaluate_function event (backward)


def _stage_of(range_name: str) -> str:
    suffix = range_name[len("saga."):]
    for st in STAGES[:-1]:
        if suffix.startswith(st):
            return st
    return "other"


def _contexts(events: Iterable[Any]) -> dict[int, _Ctx]:
    """The (phase, layer, stage, autograd node) of every CPU event, from its enclosing ranges."""
    ctx: dict[int, _Ctx] = {}

    def of(e: Any) -> _Ctx:
        c = ctx.get(id(e))
        if c is not None:
            return c
        chain = []
        cur = e
        while cur is not None and id(cur) not in ctx:
            chain.append(cur)
            cur = cur.cpu_parent
        base = ctx[id(cur)] if cur is not None else _Ctx()
        for ev in reversed(chain):
            name = ev.name
            c = _Ctx(base.phase, base.layer, base.stage, base.node)
            if name == "gnn.forward":
                c.phase = "forward"
            elif name == "gnn.loss":
                c.phase, c.layer = "loss", LOSS
            elif name == "gnn.backward":
                c.phase = "backward"
            elif name.startswith(_EVALUATE):
                c.phase, c.node = "backward", ev
            elif name.startswith("saga."):
                c.stage = _stage_of(name)
            else:
                m = _LAYER_RANGE.match(name)
                if m:
                    c.layer, c.stage = f"layer{m.group(1)}", "other"
            ctx[id(ev)] = c
            base = c
        return ctx[id(e)]

    for e in events:
        of(e)
    return ctx


def _analyse(prof: profile, cuda: bool) -> tuple[dict[Cell, float], dict[str, float], float]:
    """One profiled step -> (cells, layer range totals, backward attributed fraction)."""
    events = [e for e in prof.events() if e.device_type == DeviceType.CPU and not e.is_async]
    ctx = _contexts(events)

    def self_s(e: Any) -> float:
        return (e.self_device_time_total if cuda else e.self_cpu_time_total) * 1e-6

    def total_s(e: Any) -> float:
        return (e.device_time_total if cuda else e.cpu_time_total) * 1e-6

    # Every op recorded before an autograd node is created carries the node's (peeked) sequence
    # number, the node's creator last (or its children, which start after it): the LAST forward
    # event with a number is in the creator's stage (e.g. ``edge_index[0]`` in "other" then the
    # ``index_select`` of ``saga.scatter`` both carry the IndexSelectBackward0 node's number).
    fwd_map: dict[tuple[int, int], tuple[str, str]] = {}
    layer_totals: dict[str, float] = defaultdict(float)
    for e in sorted(events, key=lambda ev: ev.time_range.start):
        c = ctx[id(e)]
        if c.phase in ("forward", "loss") and e.sequence_nr >= 0:
            fwd_map[(e.thread, e.sequence_nr)] = (c.layer, c.stage)
        if c.phase == "forward" and _LAYER_RANGE.match(e.name):
            layer_totals[c.layer] += total_s(e)

    cells: dict[Cell, float] = defaultdict(float)
    bwd_total = bwd_attr = 0.0
    for e in events:
        c = ctx[id(e)]
        sec = self_s(e)
        if sec <= 0 or c.phase is None:
            if sec > 0:
                log.debug("event %s outside gnn.forward/loss/backward (%.3g s) not counted", e.name, sec)
            continue
        layer, stage = c.layer, c.stage
        if c.phase == "backward":
            bwd_total += sec
            owner = fwd_map.get((c.node.fwd_thread, c.node.sequence_nr)) if c.node is not None else None
            if owner is not None:
                layer, stage = owner
                bwd_attr += sec
            else:
                layer, stage = OUTSIDE, "other"
        cells[(c.phase, layer, stage, kernel_class(e.name))] += sec
    return dict(cells), dict(layer_totals), (bwd_attr / bwd_total if bwd_total > 0 else 1.0)


@contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Point file descriptor 2 at ``/dev/null`` for the duration (only around the profiler's start and
    stop, whose kineto status lines would otherwise reach the user's terminal or notebook)."""
    fd = 2  # kineto writes to the process's descriptor 2, whatever sys.stderr is
    sys.stderr.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def characterize(model: nn.Module, x: torch.Tensor, edge_index: torch.Tensor, mode: str = "inference",
                 repeats: int = 5, warmup: int = 2, *, label: str | None = None, graph: str = "",
                 labels: torch.Tensor | None = None, seed: int = 0, threads: int | None = None,
                 meta: Mapping[str, Any] | None = None) -> Characterization:
    """Profile ``model(x, edge_index)`` and break its time down by layer x SAGA stage and kernel class.

    Args:
        model: a GNN whose ``layers`` (:func:`find_layers`) run their stages inside the
            ``saga.*`` ranges (``engine.gnn.saga``); called as ``model(x, edge_index)`` and
            returning ``[N, C]``.
        x: vertex features ``[N, F_in]`` (float; on the device to profile, CPU or CUDA).
        edge_index: ``[2, E]`` int64 on the same device (row 0 source, row 1 destination).
        mode: ``"inference"`` (``model.eval()``, ``torch.no_grad``) or ``"training"``
            (``model.train()``; forward, cross-entropy against ``labels``, backward; no optimizer step).
        repeats: profiled steps (>= 1); every time reported is the median over them.
        warmup: unprofiled steps first (>= 0).
        label: the model's name in the result (default: the class name).
        graph: the graph's name in the result.
        labels: ``[N]`` int64 class targets for training (default: uniform random, ``seed``).
        threads: CPU intra-op threads while profiling (``torch.set_num_threads``, restored after;
            ``None``: leave torch's setting). On a loaded machine, 1 avoids OpenMP threads waiting
            on descheduled peers, which inflates every parallel op (seen: 100x on 2 busy cores).
        meta: extra columns for :meth:`Characterization.rows` (e.g. ``{"width": 64}``).

    Returns:
        A :class:`Characterization` (seconds; CPU self time, or CUDA kernel time for CUDA inputs).

    Raises:
        CharacterizeError: an unknown mode, ``repeats < 1``, ``warmup < 0``, ``threads < 1``, a
            badly shaped ``x``, ``edge_index`` or output, or inputs on different devices.

    Source: the stage / kernel-class breakdown of *Architectural Implications of Graph Neural
    Networks* (Zhang et al., 2020), on NGra's SAGA-NN stages (ATC'19, section 3); measured with
    ``torch.profiler``.
    """
    if mode not in MODES:
        raise CharacterizeError(f"mode must be one of {', '.join(MODES)}, got {mode!r}.")
    if repeats < 1:
        raise CharacterizeError(f"repeats must be at least 1, got {repeats}.")
    if warmup < 0:
        raise CharacterizeError(f"warmup must be 0 or more, got {warmup}.")
    if threads is not None and threads < 1:
        raise CharacterizeError(f"threads must be at least 1 (or None for torch's setting), got {threads}.")
    if x.dim() != 2:
        raise CharacterizeError(f"x must be [N, F] vertex features, got shape {tuple(x.shape)}.")
    if edge_index.dim() != 2 or edge_index.size(0) != 2 or edge_index.dtype != torch.long:
        raise CharacterizeError(f"edge_index must be a [2, E] int64 tensor, got {edge_index.dtype} "
                                f"{tuple(edge_index.shape)}.")
    if x.device != edge_index.device:
        raise CharacterizeError(f"x is on {x.device} but edge_index on {edge_index.device}; move both to one device.")
    n = x.size(0)
    if edge_index.numel() and int(edge_index.max()) >= n:
        raise CharacterizeError(f"edge_index refers to vertex {int(edge_index.max())} but x has only {n} rows.")
    cuda = x.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    layers = find_layers(model)
    training = mode == "training"
    targets = labels

    def step() -> None:
        nonlocal targets
        if not training:
            with torch.no_grad(), record_function("gnn.forward"):
                model(x, edge_index)
            return
        model.zero_grad(set_to_none=True)
        with record_function("gnn.forward"):
            out = model(x, edge_index)
        if out.dim() != 2 or out.size(0) != n:
            raise CharacterizeError(f"training needs the model to return [N, C] = [{n}, C], got {tuple(out.shape)}.")
        if targets is None:
            gen = torch.Generator().manual_seed(seed)
            targets = torch.randint(out.size(1), (n,), generator=gen).to(out.device)
        with record_function("gnn.loss"):
            loss = nn.functional.cross_entropy(out, targets)
        with record_function("gnn.backward"):
            loss.backward()

    was_training = model.training
    prev_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    used_threads = torch.get_num_threads()
    model.train(training)
    samples, totals, walls, attributed = [], [], [], []
    try:
        with layer_ranges(layers):
            for _ in range(warmup):
                step()
            for _ in range(repeats):
                if cuda:
                    torch.cuda.synchronize(x.device)
                prof = profile(activities=activities)
                with _stderr_silenced():  # kineto writes "USDT: ... profiler_start/stop" lines to fd 2
                    prof.start()
                try:
                    t0 = time.perf_counter()
                    step()
                    if cuda:
                        torch.cuda.synchronize(x.device)
                    walls.append(time.perf_counter() - t0)
                finally:
                    with _stderr_silenced():
                        prof.stop()
                cells, lt, frac = _analyse(prof, cuda)
                samples.append(cells)
                totals.append(lt)
                attributed.append(frac)
    finally:
        torch.set_num_threads(prev_threads)
        model.train(was_training)
        if training:
            model.zero_grad(set_to_none=True)
    if not any(totals):
        log.warning("no gnn.layer ranges were profiled: %s does not call its layers as modules",
                    type(model).__name__)
    return Characterization(
        model=label or type(model).__name__, mode=mode, device=x.device.type,
        time_basis="cuda kernel time" if cuda else "cpu self time", num_nodes=n,
        num_edges=int(edge_index.size(1)), in_dim=int(x.size(1)), layers=[f"layer{k}" for k in range(len(layers))],
        repeats=repeats, warmup=warmup, samples=samples, layer_totals=totals, wall_seconds=walls,
        backward_attributed=attributed, graph=graph, meta={"threads": used_threads, **(meta or {})})


def sweep(kinds: Sequence[str], graphs: Sequence[ProfileGraph], widths: Sequence[int],
          modes: Sequence[str] = ("inference",), *, layers: int = 2, heads: int = 4, repeats: int = 3,
          warmup: int = 1, seed: int = 0, device: str | torch.device = "cpu",
          threads: int | None = None) -> list[dict[str, Any]]:
    """Characterize every model kind x graph x feature width x mode; the tidy rows of all of them.

    Each model is ``build_gnn(GNNConfig(kind, in_dim=width, hidden=width, out_dim=width, layers,
    heads))`` (``heads`` for ``gat``, 1 for the others; weights seeded by ``seed``) on features
    ``x ~ N(0, 1)`` of ``[N, width]``; the graphs vary size and average degree, ``widths`` the
    feature width: the three axes of the study.

    Returns:
        :meth:`Characterization.rows` of every run, concatenated, each with the extra columns
        ``width``, ``layers_n`` (layer count), ``heads`` and ``threads`` (see :func:`characterize`);
        seconds, medians over ``repeats``. ``width`` must be a multiple of ``heads`` (GAT).

    Raises:
        CharacterizeError: an empty axis, or an unknown kind (from ``engine.gnn.models``), or as
            :func:`characterize`.
    """
    from engine.gnn.models import GNNConfig, build_gnn

    for axis, vals in (("kinds", kinds), ("graphs", graphs), ("widths", widths), ("modes", modes)):
        if not vals:
            raise CharacterizeError(f"sweep needs at least one entry in {axis}.")
    rows: list[dict[str, Any]] = []
    dev = torch.device(device)
    for g in graphs:
        ei = g.edge_index.to(dev)
        for width in widths:
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(g.num_nodes, width, generator=gen).to(dev)
            for kind in kinds:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    model = build_gnn(GNNConfig(kind=kind, in_dim=width, hidden=width, out_dim=width,
                                                layers=layers, heads=heads if kind == "gat" else 1)).to(dev)
                for mode in modes:
                    c = characterize(model, x, ei, mode, repeats=repeats, warmup=warmup, label=kind, graph=g.name,
                                     seed=seed, threads=threads,
                                     meta={"width": width, "layers_n": layers, "heads": heads if kind == "gat" else 1})
                    log.info("characterized %s on %s (width %d, %s): %.3g s", kind, g.name, width, mode,
                             c.total_seconds())
                    rows.extend(c.rows())
    return rows


def pivot(rows: Iterable[Mapping[str, Any]], by: Sequence[str], column: str,
          where: Mapping[str, Any] | None = None) -> dict[tuple, dict[str, float]]:
    """Sum ``seconds`` of tidy rows into ``{tuple(row[k] for k in by): {row[column]: seconds}}``,
    keeping only rows whose fields equal every ``where`` item (insertion order kept).

    E.g. ``pivot(rows, ("model", "layer"), "stage", {"phase": "forward"})`` is the stacked-bar data.
    """
    out: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if where and any(r.get(k) != v for k, v in where.items()):
            continue
        key = tuple(r[k] for k in by)
        cell = out.setdefault(key, {})
        cell[r[column]] = cell.get(r[column], 0.0) + float(r["seconds"])
    return out


__all__ = ["GRAPH_STAGES", "KERNEL_CLASSES", "LOSS", "MODES", "OUTSIDE", "PHASES", "STAGES",
           "Characterization", "ProfileGraph", "characterize", "find_layers", "kernel_class", "layer_ranges", "pivot",
           "sweep"]
