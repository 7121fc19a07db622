"""Training tasks: data, loss and throughput unit of a plan (see :mod:`tasks.base`)."""

from tasks.base import Task, TaskContext, TaskError, Unit

__all__ = ["Task", "TaskContext", "TaskError", "Unit"]
