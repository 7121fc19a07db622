"""Which child processes of the test process belong to Ray (not a test module).

A process counts as Ray's when its command line names Ray (``raylet``, ``gcs_server``, a
``default_worker.py``, ...). The multiprocessing helpers of the pool harness (its fork server, the
rank processes forked from it and the resource tracker) are not: their command line carries
``sys.path``, which names Ray's ``thirdparty_files`` folder once Ray has been imported.
"""

from __future__ import annotations

_MULTIPROCESSING_HELPERS = ("from multiprocessing.forkserver import", "from multiprocessing.resource_tracker import")


def ray_child_processes() -> list[str]:
    """``"pid command-line"`` (the command line cut at 80 characters) of each live Ray process
    below this one."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if p.status() == psutil.STATUS_ZOMBIE or any(h in cmd for h in _MULTIPROCESSING_HELPERS):
                continue
            if "ray" in cmd:
                out.append(f"{p.pid} {cmd[:80]}")
        except psutil.Error:
            pass
    return out
