"""The subprocess runner of the launch tests (tests/tessel_run.py) fails where a plain
``subprocess.run`` would hang: on a process that outlives the command holding its output, and on
a command that does not end (with its stack)."""

from __future__ import annotations

import sys

import pytest
from tessel_run import run_tessel

PY = [sys.executable, "-c"]


def test_a_process_left_holding_the_output_is_named():
    orphan = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
              "stdout=sys.stdout, stderr=sys.stderr); print('parent done')")
    with pytest.raises(pytest.fail.Exception, match=r"exited \(0\) but these processes still held its output") as e:
        run_tessel(timeout=60, program=[*PY, orphan], outlive_grace=1.0)
    assert "time.sleep(60)" in str(e.value)


def test_a_command_that_does_not_end_fails_with_its_stack():
    stuck = "import time\ndef waiting_for_ever():\n    time.sleep(600)\nwaiting_for_ever()\n"
    with pytest.raises(pytest.fail.Exception, match=r"ran past 3 s") as e:
        run_tessel(timeout=3, program=[*PY, stuck])
    assert "waiting_for_ever" in str(e.value)


def test_a_command_that_ends_gives_its_status_and_output():
    p = run_tessel("x", timeout=60, program=[*PY, "import sys; print(sys.argv[1]); sys.exit(3)"])
    assert (p.returncode, p.stdout) == (3, "x\n")
