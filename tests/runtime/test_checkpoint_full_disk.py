"""A full disk during a checkpoint (issue 32's review): ``tessel launch`` ended in "internal error:
RuntimeError: [enforce fail at inline_container.cc:672] ..."; it now says the checkpoint could not
be written, why (no space left on device) and where, with exit status 3 and the previous
checkpoint intact. The disk is a tmpfs mounted for the test with room for one checkpoint, not two
(root needed; skipped with the reason otherwise)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from tessel_run import run_tessel

ROOT = Path(__file__).resolve().parents[2]


def _mount_small_tmpfs(where: Path, size: int) -> str | None:
    """Mount a tmpfs of ``size`` bytes at ``where``; the reason it cannot be, or ``None``."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "mounting a small tmpfs needs root and mount(8)"
    where.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                       text=True, timeout=30)
    return None if p.returncode == 0 else f"could not mount a tmpfs: {p.stderr.strip()}"


def test_a_full_disk_during_a_checkpoint_is_one_sentence_and_keeps_the_last_one(tmp_path):
    from engine.io import save_plan
    from engine.models import build_model
    from engine.plan import make_plan
    from runtime import checkpoint as ck

    plan = make_plan("llama-tiny", devices=2, micro_batches=2, micro_batch_size=2, seq_len=16, device_type="cpu").plan
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    params = sum(p.numel() for p in build_model("llama-tiny").module.parameters())
    one = 12 * params   # float32 weights + Adam's two moments
    disk = tmp_path / "disk"
    why = _mount_small_tmpfs(disk, int(one * 1.5))
    if why:
        pytest.skip(why)
    try:
        p = run_tessel("launch", str(path), "--device", "cpu", "--steps", "3", "--checkpoint-dir", str(disk / "ckpt"),
                       "--checkpoint-every", "1", "--eval-every", "0", timeout=300)
        kept = ck.list_checkpoints(disk / "ckpt")
        assert p.returncode == 3, p.stderr[-2000:]
        last = p.stderr.strip().splitlines()[-1]
        assert "could not be written to" in last and str(disk / "ckpt") in last, last
        assert "No space left on device" in last and "internal error" not in p.stderr, last
        assert [k.name for k in kept] == ["step_000001"] and "step_000001 is kept" in last
        ck.load_checkpoint(kept[0])   # verified on load: intact
        assert not [x for x in (disk / "ckpt").iterdir() if x.name.startswith(".tmp-")]   # no partial left
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True, timeout=30)
