"""``tessel launch`` under mistakes and faults (issue 20).

- plans that cannot train (device orders that deadlock, a backward before its forward, 10^6
  micro-batches declared without their orders) are one sentence and exit status 2 before any Ray
  work (``runtime.cluster.init_ray`` is made to fail the test if it is reached);
- ``--resume`` with a folder that does not exist or holds no checkpoint is refused the same way;
- with ``--json`` Ray's forwarded worker output goes to stderr and stdout ends with the object;
- Ctrl-C (SIGINT, sent by a worker to this process during step 2) finishes the step, checkpoints
  it, names the checkpoint and the command that resumes, and ends with status 130; that command
  resumes from it;
- a damaged newest checkpoint is skipped for the previous one; a rank that dies is a
  ``RunError`` (exit status 3).

The launches use gpt2-tiny's plan on 2 ranks with a stand-in worker (the ``StageWorker``
interface, no model), so each costs about a second after Ray is up; the CLI runs in-process.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import sys
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from fake_worker import FakeWorker, pickle_by_value  # noqa: E402

from apps import cli  # noqa: E402
from engine.errors import RunError  # noqa: E402
from engine.plan import make_plan  # noqa: E402
from runtime import checkpoint as ck  # noqa: E402
from runtime.cluster import init_ray  # noqa: E402
from runtime.config import LaunchConfig  # noqa: E402
from runtime.launcher import launch  # noqa: E402
from runtime.runner import LaunchFailure  # noqa: E402

M = 4


@pytest.fixture(scope="module")
def plan_dict(tmp_path_factory):
    plan = make_plan("gpt2-tiny", devices=2, micro_batches=M, schedule="1f1b", device_type="cpu", seq_len=16,
                     micro_batch_size=2).plan
    return plan.to_dict()


def _write(folder: Path, d: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "plan.json"
    path.write_text(json.dumps(d))
    return path


@pytest.fixture
def no_ray_work(monkeypatch):
    """Any attempt to start Ray fails the test."""
    from runtime import cluster

    def refuse(*a, **k):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(cluster, "init_ray", refuse)


# ----------------------------------------------------------------------------- refused before Ray
def _deadlock(d: dict) -> None:
    # device 1 starts with micro-batch 1's forward, which waits for device 0's 0F1, which device 0
    # runs only after 0B0, which waits for device 1's 1B0
    d["schedule"]["orders"][0] = ["0F0", "0B0", "0F1", "0F2", "0B1", "0F3", "0B2", "0B3"]
    d["schedule"]["orders"][1] = ["1F1", "1F0", "1B0", "1B1", "1F2", "1B2", "1F3", "1B3"]


def _backward_first(d: dict) -> None:
    order = d["schedule"]["orders"][1]
    i, j = order.index("1F0"), order.index("1B0")
    order[i], order[j] = order[j], order[i]


def _million(d: dict) -> None:
    d["parallel"]["micro_batches"] = 1_000_000


@pytest.mark.parametrize("edit,words", [
    (_deadlock, "the device orders deadlock"),
    (_backward_first, "block 1B0 on device 1 runs before 1F0"),
    (_million, "declares parallel.micro_batches = 1,000,000 but its schedule has 4 micro-batches"),
])
def test_a_plan_that_cannot_train_is_refused_before_ray(plan_dict, tmp_path, capsys, no_ray_work, edit, words):
    d = copy.deepcopy(plan_dict)
    edit(d)
    path = _write(tmp_path, d)
    assert cli.main(["launch", str(path), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert words in err and str(path) in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_resume_without_a_checkpoint_is_refused_before_ray(plan_dict, tmp_path, capsys, no_ray_work):
    path = _write(tmp_path, plan_dict)
    assert cli.main(["launch", str(path), "--resume", "--checkpoint-dir", str(tmp_path / "typo")]) == 2
    assert "checkpoint folder" in capsys.readouterr().err and not (tmp_path / "typo").exists()
    (tmp_path / "ckpt").mkdir()
    assert cli.main(["launch", str(path), "--resume"]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err


# ----------------------------------------------------------------------------- stand-in workers
class ChattyWorker(FakeWorker):
    """Prints to its stdout, which Ray forwards to the driver."""

    def setup(self):
        print(f"chatty worker {self.rank} says hello", flush=True)
        return super().setup()

    def step(self, step, batch):
        print(f"chatty worker {self.rank} at step {step}", flush=True)
        time.sleep(0.5)  # give Ray's log monitor time to forward the lines during the launch
        return super().step(step, batch)


def interrupting_worker(driver_pid: int) -> type:
    """A worker class whose rank 0 sends SIGINT to ``driver_pid`` in the middle of step 2, as Ctrl-C
    would. Made inside a function so cloudpickle ships it by value with the pid bound: a class
    imported by reference in the actor would read a default pid, and ``os.kill(0, ...)`` signals
    the whole process group (the test runner and its parents)."""
    if not driver_pid > 0:
        raise ValueError(f"driver_pid must be a process id, got {driver_pid}")

    class InterruptingWorker(FakeWorker):
        def step(self, step, batch):
            if step == 2 and self.rank == 0:
                import signal

                os.kill(driver_pid, signal.SIGINT)
                time.sleep(0.5)  # the step is still running when the driver sees the signal
            return super().step(step, batch)

    return InterruptingWorker


class DyingWorker(FakeWorker):
    """Rank 1's process exits in step 1."""

    def step(self, step, batch):
        if step == 1 and self.rank == 1:
            os._exit(3)
        return super().step(step, batch)


def _pickle_workers_by_value() -> None:
    pickle_by_value(sys.modules[__name__])


@pytest.fixture
def worker(monkeypatch):
    """``use(cls)``: the CLI's launches run ``cls`` instead of ``runtime.worker.StageWorker``."""
    import runtime.worker

    def use(cls):
        monkeypatch.setattr(runtime.worker, "StageWorker", cls)
    return use


# ----------------------------------------------------------------------------- launches
@pytest.mark.timeout(180)
def test_json_stdout_holds_no_ray_output_and_ends_with_the_object(plan_dict, tmp_path, capfd, worker):
    """The CLI owns Ray here (started and shut down inside the launch), as from a shell."""
    if ray.is_initialized():
        ray.shutdown()
    _pickle_workers_by_value()
    worker(ChattyWorker)
    path = _write(tmp_path, plan_dict)
    assert cli.main(["launch", str(path), "--steps", "3", "--json", "--checkpoint-every", "0"]) == 0
    assert not ray.is_initialized()
    out, err = capfd.readouterr()
    assert "chatty worker" not in out
    assert "chatty worker 0 says hello" in err  # forwarded, to stderr
    assert "Token authentication" not in err   # Ray's local-cluster auth notice (runtime.cluster.init_ray)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    result = json.loads(lines[-1])
    assert result["ok"] and result["steps"] == 3


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the remaining launches (not owned by the CLI)."""
    init_ray()
    _pickle_workers_by_value()
    yield
    ray.shutdown()


#: The interrupted launch runs as ``tessel launch`` would from a terminal: its own process (and
#: session, so no signal can reach the test runner), SIGINT at Python's default handler (a
#: background CI shell starts children with SIGINT ignored), the interrupting stand-in worker.
_INTERRUPTED_LAUNCH = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path[:0] = [{root!r}, {here!r}]
import runtime.worker
import test_launch_faults as t
from apps import cli
t._pickle_workers_by_value()
runtime.worker.StageWorker = t.interrupting_worker(os.getpid())
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.timeout(300)
def test_ctrl_c_checkpoints_the_last_step_and_prints_the_resume_command(plan_dict, tmp_path, capsys, worker,
                                                                          ray_cluster):
    import subprocess

    here = Path(__file__).resolve().parent
    root = str(here.parents[1])
    path = _write(tmp_path, plan_dict)
    ckdir = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_LAUNCH.format(root=root, here=str(here)), "launch", str(path), "--steps",
         "20", "--checkpoint-every", "100", "--lr", "0.01"],
        cwd=root, capture_output=True, text=True, timeout=240, start_new_session=True,
        env={**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")})
    err = proc.stderr
    assert proc.returncode == 130, err[-3000:]
    saved = ck.list_checkpoints(ckdir)
    assert len(saved) == 1, err  # the cadence (every 100 steps) wrote none: this one is the interrupt's
    done = ck.checkpoint_step(saved[0])
    assert 3 <= done < 20  # step 2 (during which the signal came) finished and is in it
    assert f"launch interrupted after {done} of 20 steps; their checkpoint is {saved[0]}" in err
    assert f"[tessel] interrupted: checkpointing the {done} steps done" in err
    ck.load_checkpoint(saved[0], world_size=2)  # complete and intact
    command = next(ln for ln in err.splitlines() if ln.startswith("resume with: "))[len("resume with: "):]
    words = shlex.split(command)
    assert words[:2] == ["tessel", "launch"] and "--resume" in words and "--lr" in words
    assert words[words.index("--checkpoint-dir") + 1] == str(ckdir)
    # the printed command resumes from that checkpoint
    worker(FakeWorker)
    assert cli.main([*words[1:], "--steps", str(done + 1), "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.splitlines()[-1])["start_step"] == done


@pytest.mark.timeout(180)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(plan_dict, tmp_path, capsys, worker,
                                                                   ray_cluster):
    from engine.io import Plan

    worker(FakeWorker)
    path = _write(tmp_path, plan_dict)
    for step in (1, 2):  # what a 2-step run with --checkpoint-every 1 of FakeWorker writes
        ck.save_checkpoint(tmp_path / "ckpt", step, [{"w": torch.full((1,), float(step))}] * 2,
                           [ck.capture_rng()] * 2, plan=Plan.from_dict(plan_dict), extra={"optimizer": "adam"})
    newest = tmp_path / "ckpt" / "step_000002"
    data = (newest / "rank_00001.pt").read_bytes()
    (newest / "rank_00001.pt").write_bytes(data[: len(data) // 3])
    capsys.readouterr()
    assert cli.main(["launch", str(path), "--steps", "3", "--resume", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.splitlines()[-1])["start_step"] == 1
    assert "rank_00001.pt" in err and "step_000001" in err and "Traceback" not in err
    # the resumed run removed the damaged checkpoint and kept the one it resumed from beside its own
    assert [p.name for p in ck.list_checkpoints(tmp_path / "ckpt")] == ["step_000001", "step_000003"]
    ck.load_checkpoint(tmp_path / "ckpt" / "step_000003", world_size=2)


@pytest.mark.timeout(180)
def test_a_rank_that_dies_is_a_run_failure_not_a_user_mistake(plan_dict, tmp_path, ray_cluster):
    from engine.io import Plan

    with pytest.raises(LaunchFailure) as info:
        launch(Plan.from_dict(plan_dict), LaunchConfig(steps=3, checkpoint_dir=tmp_path, checkpoint_every=1,
                                                       step_timeout=30), worker_cls=DyingWorker)
    e = info.value
    assert isinstance(e, RunError) and e.exit_status == 3
    assert e.kind == "died" and e.rank == 1 and e.step == 1 and Path(e.checkpoint).name == "step_000001"


def test_predicted_throughput_is_the_plans_or_says_there_is_none(plan_dict):
    from engine.io import Plan
    from engine.plan import predicted_metrics
    from runtime.launcher import predicted_rate

    plan = Plan.from_dict(plan_dict)
    m = predicted_metrics(plan)
    tokens = m["tokens_per_step"]
    assert predicted_rate(plan, m, unit="tokens", units_per_step=tokens) == pytest.approx(m["tokens_per_second"])
    # another batch or unit (a task override): the launch's units over the predicted makespan
    assert predicted_rate(plan, m, unit="samples", units_per_step=8) == pytest.approx(8 / m["makespan"])
    # the prediction failed: the plan's saved metrics; none saved (or an abstract plan): no prediction, not 0
    assert predicted_rate(plan, None, unit="tokens", units_per_step=tokens) == plan.metrics["tokens_per_second"]
    bare = Plan.from_dict({**plan_dict, "metrics": {}})
    assert predicted_rate(bare, None, unit="tokens", units_per_step=tokens) is None
    assert predicted_rate(plan, {**m, "time_unit": "units"}, unit="tokens", units_per_step=tokens) is None


def test_the_report_says_when_the_plan_holds_no_prediction(plan_dict, tmp_path):
    import contextlib
    import io
    from types import SimpleNamespace

    from apps.cmd_launch import report
    from engine.io import Plan

    res = SimpleNamespace(
        pp=2, world_size=2, dp=1, backend="gloo", task="causal-lm", start_step=0, steps=1, elapsed=1.0, setup_time=0.5,
        losses=[5.0], val_losses=[], moe=[], unit="tokens", units_per_second=100.0, units_per_step=128,
        predicted_step_time=[float("nan")] * 2, measured_step_time=[0.1, 0.1], predicted_busy=[float("nan")] * 2,
        measured_busy=[0.1, 0.1], peak_memory=[1, 1], predicted_makespan=float("nan"), measured_makespan=0.1,
        predicted_units_per_second=None, trace_paths={}, checkpoint=None, to_dict=lambda: {})
    out = io.StringIO()
    d = report(Plan.from_dict({**plan_dict, "metrics": {}}), res, plan_dir=tmp_path, out=out)
    assert "100 tokens/s measured (128 tokens per step), no prediction in the plan;" in out.getvalue()
    assert "0 tokens/s predicted" not in out.getvalue() and d["predicted_tokens_per_second"] is None
    # without ``out`` the summary goes to sys.stdout as it is at the call, not as it was at import
    # (an in-process caller that redirects stdout, then closes the stream, must not break later calls)
    later = io.StringIO()
    with contextlib.redirect_stdout(later):
        report(Plan.from_dict({**plan_dict, "metrics": {}}), res, plan_dir=tmp_path)
    assert "100 tokens/s measured" in later.getvalue()


def test_ranks_that_outnumber_the_cores_are_named_before_ray(tmp_path, capsys, monkeypatch, no_ray_work):
    """Four CPU ranks on two cores measured 3-7x their prediction with no word (issue 32's review):
    the launch now says so before Ray starts (here Ray is refused, so the command ends there)."""
    import os

    from runtime import launcher

    plan = make_plan("gpt2-tiny", devices=4, micro_batches=4, schedule="1f1b", device_type="cpu", seq_len=16).plan
    path = _write(tmp_path, plan.to_dict())
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert cli.main(["launch", str(path), "--steps", "2", "--device", "cpu"]) != 0   # Ray refused by the fixture
    err = capsys.readouterr().err
    assert "[tessel] 4 CPU ranks share this machine's 2 cores" in err and "--address" in err
    # two ranks fit, a cluster's cores are its own, and GPU ranks are not CPU ranks
    cfg = launcher.LaunchConfig(device="cpu")
    assert launcher.shared_cores_warning(2, cfg, cores=2) is None
    assert launcher.shared_cores_warning(4, launcher.LaunchConfig(device="cpu", address="10.0.0.1:6379"), 2) is None
    assert launcher.shared_cores_warning(4, launcher.LaunchConfig(device="cuda"), cores=2) is None


def test_a_plan_whose_model_no_rank_can_build_is_refused_before_ray(plan_dict, tmp_path, capsys, no_ray_work):
    """An unknown model name passed `tessel show` and then failed inside every rank with exit 3
    (issue 32's review); a user module that does not import likewise."""
    for name, words in (("gpt2-tiyn", "unknown model 'gpt2-tiyn'"),
                        ("no_such_package.models:build", "cannot import module 'no_such_package.models'")):
        d = copy.deepcopy(plan_dict)
        d["model"]["name"] = name
        path = _write(tmp_path / name.replace(":", "_"), d)
        assert cli.main(["launch", str(path), "--steps", "2"]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
