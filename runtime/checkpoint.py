"""Atomic training checkpoints: one directory per step, all ranks together.

Layout of ``<checkpoint_dir>/step_000020/`` (the state after 20 completed steps; training
resumes at step 20, and the data position is the step because batches are a pure function
of the step, see ``runtime.data.ByteCorpus.train_batch``)::

    meta.json          format, version, step, plan_hash, world_size, seed, losses so far, time
    rank_00000.pt      torch.save of {"format": "tessel-rank-state", "version": 1, "rank": 0,
                       "state_dict": rank 0's StageWorker.state_dict() (model shards, optimizer),
                       "rng": rank 0's RNG states (capture_rng: python, torch CPU/CUDA, numpy)}
    ...
    rng.pt             the launcher's own RNG states

Integrity. ``meta.json`` (written last, inside the temporary directory, so it exists only once
every other file is complete) records every other file's size and SHA-256 under ``files``
(``{"rank_00000.pt": {"bytes": 1234, "sha256": "..."}, ...}``). :func:`load_checkpoint` checks them
(:func:`verify_checkpoint`) and raises :class:`CheckpointDamaged` naming the first damaged file (a
truncated ``rank_*.pt``, an empty ``rng.pt``, a changed byte), so a resume can fall back to the
previous checkpoint (``runtime.session.resume_point``; two checkpoints are kept by default).
Checkpoints written before ``files`` existed still load: their ``.pt`` files are checked as what
``torch.save`` writes, a zip archive whose members' CRC-32 must match (:mod:`zipfile`).

Both headers go through :class:`engine.envelope.Envelope` (``meta.json``: format and version
required; a rank state: format required, version optional since rank states written before it
had none).

Atomicity: everything is written into a hidden temporary directory in the same folder
(``.tmp-step_000020-<pid>-<random>``), every file is fsync'ed, then the directory is
``os.replace``'d to its final name and the folder fsync'ed. A reader (``latest_checkpoint``)
only considers ``step_*`` directories with a ``meta.json``, so an interrupted write leaves at
most a hidden temporary directory, which the next save removes. Replacing an existing
``step_N`` (a re-run of the same step) moves the old one aside first.

The plan hash (:func:`plan_hash`) covers what decides the shapes and owners of the state:
model, parallel degrees, segments' layers and devices, placement and schedule orders. Loading a
checkpoint for another plan raises :class:`CheckpointError` naming both hashes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import sys
import time
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from engine.envelope import Envelope
from engine.errors import TesselError

CHECKPOINT_FORMAT = "tessel-checkpoint"
CHECKPOINT_VERSION = 1
RANK_STATE_FORMAT = "tessel-rank-state"
RANK_STATE_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(TesselError):
    """A checkpoint is missing, malformed, or was written for another plan."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint's files are damaged: missing, truncated, or not what ``meta.json`` recorded.

    Attributes:
        path: the checkpoint directory.
        file: the name of the (first) damaged file in it, e.g. ``"rank_00001.pt"``.
    """

    def __init__(self, message: str, *, path: Path, file: str):
        super().__init__(message)
        self.path = path
        self.file = file


#: ``meta.json``'s envelope.
CHECKPOINT_ENVELOPE = Envelope(CHECKPOINT_FORMAT, CHECKPOINT_VERSION, CheckpointError, what="a checkpoint's meta.json")
#: The envelope of a ``rank_*.pt`` dict. ``version`` is optional: rank states written before it
#: existed carry only ``format`` and load as version 1.
RANK_STATE_ENVELOPE = Envelope(RANK_STATE_FORMAT, RANK_STATE_VERSION, CheckpointError, what="a rank state",
                               require_version=False)


@dataclass
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        path: its directory.
        step: steps completed (the next step to run).
        plan_hash: :func:`plan_hash` of the plan it was written for.
        world_size: ranks.
        meta: the whole ``meta.json``.
    """

    path: Path
    step: int
    plan_hash: str
    world_size: int
    meta: dict = field(default_factory=dict)

    def _rank_file(self, rank: int, map_location: str) -> dict:
        f = self.path / _rank_file(rank)
        if not f.is_file():
            raise CheckpointDamaged(f"checkpoint {self.path} has no state for rank {rank} ({f.name} is missing)",
                                    path=self.path, file=f.name)
        d = _torch_load(f, map_location)
        try:
            return RANK_STATE_ENVELOPE.check(d, f"checkpoint file {f}")
        except CheckpointError as e:
            raise CheckpointError(f"{e} (not a Tessel rank state)") from None

    def rank_state(self, rank: int, map_location: str = "cpu") -> Any:
        """Rank ``rank``'s worker ``state_dict()`` (``torch.load``, tensors on ``map_location``)."""
        return self._rank_file(rank, map_location)["state_dict"]

    def rank_rng(self, rank: int) -> dict | None:
        """Rank ``rank``'s RNG states (see :func:`capture_rng`), or ``None`` if none were saved."""
        return self._rank_file(rank, "cpu").get("rng")

    def restore_rng(self) -> None:
        """Restore the launcher's own RNG states (``rng.pt``) in this process."""
        f = self.path / "rng.pt"
        if f.is_file():
            restore_rng(None, _torch_load(f, "cpu"))


def _torch_load(f: Path, map_location: str) -> Any:
    """``torch.load`` of a checkpoint file; a file torch cannot read is :class:`CheckpointDamaged`."""
    try:
        return torch.load(f, map_location=map_location, weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, ImportError, AttributeError) as e:
        raise CheckpointDamaged(f"checkpoint {f.parent}: {f.name} cannot be read ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else 'no detail'}); it is damaged",
                                path=f.parent, file=f.name) from None


def capture_rng(_owner: Any = None) -> dict:
    """RNG states of this process: python ``random``, torch CPU, every CUDA device, numpy (if loaded).

    The ignored first argument lets it run on an actor via ``actor.__ray_call__.remote(capture_rng)``.
    """
    st: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        st["numpy"] = np.random.get_state()
    return st


def restore_rng(_owner: Any, st: dict | None) -> None:
    """Restore :func:`capture_rng` states in this process (``actor.__ray_call__.remote(restore_rng, st)``)."""
    if not st:
        return
    if "python" in st:
        random.setstate(st["python"])
    if "torch" in st:
        torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
    np = sys.modules.get("numpy")
    if "numpy" in st and np is not None:
        np.random.set_state(st["numpy"])


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def plan_hash(plan: Any) -> str:
    """SHA-256 (first 16 hex digits) of the parts of a plan that determine the training state.

    Args:
        plan: an ``engine.io.Plan`` or its ``to_dict()`` document.

    Covers ``model`` (minus free-form notes), ``parallel``, each segment's ``index``, ``layers``
    and ``devices``, the placement and the schedule's orders; not the cost model or predicted
    metrics, which change when a plan is re-profiled without changing what is trained.
    """
    d = plan.to_dict() if hasattr(plan, "to_dict") else dict(plan)
    segs = [{k: s.get(k) for k in ("index", "layers", "devices")} for s in d.get("segments", [])]
    sched = d.get("schedule", {})
    key = {
        "model": d.get("model"), "parallel": d.get("parallel"), "segments": segs,
        "placement": d.get("placement"),
        "schedule": {"orders": sched.get("orders"), "num_micro_batches": sched.get("num_micro_batches")},
    }
    return hashlib.sha256(_canonical(key).encode()).hexdigest()[:16]


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def step_dir_name(step: int) -> str:
    """``step_000020`` for step 20."""
    return f"step_{step:06d}"


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step count of a checkpoint directory from its name (``.../step_000020`` -> 20), or
    ``None`` when the name is not ``step_N`` (the directory itself is not read)."""
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def _fsync_path(p: Path) -> None:
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def file_record(path: str | os.PathLike) -> dict:
    """``{"bytes": size, "sha256": hex digest}`` of a file (what ``meta.json``'s ``files`` holds).

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"bytes": os.path.getsize(path), "sha256": digest}


def _zip_damage(f: Path) -> str | None:
    """Why ``f`` is not an intact ``torch.save`` zip archive (a member's CRC-32 differs, no central
    directory: truncated), or ``None`` when it is."""
    try:
        with zipfile.ZipFile(f) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"not a readable torch.save archive ({e})"
    return f"member {bad} fails its CRC check" if bad is not None else None


def verify_checkpoint(path: str | os.PathLike, meta: dict | None = None) -> None:
    """Check that a checkpoint's files are intact.

    With ``meta.json``'s ``files`` (checkpoints written by this version): every recorded file exists
    with the recorded size (bytes) and SHA-256. Without it (older checkpoints): every ``rank_*.pt``
    the world size needs and ``rng.pt`` (when present) are intact zip archives (:func:`zipfile.ZipFile.testzip`).

    Args:
        path: the ``step_N`` directory.
        meta: its parsed ``meta.json`` (read from ``path`` when ``None``).

    Raises:
        CheckpointDamaged: the first damaged or missing file, named.
        CheckpointError: ``meta.json`` is unreadable.
    """
    p = Path(path)
    meta = meta if meta is not None else _read_meta(p)
    files = meta.get("files")
    if isinstance(files, dict) and files:
        for name, rec in sorted(files.items()):
            f = p / name
            if not f.is_file():
                raise CheckpointDamaged(f"checkpoint {p} is damaged: {name} is missing", path=p, file=name)
            size = f.stat().st_size
            want = int(rec.get("bytes", -1)) if isinstance(rec, dict) else -1
            if size != want:
                raise CheckpointDamaged(f"checkpoint {p} is damaged: {name} has {size:,} bytes but {want:,} were "
                                        "written (truncated or replaced)", path=p, file=name)
            if file_record(f)["sha256"] != rec.get("sha256"):
                raise CheckpointDamaged(f"checkpoint {p} is damaged: {name} does not match the SHA-256 recorded "
                                        "in meta.json", path=p, file=name)
        return
    ws = meta.get("world_size")
    names = [_rank_file(r) for r in range(int(ws))] if isinstance(ws, int) else sorted(
        q.name for q in p.glob("rank_*.pt"))
    if (p / "rng.pt").exists():
        names.append("rng.pt")
    for name in names:
        f = p / name
        if not f.is_file():
            raise CheckpointDamaged(f"checkpoint {p} is damaged: {name} is missing", path=p, file=name)
        why = _zip_damage(f)
        if why is not None:
            raise CheckpointDamaged(f"checkpoint {p} is damaged: {name} is {why}", path=p, file=name)


def _read_meta(p: Path) -> dict:
    """The parsed ``meta.json`` of checkpoint ``p`` (a damaged one is :class:`CheckpointDamaged`)."""
    try:
        meta = json.loads((p / "meta.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointDamaged(f"checkpoint {p}: meta.json is unreadable ({e})", path=p, file="meta.json") from None
    if not isinstance(meta, dict):
        raise CheckpointDamaged(f"checkpoint {p}: meta.json is not a JSON object", path=p, file="meta.json")
    return meta


def _torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path``, flushed and synced.

    Raises:
        OSError: the file cannot be written. torch reports a failed write inside its zip writer
            (a full disk: "[enforce fail at inline_container.cc:...] PytorchStreamWriter failed
            writing file ...") as a ``RuntimeError`` without an errno; that becomes ``ENOSPC`` when
            the folder's file system has no space left, else ``EIO``.
    """
    with open(path, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as e:
            if "PytorchStreamWriter" not in str(e) and "inline_container" not in str(e):
                raise
            full = shutil.disk_usage(path.parent).free < (1 << 20)
            code = errno.ENOSPC if full else errno.EIO
            raise OSError(code, os.strerror(code), str(path)) from e
        f.flush()
        os.fsync(f.fileno())


def clean_temporaries(checkpoint_dir: str | os.PathLike) -> list[Path]:
    """Remove hidden temporary/aside directories left by interrupted saves; returns what was removed."""
    root = Path(checkpoint_dir)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for p in root.iterdir():
        if p.is_dir() and (p.name.startswith(".tmp-step_") or p.name.startswith(".old-step_")):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def save_checkpoint(
    checkpoint_dir: str | os.PathLike,
    step: int,
    rank_states: Sequence[Any] | Callable[[int], Any],
    rank_rngs: Sequence[dict] | Callable[[int], dict] | None = None,
    *,
    plan: Any,
    world_size: int | None = None,
    seed: int = 0,
    extra: dict | None = None,
    keep: int | None = 2,
    _before_replace: Callable[[Path], None] | None = None,
) -> Path:
    """Write a checkpoint of ``step`` completed steps atomically; returns its directory.

    Args:
        checkpoint_dir: parent folder (created if missing).
        step: steps completed (the data position: training resumes with batch ``step``).
        rank_states: each rank's ``state_dict()``, as a list or as ``f(rank)`` (called once per rank,
            so only one rank's state needs to be in memory at a time).
        rank_rngs: each rank's :func:`capture_rng` states (list or ``f(rank)``), or ``None``.
        plan: the plan (for :func:`plan_hash`).
        world_size: ranks; required when ``rank_states`` is a function.
        seed: the launch's seed.
        extra: more JSON-able facts for ``meta.json`` (e.g. ``losses``).
        keep: keep this many newest ``step_*`` checkpoints (``None``: keep all).
        _before_replace: test hook called with the temporary directory just before the rename.

    ``meta.json`` is written last and records every other file's size and SHA-256 (``files``).

    Raises:
        OSError: the folder cannot be written (the temporary directory is removed again).
    """
    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    clean_temporaries(root)
    if callable(rank_states):
        if world_size is None:
            raise ValueError("world_size is required when rank_states is a function")
        get = rank_states
    else:
        world_size = len(rank_states) if world_size is None else world_size
        get = rank_states.__getitem__
    name = step_dir_name(step)
    tmp = root / f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        get_rng = (rank_rngs if callable(rank_rngs) else
                   (rank_rngs.__getitem__ if rank_rngs is not None else (lambda _r: None)))
        for r in range(world_size):
            _torch_save(RANK_STATE_ENVELOPE.wrap({"rank": r, "state_dict": get(r), "rng": get_rng(r)}),
                        tmp / _rank_file(r))
        _torch_save(capture_rng(), tmp / "rng.pt")
        files = {f.name: file_record(f) for f in sorted(tmp.iterdir()) if f.is_file()}
        meta = CHECKPOINT_ENVELOPE.wrap({
            "step": int(step), "plan_hash": plan_hash(plan), "world_size": int(world_size), "seed": int(seed),
            "time": time.time(), **(extra or {}), "files": files,
        })
        with open(tmp / "meta.json", "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1, default=str)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp)
        if _before_replace is not None:
            _before_replace(tmp)
        final = root / name
        aside = None
        if final.exists():
            aside = root / f".old-{name}-{uuid.uuid4().hex[:8]}"
            os.replace(final, aside)
        os.replace(tmp, final)
        _fsync_path(root)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None and keep > 0:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(checkpoint_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoint directories (``step_N`` with a ``meta.json``), oldest first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        step = checkpoint_step(p)
        if step is not None and p.is_dir() and (p / "meta.json").is_file():
            found.append((step, p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(checkpoint_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directory under ``checkpoint_dir``, or ``None``."""
    ck = list_checkpoints(checkpoint_dir)
    return ck[-1] if ck else None


def load_checkpoint(path: str | os.PathLike, *, plan: Any = None, world_size: int | None = None,
                    verify: bool = True) -> Checkpoint:
    """Open a checkpoint directory (rank states are read lazily) and check it fits ``plan``.

    Args:
        path: a ``step_N`` directory (or a checkpoint folder: its newest checkpoint is used).
        plan: when given, its :func:`plan_hash` must equal the checkpoint's.
        world_size: when given, must equal the checkpoint's.
        verify: check every file's integrity (:func:`verify_checkpoint`: sizes and SHA-256 of a
            checkpoint that records them, zip CRCs of an older one); this reads every file once.

    Raises:
        CheckpointDamaged: an unreadable ``meta.json``, a missing rank file, or (``verify``) a
            file that is truncated or differs from what was written; names the file.
        CheckpointError: no checkpoint there, a malformed ``meta.json``, another plan (both hashes
            named), another world size.
    """
    p = Path(path)
    if not (p / "meta.json").is_file():
        newest = latest_checkpoint(p)
        if newest is None:
            raise CheckpointError(f"no checkpoint in {p} (expected step_N directories with a meta.json)")
        p = newest
    meta = _read_meta(p)
    CHECKPOINT_ENVELOPE.check(meta, f"checkpoint file {p / 'meta.json'}")
    try:
        ck = Checkpoint(p, int(meta["step"]), str(meta["plan_hash"]), int(meta["world_size"]), meta)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {p}: meta.json lacks a valid {e}") from None
    if plan is not None:
        h = plan_hash(plan)
        if h != ck.plan_hash:
            raise CheckpointError(
                f"checkpoint {p} was written for plan {ck.plan_hash} but this plan is {h} "
                "(model, parallel degrees, segments or schedule differ); resume with the plan it was "
                "written for, or start fresh with another --checkpoint-dir or without --resume"
            )
    if world_size is not None and world_size != ck.world_size:
        raise CheckpointError(f"checkpoint {p} has {ck.world_size} ranks but this launch has {world_size}")
    missing = [r for r in range(ck.world_size) if not (p / _rank_file(r)).is_file()]
    if missing:
        raise CheckpointDamaged(f"checkpoint {p} is incomplete: no state for rank(s) {missing} "
                                f"({_rank_file(missing[0])} is missing)", path=p, file=_rank_file(missing[0]))
    if verify:
        verify_checkpoint(p, meta)
    return ck


__all__ = ["Checkpoint", "CheckpointDamaged", "CheckpointError", "verify_checkpoint", "file_record",
           "capture_rng", "restore_rng", "plan_hash", "save_checkpoint",
           "load_checkpoint", "latest_checkpoint", "list_checkpoints", "clean_temporaries", "step_dir_name",
           "checkpoint_step", "CHECKPOINT_FORMAT", "CHECKPOINT_VERSION", "RANK_STATE_FORMAT", "RANK_STATE_VERSION"]
