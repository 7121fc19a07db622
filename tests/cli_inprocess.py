"""``tessel ARGV`` run in this process, for the CLI tests of this folder."""

from __future__ import annotations

import contextlib
import io
import subprocess

from apps.cli import main


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``tessel ARGV`` in-process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:   # argparse's own refusal
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    """``tessel ARGV`` in-process with its stdout and stderr captured, returned as
    :class:`subprocess.CompletedProcess` (``returncode``, ``stdout``, ``stderr``) like a ``tessel``
    subprocess, without that process's seconds of importing torch. :func:`apps.cli.main` is the
    program's one error boundary (it never raises), so what the tests read is what a user sees."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as e:   # argparse's --help; the status as Python's exit would give it
            rc = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["tessel", *argv], rc, out.getvalue(), err.getvalue())
