"""Task names -> tasks (``causal-lm``, ``masked-lm``, ``seq2seq``, ``image-classification``, ``contrastive``, or a
user's ``package.module:callable``). A task is given what it needs of its model (:class:`~tasks.base.TaskContext`);
the task of a plan's model is :func:`engine.models.bundle.task_for_plan`."""

from __future__ import annotations

from typing import Callable

from engine.errors import TaskError
from tasks.base import Task, TaskContext
from tasks.contrastive import ContrastivePairs
from tasks.digits import Digits
from tasks.seq2seq import SpanCorruption
from tasks.text import CausalLM, MaskedLM
from tasks.user import load_user_task

__all__ = ["TASKS", "get_task", "check_task_name"]

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
    """Built-in task names -> their classes (each built with a :class:`~tasks.base.TaskContext`)."""
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
    return load_user_task(name, ctx)
