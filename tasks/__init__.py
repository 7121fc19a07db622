"""Training tasks: data, loss and throughput unit of a plan (see :mod:`tasks.base`; built-ins in
:mod:`tasks.text`, :mod:`tasks.seq2seq`, :mod:`tasks.digits`; user tasks in :mod:`tasks.user`)."""

from tasks.base import Task, TaskContext, TaskError, Unit
from tasks.registry import TASKS, check_task_name, get_task, task_for_plan

__all__ = ["TASKS", "Task", "TaskContext", "TaskError", "Unit", "check_task_name", "get_task", "task_for_plan"]
