"""Byte-level language-model data from the CPython standard library sources (``runtime.data``
re-exports it).

Every machine that runs Python has real text to train on: the ``*.py`` files of the standard
library (``sysconfig.get_paths()["stdlib"]``), read as raw bytes (vocabulary 0..255, so any
byte-vocabulary model such as ``gpt2-tiny`` / ``gpt2-small-cpu`` / ``tessel-gpt`` trains on it
without a tokenizer).

Design choices:

- **Deterministic file list.** Files are found with ``os.walk`` (``site-packages``,
  ``dist-packages`` and ``__pycache__`` are skipped, so installed packages never leak in) and
  sorted by their path relative to the root. Nothing is read at construction except file sizes.
- **Split by file.** The sorted list is shuffled with ``random.Random(seed)``; the first
  ``max(1, round(val_fraction * n))`` files are the validation split, the rest the training split,
  so no file contributes to both.
- **Batches depend only on (seed, step).** Each split is a virtual concatenation of its files (in
  split order). ``train_batch(step, b)`` draws ``b`` start offsets uniformly from that stream with a
  ``torch.Generator`` seeded from ``(seed, step)`` and reads ``seq_len + 1`` bytes from each (a
  window may cross a file boundary). No iterator state exists, so resuming at step ``s`` needs
  nothing but ``s``; ``state()``/``load_state()`` are not needed.
- **Validation is a fixed sweep.** ``val_batch(i, b)`` returns consecutive, non-overlapping
  windows ``i*b .. i*b+b-1`` of the validation stream (wrapping around at its end).
- Files are opened and read on demand (one ``seek`` + ``read`` per window), so construction
  takes milliseconds and memory stays flat.
"""

from __future__ import annotations

import bisect
import os
import random
import sysconfig
from pathlib import Path

import torch

from engine.errors import DataError

__all__ = ["ByteCorpus", "stdlib_root"]

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    """The directory of the CPython standard library sources (``sysconfig`` ``stdlib`` path).

    Raises:
        DataError: the directory does not exist (e.g. a stripped, zip-only Python install).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(
            f"the Python standard library sources are not at {root} (sysconfig 'stdlib'); "
            "install the full Python distribution or pass ByteCorpus(root=<a folder of .py files>)")
    return root


def _find_py_files(root: Path) -> list[Path]:
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for f in filenames:
            if f.endswith(".py"):
                found.append(Path(dirpath) / f)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


class _Stream:
    """A virtual concatenation of files, read by global byte offset."""

    def __init__(self, files: list[Path], sizes: list[int]):
        self.files = files
        self.sizes = sizes
        self.starts: list[int] = []
        total = 0
        for s in sizes:
            self.starts.append(total)
            total += s
        self.total = total

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes starting at global ``offset`` (crossing file boundaries as needed)."""
        out = bytearray()
        k = bisect.bisect_right(self.starts, offset) - 1
        pos = offset - self.starts[k]
        while len(out) < n:
            with open(self.files[k], "rb") as fh:
                fh.seek(pos)
                out += fh.read(n - len(out))
            k += 1
            pos = 0
            if k == len(self.files) and len(out) < n:
                raise DataError(f"read past the end of the corpus at offset {offset}+{n}")
        return bytes(out)


class ByteCorpus:
    """Byte-level LM batches from the CPython standard library (or any folder of ``.py`` files).

    Args:
        root: folder searched recursively for ``*.py`` files; ``None`` means the standard library
            (:func:`stdlib_root`).
        seq_len: tokens per sample; each row holds ``seq_len + 1`` bytes so that
            ``inputs = row[:-1]`` and ``targets = row[1:]``.
        val_fraction: share of FILES (not bytes) held out for validation, in ``(0, 1)``.
        seed: seeds the file split and every training batch.

    Raises:
        DataError: ``root`` is missing, holds no ``.py`` files, or a split has fewer than
            ``seq_len + 1`` bytes.
        ValueError: ``seq_len < 1`` or ``val_fraction`` outside ``(0, 1)``.

    Attributes:
        train_files, val_files: the two splits (disjoint lists of paths).
        train_bytes, val_bytes: bytes in each split.
    """

    vocab_size = 256

    def __init__(self, root: str | Path | None = None, seq_len: int = 128, val_fraction: float = 0.1,
                 seed: int = 0):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if root is None:
            root = stdlib_root()
        root = Path(root)
        if not root.is_dir():
            raise DataError(f"corpus folder {root} does not exist")
        files = [p for p in _find_py_files(root) if p.stat().st_size > 0]
        if len(files) < 2:
            raise DataError(f"{root} holds {len(files)} non-empty .py file(s); a train/validation "
                            "split by file needs at least 2")
        self.root = root
        self.seq_len = int(seq_len)
        self.val_fraction = float(val_fraction)
        self.seed = int(seed)
        order = list(files)
        random.Random(self.seed).shuffle(order)
        n_val = min(len(order) - 1, max(1, round(self.val_fraction * len(order))))
        self.val_files = order[:n_val]
        self.train_files = order[n_val:]
        self._train = _Stream(self.train_files, [p.stat().st_size for p in self.train_files])
        self._val = _Stream(self.val_files, [p.stat().st_size for p in self.val_files])
        for name, st in (("training", self._train), ("validation", self._val)):
            if st.total < self.seq_len + 1:
                raise DataError(f"the {name} split of {root} has {st.total} bytes, fewer than "
                                f"seq_len + 1 = {self.seq_len + 1}")

    @property
    def train_bytes(self) -> int:
        return self._train.total

    @property
    def val_bytes(self) -> int:
        return self._val.total

    def num_val_batches(self, batch_size: int) -> int:
        """Batches of :meth:`val_batch` that sweep the validation split once (at least 1)."""
        return max(1, self._val.total // ((self.seq_len + 1) * batch_size))

    def _rows(self, stream: _Stream, offsets: list[int]) -> torch.Tensor:
        n = self.seq_len + 1
        buf = b"".join(stream.read(o, n) for o in offsets)
        return torch.frombuffer(bytearray(buf), dtype=torch.uint8).view(len(offsets), n).long()

    def train_batch(self, step: int, batch_size: int) -> torch.Tensor:
        """Training batch number ``step``: int64 ``[batch_size, seq_len + 1]``, values 0..255.

        Deterministic: the same ``(seed, step, batch_size)`` always gives the same bytes.
        """
        if batch_size < 1 or step < 0:
            raise ValueError(f"need step >= 0 and batch_size >= 1, got step={step}, batch_size={batch_size}")
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + int(step)) % (2**63 - 1))
        hi = self._train.total - (self.seq_len + 1) + 1
        offsets = torch.randint(0, hi, (batch_size,), generator=gen).tolist()
        return self._rows(self._train, offsets)

    def val_batch(self, i: int, batch_size: int) -> torch.Tensor:
        """Validation batch ``i``: int64 ``[batch_size, seq_len + 1]`` of consecutive windows."""
        if batch_size < 1 or i < 0:
            raise ValueError(f"need i >= 0 and batch_size >= 1, got i={i}, batch_size={batch_size}")
        n = self.seq_len + 1
        windows = self._val.total // n
        offsets = [((i * batch_size + j) % windows) * n for j in range(batch_size)]
        return self._rows(self._val, offsets)

    def __repr__(self) -> str:
        return (f"ByteCorpus(root={str(self.root)!r}, seq_len={self.seq_len}, train={len(self.train_files)} files "
                f"/ {self.train_bytes} B, val={len(self.val_files)} files / {self.val_bytes} B, seed={self.seed})")
