"""The layering contracts (pyproject.toml ``[tool.importlinter]``, run by ``make lint``).

``engine`` imports no ray/panel/bokeh/runtime/planner_ui/apps; ``runtime`` no panel/bokeh/
planner_ui/apps; ``tasks`` of ``engine`` only ``engine.errors`` and ``engine.io`` (docs/ARCHITECTURE.md).
The repository keeps them, and the same contracts, run on a small throw-away tree whose ``engine``
imports ``ray`` (or whose ``tasks`` import the model registry), fail and name the broken contract
and the offending import (so a kept contract is not a contract that checks nothing).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason=f"import-linter not installed ({LINT_IMPORTS})")


def _contracts_toml() -> str:
    """The ``[tool.importlinter]`` tables of pyproject.toml, verbatim."""
    out: list[str] = []
    keep = False
    for line in (ROOT / "pyproject.toml").read_text().splitlines():
        if line.startswith("["):
            keep = line.strip("[] ").startswith("tool.importlinter")
        if keep:
            out.append(line)
    return "\n".join(out) + "\n"


def _lint_imports(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_contracts_copy_is_complete():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    copied = tomllib.loads(_contracts_toml())["tool"]["importlinter"]
    original = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert copied == original and len(copied["contracts"]) == 3


def test_repository_keeps_the_layering_contracts():
    p = _lint_imports(ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "3 kept, 0 broken" in p.stdout


def test_a_forbidden_import_breaks_the_engine_contract(tmp_path):
    for pkg in ("engine", "runtime", "planner_ui", "apps"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "engine" / "ok.py").write_text("import math\n")
    (tmp_path / "engine" / "bad.py").write_text("import ray\n")
    (tmp_path / "runtime" / "run.py").write_text("import engine.ok\n")
    config = tmp_path / "contracts.toml"
    config.write_text(_contracts_toml())
    p = _lint_imports(tmp_path, "--config", str(config))
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "engine is the planning core: no ray, panel, bokeh, runtime, UI or apps BROKEN" in out
    assert "runtime executes plans: no panel, bokeh, UI or apps KEPT" in out
    assert "engine.bad -> ray" in out


def test_a_task_importing_the_engine_beyond_errors_and_io_breaks_the_tasks_contract(tmp_path):
    for pkg in ("engine", "engine/io", "engine/models", "runtime", "planner_ui", "apps", "tasks"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "engine" / "errors.py").write_text("class TaskError(Exception):\n    pass\n")
    (tmp_path / "engine" / "io" / "atomic.py").write_text("import engine.errors\n")
    (tmp_path / "engine" / "models" / "registry.py").write_text("import math\n")
    (tmp_path / "tasks" / "ok.py").write_text("import engine.errors\nimport engine.io\nimport engine.io.atomic\n")
    (tmp_path / "tasks" / "bad.py").write_text("import engine.models.registry\n")
    config = tmp_path / "contracts.toml"
    config.write_text(_contracts_toml())
    p = _lint_imports(tmp_path, "--config", str(config))
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "engine is the planning core: no ray, panel, bokeh, runtime, UI or apps KEPT" in out
    assert "tasks is not allowed to import engine" in out
    assert "tasks.bad -> engine.models.registry" in out
    assert "tasks.ok" not in out
