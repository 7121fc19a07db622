"""Tensor parallelism inside a pipeline stage, with ``torch.distributed.tensor`` (DTensor).

A stage of a ``tp > 1`` plan is an eager decoder or encoder stage (:mod:`runtime.stages.layer_split`) run by the
``tp`` ranks of its tensor-parallel group; :func:`apply_tensor_parallel` shards it over their
1-D :class:`~torch.distributed.device_mesh.DeviceMesh` with
``torch.distributed.tensor.parallel.parallelize_module``, Megatron-LM style, as torchtitan's
``apply_tp`` does:

- attention: query/key/value projections column-parallel (``ColwiseParallel``: each rank computes
  whole heads, ``[B, T, H] -> [B, T, H/tp]``), the output projection row-parallel
  (``RowwiseParallel``: partial sums all-reduced, ``[B, T, H/tp] -> [B, T, H]``);
- MLP: up (and gate) projections column-parallel, down projection row-parallel;
- the token embedding vocab-parallel (``RowwiseParallel(input_layouts=Replicate())`` on an
  ``nn.Embedding``: each rank owns ``vocab/tp`` rows, the lookups are all-reduced);
- the LM head column-parallel over the vocabulary. With loss parallel (torchtitan's
  ``loss_parallel``; the task's ``vocab_parallel_loss``: a cross-entropy over the last dim) its
  logits stay sharded, a ``DTensor`` ``[B, T, vocab]`` placed ``Shard(-1)``
  (``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``), and the loss runs inside
  ``torch.distributed.tensor.parallel.loss_parallel()``: each rank's softmax statistics over its
  ``vocab/tp`` columns are all-reduced (``[B*T]`` floats), never the logits. Otherwise the logits
  are all-gathered (``ColwiseParallel(output_layouts=Replicate())``) and the loss sees a plain
  ``[B, T, vocab]`` tensor.

Everything else (norms, position embeddings, biases of row-parallel layers) stays replicated: every
rank of the group computes it on the same replicated activations, and DTensor's backward
all-reduces the input gradients of the column-parallel layers, so those gradients agree on every
rank. Activations between blocks and across pipeline boundaries are replicated ``[B, T, H]``
tensors; tensor rank ``t`` of one stage exchanges them with tensor rank ``t`` of the next.

Hugging Face models publish their plan (``config.base_model_tp_plan``, e.g. Llama's and GPT-NeoX's
``{"layers.*.self_attn.q_proj": "colwise", ...}``); it is used as is, with ``"colwise"`` and
``"rowwise"`` mapped to torch's styles, and MoE experts (Mixtral's and Qwen2-MoE's ``moe_tp_experts``
with ``packed_colwise`` / ``rowwise`` expert weights) sharded by
:class:`runtime.moe_tensor_parallel.ExpertsTensorParallel`; a style the runtime does not execute (e.g.
GLM-4's ``colwise_gather_output``) is refused before any rank starts
(:func:`engine.split.tensor_parallel_refusal`).
Hugging Face GPT-2 publishes none: its plan is derived as Megatron-LM pairs its ``Conv1D``
projections (:data:`HF_GPT2_TP_PLAN`, executed by :mod:`runtime.conv1d_parallel`; the fused
query/key/value sharded part by part). The in-project GPT's plan is :data:`GPT_TP_PLAN` (its fused
``c_attn`` holds whole heads per row block, :class:`engine.models.gpt.CausalSelfAttention`).
Hugging Face BERT (masked LM) and ViT (image classifier) publish none either; their plans are derived
the Megatron-LM way (:data:`engine.tp_plan.BERT_TP_PLAN`, :data:`engine.tp_plan.VIT_TP_PLAN`: query,
key, value and the MLP's up projection column-parallel, the attention output and the MLP's down
projection row-parallel) on their encoder stages (:mod:`runtime.stages.encoder_split`). BERT's word
embedding is vocab-parallel and its MLM ``decoder`` (weight tied to it, with a bias) column-parallel
over the vocabulary; ViT has no vocabulary: its patch embedding and classifier stay replicated, and
its loss is never vocab-parallel. A user's plan (``tessel plan --tp-plan``, the plan's
``parallel.tp_plan``, :mod:`engine.tp_plan`) replaces any of them for the blocks.

CoCoNet's tensor-parallel transformations (``plan.parallel.transforms``, :mod:`engine.coconet`)
change the plan :func:`stage_tp_plan` builds:

- ``tp-split`` (CoCoNet, Jangda et al., ASPLOS 2022, section 6.2, its Megatron-LM example; Megatron
  sequence parallelism, Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models", 2022, its sequence parallelism): every row-parallel layer's all-reduce becomes a reduce-scatter
  over the sequence (``RowwiseParallel(output_layouts=Shard(1))``), so dropout, the residual add and
  the norms (``SequenceParallel``) run on this rank's ``T/tp`` tokens, and an all-gather
  (``PrepareModuleInput(Shard(1) -> Replicate())``) restores the whole sequence before the next
  column-parallel layers (attention, MLP); the embedding reduce-scatters its lookups
  (``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``), the final norm runs on
  the shard and the LM head all-gathers its input (``ColwiseParallel(input_layouts=Shard(1))``), as
  torchtitan's ``apply_tp`` does. The residual stream is ``[B, T/tp, H]`` per rank: the GPT keeps it
  as local tensors (torchtitan's way; its learned positions are a vocab-parallel ``wpe`` whose
  lookups of all ``T`` positions are reduce-scattered to ``Shard(0)``, this rank's ``T/tp``
  positions), a Hugging Face decoder as a ``Shard(1)`` ``DTensor`` of the global shape (its model
  builds the causal mask and the rotary tables from the hidden state's shape), which the stage
  unwraps at its output and wraps back at its input (:class:`runtime.stages.layer_split.HFDecoderStage`),
  so a pipeline boundary carries the local ``[B, T/tp, H]`` shard.
- ``chunked-overlap`` (CoCoNet section 4): every row-parallel layer runs as
  :class:`runtime.chunked_overlap.ChunkedRowwiseParallel`, its matmul and all-reduce pipelined over
  ``plan.parallel.overlap_chunks`` chunks of the sequence.

Sources: PyTorch, "Tensor Parallelism" (``torch.distributed.tensor.parallel``); torchtitan
``torchtitan/models/llama3/infra/parallelize.py`` (``apply_tp``); Shoeybi et al., "Megatron-LM"
(2019), section 3.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from engine.errors import TesselError
from engine.models.gpt import CausalSelfAttention
from engine.tp_plan import GPT2_TP_PLAN, T5_TP_PLAN, TESSEL_GPT_TP_PLAN, packed_parts
from runtime.chunked_overlap import ChunkedRowwiseParallel
from runtime.conv1d_parallel import Conv1DColwiseParallel, Conv1DRowwiseParallel, is_conv1d
from runtime.moe_tensor_parallel import ExpertsTensorParallel, experts_shard_spec
from runtime.stages.encoder_split import HFEncoderStage
from runtime.stages.layer_split import GPTStage, HFDecoderStage, HFGPT2Stage
from runtime.stages.seq2seq_split import T5Stage, shard_heads

__all__ = ["GPT_SP_PLAN", "GPT_TP_PLAN", "HF_GPT2_TP_PLAN", "HF_SP_PLAN", "TensorParallelError",
           "apply_tensor_parallel", "coconet_tp_refusal", "has_lm_head", "local_grad", "local_tensor", "shard_dims",
           "shard_view", "stage_tp_plan", "to_local_state", "from_local_state"]

#: The in-project GPT's plan: module path pattern -> style name (``engine.models.gpt``;
#: :data:`engine.tp_plan.TESSEL_GPT_TP_PLAN` under the stage's ``transformer``).
GPT_TP_PLAN = {f"transformer.{k}": v for k, v in TESSEL_GPT_TP_PLAN.items()}


#: A Hugging Face GPT-2's plan (:data:`engine.tp_plan.GPT2_TP_PLAN`, derived from its graph as Megatron-LM
#: pairs its ``Conv1D`` projections, :mod:`runtime.conv1d_parallel`) under the stage's ``transformer``.
HF_GPT2_TP_PLAN = {f"transformer.{k}": v for k, v in GPT2_TP_PLAN.items()}


#: ``tp-split`` (sequence parallelism) in the in-project GPT: module path pattern -> role: ``"sequence"`` (a
#: norm on the ``Shard(1)`` sequence shard, ``SequenceParallel``), ``"gather"`` (the block part whose first
#: positional input is all-gathered from ``Shard(1)`` to ``Replicate()``, ``PrepareModuleInput``).
GPT_SP_PLAN = {
    "transformer.h.*.ln_1": "sequence",
    "transformer.h.*.attn": "gather",
    "transformer.h.*.ln_2": "sequence",
    "transformer.h.*.mlp": "gather",
    "transformer.ln_f": "sequence",
}

#: ``tp-split`` in a Hugging Face decoder laid out as Llama's (``input_layernorm``, ``self_attn`` called with
#: ``hidden_states=``, ``post_attention_layernorm``, ``mlp``; the final ``model.norm``). ``"gather:NAME"``:
#: the keyword input ``NAME`` is all-gathered.
HF_SP_PLAN = {
    "model.layers.*.input_layernorm": "sequence",
    "model.layers.*.self_attn": "gather:hidden_states",
    "model.layers.*.post_attention_layernorm": "sequence",
    "model.layers.*.mlp": "gather",
    "model.norm": "sequence",
}

#: The row-parallel layers (relative to a block) ``tp-split`` expects a Hugging Face plan to have: their
#: outputs go straight into the residual adds, which then run on the sequence shard.
_HF_ROWWISE = ("layers.*.self_attn.o_proj", "layers.*.mlp.down_proj")


def coconet_tp_refusal(transforms: Any, *, tp: int, seq_len: int) -> str | None:
    """The sentence refusing CoCoNet's tensor-parallel transformations this runtime cannot execute on a
    plan with tensor-parallel degree ``tp`` and ``seq_len`` tokens per sequence, or ``None``:
    ``chunked-overlap`` together with ``tp-split`` (the chunked path pipelines an all-reduce, which
    ``tp-split`` has turned into a reduce-scatter), and ``tp-split`` / ``scatter-send`` with a sequence
    that ``tp`` does not divide (both cut it into ``tp`` equal ``torch.chunk`` shards)."""
    tf = set(transforms or ())
    if tp < 2:
        return None
    if "tp-split" in tf and "chunked-overlap" in tf:
        return ("the runtime executes 'chunked-overlap' by pipelining each row-parallel layer's all-reduce, which "
                "'tp-split' replaces by a reduce-scatter over the sequence; plan with one of the two")
    for name in ("tp-split", "scatter-send"):
        if name in tf and seq_len % tp:
            return (f"transformation {name!r} cuts each sequence of {seq_len} tokens into tp={tp} equal shards, "
                    f"which {tp} does not divide; plan a sequence length divisible by {tp}")
    return None


class TensorParallelError(TesselError):
    """A stage cannot be sharded over the plan's tensor-parallel degree (one sentence says why)."""


def has_lm_head(stage: nn.Module) -> bool:
    """Whether an eager decoder stage holds its model's LM head (the last stage)."""
    try:
        return _has(stage, _own_plan(stage, True)[2])
    except TensorParallelError:
        return False


def _family_plan(stage: Any, tp_plan: dict[str, str] | None = None) -> tuple[dict[str, str], str, str, dict[str, int]]:
    """(block plan, embedding path, head path, sizes that must divide by tp) of a stage; ``tp_plan``
    (a user's, :mod:`engine.tp_plan`: paths relative to the base model) replaces the block plan."""
    block, embed, head, sizes = _own_plan(stage, tp_plan is not None)
    if tp_plan is not None:
        base = _BASE_PREFIX[type(stage)] if type(stage) in _BASE_PREFIX else f"{stage.layout.base}."
        block = {f"{base}{k}": v for k, v in tp_plan.items() if v != "embedding_rowwise"}
    return block, embed, head, sizes


#: The base model's prefix of the stage classes whose parameters live under one fixed name.
_BASE_PREFIX: dict[type, str] = {GPTStage: "transformer.", HFGPT2Stage: "transformer.", T5Stage: ""}

#: Token embeddings besides :func:`_own_plan`'s, vocab-parallel the same way (T5's decoder has its own, tied).
_MORE_EMBEDDINGS: dict[type, tuple[str, ...]] = {T5Stage: ("decoder.embed_tokens",)}


def _own_plan(stage: Any, overridden: bool) -> tuple[dict[str, str], str, str, dict[str, int]]:
    """:func:`_family_plan` without a user's plan (``overridden``: one replaces the block plan, so a
    model that publishes none is not refused)."""
    if isinstance(stage, GPTStage):
        heads = [m.n_head for m in stage.modules() if isinstance(m, CausalSelfAttention)]
        return dict(GPT_TP_PLAN), "transformer.wte", "lm_head", {"attention heads": heads[0]} if heads else {}
    if isinstance(stage, HFDecoderStage):
        lay = stage.layout
        cfg = stage.base.config
        plan = getattr(cfg, "base_model_tp_plan", None) or {}
        if not plan and not overridden:
            raise TensorParallelError(
                f"{type(stage.base).__name__} publishes no tensor-parallel plan (config.base_model_tp_plan); "
                "use tp=1 for this model")
        sizes = {"attention heads": int(cfg.num_attention_heads),
                 "key/value heads": int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)}
        # the token embedding is vocab-parallel whatever the plan calls it (GPT-NeoX: "embedding_rowwise")
        blocks = {f"{lay.base}.{k}": v for k, v in plan.items() if k != lay.embed}
        return blocks, f"{lay.base}.{lay.embed}", lay.head, sizes
    if isinstance(stage, HFGPT2Stage):
        cfg = stage.transformer.config
        return dict(HF_GPT2_TP_PLAN), "transformer.wte", "lm_head", {"attention heads": int(cfg.n_head)}
    if isinstance(stage, HFEncoderStage):   # BERT / ViT: the derived plan; ViT has no vocabulary ("": none)
        enc = stage.layout
        blocks = {f"{enc.base}.{k}": v for k, v in enc.tp_plan}
        sizes = {"attention heads": int(stage.base.config.num_attention_heads)}
        return blocks, enc.token_embedding or "", enc.vocab_head or "", sizes
    if isinstance(stage, T5Stage):   # T5: the derived plan from the model root, both stacks' embeddings
        return dict(T5_TP_PLAN), "encoder.embed_tokens", "lm_head", {"attention heads": stage.num_heads}
    raise TensorParallelError(f"a {type(stage).__name__} stage cannot be tensor-parallel: build the plan's stages "
                              "with the layer split (plan.model.split = 'layers')")


def _pattern(path: str) -> re.Pattern:
    return re.compile("^" + r"\.".join("[^.]+" if t == "*" else re.escape(t) for t in path.split(".")) + "$")


def stage_tp_plan(stage: nn.Module, tp: int, *, loss_parallel: bool = False, sequence_parallel: bool = False,
                  overlap_chunks: int = 0, tp_plan: dict[str, str] | None = None) -> dict[str, Any]:
    """The ``parallelize_module`` plan of one eager decoder stage for ``tp`` ranks: module path
    (``*`` matches one level) -> ``ParallelStyle`` instance. With ``loss_parallel`` the LM head's
    logits stay vocab-sharded; ``sequence_parallel``: CoCoNet's ``tp-split`` (the row-parallel layers
    reduce-scatter over the sequence, norms on the shard, all-gathers before the column-parallel
    layers); ``overlap_chunks > 0``: ``chunked-overlap`` (row-parallel layers as
    :class:`runtime.chunked_overlap.ChunkedRowwiseParallel` with that many chunks); ``tp_plan``: a
    user's plan for the blocks (:mod:`engine.tp_plan`, the plan's ``parallel.tp_plan``). See the
    module docstring.

    Raises:
        TensorParallelError: the model publishes no plan, its plan uses a style other than
            ``colwise``/``rowwise`` and the experts' ``moe_tp_experts`` (e.g. GLM-4's
            ``colwise_gather_output``; the entry is named), MoE experts with ``tp-split`` or ``chunked-overlap``,
            its heads do not divide by ``tp``, ``sequence_parallel`` on a Hugging Face model whose
            decoder layers are not laid out as Llama's, or both ``sequence_parallel`` and
            ``overlap_chunks``.
    """
    block_plan, embed, head, sizes = _family_plan(stage, tp_plan)
    for what, n in sizes.items():
        if n % tp:
            raise TensorParallelError(f"the model has {n} {what}, which tp={tp} does not divide; tensor "
                                      "parallelism splits whole heads across ranks, pick a tp that divides it")
    if sequence_parallel and overlap_chunks:
        raise TensorParallelError("'chunked-overlap' pipelines the row-parallel all-reduce that 'tp-split' turns "
                                  "into a reduce-scatter; plan with one of the two")
    if isinstance(stage, (HFEncoderStage, T5Stage)) and (sequence_parallel or overlap_chunks):
        raise TensorParallelError(f"'tp-split' and 'chunked-overlap' rewrite decoder-only blocks, and "
                                  f"{type(stage).__name__} is an encoder's or encoder-decoder's; plan it without "
                                  "CoCoNet's tensor-parallel transformations")
    hf = isinstance(stage, HFDecoderStage)
    names = [n for n, _ in stage.named_modules()]

    def present(path: str) -> list[str]:
        pattern = _pattern(path)
        return [n for n in names if pattern.match(n)]

    def rowwise() -> Any:
        if overlap_chunks:
            return ChunkedRowwiseParallel(overlap_chunks)
        if sequence_parallel:   # reduce-scatter over the sequence; GPT keeps its residual stream local
            return RowwiseParallel(output_layouts=Shard(1), use_local_output=not hf)
        return RowwiseParallel()

    out: dict[str, Any] = {}
    experts = [p for p, v in block_plan.items() if v == "moe_tp_experts"]
    for path in experts:   # transformers' moe_tp_experts: the experts' 3-D weights (runtime.moe_tensor_parallel)
        found = present(path)
        if not found:
            continue
        if sequence_parallel or overlap_chunks:
            raise TensorParallelError(f"the plan shards the MoE experts {path!r} as 'moe_tp_experts', which "
                                      "'tp-split' and 'chunked-overlap' do not rewrite; plan it without CoCoNet's "
                                      "tensor-parallel transformations")
        entries = {k[len(path) + 1:]: v for k, v in block_plan.items() if k.startswith(path + ".")}
        try:
            spec = experts_shard_spec(entries, transposed=bool(getattr(stage.get_submodule(found[0]),
                                                                        "is_transposed", False)))
        except ValueError as e:
            raise TensorParallelError(f"{e}; use tp=1 for this model") from None
        out[path] = ExpertsTensorParallel(spec)
    for path, style in block_plan.items():
        if path in experts or any(path.startswith(e + ".") for e in experts):
            continue
        packed = packed_parts(style)
        if style not in ("colwise", "rowwise") and not packed:
            raise TensorParallelError(f"the model's tensor-parallel plan shards {path!r} as {style!r}; the runtime "
                                      "executes 'colwise' and 'rowwise' layers only, use tp=1 for this model")
        found = present(path)
        if not found:   # a stage without blocks (M's embedding, head) has none
            continue
        conv1d = is_conv1d(stage.get_submodule(found[0]))
        if packed and not conv1d:
            raise TensorParallelError(f"the plan shards {path!r} as {style!r}, which the runtime executes on "
                                      "transformers' Conv1D layers only; use tp=1 for this model")
        if conv1d and (sequence_parallel or overlap_chunks):
            raise TensorParallelError(f"{type(stage).__name__}'s projections are Conv1D layers, which 'tp-split' and "
                                      "'chunked-overlap' do not shard; plan it without CoCoNet's tensor-parallel "
                                      "transformations")
        if conv1d:
            out[path] = Conv1DColwiseParallel(packed=packed or 1) if style != "rowwise" else Conv1DRowwiseParallel()
        else:
            out[path] = ColwiseParallel() if style == "colwise" else rowwise()
    if sequence_parallel:
        if hf:
            rows = sorted(k[len("model."):] for k, v in block_plan.items() if v == "rowwise")
            if tuple(rows) != tuple(sorted(_HF_ROWWISE)):
                raise TensorParallelError(
                    f"'tp-split' needs decoder layers laid out as Llama's (row-parallel {', '.join(_HF_ROWWISE)} "
                    f"feeding the residual adds); {type(stage.base).__name__}'s plan has row-parallel {rows}, so "
                    "plan it without tp-split")
        for path, role in (HF_SP_PLAN if hf else GPT_SP_PLAN).items():
            found = [n for n in present(path) if not isinstance(stage.get_submodule(n), nn.Identity)]
            if not found:   # not on this stage (the final norm lives on the last one)
                continue
            if role == "sequence":
                out[path] = SequenceParallel()
            elif role == "gather":
                out[path] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            else:
                kw = role.split(":", 1)[1]
                out[path] = PrepareModuleInput(input_kwarg_layouts={kw: Shard(1)},
                                               desired_input_kwarg_layouts={kw: Replicate()})
        if hf and present("model.layers.*") and not present("model.layers.*.input_layernorm"):
            raise TensorParallelError(f"'tp-split' needs decoder layers laid out as Llama's (input_layernorm, "
                                      f"self_attn, post_attention_layernorm, mlp); {type(stage.base).__name__}'s are "
                                      "not, so plan it without tp-split")
    if _has(stage, embed):
        if sequence_parallel:   # the vocab-parallel lookups reduce-scattered over the sequence
            out[embed] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=not hf)
            if not hf and _has(stage, "transformer.wpe"):   # positions [T, H]: this rank's T/tp rows
                out["transformer.wpe"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
        else:
            out[embed] = RowwiseParallel(input_layouts=Replicate())
    for more in _MORE_EMBEDDINGS.get(type(stage), ()):
        if _has(stage, more):
            out[more] = RowwiseParallel(input_layouts=Replicate())
    if _has(stage, head):
        head_in = Shard(1) if sequence_parallel else Replicate()
        if loss_parallel:
            out[head] = ColwiseParallel(input_layouts=head_in, output_layouts=Shard(-1), use_local_output=False)
        else:
            out[head] = ColwiseParallel(input_layouts=head_in, output_layouts=Replicate())
    return out


def _has(module: nn.Module, path: str) -> bool:
    """Whether ``module`` holds a submodule at ``path`` (``""``: the model has no such part)."""
    if not path:
        return False
    try:
        return module.get_submodule(path) is not None
    except AttributeError:
        return False


def apply_tensor_parallel(stage: nn.Module, mesh, *, loss_parallel: bool = False, sequence_parallel: bool = False,
                          overlap_chunks: int = 0, tp_plan: dict[str, str] | None = None) -> dict[str, int]:
    """Shard ``stage`` in place over the 1-D tensor-parallel ``mesh`` (``parallelize_module`` with
    :func:`stage_tp_plan`; ``loss_parallel``: the LM head's logits stay vocab-sharded;
    ``sequence_parallel``: ``tp-split``, a Hugging Face stage then takes and returns the local
    ``[B, T/tp, H]`` shard, ``HFDecoderStage.sequence_mesh``; ``overlap_chunks``: ``chunked-overlap``);
    re-ties parameters the stage shared before (GPT's ``wte``/``lm_head`` in a one-stage plan: both become
    ``Shard(0)`` over the vocabulary, so one DTensor serves both; a name whose module the plan leaves
    whole, BERT's ``cls.predictions.bias`` beside the sharded ``cls.predictions.decoder.bias``, gets the
    sharded tensor).

    Returns:
        ``{parameter name: sharded dim}`` of every sharded parameter (:func:`shard_dims`).

    Raises:
        TensorParallelError: see :func:`stage_tp_plan`.
    """
    tp = mesh.size()
    plan = stage_tp_plan(stage, tp, loss_parallel=loss_parallel, sequence_parallel=sequence_parallel,
                         overlap_chunks=overlap_chunks, tp_plan=tp_plan)
    names: dict[int, list[str]] = {}
    for name, p in stage.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    shared = [v for v in names.values() if len(v) > 1]
    parallelize_module(stage, mesh, plan)
    if isinstance(stage, HFGPT2Stage):
        _localize_gpt2_attention(stage, tp)
    if isinstance(stage, T5Stage):   # heads/tp heads per rank, each adding its slice of the position biases
        shard_heads(stage, mesh.get_local_rank(), tp, mesh.get_group())
    for group in shared:
        first = next((n for n in group if isinstance(stage.get_parameter(n), DTensor)), group[0])
        keep = stage.get_parameter(first)
        for name in (n for n in group if n != first):
            owner_path, _, leaf = name.rpartition(".")
            owner = stage.get_submodule(owner_path) if owner_path else stage
            other = owner._parameters[leaf]
            if isinstance(other, DTensor) and other.placements != getattr(keep, "placements", None):
                raise TensorParallelError(f"parameters {first} and {name} are one tied tensor but tensor "
                                          "parallelism shards them differently; place them on different stages")
            owner._parameters[leaf] = keep
    if sequence_parallel and hasattr(stage, "sequence_mesh"):
        stage_any: Any = stage
        stage_any.sequence_mesh = mesh
    return shard_dims(stage)


def _localize_gpt2_attention(stage: nn.Module, tp: int) -> None:
    """GPT-2's attention splits its fused ``c_attn`` output into query, key and value by
    ``split_size`` (the hidden size); column-parallel in three parts, each rank's output holds
    ``H/tp`` features of each, so its attention modules split by ``H/tp`` and run ``heads/tp``
    heads (their views infer the head count from the shape)."""
    for m in stage.modules():
        attn: Any = m
        if is_conv1d(getattr(attn, "c_attn", None) or nn.Identity()) and hasattr(attn, "split_size"):
            attn.split_size //= tp
            attn.embed_dim //= tp
            attn.num_heads //= tp


def shard_dims(module: nn.Module) -> dict[str, int]:
    """``{state_dict key: dim}`` of every DTensor parameter of ``module`` sharded on one dim."""
    out: dict[str, int] = {}
    for k, v in module.state_dict(keep_vars=True).items():
        if isinstance(v, DTensor):
            dims = [p.dim for p in v.placements if isinstance(p, Shard)]
            if dims:
                out[k] = int(dims[0])
    return out


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (``to_local()``), or ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """``p.grad`` as this rank's shard laid out like ``p`` (``None`` without a gradient).

    DTensor may return a gradient with other placements than its parameter: a vocab-parallel
    embedding (``Shard(0)`` weight) gets a ``Replicate()`` gradient from its backward. It is
    redistributed to the parameter's placements first (from ``Replicate`` a local slice, no
    communication) and stored back in ``p.grad``, so flat all-reduce buffers, tied sums and the
    optimizer all see shards of the parameter's shape."""
    g: Any = p.grad
    d: Any = p
    if g is None or local_tensor(p) is p:
        return g
    if tuple(g.placements) != tuple(d.placements):
        g = g.redistribute(d.device_mesh, d.placements)
        p.grad = g
    return g.to_local()


def shard_view(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The slice of ``full`` (shaped like ``p``'s global shape) that ``p``'s local shard covers
    (``torch.chunk`` along its ``Shard`` dim, DTensor's layout); ``full`` itself for a plain tensor."""
    if local_tensor(p) is p:
        return full
    d: Any = p
    view = full
    for mesh_dim, placement in enumerate(d.placements):
        if isinstance(placement, Shard):
            k = d.device_mesh.size(mesh_dim)
            view = view.chunk(k, dim=placement.dim)[d.device_mesh.get_local_rank(mesh_dim)]
    return view


def to_local_state(state: Any) -> Any:
    """``state`` (a nested dict/list of tensors, e.g. a module's or optimizer's ``state_dict``) with
    every DTensor replaced by its local shard, for checkpoints (plain tensors, ``weights_only``)."""
    if isinstance(state, dict):
        return {k: to_local_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_local_state(v) for v in state)
    return local_tensor(state) if isinstance(state, torch.Tensor) else state


def from_local_state(state: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_local_state` for a module ``state_dict``: each entry whose counterpart in
    ``like`` (``module.state_dict(keep_vars=True)``) is a DTensor becomes a DTensor with the same mesh
    and placements around the saved local shard."""
    out = {}
    for k, v in state.items():
        ref = like.get(k)
        if isinstance(ref, DTensor) and not isinstance(v, DTensor):   # global shape given: FSDP's shards may be uneven
            v = DTensor.from_local(v.to(ref.device), ref.device_mesh, ref.placements, run_check=False,
                                   shape=ref.shape, stride=ref.stride())
        out[k] = v
    return out
