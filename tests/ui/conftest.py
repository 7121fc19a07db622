"""Browser-test fixtures: a served planner app (``tessel serve`` in a subprocess on a free port)
and pytest-playwright's ``page`` driven by Debian's Chromium (playwright cannot download one here).

Tests skip, with the reason, when ``/usr/bin/chromium`` is missing (``make browser`` installs it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("TESSEL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

#: The app every browser test opens: a small model so a session starts in seconds.
APP_ARGS = ["--model", "gpt2-tiny", "--devices", "2", "--micro-batches", "4"]


def _free_port() -> int:
    """A port for the served app, below the ephemeral range (:func:`runtime.ports.free_port`)."""
    from runtime.ports import free_port

    return free_port("127.0.0.1")


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    """pytest-playwright: launch the system Chromium headless."""
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        pytest.skip(f"no Chromium at {CHROMIUM}: run `make browser` (apt install chromium) to run the browser tests")
    return {**browser_type_launch_args,
            "executable_path": CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium"),
            "args": CHROMIUM_ARGS, "headless": True}


@contextlib.contextmanager
def served_app(*args: str):
    """Run ``tessel serve --port P ARGS`` in a subprocess (its own process group) and yield its URL
    once it listens; the group is stopped at the end. Fails the test when it exits or does not
    listen within 120 s."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "apps.cli", "serve", "--port", str(port), *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.time() + 120
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"tessel serve {' '.join(args)} exited with {proc.returncode}: "
                            f"{proc.stdout.read()[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.3)
        else:
            pytest.fail(f"tessel serve {' '.join(args)} did not start listening within 120 s")
        yield f"http://127.0.0.1:{port}/"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


@pytest.fixture(scope="session")
def app_url():
    """URL of a ``tessel serve`` subprocess on :data:`APP_ARGS` (stopped at the end of the session)."""
    with served_app(*APP_ARGS) as url:
        yield url


@pytest.fixture(scope="module")
def dp_url(tmp_path_factory):
    """URL of a ``tessel serve`` opened on a data-parallel plan file (gpt2-tiny, dp=2 on 2 CPU devices)."""
    from engine.io import save_plan
    from engine.plan import make_plan

    path = tmp_path_factory.mktemp("colocate") / "dp2.json"
    save_plan(make_plan("gpt2-tiny", devices=2, dp=2, micro_batches=1, device_type="cpu").plan, path)
    with served_app("--plan", str(path)) as url:
        yield url
