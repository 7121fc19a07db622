"""Checkpoint integrity (issue 20): ``meta.json`` records every file's size and SHA-256, loading
checks them, and resuming falls back to the previous intact checkpoint with a warning naming the
damaged file; a folder that does not exist, holds no checkpoint, or only damaged ones is one
sentence. Checkpoints written before the records existed still load (their zip CRCs are checked).

No Ray: the checkpoints are written by ``runtime.checkpoint.save_checkpoint`` from small tensors,
and resuming is ``runtime.session.resume_point``, what both launchers call before Ray starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch

from engine.errors import TesselError
from runtime import checkpoint as ck
from runtime.runner import LaunchError
from runtime.session import resume_point

PLAN = {"model": {"name": "tiny"}, "parallel": {"pp": 2}, "segments": [], "schedule": {"orders": [["0F0"]]}}
WS = 2


def _save(root: Path, step: int) -> Path:
    states = [{"w": torch.full((64,), float(step * 10 + r))} for r in range(WS)]
    rngs = [ck.capture_rng() for _ in range(WS)]
    return ck.save_checkpoint(root, step, states, rngs, plan=PLAN, seed=0, extra={"optimizer": "adam"}, keep=None)


def _resume(root: Path, steps: int = 10):
    return resume_point(root, resume=True, plan=PLAN, world_size=WS, steps=steps, optimizer="adam",
                        error=lambda msg, **kw: LaunchError(msg, kind="setup", **kw))


def _truncate(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def test_meta_records_every_file_size_and_sha256(tmp_path):
    p = _save(tmp_path, 2)
    files = json.loads((p / "meta.json").read_text())["files"]
    on_disk = sorted(f.name for f in p.iterdir() if f.name != "meta.json")
    assert sorted(files) == on_disk == ["rank_00000.pt", "rank_00001.pt", "rng.pt"]
    for name, rec in files.items():
        data = (p / name).read_bytes()
        assert rec == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    ck.load_checkpoint(p, plan=PLAN, world_size=WS)  # intact: no error


@pytest.mark.parametrize("damage,name", [
    (_truncate, "rank_00001.pt"),
    (lambda f: f.write_bytes(b""), "rng.pt"),
    (lambda f: f.write_bytes(bytes([f.read_bytes()[0] ^ 1]) + f.read_bytes()[1:]), "rank_00000.pt"),  # same size
    (lambda f: f.unlink(), "rank_00001.pt"),
])
def test_a_damaged_file_is_named_and_resume_falls_back_to_the_previous_checkpoint(tmp_path, caplog, damage, name):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    damage(newest / name)
    with pytest.raises(ck.CheckpointDamaged) as info:
        ck.load_checkpoint(newest, plan=PLAN, world_size=WS)
    assert info.value.file == name and name in str(info.value)
    with caplog.at_level(logging.WARNING, logger="runtime"):
        got, last = _resume(tmp_path)
    assert got.step == 1 and Path(last).name == "step_000001"
    assert torch.equal(got.rank_state(1)["w"], torch.full((64,), 11.0))
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert name in warned and "step_000002" in warned and "step_000001" in warned


def test_every_checkpoint_damaged_is_one_sentence(tmp_path):
    for step in (1, 2):
        (_save(tmp_path, step) / "rng.pt").write_bytes(b"")
    _truncate(tmp_path / "step_000001" / "rank_00000.pt")
    with pytest.raises(ck.CheckpointError) as info:
        _resume(tmp_path)
    msg = str(info.value)
    assert isinstance(info.value, TesselError) and info.value.exit_status == 2
    assert "every checkpoint in" in msg and "step_000002: rng.pt" in msg and "step_000001: rank_00000.pt" in msg
    assert "without --resume" in msg and "\n" not in msg


def test_old_checkpoints_without_records_still_load_and_their_damage_is_found(tmp_path):
    old = _save(tmp_path, 3)
    meta = json.loads((old / "meta.json").read_text())
    del meta["files"]  # as written before the records existed
    (old / "meta.json").write_text(json.dumps(meta))
    got, _ = _resume(tmp_path)
    assert got.step == 3 and torch.equal(got.rank_state(0)["w"], torch.full((64,), 30.0))
    got.restore_rng()
    _truncate(old / "rank_00001.pt")
    with pytest.raises(ck.CheckpointDamaged, match="rank_00001.pt is not a readable torch.save archive"):
        ck.load_checkpoint(old, plan=PLAN, world_size=WS)
    # reading the damaged file anyway is a sentence, not torch's traceback
    unchecked = ck.load_checkpoint(old, plan=PLAN, world_size=WS, verify=False)
    with pytest.raises(ck.CheckpointDamaged, match="rank_00001.pt cannot be read"):
        unchecked.rank_state(1)


def test_resume_from_a_missing_or_empty_folder_is_refused(tmp_path):
    with pytest.raises(LaunchError, match=r"cannot resume: the checkpoint folder .*nowhere does not exist") as info:
        _resume(tmp_path / "nowhere")
    assert info.value.exit_status == 2 and info.value.kind == "setup"
    (tmp_path / "empty").mkdir()
    with pytest.raises(LaunchError, match=r"cannot resume: .*empty holds no checkpoint"):
        _resume(tmp_path / "empty")
    with pytest.raises(LaunchError, match="cannot resume without a checkpoint folder"):
        resume_point(None, resume=True, plan=PLAN, world_size=WS, steps=10, optimizer="adam",
                     error=lambda msg, **kw: LaunchError(msg, kind="setup", **kw))
    assert resume_point(tmp_path / "nowhere", resume=False, plan=PLAN, world_size=WS, steps=10, optimizer="adam",
                        error=LaunchError) == (None, None)  # a fresh run needs no folder yet



def test_a_checkpoint_that_cannot_be_written_is_a_run_failure(tmp_path):
    from types import SimpleNamespace

    from engine.errors import RunError
    from runtime.runner import LaunchFailure
    from runtime.session import TrainingSession

    blocked = tmp_path / "ckpt"
    blocked.write_text("a file where the checkpoint folder should be")
    session = TrainingSession(runner=SimpleNamespace(checkpoint=None, call=None), plan=PLAN, world_size=WS,
                              corpus=None, global_batch=1, steps=2, checkpoint_dir=blocked)
    with pytest.raises(LaunchFailure) as info:
        session.save(1)
    e = info.value
    assert isinstance(e, RunError) and e.exit_status == 3 and e.kind == "checkpoint" and e.step == 1
    assert str(e).startswith(f"the checkpoint after 1 steps could not be written to {blocked}")
