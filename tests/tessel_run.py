"""``tessel ARGV`` as a subprocess, for the tests that launch Ray: a hang fails with where it hung,
and a process that outlives the command holding its output fails by name.

``subprocess.run(..., capture_output=True)`` reads the command's pipes to their end, so it waits for
every process that inherited them, not for ``tessel``: a Ray helper left running after
``ray.shutdown()`` made such a test time out with nothing to show (a user's ``tessel launch | tee``
would hang the same way). Here the output goes to files, the test waits for ``tessel`` itself, and
then checks, as its own assertion, that nothing left behind still holds that output. Should
``tessel`` not end within the timeout, Python's faulthandler (``PYTHONFAULTHANDLER``, on SIGABRT)
writes every thread's stack to its stderr, and the test fails with that and the process tree.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Seconds a process left by the command may still hold its output after it exits (Ray's own
#: processes end within ``runtime.cluster.shutdown_ray``'s 10 s grace or are killed by it).
OUTLIVE_GRACE_S = 15.0


def _tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return [proc]


def _describe(procs: list[psutil.Process]) -> str:
    lines = []
    for p in procs:
        try:
            lines.append(f"  {p.pid} {p.status()}: {' '.join(p.cmdline())[:200]}")
        except psutil.Error:
            lines.append(f"  {p.pid} (gone)")
    return "\n".join(lines)


def _holders(paths: set[str]) -> list[psutil.Process]:
    """The processes that have one of ``paths`` open."""
    found = []
    for p in psutil.process_iter():
        try:
            if any(f.path in paths for f in p.open_files()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def run_tessel(*argv: str, timeout: float, cwd: Path | str = ROOT, env: dict[str, str] | None = None,
               program: list[str] | None = None, outlive_grace: float = OUTLIVE_GRACE_S) -> subprocess.CompletedProcess:
    """Run ``python -m apps.cli ARGV`` (or ``program`` + ``ARGV``) in ``cwd`` and return its
    :class:`subprocess.CompletedProcess` (``returncode``, ``stdout``, ``stderr`` as text).

    Fails the test (``pytest.fail``) when the command runs past ``timeout`` seconds (with its
    threads' stacks and its process tree), or when a process it left behind still holds its stdout
    or stderr ``outlive_grace`` seconds after it exited (named, then killed)."""
    cmd = [*(program or [sys.executable, "-m", "apps.cli"]), *argv]
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    with tempfile.TemporaryDirectory(prefix="tessel-run-") as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        with open(out_path, "w") as out, open(err_path, "w") as err:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        me = psutil.Process(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            tree = _tree(me)
            seen = _describe(tree)
            proc.send_signal(signal.SIGABRT)   # faulthandler: every thread's stack to stderr
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            _kill(tree)
            stacks = Path(err_path).read_text(errors="replace")
            pytest.fail(f"`tessel {' '.join(argv[:2])} ...` ran past {timeout:.0f} s; its processes:\n{seen}\n"
                        f"stderr (with the stacks):\n{stacks[-12000:]}", pytrace=False)
        deadline = time.monotonic() + outlive_grace
        left = _holders({out_path, err_path})
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = _holders({out_path, err_path})
        if left:
            who = _describe(left)
            _kill(left)
            pytest.fail(f"`tessel {' '.join(argv[:2])} ...` exited ({rc}) but these processes still held its "
                        f"output {outlive_grace:.0f} s later, so a pipe reading it would not end:\n{who}",
                        pytrace=False)
        return subprocess.CompletedProcess(cmd, rc, Path(out_path).read_text(errors="replace"),
                                           Path(err_path).read_text(errors="replace"))
