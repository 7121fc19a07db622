"""Atomic file writes: a reader sees the old file or the new one, never a torn one.

:func:`atomic_write_bytes` writes one file; :func:`atomic_write_files` writes a command's
output folder (``plan.json``, ``trace.json``, ``schedule.csv``) so that a failure leaves the
folder as it was: every target is checked and every file staged before the first one replaces
its old version. Files get the permissions of a plain ``open()`` (``0o666`` less the umask),
not :func:`tempfile.mkstemp`'s ``0o600``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Mapping

from engine.errors import OutputPathError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _stage(path: Path, data: bytes | bytearray | memoryview) -> str:
    """Write ``data`` to a fsynced temp file beside ``path`` with plain-file permissions; returns its name."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            os.fsync(f.fileno())
    except BaseException:
        _unlink(tmp)
        raise
    return tmp


def _unlink(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


def check_output_folder(folder: str | os.PathLike, names: list[str] | tuple[str, ...] = (), *,
                        option: str = "-o/--output") -> Path:
    """Check that ``folder`` can hold the files ``names`` before any work writes them.

    Raises:
        OutputPathError: ``folder`` is an existing file, or one of ``folder/name`` is a folder.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise OutputPathError(f"{option} {folder} is an existing file, not a folder; name a folder "
                              "(it is created if missing)")
    for name in names:
        if (folder / name).is_dir():
            raise OutputPathError(f"{folder / name} is a folder, so {name} cannot be written there; remove it "
                                  f"or choose another {option} folder")
    return folder


def atomic_write_files(folder: str | os.PathLike, files: Mapping[str, str | bytes], *,
                       option: str = "-o/--output") -> dict[str, Path]:
    """Write several files into ``folder`` all-or-nothing (as far as POSIX allows).

    Every target is checked (:func:`check_output_folder`) and every file is staged (written and
    fsynced beside its target) before the first ``os.replace``; a failure while checking or
    staging leaves ``folder`` unchanged. Text is written as UTF-8.

    Args:
        folder: the output folder; created if missing.
        files: ``{file name: text or bytes}``.
        option: the command-line option naming the folder, for messages.

    Returns:
        ``{file name: path written}``.

    Raises:
        OutputPathError: the folder is a file or a target is a folder.
        OSError: the folder cannot be created or written.
    """
    folder = check_output_folder(folder, list(files), option=option)
    folder.mkdir(parents=True, exist_ok=True)
    staged: dict[str, str] = {}
    try:
        for name, data in files.items():
            staged[name] = _stage(folder / name, data.encode("utf-8") if isinstance(data, str) else data)
    except BaseException:
        for tmp in staged.values():
            _unlink(tmp)
        raise
    out = {}
    for name, tmp in staged.items():
        os.replace(tmp, folder / name)
        out[name] = folder / name
    return out


def atomic_write_bytes(path: str | os.PathLike, data: bytes | bytearray | memoryview) -> Path:
    """Write ``data`` to ``path`` atomically (temp file in the same folder, fsync, ``os.replace``).

    Creates missing parent folders. Returns the path.

    Raises:
        OSError: the folder cannot be created or written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _stage(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8, newlines as given) to ``path`` atomically (:func:`atomic_write_bytes`).

    Raises:
        OSError: the folder cannot be created or written.
    """
    return atomic_write_bytes(path, text.encode("utf-8"))
