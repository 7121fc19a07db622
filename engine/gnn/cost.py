"""Cost model of chunk-streamed GNN training: chunk compute, chunk load, collectives, memory.

NGra (Ma et al., "NeuGraph: Parallel Deep Neural Network Computation on Large Graphs", USENIX
ATC 2019, sections 3-4) splits a layer into the SAGA-NN stages and streams P x P edge chunks
through the device; the GNN characterization study (the stage/kernel break-down of
``docs/gnn.md``) finds the graph stages (Scatter, Gather) memory-bound and the neural stages
(ApplyVertex, dense matmul) compute-bound. This module predicts, for one layer of a
:class:`~engine.gnn.models.GNNConfig`:

* a chunk's compute (Scatter + ApplyEdge + Gather of its ``e`` edges): ``e x`` the roofline time
  of one edge (``max(edge FLOPs / FLOP rate, edge bytes / memory bandwidth)``, FLOPs and bytes
  proportional to the message width), times a calibrated scale, plus a fixed per-chunk overhead
  (kernel launches, Python); the backward recomputes the chunk and back-propagates it
  (:data:`BACKWARD_EDGE_FACTOR` x the forward edge time);
* the dense per-vertex stages (``apply_vertex_pre``, e.g. GAT's ``W x``, and ``apply_vertex``):
  the roofline of their FLOPs over an interval's vertices, backward twice the forward;
* a chunk's load (host to device): its edge index plus the gathered vertex rows it reads,
  ``bytes / host bandwidth`` (PCIe for GPUs, the memory bandwidth for the CPU) plus a per-load
  overhead;
* collectives between layers for several devices (all-gather of the vertex data, reduce-scatter
  of the source gradients, all-reduce of the parameter gradients) from the project's ring
  alpha-beta model (:mod:`engine.cost.comm` through :class:`~engine.cost.model.CostModel`);
* memory: the resident vertex data, a chunk's loaded buffer and edge tensors, an accumulator.

Device FLOP rates and bandwidths come from the project's device table
(:mod:`engine.cost.devices`, ``cpu`` included). :meth:`GNNCostModel.calibrate` fits the scales and
overheads to measured chunk records of the streamed executor (``runtime/gnn/streaming.py``) by
non-negative least squares (``scipy.optimize.nnls``), as :mod:`engine.cost.calibrate` does for
pipeline blocks. Units: seconds, bytes, FLOPs.
"""

from __future__ import annotations

import bisect
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Sequence

import numpy as np

from engine.cost import roofline
from engine.cost.devices import DTYPE_BYTES, LINKS, canonical_dtype
from engine.cost.model import CostModel
from engine.envelope import FieldReader
from engine.errors import CostModelError

log = logging.getLogger(__name__)

#: Bytes of one edge's entry in a chunk's index (``src`` and ``dst`` local indices, int64).
INDEX_BYTES_PER_EDGE = 16
#: Bytes per vertex of the per-vertex attributes (in- and out-degree, int64) every device keeps.
VATTR_BYTES_PER_VERTEX = 16
#: Backward edge time / forward edge time: the chunk is recomputed (1x) and back-propagated (~2x).
BACKWARD_EDGE_FACTOR = 3.0
#: Backward dense time / forward dense time (input and weight gradients, one forward each).
BACKWARD_DENSE_FACTOR = 2.0
#: ATen kernels of one chunk's compute, forward and backward (index_select, the edge network,
#: the scatter-reduce and their autograd counterparts): the default per-chunk overhead is
#: this many launch overheads of the device.
KERNELS_PER_CHUNK = {"F": 6, "B": 16}
#: Fraction of a calibration group's records left out of its second fit (the worst explained).
TRIM = 0.1
#: Optimizer states per parameter (Adam: parameter, gradient, two moments).
ADAM_STATES = 4

#: Layer kinds that add one self-loop per vertex (``add_self_loops=True``, PyG's default).
SELF_LOOP_KINDS = ("gcn", "gat")
#: Accepted spellings of the layer kinds of :data:`engine.gnn.models.GNN_KINDS`.
KIND_ALIASES = {
    "gcn": "gcn", "gat": "gat", "sage": "sage", "graphsage": "sage", "gin": "gin",
    "gated": "gated-gcn", "gatedgcn": "gated-gcn", "gated-gcn": "gated-gcn", "gated_gcn": "gated-gcn",
    "resgated": "gated-gcn", "resgatedgcn": "gated-gcn",
}


@dataclass(frozen=True)
class LayerShape:
    """The costs of one GNN layer per vertex and per edge (float elements, FLOPs, bytes).

    Attributes:
        index: the layer's position in the model (0 = first).
        kind: canonical kind (``gcn``, ``gat``, ``sage``, ``gin``, ``gated-gcn``).
        in_dim, out_dim: feature widths of the layer's input and output vertex data.
        heads: attention heads (GAT), 1 otherwise.
        width: message width D: elements per edge of the gathered message.
        pre_width: elements per vertex written by ``apply_vertex_pre`` (0: the layer has none,
            its input rows are scattered directly).
        pre_flops: FLOPs per vertex of ``apply_vertex_pre``.
        post_flops: FLOPs per vertex of ``apply_vertex``.
        edge_flops: FLOPs per edge of Scatter + ApplyEdge + Gather.
        edge_traffic: bytes per edge those stages read and write in device memory.
        edge_tensor_bytes: bytes per edge resident at once while a chunk computes in the forward
            (its int64 index, the scattered rows, messages, logits, the gather's temporaries).
        edge_tensor_bytes_backward: the same while a chunk is recomputed and back-propagated
            (``chunk_surrogate`` and ``torch.autograd.grad``). Both after the peak resident set of
            one 500,000-edge chunk of each layer (``runtime.gnn.memory.measure_peak``, widths 64,
            GAT 4 heads), per edge: forward/backward gcn 561/1062, gat 623/1649, sage and gin
            290/772, gated-gcn 1281/2307 bytes; the formulas give 560/1072, 624/1648, 288/784,
            1296/2320.
        acc_width: elements per destination vertex of the gather accumulator (softmax: the
            weighted sum, a running max and a running sum per head).
        params: parameters of the layer.
        self_loops: the layer replaces the graph's self-loops by one per vertex (GCN, GAT, as PyG's
            ``add_self_loops=True``), so each diagonal chunk ``(i, i)`` has ``|interval i|`` more edges.
    """

    index: int
    kind: str
    in_dim: int
    out_dim: int
    heads: int
    width: int
    pre_width: int
    pre_flops: float
    post_flops: float
    edge_flops: float
    edge_traffic: float
    edge_tensor_bytes: float
    edge_tensor_bytes_backward: float
    acc_width: int
    params: int
    self_loops: bool = False

    @property
    def has_pre(self) -> bool:
        """The layer has a dense ``apply_vertex_pre`` (its vertex data is transformed before scattering)."""
        return self.pre_width > 0

    @property
    def vertex_width(self) -> int:
        """Elements per vertex of the vertex data the layer's chunks read (``h``: the
        ``apply_vertex_pre`` output, else the layer's input); what a chunk load takes rows of
        and what an all-gather brings."""
        return self.pre_width if self.has_pre else self.in_dim


def canonical_kind(kind: str) -> str:
    """``"GraphSAGE"`` -> ``"sage"``, ``"gated_gcn"`` -> ``"gated-gcn"`` (see :data:`KIND_ALIASES`).

    Raises:
        CostModelError (a ValueError): an unknown kind; the message lists the known ones.
    """
    k = str(kind).strip().lower()
    if k not in KIND_ALIASES:
        raise CostModelError(f"unknown GNN layer kind {kind!r}; the cost model knows {sorted(set(KIND_ALIASES))}")
    return KIND_ALIASES[k]


def _shape(index: int, kind: str, a: int, b: int, heads: int, elem: int, concat: bool = True) -> LayerShape:
    """One layer's :class:`LayerShape` for input width ``a``, output width ``b`` (see the table in
    :func:`layer_shapes`)."""
    idx = INDEX_BYTES_PER_EDGE
    if kind == "gcn":        # GCNLayer: h = W x; msg = deg^-1/2 deg^-1/2 h[src] (degrees per edge); sum; + bias
        return LayerShape(index, kind, a, b, 1, width=b, pre_width=b, pre_flops=2.0 * a * b, post_flops=b,
                          edge_flops=4.0 * b, edge_traffic=elem * 5.0 * b + idx + 2 * VATTR_BYTES_PER_VERTEX,
                          edge_tensor_bytes=elem * (2.0 * b + 8) + idx,
                          edge_tensor_bytes_backward=elem * (4.0 * b + 8) + idx, acc_width=b, params=a * b + b)
    if kind == "sage":       # SAGELayer (mean): agg = mean x[src]; out = lin_l(agg) + lin_r(x_dst)
        return LayerShape(index, kind, a, b, 1, width=a, pre_width=0, pre_flops=0.0, post_flops=4.0 * a * b + 2.0 * b,
                          edge_flops=1.0 * a, edge_traffic=elem * 4.0 * a + idx,
                          edge_tensor_bytes=elem * (a + 4.0) + idx, edge_tensor_bytes_backward=elem * 3.0 * a + idx,
                          acc_width=a, params=2 * a * b + b)
    if kind == "gin":        # GINLayer: agg = sum x[src]; out = MLP(agg + (1 + eps) x_dst), MLP = Lin ReLU Lin
        return LayerShape(index, kind, a, b, 1, width=a, pre_width=0, pre_flops=0.0,
                          post_flops=2.0 * a * b + 2.0 * b * b + 2.0 * a + 2.0 * b, edge_flops=1.0 * a,
                          edge_traffic=elem * 4.0 * a + idx, edge_tensor_bytes=elem * (a + 4.0) + idx,
                          edge_tensor_bytes_backward=elem * 3.0 * a + idx, acc_width=a, params=a * b + b * b + 2 * b)
    if kind == "gat":        # GATLayer: h = [W x | a_src | a_dst]; logit = leaky(a_src[src] + a_dst[dst]); softmax
        h = heads
        w = b if concat else b * h   # message width heads * head_dim (averaged over heads when not concatenated)
        return LayerShape(index, kind, a, b, h, width=w, pre_width=w + 2 * h, pre_flops=2.0 * a * w + 4.0 * w,
                          post_flops=1.0 * w, edge_flops=2.0 * w + 8.0 * h,
                          edge_traffic=elem * (5.0 * w + 6.0 * h) + idx,
                          edge_tensor_bytes=elem * (2.0 * w + 6.0 * h) + idx,
                          edge_tensor_bytes_backward=elem * (6.0 * w + 6.0 * h) + idx, acc_width=w + 2 * h,
                          params=a * w + 2 * w + b)
    if kind == "gated-gcn":  # GatedGCNLayer: h = [K x | Q x | V x]; msg = sigmoid(K x_dst + Q x_src) V x_src; sum;
        #                      out = agg + lin_skip(x_dst) + bias
        return LayerShape(index, kind, a, b, 1, width=b, pre_width=3 * b, pre_flops=6.0 * a * b,
                          post_flops=2.0 * a * b + 2.0 * b, edge_flops=5.0 * b, edge_traffic=elem * 7.0 * b + idx,
                          edge_tensor_bytes=elem * 5.0 * b + idx, edge_tensor_bytes_backward=elem * 9.0 * b + idx,
                          acc_width=b, params=4 * a * b + 4 * b)
    raise CostModelError(f"unknown GNN layer kind {kind!r}")  # pragma: no cover - canonical_kind first


def layer_shapes(model: Any, dtype: str = "float32") -> list[LayerShape]:
    """The :class:`LayerShape` of every layer of ``model`` (a ``GNNConfig``: ``kind``, ``in_dim``,
    ``hidden``, ``out_dim``, ``layers``, ``heads``).

    Layer ``l`` maps ``in_dim`` (``l == 0``) or ``hidden`` to ``hidden``, the last one to
    ``out_dim``. Per kind (``a`` in, ``b`` out, ``h`` heads; FLOPs of a multiply-add = 2), after the
    PyTorch Geometric layers the project's SAGA-NN layers are tested against:

    ==========  ==================  =======  =====================  =====================
    kind        apply_vertex_pre    D        edge FLOPs             apply_vertex FLOPs
    ==========  ==================  =======  =====================  =====================
    gcn         2ab (``x W``)       b        2b (norm, sum)         b (bias)
    sage        --                  a        a (mean)               4ab + 2b (two linears)
    gin         --                  a        a (sum)                2ab + 2b^2 (MLP)
    gat         2ab + 4b            b        2b + 8h (softmax)      b
    gated-gcn   6ab (k, q, v)       b        5b (gate, sum)         2ab + 2b (skip)
    ==========  ==================  =======  =====================  =====================

    Raises:
        CostModelError (a ValueError): an unknown kind, fewer than one layer, a non-positive width
            or a dtype the cost model does not know.
    """
    kind = canonical_kind(getattr(model, "kind", ""))
    dims = [int(getattr(model, f)) for f in ("in_dim", "hidden", "out_dim", "layers")]
    if min(dims) < 1:
        raise CostModelError(f"a GNN needs positive in_dim, hidden, out_dim and layers, got {dims}")
    in_dim, hidden, out_dim, layers = dims
    heads = max(1, int(getattr(model, "heads", 1) or 1))
    d = canonical_dtype(dtype)
    if d not in DTYPE_BYTES:
        raise CostModelError(f"unknown dtype {dtype!r}; valid dtypes: {sorted(DTYPE_BYTES)}")
    elem = DTYPE_BYTES[d]
    widths = [in_dim] + [hidden] * (layers - 1) + [out_dim]
    loops = kind in SELF_LOOP_KINDS
    # GAT's hidden layers concatenate heads of hidden // heads channels; its last layer averages heads of out_dim
    return [replace(_shape(i, kind, widths[i], widths[i + 1], heads, elem, concat=i < layers - 1), self_loops=loops)
            for i in range(layers)]


def _default_coefficients(device_launch: float) -> dict[str, float]:
    return {
        "edge_scale_F": 1.0, "edge_scale_B": 1.0,
        "chunk_overhead_F": KERNELS_PER_CHUNK["F"] * device_launch,
        "chunk_overhead_B": KERNELS_PER_CHUNK["B"] * device_launch,
        "vertex_scale_F": 1.0, "vertex_scale_B": 1.0,
        "vertex_overhead_F": 2 * device_launch, "vertex_overhead_B": 4 * device_launch,
        "load_scale_index": 1.0, "load_scale_rows": 1.0, "load_overhead": device_launch,
        "epoch_overhead": 0.0,
    }


#: Names of the coefficients :meth:`GNNCostModel.calibrate` fits (see :attr:`GNNCostModel.coefficients`).
COEFFICIENTS = tuple(_default_coefficients(0.0))


@dataclass
class GNNCostModel:
    """Predicted times and memory of chunk-streamed GNN training on one kind of device.

    Attributes:
        base: the project's cost model (:class:`~engine.cost.model.CostModel`): the device (FLOP
            rate, memory bandwidth, launch overhead), the links and the collectives.
        host_bandwidth: bytes/s of a chunk load from host memory: the PCIe link for a GPU
            (:data:`engine.cost.devices.LINKS` ``pcie``), the memory bandwidth for the CPU.
        coefficients: the calibrated scales and overheads (defaults: scales 1, overheads a few
            kernel launches): ``edge_scale_F/B`` (x the roofline edge time), ``chunk_overhead_F/B``
            (seconds per chunk compute), ``vertex_scale_F/B`` and ``vertex_overhead_F/B`` (dense
            per-vertex stages), ``load_scale_index`` and ``load_scale_rows`` (x index and row bytes /
            host bandwidth) and ``load_overhead`` (seconds per load), ``epoch_overhead`` (seconds per
            epoch of work no chunk record covers: the loss, the dense stages' backward inside
            autograd, the optimizer's Python; :meth:`engine.gnn.plan.GNNPlan.calibrated` sets it
            from measured epoch times).
        calibrated_from: measured records the coefficients were fitted to (0: not calibrated).
    """

    base: CostModel
    host_bandwidth: float
    coefficients: dict[str, float] = field(default_factory=dict)
    calibrated_from: int = 0

    def __post_init__(self) -> None:
        if not self.host_bandwidth > 0:
            raise CostModelError(f"host_bandwidth must be positive bytes/s, got {self.host_bandwidth}")
        full = _default_coefficients(self.base.device.launch_overhead)
        unknown = sorted(set(self.coefficients) - set(full))
        if unknown:
            raise CostModelError(f"unknown GNN cost coefficients {unknown}; known: {list(full)}")
        full.update({k: float(v) for k, v in self.coefficients.items()})
        bad = [k for k, v in full.items() if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise CostModelError(f"GNN cost coefficients {bad} must be finite and >= 0")
        self.coefficients = full

    @classmethod
    def for_device(cls, name: str = "h100", link: str | None = None, dtype: str = "float32") -> "GNNCostModel":
        """The uncalibrated model of a table device (``h100``, ``a100``, ``cpu``; see
        :meth:`CostModel.for_device` for ``link``).

        Raises:
            CostModelError (a ValueError): an unknown device, link or dtype (the message lists the valid names).
        """
        base = CostModel.for_device(name, link, dtype=dtype)
        host = base.device.mem_bandwidth * base.device.bw_efficiency if base.device.name == "cpu" \
            else LINKS["pcie"].bandwidth
        return cls(base, host)

    # ------------------------------------------------------------ per-layer times
    @property
    def elem_bytes(self) -> int:
        """Bytes per element of the vertex and edge data (the cost model's dtype)."""
        return DTYPE_BYTES.get(self.base.dtype, 4)

    def _roofline(self, flops: float, nbytes: float) -> float:
        return roofline.op_time(flops, nbytes, self.base.device, self.base.dtype, launch_overhead=0.0)

    def edge_time(self, layer: LayerShape) -> float:
        """Seconds of one edge's Scatter + ApplyEdge + Gather in the forward, before calibration:
        ``max(edge_flops / FLOP rate, edge_traffic / memory bandwidth)``."""
        return self._roofline(layer.edge_flops, layer.edge_traffic)

    def chunk_compute_time(self, layer: LayerShape, edges: int, phase: str) -> float:
        """Seconds of one chunk's compute: ``edge_scale x edges x edge_time (x``
        :data:`BACKWARD_EDGE_FACTOR` ``for "B") + chunk_overhead``; 0.0 for an empty chunk.

        Args:
            layer: the layer.
            edges: edges in the chunk.
            phase: ``"F"`` (forward) or ``"B"`` (backward: recompute + back-propagate).

        Raises:
            CostModelError (a ValueError): another phase or a negative edge count.
        """
        ph = _phase(phase)
        if edges < 0:
            raise CostModelError(f"a chunk has >= 0 edges, got {edges}")
        if edges == 0:
            return 0.0
        factor = BACKWARD_EDGE_FACTOR if ph == "B" else 1.0
        c = self.coefficients
        return c[f"edge_scale_{ph}"] * factor * edges * self.edge_time(layer) + c[f"chunk_overhead_{ph}"]

    def dense_time(self, layer: LayerShape, vertices: int, stage: str, phase: str) -> float:
        """Seconds of a dense per-vertex stage over ``vertices`` vertices: ``stage`` ``"pre"``
        (``apply_vertex_pre``) or ``"apply"`` (``apply_vertex``); the roofline of its FLOPs and of
        reading its input and writing its output rows, x ``vertex_scale``
        (x :data:`BACKWARD_DENSE_FACTOR` for ``"B"``) ``+ vertex_overhead``. 0.0 for a layer
        without that stage or no vertices.

        Raises:
            CostModelError (a ValueError): an unknown stage or phase.
        """
        ph = _phase(phase)
        flops, rows = self._dense_work(layer, stage)
        if vertices <= 0 or flops <= 0:
            return 0.0
        factor = BACKWARD_DENSE_FACTOR if ph == "B" else 1.0
        c = self.coefficients
        t = self._roofline(vertices * flops, vertices * rows * self.elem_bytes)
        return c[f"vertex_scale_{ph}"] * factor * t + c[f"vertex_overhead_{ph}"]

    @staticmethod
    def _dense_work(layer: LayerShape, stage: str) -> tuple[float, int]:
        """``(FLOPs, elements read and written)`` per vertex of a dense stage."""
        if stage == "pre":
            return layer.pre_flops, layer.in_dim + layer.pre_width
        if stage == "apply":
            return layer.post_flops, layer.width + layer.in_dim + layer.out_dim
        raise CostModelError(f"unknown dense stage {stage!r}; use 'pre' or 'apply'")

    def chunk_load(self, layer: LayerShape, edges: int, n_src: int, n_dst: int, phase: str) -> tuple[int, int]:
        """``(index_bytes, row_bytes)`` a chunk load brings to the device: its edge index
        (:data:`INDEX_BYTES_PER_EDGE` per edge, int64 ``src`` and ``dst``) and the vertex rows it
        reads: ``h`` (``vertex_width`` elements) of the source and the destination interval, and in the
        backward the destination interval's aggregate gradient (``width``), as the streamed executor
        takes them (``runtime/gnn/streaming.py``). ``(0, 0)`` for an empty chunk."""
        if edges <= 0:
            return 0, 0
        rows = (n_src + n_dst) * layer.vertex_width
        if _phase(phase) == "B":
            rows += n_dst * layer.width
        return int(edges * INDEX_BYTES_PER_EDGE), int(rows * self.elem_bytes)

    def chunk_load_bytes(self, layer: LayerShape, edges: int, n_src: int, n_dst: int, phase: str) -> int:
        """Bytes of a chunk load (index and rows, :meth:`chunk_load`); what its buffer holds."""
        return sum(self.chunk_load(layer, edges, n_src, n_dst, phase))

    def load_time(self, index_bytes: int, row_bytes: int = 0) -> float:
        """Seconds of one chunk load: ``(load_scale_index x index_bytes + load_scale_rows x row_bytes)
        / host_bandwidth + load_overhead`` (0.0 for nothing). The two scales differ where the index
        and the rows cost differently (on the CPU the rows are views of resident vertex data and the
        index an int32 -> int64 copy)."""
        if index_bytes <= 0 and row_bytes <= 0:
            return 0.0
        c = self.coefficients
        return ((c["load_scale_index"] * index_bytes + c["load_scale_rows"] * row_bytes) / self.host_bandwidth
                + c["load_overhead"])

    def collective_time(self, kind: str, nbytes: int, devices: int) -> float:
        """Seconds of a ring collective (``allgather``, ``reducescatter``, ``allreduce``) of
        ``nbytes`` full-tensor bytes over ``devices`` ranks (:meth:`CostModel.collective_time`)."""
        return self.base.collective_time(kind, int(nbytes), list(range(max(1, devices))))

    def optimizer_time(self, param_bytes: int) -> float:
        """Seconds of one Adam step over ``param_bytes`` (:meth:`CostModel.optimizer_time`)."""
        return self.base.optimizer_time(int(param_bytes))

    # ------------------------------------------------------------ memory
    def chunk_edge_bytes(self, layer: LayerShape, edges: int, phase: str) -> int:
        """Bytes of a chunk's edge tensors while it computes: ``edges x edge_tensor_bytes`` in the
        forward, ``edges x edge_tensor_bytes_backward`` in the backward (recomputed tensors and their
        gradients)."""
        per_edge = layer.edge_tensor_bytes_backward if _phase(phase) == "B" else layer.edge_tensor_bytes
        return int(edges * per_edge)

    def accumulator_bytes(self, layer: LayerShape, n_dst: int) -> int:
        """Bytes of the gather accumulator of a destination interval of ``n_dst`` vertices."""
        return int(n_dst * layer.acc_width * self.elem_bytes)

    # ------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        """JSON form: ``base`` (:meth:`CostModel.to_dict`), ``host_bandwidth``, ``coefficients``,
        ``calibrated_from``; :meth:`from_dict` restores an equal model."""
        return {"base": self.base.to_dict(), "host_bandwidth": self.host_bandwidth,
                "coefficients": dict(self.coefficients), "calibrated_from": self.calibrated_from}

    @classmethod
    def from_dict(cls, d: Any, fields: FieldReader, path: str = "cost") -> "GNNCostModel":
        """Inverse of :meth:`to_dict`; errors are ``fields``' class and name the field path.

        Raises:
            the reader's error class: a missing or malformed field (e.g. ``cost.coefficients.load_overhead``).
        """
        num = (int, float)
        base_d = fields.need(d, "base", dict, f"{path}.base")
        try:
            base = CostModel.from_dict(base_d, path=f"{path}.base")
        except CostModelError as e:
            raise fields.fail(f"{path}.base", f": {e}") from None
        host = float(fields.need(d, "host_bandwidth", num, f"{path}.host_bandwidth"))
        coeffs = fields.need(d, "coefficients", dict, f"{path}.coefficients")
        for k in coeffs:
            fields.need(coeffs, k, num, f"{path}.coefficients.{k}")
        calibrated = int(fields.optional(d, "calibrated_from", int, f"{path}.calibrated_from", 0))
        try:
            return cls(base, host, {str(k): float(v) for k, v in coeffs.items()}, calibrated)
        except CostModelError as e:
            raise fields.fail(path, f": {e}") from None

    # ------------------------------------------------------------ calibration
    def calibrate(self, records: Iterable[Any], layers: Sequence[LayerShape], chunk_edges: Sequence[Sequence[int]],
                  intervals: Sequence[int]) -> "GNNCostModel":
        """A copy whose coefficients fit measured chunk records of the streamed executor.

        Each record is ``(layer, phase, i, j, kind, start, end, bytes)`` (a tuple, a dict or an object
        with those attributes, e.g. ``runtime.gnn.streaming.ChunkRecord``; ``phase`` ``"F"``/``"B"``,
        ``kind`` ``"load"``/``"compute"``, seconds, bytes): a compute record with ``i, j >= 0`` is
        chunk ``(i, j)``'s Scatter/ApplyEdge/Gather (its recomputation and backward in ``"B"``); a
        compute record with ``i < 0`` a dense stage of destination interval ``j`` (``i == -1``:
        ``apply_vertex``, ``i == -2``: ``apply_vertex_pre``). Fitted by non-negative least squares
        (``scipy.optimize.nnls``) with an intercept, each group on its own:

        * chunk compute, per phase: ``seconds = edge_scale x predicted edge seconds + chunk_overhead``;
        * dense stages, per phase: ``seconds = vertex_scale x predicted roofline seconds +
          vertex_overhead`` (a backward never measured takes the forward's fit: the executor
          records the dense backward inside autograd, not per interval);
        * loads: ``seconds = (load_scale_index x index bytes + load_scale_rows x row bytes) /
          host_bandwidth + load_overhead``, index bytes from the chunk's edges, row bytes the rest
          of the record's bytes.

        Each group is fitted twice: the second fit leaves out the :data:`TRIM` fraction of its
        records that the first explains worst (measured times are skewed by preemption, as
        :mod:`engine.cost.calibrate`'s trimmed means allow for). Records of several epochs may be
        passed together.

        A group without measurements keeps its coefficients. As :mod:`engine.cost.calibrate`
        advises, leave out the first epoch (allocator and autograd warm-up).

        Args:
            records: the measured records.
            layers: the model's :func:`layer_shapes`.
            chunk_edges: ``chunk_edges[i][j]``, edges from interval ``i`` to interval ``j``.
            intervals: vertices per interval.

        Raises:
            CostModelError (a ValueError): no usable record, a malformed record, or one naming a
                layer or interval the plan does not have.
        """
        from scipy.optimize import nnls

        p = len(intervals)
        parsed = []
        for n, rec in enumerate(records):
            r = _record(rec, n)
            if not 0 <= r["layer"] < len(layers):
                raise CostModelError(f"record {n} names layer {r['layer']}, but the model has {len(layers)} layers")
            if not 0 <= r["j"] < p or r["i"] >= p:
                raise CostModelError(f"record {n} names chunk ({r['i']}, {r['j']}), but the plan has {p} intervals")
            r["phase"] = _phase(r["phase"])
            if r["end"] >= r["start"]:
                parsed.append(r)
        occupancy = _occupancy(parsed)
        groups: dict[str, list[tuple[list[float], float]]] = {}
        for k, r in enumerate(parsed):
            layer, ph, i, j = layers[r["layer"]], r["phase"], r["i"], r["j"]
            if r["kind"] == "load":
                if i < 0:
                    continue
                index = int(chunk_edges[i][j]) * INDEX_BYTES_PER_EDGE
                rows = max(0, r["bytes"] - index)
                groups.setdefault("load", []).append(([index / self.host_bandwidth, rows / self.host_bandwidth],
                                                      r["end"] - r["start"]))
            elif i >= 0:
                e = int(chunk_edges[i][j])
                if e > 0:
                    x = (BACKWARD_EDGE_FACTOR if ph == "B" else 1.0) * e * self.edge_time(layer)
                    groups.setdefault(f"chunk_{ph}", []).append(([x], occupancy[k]))
            else:
                stage = "apply" if i == -1 else "pre"
                flops, rows = self._dense_work(layer, stage)
                nv = int(intervals[j])
                if flops > 0 and nv > 0:
                    x = (BACKWARD_DENSE_FACTOR if ph == "B" else 1.0) * self._roofline(nv * flops,
                                                                                       nv * rows * self.elem_bytes)
                    groups.setdefault(f"vertex_{ph}", []).append(([x], occupancy[k]))
        if not groups:
            raise CostModelError("no measured chunk records to calibrate from; pass the streamed executor's records "
                                 "(layer, phase, i, j, kind, start, end, bytes) of a training epoch")
        names = {"chunk_F": ("edge_scale_F", "chunk_overhead_F"), "chunk_B": ("edge_scale_B", "chunk_overhead_B"),
                 "vertex_F": ("vertex_scale_F", "vertex_overhead_F"),
                 "vertex_B": ("vertex_scale_B", "vertex_overhead_B"),
                 "load": ("load_scale_index", "load_scale_rows", "load_overhead")}
        coeffs = dict(self.coefficients)
        for g, pts in groups.items():
            a = np.array([feat + [1.0] for feat, _ in pts])
            y = np.array([t for _, t in pts])
            colscale = np.maximum(np.abs(a).max(axis=0), 1e-300)   # equilibrate the columns for nnls
            sol, _res = nnls(a / colscale, y)
            keep = len(y) - int(len(y) * TRIM)
            if keep > a.shape[1] and keep < len(y):
                # trimmed refit: the records the first fit explains worst (a preempted chunk) are left out
                order = np.argsort(np.abs(a / colscale @ sol - y))[:keep]
                sol, _res = nnls((a / colscale)[order], y[order])
            for name, v in zip(names[g], sol / colscale):
                coeffs[name] = float(v)
            log.info("calibrated %s from %d records: %s", g, len(pts),
                     ", ".join(f"{k}={coeffs[k]:.4g}" for k in names[g]))
        if "vertex_F" in groups and "vertex_B" not in groups:
            coeffs["vertex_scale_B"] = coeffs["vertex_scale_F"]
            coeffs["vertex_overhead_B"] = coeffs["vertex_overhead_F"]
        return replace(self, coefficients=coeffs, calibrated_from=sum(len(v) for v in groups.values()))


def _occupancy(records: list[dict]) -> dict[int, float]:
    """Per compute record (by position), the seconds it holds the compute stream: from its start to
    the start of the next compute record of the same layer, phase and stage (chunk, ``pre`` or
    ``apply``), so that the executor's unrecorded work between two records (freeing the chunk's
    tensors, writing the aggregate, Python) counts; its own duration when it is the last one, when
    another compute record starts in between, or when the next is a chunk whose load ended after it
    (the gap is then waiting for the load)."""
    load_end = {(r["layer"], r["phase"], r["i"], r["j"]): r["end"] for r in records if r["kind"] == "load"}
    starts = sorted(r["start"] for r in records if r["kind"] != "load")
    runs: dict[tuple, list[int]] = {}
    for k, r in enumerate(records):
        if r["kind"] != "load":
            stage = "chunk" if r["i"] >= 0 else r["i"]
            runs.setdefault((r["layer"], r["phase"], stage), []).append(k)
    out: dict[int, float] = {}
    for ks in runs.values():
        ks.sort(key=lambda k: records[k]["start"])
        for a, b in zip(ks, ks[1:] + [None]):
            ra = records[a]
            out[a] = ra["end"] - ra["start"]
            if b is None:
                continue
            rb = records[b]
            waited = rb["i"] >= 0 and load_end.get((rb["layer"], rb["phase"], rb["i"], rb["j"]), 0.0) > ra["end"]
            between = bisect.bisect_left(starts, rb["start"]) - bisect.bisect_left(starts, ra["end"])
            if not waited and between == 0 and rb["start"] >= ra["end"]:
                out[a] = rb["start"] - ra["start"]
    return out


def _phase(phase: str) -> str:
    p = str(phase).upper()
    if p not in ("F", "B"):
        raise CostModelError(f"unknown phase {phase!r}; use 'F' (forward) or 'B' (backward)")
    return p


_RECORD_FIELDS = ("layer", "phase", "i", "j", "kind", "start", "end", "bytes")


def _record(rec: Any, n: int) -> dict:
    """One measured record as a dict of :data:`_RECORD_FIELDS` (from a tuple, a dict or an object)."""
    try:
        if isinstance(rec, dict):
            raw = [rec[k] for k in _RECORD_FIELDS]
        elif isinstance(rec, (tuple, list)) and not hasattr(rec, "_fields"):
            raw = list(rec)[:len(_RECORD_FIELDS)]
            if len(raw) < len(_RECORD_FIELDS):
                raise ValueError
        else:
            raw = [getattr(rec, k) for k in _RECORD_FIELDS]
        return {"layer": int(raw[0]), "phase": str(raw[1]), "i": int(raw[2]), "j": int(raw[3]),
                "kind": str(raw[4]), "start": float(raw[5]), "end": float(raw[6]), "bytes": int(raw[7] or 0)}
    except (KeyError, AttributeError, TypeError, ValueError):
        raise CostModelError(f"record {n} ({rec!r}) is not (layer, phase, i, j, kind, start, end, bytes)") from None


def param_count(layers: Sequence[LayerShape]) -> int:
    """Parameters of the whole model (sum over layers)."""
    return sum(layer.params for layer in layers)


__all__ = ["BACKWARD_DENSE_FACTOR", "BACKWARD_EDGE_FACTOR", "COEFFICIENTS", "GNNCostModel", "LayerShape",
           "canonical_kind", "layer_shapes", "param_count"]
