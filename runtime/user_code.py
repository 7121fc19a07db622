"""User code reaches every rank on every node: a plan whose model is ``package.module:callable``
ships that code with the ranks through Ray's ``runtime_env`` (``py_modules``), as Ray users expect.

Without it, a model that the driver imports from its working directory (``tessel launch`` run
where ``mymodel.py`` lies, no ``PYTHONPATH``) was unknown to every rank: each failed in set-up
after Ray's start-up, exit status 3. :func:`user_code_runtime_env` gives the actors' runtime
environment: the top-level package's directory, or the single module file, as the driver
imports it. Code installed in the interpreter's environment (site-packages, the standard
library) is left out: every node has its own copy, as it has torch.

Source: Ray runtime environments, ``py_modules``
(https://docs.ray.io/en/latest/ray-core/handling-dependencies.html).
"""

from __future__ import annotations

import importlib.util
import sys
import sysconfig
from pathlib import Path

from engine.models.registry import is_user_model

__all__ = ["user_code_path", "user_code_runtime_env"]


def _installed(path: Path) -> bool:
    roots = {Path(p).resolve() for p in (sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib"),
                                         sysconfig.get_paths().get("stdlib"), sys.base_prefix) if p}
    return any(path == r or r in path.parents for r in roots)


def user_code_path(model: str) -> Path | None:
    """The directory of the top-level package (or the file of the single module) that a user
    model ``package.module:callable`` is imported from here; ``None`` for a registered model, a
    config path, code installed in the environment, or a module this interpreter cannot find
    (the launcher's model check names that one)."""
    if not is_user_model(model):
        return None
    top = model.partition(":")[0].split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin in (None, "built-in", "frozen"):
        return None
    path = Path(spec.submodule_search_locations[0]) if spec.submodule_search_locations else Path(str(spec.origin))
    path = path.resolve()
    return None if _installed(path) else path


def user_code_runtime_env(model: str) -> dict | None:
    """The actors' ``runtime_env`` that ships a user model's code (:func:`user_code_path`):
    ``{"py_modules": [path]}``, or ``None`` when there is nothing to ship."""
    path = user_code_path(model)
    return {"py_modules": [str(path)]} if path is not None else None
