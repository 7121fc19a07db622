"""The Ray launcher: exact losses, resume, faults (raise / die / hang), atomic checkpoints.

Real launches use gpt2-tiny on 2 pipeline ranks (1F1B, 4 micro-batches of 2 x 32 tokens) on the
CPU/gloo path; the death and hang cases use a tiny stand-in worker (same interface, no model) so
they cost seconds. One local Ray cluster is shared by the tests that want one and shut down at
the end of the module; the fault test with the real worker lets the launcher own Ray, to check
that it shuts it down and leaves no processes behind.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from fake_worker import FakeWorker, pickle_by_value  # noqa: E402
from ray_processes import ray_child_processes  # noqa: E402
from tessel_run import run_tessel  # noqa: E402

from engine.errors import TesselError  # noqa: E402
from engine.plan import make_plan  # noqa: E402
from runtime import LaunchError, LaunchResult, launch  # noqa: E402
from runtime import checkpoint as ck  # noqa: E402
from runtime.cluster import TINY_CPU, choose_backend, init_ray  # noqa: E402
from runtime.config import LaunchConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SEQ, MBS, M = 32, 2, 4


@pytest.fixture(scope="module")
def plan():
    return make_plan("gpt2-tiny", devices=2, micro_batches=M, schedule="1f1b", device_type="cpu",
                     seq_len=SEQ, micro_batch_size=MBS).plan


@pytest.fixture(scope="module")
def _ray_module():
    yield
    ray.shutdown()


def _ensure_ray() -> None:
    init_ray()
    # pickle the stand-in workers by value, so Ray's worker processes need not import the tests
    pickle_by_value(sys.modules[__name__])


@pytest.fixture
def ray_cluster(_ray_module):
    """A shared local Ray cluster (started on first use, shut down after the module)."""
    _ensure_ray()
    yield


@pytest.fixture
def no_ray():
    """No Ray in this process: the launcher starts (and must shut down) its own."""
    if ray.is_initialized():
        ray.shutdown()
    yield
    if ray.is_initialized():
        ray.shutdown()


def _alive_actors() -> list[dict]:
    from ray._private import state

    return [a for a in state.actors().values() if a.get("State") != "DEAD"]


def _ray_children() -> list[str]:
    return ray_child_processes()


# ----------------------------------------------------------------------------- real launches
@pytest.fixture(scope="module")
def straight(plan, _ray_module, tmp_path_factory):
    """4 steps in one launch, checkpoints every 2 steps."""
    _ensure_ray()
    d = tmp_path_factory.mktemp("straight")
    t0 = time.perf_counter()
    res = launch(plan, LaunchConfig(steps=4, checkpoint_dir=d / "ckpt", checkpoint_every=2, eval_every=2,
                                    trace_path=d / "trace.measured.json", step_timeout=120))
    return res, d, time.perf_counter() - t0


@pytest.mark.timeout(400)
def test_losses_equal_single_process_reference(straight, plan):
    from runtime.data import ByteCorpus
    from runtime.reference import reference_losses

    res, d, _ = straight
    assert isinstance(res, LaunchResult) and res.backend == "gloo" and res.world_size == 2
    corpus = ByteCorpus(seq_len=SEQ)
    ref = reference_losses(plan, [corpus.train_batch(s, M * MBS) for s in range(4)])
    expected = [sum(r) / len(r) for r in ref]
    assert len(res.losses) == 4
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(expected), rtol=1e-4, atol=1e-5)
    assert res.losses[-1] < res.losses[0]
    # evaluation at steps 2 and 4, measured timeline over both pipeline ranks, trace written
    assert [s for s, _ in res.val_losses] == [2, 4] and all(v > 0 for _, v in res.val_losses)
    tl = res.timeline
    assert tl.source == "measured" and tl.num_devices == 2
    assert {e.rank for e in tl.events} == {0, 1}
    assert sum(1 for e in tl.events if e.op == "F") == 2 * M and sum(1 for e in tl.events if e.op == "B") == 2 * M
    assert all(t > 0 for t in res.measured_step_time) and all(t > 0 for t in res.predicted_step_time)
    assert res.tokens_per_step == M * MBS * SEQ and res.tokens_per_second > 0
    # a dense model has no MoE gate metrics and no all-to-alls
    assert res.moe == [] and "moe" not in res.to_dict() and not any(e.op == "ALLTOALL" for e in tl.events)
    assert Path(res.trace_paths["measured"]).is_file()
    assert Path(res.checkpoint).name == "step_000004"
    # every step's measured timeline is kept (up to keep_timelines); the last one is res.timeline
    assert len(res.timelines) == 4 and res.timelines[-1] is tl and "timelines" not in res.to_dict()
    assert [p.name for p in ck.list_checkpoints(d / "ckpt")] == ["step_000002", "step_000004"]


@pytest.mark.timeout(400)
@pytest.mark.serial
def test_calibration_from_measured_steps_predicts_them(straight, plan):
    """Profile-guided prediction: blocks take their measured median durations, so the
    calibrated plan's compute per rank matches what was measured (the makespan still depends
    on the simulator's model of waits and communication)."""
    from engine.cost.calibrate import calibrate
    from engine.plan import with_calibration

    res, _, _ = straight
    cal = calibrate(res.timelines[1:])
    assert cal.steps == 3 and set(cal.block_seconds) == {(0, "F"), (0, "B"), (1, "F"), (1, "B")}
    assert cal.optimizer_seconds_per_byte and cal.optimizer_seconds_per_byte > 0
    new, tl = with_calibration(plan, cal)
    assert new.meta["calibration"]["steps"] == 3
    for r in range(2):
        measured_busy = sorted(t.busy_time(r) for t in res.timelines[1:])[1]   # median of 3
        assert tl.busy_time(r) == pytest.approx(measured_busy, rel=0.5)
    assert tl.makespan != pytest.approx(plan.metrics["makespan"], rel=1e-3)   # the roofline plan predicted otherwise


@pytest.mark.timeout(400)
def test_resume_gives_the_same_final_loss(straight, plan, ray_cluster, tmp_path):
    res4, _, _ = straight
    first = launch(plan, LaunchConfig(steps=2, checkpoint_dir=tmp_path))
    assert first.losses == pytest.approx(res4.losses[:2], rel=1e-6)
    second = launch(plan, LaunchConfig(steps=4, checkpoint_dir=tmp_path, resume=True))
    assert second.start_step == 2 and len(second.losses) == 2
    # same model, optimizer state and data position: the same losses as the straight run
    assert second.losses == pytest.approx(res4.losses[2:], rel=1e-5, abs=1e-6)
    meta = ck.load_checkpoint(tmp_path).meta
    assert [s for s, _ in meta["losses"]] == [0, 1, 2, 3]


def test_resume_with_another_plan_is_refused_before_starting(straight, tmp_path):
    _, d, _ = straight
    other = make_plan("gpt2-tiny", devices=2, micro_batches=M, schedule="gpipe", device_type="cpu",
                      seq_len=SEQ, micro_batch_size=MBS).plan
    with pytest.raises(ck.CheckpointError, match="was written for plan .* but this plan is"):
        launch(other, LaunchConfig(steps=6, checkpoint_dir=d / "ckpt", resume=True))


@pytest.mark.parametrize("field,value", [
    ("keep_checkpoints", 0), ("keep_checkpoints", -1), ("checkpoint_every", -1), ("eval_every", -2),
    ("keep_timelines", -1), ("step_timeout", 0), ("step_timeout", -5.0), ("step_timeout", float("nan")),
])
def test_out_of_range_settings_are_refused_before_ray_starts(plan, field, value):
    """Values that would silently do something else (keep every checkpoint, never time out, ...)
    are a setup error naming the field, for one plan and (where the field exists) co-located jobs."""
    from runtime.config import CrossoverConfig
    from runtime.runner import CrossoverLaunchError

    with pytest.raises(LaunchError, match=field) as info:
        launch(plan, LaunchConfig(steps=1, **{field: value}))
    assert info.value.kind == "setup"
    if field != "keep_timelines":
        with pytest.raises(CrossoverLaunchError, match=field) as cinfo:
            CrossoverConfig(**{field: value}).validate()
        assert cinfo.value.kind == "setup"
    LaunchConfig(keep_checkpoints=None, checkpoint_every=0, eval_every=0, keep_timelines=0).validate()  # the limits


@pytest.mark.timeout(300)
def test_fault_names_rank_and_instruction_and_cleans_up(plan, no_ray, tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(LaunchError) as info:
        launch(plan, LaunchConfig(steps=4, checkpoint_dir=tmp_path, checkpoint_every=1, fail_at=(1, 1, 3),
                                  step_timeout=60))
    took = time.perf_counter() - t0
    e = info.value
    msg = str(e)
    assert isinstance(e, TesselError)
    assert e.rank == 1 and e.step == 1 and e.kind == "raised"
    assert msg.startswith("rank 1 failed during step 1 in instruction 3 (") and "deliberate failure" in msg
    assert e.instruction.startswith("3 (")
    # the last checkpoint (after step 1) is kept and named
    assert e.checkpoint and Path(e.checkpoint).name == "step_000001" and e.checkpoint in msg
    assert ck.latest_checkpoint(tmp_path).name == "step_000001"
    assert took < 120, f"the fault took {took:.0f} s to surface"
    # the launcher owned Ray: it is shut down and its processes are gone
    assert not ray.is_initialized()
    deadline = time.monotonic() + 15
    while _ray_children() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ray_children() == []


@pytest.mark.timeout(120)
def test_dead_rank_is_named_and_actors_are_gone(plan, ray_cluster, tmp_path):
    with pytest.raises(LaunchError) as info:
        launch(plan, LaunchConfig(steps=3, checkpoint_dir=tmp_path, checkpoint_every=1, fail_at=(1, 2, 0),
                                  step_timeout=30), worker_cls=FakeWorker)
    e = info.value
    assert e.kind == "died" and e.rank == 1 and e.step == 2
    assert str(e).startswith("rank 1 died during step 2")
    assert Path(e.checkpoint).name == "step_000002"
    assert _alive_actors() == []
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


@pytest.mark.timeout(120)
def test_hung_rank_is_named_within_the_step_timeout(plan, ray_cluster, tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(LaunchError) as info:
        launch(plan, LaunchConfig(steps=3, checkpoint_dir=tmp_path, fail_at=(1, 1, 1),
                                  step_timeout=3), worker_cls=FakeWorker)
    assert time.perf_counter() - t0 < 60
    e = info.value
    assert e.kind == "hung" and e.rank == 1 and e.step == 1
    assert str(e).startswith("rank 1 gave no result for step 1 within 3 s")
    assert _alive_actors() == []


def test_four_ranks_share_two_cores(plan, ray_cluster, tmp_path):
    """More ranks than cores: zero-ish CPU bundles let every actor start (fake worker, 4 ranks, dp=2)."""
    p4 = make_plan("gpt2-tiny", devices=4, dp=2, micro_batches=M, schedule="1f1b", device_type="cpu",
                   seq_len=SEQ, micro_batch_size=MBS).plan
    res = launch(p4, LaunchConfig(steps=2, step_timeout=30), worker_cls=FakeWorker)
    assert res.world_size == 4 and res.dp == 2 and res.pp == 2
    assert res.losses == pytest.approx([5.0, 4.9])  # mean over both replicas' micro-batches
    assert res.val_losses == [(2, 4.0)]
    assert _alive_actors() == []


def test_backend_choice_and_bundles(ray_cluster):
    b = choose_backend(4, "cpu")
    assert b.name == "gloo" and not b.use_gpu and b.bundle() == {"CPU": TINY_CPU}
    assert b.actor_options()["num_cpus"] == TINY_CPU
    if ray.cluster_resources().get("GPU", 0) < 1:
        assert choose_backend(1).name == "gloo"
        with pytest.raises(TesselError, match="needs 2 GPUs"):
            choose_backend(2, "cuda")


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"needs 2 CUDA GPUs (one NCCL rank each); this machine has {torch.cuda.device_count()}")
@pytest.mark.timeout(400)
def test_gpu_clusters_launch_with_nccl(plan, ray_cluster, tmp_path):  # pragma: no cover
    if ray.cluster_resources().get("GPU", 0) < 2:
        pytest.skip("the Ray cluster has fewer than 2 GPUs")
    assert choose_backend(2).name == "nccl"   # auto picks NCCL with one GPU per rank
    assert choose_backend(2, "cpu").name == "gloo"
    res = launch(plan, LaunchConfig(steps=2))
    assert res.backend == "nccl" and len(res.losses) == 2


# ----------------------------------------------------------------------------- checkpoints
def test_checkpoint_roundtrip_and_plan_hash(plan, tmp_path):
    states = [{"w": torch.arange(3.0)}, {"w": torch.ones(2)}]
    rngs = [ck.capture_rng(), None]
    p = ck.save_checkpoint(tmp_path, 5, states, rngs, plan=plan, extra={"losses": [[0, 1.0]]})
    assert p.name == "step_000005" and ck.latest_checkpoint(tmp_path) == p
    c = ck.load_checkpoint(tmp_path, plan=plan, world_size=2)
    assert c.step == 5 and c.world_size == 2 and c.meta["losses"] == [[0, 1.0]]
    assert torch.equal(c.rank_state(0)["w"], torch.arange(3.0)) and c.rank_rng(1) is None
    assert set(c.rank_rng(0)) >= {"python", "torch"}
    other = make_plan("gpt2-tiny", devices=2, micro_batches=M + 2, schedule="1f1b", device_type="cpu",
                      seq_len=SEQ, micro_batch_size=MBS).plan
    assert ck.plan_hash(other) != ck.plan_hash(plan) == ck.plan_hash(plan.to_dict())
    with pytest.raises(ck.CheckpointError,
                       match=f"written for plan {ck.plan_hash(plan)} but this plan is {ck.plan_hash(other)}"):
        ck.load_checkpoint(p, plan=other)
    with pytest.raises(ck.CheckpointError, match="has 2 ranks but this launch has 4"):
        ck.load_checkpoint(p, world_size=4)
    # keep=2 prunes the oldest; rewriting an existing step replaces it
    ck.save_checkpoint(tmp_path, 6, states, plan=plan)
    ck.save_checkpoint(tmp_path, 7, states, plan=plan)
    ck.save_checkpoint(tmp_path, 7, [{"w": torch.zeros(1)}, {"w": torch.zeros(1)}], plan=plan)
    assert [x.name for x in ck.list_checkpoints(tmp_path)] == ["step_000006", "step_000007"]
    assert torch.equal(ck.load_checkpoint(tmp_path).rank_state(0)["w"], torch.zeros(1))
    assert [x.name for x in tmp_path.iterdir() if x.name.startswith(".")] == []


def test_interrupted_checkpoint_leaves_no_partial_directory(plan, tmp_path):
    good = ck.save_checkpoint(tmp_path, 2, [{"w": torch.ones(1)}] * 2, plan=plan)

    def failing(r):
        if r == 1:
            raise OSError("disk full (simulated)")
        return {"w": torch.ones(1)}

    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(tmp_path, 4, failing, plan=plan, world_size=2)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["step_000002"]
    assert ck.latest_checkpoint(tmp_path) == good


@pytest.mark.timeout(120)
def test_killed_checkpoint_writer_leaves_no_partial_directory(plan, tmp_path):
    """A process killed between writing the files and the rename (os._exit) leaves only a hidden
    temporary directory: readers never see it and the next save removes it."""
    from engine.io import save_plan

    save_plan(plan, tmp_path / "plan.json")
    ckdir = tmp_path / "ckpt"
    good = ck.save_checkpoint(ckdir, 2, [{"w": torch.ones(1)}] * 2, plan=plan)
    script = textwrap.dedent(f"""
        import os, torch
        from engine.io import load_plan
        from runtime import checkpoint as ck
        plan = load_plan({str(tmp_path / 'plan.json')!r})
        ck.save_checkpoint({str(ckdir)!r}, 4, [{{"w": torch.ones(1)}}] * 2, plan=plan,
                           _before_replace=lambda tmp: os._exit(9))
    """)
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert p.returncode == 9, p.stderr
    names = sorted(x.name for x in ckdir.iterdir())
    assert "step_000004" not in names and any(n.startswith(".tmp-step_000004") for n in names)
    assert ck.latest_checkpoint(ckdir) == good
    ck.save_checkpoint(ckdir, 3, [{"w": torch.ones(1)}] * 2, plan=plan)
    assert sorted(x.name for x in ckdir.iterdir()) == ["step_000002", "step_000003"]


# ----------------------------------------------------------------------------- CLI
@pytest.mark.timeout(400)
def test_cli_launch_json_and_resume_errors(tmp_path):
    import json

    def tessel(*args):
        return run_tessel(*args, timeout=350)

    p = tessel("plan", "--model", "gpt2-tiny", "--devices", "2", "--micro-batches", str(M), "--schedule", "1f1b",
               "--device-type", "cpu", "--seq-len", str(SEQ), "--micro-batch-size", str(MBS), "-o", str(tmp_path))
    assert p.returncode == 0, p.stderr
    p = tessel("launch", str(tmp_path / "plan.json"), "--steps", "2", "--json", "--calibrate")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    # --calibrate: the plan calibrated from the measured step (the first is kept: only two ran)
    cal = res["calibration"]
    assert Path(cal["path"]) == tmp_path / "plan.calibrated.json" and cal["steps"] == 1
    assert cal["predicted_makespan"] > 0 and "calibrated from 1 measured step:" in p.stdout
    # the step residual: the one measured step over the transferred prediction, said and saved
    assert set(cal["step_residual"]) == {"whole"} and cal["step_residual"]["whole"] > 0
    assert f"step residual x{cal['step_residual']['whole']:.2f} (whole backward" in p.stdout
    assert "calibration" in json.loads((tmp_path / "plan.calibrated.json").read_text())["meta"]
    assert res["ok"] and res["steps"] == 2 and len(res["losses"]) == 2 and res["backend"] == "gloo"
    assert res["loss_end"] == res["losses"][-1] and res["val_loss"] > 0 and res["tokens_per_second"] > 0
    assert len(res["predicted_step_time"]) == len(res["measured_step_time"]) == 2
    assert "measured step" in p.stdout and "tokens/s measured" in p.stdout
    assert Path(res["trace_paths"]["measured"]) == tmp_path / "trace.measured.json"
    assert Path(res["trace_paths"]["predicted"]) == tmp_path / "trace.json"
    assert Path(res["checkpoint"]) == tmp_path / "ckpt" / "step_000002"
    trace = json.loads((tmp_path / "trace.measured.json").read_text())
    assert trace["metadata"]["source"] == "measured"
    # resuming a finished run is a user error: one sentence, exit status 2, before Ray starts
    p = tessel("launch", str(tmp_path / "plan.json"), "--steps", "2", "--resume", "--json")
    assert p.returncode == 2 and "already reached step 2" in p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1])["ok"] is False


@pytest.mark.timeout(400)
def test_cli_search_with_a_model_writes_a_plan_that_launch_trains(tmp_path):
    """``tessel search --model llama-tiny --placement m`` uses the model's costs, compares with the
    same model's plain pipeline (the ``(V)`` rows), and ``tessel launch`` trains the written plan
    (embedding and head tensor-parallel over both ranks) on Ray: losses fall, calibration works."""
    import json

    def tessel(*args):
        return run_tessel(*args, timeout=350)

    p = tessel("search", "--model", "llama-tiny", "--placement", "m", "--devices", "2", "--micro-batches", str(M),
               "--micro-batch-size", str(MBS), "--seq-len", str(SEQ), "--device-type", "cpu", "--time-limit", "5",
               "-o", str(tmp_path), "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert {"1f1b (V)", "zb-h1 (V)", "gpipe (V)", "interleaved (V)"} <= set(res["baselines"])
    assert "1f1b (V)" in p.stdout and "Traceback" not in p.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["model"]["name"] == "llama-tiny" and plan["model"]["split"] == "layers"
    assert plan["metrics"]["tokens_per_second"] > 0
    p = tessel("launch", str(tmp_path / "plan.json"), "--steps", "3", "--json", "--calibrate",
               "--checkpoint-every", "0")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["steps"] == 3 and out["losses"][-1] < out["losses"][0]
    assert out["calibration"]["predicted_makespan"] > 0
