"""The stage worker's CUDA + NCCL path.

GPU tests (skipped unless 2 CUDA GPUs are visible: NCCL point-to-point needs one GPU per rank):

- a 2-rank 1F1B run with ``backend="nccl"``, ``device="cuda:<rank>"`` (plain spawned processes
  of the shared ``worker_harness.WorkerPool``) equals the single-process CPU reference
  (``rtol=2e-4``; TF32 is switched off in the ranks, ``torch.backends.cuda.matmul.allow_tf32 =
  False``, since TF32 matmuls round inputs to 10 mantissa bits and would differ by ~1e-3), with
  ordered p2p matching, CPU checkpoints, CUDA memory samples, and a checkpoint round trip;
- a Ray launch with ``device="cuda"`` (NCCL, ``num_gpus=1`` actors) trains like a gloo launch.

CPU tests (always run) of the plumbing around it: ``choose_backend`` with and without (mocked)
GPUs, the launcher handing ``device="cuda"`` to its workers exactly when the backend is NCCL,
moving a stage module (and its traced inner module) to another device, and the send waiter's
``is_completed()`` polling used on CUDA.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
from test_worker import STEPS, M, _batches, _plan, _reference
from worker_harness import WorkerPool

from engine.timeline import Event

N_GPUS = torch.cuda.device_count()
needs_2_gpus = pytest.mark.skipif(
    N_GPUS < 2, reason=f"needs 2 CUDA GPUs (NCCL point-to-point between two ranks); this machine has {N_GPUS}")


# ----------------------------------------------------------------------------- CPU: backend choice
@pytest.fixture
def fake_ray(monkeypatch):
    """``runtime.cluster``'s view of a running Ray cluster with the given resources (no Ray started)."""
    from runtime import cluster

    def set_resources(res: dict):
        monkeypatch.setattr(cluster.ray, "is_initialized", lambda: True)
        monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: dict(res))

    monkeypatch.delenv("TESSEL_DEVICE", raising=False)
    return set_resources


def test_choose_backend_without_gpus_refuses_cuda(fake_ray):
    from runtime.cluster import ClusterError, choose_backend

    fake_ray({"CPU": 2.0})
    with pytest.raises(ClusterError, match=r"device 'cuda' needs 2 GPUs \(one per rank\) but the Ray cluster has 0"):
        choose_backend(2, "cuda")
    assert choose_backend(2).name == "gloo" and not choose_backend(2).use_gpu


def test_choose_backend_with_gpus_gives_nccl(fake_ray, monkeypatch):
    from runtime import cluster
    from runtime.cluster import ClusterError, choose_backend

    assert cluster.WORKER_SUPPORTS_CUDA
    fake_ray({"CPU": 16.0, "GPU": 4.0})
    for dev in ("auto", "cuda"):
        b = choose_backend(4, dev)
        assert b.name == "nccl" and b.use_gpu
        assert b.bundle()["GPU"] == 1 and b.actor_options()["num_gpus"] == 1
    assert choose_backend(8).name == "gloo"            # not one GPU per rank: auto stays on CPU
    with pytest.raises(ClusterError, match="needs 8 GPUs"):
        choose_backend(8, "cuda")
    assert choose_backend(4, "cpu").name == "gloo"
    monkeypatch.setenv("TESSEL_DEVICE", "cpu")
    assert choose_backend(4).name == "gloo"
    monkeypatch.delenv("TESSEL_DEVICE")
    monkeypatch.setattr(cluster, "WORKER_SUPPORTS_CUDA", False)   # the switch still works
    assert choose_backend(4).name == "gloo"
    with pytest.raises(ClusterError, match="--device cpu"):
        choose_backend(4, "cuda")


@pytest.mark.parametrize("backend,p2p", [("nccl", None), ("gloo", None), ("gloo", "ordered")])
def test_launcher_passes_the_device_to_its_workers(monkeypatch, backend, p2p):
    """The launcher builds workers with ``device="cuda"`` exactly when the backend is NCCL (and a
    gloo launch passes neither ``device`` nor ``p2p_matching`` unless asked: custom worker classes
    keep their constructor)."""
    from runtime import cluster, launcher
    from runtime.config import LaunchConfig

    seen = {}

    def fake_create(worker_cls, ws, b, args_for_rank, timeout):
        seen["args"] = [args_for_rank(r, "10.0.0.1", 1234) for r in range(ws)]
        raise cluster.ClusterError("stop here: no Ray in this test")

    monkeypatch.setattr(cluster, "init_ray", lambda address=None, **kw: False)
    monkeypatch.setattr(cluster, "choose_backend",
                        lambda ws, device="auto": cluster.Backend(backend, backend == "nccl"))
    monkeypatch.setattr(cluster, "create_actors", fake_create)
    monkeypatch.delenv("TESSEL_P2P", raising=False)
    with pytest.raises(launcher.LaunchError, match="stop here"):
        launcher.launch(_plan(2, "1f1b"), LaunchConfig(steps=1, p2p_matching=p2p))
    for r, (args, kw) in enumerate(seen["args"]):
        cfg = kw["config"]   # a runtime.worker.WorkerConfig; unset options keep their defaults
        assert args[1] == r and args[2] == 2 and cfg.backend == backend
        assert cfg.device == ("cuda" if backend == "nccl" else None)
        assert cfg.p2p_matching == (p2p or "auto")
    with pytest.raises(launcher.LaunchError, match="unknown p2p_matching 'fifo'"):
        launcher.launch(_plan(2, "1f1b"), LaunchConfig(steps=1, p2p_matching="fifo"))


# ----------------------------------------------------------------------------- CPU: device plumbing
def test_module_to_moves_the_inner_graph_module_and_keeps_slots_linked():
    """``_module_to`` on a StageModule-like wrapper (the inner module's own parameter and buffer
    registered on the outer one too, a plain tensor constant on the inner one), to ``meta``."""
    from torch import nn

    from runtime.worker.device import module_to as _module_to

    inner = nn.Module()
    inner.w = nn.Parameter(torch.ones(3))
    inner.register_buffer("b", torch.zeros(2))
    inner.child = nn.Linear(2, 2)
    inner.const = torch.arange(4.0)        # traced constant: neither parameter nor buffer
    outer = nn.Module()
    object.__setattr__(outer, "inner", inner)
    outer.add_module("child", inner.child)
    outer.register_parameter("w", inner.w)
    outer.register_buffer("b", inner.b)
    meta = torch.device("meta")
    _module_to(outer, meta)
    tensors = list(outer.parameters()) + list(outer.buffers()) + list(inner.parameters()) + list(inner.buffers())
    tensors.append(inner.const)
    assert all(t.device == meta for t in tensors)
    assert outer.w is inner.w and outer.b is inner.b and outer.child is inner.child

    # the real stage modules: nothing reachable stays on the CPU
    from runtime.stages import build_stages

    st = build_stages(_plan(2, "1f1b"), seed=0)
    for m in st.modules.values():
        _module_to(m, meta)
        for root in (m, m.inner):
            for sub in root.modules():
                for t in list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False)) + [
                        v for v in vars(sub).values() if isinstance(v, torch.Tensor)]:
                    assert t.device == meta


def test_retargeted_stages_run_on_another_device():
    """The traced graphs create tensors with ``device=cpu`` (GPT-2's position ``arange``,
    ``_assert_tensor_metadata``): moved to another device (``meta`` stands in for a GPU) the stage
    forward fails until :func:`runtime.stages.tracer_split.retarget_device` rewrites those arguments."""
    from runtime.stages import build_stages, retarget_device
    from runtime.worker.device import module_to as _module_to

    st = build_stages(_plan(2, "1f1b"), seed=0)
    meta = torch.device("meta")
    ids = torch.zeros(st.inputs[0].shape, dtype=torch.long, device=meta)
    for m in st.modules.values():
        _module_to(m, meta)
    with pytest.raises((RuntimeError, NotImplementedError)):
        st.modules[1](*st.modules[0](ids))
    assert sum(retarget_device(m, meta) for m in st.modules.values()) > 0
    out = st.modules[1](*st.modules[0](ids))[0]
    assert out.device == meta and tuple(out.shape) == st.output.shape
    # nothing left naming the CPU, and a second pass rewrites nothing
    assert sum(retarget_device(m, meta) for m in st.modules.values()) == 0


class _FakeWork:
    """A work handle that completes after ``polls`` calls of ``is_completed()``."""

    def __init__(self, polls: int, error: Exception | None = None):
        self.polls, self.calls, self.error, self.waited = polls, 0, error, False

    def is_completed(self) -> bool:
        self.calls += 1
        return self.calls > self.polls

    def wait(self, timeout=None) -> bool:
        self.waited = True
        if self.error is not None:
            raise self.error
        return True


def test_poll_completion_and_the_cuda_send_waiter():
    from runtime.worker.send_waiter import SendWaiter as _SendWaiter
    from runtime.worker.send_waiter import poll_completion

    w = _FakeWork(5)
    assert poll_completion(w, 5.0) >= 0 and w.calls == 6
    with pytest.raises(TimeoutError, match="did not complete within 0.01 s"):
        poll_completion(_FakeWork(10 ** 9), 0.01)

    # device given: the waiter polls is_completed() (never blocks on wait() first), then wait()s
    t0 = time.perf_counter()
    now = lambda: time.perf_counter() - t0   # noqa: E731
    waiter = _SendWaiter(now, timedelta(seconds=5), device=torch.device("meta"))
    works = [[_FakeWork(3), _FakeWork(0)], [_FakeWork(20)]]
    evs = [Event(0, "send", "SEND", f"0F{i}>1", now(), -1.0, 4, i, 0) for i in range(2)]
    for ws, ev in zip(works, evs):
        waiter.add(ws, [], ev)
    waiter.close()
    assert all(w.waited and w.calls == w.polls + 1 for ws in works for w in ws)
    assert 0 <= evs[0].start <= evs[0].end <= evs[1].end
    failing = _SendWaiter(now, timedelta(seconds=5), device=torch.device("meta"))
    failing.add([_FakeWork(0, RuntimeError("NCCL error: remote process exited"))], [], evs[0])
    with pytest.raises(RuntimeError, match="remote process exited"):
        failing.close()


# ----------------------------------------------------------------------------- GPU: 2 ranks, NCCL
def _run_cuda_task(task: dict) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from runtime.worker import StageWorker, WorkerConfig

    w = StageWorker(task["plan"], task["rank"], task["world"], "127.0.0.1", task["port"],
                    config=WorkerConfig(backend="nccl", device=task["device"], timeout_s=60.0))
    try:
        info = w.setup()
        outs = [w.step(i, b) for i, b in enumerate(task["batches"])]
        ev = w.evaluate(task["batches"][0])
        sd = w.state_dict()
        w.load_state_dict(sd)   # CPU tensors back onto the GPU
        again = w.state_dict()
        return {"info": info, "steps": outs, "eval": ev, "state": sd,
                "reloaded": all(torch.equal(sd["segments"][s][k], again["segments"][s][k])
                                for s in sd["segments"] for k in sd["segments"][s]),
                "param_devices": sorted({str(p.device) for s in w.segments for p in w.seg_params[s]}),
                "state_devices": sorted({str(v.device) for s in sd["segments"].values() for v in s.values()}
                                        | {str(v.device) for st in (sd["optimizer"] or {}).get("state", {}).values()
                                           for v in st.values() if isinstance(v, torch.Tensor)})}
    finally:
        w.shutdown()


@needs_2_gpus
@pytest.mark.timeout(600)
def test_two_rank_1f1b_on_cuda_matches_the_cpu_reference():   # pragma: no cover - needs GPUs
    plan = _plan(2, "1f1b")
    batches = _batches(1)
    pool = WorkerPool(2)
    try:
        out = pool.run_ok("test_cuda_worker:_run_cuda_task", {"plan": plan.to_dict(), "batches": batches},
                          world=2, per_rank={r: {"device": f"cuda:{r}"} for r in range(2)})
    finally:
        pool.close()
    ref = _reference(plan, batches, 1)
    last = out[1]
    got = [s["losses"] for s in last["steps"]]
    assert len(got) == STEPS and all(len(g) == M for g in got)
    for step, (g, r) in enumerate(zip(got, ref)):
        assert torch.allclose(torch.tensor(g), torch.tensor(r), rtol=2e-4, atol=1e-6), (step, g, r)
    for r, p in out.items():
        assert p["info"]["backend"] == "nccl" and p["info"]["p2p_matching"] == "ordered"
        assert p["info"]["device"] == f"cuda:{r}" and p["param_devices"] == [f"cuda:{r}"]
        assert p["state_devices"] == ["cpu"] and p["reloaded"]
        for s in p["steps"]:
            assert s["peak_device_memory"] > 0 and len(s["device_memory"]) == len(s["memory"])
            assert all(0 <= e["start"] <= e["end"] <= s["time"] + 1e-6 for e in s["events"])
    assert isinstance(last["eval"], float) and out[0]["eval"] is None


@needs_2_gpus
@pytest.mark.timeout(900)
def test_ray_launch_on_cuda(ray_local, tmp_path):   # pragma: no cover - needs GPUs
    from runtime.config import LaunchConfig
    from runtime.launcher import launch

    if ray_local.cluster_resources().get("GPU", 0) < 2:
        pytest.skip("the Ray cluster has fewer than 2 GPUs")
    plan = _plan(2, "1f1b")
    gpu = launch(plan, LaunchConfig(steps=2, device="cuda", checkpoint_dir=tmp_path / "gpu", step_timeout=300))
    cpu = launch(plan, LaunchConfig(steps=2, device="cpu", step_timeout=300))
    assert gpu.backend == "nccl" and cpu.backend == "gloo"
    assert torch.allclose(torch.tensor(gpu.losses), torch.tensor(cpu.losses), rtol=1e-3)
    assert gpu.timeline is not None and gpu.timeline.events
    from runtime import checkpoint as ck

    c = ck.load_checkpoint(ck.latest_checkpoint(tmp_path / "gpu"), plan=plan, world_size=2)
    stored = c.rank_state(0, map_location=None)   # as written: the workers handed over CPU tensors
    assert all(v.device.type == "cpu" for s in stored["segments"].values() for v in s.values())


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([os.path.abspath(__file__), "-q"]))
