"""A user's own task, named ``package.module:callable`` (``tessel plan --task``, ``tessel launch
--task``).

Protocol. ``callable`` is imported (the module must be importable on every machine that runs a
rank: installed, or on ``PYTHONPATH``) and called with those of the keyword arguments
``seq_len``, ``vocab_size``, ``seed``, ``model_name`` (the :class:`~tasks.base.TaskContext`
fields) and ``ctx`` (the whole context) that its signature accepts. It returns an object with:

- ``input_names``: a tuple of strings, the model's positional inputs in order (e.g.
  ``("input_ids",)``); their number ``k`` is how many leading batch tensors are model inputs;
- ``train_batch(step: int, rows: int) -> tuple[Tensor, ...]``: ``(*inputs, *targets)``, at least
  ``k + 1`` CPU tensors, every one with first dimension ``rows`` (samples), the same for the same
  ``(seed, step)`` on every machine (it is called by the driver; the runtime cuts the batch into
  replicas and micro-batches along dimension 0);
- ``val_batch(index: int, rows: int) -> tuple[Tensor, ...]``: held-out data, same layout;
- ``loss(output: Tensor, *targets: Tensor) -> Tensor``: the mean loss of ONE micro-batch (a
  scalar with a gradient); ``output`` is the model's output for the micro-batch's inputs (the
  last pipeline stage's first output: logits for the built-in models), ``targets`` the
  micro-batch's rows of the target tensors;

and optionally ``unit`` (``"tokens"`` or ``"samples"``, default ``"samples"``),
``count(*targets) -> int`` (units per micro-batch for throughput; default: rows, or ``rows x
dim 1`` of the first target for ``tokens``) and ``example_inputs(rows) -> tuple`` (default: the
inputs of training batch 0). A :class:`~tasks.base.Task` subclass instance satisfies this.

Example (``tests/tasks/user_task_example.py``): reversed-bytes prediction for a causal LM::

    class ReverseBytes:
        input_names = ("input_ids",)
        unit = "tokens"
        def __init__(self, seq_len, seed=0): ...
        def train_batch(self, step, rows): return ids, ids.flip(1)     # [rows, T] int64 each
        def val_batch(self, index, rows): ...
        def loss(self, logits, labels): return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def make_task(seq_len, seed=0): return ReverseBytes(seq_len, seed)

The object is wrapped in a :class:`UserTask`, which checks every batch and loss it returns and
raises :class:`~engine.errors.TaskError` (one sentence naming the task) when it breaks the protocol.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import asdict
from typing import Any

import torch

from engine.errors import TaskError
from tasks.base import Task, TaskContext, Unit

__all__ = ["UserTask", "load_user_task", "REQUIRED_METHODS"]

REQUIRED_METHODS = ("train_batch", "val_batch", "loss")


def _resolve(name: str) -> Any:
    """The callable ``package.module:attr.path``. Raises :class:`TaskError`."""
    mod_name, _, attr = name.partition(":")
    if not mod_name or not attr:
        raise TaskError(f"user task {name!r} must be written 'package.module:callable'")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as e:
        raise TaskError(f"user task {name!r}: cannot import module {mod_name!r} ({e})") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TaskError(f"user task {name!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TaskError(f"user task {name!r}: {attr!r} is not callable")
    return obj


def _call(fn: Any, ctx: TaskContext, name: str) -> Any:
    offered = {**asdict(ctx), "ctx": ctx}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn()
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kw = {k: v for k, v in offered.items() if var_kw or k in params}
    missing = [p.name for p in params.values() if p.default is p.empty and p.kind in
               (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in kw]
    if missing:
        raise TaskError(f"user task {name!r} requires argument(s) {', '.join(missing)}; it may take only "
                        f"seq_len, vocab_size, seed, model_name and ctx")
    return fn(**kw)


def load_user_task(name: str, ctx: TaskContext) -> UserTask:
    """Import and call the user's ``package.module:callable`` (see the module docstring) and wrap
    the task object it returns.

    Raises:
        TaskError: the module or callable cannot be found, it needs other arguments, or the object
            lacks a required method or valid ``input_names``/``unit``.
    """
    fn = _resolve(name)
    obj = _call(fn, ctx, name)
    return UserTask(name, obj)


class UserTask(Task):
    """A user's task object behind the :class:`~tasks.base.Task` interface, with checks.

    Args:
        name: the ``module:callable`` it came from (for messages and plans).
        obj: the object the callable returned.

    Raises:
        TaskError: ``obj`` lacks a required method, or has bad ``input_names`` or ``unit``.
    """

    def __init__(self, name: str, obj: Any):
        self.name = name
        self.obj = obj
        missing = [m for m in REQUIRED_METHODS if not callable(getattr(obj, m, None))]
        if missing:
            raise TaskError(f"user task {name!r} returned a {type(obj).__name__} without "
                            f"{', '.join(missing)}; a task needs train_batch(step, rows), val_batch(index, rows), "
                            "loss(output, *targets) and input_names (see tasks.user)")
        names = getattr(obj, "input_names", None)
        if isinstance(names, str):
            names = (names,)
        if not isinstance(names, (tuple, list)) or not names or not all(isinstance(n, str) for n in names):
            raise TaskError(f"user task {name!r}: input_names must be a non-empty tuple of strings (the model's "
                            f"inputs in order), got {names!r}")
        self.input_names = tuple(names)
        unit = getattr(obj, "unit", "samples")
        if unit == "tokens":
            self.unit: Unit = "tokens"
        elif unit == "samples":
            self.unit = "samples"
        else:
            raise TaskError(f"user task {name!r}: unit must be 'tokens' or 'samples', got {unit!r}")

    def _batch(self, what: str, got: Any, rows: int) -> tuple[torch.Tensor, ...]:
        if isinstance(got, list):
            got = tuple(got)
        if not isinstance(got, tuple) or not all(isinstance(t, torch.Tensor) for t in got):
            raise TaskError(f"user task {self.name!r}: {what} must return a tuple of tensors (*inputs, *targets), "
                            f"got {type(got).__name__}")
        if len(got) <= self.num_inputs:
            raise TaskError(f"user task {self.name!r}: {what} returned {len(got)} tensor(s) but the task has "
                            f"{self.num_inputs} input(s) {self.input_names} and needs at least one target")
        bad = [tuple(t.shape) for t in got if t.dim() == 0 or t.shape[0] != rows]
        if bad:
            raise TaskError(f"user task {self.name!r}: {what} asked for {rows} rows returned tensors of shapes "
                            f"{[tuple(t.shape) for t in got]}; every tensor's first dimension must be {rows}")
        return got

    def train_batch(self, step: int, rows: int) -> tuple[torch.Tensor, ...]:
        """The user's ``train_batch(step, rows)``, checked."""
        return self._batch("train_batch", self.obj.train_batch(step, rows), rows)

    def val_batch(self, index: int, rows: int) -> tuple[torch.Tensor, ...]:
        """The user's ``val_batch(index, rows)``, checked."""
        return self._batch("val_batch", self.obj.val_batch(index, rows), rows)

    def loss(self, output: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        """The user's ``loss(output, *targets)``; must be a scalar tensor."""
        out = self.obj.loss(output, *targets)
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            raise TaskError(f"user task {self.name!r}: loss must return a scalar tensor, got "
                            f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}")
        return out.reshape(())

    def example_inputs(self, rows: int) -> tuple[torch.Tensor, ...]:
        """The user's ``example_inputs(rows)`` if it has one, else the inputs of training batch 0."""
        fn = getattr(self.obj, "example_inputs", None)
        if callable(fn):
            got = fn(rows)
            return tuple(got) if isinstance(got, (tuple, list)) else (got,)
        return super().example_inputs(rows)

    def count(self, *targets: torch.Tensor) -> int:
        """The user's ``count(*targets)`` if it has one, else :meth:`Task.count`."""
        fn = getattr(self.obj, "count", None)
        if callable(fn):
            return int(fn(*targets))
        return super().count(*targets)
