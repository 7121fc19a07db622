"""Pipeline stage modules of a plan: split a real model at the plan's segment boundaries.

:func:`build_stages` builds the plan's model on the CPU with real float32 weights
(``torch.manual_seed(seed)`` first, so every rank and the single-process reference get identical
weights; ``build_model(name, batch_size=micro_batch_size, seq_len=seq_len, task=plan.model.task)``)
and cuts it into one :class:`StageModule` per segment (segment ``i`` = pipe stage ``i``) with one
of two methods, ``plan.model.split`` (``None``: :func:`engine.split.choose_split`; the method used
is recorded as :attr:`PipelineStages.split`):

- ``"tracer"`` (:class:`TracedStage`): PyTorch's ``torch.distributed.pipelining.pipeline`` with
  our ``split_policy`` (:mod:`runtime.stage_split`): the exported graph is cut at the plan's layers
  exactly as the planner attributed ops to layers, giving exactly one stage per segment;
- ``"module"`` (:class:`runtime.stage_module.SequentialStage`): torchtitan's manual split of an
  ``nn.Sequential``: each stage holds its children under their original names and runs them
  eagerly (:mod:`runtime.stage_module`).

If the tracer cannot export the model and the model is an ``nn.Sequential``, the module split is
used instead (and the other way round); if neither works, :class:`StageSplitError` names the
layer (module path and class) that failed in one sentence.

What a worker needs to run the stages across processes:

- **Chain interface.** ``pipeline()`` may route a value from stage ``i`` straight to stage
  ``j > i + 1`` (GPT-2's boolean attention mask goes from stage 0 to every block). Our instruction
  streams (``engine.dependency.lower``) only move tensors between consecutive segments, so each
  :class:`StageModule` takes the values live at its input boundary and returns the values live
  at its output boundary, passing skip values through. ``forward(*boundary_in) -> tuple``;
  stage 0 takes all model inputs (``input_ids`` int64 ``[micro_batch, seq]``; T5's
  ``(input_ids, decoder_input_ids [micro_batch, seq'])``; images ``[micro_batch, 1, 8, 8]``) and
  the last stage returns exactly one tensor, ``(logits,)`` of any rank (``[micro_batch, seq,
  vocab]``, ``[micro_batch, classes]``).
- **Boundary metadata** (:class:`TensorMeta`): shape, dtype and whether a gradient flows back
  across the boundary, found by running one real micro-batch forward and backward through the
  chain at build time. Receive buffers are allocated from it once (static shapes; the
  "pre-allocated receive buffers" insight of Xue et al., EuroSys 2019; docs/ARCHITECTURE.md, Sources).
  The traced graphs are specialised to the plan's ``micro_batch_size`` and ``seq_len``.
- **Tied weights.** GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight``; after the
  split the first and last stage hold separate copies. :attr:`PipelineStages.tied` lists them
  so the worker can all-reduce (sum) their gradients between the ranks that hold them before the
  optimizer step, Megatron-LM's embedding group (Narayanan et al., SC'21, section on tied
  embeddings / "embedding all-reduce"). The copies start equal and get the same summed gradient,
  so with the same optimizer they stay equal.
- **Leftover parameters.** ``pipeline()`` can leave an unused copy of a tied parameter in a stage
  that does not call its module (stage 0 keeps an ``lm_head`` it never runs). Parameters that get
  no gradient AND lie outside the segment's layers are removed, so they are neither optimised nor
  checkpointed.

- **MoE layers.** The model's own eager :class:`~engine.models.moe.layer.MoEFeedForward`
  layers and Hugging Face sparse MoE blocks (:func:`engine.models.moe.hf_moe.is_hf_moe_block`,
  e.g. Mixtral's ``model.layers.3.mlp``) replace their traced graphs inside traced stages
  (:func:`_restore_eager_moe`), so they produce their aux loss and routing metrics, follow their
  gates' update counters (DTS-Gate temperature), keep the gate buffers in the stage's
  ``state_dict``, and a worker can swap their experts for an expert-parallel version; a segment
  boundary inside an MoE layer is refused.

Tensor parallelism (``tp > 1``) uses the third method, ``"layers"`` (:mod:`runtime.stage_layers`:
eager decoder stages that :mod:`runtime.tensor_parallel` shards with DTensor).
The exported graphs freeze the train/eval mode they were traced in (dropout stays as traced);
the built-in byte-level models have dropout 0, so this only matters for user models with dropout.

Sources: torch.distributed.pipelining (``pipeline``, ``split_policy``, ``Pipe.get_stage_module``),
https://pytorch.org/docs/stable/distributed.pipelining.html; torchtitan
``torchtitan/distributed/pipeline.py`` (the module split).
"""

from __future__ import annotations

import logging
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from engine.errors import TesselError
from runtime.stage_types import StageModule, StageSplitError

__all__ = ["TensorMeta", "StageModule", "TracedStage", "PipelineStages", "RuntimeNotSupported", "StageSplitError",
           "build_stages", "build_stage_modules", "tied_groups", "boundary_specs", "check_executable",
           "retarget_device"]

log = logging.getLogger(__name__)


class RuntimeNotSupported(TesselError, NotImplementedError):
    """The plan uses something the runtime does not execute (multi-device blocks, non-chain
    placements, tensor parallelism on a model without the layer split)."""


@dataclass(frozen=True)
class TensorMeta:
    """Static description of one tensor crossing a stage boundary (one micro-batch).

    Attributes:
        shape: e.g. ``(micro_batch, seq, hidden)``.
        dtype: torch dtype (``torch.float32``, ``torch.bool`` for GPT-2's mask, ``torch.int64``...).
        requires_grad: a gradient of this tensor flows back across the boundary (float tensors
            that the consumer uses differentiably); ``False`` for masks, ids, positions.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()

    def empty(self) -> torch.Tensor:
        """A fresh uninitialised CPU tensor of this shape and dtype."""
        return torch.empty(self.shape, dtype=self.dtype)

    def sequence_shard(self, parts: int) -> "TensorMeta":
        """The metadata of one of ``parts`` equal shards along dim 1 (the sequence of a
        ``[micro_batch, seq, hidden]`` hidden state; ``torch.chunk`` layout): what CoCoNet's
        ``tp-split`` keeps per tensor rank and ``scatter-send`` sends.

        Raises:
            RuntimeNotSupported: the tensor has no dim 1 or ``parts`` does not divide it.
        """
        if parts == 1:
            return self
        if len(self.shape) < 2 or self.shape[1] % parts:
            raise RuntimeNotSupported(f"a boundary tensor of shape {list(self.shape)} cannot be cut into {parts} "
                                      "equal shards along its sequence dim (1); plan without tp-split and "
                                      "scatter-send, or a sequence length divisible by tp")
        return TensorMeta((self.shape[0], self.shape[1] // parts, *self.shape[2:]), self.dtype, self.requires_grad)

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": str(self.dtype).replace("torch.", ""),
                "requires_grad": self.requires_grad}


class TracedStage(StageModule):
    """One segment of the traced (``pipeline()``) split with the chain interface of
    :class:`StageModule`. Parameters keep their original fully qualified names
    (``transformer.h.2.attn.c_attn.weight``), so ``state_dict()`` keys match the unsplit model.

    Attributes:
        segment: segment index.
        inner: the ``pipe.get_stage_module(segment)`` graph module (its children are registered
            on this module too, which is what keeps the names).
    """

    def __init__(self, inner: nn.Module, segment: int, live_in: list, live_out: list, node: fx.Node,
                 produced: dict):
        super().__init__()
        self.inner: nn.Module
        object.__setattr__(self, "inner", inner)   # not a child: keeps FQNs unprefixed
        self.segment = segment
        for name, child in inner.named_children():
            self.add_module(name, child)
        for name, p in inner._parameters.items():
            if p is not None:
                self.register_parameter(name, p)
        for name, b in inner._buffers.items():
            if b is not None:
                self.register_buffer(name, b)
        self._live_in = list(live_in)
        self._live_out = list(live_out)
        self._node = node
        self._produced = produced   # value node -> output index (None: the whole result)

    def train(self, mode: bool = True) -> "TracedStage":
        super().train(mode)
        self.inner.train(mode)
        return self

    def forward(self, *values):
        if len(values) != len(self._live_in):
            raise TypeError(f"segment {self.segment} takes {len(self._live_in)} boundary tensors, "
                            f"got {len(values)}")
        env = dict(zip(self._live_in, values))
        args = fx.node.map_arg(self._node.args, lambda n: env[n])
        kwargs = fx.node.map_arg(self._node.kwargs, lambda n: env[n])
        result = self.inner(*args, **kwargs)
        for v, k in self._produced.items():
            env[v] = result if k is None else result[k]
        out = []
        for v in self._live_out:
            t = env[v]
            if v in self._live_in and isinstance(t, torch.Tensor) and t.requires_grad:
                t = t.clone()   # a pass-through gets its own autograd node (see module doc)
            out.append(t)
        return tuple(out)


@dataclass
class PipelineStages:
    """Everything :func:`build_stages` derives from a plan.

    Attributes:
        modules: segment index -> :class:`StageModule` (all segments; a worker keeps its own).
        split: the method that built them, ``"tracer"`` or ``"module"`` (see the module docstring).
        boundaries: ``boundaries[s]`` describes the outputs of segment ``s`` = inputs of segment
            ``s + 1`` (``s`` in ``0 .. S-2``), one :class:`TensorMeta` per tensor, for one micro-batch.
        inputs: metas of every model input (segment 0's inputs, e.g. ``input_ids`` and T5's
            ``decoder_input_ids``).
        output: meta of the logits (the last segment's single output, any rank).
        tied: tied-parameter groups, each a list of ``(segment, parameter name)`` across which
            gradients must be summed (only groups with 2+ members).
        removed: ``(segment, parameter name)`` of unused leftover parameters that were removed.
        micro_batch_size, seq_len: the static micro-batch shape the stages were built for
            (``seq_len`` 0 for models without a sequence, such as image classifiers).
        aliases: the unsplit model's names of one shared parameter, one sorted list per parameter
            with 2+ names (T5's ``shared.weight`` / ``encoder.embed_tokens.weight`` / ...; BERT's
            ``cls.predictions.bias`` / ``cls.predictions.decoder.bias``); a stage holds such a
            parameter under one or some of them, and the merged checkpoint restores every name.
        chains: the placement's forward chains (:meth:`engine.placement.Placement.chains`): one for
            every shape but X, whose second chain holds copies of the first chain's stages.
    """

    modules: dict[int, StageModule]
    boundaries: list[list[TensorMeta]]
    inputs: list[TensorMeta]
    output: TensorMeta
    tied: list[list[tuple[int, str]]] = field(default_factory=list)
    removed: list[tuple[int, str]] = field(default_factory=list)
    micro_batch_size: int = 1
    seq_len: int = 1
    split: str = "tracer"
    aliases: list[list[str]] = field(default_factory=list)
    chains: list[list[int]] = field(default_factory=list)


def check_executable(plan) -> None:
    """Raise :class:`RuntimeNotSupported` unless the runtime can execute ``plan``.

    The runtime executes pipeline, data and tensor parallelism over a chain of segments where each
    block (F/B/I/W) runs on one pipeline rank: the plain (V), interleaved and zero-bubble
    placements, Tessel's M and NN shapes (all-device blocks in a chain: each runs as a tensor-parallel
    group over its device set) and any Tessel schedule over them. Tensor parallelism (``tp > 1``: every pipeline
    rank is a group of ``tp`` ranks sharding its stages with DTensor, :mod:`runtime.tensor_parallel`)
    needs the layer split (``plan.model.split == "layers"``: a Llama-family or in-project GPT
    decoder, :mod:`runtime.stage_layers`).
    """
    tp = plan.parallel.tp
    if tp > 1 and plan.model.split != "layers":
        raise RuntimeNotSupported(
            f"the plan uses tensor parallelism (tp={tp}) but its stages are built with the "
            f"{plan.model.split or 'default'!r} split; tensor parallelism runs on eager decoder stages (split "
            "'layers'), which `tessel plan --tp` records for Llama-family models and tessel-gpt; "
            f"{plan.model.name!r} is not one of them, so plan it with --tp 1")
    pl = plan.schedule.placement
    S = pl.num_segments
    if S != len(plan.segments):
        raise RuntimeNotSupported(f"the placement has {S} segments but the plan lists {len(plan.segments)}")
    for b in pl.blocks:
        if len(b.devices) == 1:
            continue
        if plan.model.split != "layers":
            raise RuntimeNotSupported(
                f"block {b.segment}{b.kind} runs on devices {list(b.devices)}: the runtime executes a block on "
                "several devices as a tensor-parallel group over them, which needs the layer split (eager "
                f"decoder stages: Llama-family models and tessel-gpt); {plan.model.name!r} is planned with the "
                f"{plan.model.split or 'default'!r} split; place the block on one device")
        if tp > 1:
            raise RuntimeNotSupported(
                f"block {b.segment}{b.kind} runs on devices {list(b.devices)} and the plan also has tp={tp}: a "
                "multi-device block is itself tensor-parallel over its devices; plan it with tp=1")
    for s in range(S):
        if not pl.has("F", s):
            raise RuntimeNotSupported(f"segment {s} has no forward block")
        for k in ("B", "I", "W"):
            if pl.has(k, s) and tuple(pl.spec(k, s).devices) != tuple(pl.spec("F", s).devices):
                raise RuntimeNotSupported(
                    f"block {s}{k} runs on devices {list(pl.spec(k, s).devices)} but {s}F on "
                    f"{list(pl.spec('F', s).devices)}: a segment's backward must run where its forward ran")
    preds: dict[int, list[int]] = {}
    for s in range(S):
        deps = [pl.blocks[i] for i in pl.spec("F", s).deps]
        if any(d.kind != "F" for d in deps):
            raise RuntimeNotSupported(f"block {s}F depends on a backward block; forwards may depend on forwards only")
        preds[s] = [d.segment for d in deps]
    succ: dict[int, list[int]] = {s: [] for s in range(S)}
    for c, ps in preds.items():
        for p in ps:
            succ[p].append(c)
    for p, cs in succ.items():
        if len(cs) > 1:
            raise RuntimeNotSupported(
                f"segment {p}'s output feeds segments {cs}; the runtime sends a segment's outputs to one "
                "consumer segment (chains, model replicas, branches joined by one block)")
    sinks = [s for s in range(S) if not succ[s]]
    sources = [s for s in range(S) if not preds[s]]
    chains = pl.chains()
    if len(sinks) > 1:   # several losses: only model replicas (X), each a chain
        if sum(len(c) for c in chains) != S:
            raise RuntimeNotSupported(
                f"the placement ends in segments {sinks}; several ends are executed only as model replicas "
                "(the X shape: chains F(s-1) -> F(s) of equal layers)")
        _check_replicas(plan, chains)
    elif len(sources) > 1:   # branches joined by a block (K): each branch starts from its own model inputs
        given = {int(g["index"]) for g in plan.segments if g.get("inputs") is not None}
        missing = [s for s in sources if s not in given]
        if missing:
            raise RuntimeNotSupported(
                f"segments {sources} all start from the model's inputs; a placement whose branches are joined "
                f"by a block needs each branch's model inputs (the plan segment field 'inputs'), which segments "
                f"{missing} lack")
    if pl.forward_only:
        return
    grad = "I" if pl.split_backward else "B"
    for s in range(S):
        if not pl.has(grad, s) or (grad == "I" and not pl.has("W", s)):
            raise RuntimeNotSupported(f"segment {s} lacks its backward block(s); the runtime needs "
                                      f"{'I and W' if grad == 'I' else 'B'} for every segment")
        bdeps = tuple(pl.spec(grad, s).deps)
        want = (pl.index("F", s),) if not succ[s] else (pl.index(grad, succ[s][0]),)
        if bdeps != want:
            after = f"{s}F" if not succ[s] else f"{succ[s][0]}{grad}"
            raise RuntimeNotSupported(
                f"block {s}{grad} depends on blocks {list(bdeps)}; the runtime runs a segment's backward right "
                f"after {after} (the forward mirrored)")


def _check_replicas(plan, chains: list[list[int]]) -> None:
    """Several forward chains must be replicas of one model (the X shape, Chimera): equally long,
    segment ``k`` of every chain holding the layers of segment ``k`` of the first."""
    layers = {int(s["index"]): [str(x) for x in s.get("layers") or []] for s in plan.segments}
    first = chains[0]
    for chain in chains[1:]:
        if len(chain) != len(first) or any(layers.get(a) != layers.get(b) for a, b in zip(first, chain)):
            raise RuntimeNotSupported(
                f"the placement has {len(chains)} forward chains ({chains}); the runtime executes several chains "
                "only as replicas of the model (the X shape: segment k of every chain holds the layers of "
                f"segment k of the first), and segments {chain} do not replicate {first}")


def _route(pipe, S: int):
    """Live values at every boundary of the split graph and, per stage, the values it produces."""
    g = pipe.split_gm.graph
    from torch.distributed.pipelining._IR import get_submod_name
    stage_of_target = {get_submod_name(i): i for i in range(S)}
    producer: dict[fx.Node, int] = {}
    consumers: dict[fx.Node, set[int]] = {}
    stage_node: dict[int, fx.Node] = {}
    produced: dict[int, dict[fx.Node, int | None]] = {i: {} for i in range(S)}
    order: list[fx.Node] = []
    output_vals: list[fx.Node] = []

    def uses(args) -> list[fx.Node]:
        out: list[fx.Node] = []
        fx.node.map_arg(args, lambda n: out.append(n))
        return out

    for n in g.nodes:
        if n.op == "placeholder":
            producer[n] = -1
            order.append(n)
        elif n.op == "call_module" and n.target in stage_of_target:
            i = stage_of_target[n.target]
            stage_node[i] = n
            for a in uses((n.args, n.kwargs)):
                consumers.setdefault(a, set()).add(i)
            direct = [u for u in n.users if not (u.op == "call_function" and u.target is operator.getitem)]
            if direct:
                producer[n] = i
                produced[i][n] = None
                order.append(n)
        elif n.op == "call_function" and n.target is operator.getitem:
            src, k = n.args
            if not (isinstance(src, fx.Node) and src.op == "call_module" and src.target in stage_of_target
                    and isinstance(k, int)):
                raise RuntimeNotSupported(f"the split graph has an unsupported value {n.format_node()}")
            i = stage_of_target[src.target]
            producer[n] = i
            produced[i][n] = k
            order.append(n)
        elif n.op == "output":
            output_vals = uses(n.args)
            for a in output_vals:
                consumers.setdefault(a, set()).add(S)
        else:
            raise RuntimeNotSupported(f"the split graph has an unsupported node {n.format_node()}")
    if sorted(stage_node) != list(range(S)):
        raise RuntimeNotSupported(f"pipeline() produced stages {sorted(stage_node)}, expected 0..{S - 1}")
    live: list[list[fx.Node]] = []
    for b in range(S + 1):
        if b == S:
            live.append(list(output_vals))
        else:
            live.append([v for v in order if producer[v] < b and max(consumers.get(v, {-2})) >= b])
    return live, stage_node, produced


def _restore_eager_moe(model: nn.Module, modules: dict[int, StageModule]) -> list[nn.Module]:
    """Put the model's own (eager) MoE layers back into the traced stages, in place of the graphs
    ``pipeline()`` traced for them: :class:`~engine.models.moe.layer.MoEFeedForward` and Hugging
    Face sparse MoE blocks (:func:`engine.models.moe.hf_moe.is_hf_moe_block`; Mixtral's
    ``MixtralSparseMoeBlock``, called as ``mlp(hidden_states [B, T, H]) -> [B, T, H]``).

    The exported graph of an MoE layer freezes what is Python state of the eager layer: DTS-Gate's
    temperature and dense/sparse phase (they follow the optimizer-update counter), and it drops
    the aux (load-balancing) loss, the routing metrics and the gate's state buffers
    (``num_updates``, ``temperature``, ``sparse``). The stage's parent graph calls the layer as a
    submodule (``call_module mlp(x)``), so the eager layer is swapped in at that path: its
    parameters get the traced copies' values (identical, same names), its buffers come with it
    (so they are in the stage's ``state_dict``), and after every forward it holds
    ``last_aux_loss``/``last_metrics`` for the worker. A worker can then replace it by an
    expert-parallel layer (:class:`runtime.expert_parallel.ExpertParallelMoE`), or an HF block's
    ``experts`` by an expert-parallel version. Only traced stages (those with ``inner``) are
    searched; the module split keeps every layer eager anyway.

    Returns:
        the eager layers now inside the stages.

    Raises:
        RuntimeNotSupported: a segment boundary falls inside an MoE layer, or the traced parent
            does not call the layer as one submodule with one tensor argument.
    """
    from engine.models.moe.hf_moe import is_hf_moe_block
    from engine.models.moe.layer import MoEFeedForward

    restored: list[nn.Module] = []
    for name, layer in model.named_modules():
        if not (isinstance(layer, MoEFeedForward) or is_hf_moe_block(layer)):
            continue
        parent_name, _, attr = name.rpartition(".")
        callers = []
        for i, sm in modules.items():
            if not isinstance(sm, TracedStage):
                continue
            try:
                parent = sm.get_submodule(parent_name) if parent_name else sm.inner
            except AttributeError:
                continue
            graph = getattr(parent, "graph", None)
            calls = [n for n in graph.nodes if n.op == "call_module" and n.target == attr] if graph is not None else []
            if calls:
                callers.append((i, sm, parent, calls))
        if not callers:
            continue   # an unused layer: nothing to restore
        if len(callers) > 1 or len(callers[0][3]) != 1:
            raise RuntimeNotSupported(
                f"the MoE layer {name} is called from segments {[c[0] for c in callers]}; put a whole "
                "MoE layer into one segment")
        i, sm, parent, (call,) = callers[0]
        if any(u.op == "call_function" and u.target is operator.getitem for u in call.users):
            raise RuntimeNotSupported(f"segment {i} uses the MoE layer {name}'s result as a tuple; the runtime "
                                      "needs a layer returning one tensor")
        if len(call.args) != 1 or call.kwargs:
            raise RuntimeNotSupported(f"segment {i} calls the MoE layer {name} with {len(call.args)} arguments "
                                      f"and kwargs {sorted(call.kwargs)}; the runtime needs layer(x)")
        traced = getattr(parent, attr)
        mine = dict(layer.named_parameters())
        with torch.no_grad():
            for pname, p in traced.named_parameters():
                if pname not in mine or mine[pname].shape != p.shape:
                    raise RuntimeNotSupported(f"the traced MoE layer {name} has a parameter {pname} "
                                              f"{tuple(p.shape)} that the model's layer lacks")
                mine[pname].copy_(p)
        setattr(parent, attr, layer)
        if not parent_name:           # a top-level layer: the StageModule registers inner's children too
            sm.add_module(attr, layer)
        restored.append(layer)
    return restored


def _failure_sentence(name: str, model: nn.Module, e: BaseException) -> str:
    """One sentence: which layer (module path and class) ``torch.export`` failed in, why, what to do."""
    from engine.graph.capture import trace_failure

    f = trace_failure(e, model)
    what = (f"layer '{f.module_path or '<root>'}' ({f.module_type})" if f.module_type
            else f"the top-level forward of {type(model).__name__}")
    if f.kind == "data-dependent":
        why = f"data-dependent control flow{f.where}"
        todo = ("remove the data-dependent branch (or express it with torch.where / torch.cond) "
                "or make the model an nn.Sequential")
    else:
        why = f"{type(e).__name__}{f.where}: {f.first.rstrip('.')}"
        todo = ("make that layer exportable (torch.export.export(model, example_inputs, strict=False) "
                "must succeed) or make the model an nn.Sequential")
    return (f"cannot split {name!r} into stages: {what} cannot be traced by torch.export ({why}), and the "
            f"model is not an nn.Sequential that the module split could cut; {todo}")


def _trace_split(model: nn.Module, example: tuple, segment_layers: list[list[str]], name: str
                 ) -> dict[int, StageModule]:
    """The tracer split: ``pipeline(model, mb_args=example, split_policy=...)`` (see
    :mod:`runtime.stage_split`) and one :class:`TracedStage` per segment.

    Raises:
        StageSplitError: ``torch.export`` fails (the message names the layer), or ``pipeline()``
            fails after tracing.
        RuntimeNotSupported: the split graph does not fit the chain interface.
    """
    from torch.distributed.pipelining import pipeline

    from runtime.stage_split import segment_split_policy

    S = len(segment_layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            pipe = pipeline(model, mb_args=example, split_policy=segment_split_policy(model, segment_layers))
        except StageSplitError:
            raise
        except Exception as e:  # noqa: BLE001 - every tracing failure becomes one sentence
            cause = e.__cause__ if "cannot capture your model" in str(e) and e.__cause__ is not None else None
            if cause is not None:
                raise StageSplitError(_failure_sentence(name, model, cause)) from cause
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
            raise StageSplitError(
                f"cannot split {name!r} into stages: torch.distributed.pipelining.pipeline failed after tracing "
                f"the model ({type(e).__name__}: {first}); report this model, or make it an nn.Sequential "
                "that the module split can cut") from e
    if pipe.num_stages != S:
        raise RuntimeNotSupported(f"pipeline() made {pipe.num_stages} stages of {name!r}, but the plan has "
                                  f"{S} segments")
    live, stage_node, produced = _route(pipe, S)
    modules: dict[int, StageModule] = {
        i: TracedStage(pipe.get_stage_module(i), i, live[i], live[i + 1], stage_node[i], produced[i])
        for i in range(S)}
    for m in modules.values():
        m.train()
    _run_with_codegen(modules.values())
    return modules


def _split(model: nn.Module, example: tuple, segment_layers: list[list[str]], name: str,
           method: str, chain: bool = True) -> tuple[dict[int, StageModule], str]:
    """Cut ``model`` with ``method`` (``"tracer"`` / ``"module"``, falling back to the other one
    where it applies; ``"layers"``: eager decoder stages, :mod:`runtime.stage_layers`, no
    fallback; ``chain``: the segments form a chain, not K's branches); returns the stages and the
    method used."""
    from runtime.stage_module import split_sequential

    if method == "layers":
        from runtime.stage_layers import split_layers

        return split_layers(model, segment_layers, name, chain=chain), "layers"
    sequential = isinstance(model, nn.Sequential)
    if method == "module":
        if sequential:
            return dict(split_sequential(model, segment_layers)), "module"
        log.warning("%s is a %s, not an nn.Sequential: using the tracer split instead of the module split",
                    name, type(model).__name__)
    try:
        return _trace_split(model, example, segment_layers, name), "tracer"
    except StageSplitError as e:
        if not sequential:
            raise
        log.warning("the tracer split of %s failed (%s); using the module split", name, e)
        return dict(split_sequential(model, segment_layers)), "module"


def _share_tied_copies(m: StageModule, tie_sets: list[set[str]]) -> int:
    """Make the copies of one tied parameter inside one stage the same ``Parameter`` again
    (``pipeline()`` can give T5's ``encoder.embed_tokens.weight`` and ``decoder.embed_tokens.weight``,
    one tensor in the model, separate copies in stage 0), so their gradients accumulate in one
    tensor as in the unsplit model. Returns how many names were re-pointed."""
    n = 0
    for names in tie_sets:
        members = [(name, p) for name, p in m.named_parameters(remove_duplicate=False) if name in names]
        if len({id(p) for _, p in members}) < 2:
            continue
        keep = members[0][1]
        for name, p in members[1:]:
            if p is keep:
                continue
            if not torch.equal(p, keep):
                raise TesselError(f"tied parameter copies {members[0][0]} and {name} differ after the split")
            owner_path, _, leaf = name.rpartition(".")
            owner = m.get_submodule(owner_path) if owner_path else m
            owner._parameters[leaf] = keep
            if not owner_path and isinstance(m, TracedStage):
                m.inner._parameters[leaf] = keep
            n += 1
    return n


def _keep_buffers_non_persistent(model: nn.Module, modules: dict[int, StageModule]) -> int:
    """Mark the stages' buffers non-persistent where the model's are (``pipeline()`` registers every
    buffer it moves as persistent, e.g. Llama's ``model.rotary_emb.inv_freq``), so a stage's
    ``state_dict`` keys stay a subset of the unsplit model's. Returns how many were marked."""
    transient = {f"{path}.{b}" if path else b for path, m in model.named_modules()
                 for b in m._non_persistent_buffers_set}
    n = 0
    for sm in modules.values():
        for path, m in sm.named_modules():
            for b in list(m._buffers):
                if (f"{path}.{b}" if path else b) in transient and b not in m._non_persistent_buffers_set:
                    m._non_persistent_buffers_set.add(b)
                    n += 1
    return n


def build_stages(plan, *, seed: int = 0) -> PipelineStages:
    """Build, split and probe the plan's model (see the module docstring).

    Args:
        plan: an :class:`engine.io.Plan` (``plan.model.name``, ``task``, ``split``,
            ``micro_batch_size``, ``seq_len``; ``plan.segments[i]["layers"]``).
        seed: ``torch.manual_seed(seed)`` right before the model is built.

    Returns:
        :class:`PipelineStages`. Parameter ``.grad`` fields are ``None`` on return.

    Raises:
        RuntimeNotSupported: ``tp > 1`` without the layer split, multi-device blocks, a non-chain placement, a segment
            without layers, or a split the chain interface cannot express.
        StageSplitError: neither split method can cut the model (one sentence naming the layer).
        TesselError: the model name is unknown (``ModelNotFoundError``).
    """
    from engine.models import build_model
    from engine.split import choose_split

    check_executable(plan)
    chains = plan.schedule.placement.replica_chains()   # one model (a chain, K's joined branches), or X's replicas
    S = len(chains[0])   # the first chain; other chains (X: a second model replica) are copies of it
    mbs = plan.model.micro_batch_size
    torch.manual_seed(seed)
    bundle = build_model(plan.model.name, batch_size=mbs, seq_len=plan.model.seq_len, device="cpu",
                         dtype=torch.float32, task=plan.model.task)
    model = bundle.module.float().train()
    seq = int(bundle.seq_len or 0)   # 0: not a sequence model (images)
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    tie_sets = [set(v) for v in aliases.values() if len(v) > 1]

    segs = sorted(plan.segments, key=lambda s: int(s["index"]))
    for s in segs:
        if not s.get("layers"):
            raise RuntimeNotSupported(f"segment {s['index']} lists no layers; cannot find where to split")
    segment_layers = [[str(x) for x in s["layers"]] for s in segs][:S]
    example = tuple(bundle.example_inputs)
    method = plan.model.split or choose_split(model)
    pl = plan.schedule.placement
    preds = {i: [pl.blocks[k].segment for k in pl.spec("F", i).deps] for i in range(S)}
    chain = all(preds[i] == [i - 1] for i in range(1, S))
    modules, method = _split(model, example, segment_layers, plan.model.name, method, chain)
    eager = _restore_eager_moe(model, modules)
    _keep_buffers_non_persistent(model, modules)

    # ---- probe: one real micro-batch forward and backward through the placement's DAG (a chain:
    # segment i takes segment i-1's outputs; K's loss block takes both branches' ends)
    given = {int(g["index"]): [int(k) for k in g["inputs"]] for g in segs if g.get("inputs") is not None}
    records: dict[int, tuple[tuple, tuple]] = {}
    for i in range(S):
        if preds[i]:
            vals: tuple = tuple(v for p in preds[i] for v in records[p][1])
        else:
            vals = tuple(example[k] for k in given[i]) if i in given else tuple(example)
        # a producer's output carries a gradient only where it does in training: computed from
        # parameters (a rotary table or mask passed through a stage does not, so no stage may
        # expect a gradient for it: interleaved Llama stages forward cos/sin untouched)
        ins = tuple(v.detach().requires_grad_(v.is_floating_point() and (not preds[i] or v.requires_grad))
                    if isinstance(v, torch.Tensor) else v for v in vals)
        records[i] = (ins, modules[i](*ins))
    vals = records[S - 1][1]
    logits = vals[0] if len(vals) == 1 else None
    if not isinstance(logits, torch.Tensor):
        raise RuntimeNotSupported(
            f"the last stage of {plan.model.name!r} returns {len(vals)} value(s) "
            f"({', '.join(type(v).__name__ for v in vals)}); the runtime needs exactly one tensor (the logits)")
    torch.autograd.backward(logits.float().square().mean())
    # each producer's outputs against the inputs of its consumer they became (consumers come later)
    fed: dict[int, list[tuple[Any, Any]]] = {}
    for c in range(S):
        at = 0
        for p in preds[c]:
            outs = records[p][1]
            fed[p] = list(zip(outs, records[c][0][at:at + len(outs)]))
            at += len(outs)
    for i in range(S - 1, -1, -1):
        pairs = [(o, x.grad) for o, x in fed.get(i, [])
                 if isinstance(o, torch.Tensor) and o.requires_grad and x.grad is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    boundaries: list[list[TensorMeta]] = []
    for i in range(S - 1):
        metas = []
        for o, x in fed.get(i, []):
            if not isinstance(o, torch.Tensor):
                raise RuntimeNotSupported(f"segment {i} outputs a {type(o).__name__}; only tensors can be sent")
            metas.append(TensorMeta(tuple(o.shape), o.dtype,
                                    bool(o.requires_grad and x.grad is not None)))
        boundaries.append(metas)
    inputs = [TensorMeta(tuple(v.shape), v.dtype, False) for v in example]
    output = TensorMeta(tuple(logits.shape), logits.dtype, True)

    # ---- prune leftovers, find tied copies
    removed: list[tuple[int, str]] = []
    for i, m in modules.items():
        layers = [str(x) for x in segs[i]["layers"]]
        for name, p in list(m.named_parameters()):
            inside = any(name == lay or name.startswith(lay + ".") for lay in layers)
            if p.grad is None and not inside:
                owner_path, _, leaf = name.rpartition(".")
                owner = m.get_submodule(owner_path) if owner_path else m
                delattr(owner, leaf)
                if not owner_path and isinstance(m, TracedStage):
                    m.inner._parameters.pop(leaf, None)
                removed.append((i, name))
    for m in modules.values():   # after the pruning: unused leftover copies are gone
        _share_tied_copies(m, tie_sets)
    tied: list[list[tuple[int, str]]] = []
    for names in tie_sets:
        members = [(i, n) for i, m in modules.items() for n, _ in m.named_parameters() if n in names]
        if len(members) > 1:
            ref = dict(modules[members[0][0]].named_parameters())[members[0][1]]
            for i, n in members[1:]:
                if not torch.equal(dict(modules[i].named_parameters())[n], ref):
                    raise TesselError(f"tied parameter copies {members[0]} and {(i, n)} differ after the split")
            tied.append(sorted(members))
    for m in modules.values():
        m.zero_grad(set_to_none=True)
    for layer in eager:   # drop the probe's routing (it holds the probe's autograd graph)
        for attr, value in (("last_aux_loss", None), ("last_metrics", {}), ("last_gate_output", None)):
            setattr(layer, attr, value)
    if len(chains) > 1:
        modules, boundaries, tied = _replicate_chains(modules, boundaries, tied, chains)
    return PipelineStages(modules, boundaries, inputs, output, sorted(tied), removed, mbs, seq, method,
                          sorted(sorted(t) for t in tie_sets), chains)


def _replicate_chains(modules: dict[int, StageModule], boundaries: list[list[TensorMeta]],
                      tied: list[list[tuple[int, str]]], chains: list[list[int]]):
    """Copy the first chain's stages into every other chain (model replicas, the X shape): segment
    ``k`` of chain ``c`` is ``c * L + k``, a deep copy of segment ``k`` (same weights). Boundaries are
    repeated per chain (a chain's end has no outgoing boundary: ``[]``). Every parameter becomes tied
    across its copies (their gradients are summed at the optimizer step, so the replicas stay
    equal: Chimera's per-stage gradient all-reduce), tied groups of the model (GPT's ``wte`` /
    ``lm_head``) across all their copies."""
    import copy

    L = len(chains[0])
    out = dict(modules)
    for c in range(1, len(chains)):
        for k in range(L):
            try:
                out[c * L + k] = copy.deepcopy(modules[k])
            except Exception as e:   # traced graphs keep fake tensors in their metadata
                raise RuntimeNotSupported(
                    f"the placement runs {len(chains)} model replicas (the X shape), made by copying the first "
                    f"replica's stages, and a {type(modules[k]).__name__} stage cannot be copied ({type(e).__name__}); "
                    "plan it with the layer split (Llama-family models and tessel-gpt: `tessel search --model` "
                    "records it) or search another shape") from None
    bounds = [list(boundaries[k]) if k < L - 1 else [] for _c in range(len(chains)) for k in range(L)][:-1]
    grouped = {m for g in tied for m in g}
    groups = [sorted((s + c * L, n) for c in range(len(chains)) for s, n in g) for g in tied]
    for k in range(L):
        for n, _ in modules[k].named_parameters():
            if (k, n) not in grouped:
                groups.append([(k + c * L, n) for c in range(len(chains))])
    return out, bounds, groups


def _run_with_codegen(modules) -> int:
    """Make every ``torch.export.unflatten.InterpreterModule`` inside ``modules`` run its FX
    graph's generated Python code instead of ``torch.fx.Interpreter``; returns how many.

    ``pipeline()``'s stage modules are unflattened exported graphs whose submodules, by default,
    execute node by node through the interpreter (better stack traces, slower: on
    ``gpt2-small-cpu`` one stage-0 + stage-1 forward and backward of a 2 x 64 micro-batch takes
    about 66-69 ms interpreted and 52 ms with codegen on one CPU thread). The codegen path is
    the one ``InterpreterModule.forward`` itself takes under ``torch.export.unflatten``'s
    ``_disable_interpreter()`` context (and under Dynamo); the results are the same graph's.

    Source: ``torch/export/unflatten.py`` (``InterpreterModule``, ``RUN_WITH_INTERPRETER``).
    """
    from torch.export.unflatten import InterpreterModule

    n = 0
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, InterpreterModule):
                _rename_self_nodes(sub)
                sub._run_with_interpreter = False
                n += 1
    return n


def _rename_self_nodes(sub) -> int:
    """Rename FX nodes called ``self`` (the result of calling a child module named ``self``, as in
    BERT's ``attention.self``): the generated code would assign to ``self`` and then fail on the
    next ``self.output(...)`` ("'Tensor' object has no attribute 'output'"). Returns how many."""
    renamed = 0
    for node in sub.graph.nodes:
        if node.name == "self":
            node._rename("self_value")
            renamed += 1
    if renamed and sub.graph_module is not None:
        sub.graph_module.recompile()
    return renamed


def retarget_device(module: nn.Module, device: torch.device | str) -> int:
    """Rewrite the traced graphs inside a stage module so tensors they create land on ``device``.

    The graphs were traced on the CPU, so factory and metadata calls carry ``device=cpu``
    literally (GPT-2's position ``aten.arange``, ``aten._assert_tensor_metadata``,
    ``aten.to.dtype_layout``); moving the module's parameters to a GPU leaves those on the CPU,
    and the first forward fails on mixed devices. Every ``torch.device`` argument or keyword of
    a graph node is replaced by ``device`` and the generated code is recompiled (the same rewrite
    ``torch.export.passes.move_to_device_pass`` does for an ``ExportedProgram``). Move the
    parameters and buffers yourself (``module.to(device)``).

    Returns:
        The number of node arguments rewritten (0 where nothing names a device).

    Source: torch.fx (``Graph``, ``GraphModule.recompile``);
    ``torch.export.passes.move_to_device_pass``.
    """
    target = torch.device(device)
    n = 0
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        changed = 0
        for node in graph.nodes:
            if any(isinstance(a, torch.device) and a != target for a in node.args):
                node.args = tuple(target if isinstance(a, torch.device) else a for a in node.args)
                changed += 1
            if any(isinstance(v, torch.device) and v != target for v in node.kwargs.values()):
                node.kwargs = {k: (target if isinstance(v, torch.device) else v) for k, v in node.kwargs.items()}
                changed += 1
        if changed:
            gm = sub if isinstance(sub, fx.GraphModule) else sub.__dict__.get("graph_module")
            if isinstance(gm, fx.GraphModule):
                gm.recompile()
            n += changed
    return n


def build_stage_modules(plan, *, seed: int = 0) -> dict[int, StageModule]:
    """Segment index -> :class:`StageModule` (see :func:`build_stages`, which also gives the
    boundary shapes and tied groups)."""
    return build_stages(plan, seed=seed).modules


def tied_groups(plan, *, seed: int = 0) -> list[list[tuple[int, str]]]:
    """Tied parameters across segments, e.g. ``[[(0, "transformer.wte.weight"), (3, "lm_head.weight")]]``.

    Builds the stages; use ``build_stages(plan).tied`` if you already have them.
    """
    return build_stages(plan, seed=seed).tied


def boundary_specs(plan, *, seed: int = 0) -> list[list[TensorMeta]]:
    """Per boundary ``s`` (outputs of segment ``s``), the tensors of one micro-batch.

    Builds the stages; use ``build_stages(plan).boundaries`` if you already have them.
    """
    return build_stages(plan, seed=seed).boundaries
