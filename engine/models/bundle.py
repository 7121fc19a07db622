"""A model joined with its task: the one place where :mod:`engine.models` and :mod:`tasks` meet.

The registry (:mod:`engine.models.registry`) builds modules and knows no task; a task
(:mod:`tasks`) is given what it needs of a model (its vocabulary, through
:class:`~tasks.base.TaskContext`) and imports no model. Here the two are joined:

- :func:`build_model`: a model and the example inputs its task gives (token ids, plus the decoder
  ids of span corruption for ``seq2seq``, the two towers' ids for ``contrastive``, images for
  ``image-classification``, or a user task's own), as a :class:`ModelBundle` ready to capture;
- :func:`task_for_plan`: the task a plan trains on, given its model's vocabulary.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.errors import ModelArgumentError, ModelBuildError
from engine.graph.capture import capture, note_example_inputs
from tasks.base import Task, TaskContext
from tasks.registry import check_task_name, get_task
from tasks.span import span_corruption_lengths

from .registry import build_user_module, check_build_args, infer_task, is_user_model, model_spec

__all__ = ["ModelBundle", "build_model", "example_token_inputs", "model_vocab_size", "task_for_plan"]


@dataclass
class ModelBundle:
    """A model ready to capture.

    Attributes:
        module: the ``nn.Module`` (on the requested device; ``meta`` allocates no weights).
        example_inputs: positional forward inputs, e.g. ``(input_ids,)`` int64 ``[batch, seq]``.
        name: registry name (or the ``module:callable`` string).
        source: ``"hf"`` (transformers config), ``"zoo"`` (in-project) or ``"user"``.
        config: JSON-able model configuration.
        batch_size, seq_len: shape of the example inputs (``seq_len`` None when not a sequence
            model).
        task: the task the model trains on (``causal-lm``, ``masked-lm``, ``seq2seq``,
            ``image-classification`` or a user's ``module:callable``; see :mod:`tasks`).
    """

    module: nn.Module
    example_inputs: tuple
    name: str
    source: str
    config: dict = field(default_factory=dict)
    batch_size: int = 1
    seq_len: int | None = None
    task: str = "causal-lm"

    def capture(self, **kwargs: Any):
        """Shortcut for ``engine.graph.capture(self, **kwargs)`` -> OpGraph."""
        return capture(self, **kwargs)


def build_model(name: str, *, batch_size: int = 1, seq_len: int | None = None,
                device: str | torch.device = "meta",
                dtype: torch.dtype = torch.float32, task: str | None = None) -> ModelBundle:
    """Build model ``name`` and example inputs.

    Args:
        name: a name from :func:`~engine.models.registry.list_models` or ``"package.module:callable"``.
        batch_size: batch dimension of the example inputs.
        seq_len: sequence length (default: the model's usual context, e.g. 1024 for gpt2,
            2048 for gpt3-175b / llama-7b, 128 for the tiny models).
        device: ``"meta"`` (default: shapes only, no memory) or a real device.
        dtype: floating-point dtype of parameters.
        task: the task (``causal-lm``, ``masked-lm``, ``seq2seq``, ``image-classification``,
            ``module:callable``); ``None``: the model's own (built-in) or
            :func:`~engine.models.registry.infer_task`
            (user code). It decides the example inputs of a user model that returns none.

    Returns:
        :class:`ModelBundle`; built-in models take ``(input_ids,)`` int64 ``[batch, seq]``
        (zeros on meta, seeded random ids elsewhere) and return logits ``[batch, seq, vocab]``.

    Raises:
        ModelNotFoundError: unknown name, or a ``module:callable`` that cannot be imported.
        ModelArgumentError: (a ValueError) ``batch_size`` or ``seq_len`` below 1, ``seq_len``
            beyond the model's position table, ``dtype`` not one of
            :data:`~engine.models.registry.MODEL_DTYPES`.
        ModelBuildError: (a TypeError) a ``module:callable`` that is not a Python function or
            ``nn.Module`` class, needs arguments Tessel cannot give, raises, or returns something
            other than a module or ``(module, example_inputs)`` (checked before it is called where
            possible).
    """
    check_build_args(batch_size, seq_len, dtype)
    if is_user_model(name):
        return _build_user(name, batch_size=batch_size, seq_len=seq_len, device=device,
                           dtype=dtype, task=task)
    spec = model_spec(name)
    module, config = spec.builder(device=device, dtype=dtype)
    if spec.task == "image-classification":
        shape = tuple(config.get("image", (1, 8, 8)))
        images = torch.zeros((batch_size, *shape), dtype=dtype, device=device)
        return ModelBundle(module=module, example_inputs=(images,), name=name, source=spec.source,
                           config=config, batch_size=batch_size, seq_len=None, task=task or spec.task)
    seq = seq_len or spec.default_seq_len
    limit = spec.max_seq_len(config)
    if limit is not None and seq > limit:
        raise ModelArgumentError(f"seq_len {seq} exceeds {name}'s maximum of {limit} positions; use "
                                 f"--seq-len {limit} or less")
    inputs = example_token_inputs(spec.task, batch_size, seq, spec.vocab_size(config), device)
    return ModelBundle(module=module, example_inputs=inputs, name=name, source=spec.source,
                       config=config, batch_size=batch_size, seq_len=seq, task=task or spec.task)


def example_token_inputs(task: str, batch: int, seq: int, vocab: int, device: Any) -> tuple:
    """Example inputs of a text task: ``(input_ids [batch, seq],)``, plus ``decoder_input_ids
    [batch, T']`` for ``seq2seq`` (``T'`` = the span-corruption target length,
    :func:`tasks.span.span_corruption_lengths`); ``(text_ids, code_ids)``, ``[batch, seq]`` each, for
    ``contrastive``."""
    ids = _token_ids(batch, seq, vocab, device)
    if task == "contrastive":   # a two-tower model: the text ids and the code ids
        return (ids, _token_ids(batch, seq, vocab, device))
    if task != "seq2seq":
        return (ids,)
    _, tgt = span_corruption_lengths(seq)
    return (ids, _token_ids(batch, tgt, vocab, device))


def _token_ids(batch: int, seq: int, vocab: int, device: Any) -> torch.Tensor:
    if torch.device(device).type == "meta":
        return torch.zeros(batch, seq, dtype=torch.long, device="meta")
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, seq), generator=gen).to(device)


def _build_user(name: str, *, batch_size: int, seq_len: int | None, device: Any,
                dtype: torch.dtype, task: str | None = None) -> ModelBundle:
    """A user's ``module:callable`` as a bundle; example inputs from its task when it returned only a module
    (then a capture failure says so: :func:`engine.graph.capture.note_example_inputs`)."""
    module, inputs = build_user_module(name, batch_size=batch_size, seq_len=seq_len, device=device, dtype=dtype)
    task = task or infer_task(module, inputs)
    seq = seq_len
    made_up = inputs is None
    if inputs is None:
        if task == "image-classification":
            shape = config_image_shape(module)
            if shape is None:
                raise ModelBuildError(f"{name} returned only a module for an image task, and its config states no "
                                      "image_size and num_channels; return (module, example_inputs) with example "
                                      "images [batch, C, H, W]")
            inputs = (torch.zeros((batch_size, *shape), dtype=dtype, device=device),)
        elif ":" in task:
            ctx = TaskContext(seq_len=seq_len, vocab_size=_vocab(module), model_name=name)
            inputs = tuple(get_task(task, ctx).example_inputs(batch_size))
            if torch.device(device).type == "meta":
                inputs = tuple(t.to("meta") for t in inputs)
        else:
            seq = seq_len or 128
            inputs = example_token_inputs(task, batch_size, seq, _vocab(module) or 2, device)
    if made_up:
        shapes = ", ".join(f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}" for t in inputs
                           if isinstance(t, torch.Tensor))
        note_example_inputs(module, f"{name} returned only a module, so Tessel gave it example inputs of the "
                                    f"{task} task ({shapes}); return (module, example_inputs) from {name} with "
                                    "inputs of the shapes and dtypes its forward takes")
    first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    if first is not None and first.dim() >= 1:
        batch_size = int(first.shape[0])
        if seq is None and first.dim() >= 2 and not first.is_floating_point():
            seq = int(first.shape[1])
    cfg: Any = getattr(module, "config", None)
    config: dict = {"callable": name, "class": type(module).__name__}
    if hasattr(cfg, "to_dict"):
        config["config"] = json.loads(json.dumps(cfg.to_dict(), default=str))
    elif task != "image-classification" and _vocab(module):   # a plain LM: the task checks its ids fit
        config["vocab_size"] = _vocab(module)
    return ModelBundle(module=module, example_inputs=inputs, name=name, source="user",
                       config=config, batch_size=batch_size, seq_len=seq, task=task)


def config_image_shape(module: nn.Module) -> tuple[int, int, int] | None:
    """``(C, H, W)`` of the images a model takes, from its Hugging Face config's ``num_channels`` and
    ``image_size`` (an int: square; or ``[H, W]``), or ``None`` when the config states neither
    (e.g. ``ViTConfig``, ``ConvNextConfig`` state both)."""
    cfg = getattr(module, "config", None)
    size, channels = getattr(cfg, "image_size", None), getattr(cfg, "num_channels", None)
    if isinstance(size, int) and not isinstance(size, bool):
        size = (size, size)
    if (isinstance(channels, int) and channels > 0 and isinstance(size, (list, tuple)) and len(size) == 2
            and all(isinstance(x, int) and x > 0 for x in size)):
        return int(channels), int(size[0]), int(size[1])
    return None


def _vocab(module: nn.Module) -> int | None:
    """The vocabulary of a user's model: its config's ``vocab_size``, else the rows of its first
    ``nn.Embedding`` (the token embedding of a plain PyTorch LM), else ``None``."""
    v = getattr(getattr(module, "config", None), "vocab_size", None)
    if v:
        return int(v)
    first = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    return int(first.num_embeddings) if first is not None else None


def model_vocab_size(module: Any, config: dict | None = None) -> int | None:
    """The vocabulary of a built model: ``module.config.vocab_size`` (Hugging Face, the in-project
    GPTs), else ``config["vocab_size"]`` or ``config["config"]["vocab_size"]`` (a registry
    bundle's config), else ``None`` (no vocabulary, e.g. a CNN)."""
    for src in (getattr(getattr(module, "config", None), "vocab_size", None),
                (config or {}).get("vocab_size"),
                ((config or {}).get("config") or {}).get("vocab_size")):
        if isinstance(src, int) and src > 0:
            return src
    return None


def task_for_plan(plan: Any, *, seed: int = 0, task: str | None = None, module: Any = None,
                  config: dict | None = None) -> Task:
    """The task a plan trains on: ``task`` (an override) or ``plan.model.task_name``, with
    ``TaskContext(seq_len=plan.model.seq_len, vocab_size, seed, model_name=plan.model.name)``.

    Args:
        plan: an ``engine.io.Plan``.
        seed: the data seed.
        task: a task name overriding the plan's.
        module, config: the built model (and its registry config) to read the vocabulary from;
            ``None``: from the configuration the plan records (``plan.model.config``), else the
            model is built on the ``meta`` device (no weights) when the task needs the vocabulary
            (every task but ``causal-lm`` and ``image-classification``).

    Raises:
        TaskError: see :func:`tasks.registry.get_task`.
    """
    name = task or plan.model.task_name
    vocab = None
    if module is not None:
        vocab = model_vocab_size(module, config)
    else:   # the plan records the model's configuration (HF config, zoo config)
        vocab = model_vocab_size(None, plan.model.config)
    if vocab is None and module is None and name not in ("causal-lm", "image-classification"):
        check_task_name(name)
        bundle = build_model(plan.model.name, batch_size=plan.model.micro_batch_size, seq_len=plan.model.seq_len,
                             device="meta", task=name)
        vocab = model_vocab_size(bundle.module, bundle.config)
    ctx = TaskContext(seq_len=plan.model.seq_len, vocab_size=vocab, seed=seed, model_name=plan.model.name)
    return get_task(name, ctx)
