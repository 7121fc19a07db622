"""Names of a package loaded on first use (PEP 562), for the packages whose modules import torch
while the rest of the package must stay light (``engine.plan``, ``engine.tune``)."""

from __future__ import annotations

import importlib
from typing import Any, Mapping, MutableMapping


def load_lazy_name(package: str, lazy: Mapping[str, str], namespace: MutableMapping[str, Any], name: str) -> Any:
    """``name`` of ``package`` imported from its module in ``lazy`` (name -> module) and kept in
    ``namespace`` (the package's ``globals()``) so later lookups skip this function.

    Raises:
        AttributeError: ``name`` is not one of ``lazy`` (Python's message for a missing attribute).
    """
    module = lazy.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    namespace[name] = value
    return value
