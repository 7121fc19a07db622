"""Task names -> tasks (``causal-lm``, ``masked-lm``, ``seq2seq``, ``image-classification``, ``contrastive``, or a
user's ``package.module:callable``), and the task of a plan (:func:`task_for_plan`)."""

from __future__ import annotations

from typing import Any, Callable

from engine.errors import TaskError
from tasks.base import Task, TaskContext

__all__ = ["TASKS", "get_task", "check_task_name", "model_vocab_size", "task_for_plan"]

TASKS: dict[str, str] = {
    "causal-lm": "next-byte prediction on the CPython sources (GPT-style; input_ids -> logits [B, T, V]); tokens",
    "masked-lm": "BERT-style masked bytes of the CPython sources (15% selected: 80% [MASK], 10% random, 10% kept; "
                 "vocab > 256); tokens",
    "seq2seq": "T5-style span corruption of the CPython sources (input_ids, decoder_input_ids -> logits [B, T', V]; "
               "sentinels at the top of the vocab); tokens",
    "image-classification": "scikit-learn's bundled load_digits 8x8 images, 10 classes (pixel_values [B, 1, 8, 8] -> "
                            "logits [B, 10]); samples",
    "contrastive": "CPython docstrings matched to their function bodies (text_ids, code_ids [B, T] -> logits [B, B] "
                   "of a two-tower model; symmetric InfoNCE); samples",
    "<module>:<callable>": "user code: a callable returning a task object (train_batch, val_batch, loss, "
                           "input_names; see tasks.user)",
}
"""Task names -> one-line descriptions (for ``--help`` and errors)."""


def _builtins() -> dict[str, Callable[[TaskContext], Task]]:
    from tasks.contrastive import ContrastivePairs
    from tasks.digits import Digits
    from tasks.seq2seq import SpanCorruption
    from tasks.text import CausalLM, MaskedLM

    return {"causal-lm": CausalLM, "masked-lm": MaskedLM, "seq2seq": SpanCorruption,
            "image-classification": Digits, "contrastive": ContrastivePairs}


def _unknown(name: str) -> TaskError:
    valid = ", ".join(n for n in TASKS if ":" not in n)
    return TaskError(f"unknown task {name!r}; valid tasks: {valid}, or user code as 'package.module:callable'")


def check_task_name(name: str) -> str:
    """``name`` if it is a built-in task or has the ``module:callable`` form (nothing is imported).

    Raises:
        TaskError: neither (the message lists the valid tasks).
    """
    if name in _builtins():
        return name
    mod, sep, attr = name.partition(":")
    if sep and mod and attr:
        return name
    raise _unknown(name)


def get_task(name: str, ctx: TaskContext | None = None) -> Task:
    """The task ``name`` for a model and run described by ``ctx`` (default ``TaskContext()``).

    Raises:
        TaskError: an unknown name (listing the valid ones), a model the task's data does not fit
            (e.g. masked-lm without a vocabulary above the bytes), or a user task that cannot be
            imported or breaks the protocol of :mod:`tasks.user`.
    """
    ctx = ctx if ctx is not None else TaskContext()
    builtins = _builtins()
    if name in builtins:
        return builtins[name](ctx)
    check_task_name(name)
    from tasks.user import load_user_task

    return load_user_task(name, ctx)


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
        TaskError: see :func:`get_task`.
    """
    name = task or plan.model.task_name
    vocab = None
    if module is not None:
        vocab = model_vocab_size(module, config)
    else:   # the plan records the model's configuration (HF config, zoo config)
        vocab = model_vocab_size(None, plan.model.config)
    if vocab is None and module is None and name not in ("causal-lm", "image-classification"):
        check_task_name(name)
        from engine.models import build_model

        bundle = build_model(plan.model.name, batch_size=plan.model.micro_batch_size, seq_len=plan.model.seq_len,
                             device="meta", task=name)
        vocab = model_vocab_size(bundle.module, bundle.config)
    ctx = TaskContext(seq_len=plan.model.seq_len, vocab_size=vocab, seed=seed, model_name=plan.model.name)
    return get_task(name, ctx)
