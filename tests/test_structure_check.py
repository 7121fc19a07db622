"""The structure checks of ``make lint`` (``tools/check_structure.py``): the repository passes them,
and a throw-away tree with a long function, or an import hidden in a function that defers nothing
heavy, fails and names the place (so a passing check is not a check that finds nothing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tools" / "check_structure.py"


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True, timeout=120,
                          check=False)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for pkg in ("engine", "runtime", "planner_ui", "apps", "tasks"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_repository_passes():
    p = _check("--count")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 not for a heavy dependency" in p.stdout


def test_a_long_function_is_reported(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(151))
    root = _tree(tmp_path, {"engine/long.py": "def f():\n" + body})
    p = _check("--root", str(root))
    assert p.returncode == 1
    assert "engine/long.py:1: function f is 152 lines long" in p.stdout


def test_only_a_lazy_heavy_import_may_hide_in_a_function(tmp_path):
    root = _tree(tmp_path, {
        "engine/light.py": "import math\n",
        "engine/heavy.py": "import torch\n",
        "engine/user.py": ("def a():\n    from engine.light import math\n\n\n"
                           "def b():\n    from engine.heavy import torch\n\n\n"
                           "def c():\n    import ray\n"),
    })
    p = _check("--root", str(root), "--count")
    assert p.returncode == 1
    assert "engine/user.py:2: function-local `from engine.light import math`" in p.stdout
    assert "user.py:6" not in p.stdout and "user.py:10" not in p.stdout   # torch and ray are deferred
    assert "3 function-local imports in" in p.stdout and "1 not for a heavy dependency" in p.stdout
