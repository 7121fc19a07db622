"""The notebooks in notebooks/ execute top to bottom (nbclient, a fresh ipykernel each)."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

pytestmark = pytest.mark.timeout(600)


def test_the_notebooks_are_there():
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "placements.ipynb", "gnn.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    client = NotebookClient(nb, timeout=420, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    # the views rendered as Panel output (its mimebundle), not as a plain repr
    panel_outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                     if any(k.startswith("application/vnd.holoviews") for k in o.get("data", {}))]
    assert len(panel_outputs) >= (5 if path.stem == "quickstart" else 1)
