"""Real architectures without code: a Hugging Face ``config.json`` planned on the meta device.

``tessel plan --model-config PATH`` (and ``tessel search --model-config PATH``) take the
``config.json`` of a published model (or the folder holding one, as the Hub lays it out), e.g.
``configs/hf/llama-3-8b/config.json``. The file is read here as JSON and handed to
``transformers.AutoConfig.for_model(**d)`` (no download, no remote code: only the ``model_type``
chooses the config class), and the model is built with the auto class its ``architectures`` entry
names (``...ForCausalLM`` -> ``AutoModelForCausalLM``, ``...ForMaskedLM``, ``...ForConditionalGeneration``
-> ``AutoModelForSeq2SeqLM``, ``...ForImageClassification``; ``AutoModelForCausalLM`` when the
file names none) inside ``torch.device("meta")``: shapes only, no weight is allocated, so
Llama-3-70B builds in a few seconds on a laptop. The module is then made logits-only like the
registry's HF models (:func:`engine.models.hf.logits_only_class`; module paths and ``state_dict``
keys stay Hugging Face's), with ``use_cache=False`` and ``attn_implementation="sdpa"``.

A config path is a model *name*: :func:`engine.models.registry.model_spec` resolves a name that
ends in ``.json`` or is an existing folder to :func:`config_spec_fields`, so
``engine.models.build_model(path)``, ``make_plan(path)``, the runtime's stage builder and
``task_for_plan`` treat it like ``gpt2``. The plan records the path as ``plan.model.name`` and
the whole configuration (``architecture``, ``config_path`` and every field of the file as
``transformers`` completes it) as ``plan.model.config``; ``tessel show`` re-simulates the plan
from the file alone.

Errors (one sentence each, :class:`engine.errors.ModelConfigError`, exit status 2): the path does
not exist, a folder without ``config.json``, a file that is not a JSON object, no ``model_type``,
a ``model_type`` or architecture the installed ``transformers`` does not know, or field values
``transformers`` refuses.

Source: transformers ``AutoConfig.for_model``, ``AutoModelForCausalLM.from_config``
(``models/auto/``); the configs in ``configs/hf/`` are the public ``config.json`` files of
meta-llama/Meta-Llama-3-8B, meta-llama/Meta-Llama-3-70B and mistralai/Mixtral-8x7B-v0.1.
"""
from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.errors import ModelConfigError

from . import hf as _hf

__all__ = ["ModelConfigFile", "build_from_config", "config_default_seq_len", "config_task", "hf_config_object",
           "is_config_name", "load_model_config", "model_choice"]

log = logging.getLogger(__name__)

#: The file a model folder holds (the Hugging Face Hub's layout).
CONFIG_FILE = "config.json"

#: Architecture class suffix -> the transformers auto class that builds it (first match wins).
AUTO_CLASSES: tuple[tuple[str, str], ...] = (
    ("ForCausalLM", "AutoModelForCausalLM"),
    ("ForMaskedLM", "AutoModelForMaskedLM"),
    ("ForConditionalGeneration", "AutoModelForSeq2SeqLM"),
    ("ForImageClassification", "AutoModelForImageClassification"),
)

#: Sequence length of a config that names no position table (``max_position_embeddings``,
#: ``n_positions``), e.g. a model with rotary embeddings and no recorded context.
FALLBACK_SEQ_LEN = 2048


@dataclass(frozen=True)
class ModelConfigFile:
    """A read ``config.json``.

    Attributes:
        path: the ``config.json`` file (absolute).
        fields: its JSON object, as written.
        model_type: ``fields["model_type"]`` (``"llama"``, ``"mixtral"``, ``"gpt2"``...).
        auto_class: the transformers auto class that builds it (:data:`AUTO_CLASSES`).
    """

    path: Path
    fields: dict[str, Any]
    model_type: str
    auto_class: str


def is_config_name(name: str) -> bool:
    """Whether a model name is a config path: it ends with ``.json`` or is an existing folder
    (a registered name is looked up first by :func:`engine.models.registry.model_spec`)."""
    return name.endswith(".json") or Path(name).is_dir()


def _config_file(name: str) -> Path:
    """The ``config.json`` a name points at (the file, or the one inside a folder).

    Raises:
        ModelConfigError: nothing at the path, or a folder without ``config.json``.
    """
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / CONFIG_FILE).is_file():
            raise ModelConfigError(f"model config folder {name} holds no {CONFIG_FILE}; give the folder of a "
                                   f"Hugging Face model or the path of its {CONFIG_FILE}")
        p = p / CONFIG_FILE
    elif not p.is_file():
        raise ModelConfigError(f"model config {name} does not exist; give a Hugging Face {CONFIG_FILE} or a "
                               f"folder holding one (e.g. configs/hf/llama-3-8b)")
    return p.resolve()


def _auto_class(fields: dict[str, Any]) -> str:
    """The auto class of a config's first ``architectures`` entry (:data:`AUTO_CLASSES`;
    ``AutoModelForCausalLM`` when it names none or another kind)."""
    archs = fields.get("architectures") or []
    arch = str(archs[0]) if isinstance(archs, list) and archs else ""
    return next((auto for suffix, auto in AUTO_CLASSES if arch.endswith(suffix)), "AutoModelForCausalLM")


def load_model_config(name: str) -> ModelConfigFile:
    """Read and check a ``config.json`` (or the one in folder ``name``) without building anything.

    Raises:
        ModelConfigError: the path does not exist, a folder holds no ``config.json``, the file is
            not UTF-8 JSON holding an object, it has no string ``model_type``, or the installed
            transformers does not know that ``model_type``.
    """
    path = _config_file(name)
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"model config {name} is not valid JSON ({e.msg} at line {e.lineno} column "
                               f"{e.colno}); give a Hugging Face {CONFIG_FILE}") from None
    except UnicodeDecodeError:
        raise ModelConfigError(f"model config {name} is not UTF-8 text; give a Hugging Face {CONFIG_FILE}") from None
    if not isinstance(fields, dict):
        raise ModelConfigError(f"model config {name} holds a JSON {type(fields).__name__}, not an object; a "
                               f"Hugging Face {CONFIG_FILE} is an object of fields")
    model_type = fields.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelConfigError(f"model config {name} has no \"model_type\" field, which names the architecture "
                               f"family (e.g. \"llama\", \"mixtral\", \"gpt2\"); add it")
    _check_model_type(model_type, name)
    return ModelConfigFile(path, fields, model_type, _auto_class(fields))


def _check_model_type(model_type: str, name: str) -> None:
    """Refuse a ``model_type`` the installed transformers has no config class for.

    Raises:
        ModelConfigError: an unknown ``model_type``.
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ModelConfigError(f"model config {name} has model_type {model_type!r}, which transformers "
                               f"{transformers.__version__} does not know; use a model_type it lists (e.g. "
                               "\"llama\", \"mixtral\", \"gpt2\") or a newer transformers")


def _first_line(e: BaseException) -> str:
    """transformers' message folded into one line (at most 300 characters), else the type's name."""
    text = " ".join(str(e).split()).rstrip(".")
    return (text[:297] + "...") if len(text) > 300 else (text or type(e).__name__)


def hf_config_object(cf: ModelConfigFile, name: str) -> Any:
    """The transformers config object of a read file: ``AutoConfig.for_model(**fields)`` with
    ``use_cache=False`` and ``attn_implementation="sdpa"`` (no download, no remote code).

    Raises:
        ModelConfigError: the installed transformers does not know ``model_type``, or refuses a
            field's value.
    """
    import transformers

    kw = {k: v for k, v in cf.fields.items() if k not in ("model_type", "auto_map")}
    kw.update(use_cache=False, attn_implementation="sdpa")
    try:
        with warnings.catch_warnings():   # e.g. "rope_scaling is deprecated": the public file is as published
            warnings.simplefilter("ignore", FutureWarning)
            return transformers.AutoConfig.for_model(cf.model_type, **kw)
    except Exception as e:  # noqa: BLE001 - the user's file: any refusal (validators included) is one sentence
        raise ModelConfigError(f"transformers refuses model config {name}: {_first_line(e)}") from None


def config_default_seq_len(fields: dict[str, Any]) -> int:
    """Tokens per sample when none is asked for: the config's context (``max_position_embeddings``
    or ``n_positions``), else :data:`FALLBACK_SEQ_LEN`; the registry's HF models do the same
    (gpt2: 1024)."""
    limit = _hf.max_positions(fields)
    return limit if limit is not None else FALLBACK_SEQ_LEN


def build_from_config(name: str, *, device: str | torch.device = "meta",
                      dtype: torch.dtype = torch.float32) -> tuple[nn.Module, dict[str, Any]]:
    """Build the model of a ``config.json`` (or a folder holding one) on ``device``.

    Args:
        name: the path of the file or folder.
        device: ``"meta"`` (default: no weights allocated) or a real device.
        dtype: parameter dtype (the file's ``torch_dtype`` is not used: the plan's ``--dtype`` is).

    Returns:
        ``(module, config dict)``: the logits-only module in training mode (``forward(input_ids
        [B, T] int64) -> logits [B, T, vocab]``; seq2seq models also take ``decoder_input_ids``;
        image models ``pixel_values [B, C, H, W]``), and ``{"architecture", "config_path",
        **config}`` (JSON-able; an image model also ``"image": [C, H, W]``).

    Raises:
        ModelConfigError: see :func:`load_model_config` and :func:`hf_config_object`; also no
            ``auto_class`` model for this ``model_type``, or transformers failing to build it.
    """
    import transformers

    cf = load_model_config(name)
    cfg = hf_config_object(cf, name)
    auto = getattr(transformers, cf.auto_class)
    try:
        with torch.device(device):
            module = auto.from_config(cfg, dtype=dtype)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise ModelConfigError(f"transformers {transformers.__version__} has no {cf.auto_class} model for "
                                   f"model_type {cf.model_type!r} (model config {name}); Tessel plans causal, "
                                   "masked and seq2seq language models and image classifiers") from None
        raise ModelConfigError(f"transformers cannot build model config {name}: {_first_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - the user's file: any failure to build it is one sentence
        raise ModelConfigError(f"transformers cannot build model config {name}: {_first_line(e)}") from None
    module.__class__ = _hf.logits_only_class(type(module))
    module.to(dtype=dtype)
    module.train()
    arch = type(module).__name__.removesuffix("LogitsOnly")
    config = {**_hf.config_dict(cfg, arch), "config_path": str(cf.path)}
    if _hf.hf_task(type(module)) == "image-classification":
        size = getattr(cfg, "image_size", 224)
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        config["image"] = [int(getattr(cfg, "num_channels", 3)), int(h), int(w)]
    log.info("built %s from %s on %s: %s", arch, cf.path, device, cf.auto_class)
    return module, config


def config_task(name: str) -> str:
    """The built-in task the model of a config trains on (:func:`engine.models.hf.hf_task` of
    the class its auto class picks, without building it): ``causal-lm``, ``masked-lm``,
    ``seq2seq`` or ``image-classification``.

    Raises:
        ModelConfigError: see :func:`load_model_config`.
    """
    cf = load_model_config(name)
    tasks = {"AutoModelForCausalLM": "causal-lm", "AutoModelForMaskedLM": "masked-lm",
             "AutoModelForSeq2SeqLM": "seq2seq", "AutoModelForImageClassification": "image-classification"}
    return tasks[cf.auto_class]


def model_choice(model: str | None, model_config: str | None) -> str | None:
    """The model a command plans from its ``--model`` and ``--model-config`` (the CLI's hand-off):
    ``model_config`` when given, checked by :func:`load_model_config` before anything is planned
    (the path is the model's name: :func:`engine.models.registry.config_model_spec`), else
    ``model`` (``None`` when neither is given: the command's default).

    Raises:
        ModelConfigError: both are given, or the config cannot be read.
    """
    if model_config is None:
        return model
    if model is not None:
        raise ModelConfigError(f"--model-config {model_config} cannot be combined with --model {model}; give one "
                               "of them")
    load_model_config(model_config)
    return model_config
