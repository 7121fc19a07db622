"""Training through the task API (``tasks``) on real processes (gloo, no Ray): the global batch is
the task's tuple ``(*inputs, *targets)``, the last stage's loss is ``task.loss``, and per-step
losses (and the validation loss, and the parameters after the steps) equal the single-process
reference of the same model and data.

Model: gpt2-tiny, pp=2, micro-batch 2 x 32 tokens, m = 4, 3 steps; tasks: causal-lm (1F1B) and
the example user task ``user_task_example:make_task`` (``tests/tasks``; predict each byte's
class from the first 4 logits) on ZB-H1. The pool processes inherit ``sys.path`` (spawn), so the
user task's module is importable in every rank, as it must be on every machine of a launch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from worker_harness import WorkerPool

_TASKS_DIR = str(Path(__file__).resolve().parents[1] / "tasks")
if _TASKS_DIR not in sys.path:          # before the pool spawns: the ranks import the user task
    sys.path.insert(0, _TASKS_DIR)

STEPS = 3
MBS, SEQ, M = 2, 32, 4
USER_TASK = "user_task_example:make_task"


def _run_task(task: dict) -> dict:
    """One rank: setup, the steps, evaluate, state."""
    from runtime.worker import StageWorker, WorkerConfig

    w = StageWorker(task["plan"], task["rank"], task["world"], "127.0.0.1", task["port"],
                    config=WorkerConfig(timeout_s=60.0))
    try:
        w.setup()
        steps = [w.step(i, b) for i, b in enumerate(task["batches"])]
        ev = w.evaluate(task["val"])
        return {"steps": steps, "eval": ev, "state": w.state_dict()["segments"], "task": w.task.name}
    finally:
        w.shutdown()


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2)
    yield p
    p.close()


def _plan(schedule: str, task: str | None):
    from engine.plan import make_plan

    return make_plan("gpt2-tiny", devices=2, micro_batches=M, schedule=schedule, device_type="cpu",
                     micro_batch_size=MBS, seq_len=SEQ, task=task).plan


def _train_and_compare(pool, plan, task_name: str) -> None:
    from engine.models import task_for_plan
    from runtime.reference import reference_run
    from runtime.worker import merge_model_state

    task = task_for_plan(plan, seed=0)
    assert task.name == task_name
    batches = [task.train_batch(s, M * MBS) for s in range(STEPS)]
    val = task.val_batch(0, M * MBS)
    out = pool.run_ok("test_task_training:_run_task", {"plan": plan.to_dict(), "batches": batches, "val": val},
                      world=2)
    assert {p["task"] for p in out.values()} == {task_name}
    ref = reference_run(plan, batches, seed=0, lr=1e-3)
    got = [out[1]["steps"][s]["losses"] for s in range(STEPS)]   # pipeline rank 1 holds the last stage
    assert all(not out[0]["steps"][s]["losses"] for s in range(STEPS))
    for s in range(STEPS):
        assert torch.allclose(torch.tensor(got[s]), torch.tensor(ref.losses[s]), rtol=1e-4, atol=0), \
            f"{task_name} step {s}: pipelined {got[s]} vs reference {ref.losses[s]}"
    assert sum(got[-1]) < sum(got[0]), "the model must actually train"
    # parameters after the steps equal the reference model's
    merged = merge_model_state([{"segments": out[r]["state"]} for r in (0, 1)])
    ref_sd = ref.model.state_dict()
    assert set(merged) <= set(ref_sd) and len(merged) >= len(dict(ref.model.named_parameters()))
    for name, t in merged.items():
        torch.testing.assert_close(t, ref_sd[name], rtol=1e-4, atol=2e-5, msg=lambda m, k=name: f"{k}: {m}")
    # validation loss: the trained reference model on the same micro-batches, with the task's loss
    model = ref.model
    with torch.no_grad():
        k = task.num_inputs
        per = [float(task.loss(model(*[t[j * MBS:(j + 1) * MBS] for t in val[:k]]),
                               *[t[j * MBS:(j + 1) * MBS] for t in val[k:]])) for j in range(M)]
    assert out[0]["eval"] is None
    assert out[1]["eval"] == pytest.approx(sum(per) / M, rel=1e-4)


@pytest.mark.timeout(300)
def test_causal_lm_task_batches_match_reference(pool):
    _train_and_compare(pool, _plan("1f1b", None), "causal-lm")


@pytest.mark.timeout(300)
def test_user_task_trains_and_matches_reference(pool):
    plan = _plan("zb-h1", USER_TASK)
    assert plan.model.task == USER_TASK
    _train_and_compare(pool, plan, USER_TASK)


def test_legacy_tensor_batches_give_the_same_reference():
    """The causal-lm tuple batch and the legacy ``[rows, seq_len + 1]`` tensor are the same data."""
    from runtime.data import ByteCorpus
    from runtime.reference import reference_losses
    from tasks import TaskContext, get_task

    plan = _plan("1f1b", None)
    legacy = [ByteCorpus(seq_len=SEQ, seed=0).train_batch(s, M * MBS) for s in range(2)]
    task = get_task("causal-lm", TaskContext(seq_len=SEQ, seed=0))
    tuples = [task.train_batch(s, M * MBS) for s in range(2)]
    assert reference_losses(plan, legacy) == reference_losses(plan, tuples)
    with pytest.raises(ValueError, match="first dimension 8"):
        reference_losses(plan, [tuple(t[:6] for t in tuples[0])])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model, task_name", [("bert-tiny", "masked-lm"), ("t5-tiny", "seq2seq"),
                                              ("cnn-digits", "image-classification"), ("llama-tiny", "causal-lm")])
def test_single_process_reference_of_every_task(model, task_name):
    """The reference trains each zoo model on its own task; its first micro-batch loss is the hand
    count ``-mean log softmax(output)[target]`` over the positions with a target (``-100``: none)
    of the same model (same seed) on the same rows, and the losses go down."""
    from engine.models import build_model, task_for_plan
    from engine.plan import make_plan
    from runtime.reference import reference_run

    plan = make_plan(model, devices=2, micro_batches=2, schedule="1f1b", device_type="cpu", micro_batch_size=2,
                     seq_len=None if task_name == "image-classification" else SEQ).plan
    assert plan.model.task == task_name
    task = task_for_plan(plan, seed=0)
    batches = [task.train_batch(s, 4) for s in range(6)]
    run = reference_run(plan, batches, seed=0, lr=3e-3)
    torch.manual_seed(0)
    fresh = build_model(model, batch_size=2, seq_len=plan.model.seq_len, device="cpu").module.float().train()
    k = task.num_inputs
    with torch.no_grad():
        out = fresh(*[t[:2] for t in batches[0][:k]])
    target = batches[0][-1][:2]
    logp = torch.log_softmax(out.float().reshape(-1, out.shape[-1]), -1)
    flat = target.reshape(-1)
    keep = flat != -100
    by_hand = -logp[keep].gather(1, flat[keep][:, None]).mean()
    assert run.losses[0][0] == pytest.approx(float(by_hand), rel=1e-4)
    assert sum(run.losses[-1]) < sum(run.losses[0])


# ----------------------------------------------------------------------------- launcher and CLI
def test_cli_refuses_a_bad_task_before_ray_starts(tmp_path, capsys):
    """``tessel launch --task``: an unknown task, or one the model cannot train, is exit 2 with
    one sentence, before any Ray work (Ray is never initialised here)."""
    from apps.cli import main
    from engine.io import save_plan

    path = save_plan(_plan("1f1b", None), tmp_path / "plan.json")
    ray = pytest.importorskip("ray")
    was = ray.is_initialized()
    assert main(["launch", str(path), "--task", "nope", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "unknown task 'nope'; valid tasks: causal-lm, masked-lm" in err and len(err.strip().splitlines()) == 1
    assert main(["launch", str(path), "--task", "masked-lm", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "masked-lm needs a [MASK] id" in err and len(err.strip().splitlines()) == 1
    assert ray.is_initialized() == was


def test_plan_records_the_task(tmp_path):
    from apps.cli import main
    from engine.io import load_plan

    assert main(["plan", "--model", "gpt2-tiny", "--devices", "2", "--micro-batches", "2", "--device-type", "cpu",
                 "--seq-len", "16", "--task", USER_TASK, "-o", str(tmp_path), "--json"]) == 0
    assert load_plan(tmp_path / "plan.json").model.task == USER_TASK


@pytest.mark.timeout(400)
def test_launch_with_a_user_task_override():
    """``LaunchConfig(task=...)`` on Ray: the workers train the user task (its data, its loss), the
    losses equal the reference of the same batches, and throughput is in the task's unit."""
    ray = pytest.importorskip("ray")
    from runtime import launch
    from runtime.cluster import init_ray
    from runtime.config import LaunchConfig
    from runtime.reference import reference_losses
    from tasks import TaskContext, get_task

    root = str(Path(__file__).resolve().parents[2])
    # the actors import the user task's module: put its folder on their path
    owned = init_ray(runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([root, _TASKS_DIR])}})
    try:
        plan = _plan("1f1b", None)
        res = launch(plan, LaunchConfig(steps=3, device="cpu", task=USER_TASK, eval_every=0, keep_timelines=0))
    finally:
        if owned:
            ray.shutdown()
    task = get_task(USER_TASK, TaskContext(seq_len=SEQ, seed=0))
    ref = reference_losses(plan, [task.train_batch(s, M * MBS) for s in range(3)], task=USER_TASK)
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor([sum(r) / len(r) for r in ref]),
                               rtol=1e-4, atol=1e-5)
    assert res.task == USER_TASK and res.unit == "tokens" and res.units_per_step == M * MBS * SEQ
    assert res.tokens_per_step == M * MBS * SEQ and res.units_per_second > 0
    assert res.losses[0] < 2.0   # 4 classes (ln 4 = 1.39), not the 256-way next byte (ln 256 = 5.5)
    assert len(res.val_losses) == 1
