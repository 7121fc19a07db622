"""Structure checks that ruff and import-linter do not make (run by ``make lint``).

1. **Function length**: no function or method in ``engine/``, ``runtime/`` or ``apps/`` is longer
   than :data:`MAX_FUNCTION_LINES` lines (its ``def`` line to its last line, docstring included).
2. **Function-local imports** only where an optional heavy dependency is loaded lazily: an
   ``import`` inside a function must load a heavy package (:data:`HEAVY`: torch, transformers,
   ray, panel, ...) or a project module that, through its module-level imports, loads a heavy
   package the importing module does not already load at module level. Any other local import
   (an import circle hidden in a function, or plain habit) is reported.

Usage::

    python tools/check_structure.py            # the whole project; exit status 1 on a violation
    python tools/check_structure.py engine/tessel --count   # one folder; also count local imports
    python tools/check_structure.py --root DIR               # another tree with the same packages

Module-level imports under ``if TYPE_CHECKING:`` are not followed (they do not run).
"""

from __future__ import annotations

import argparse
import ast
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The project's packages.
PACKAGES = ("engine", "runtime", "planner_ui", "apps", "tasks")
#: Folders whose functions must stay short.
SHORT_FUNCTIONS = ("engine", "runtime", "apps")
MAX_FUNCTION_LINES = 150
#: Third-party packages whose import costs a noticeable part of a second or more (measured on the
#: development machine: torch 2.2 s, transformers 1.4 s, torch_geometric 6.6 s, panel 0.9 s,
#: scikit-learn 1.1 s, ray 0.4 s, ortools' CP-SAT 0.3 s) or that an installation may lack.
HEAVY = frozenset({"torch", "transformers", "torch_geometric", "ray", "panel", "bokeh", "sklearn", "scipy",
                   "ortools", "playwright", "nbclient", "nbformat", "matplotlib", "pandas", "IPython",
                   "ipywidgets", "jupyter_bokeh", "hypothesis", "webbrowser"})


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _source_files(roots: list[str]) -> list[Path]:
    out: list[Path] = []
    for r in roots:
        p = ROOT / r
        out += [p] if p.is_file() else sorted(p.rglob("*.py"))
    return out


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _resolve(module: str, node: ast.ImportFrom | ast.Import, alias: str | None = None) -> list[str]:
    """Absolute module names an import statement in ``module`` names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        pkg = module.split(".")
        is_pkg = (ROOT / Path(*pkg) / "__init__.py").exists()
        pkg = pkg if is_pkg else pkg[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    # ``from pkg import sub`` may import a submodule, or a name ``pkg`` loads lazily (PEP 562)
    lazy = _lazy_names(base)
    return [base] + [f"{base}.{a.name}" for a in node.names] + [lazy[a.name] for a in node.names if a.name in lazy]


@lru_cache(maxsize=None)
def _lazy_names(module: str) -> dict[str, str]:
    """Names a module with a PEP 562 ``__getattr__`` loads on first use -> the module defining
    them, read off its ``if TYPE_CHECKING:`` imports (how such a module declares them)."""
    path = _path_of(module)
    if path is None:
        return {}
    body = _tree(path).body
    if not any(isinstance(s, ast.FunctionDef) and s.name == "__getattr__" for s in body):
        return {}
    out: dict[str, str] = {}
    for s in body:
        if isinstance(s, ast.If) and _is_type_checking(s.test):
            for imp in s.body:
                if isinstance(imp, ast.ImportFrom) and imp.module and not imp.level:
                    out.update({a.asname or a.name: imp.module for a in imp.names})
    return out


def _path_of(module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    p = ROOT / Path(*parts)
    if (p / "__init__.py").exists():
        return p / "__init__.py"
    if p.with_suffix(".py").exists():
        return p.with_suffix(".py")
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_level_imports(path: Path) -> list[str]:
    """Modules imported when ``path`` is imported (module level, try/except included, not TYPE_CHECKING)."""
    module = _module_name(path)
    out: list[str] = []

    def visit(stmts: list[ast.stmt]) -> None:
        for s in stmts:
            if isinstance(s, (ast.Import, ast.ImportFrom)):
                out.extend(_resolve(module, s))
            elif isinstance(s, ast.If) and not _is_type_checking(s.test):
                visit(s.body)
                visit(s.orelse)
            elif isinstance(s, ast.Try):
                visit(s.body)
                for h in s.handlers:
                    visit(h.body)
                visit(s.orelse)
                visit(s.finalbody)

    visit(_tree(path).body)
    # a submodule import also runs its packages' __init__
    parents = []
    for m in out:
        parts = m.split(".")
        parents += [".".join(parts[:i]) for i in range(1, len(parts))]
    return out + parents


@lru_cache(maxsize=None)
def heavy_loaded(module: str) -> frozenset[str]:
    """Heavy packages (:data:`HEAVY`) that importing ``module`` loads, through module-level imports."""
    top = module.split(".")[0]
    if top in HEAVY:
        return frozenset({top})
    path = _path_of(module)
    if path is None:
        return frozenset()
    seen: set[str] = set()
    out: set[str] = set()
    stack = [module]
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        t = m.split(".")[0]
        if t in HEAVY:
            out.add(t)
            continue
        p = _path_of(m)
        if p is None:
            continue
        stack.extend(_top_level_imports(p))
    return frozenset(out)


def long_functions(files: list[Path]) -> list[str]:
    out = []
    for f in files:
        rel = f.relative_to(ROOT)
        if rel.parts[0] not in SHORT_FUNCTIONS:
            continue
        for n in ast.walk(_tree(f)):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (n.end_lineno or n.lineno) - n.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    out.append(f"{rel}:{n.lineno}: function {n.name} is {length} lines long "
                               f"(at most {MAX_FUNCTION_LINES}); split it")
    return out


def local_imports(files: list[Path]) -> tuple[list[str], int]:
    """``(violations, number of function-local imports)``."""
    out, count = [], 0
    for f in files:
        rel = f.relative_to(ROOT)
        if rel.parts[0] not in PACKAGES:
            continue
        module = _module_name(f)
        own = set()
        for m in _top_level_imports(f):
            own |= heavy_loaded(m)
        seen: set[int] = set()
        for fn in ast.walk(_tree(f)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for s in ast.walk(fn):
                if not isinstance(s, (ast.Import, ast.ImportFrom)) or s.lineno in seen:
                    continue
                seen.add(s.lineno)
                count += 1
                names = _resolve(module, s)
                brings = set()
                for m in names:
                    brings |= heavy_loaded(m)
                if not brings - own:
                    what = ast.unparse(s)
                    out.append(f"{rel}:{s.lineno}: function-local `{what}` loads no heavy package that "
                               f"{module} does not already load; import it at module level")
    return out, count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=list(PACKAGES), help="folders or files (default: the packages)")
    ap.add_argument("--count", action="store_true", help="print the number of function-local imports")
    ap.add_argument("--root", type=Path, default=None, help="the tree to check (default: this repository)")
    args = ap.parse_args(argv)
    if args.root is not None:
        global ROOT
        ROOT = args.root.resolve()
    files = _source_files(args.paths)
    problems = long_functions(files)
    bad, count = local_imports(files)
    problems += bad
    for p in problems:
        print(p)
    if args.count:
        print(f"{count} function-local imports in {len(files)} files; {len(bad)} not for a heavy dependency")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
