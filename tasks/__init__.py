"""Training tasks: data, loss and throughput unit of a plan (see :mod:`tasks.base`; built-ins in
:mod:`tasks.text`, :mod:`tasks.seq2seq`, :mod:`tasks.digits`; user tasks in :mod:`tasks.user`).

The names below are imported on first use (PEP 562 module ``__getattr__``): :mod:`tasks.base`
imports torch, and the command line imports :mod:`tasks.graph_forms` for its help text without
paying for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.base import Task, TaskContext, Unit
    from tasks.registry import TASKS, check_task_name, get_task

#: Exported name -> the module defining it.
_EXPORTS = {"Task": "tasks.base", "TaskContext": "tasks.base", "Unit": "tasks.base",
            "TASKS": "tasks.registry", "check_task_name": "tasks.registry", "get_task": "tasks.registry"}

__all__ = ["TASKS", "Task", "TaskContext", "Unit", "check_task_name", "get_task"]


def __getattr__(name: str) -> Any:
    """Import an exported name's module on first access (``tasks.Task`` etc.).

    Raises:
        AttributeError: ``name`` is not exported by :mod:`tasks`.
    """
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tasks' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
