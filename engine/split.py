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
  longer has). Two Hugging Face encoders get it too (:class:`EncoderLayout`): BERT's masked LM
  (``BertForMaskedLM``) and ViT's image classifier (``ViTForImageClassification``), each stage keeping
  its run of encoder layers, the embeddings on the first and the head on the last; tensor
  parallelism shards them with a plan derived Megatron-style (:data:`engine.tp_plan.BERT_TP_PLAN`,
  :data:`engine.tp_plan.VIT_TP_PLAN`). So does T5, the encoder-decoder (:func:`is_hf_t5`): a stage is
  a contiguous run of :func:`t5_layer_order` carrying the encoder output, the decoder state and each
  stack's relative position bias (``runtime.stages.seq2seq_split``; :data:`engine.tp_plan.T5_TP_PLAN`).

Source: torch.distributed.pipelining (``pipeline``, ``SplitPoint``); torchtitan
``torchtitan/distributed/pipeline.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence, get_args

from torch import nn

from engine.models.gpt import GPT
from engine.tp_plan import BERT_TP_PLAN, GPT2_TP_PLAN, T5_TP_PLAN, TESSEL_GPT_TP_PLAN, VIT_TP_PLAN

__all__ = ["DecoderLayout", "EncoderLayout", "EXECUTED_TP_STYLES", "HF_DECODER_LAYOUTS", "HF_ENCODER_LAYOUTS",
           "LLAMA_ROWWISE", "SPLIT_METHODS", "SplitMethod", "choose_split", "effective_tp_plan", "hf_decoder_layout",
           "hf_encoder_layout", "is_hf_gpt2", "is_hf_t5", "record_tp_plan", "sequence_parallel_refusal",
           "supports_layer_split", "t5_layer_order", "tensor_parallel_refusal", "tp_transform_refusal"]

SplitMethod = Literal["tracer", "module", "layers"]
"""How the runtime builds a plan's stages (see the module docstring)."""

SPLIT_METHODS: tuple[str, ...] = get_args(SplitMethod)


def choose_split(module: nn.Module, tp: int = 1, recompute: str = "none", dp_shard: int = 1) -> SplitMethod:
    """``"layers"`` with tensor parallelism (``tp > 1``), activation recomputation (``recompute`` not
    ``"none"``, :mod:`engine.recompute`) or fully sharded data parallelism (``dp_shard > 1``: FSDP2's
    ``fully_shard`` wraps each eager transformer block, ``runtime.fsdp``) for a decoder-only LM or
    Hugging Face encoder (BERT masked LM, ViT classifier) the layer split supports (the runtime refuses
    the plan otherwise, naming the model), and always for the in-project two-tower model (its eager
    stages carry both towers' inputs along a pipeline, which the traced split cannot); else
    ``"module"`` for an ``nn.Sequential`` model (its layers run in order, so a stage is a slice of them), ``"tracer"``
    for every other model. T5 (:func:`is_hf_t5`) takes the layer split for tensor parallelism and
    recomputation, not for FSDP alone (its eager stages are not run under ``fully_shard``)."""
    fallback: SplitMethod = "module" if isinstance(module, nn.Sequential) else "tracer"
    if _is_two_tower(module):
        return "layers"
    if tp > 1:   # a family tensor parallelism cannot shard keeps its split, which the runtime refuses for tp > 1
        return "layers" if supports_layer_split(module) else fallback
    if int(dp_shard) > 1 and is_hf_t5(module):   # FSDP2 is not run on T5's eager stages: refused on the traced split
        return fallback
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


@dataclass(frozen=True)
class EncoderLayout:
    """Where a Hugging Face encoder the layer split cuts keeps its parts (paths in the whole model):
    ``{base}.embeddings`` (first stage), ``{base}.{blocks}.{i}`` (an ``nn.ModuleList`` of encoder
    layers, each called as ``layer(hidden [B, T, H], None) -> hidden``), the ``head`` modules (last
    stage), the vocab-parallel ``token_embedding`` and ``vocab_head`` (``None``: no vocabulary)."""

    family: str
    """``"hf-bert"`` or ``"hf-vit"`` (``runtime.stages.encoder_split``)."""
    base: str
    """Attribute of the base model (``"bert"``, ``"vit"``); the derived plan's paths are relative to it."""
    blocks: str
    """The encoder layers' ``nn.ModuleList`` under the base model (``"encoder.layer"``; ViT: ``"layers"``)."""
    head: tuple[str, ...]
    """The last stage's modules: BERT's ``("cls",)``; ViT's ``("vit.layernorm", "classifier")``."""
    token_embedding: str | None
    """The token embedding, sharded over the vocabulary (BERT's ``bert.embeddings.word_embeddings``); ``None``."""
    vocab_head: str | None
    """The LM head's ``nn.Linear``, column-parallel over the vocabulary (``cls.predictions.decoder``); ``None``."""
    tp_plan: tuple[tuple[str, str], ...]
    """The derived block plan (:data:`engine.tp_plan.BERT_TP_PLAN` / :data:`engine.tp_plan.VIT_TP_PLAN`)."""


#: The encoders the layer split knows: BERT's masked LM (``BertForMaskedLM``: ``bert.embeddings``,
#: ``bert.encoder.layer``, ``cls``) and ViT's classifier (``ViTForImageClassification``, transformers 5:
#: ``vit.embeddings``, ``vit.layers``, ``vit.layernorm``, ``classifier`` on the CLS token).
HF_ENCODER_LAYOUTS = (
    EncoderLayout("hf-bert", "bert", "encoder.layer", ("cls",), "bert.embeddings.word_embeddings",
                  "cls.predictions.decoder", tuple(BERT_TP_PLAN.items())),
    EncoderLayout("hf-vit", "vit", "layers", ("vit.layernorm", "classifier"), None, None, tuple(VIT_TP_PLAN.items())),
)


def hf_encoder_layout(module: nn.Module) -> EncoderLayout | None:
    """The :class:`EncoderLayout` of a Hugging Face BERT masked LM (bidirectional: ``config.is_decoder``
    false) or ViT image classifier (an ``nn.Linear`` ``classifier``), or ``None``."""
    base = getattr(module, "bert", None)
    if isinstance(base, nn.Module):
        emb = getattr(base, "embeddings", None)
        dec = getattr(getattr(getattr(module, "cls", None), "predictions", None), "decoder", None)
        if (isinstance(getattr(emb, "word_embeddings", None), nn.Embedding)
                and isinstance(getattr(getattr(base, "encoder", None), "layer", None), nn.ModuleList)
                and isinstance(dec, nn.Linear) and not getattr(getattr(base, "config", None), "is_decoder", False)):
            return HF_ENCODER_LAYOUTS[0]
    base = getattr(module, "vit", None)
    if (isinstance(base, nn.Module) and isinstance(getattr(module, "classifier", None), nn.Linear)
            and isinstance(getattr(base, "layers", None), nn.ModuleList)
            and hasattr(getattr(base, "embeddings", None), "patch_embeddings")
            and isinstance(getattr(base, "layernorm", None), nn.Module)):
        return HF_ENCODER_LAYOUTS[1]
    return None


def supports_layer_split(module: nn.Module) -> bool:
    """Whether the ``"layers"`` split can cut ``module``: the in-project GPT, the in-project two-tower
    model, a Hugging Face GPT-2 LM (:func:`is_hf_gpt2`), a Hugging Face causal LM laid out as
    one of :data:`HF_DECODER_LAYOUTS` (:func:`hf_decoder_layout`), a BERT masked LM or ViT
    classifier (:func:`hf_encoder_layout`), or a T5 encoder-decoder (:func:`is_hf_t5`)."""
    if isinstance(module, GPT) or _is_two_tower(module) or is_hf_gpt2(module) or is_hf_t5(module):
        return True
    return hf_decoder_layout(module) is not None or hf_encoder_layout(module) is not None


#: The styles of transformers' tensor-parallel plans (``config.base_model_tp_plan``) the runtime executes
#: (``runtime.tensor_parallel``): column- and row-parallel linear layers, the vocab-parallel embedding, and
#: MoE experts (``moe_tp_experts``, ``runtime.moe_tensor_parallel``) whose 3-D weights are ``packed_colwise``,
#: ``colwise`` or ``rowwise``.
EXECUTED_TP_STYLES = ("colwise", "rowwise", "embedding_rowwise", "moe_tp_experts", "packed_colwise")


def tensor_parallel_refusal(module: nn.Module, name: str, tp_plan: dict[str, str] | None = None) -> str | None:
    """The sentence refusing tensor parallelism (``tp > 1``, or Tessel's all-device blocks) on a
    Hugging Face decoder ``module`` (called ``name``) whose published plan the runtime cannot execute,
    checked from the model alone, before any rank starts: no ``config.base_model_tp_plan``, or an
    entry in a style outside :data:`EXECUTED_TP_STYLES` (GLM-4's ``colwise_gather_output``), or
    ``packed_colwise`` on a layer that is not an MoE expert weight. ``None`` for every other model: GPT-2 and the
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
    experts = [k for k, v in eff[1].items() if v == "moe_tp_experts"]
    for key, style in eff[1].items():
        in_experts = any(key.startswith(e + ".") for e in experts)
        if style not in EXECUTED_TP_STYLES or (style == "packed_colwise" and not in_experts):
            where = "" if style not in EXECUTED_TP_STYLES else " outside MoE experts"
            return (f"model {name!r} shards {key!r} as {style!r} in its tensor-parallel plan "
                    f"(config.base_model_tp_plan), which the runtime does not execute{where}; plan it with --tp 1 "
                    "and no all-device blocks")
    return None


#: The row-parallel layers of a Hugging Face decoder laid out as Llama's, relative to the base model: the two
#: whose all-reduces CoCoNet's ``tp-split`` turns into reduce-scatters feeding the residual adds.
LLAMA_ROWWISE = ("layers.*.self_attn.o_proj", "layers.*.mlp.down_proj")


def sequence_parallel_refusal(module: nn.Module, name: str, tp_plan: dict[str, str] | None = None) -> str | None:
    """The sentence refusing CoCoNet's ``tp-split`` (sequence parallelism, ``runtime.tensor_parallel``)
    on a Hugging Face decoder ``module`` (called ``name``) whose layers are not laid out as Llama's:
    row-parallel exactly :data:`LLAMA_ROWWISE` in its block plan (:func:`effective_tp_plan`, ``tp_plan``:
    the user's) and ``input_layernorm`` / ``post_attention_layernorm`` norms (GPT-NeoX's parallel
    residual has neither); ``None`` for a model where it runs (and for models that are not Hugging Face
    decoders: the in-project GPT runs it, GPT-2 is refused where its transformations are checked)."""
    lay = hf_decoder_layout(module)
    if lay is None:
        return None
    eff = effective_tp_plan(module, tp_plan)
    rows = sorted(k for k, v in (eff[1] if eff else {}).items() if v == "rowwise")
    layers = getattr(module, lay.base).layers
    norms = all(hasattr(layers[0], n) for n in ("input_layernorm", "post_attention_layernorm")) if len(layers) else True
    if rows == sorted(LLAMA_ROWWISE) and norms:
        return None
    return (f"'tp-split' needs decoder layers laid out as Llama's (row-parallel {' and '.join(LLAMA_ROWWISE)} feeding "
            f"the residual adds after input_layernorm and post_attention_layernorm); {name!r} "
            f"({type(module).__name__}) has row-parallel {rows}"
            + ("" if norms else " and other norms") + ", so plan it without tp-split")


def tp_transform_refusal(module: nn.Module, name: str, transforms: Sequence[str], *, tp: int,
                         tp_plan: dict[str, str] | None = None, moe: bool = False) -> str | None:
    """The sentence refusing a CoCoNet transformation (``transforms``, parsed names) that the runtime
    does not execute on the tensor-parallel stages (``tp > 1``) of ``module`` (called ``name``), or
    ``None``: ``tp-split`` and ``chunked-overlap`` rewrite row-parallel ``nn.Linear`` layers of decoder
    blocks, so not GPT-2's ``Conv1D``, MoE experts' 3-D weights (``moe``), BERT's, ViT's or T5's layers;
    ``scatter-send`` cuts each boundary tensor over the tensor ranks, so not T5's (ids and position
    biases cross) nor a ViT whose patches + 1 tokens ``tp`` does not divide; ``tp-split`` also needs
    decoder layers laid out as Llama's (:func:`sequence_parallel_refusal`, with the user's ``tp_plan``).
    Checked from the model alone, by ``tessel plan`` / ``tessel search`` and again by ``tessel launch``."""
    tf = set(transforms)
    if tp <= 1 or not tf:
        return None
    encoder = hf_encoder_layout(module)
    t5 = is_hf_t5(module)
    for t in ("tp-split", "chunked-overlap"):
        if t not in tf:
            continue
        if is_hf_gpt2(module) or moe:
            what = ("is a GPT-2, whose projections are transformers' Conv1D" if is_hf_gpt2(module)
                    else "has MoE experts, whose 3-D weights")
            return (f"transformation {t!r} rewrites row-parallel nn.Linear layers, but {name!r} {what}, which "
                    f"tensor parallelism shards without it; plan it without {t!r}")
        if encoder is not None or t5:
            kind = "T5 encoder-decoder" if encoder is None else "BERT encoder" if encoder.family == "hf-bert" \
                else "ViT encoder"
            return (f"transformation {t!r} rewrites the row-parallel layers of decoder blocks, but {name!r} is a "
                    f"{kind}, whose layers tensor parallelism shards without it; plan it without {t!r}")
    if "scatter-send" in tf and t5:
        return (f"transformation 'scatter-send' slices each boundary tensor over the tensor ranks, but {name!r} is a "
                "T5 whose boundaries also carry token ids and position biases; plan it without 'scatter-send'")
    if "scatter-send" in tf and encoder is not None and encoder.family == "hf-vit":
        patches: Any = module.get_submodule(f"{encoder.base}.embeddings.patch_embeddings")
        tokens = int(patches.num_patches) + 1   # the boundary's sequence: the patches and the CLS token
        if tokens % tp:
            return (f"transformation 'scatter-send' cuts each boundary's {tokens} tokens (the image's patches and "
                    f"its CLS token) into tp={tp} equal shards, which {tp} does not divide; plan it without "
                    "'scatter-send'")
    return sequence_parallel_refusal(module, name, tp_plan) if "tp-split" in tf else None


def effective_tp_plan(module: nn.Module, user: dict[str, str] | None = None) -> tuple[str, dict[str, str]] | None:
    """``(source, block plan)`` tensor parallelism shards ``module``'s transformer blocks with
    (patterns relative to the base model, transformers' ``base_model_tp_plan`` format): ``"user"``
    (``user``, ``tessel plan --tp-plan``), ``"published"`` (a Hugging Face decoder's
    ``config.base_model_tp_plan``, its embedding entry left out: the embedding is always
    vocab-parallel) or ``"derived"`` (GPT-2's, BERT's, ViT's, T5's and the in-project GPT's,
    :mod:`engine.tp_plan`; T5's paths are from the model root);
    ``None`` for a model without one."""
    if user is not None:
        return "user", dict(user)
    if is_hf_gpt2(module):
        return "derived", dict(GPT2_TP_PLAN)
    if isinstance(module, GPT):
        return "derived", dict(TESSEL_GPT_TP_PLAN)
    enc = hf_encoder_layout(module)
    if enc is not None:
        return "derived", dict(enc.tp_plan)
    if is_hf_t5(module):
        return "derived", dict(T5_TP_PLAN)
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


def is_hf_t5(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face T5 encoder-decoder LM (``T5ForConditionalGeneration``: an
    ``nn.Embedding`` ``shared``, ``encoder`` and ``decoder`` stacks each with ``embed_tokens``, a
    ``block`` ``nn.ModuleList`` and ``final_layer_norm``, the decoder's config ``is_decoder``, an
    ``nn.Linear`` ``lm_head``)."""
    stacks = [getattr(module, s, None) for s in ("encoder", "decoder")]
    return (isinstance(getattr(module, "lm_head", None), nn.Linear)
            and isinstance(getattr(module, "shared", None), nn.Embedding)
            and all(isinstance(getattr(s, "block", None), nn.ModuleList)
                    and isinstance(getattr(s, "embed_tokens", None), nn.Embedding)
                    and hasattr(s, "final_layer_norm") for s in stacks)
            and bool(getattr(getattr(stacks[1], "config", None), "is_decoder", False)))


def t5_layer_order(module: nn.Module) -> list[str]:
    """The layers of a T5 (:func:`is_hf_t5`) in forward order, as the layer split cuts them:
    ``encoder.embed_tokens``, ``encoder.block.{i}``, ``encoder.final_layer_norm``, ``decoder.embed_tokens``,
    ``decoder.block.{j}``, ``decoder.final_layer_norm``, ``lm_head``."""
    m: Any = module
    return (["encoder.embed_tokens"] + [f"encoder.block.{i}" for i in range(len(m.encoder.block))]
            + ["encoder.final_layer_norm", "decoder.embed_tokens"]
            + [f"decoder.block.{i}" for i in range(len(m.decoder.block))] + ["decoder.final_layer_norm", "lm_head"])


def _is_two_tower(module: nn.Module) -> bool:
    """The in-project two-tower model (``engine.models.two_tower``): ``text`` and ``code`` towers of
    blocks (``h``) and a ``head`` joining them."""
    return all(isinstance(getattr(getattr(module, t, None), "h", None), nn.ModuleList) for t in ("text", "code")) \
        and isinstance(getattr(module, "head", None), nn.Module)
