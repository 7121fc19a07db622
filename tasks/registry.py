"""Task names -> tasks (``causal-lm``, ``masked-lm``, ``seq2seq``, ``image-classification``, or a
user's ``package.module:callable``)."""

from __future__ import annotations

from tasks.base import Task, TaskContext, TaskError

__all__ = ["get_task"]


def get_task(name: str, ctx: TaskContext | None = None) -> Task:
    """The task ``name`` for a model and run described by ``ctx``.

    Raises:
        TaskError: an unknown name.
    """
    raise TaskError(f"unknown task {name!r}")
