"""Training tasks: data, loss and throughput unit of a plan (see :mod:`tasks.base`)."""

from tasks.base import Task, TaskContext, TaskError, Unit
from tasks.registry import get_task

__all__ = ["Task", "TaskContext", "TaskError", "Unit", "get_task"]
