"""Two Ray nodes on one machine (``benchmarks/emulated_cluster.py``: a namespace per node, a shaped
veth pair between them, ``ray start`` in each): plans placed by node train like one process.

- dp 2 and pp 2, one rank per node (``tessel plan --devices-per-node 1``), launched with
  ``tessel launch --address`` from the head node: 3 Adam steps equal the single-process reference;
  the ranks ran on the nodes the plan put them on (the launch's ``rank_nodes``, the printed
  mapping and the measured trace's metadata).
- tp 2 x pp 2 on two nodes of two CPUs: each tensor group inside one node, the pipeline across.
- a plan that needs more nodes than the cluster has is refused before any actor starts.

Skipped with the harness's sentence where namespaces cannot be made (not root, no ``ip``/``tc``).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from emulated_cluster import emulated_cluster, run_on_node  # noqa: E402
from emulated_network import unavailable_reason  # noqa: E402

pytestmark = [pytest.mark.serial,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]

STEPS, M, MBS, SEQ = 3, 2, 2, 16


def _plan(tmp: Path, name: str, *, dp: int = 1, tp: int = 1, devices: int = 2, per_node: int = 1) -> Path:
    from engine.io import save_plan
    from engine.plan import make_plan

    res = make_plan("llama-tiny", devices=devices, dp=dp, tp=tp, micro_batches=M, micro_batch_size=MBS, seq_len=SEQ,
                    device_type="cpu", inter_link="1gbit", devices_per_node=per_node)
    path = tmp / name / "plan.json"
    path.parent.mkdir(parents=True)
    save_plan(res.plan, path)
    return path


def _launch(cluster, plan: Path, *extra: str, timeout: float = 300.0):
    return run_on_node(cluster, 0, [sys.executable, "-m", "apps.cli", "launch", str(plan), "--address", cluster.ray,
                                    "--device", "cpu", "--steps", str(STEPS), "--json", *extra],
                       timeout=timeout, capture_output=True, text=True, cwd=ROOT)


def _reference(plan_path: Path) -> list[float]:
    from engine.io import load_plan
    from engine.models import task_for_plan
    from runtime.reference import reference_losses

    plan = load_plan(plan_path)
    task = task_for_plan(plan, seed=0)
    batches = [tuple(task.train_batch(s, plan.parallel.dp * M * MBS)) for s in range(STEPS)]
    return [sum(r) / len(r) for r in reference_losses(plan, batches)]


def test_dp2_and_pp2_across_two_nodes_train_like_one_process(tmp_path):
    plans = {"dp2": _plan(tmp_path, "dp2", dp=2), "pp2": _plan(tmp_path, "pp2")}
    with emulated_cluster("1gbit", cpus_per_node=1) as cluster:
        for name, path in plans.items():
            trace = tmp_path / name / "trace.measured.json"
            p = _launch(cluster, path, "--trace", str(trace))
            assert p.returncode == 0, f"{name}: {p.stderr[-2000:]}"
            out = json.loads(p.stdout.strip().splitlines()[-1])
            torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(_reference(path)), rtol=1e-4,
                                       atol=1e-5, msg=name)
            placed = {row["rank"]: (row["node"], row["address"]) for row in out["rank_nodes"]}
            assert placed == {0: (0, cluster.addresses[0]), 1: (1, cluster.addresses[1])}, name
            assert f"node 0 ({cluster.addresses[0]}): rank 0; node 1 ({cluster.addresses[1]}): rank 1" in p.stdout
            meta = json.loads(trace.read_text())["metadata"]
            assert [r["address"] for r in meta["rank_nodes"]] == list(cluster.addresses), name


def test_tensor_groups_stay_inside_a_node_and_too_few_nodes_are_refused(tmp_path):
    """tp 2 x pp 2 on two nodes of two CPUs (devices per node 2): world ranks ``(d*tp + t)*pp + p``
    put pipeline rank p's two tensor ranks on node p. A plan of four nodes is refused before any
    actor starts, naming both counts."""
    tp2pp2 = _plan(tmp_path, "tp2pp2", tp=2, devices=4, per_node=2)
    four = _plan(tmp_path, "four", dp=4, devices=4, per_node=1)
    with emulated_cluster("1gbit", cpus_per_node=2) as cluster:
        p = _launch(cluster, tp2pp2)
        assert p.returncode == 0, p.stderr[-2000:]
        out = json.loads(p.stdout.strip().splitlines()[-1])
        node = {row["rank"]: row["node"] for row in out["rank_nodes"]}
        # world rank w = (d * tp + t) * pp + p (runtime.worker): ranks 0, 2 are pipeline rank 0
        assert node == {0: 0, 2: 0, 1: 1, 3: 1}
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(_reference(tp2pp2)), rtol=1e-4,
                                   atol=1e-5)
        p = _launch(cluster, four, timeout=120)
        assert p.returncode != 0
        err = p.stderr.strip().splitlines()[-1]
        assert "on 4 nodes of 1 devices" in err and "has 2 alive nodes" in err, err


def test_a_lost_node_ends_the_launch_naming_it_and_resume_continues_exactly(tmp_path):
    """dp 2 over two nodes, a checkpoint every 2 steps: once step 2's checkpoint exists the worker
    node's raylet is killed. The launch ends with exit status 3 within 30 s, in one sentence
    naming the node and its rank; the checkpoint is intact; with the node back, ``--resume``
    continues and every step's loss equals the uninterrupted single-process run."""
    import subprocess
    import time

    from emulated_cluster import kill_raylet, restart_node

    from runtime import checkpoint as ck

    steps = 6
    plan = _plan(tmp_path, "dp2", dp=2)
    ckdir = tmp_path / "ckpt"
    with emulated_cluster("1gbit", cpus_per_node=1) as cluster:
        cmd = ["ip", "netns", "exec", cluster.namespaces[0], sys.executable, "-m", "apps.cli", "launch", str(plan),
               "--address", cluster.ray, "--device", "cpu", "--steps", str(steps), "--checkpoint-dir", str(ckdir),
               "--checkpoint-every", "2", "--eval-every", "0", "--json"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env={**os.environ, **cluster.env()})
        try:
            deadline = time.monotonic() + 240
            while not (ckdir / "step_000002").is_dir() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert (ckdir / "step_000002").is_dir(), proc.communicate(timeout=60)
            assert kill_raylet(cluster, 1)
            t0 = time.monotonic()
            out, err = proc.communicate(timeout=120)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 3, err[-2000:]
        last = err.strip().splitlines()[-1]
        # lost in a step, or in the step-4 checkpoint when the launch got there first (both name the node)
        assert re.search(rf"node 1 \({re.escape(cluster.addresses[1])}\) was lost during (checkpointing at )?step",
                         last) and "rank 1 ran there" in last, last
        assert took < 30, f"the launch took {took:.1f} s to end after the node was lost"
        print(f"\nnode lost: the launch ended {took:.1f} s later, exit {proc.returncode}: {last}")
        kept = ck.list_checkpoints(ckdir)
        assert kept and kept[-1].name in ("step_000002", "step_000004")
        ck.load_checkpoint(kept[-1])   # verified on load: intact
        restart_node(cluster, 1)
        p = run_on_node(cluster, 0, [sys.executable, "-m", "apps.cli", "launch", str(plan), "--address", cluster.ray,
                                     "--device", "cpu", "--steps", str(steps), "--checkpoint-dir", str(ckdir),
                                     "--checkpoint-every", "2", "--eval-every", "0", "--resume", "--json"],
                        timeout=300, capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    from engine.io import load_plan
    from engine.models import task_for_plan
    from runtime.reference import reference_losses

    loaded = load_plan(plan)
    task = task_for_plan(loaded, seed=0)
    ref = [sum(r) / len(r) for r in reference_losses(loaded, [tuple(task.train_batch(s, 2 * M * MBS))
                                                               for s in range(steps)])]
    start = res["start_step"]
    assert start in (2, 4)
    got = res["losses"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref if len(got) == steps else ref[start:]), rtol=1e-4,
                               atol=1e-5)
