"""The last few captures of built-in models, kept per process so that planning the same model again
does not trace it again.

A capture (``torch.export`` of one micro-batch on the meta device) is the slowest step of planning
a small model: about a second for ``llama-tiny`` on two cores, nine to fourteen for a Llama 3
config. The app re-plans the loaded model on every form change, Compare plans it once per row,
``tessel tune`` once per micro-batch size, and a notebook or a test file plans one model many
times. The operator graph depends only on the model, the micro-batch size, the sequence length,
the compute dtype and the task (never on the parallel degrees: :func:`engine.plan.make.recheck_capture`
already shares one graph between configurations), so those five name an entry.

Only models of the built-in registry are kept, each under the builder registered for its name
(a name registered again with another builder is captured again). User code (``module:callable``)
and Hugging Face config paths are captured every time: their source or file may change between
two plans of one session.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable

from engine.models.registry import registered_spec

#: How many captures a process keeps (least recently used dropped first).
MAX_ENTRIES = 8

_ENTRIES: OrderedDict[Hashable, Any] = OrderedDict()


def cache_key(model: Any, micro_batch_size: int, seq_len: int | None, dtype: str,
              task: str | None) -> Hashable | None:
    """The key of ``model``'s capture, or ``None`` where it is not kept (a built model, user code,
    a config path)."""
    if not isinstance(model, str):
        return None
    spec = registered_spec(model)
    if spec is None:
        return None
    return model, id(spec.builder), int(micro_batch_size), seq_len, dtype, task


def get(key: Hashable | None) -> Any:
    """The entry stored under ``key`` (marked most recently used), or ``None``."""
    if key is None or key not in _ENTRIES:
        return None
    _ENTRIES.move_to_end(key)
    return _ENTRIES[key]


def put(key: Hashable | None, value: Any) -> None:
    """Keep ``value`` under ``key`` (nothing for ``None``), dropping the least recently used entry
    beyond :data:`MAX_ENTRIES`."""
    if key is None:
        return
    _ENTRIES[key] = value
    _ENTRIES.move_to_end(key)
    while len(_ENTRIES) > MAX_ENTRIES:
        _ENTRIES.popitem(last=False)


def clear() -> None:
    """Forget every kept capture (the next plan of each model traces it again)."""
    _ENTRIES.clear()


__all__ = ["MAX_ENTRIES", "cache_key", "clear", "get", "put"]
