"""A user's tensor-parallel plan (``tessel plan --tp-plan FILE``): read, checked, costed.

The file is a JSON object in transformers' ``base_model_tp_plan`` format: module path patterns
relative to the base model (``*`` matches one level: ``"layers.*.self_attn.q_proj"`` for Llama,
``"h.*.attn.c_attn"`` for GPT-2) -> a style:

- ``"colwise"``: the layer's output features split over the ``tp`` ranks (Megatron-LM's column
  parallelism), its input replicated;
- ``"rowwise"``: its input features split, the partial outputs all-reduced;
- ``"packed_colwise:K"``: column-parallel part by part over ``K`` fused equal parts (GPT-2's
  ``c_attn``: query, key and value, ``K = 3``), so each rank computes whole heads of each;
- ``"embedding_rowwise"``: the token embedding vocab-parallel (it always is: the entry is accepted
  and changes nothing).

It replaces the model's own plan (the one it publishes, or the one the runtime derives for GPT-2,
BERT, ViT and the in-project GPT) for the transformer blocks; the token embedding and the LM head stay
vocab-parallel. The plan records it (``parallel.tp_plan``), the planner costs it
(:class:`ShardedSublayers`: a block's ops run on ``1/tp`` of the work only inside a sublayer the
plan shards, e.g. ``attn``, and each sharded sublayer all-reduces its output once) and the runtime
executes it (``runtime.tensor_parallel``).

Sources: transformers, "Tensor parallelism" (``base_model_tp_plan``, its style names); Shoeybi et
al., "Megatron-LM" (2019), section 3.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

from engine.errors import TransformError

__all__ = ["BERT_TP_PLAN", "GPT2_TP_PLAN", "SHARDING_KINDS", "ShardedSublayers", "T5_TP_PLAN", "TESSEL_GPT_TP_PLAN",
           "VIT_TP_PLAN", "check_tp_plan", "check_tp_plan_matches", "op_sharding", "packed_parts", "parse_tp_plan",
           "read_tp_plan", "style_pattern"]

#: Hugging Face GPT-2's plan, derived from its graph as Megatron-LM pairs its projections (transformers
#: publishes none: they are ``Conv1D``, sharded by ``runtime.conv1d_parallel``): the fused query/key/value
#: ``c_attn`` column-parallel in its three parts (each rank computes whole heads of all three), the
#: attention output and the MLP's down projection row-parallel, the MLP's up projection column-parallel.
GPT2_TP_PLAN = {"h.*.attn.c_attn": "packed_colwise:3", "h.*.attn.c_proj": "rowwise",
                "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"}

#: The in-project GPT's plan (``engine.models.gpt``: its fused ``c_attn`` holds whole heads per row block).
TESSEL_GPT_TP_PLAN = {"h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise",
                      "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"}

#: Hugging Face BERT's plan (``BertModel``: transformers publishes none), derived as Megatron-LM pairs an
#: encoder layer's projections: the query, key and value projections and the MLP's ``intermediate.dense``
#: column-parallel (each rank computes whole heads, ``intermediate_size/tp`` features), the attention output
#: ``attention.output.dense`` and the MLP's ``output.dense`` row-parallel; the post-residual LayerNorms replicated.
BERT_TP_PLAN = {"encoder.layer.*.attention.self.query": "colwise", "encoder.layer.*.attention.self.key": "colwise",
                "encoder.layer.*.attention.self.value": "colwise", "encoder.layer.*.attention.output.dense": "rowwise",
                "encoder.layer.*.intermediate.dense": "colwise", "encoder.layer.*.output.dense": "rowwise"}

#: Hugging Face ViT's plan (``ViTModel``, transformers 5: ``layers.*.attention.{q,k,v,o}_proj``,
#: ``layers.*.mlp.fc1/fc2``; it publishes none), derived the same way: query/key/value and ``fc1``
#: column-parallel, ``o_proj`` and ``fc2`` row-parallel, the pre-norms replicated.
VIT_TP_PLAN = {"layers.*.attention.q_proj": "colwise", "layers.*.attention.k_proj": "colwise",
               "layers.*.attention.v_proj": "colwise", "layers.*.attention.o_proj": "rowwise",
               "layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise"}

#: Hugging Face T5's plan (``T5ForConditionalGeneration``; it publishes none; paths from the model root, which
#: has no base model), derived the same way in both stacks: the self- and cross-attention's ``q``, ``k``, ``v``
#: and the feed-forward's ``wi`` (gated: ``wi_0``, ``wi_1``) column-parallel, ``o`` and ``wo`` row-parallel; the
#: relative position bias (``relative_attention_bias``, ``heads`` columns) stays replicated and each rank adds
#: its heads' slice (``runtime.stages.seq2seq_split``).
T5_TP_PLAN = {
    **{f"*.block.*.layer.0.SelfAttention.{p}": "colwise" for p in ("q", "k", "v")},
    "*.block.*.layer.0.SelfAttention.o": "rowwise",
    **{f"decoder.block.*.layer.1.EncDecAttention.{p}": "colwise" for p in ("q", "k", "v")},
    "decoder.block.*.layer.1.EncDecAttention.o": "rowwise",
    **{f"*.block.*.layer.*.DenseReluDense.{p}": "colwise" for p in ("wi", "wi_0", "wi_1")},
    "*.block.*.layer.*.DenseReluDense.wo": "rowwise",
}

#: How an op runs under tensor parallelism (:func:`op_sharding`), as the model graph view colours it.
SHARDING_KINDS = ("column-parallel", "row-parallel", "sharded", "vocab-parallel", "replicated")

#: Styles without parameters; ``packed_colwise:K`` (K >= 2) is the one with one.
PLAIN_STYLES = ("colwise", "rowwise", "embedding_rowwise")


def packed_parts(style: str) -> int:
    """The ``K`` of a ``packed_colwise:K`` style, else 0."""
    name, _, k = style.partition(":")
    return int(k) if name == "packed_colwise" and k.isdigit() and int(k) > 1 else 0


def check_tp_plan(plan: Any, where: str = "the tensor-parallel plan") -> dict[str, str]:
    """``plan`` as a ``{pattern: style}`` dict, or :class:`TransformError` in one sentence naming
    the first entry that is not a non-empty dotted module path pattern mapped to a known style."""
    if not isinstance(plan, dict) or not plan:
        raise TransformError(f"{where} must be a non-empty JSON object mapping module path patterns to styles "
                             f"(transformers' base_model_tp_plan format), got {type(plan).__name__}")
    for key, style in plan.items():
        if not isinstance(key, str) or not key or any(not part for part in key.split(".")):
            raise TransformError(f"{where} has the key {key!r}, which is not a dotted module path pattern such as "
                                 "'layers.*.self_attn.q_proj'")
        if not isinstance(style, str) or (style not in PLAIN_STYLES and not packed_parts(style)):
            raise TransformError(f"{where} shards {key!r} as {style!r}; use one of {', '.join(PLAIN_STYLES)} or "
                                 "packed_colwise:K (K >= 2 fused parts)")
    return dict(plan)


def check_tp_plan_matches(plan: Mapping[str, str], module: Any, name: str) -> None:
    """Refuse (:class:`TransformError`, one sentence) an entry of ``plan`` that names no submodule
    of ``module`` (an ``nn.Module`` called ``name``): a misspelt path would otherwise shard
    nothing without a word."""
    names = [n for n, _ in module.named_modules() if n]
    for key in plan:
        pattern = style_pattern(key)
        if not any(pattern.match(n) for n in names):
            raise TransformError(f"the tensor-parallel plan's entry {key!r} names no module of {name!r}; give paths "
                                 "relative to its base model as transformers' base_model_tp_plan does (e.g. "
                                 "'layers.*.self_attn.q_proj' for Llama, 'h.*.attn.c_attn' for GPT-2)")


def parse_tp_plan(text: str, where: str = "the tensor-parallel plan") -> dict[str, str]:
    """A tensor-parallel plan from its JSON ``text`` (see the module docstring), checked.

    Raises:
        TransformError: not JSON, or not a valid plan (one sentence naming ``where`` it came from).
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TransformError(f"{where} is not JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    return check_tp_plan(data, where)


def read_tp_plan(path: str | Path) -> dict[str, str]:
    """Read and check a tensor-parallel plan file (see the module docstring).

    Raises:
        TransformError: the file cannot be read, is not JSON, or is not a valid plan (one sentence).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise TransformError(f"cannot read the tensor-parallel plan {str(p)!r}: {e.strerror or e}") from None
    return parse_tp_plan(text, f"the tensor-parallel plan {str(p)!r}")


def style_pattern(path: str, *, subtree: bool = False) -> re.Pattern:
    """A regex matching the module paths that end in ``path`` (``*`` matches one level), or, with
    ``subtree``, anything under such a path."""
    body = r"\.".join("[^.]+" if t == "*" else re.escape(t) for t in path.split("."))
    return re.compile(r"^(?:.*\.)?" + body + (r"(?:\..*)?$" if subtree else "$"))


class ShardedSublayers:
    """The sublayers of a transformer block a user's plan shards: the parents of its column- and
    row-parallel entries (``h.*.attn`` for ``h.*.attn.c_attn``). A block's op splits ``tp`` ways
    only inside one of them (heads or MLP features split); each holds one row-parallel layer whose
    output is all-reduced."""

    def __init__(self, tp_plan: Mapping[str, str]):
        parents = {k.rsplit(".", 1)[0] for k, v in tp_plan.items() if v != "embedding_rowwise" and "." in k}
        self._patterns = [style_pattern(p, subtree=True) for p in sorted(parents)]
        #: the row-parallel and column-parallel (packed included) projections' patterns
        self.rows = [style_pattern(k) for k, v in tp_plan.items() if v == "rowwise"]
        self.columns = [style_pattern(k) for k, v in tp_plan.items() if v not in ("rowwise", "embedding_rowwise")]

    def covers(self, module_path: str) -> bool:
        """Whether an op of ``module_path`` runs on the rank's shard."""
        return any(p.match(module_path) for p in self._patterns)

    def all_reduces(self, module_paths: list[str]) -> int:
        """How many row-parallel layers (all-reduces of the hidden state) a block of ops with these
        module paths holds."""
        return len({m for m in module_paths if any(r.match(m) for r in self.rows)})


def op_sharding(module_path: str, *, in_block: bool, vocab: bool, blocks: ShardedSublayers) -> str:
    """How an op of ``module_path`` runs on a tensor-parallel stage (one of :data:`SHARDING_KINDS`):
    ``vocab``: in the token embedding or LM head (vocab-parallel); in a transformer block
    (``in_block``), a projection of ``blocks`` (the block plan, built once per plan) is column- or
    row-parallel, another op inside a sublayer the plan shards runs on the rank's heads or features
    (``sharded``); everything else (norms, residual adds, position embeddings) is replicated."""
    if vocab:
        return "vocab-parallel"
    if not in_block:
        return "replicated"
    if any(r.match(module_path) for r in blocks.rows):
        return "row-parallel"
    if any(c.match(module_path) for c in blocks.columns):
        return "column-parallel"
    return "sharded" if blocks.covers(module_path) else "replicated"
