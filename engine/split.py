"""Which stage-construction method the runtime uses for a model (recorded as ``plan.model.split``).

Three methods cut a model into pipeline stages (``runtime.stages.build_stages``):

- ``"tracer"``: ``torch.distributed.pipelining.pipeline`` traces the whole model with
  ``torch.export`` and splits the graph between the plan's segments. It handles any forward that
  exports (Hugging Face transformers, the zoo, most user modules), including values that skip
  stages (attention masks, rotary tables, T5's position bias).
- ``"module"``: torchtitan's manual split (``torchtitan/distributed/pipeline.py``,
  ``pipeline_module_split``): each stage is a copy of the model that keeps only its own layers and
  runs them eagerly. It needs a model whose forward is the composition of its layers in order,
  which an ``nn.Sequential`` is by definition (a CNN, an MLP); nothing is traced, so dropout,
  batch norm and any Python in the layers behave exactly as in the unsplit model.
- ``"layers"``: torchtitan's manual split of a decoder-only LM (Hugging Face Llama-family,
  GPT-NeoX and GPT-2 models, the in-project GPT): each stage is a copy of the model keeping its embedding
  (first stage), its run of decoder blocks, and its final norm and LM head (last stage), run
  eagerly. Tensor parallelism needs it (``parallelize_module`` shards the blocks' ``nn.Linear``
  projections, and GPT-2's ``Conv1D`` ones, which tracing would flatten into graph ops); plans
  with ``tp > 1`` use it where the family can be sharded, and so do plans with activation
  recomputation (``torch.utils.checkpoint`` wraps each decoder block, which an exported graph no
  longer has).

Source: torch.distributed.pipelining (``pipeline``, ``SplitPoint``); torchtitan
``torchtitan/distributed/pipeline.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from torch import nn

from engine.models.gpt import GPT
from engine.tp_plan import GPT2_TP_PLAN, TESSEL_GPT_TP_PLAN

__all__ = ["DecoderLayout", "EXECUTED_TP_STYLES", "HF_DECODER_LAYOUTS", "SplitMethod", "SPLIT_METHODS",
           "choose_split", "hf_decoder_layout", "is_hf_gpt2", "supports_layer_split",
           "effective_tp_plan", "record_tp_plan", "tensor_parallel_refusal"]

SplitMethod = Literal["tracer", "module", "layers"]
"""How the runtime builds a plan's stages (see the module docstring)."""

SPLIT_METHODS: tuple[str, ...] = get_args(SplitMethod)


def choose_split(module: nn.Module, tp: int = 1, recompute: str = "none", dp_shard: int = 1) -> SplitMethod:
    """``"layers"`` with tensor parallelism (``tp > 1``), activation recomputation (``recompute`` not
    ``"none"``, :mod:`engine.recompute`) or fully sharded data parallelism (``dp_shard > 1``: FSDP2's
    ``fully_shard`` wraps each eager transformer block, ``runtime.fsdp``) for a decoder-only LM the
    layer split supports (the runtime refuses the plan otherwise, naming the model), and always for the
    in-project two-tower model (its eager stages carry both towers' inputs along a pipeline, which
    the traced split cannot); else ``"module"`` for an
    ``nn.Sequential`` model (its layers run in order, so a stage is a slice of them), ``"tracer"``
    for every other model."""
    fallback: SplitMethod = "module" if isinstance(module, nn.Sequential) else "tracer"
    if _is_two_tower(module):
        return "layers"
    if tp > 1:   # a family tensor parallelism cannot shard keeps its split, which the runtime refuses for tp > 1
        return "layers" if supports_layer_split(module) else fallback
    needs_blocks = recompute != "none" or int(dp_shard) > 1
    return "layers" if needs_blocks and supports_layer_split(module) else fallback


@dataclass(frozen=True)
class DecoderLayout:
    """Where a Hugging Face decoder-only causal LM keeps its parts: ``{base}.{embed}`` (an
    ``nn.Embedding``), ``{base}.layers`` (an ``nn.ModuleList`` of decoder layers), ``{base}.{norm}``,
    ``{base}.rotary_emb`` and the ``nn.Linear`` ``{head}``; the base model's ``forward`` takes
    ``input_ids`` or ``inputs_embeds``."""

    base: str
    """Attribute of the base model (``"model"``; GPT-NeoX: ``"gpt_neox"``)."""
    embed: str
    """Attribute of the token embedding in the base model (``"embed_tokens"``; GPT-NeoX: ``"embed_in"``)."""
    norm: str
    """Attribute of the final norm in the base model (``"norm"``; GPT-NeoX: ``"final_layer_norm"``)."""
    head: str = "lm_head"
    """Attribute of the LM head in the causal LM."""


#: The layouts the layer split knows: Llama's (Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE, ...) and GPT-NeoX's.
HF_DECODER_LAYOUTS = (DecoderLayout("model", "embed_tokens", "norm"),
                      DecoderLayout("gpt_neox", "embed_in", "final_layer_norm"))


def hf_decoder_layout(module: nn.Module) -> DecoderLayout | None:
    """The :class:`DecoderLayout` of a Hugging Face decoder-only causal LM, or ``None``."""
    for lay in HF_DECODER_LAYOUTS:
        inner = getattr(module, lay.base, None)
        if (isinstance(getattr(module, lay.head, None), nn.Linear) and isinstance(inner, nn.Module)
                and isinstance(getattr(inner, "layers", None), nn.ModuleList)
                and isinstance(getattr(inner, lay.embed, None), nn.Embedding)
                and hasattr(inner, lay.norm) and hasattr(inner, "rotary_emb")):
            return lay
    return None


def supports_layer_split(module: nn.Module) -> bool:
    """Whether the ``"layers"`` split can cut ``module``: the in-project GPT, the in-project two-tower
    model, a Hugging Face GPT-2 LM (:func:`is_hf_gpt2`), or a Hugging Face causal LM laid out as
    one of :data:`HF_DECODER_LAYOUTS` (:func:`hf_decoder_layout`)."""
    if isinstance(module, GPT) or _is_two_tower(module) or is_hf_gpt2(module):
        return True
    return hf_decoder_layout(module) is not None


#: The styles of transformers' tensor-parallel plans (``config.base_model_tp_plan``) the runtime executes
#: (``runtime.tensor_parallel``): column- and row-parallel linear layers, the vocab-parallel embedding.
EXECUTED_TP_STYLES = ("colwise", "rowwise", "embedding_rowwise")


def tensor_parallel_refusal(module: nn.Module, name: str, tp_plan: dict[str, str] | None = None) -> str | None:
    """The sentence refusing tensor parallelism (``tp > 1``, or Tessel's all-device blocks) on a
    Hugging Face decoder ``module`` (called ``name``) whose published plan the runtime cannot execute,
    checked from the model alone, before any rank starts: no ``config.base_model_tp_plan``, or an
    entry in a style outside :data:`EXECUTED_TP_STYLES` (Mixtral's and Qwen2-MoE's packed
    ``gate_up_proj`` experts, ``moe_tp_experts``). ``None`` for every other model: GPT-2 and the
    in-project GPT get the runtime's own plans, and models without the layer split are refused where
    the split is checked. ``tp_plan``: the user's plan (:mod:`engine.tp_plan`), which replaces the
    model's own for every model: accepted as checked by :func:`engine.tp_plan.check_tp_plan`."""
    if tp_plan is not None or hf_decoder_layout(module) is None:
        return None
    eff = effective_tp_plan(module)
    if eff is None:
        return (f"model {name!r} ({type(module).__name__}) publishes no tensor-parallel plan "
                "(config.base_model_tp_plan), so its layers cannot be sharded; plan it with --tp 1 and no "
                "all-device blocks")
    for key, style in eff[1].items():
        if style not in EXECUTED_TP_STYLES:
            hint = " (its experts can be expert-parallel over --dp instead)" if "experts" in key else ""
            return (f"model {name!r} shards {key!r} as {style!r} in its tensor-parallel plan "
                    f"(config.base_model_tp_plan), which the runtime does not execute; plan it with --tp 1 and no "
                    f"all-device blocks{hint}")
    return None


def effective_tp_plan(module: nn.Module, user: dict[str, str] | None = None) -> tuple[str, dict[str, str]] | None:
    """``(source, block plan)`` tensor parallelism shards ``module``'s transformer blocks with
    (patterns relative to the base model, transformers' ``base_model_tp_plan`` format): ``"user"``
    (``user``, ``tessel plan --tp-plan``), ``"published"`` (a Hugging Face decoder's
    ``config.base_model_tp_plan``, its embedding entry left out: the embedding is always
    vocab-parallel) or ``"derived"`` (GPT-2's and the in-project GPT's, :mod:`engine.tp_plan`);
    ``None`` for a model without one."""
    if user is not None:
        return "user", dict(user)
    if is_hf_gpt2(module):
        return "derived", dict(GPT2_TP_PLAN)
    if isinstance(module, GPT):
        return "derived", dict(TESSEL_GPT_TP_PLAN)
    lay = hf_decoder_layout(module)
    if lay is None:
        return None
    plan = getattr(getattr(getattr(module, lay.base), "config", None), "base_model_tp_plan", None)
    return ("published", {k: v for k, v in plan.items() if k != lay.embed}) if plan else None


def record_tp_plan(meta: dict, module: nn.Module, user: dict[str, str] | None, *, sharded: bool) -> None:
    """Record in a plan's ``meta["tp_plan"]`` the plan its transformer blocks are sharded with
    (``{"source": "user" | "published" | "derived", "blocks": {pattern: style}}``,
    :func:`effective_tp_plan`) when the plan shards them (``sharded``): what the model
    graph view colours by and the user can copy into ``--tp-plan``."""
    eff = effective_tp_plan(module, user) if sharded else None
    if eff is not None:
        meta["tp_plan"] = {"source": eff[0], "blocks": eff[1]}


def is_hf_gpt2(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face GPT-2 LM (``GPT2LMHeadModel``): ``transformer.wte`` and
    ``transformer.wpe`` (``nn.Embedding``), ``transformer.h`` (an ``nn.ModuleList`` of blocks),
    ``transformer.ln_f`` and an ``nn.Linear`` ``lm_head``; the in-project GPT has the same names
    but is not one."""
    tr = getattr(module, "transformer", None)
    return (not isinstance(module, GPT) and isinstance(getattr(module, "lm_head", None), nn.Linear)
            and isinstance(tr, nn.Module) and isinstance(getattr(tr, "h", None), nn.ModuleList)
            and all(isinstance(getattr(tr, e, None), nn.Embedding) for e in ("wte", "wpe"))
            and hasattr(tr, "ln_f"))


def _is_two_tower(module: nn.Module) -> bool:
    """The in-project two-tower model (``engine.models.two_tower``): ``text`` and ``code`` towers of
    blocks (``h``) and a ``head`` joining them."""
    return all(isinstance(getattr(getattr(module, t, None), "h", None), nn.ModuleList) for t in ("text", "code")) \
        and isinstance(getattr(module, "head", None), nn.Module)
