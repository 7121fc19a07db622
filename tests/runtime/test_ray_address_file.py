"""A local launch starts its own Ray cluster even where Ray's address file names another.

``ray.init()`` without an address joins the cluster named in ``$RAY_TMPDIR/ray/ray_current_cluster``
(written by ``ray start`` and by ``ray.cluster_utils.Cluster``, the transfer benchmark's two-node
cluster). When that cluster has stopped and left the file, ``ray.init()`` waits for its GCS
without end: CI caught ``tessel demo`` doing so for its whole 330 s while another test's cluster
came and went. ``runtime.cluster.init_ray`` now starts a local cluster (``address="local"``)
unless ``RAY_ADDRESS`` names the job's cluster (``ray job submit``)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest
from tessel_run import run_tessel

pytest.importorskip("ray")

_START = ("import ray; from runtime.cluster import init_ray, shutdown_ray; owned = init_ray(); "
          "print(ray.get_runtime_context().gcs_address); shutdown_ray(owned)")


def test_a_stale_ray_address_file_is_not_joined():
    # a short folder: Ray's session sockets live under it, and socket paths are limited to 107 bytes
    tmp = tempfile.mkdtemp(prefix="tsl-ray-", dir="/tmp")
    try:
        os.mkdir(os.path.join(tmp, "ray"))
        with open(os.path.join(tmp, "ray", "ray_current_cluster"), "w") as f:
            f.write("127.0.0.1:9")   # no GCS there: a stopped cluster's leftover
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        p = run_tessel(timeout=120, program=[sys.executable, "-c", _START], env={**env, "RAY_TMPDIR": tmp})
        assert p.returncode == 0, p.stderr[-3000:]
        address = p.stdout.strip().splitlines()[-1]
        assert address and not address.endswith(":9"), address
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
