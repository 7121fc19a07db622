"""Hugging Face ``transformers`` models built from configs (no downloads, no weights).

``transformers`` is imported lazily inside functions, so ``import engine.models`` stays cheap.

Wrapping choice (transparent): an HF causal-LM class ``C`` is subclassed as ``CLogitsOnly``
whose ``forward(input_ids)`` calls ``C.forward(input_ids=..., use_cache=False)`` and returns
only ``.logits`` (``[batch, seq, vocab]``). Nothing is added to the module tree, so module paths
and ``state_dict`` keys are exactly HF's (``transformer.h.3.attn.c_attn``,
``model.layers.3.self_attn.q_proj``) and HF checkpoints load with ``load_state_dict``. The
subclasses are reachable as attributes of this module (``engine.models.hf.GPT2LMHeadModelLogitsOnly``)
so they pickle by reference.

Models use ``attn_implementation="sdpa"`` and ``use_cache=False``. Note that ``torch.export``
makes HF materialise the causal mask (``transformers.masking_utils._ignore_causal_mask_sdpa``
returns False while exporting), so captured HF graphs carry a bool mask ``[batch, 1, seq, seq]``
from the first block to the others; in eager mode HF uses ``is_causal=True`` instead.
"""
from __future__ import annotations

import inspect
import json
import sys
from typing import Any

import torch
from torch import nn

__all__ = ["HF_SPECS", "hf_config", "build_hf", "logits_only_class"]

# name -> (transformers class, config class, config kwargs, default seq_len, description)
HF_SPECS: dict[str, tuple[str, str, dict[str, Any], int, str]] = {
    "gpt2-tiny": ("GPT2LMHeadModel", "GPT2Config", dict(
        vocab_size=256, n_positions=128, n_embd=64, n_layer=4, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None), 128,
        "HF GPT-2, 4 layers, hidden 64, 4 heads, byte vocab 256, 128 positions (~0.2M params; "
        "trains on a CPU in seconds)"),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {}, 1024,
             "HF GPT-2 small, 12 layers, hidden 768, 12 heads, vocab 50257 (124M params)"),
    "gpt2-xl": ("GPT2LMHeadModel", "GPT2Config", dict(n_embd=1600, n_layer=48, n_head=25), 1024,
                "HF GPT-2 XL, 48 layers, hidden 1600, 25 heads (1.56B params)"),
    "gpt3-175b": ("GPT2LMHeadModel", "GPT2Config", dict(
        vocab_size=50257, n_positions=2048, n_embd=12288, n_layer=96, n_head=96), 2048,
        "GPT-3 175B shape on the HF GPT-2 architecture: 96 layers, hidden 12288, 96 heads, "
        "seq 2048 (meta device only)"),
    "llama-tiny": ("LlamaForCausalLM", "LlamaConfig", dict(
        vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None), 128,
        "HF Llama, 4 layers, hidden 64, 4 heads / 2 KV heads (GQA), byte vocab 256"),
    "gpt-neox-tiny": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(
        vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None), 128,
        "HF GPT-NeoX (Pythia's architecture), 4 layers, hidden 64, 4 heads, partial rotary, parallel "
        "residual, fused query/key/value, byte vocab 256"),
    "mixtral-tiny": ("MixtralForCausalLM", "MixtralConfig", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None), 128,
        "HF Mixtral, 4 layers, hidden 64, 4 heads / 2 KV heads, 4 experts top-2 (sparse MoE in every "
        "layer), byte vocab 256"),
    "qwen2-moe-tiny": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None), 128,
        "HF Qwen2-MoE, 4 layers, hidden 64, 4 heads / 2 KV heads, 4 experts top-2 plus a gated shared expert in "
        "every layer, byte vocab 256"),
    "bert-tiny": ("BertForMaskedLM", "BertConfig", dict(
        vocab_size=260, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0), 128,
        "HF BERT masked LM, 4 layers, hidden 64, 4 heads, vocab 260 (bytes + [MASK] = 259), task masked-lm"),
    "t5-tiny": ("T5ForConditionalGeneration", "T5Config", dict(
        vocab_size=300, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=None), 128,
        "HF T5 encoder-decoder, 2+2 layers, d_model 64, 4 heads, vocab 300 (bytes + sentinels from 299 "
        "down), task seq2seq (span corruption)"),
    "llama-32k-cpu": ("LlamaForCausalLM", "LlamaConfig", dict(
        vocab_size=32000, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None), 128,
        "HF Llama, 4 layers, hidden 128, 4 heads / 2 KV heads, Llama-2's vocabulary size 32000 (8.9M params, "
        "8.2M of them in the embedding and LM head): a large-vocabulary model that trains on a CPU"),
    "llama-250k": ("LlamaForCausalLM", "LlamaConfig", dict(
        vocab_size=250112, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None), 1024,
        "HF Llama with mT5-base's width and vocabulary: 12 layers, hidden 768, 12 heads, SwiGLU 2048, "
        "vocab 250112 (0.47B params, 0.38B of them in the embedding and LM head; Tessel's M placement)"),
    "llama-7b": ("LlamaForCausalLM", "LlamaConfig", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=False), 2048,
        "HF Llama 7B shape: 32 layers, hidden 4096, 32 heads, SwiGLU 11008, vocab 32000 (6.7B)"),
}

_CLASSES: dict[str, type] = {}


def _cache_kw(hf_cls: type) -> dict[str, Any]:
    """``use_cache=False`` where the HF forward takes it (decoders), nothing elsewhere (BERT)."""
    cls_any: Any = hf_cls
    forward = cls_any.forward
    params = inspect.signature(forward).parameters
    return {"use_cache": False} if "use_cache" in params else {}


class _LogitsOnly:
    """Mixin: ``forward(input_ids [B, T] int64) -> logits [B, T, vocab]`` (causal and masked LMs)."""

    _tessel_forward_kw: dict[str, Any] = {}   # set per class by logits_only_class

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # noqa: D401
        parent: Any = super()  # the HF class this mixin is combined with (logits_only_class)
        return parent.forward(input_ids=input_ids, **self._tessel_forward_kw).logits


class _Seq2SeqLogitsOnly:
    """Mixin: ``forward(input_ids [B, T] int64, decoder_input_ids [B, T'] int64) -> logits
    [B, T', vocab]`` (encoder-decoder models such as T5)."""

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:  # noqa: D401
        parent: Any = super()
        return parent.forward(input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=False).logits


class _ImageLogitsOnly:
    """Mixin: ``forward(pixel_values [B, C, H, W] float) -> logits [B, classes]`` (image classifiers)."""

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # noqa: D401
        parent: Any = super()
        return parent.forward(pixel_values=pixel_values).logits


def input_names(hf_cls: type) -> tuple[str, ...]:
    """The positional inputs of the logits-only form of ``hf_cls``: ``("input_ids",)``,
    ``("input_ids", "decoder_input_ids")`` (encoder-decoder) or ``("pixel_values",)``."""
    if getattr(hf_cls, "main_input_name", "input_ids") == "pixel_values":
        return ("pixel_values",)
    cls_any: Any = hf_cls
    forward = cls_any.forward
    if "decoder_input_ids" in inspect.signature(forward).parameters:
        return ("input_ids", "decoder_input_ids")
    return ("input_ids",)


def logits_only_class(hf_cls: type) -> type:
    """The transparent logits-only subclass of an HF model class (cached); its ``forward`` takes
    :func:`input_names` positionally and returns ``.logits``. An already logits-only class is
    returned as is."""
    if hf_cls.__name__.endswith("LogitsOnly"):
        return hf_cls
    name = f"{hf_cls.__name__}LogitsOnly"
    if name not in _CLASSES:
        mixin = {("input_ids",): _LogitsOnly, ("input_ids", "decoder_input_ids"): _Seq2SeqLogitsOnly,
                 ("pixel_values",): _ImageLogitsOnly}[input_names(hf_cls)]
        ns: dict[str, Any] = {"__module__": __name__, "__qualname__": name, "_tessel_forward_kw": _cache_kw(hf_cls)}
        can_set = getattr(hf_cls, "_can_set_experts_implementation", None)
        if callable(can_set):   # transformers reads the class's *module source* for this: ask the HF class
            ns["_can_set_experts_implementation_cached_value"] = bool(can_set())
        _CLASSES[name] = type(name, (mixin, hf_cls), ns)
    return _CLASSES[name]


def is_hf_model(module: Any) -> bool:
    """``module`` is a ``transformers.PreTrainedModel`` (without importing transformers if it is
    not loaded yet)."""
    tr = sys.modules.get("transformers")
    return tr is not None and isinstance(module, tr.PreTrainedModel)


def hf_task(hf_cls: type) -> str:
    """The built-in task an HF model class trains on: ``seq2seq`` (encoder-decoder),
    ``image-classification`` (pixel inputs), ``masked-lm`` (``...ForMaskedLM``), else ``causal-lm``."""
    names = input_names(hf_cls)
    if names == ("pixel_values",):
        return "image-classification"
    if len(names) == 2:
        return "seq2seq"
    base = hf_cls.__name__.removesuffix("LogitsOnly")
    return "masked-lm" if base.endswith("ForMaskedLM") else "causal-lm"


def __getattr__(name: str) -> Any:  # PEP 562: lets pickle find the generated classes
    if name.endswith("LogitsOnly"):
        import transformers
        base = getattr(transformers, name[: -len("LogitsOnly")], None)
        if isinstance(base, type):
            return logits_only_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def hf_config(name: str, **overrides: Any) -> Any:
    """The ``transformers`` config object of built-in HF model ``name`` (``use_cache=False``,
    ``attn_implementation="sdpa"``), with ``overrides`` applied.

    Raises:
        KeyError: ``name`` is not in :data:`HF_SPECS`.
    """
    import transformers
    _, cfg_cls, kwargs, _, _ = HF_SPECS[name]
    kw = {**kwargs, **overrides, "use_cache": False}
    kw.setdefault("attn_implementation", "sdpa")
    return getattr(transformers, cfg_cls)(**kw)


def config_dict(config: Any, arch: str) -> dict[str, Any]:
    """JSON-able dict of an HF config (non-JSON values as strings) plus ``architecture``."""
    d = json.loads(json.dumps(config.to_dict(), default=str))
    return {"architecture": arch, **d}


def build_hf(name: str, *, device: str | torch.device = "meta",
             dtype: torch.dtype = torch.float32, **overrides: Any) -> tuple[nn.Module, dict]:
    """Build built-in HF model ``name`` from its config on ``device`` (``meta``: no weights).

    Returns:
        (module, config dict). The module's ``forward(input_ids [B, T] int64)`` returns logits
        ``[B, T, vocab]``; it is in training mode (dropout active), like a fresh HF model.
    """
    import transformers
    arch = HF_SPECS[name][0]
    cfg = hf_config(name, **overrides)
    cls = logits_only_class(getattr(transformers, arch))
    with torch.device(device):
        module = cls(cfg)
    module.to(dtype=dtype)
    module.train()
    return module, config_dict(cfg, arch)


def vocab_size(config: dict) -> int:
    """Vocabulary size from an HF config dict."""
    size: Any = config.get("vocab_size")
    return int(size)


def max_positions(config: dict) -> int | None:
    """Context length limit from an HF config dict (``n_positions`` / ``max_position_embeddings``)."""
    for k in ("n_positions", "max_position_embeddings"):
        if config.get(k):
            return int(config[k])
    return None
