"""``tessel ARGV`` run in this process, for the CLI tests of this folder."""

from __future__ import annotations

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
