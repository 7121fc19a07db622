"""SuperScaler phase 1: model transformation into pipeline segments with DP/TP degrees.

The captured :class:`~engine.graph.OpGraph` is cut along layer boundaries (``layer`` node
attribute: a transformer block, the embedding, the head) into ``pp * virtual_stages``
contiguous segments whose forward times are balanced (minimise the slowest segment, a
linear-partition dynamic program) under a per-device memory bound. Tensor parallelism splits
each transformer block Megatron-style: the first linear of attention and MLP by columns, the
second by rows, so each block costs two all-reduces of its ``[micro_batch, seq, hidden]``
output in forward and two in backward (Shoeybi et al., "Megatron-LM", 2019, section 3);
layer norms and residual adds are replicated; the embedding and head are vocabulary-parallel
(one all-reduce each). Data parallelism replicates the pipeline ``dp`` times and all-reduces
gradients once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from engine.config import ParallelConfig
from engine.dependency import TiedGroup
from engine.errors import TransformError
from engine.placement import TensorSpec, dtype_bytes
from engine.precision import get_policy
from engine.recompute import (
    MASK_SUFFIX,
    LayerActivation,
    attention_core_ops,
    kept_bytes,
    segment_recompute,
    stage_granularities,
    working_set_bytes,
)
from engine.tp_plan import ShardedSublayers

#: Bytes resident per parameter byte with Adam in the parameter dtype: parameter, gradient,
#: and Adam's two moments (m, v): 4x the parameter bytes.
ADAM_STATE_FACTOR = 4

#: Bytes resident for the whole step per parameter byte with either optimizer under ``32-true``: the
#: parameter and Adam's two moments (m, v). The gradient buffer is modelled separately (see
#: :func:`gradient_bytes`); other precision policies: :func:`resident_state_bytes`.
PARAM_STATE_FACTOR = 3

#: Optimizers the memory model knows: ``adam`` (``torch.optim.Adam`` with gradient accumulation:
#: a full gradient buffer lives from a stage's first backward to the optimizer step) and ``adama``
#: (AdamA, ``runtime.adama.AdamA``: each micro-batch gradient is folded into m and v and freed, so
#: only a transient gradient of one parameter tensor exists during a backward).
OPTIMIZERS = ("adam", "adama")

_REPLICATED_MODULES = ("LayerNorm", "RMSNorm", "LlamaRMSNorm", "GPT2LayerNorm", "Dropout")


def check_optimizer(optimizer: str) -> str:
    """``optimizer`` if the memory model knows it (:data:`OPTIMIZERS`).

    Raises:
        TransformError: any other name.
    """
    if optimizer not in OPTIMIZERS:
        raise TransformError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    return optimizer


def gradient_bytes(optimizer: str, param_bytes: int, max_param_bytes: int,
                   precision: str = "32-true") -> tuple[int, int]:
    """``(buffer, transient)`` gradient bytes of a segment with ``param_bytes`` bytes of weights
    (in the policy's weight dtype) whose largest parameter tensor has ``max_param_bytes`` bytes.

    Gradients are kept in the policy's gradient dtype (:attr:`engine.precision.PrecisionPolicy.grad_bytes`
    per parameter: 4 for ``32-true`` and ``bf16-mixed``, 2 for ``16-mixed`` and ``bf16-true``;
    Megatron-LM's table), i.e. ``param_bytes x grad_bytes / weight_bytes``.

    - ``adam``: the accumulated ``p.grad`` of every parameter from the segment's first backward
      to the optimizer step, plus, on each later backward, the fresh micro-batch gradient of one
      parameter before ``p.grad += g``.
    - ``adama``: ``(0, transient)``: no buffer across micro-batches (AdamA, Zhang et al.,
      ECAI 2023: each gradient is folded into m and v by a post-accumulate-grad hook and freed);
      during each backward, one parameter's micro-batch gradient at a time, bounded by the
      largest parameter tensor of the segment.

    ``32-true``: ``(param_bytes, max_param_bytes)`` for ``adam``, as before policies.

    Raises:
        TransformError: an unknown optimizer or precision.
    """
    check_optimizer(optimizer)
    pol = get_policy(precision)
    trans = pol.scale(max_param_bytes, pol.grad_bytes)
    return (pol.scale(param_bytes, pol.grad_bytes) if optimizer == "adam" else 0), trans


def resident_state_bytes(param_bytes: int, precision: str = "32-true", dp_shard: int = 1) -> int:
    """Bytes resident for the whole step for ``param_bytes`` bytes of weights: weights, fp32
    master weights, Adam's m and v and (``16-mixed``) the fp32 gradient copy, i.e.
    ``count x PrecisionPolicy.resident_bytes_per_param`` (``32-true``: ``3 x param_bytes``,
    :data:`PARAM_STATE_FACTOR`); with the sharded update over ``dp_shard`` replicas the sharded
    part divided by it (Megatron-LM's distributed optimizer,
    :meth:`engine.precision.PrecisionPolicy.sharded_saving`).

    Raises:
        TransformError: an unknown precision.
    """
    pol = get_policy(precision)
    return pol.scale(param_bytes, pol.resident_bytes_per_param) - pol.sharded_saving(param_bytes, dp_shard)


def training_state_bytes(optimizer: str, param_bytes: int, max_param_bytes: int, precision: str = "32-true",
                         dp_shard: int = 1) -> int:
    """Upper bound of a segment's weight, optimizer-state and gradient bytes at any time of a
    step: :func:`resident_state_bytes` plus :func:`gradient_bytes`' buffer and transient
    (``32-true``: ``4 x param_bytes (+ largest tensor)`` with ``adam``, ``3 x param_bytes +
    largest tensor`` with ``adama``; the bound the stage split checks against device memory).

    Raises:
        TransformError: an unknown optimizer or precision.
    """
    buf, trans = gradient_bytes(optimizer, param_bytes, max_param_bytes, precision)
    return resident_state_bytes(param_bytes, precision, dp_shard) + buf + trans


def fsdp_state_bytes(param_bytes: int, largest_unit_bytes: int, precision: str, dp_shard: int, *,
                     pipelined: bool) -> int:
    """Upper bound of a segment's parameter, gradient and optimizer-state bytes on one rank under
    fully sharded data parallelism over ``dp_shard`` ranks (:mod:`engine.dependency.fsdp`): the
    shards (:meth:`engine.precision.PrecisionPolicy.fsdp_bytes_per_param`), plus what is gathered:
    with a pipeline the whole segment's parameters and its unsharded gradients in the reduce dtype
    (gathered from the first forward to the last backward), without one two units' parameters
    and gradients (the one computing and the one prefetched; ``largest_unit_bytes`` each).

    Raises:
        TransformError: an unknown precision.
    """
    pol = get_policy(precision)
    d = max(1, dp_shard)
    shards = -(-pol.scale(param_bytes, pol.fsdp_sharded_bytes_per_param + pol.fsdp_reduce_bytes) // d)
    gathered = param_bytes if pipelined else min(param_bytes, 2 * largest_unit_bytes)
    return shards + gathered + pol.scale(gathered, pol.fsdp_reduce_bytes)


@dataclass
class Segment:
    """A pipeline segment (stage): contiguous layers run as one unit, per micro-batch.

    Attributes:
        index: segment index.
        layers: module paths of its layers, in order.
        flops: forward FLOPs per micro-batch on one TP rank.
        param_bytes: parameter bytes on one TP rank.
        activation_bytes: bytes saved for backward per micro-batch on one TP rank.
        forward_time: seconds of forward per micro-batch, TP all-reduces included.
        backward_time: seconds of full backward per micro-batch, TP all-reduces included.
        tp_comm_time: seconds of the forward TP all-reduces (included in ``forward_time``).
        output: the boundary tensors sent to the next segment (``None`` for the last): the main
            one (the hidden state) with every other tensor crossing the cut as
            :attr:`TensorSpec.parts <engine.placement.TensorSpec.parts>`; its ``nbytes`` is the
            bytes of the forward send (see :func:`boundary_spec`).
        max_param_bytes: bytes of its largest parameter tensor on one TP rank (the transient
            gradient of one backward, see :func:`gradient_bytes`).
        output_grad: the gradients the next segment's backward sends back: the differentiable
            boundary tensors only (floating point and computed from parameters; masks, position
            ids and rotary tables have none). ``None`` for the last segment or when nothing
            crossing the cut has a gradient.
        tp_collectives: its layers' forward tensor-parallel collectives, ``(kind, bytes,
            seconds)`` in order (:func:`layer_costs`), included in ``forward_time``; drawn inside its
            blocks (the backward's are the same in reverse).
        recompute: its activation recomputation granularity (:data:`engine.recompute.RECOMPUTE`);
            ``activation_bytes`` is what that granularity keeps
            (:func:`engine.recompute.segment_recompute`).
        recompute_time: seconds of forward its backward runs again, included in
            ``backward_time`` (in the ``I`` block when the backward is split); 0 without.
        recompute_transient_bytes: bytes live only while its backward runs: the recomputed
            activations of its largest layer (full) or attention core (selective); 0 without.
        fsdp_units: its units under fully sharded data parallelism (:func:`fsdp_units`):
            ``(parameter bytes on one TP rank, forward seconds)`` of its layers outside the
            transformer blocks, then of each block.
    """

    index: int
    layers: list[str]
    flops: float
    param_bytes: int
    activation_bytes: int
    forward_time: float
    backward_time: float
    tp_comm_time: float = 0.0
    output: TensorSpec | None = None
    meta: dict = field(default_factory=dict)
    max_param_bytes: int = 0
    output_grad: TensorSpec | None = None
    tp_collectives: tuple[tuple[str, int, float], ...] = ()
    recompute: str = "none"
    recompute_time: float = 0.0
    recompute_transient_bytes: int = 0
    fsdp_units: tuple[tuple[int, float], ...] = ()

    @property
    def boundary_bytes(self) -> int:
        """Bytes its forward sends to the next segment per micro-batch (all boundary tensors)."""
        return self.output.nbytes if self.output else 0

    def to_dict(self) -> dict:
        """The plan JSON form: ``output`` lists every boundary tensor (``parts``), and
        ``boundary_bytes`` / ``output_grad`` say what crosses the cut forward / backward;
        ``recompute``, ``recompute_time`` and ``recompute_transient_bytes`` appear only when set (a
        plan without recomputation is unchanged)."""
        return {
            "index": self.index, "layers": self.layers, "flops": self.flops, "param_bytes": self.param_bytes,
            "max_param_bytes": self.max_param_bytes,
            "activation_bytes": self.activation_bytes, "forward_time": self.forward_time,
            "backward_time": self.backward_time, "tp_comm_time": self.tp_comm_time,
            "output": self.output.to_dict() if self.output else None,
            "boundary_bytes": self.boundary_bytes,
            "output_grad": self.output_grad.to_dict() if self.output_grad else None,
            **({"tp_collectives": [list(c) for c in self.tp_collectives]} if self.tp_collectives else {}),
            **({"recompute": self.recompute} if self.recompute != "none" else {}),
            **({"recompute_time": self.recompute_time} if self.recompute_time else {}),
            **({"recompute_transient_bytes": self.recompute_transient_bytes}
               if self.recompute_transient_bytes else {}),
        }


def is_block_layer(layer: str) -> bool:
    """A ModuleList element (``...h.3``, ``...layers.3``) is a transformer block."""
    return layer.rsplit(".", 1)[-1].isdigit()


def _tp_divisor(node: dict, tp: int, vocab_layers: frozenset[str] = frozenset(),
                sequence_parallel: bool = False) -> int:
    """How many ways an op's work splits under TP, as the runtime shards a stage
    (``runtime.tensor_parallel``): the projections inside transformer blocks and, of the other
    layers, only the token embedding and the LM head (``vocab_layers``: vocab-parallel) split
    ``tp`` ways; norms, residual adds in the block body, position embeddings and every other
    layer run replicated (1), except with ``sequence_parallel`` (CoCoNet's ``tp-split``), where the
    norms, dropouts and residual adds of the blocks and the final norm run on ``1/tp`` of the
    sequence."""
    if tp == 1:
        return 1
    mt = str(node.get("module_type", ""))
    layer = node.get("layer", None)
    in_block = layer is not None and is_block_layer(str(layer))
    if mt in _REPLICATED_MODULES or mt.endswith(("LayerNorm", "RMSNorm")):
        return tp if sequence_parallel and (in_block or mt.endswith("Norm")) else 1
    if not in_block:
        return tp if layer in vocab_layers else 1
    if node.get("module_path", "") == layer:  # residual adds in the block body
        return tp if sequence_parallel else 1
    return tp


#: Module path endings of the row-parallel projections whose output all-reduce ``chunked-overlap``
#: pipelines (GPT-2 / tessel-gpt ``c_proj``, Llama ``o_proj`` and ``down_proj``, others' ``out_proj``).
_ROW_PARALLEL = ("c_proj", "o_proj", "down_proj", "out_proj", "dense_4h_to_h", "wo", "w2")


@dataclass
class LayerCost:
    """Per-layer costs after TP split (internal to the partitioner, exposed for tests/UI).

    ``activation_bytes`` is what the layer keeps with no recomputation; ``block_input_bytes``
    (the hidden state entering a transformer block; 0 for other layers), ``attention_core_bytes``
    and ``attention_core_time`` (its eager attention core's saved bytes and forward seconds,
    :func:`engine.recompute.attention_core_ops`) are what :mod:`engine.recompute` needs to count
    the other granularities (:meth:`activation`). Bytes and seconds on one TP rank.
    """

    name: str
    forward_time: float
    flops: float
    param_bytes: int
    activation_bytes: int
    tp_comm_time: float
    output: TensorSpec | None
    max_param_bytes: int = 0
    grad: TensorSpec | None = None
    tp_collectives: tuple[tuple[str, int, float], ...] = ()
    block_input_bytes: int = 0
    attention_core_bytes: int = 0
    attention_core_time: float = 0.0

    def activation(self) -> LayerActivation:
        """The layer's :class:`engine.recompute.LayerActivation`."""
        return LayerActivation(self.name, is_block_layer(self.name), self.activation_bytes,
                               self.attention_core_bytes, self.block_input_bytes, self.forward_time,
                               self.attention_core_time)


def _largest_param_bytes(node: dict) -> int:
    """Bytes of the largest parameter tensor an op reads (from its argument descriptors), capped
    by the parameter bytes counted at this op (tied or reused parameters count at first use)."""
    if not node.get("param_bytes"):
        return 0
    best = 0

    def walk(a) -> None:
        nonlocal best
        if isinstance(a, dict):
            if "param" in a and "shape" in a:
                n = 1
                for x in a["shape"]:
                    n *= int(x)
                try:
                    best = max(best, n * dtype_bytes(str(a.get("dtype", "float32"))))
                except ValueError:
                    pass
        elif isinstance(a, (list, tuple)):
            for x in a:
                walk(x)

    walk(node.get("args", ()))
    walk(list((node.get("kwargs") or {}).values()))
    return min(best, int(node["param_bytes"])) if best else int(node["param_bytes"])


LOSS_PARALLEL_TASKS = frozenset({"causal-lm", "masked-lm", "seq2seq"})
"""The built-in tasks whose loss is a cross-entropy over the vocabulary, which the runtime computes
on vocab-sharded logits (``tasks.Task.vocab_parallel_loss``; a test keeps the two in agreement)."""


def _vocab_layers(graph, summaries) -> frozenset[str]:
    """The layers the runtime shards over the vocabulary: the first non-block layer holding an
    ``Embedding`` (the token embedding, before any position embedding) and a last layer holding a
    ``Linear`` (the LM head, tied weights included) in a model with such an embedding (a model
    without one, e.g. ViT's classifier on patch embeddings, has no vocabulary: its head stays
    replicated, ``runtime.tensor_parallel``)."""
    def has(ls, mt: str) -> bool:
        return any(graph.nodes[o].get("module_type") == mt for o in ls.ops)
    out = [next((ls.name for ls in summaries if not is_block_layer(ls.name) and has(ls, "Embedding")), None)]
    if out[0] is not None and summaries and not is_block_layer(summaries[-1].name) and has(summaries[-1], "Linear"):
        out.append(summaries[-1].name)
    return frozenset(x for x in out if x is not None)


def vocab_layers(graph) -> frozenset[str]:
    """The layers of ``graph`` (an :class:`~engine.graph.OpGraph`) the runtime shards over the
    vocabulary under tensor parallelism: the token embedding and the LM head."""
    return _vocab_layers(graph, graph.layer_summaries())


def layer_costs(graph, cost, tp: int = 1, *, loss_parallel: bool = False, sequence_parallel: bool = False,
                overlap_chunks: int = 1, tp_plan: Mapping[str, str] | None = None) -> list[LayerCost]:
    """Forward time, FLOPs, parameter and activation bytes of every layer on one TP rank.

    Tensor-parallel communication per layer (Megatron-LM, Shoeybi et al. 2019, section 3; its
    forward all-reduces, the backward's are as many): a transformer block all-reduces its hidden
    state twice (attention and MLP outputs), a vocab-parallel embedding once; the LM head (the
    last layer) all-gathers its logits (``[B, T, vocab]``, counted as an all-reduce of them), or
    with ``loss_parallel`` keeps them sharded and pays one all-reduce of its input hidden state
    (its backward's input gradient; the softmax statistics of the loss are ``B*T`` floats).

    Args:
        graph: an :class:`~engine.graph.OpGraph`.
        cost: an :class:`~engine.cost.CostModel` (``op_time(node)``, ``collective_time(kind, nbytes, ranks)``).
        tp: tensor-parallel degree.
        loss_parallel: the task's loss runs on vocab-sharded logits (:data:`LOSS_PARALLEL_TASKS`).
        sequence_parallel: CoCoNet's ``tp-split`` (Megatron sequence parallelism): each block's
            all-reduces become a reduce-scatter and an all-gather of the same bytes (a ring
            all-reduce is exactly the two), and the norms, dropouts and residual adds run on the
            ``1/tp`` sequence shard (their time and saved activations divided by ``tp``).
        overlap_chunks: CoCoNet's ``chunked-overlap`` with this many chunks (1: off): each
            row-parallel projection (:data:`_ROW_PARALLEL`) and its all-reduce are pipelined, so of
            ``matmul + all-reduce`` only ``max(matmul, all-reduce) + min(matmul, all-reduce) / k`` is
            on the critical path.
        tp_plan: a user's tensor-parallel plan for the blocks (:mod:`engine.tp_plan`): a block's op
            splits ``tp`` ways only inside a sublayer it shards, and the block all-reduces once per
            row-parallel layer it holds (:class:`~engine.tp_plan.ShardedSublayers`); ``None``: every
            projection sharded, two all-reduces per block.

    Each layer's ``tp_collectives`` lists its forward collectives as ``(kind, bytes, seconds)`` in
    order (what the Gantt draws inside the block; the backward has as many, in reverse).
    """
    out = []
    summaries = graph.layer_summaries()
    vocab = _vocab_layers(graph, summaries)
    sublayers = ShardedSublayers(tp_plan) if tp_plan is not None and tp > 1 else None
    prev_hidden = 0
    for ls in summaries:
        t = 0.0
        flops = 0.0
        pbytes = 0
        pmax = 0
        row_matmul = 0.0
        core, interior = attention_core_ops(graph, ls.ops) if is_block_layer(ls.name) else (frozenset(), frozenset())
        core_time = 0.0
        divisor = _Divisor(graph, tp, vocab, sequence_parallel, core, sublayers)
        for op in ls.ops:
            node = graph.nodes[op]
            k = divisor(op)
            dt = cost.op_time(node, shard=k)
            t += dt
            if op in core:
                core_time += dt
            if str(node.get("module_path", "")).endswith(_ROW_PARALLEL) and node.get("flops"):
                row_matmul += dt
            flops += node.get("flops", 0.0) / k
            pbytes += node.get("param_bytes", 0) // k
            pmax = max(pmax, _largest_param_bytes(node) // k)
        act, core_bytes = saved_activation_bytes(graph, ls.ops, divisor.of_saved, interior)
        output, grad = boundary_spec(graph, ls)
        comm = 0.0
        hidden = TensorSpec(output.shape, output.dtype).nbytes if output else 0
        colls: list[tuple[str, int, float]] = []
        if tp > 1:
            ranks = list(range(tp))
            n_ar = 2 if is_block_layer(ls.name) else (1 if ls.name in vocab else 0)
            if sublayers is not None and is_block_layer(ls.name):
                n_ar = sublayers.all_reduces([str(graph.nodes[op].get("module_path", "")) for op in ls.ops])
            # the Megatron all-reduces are of the layer's hidden state (the first boundary tensor);
            # the last layer (the LM head) has none after it: its logits, or its input with loss parallel
            nbytes = hidden if output else (prev_hidden if loss_parallel and prev_hidden else ls.output_bytes)
            for _ in range(n_ar):
                if sequence_parallel and is_block_layer(ls.name):
                    colls += [("reducescatter", nbytes, cost.collective_time("reducescatter", nbytes, ranks)),
                              ("allgather", nbytes, cost.collective_time("allgather", nbytes, ranks))]
                else:
                    colls.append(("allreduce", nbytes, cost.collective_time("allreduce", nbytes, ranks)))
            comm = sum(c[2] for c in colls)
            if overlap_chunks > 1 and is_block_layer(ls.name) and n_ar:
                per_mm, per_comm = row_matmul / n_ar, comm / n_ar
                hidden_s = n_ar * min(per_mm, per_comm) * (1 - 1 / overlap_chunks)
                scale = (comm - hidden_s) / comm if comm > 0 else 1.0
                colls = [(kind, nb, sec * scale) for kind, nb, sec in colls]
                comm -= hidden_s
        block_input = prev_hidden // (tp if sequence_parallel else 1) if is_block_layer(ls.name) else 0
        prev_hidden = hidden or prev_hidden
        out.append(LayerCost(ls.name, t + comm, flops, pbytes, act, comm, output, pmax, grad, tuple(colls),
                             block_input, core_bytes, core_time))
    return out


class _Divisor:
    """How many ways an op's work (``__call__``) and its output kept for the backward
    (:meth:`of_saved`) split over the TP ranks: :func:`_tp_divisor`, except that the attention
    ``core`` runs on the rank's heads (its dropout too, unlike a replicated Dropout elsewhere) and
    tensors computed from the inputs only (attention masks, position ids, rotary tables) are built
    whole on every rank."""

    def __init__(self, graph, tp: int, vocab: frozenset[str], sequence_parallel: bool, core: frozenset[str],
                 sublayers: ShardedSublayers | None = None):
        self.graph, self.tp, self.vocab, self.sp, self.core = graph, tp, vocab, sequence_parallel, core
        self.sublayers = sublayers

    def __call__(self, op: str) -> int:
        node = self.graph.nodes[op]
        layer = node.get("layer", None)
        if self.sublayers is not None and layer is not None and is_block_layer(str(layer)):
            # a user's plan: inside a block, only the sublayers it shards split (the core included)
            return self.tp if self.sublayers.covers(str(node.get("module_path", ""))) else 1
        if op in self.core:
            return self.tp
        return _tp_divisor(node, self.tp, self.vocab, self.sp)

    def of_saved(self, op: str) -> int:
        return 1 if self.graph.nodes[op].get("input_only") else self(op)


def saved_activation_bytes(graph, ops: Sequence[str], divisor,
                           interior: frozenset[str] = frozenset()) -> tuple[int, int]:
    """``(saved, core)``: bytes one layer's ``ops`` keep for the backward on one TP rank, and of
    them those produced by the ``interior`` ops (the attention core selective recomputation drops).

    Every saved tensor counts once, by its storage (the ``saved`` entries of the capture: a
    tensor several ops save, or saves through views, once; a dropout's mask apart from its
    output), divided by the tensor-parallel ``divisor(op)`` of the op that PRODUCED it, not of
    the op saving it: a column-parallel projection keeps its replicated input (the LayerNorm
    output) whole on every rank, as Megatron-LM does (Korthikanti et al. 2022, section 4.1: the
    ``10·s·b·h`` that tensor parallelism does not divide), and a tensor produced in an earlier
    layer (the block input) by that layer's rule.

    Args:
        graph: the :class:`~engine.graph.OpGraph`.
        ops: the layer's op ids.
        divisor: ``op id -> int``, how many ways an op's output is split over the TP ranks.
        interior: op ids whose saved tensors are the attention core's.
    """
    roots: dict[str, tuple[int, str]] = {}
    for op in ops:
        for root in graph.nodes[op].get("saved", []):
            producer = root.removesuffix(MASK_SUFFIX) if root.endswith(MASK_SUFFIX) else root
            if producer not in graph:
                producer = op
            size = (int(graph.nodes[op].get("saved_self_bytes", 0)) if root == op or root not in graph
                    else int(graph.nodes[root].get("output_bytes", 0)))
            roots[root] = (size, producer)
    total = core = 0
    for size, producer in roots.values():
        b = size // divisor(producer)
        total += b
        if producer in interior:
            core += b
    return total, core


_FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def boundary_spec(graph, summary) -> tuple[TensorSpec | None, TensorSpec | None]:
    """What a pipeline cut after one layer sends: ``(forward, gradient)``.

    ``forward`` holds EVERY tensor produced up to the layer and consumed after it (the layer
    summary's ``boundary_tensors``, each once): the first (the hidden state) as the spec's
    shape/dtype and the others as its ``parts``, so ``forward.nbytes`` equals the summary's
    ``boundary_bytes`` (e.g. GPT-2: hidden ``[B, T, H]`` + causal mask ``[B, 1, T, T]`` bool;
    Llama: hidden + mask + rotary cos/sin ``[B, T, head_dim]`` x2; T5: hidden + position bias
    ``[B, heads, T, T]`` + mask, and the encoder output in the decoder).

    ``gradient`` holds the boundary tensors whose gradient the backward sends back: floating
    point and not computed from graph inputs only (the graph node attribute ``input_only``;
    masks, position ids and rotary tables have none); ``None`` when there is none.

    Args:
        graph: the :class:`~engine.graph.OpGraph`.
        summary: one of its :meth:`~engine.graph.OpGraph.layer_summaries`.

    Returns:
        ``(forward, gradient)``, both ``None`` after the last layer.
    """
    specs = [TensorSpec(tuple(int(x) for x in bt["shape"]), str(bt["dtype"])) for bt in summary.boundary_tensors]
    if not specs:
        return None, None
    nodes = list(getattr(summary, "boundary_nodes", []) or [])
    diff = []
    for i, sp in enumerate(specs):
        producer = graph.nodes[nodes[i]] if i < len(nodes) and nodes[i] in graph.nodes else {}
        if sp.dtype in _FLOAT_DTYPES and not producer.get("input_only", False):
            diff.append(sp)
    fwd = TensorSpec(specs[0].shape, specs[0].dtype, tuple(specs[1:]))
    grad = TensorSpec(diff[0].shape, diff[0].dtype, tuple(diff[1:])) if diff else None
    return fwd, grad


def balanced_partition(weights: Sequence[float], k: int, *, fits=None, fits_segment=None) -> list[tuple[int, int]]:
    """Split ``weights`` into ``k`` contiguous non-empty ranges minimising the largest sum.

    Linear-partition dynamic program, O(k * n^2). ``fits(i, j)`` (optional) says whether the
    range ``[i, j)`` may form one segment (e.g. it fits in device memory); ``fits_segment(s, i,
    j)`` (optional) whether it may form segment ``s`` (e.g. under that stage's recomputation).

    Returns:
        ``k`` half-open ranges ``(start, end)`` covering ``0..n``.

    Raises:
        TransformError: fewer items than segments, or no partition satisfies ``fits``.
    """
    n = len(weights)
    if k > n:
        raise TransformError(f"cannot cut {n} layers into {k} segments; use at most {n} pipeline segments")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    INF = float("inf")
    # best[j][i]: minimal max-sum splitting the first i items into j segments
    best = [[INF] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for s in range(j - 1, i):
                if best[j - 1][s] == INF or (fits is not None and not fits(s, i)) or (
                        fits_segment is not None and not fits_segment(j - 1, s, i)):
                    continue
                v = max(best[j - 1][s], prefix[i] - prefix[s])
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, s
    if best[k][n] == INF:
        raise TransformError("no split of the layers into segments fits the memory bound")
    ranges = []
    i = n
    for j in range(k, 0, -1):
        s = cut[j][i]
        ranges.append((s, i))
        i = s
    return ranges[::-1]


def split_segments(graph, cost, config: ParallelConfig, *, memory_limit: float | None = None,
                   optimizer: str = "adam", loss_parallel: bool = False,
                   stage_recompute: Sequence[str] | None = None,
                   layers: Sequence[LayerCost] | None = None) -> tuple[list[Segment], list[str]]:
    """Cut the graph into ``config.num_segments`` balanced segments (``config.transforms``: CoCoNet's
    ``tp-split`` and ``chunked-overlap`` change the layers' tensor-parallel costs, :func:`layer_costs`).

    Args:
        graph: the captured :class:`~engine.graph.OpGraph` of ONE micro-batch.
        cost: the cost model.
        config: parallel degrees.
        memory_limit: bytes per device; segments are bounded so that parameters with Adam states
            and gradients under ``config.precision`` (:func:`training_state_bytes`, or
            :func:`fsdp_state_bytes` with ``config.dp_shard > 1``; ``32-true``:
            4x the parameter bytes with ``adam``, 3x plus the largest parameter tensor with
            ``adama``; the sharded part divided by ``dp`` with ``sharded-update``) plus ``min(m, pp)``
            micro-batches of activations fit (1F1B's in-flight bound). ``None`` uses the cost
            model's device capacity.
        optimizer: ``adam`` or ``adama`` (:data:`OPTIMIZERS`).
        loss_parallel: see :func:`layer_costs`.
        stage_recompute: per-stage activation recomputation overriding ``config.recompute``: one
            granularity per segment, or one per pipeline stage (``pp``) applied to its segments
            (:func:`engine.recompute.stage_granularities`).
        layers: :func:`layer_costs` of ``graph`` and ``cost`` under ``config`` (its ``tp``,
            ``tp-split`` and ``chunked-overlap``) and ``loss_parallel``, when the caller already
            has them (``tessel tune`` shares them across configurations); read, not changed.

    Activation recomputation (``config.recompute``, Korthikanti et al. 2022, section 5): a
    segment's ``activation_bytes`` is what its granularity keeps per micro-batch
    (:func:`engine.recompute.segment_recompute`); its backward includes the recomputed forward
    (``recompute_time``); the memory bound adds the recomputation's working set
    (``recompute_transient_bytes``) to the in-flight activations.

    Returns:
        ``(segments, warnings)``; a warning says when no memory-feasible split exists and the
        time-balanced split is used anyway (the plan then reports memory above capacity).

    Raises:
        TransformError: bad degrees, an unknown optimizer or granularity, a ``stage_recompute`` of
            the wrong length, or more segments than layers.
    """
    config.check()
    check_optimizer(optimizer)
    if layers is None:
        layers = layer_costs(graph, cost, config.tp, loss_parallel=loss_parallel,
                             sequence_parallel="tp-split" in config.transforms,
                             overlap_chunks=config.overlap_chunks if "chunked-overlap" in config.transforms else 1,
                             tp_plan=config.tp_plan)
    k = config.num_segments
    if k > len(layers):
        raise TransformError(
            f"the model has {len(layers)} layers, too few for {k} pipeline segments "
            f"(pp={config.pp} x virtual_stages={config.virtual_stages}); use fewer devices or more layers"
        )
    grans = stage_granularities(config.recompute, k, config.pp, stage_recompute)
    cap = memory_limit if memory_limit is not None else cost.device.mem_capacity
    inflight = min(config.micro_batches, config.pp)
    acts = [lc.activation() for lc in layers]
    pre_p = [0]
    for lc in layers:
        pre_p.append(pre_p[-1] + lc.param_bytes)
    # kept activations (prefix sums) and working set (range max) per granularity in use
    pre_a = {g: [0] for g in set(grans)}
    n_l = len(layers)
    wmax = {g: [[0] * (n_l + 1) for _ in range(n_l + 1)] for g in pre_a}
    for g, pre in pre_a.items():
        ws = [working_set_bytes(la, g) for la in acts]
        for la in acts:
            pre.append(pre[-1] + kept_bytes(la, g))
        for i in range(n_l):
            for j in range(i + 1, n_l + 1):
                wmax[g][i][j] = max(wmax[g][i][j - 1], ws[j - 1])

    # largest parameter tensor of layers i..j-1, for every range (the DP asks O(k n^2) times)
    pmax = [[0] * (n_l + 1) for _ in range(n_l + 1)]
    for i in range(n_l):
        for j in range(i + 1, n_l + 1):
            pmax[i][j] = max(pmax[i][j - 1], layers[j - 1].max_param_bytes)

    shard = config.dp if "sharded-update" in config.transforms else 1
    lmax = [[0] * (n_l + 1) for _ in range(n_l + 1)]   # largest layer (FSDP unit) of layers i..j-1
    for i in range(n_l):
        for j in range(i + 1, n_l + 1):
            lmax[i][j] = max(lmax[i][j - 1], layers[j - 1].param_bytes)

    def state_of(i: int, j: int) -> int:
        if config.fully_sharded:
            return fsdp_state_bytes(pre_p[j] - pre_p[i], lmax[i][j], config.precision, config.dp_shard,
                                    pipelined=config.pp > 1)
        return training_state_bytes(optimizer, pre_p[j] - pre_p[i], pmax[i][j], config.precision, shard)

    def need_of(seg: int, i: int, j: int) -> int:
        g = grans[seg]
        return state_of(i, j) + inflight * (pre_a[g][j] - pre_a[g][i]) + wmax[g][i][j]

    def fits(seg: int, i: int, j: int) -> bool:
        return need_of(seg, i, j) <= cap

    warnings: list[str] = []
    weights = [lc.forward_time for lc in layers]
    try:
        ranges = balanced_partition(weights, k, fits_segment=fits)
    except TransformError:
        ranges = balanced_partition(weights, k)
        need = max(need_of(seg, i, j) for seg, (i, j) in enumerate(ranges))
        warnings.append(
            f"no split into {k} segments fits {cap / 2**30:.1f} GiB per device "
            f"(the best needs {need / 2**30:.1f} GiB); "
            "add pipeline stages, tensor parallelism (--tp) or a larger device"
        )
    segments = []
    for idx, (i, j) in enumerate(ranges):
        part = layers[i:j]
        fwd = sum(lc.forward_time for lc in part)
        comm = sum(lc.tp_comm_time for lc in part)
        rc = segment_recompute(acts[i:j], grans[idx])
        bwd = cost.backward_factor * (fwd - comm) + comm + rc.recompute_time
        segments.append(Segment(
            index=idx, layers=[lc.name for lc in part], flops=sum(lc.flops for lc in part),
            param_bytes=sum(lc.param_bytes for lc in part), activation_bytes=rc.kept_bytes,
            forward_time=fwd, backward_time=bwd, tp_comm_time=comm,
            output=part[-1].output if idx < k - 1 else None,
            max_param_bytes=max((lc.max_param_bytes for lc in part), default=0),
            output_grad=part[-1].grad if idx < k - 1 else None,
            tp_collectives=tuple(c for lc in part for c in lc.tp_collectives),
            recompute=grans[idx], recompute_time=rc.recompute_time,
            recompute_transient_bytes=rc.working_set_bytes, fsdp_units=fsdp_units(part),
        ))
    return segments, warnings


def fsdp_units(layers: Sequence[LayerCost]) -> tuple[tuple[int, float], ...]:
    """A segment's units under fully sharded data parallelism, as torchtitan wraps a stage
    (``apply_fsdp``: ``fully_shard`` on each transformer block, then on the stage's root for the
    rest: embeddings, final norm, LM head): ``(parameter bytes, forward seconds)`` of the layers
    outside the blocks first (the stage's root unit; ``(0, 0.0)`` when it has none), then of each
    block (:func:`is_block_layer`), in order. Bytes on one TP rank, seconds per micro-batch."""
    root = [lc for lc in layers if not is_block_layer(lc.name)]
    out = [(sum(lc.param_bytes for lc in root), sum(lc.forward_time for lc in root))]
    out += [(lc.param_bytes, lc.forward_time) for lc in layers if is_block_layer(lc.name)]
    return tuple(out)


def _inside_layer(name: str, layer: str) -> bool:
    return name == layer or name.startswith(layer + ".")


def tied_parameter_groups(module, segment_layers: Sequence[Sequence[str]]):
    """Parameters shared by several segments (tied weights), as the pipeline runtime sees them.

    A parameter reachable under several names (``module.named_parameters(remove_duplicate=False)``,
    e.g. GPT-2's ``transformer.wte.weight`` and ``lm_head.weight``) is held by every segment whose
    layers contain one of its names (``name == layer`` or ``name`` starts with ``layer + "."``);
    after a pipeline split each such segment holds its own copy and the copies' gradients must be
    summed at the optimizer step (``runtime.stages.PipelineStages.tied``, Megatron-LM's embedding
    all-reduce). A segment holding several names of one parameter holds one copy (its first name).
    Works on meta-device models.

    Args:
        module: the model (``nn.Module``).
        segment_layers: ``segment_layers[s]`` = module paths of segment ``s`` (``Segment.layers``).

    Returns:
        ``list[engine.dependency.TiedGroup]``: groups held by 2+ segments (sorted members,
        ``nbytes`` = bytes of one copy), sorted by their members.
    """
    aliases: dict[int, list[str]] = {}
    tensors: dict[int, Any] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    groups = []
    for pid, names in aliases.items():
        if len(names) < 2:
            continue
        by_segment: dict[int, str] = {}
        for name in names:
            for s, layers in enumerate(segment_layers):
                if any(_inside_layer(name, str(lay)) for lay in layers):
                    by_segment.setdefault(s, name)
                    break
        if len(by_segment) > 1:
            p = tensors[pid]
            groups.append(TiedGroup(tuple(sorted(by_segment.items())), int(p.numel() * p.element_size())))
    return sorted(groups, key=lambda g: g.members)


def tied_copy_bytes(groups, tp: int = 1) -> tuple[dict[int, int], dict[int, int]]:
    """The tied copies each segment holds beyond first use, from :func:`tied_parameter_groups`.

    Graph capture counts a shared parameter once, in the segment that uses it first; every other
    holder of a group keeps its own copy. With tensor parallelism a holder keeps ``1/tp`` of it:
    the tied weights are the vocabulary-parallel embedding and LM head (Megatron-LM), sharded over
    the tensor group like every other parameter the capture counts per tensor rank.

    Returns:
        ``(extra, largest)``: per segment index, the bytes of its extra copies and the largest one
        (``{}`` for segments holding none).
    """
    extra: dict[int, int] = {}
    largest: dict[int, int] = {}
    for g in groups:
        for s in g.segments()[1:]:  # the first (lowest) segment already counted it at first use
            share = g.nbytes // max(1, tp)
            extra[s] = extra.get(s, 0) + share
            largest[s] = max(largest.get(s, 0), share)
    return extra, largest


def add_tied_copies(segments: list[Segment], groups, tp: int = 1) -> list[Segment]:
    """Count each tied copy in its segment's parameter bytes.

    Graph capture counts a shared parameter once, in the segment that uses it first; after a
    pipeline split every holder of a :func:`tied_parameter_groups` group keeps its own copy (with
    its own gradient and Adam states), so the other holders get ``nbytes / tp`` (one tensor rank's
    shard, :func:`tied_copy_bytes`) added to ``param_bytes`` (and ``max_param_bytes`` raised to
    it). Returns new segments (inputs untouched).
    """
    extra, largest = tied_copy_bytes(groups, tp)
    return [replace(s, param_bytes=s.param_bytes + extra.get(s.index, 0),
                    max_param_bytes=max(s.max_param_bytes, largest.get(s.index, 0))) for s in segments]
