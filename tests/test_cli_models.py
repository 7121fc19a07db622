"""``tessel models``: a table that fits a terminal, and a reader that stops early (``tessel models |
head``) ends the command quietly with status 0 (issue 32's review faults: a 298-character table
and ``error: BrokenPipeError``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cli_inprocess import run_cli

ROOT = Path(__file__).resolve().parents[1]


def test_the_models_table_fits_the_terminal_and_names_every_model(monkeypatch):
    from engine.models import list_models

    monkeypatch.setenv("COLUMNS", "100")
    p = run_cli("models")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100
    names = {line.split()[0] for line in lines[2:] if line and not line.startswith(" ")}
    assert set(list_models()) <= names


def test_a_reader_that_stops_early_ends_the_command_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "apps.cli", "models"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()   # the reader is gone before the command writes (as `| head` after its lines)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert "error" not in err.lower() and "Traceback" not in err, err
