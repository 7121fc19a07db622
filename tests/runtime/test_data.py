"""ByteCorpus: byte-level LM data from the CPython standard library, split by file."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from engine.errors import DataError
from runtime.data import ByteCorpus


@pytest.fixture(scope="module")
def corpus() -> ByteCorpus:
    return ByteCorpus(seq_len=64, val_fraction=0.1, seed=0)


def test_reads_the_standard_library_split_by_file(corpus):
    root = Path(sysconfig.get_paths()["stdlib"])
    assert corpus.root == root
    train, val = set(corpus.train_files), set(corpus.val_files)
    assert train and val and not (train & val), "a file must not be in both splits"
    assert all(p.suffix == ".py" and root in p.parents for p in train | val)
    assert not any("site-packages" in p.parts for p in train | val)
    n = len(train) + len(val)
    assert abs(len(val) - round(0.1 * n)) <= 1
    assert corpus.train_bytes > 1_000_000 and corpus.val_bytes > 10_000


def test_shapes_dtype_and_byte_vocabulary(corpus):
    b = corpus.train_batch(0, 8)
    assert b.shape == (8, 65) and b.dtype == torch.int64
    assert int(b.min()) >= 0 and int(b.max()) < 256
    v = corpus.val_batch(0, 4)
    assert v.shape == (4, 65) and v.dtype == torch.int64 and int(v.max()) < 256
    text = bytes(b.flatten().tolist())
    assert text.isascii() or b"\n" in text     # it is source code


def test_batches_are_deterministic_per_seed_and_step(corpus):
    again = ByteCorpus(seq_len=64, val_fraction=0.1, seed=0)
    assert again.val_files == corpus.val_files
    assert torch.equal(corpus.train_batch(5, 4), again.train_batch(5, 4))
    assert torch.equal(corpus.val_batch(2, 4), again.val_batch(2, 4))
    assert not torch.equal(corpus.train_batch(5, 4), corpus.train_batch(6, 4))
    other = ByteCorpus(seq_len=64, val_fraction=0.1, seed=1)
    assert other.val_files != corpus.val_files
    assert not torch.equal(other.train_batch(5, 4), corpus.train_batch(5, 4))


def test_validation_batches_are_consecutive_windows(corpus):
    a, b = corpus.val_batch(0, 2), corpus.val_batch(1, 2)
    assert not torch.equal(a, b)
    assert corpus.num_val_batches(2) >= 1


def test_windows_come_from_their_split(tmp_path):
    for i in range(10):
        (tmp_path / f"m{i}.py").write_bytes(bytes([65 + i]) * 200)   # file i is all one letter
    c = ByteCorpus(tmp_path, seq_len=16, val_fraction=0.2, seed=3)
    val_letters = {p.read_bytes()[0] for p in c.val_files}
    train_letters = {p.read_bytes()[0] for p in c.train_files}
    assert len(c.val_files) == 2 and not (val_letters & train_letters)
    for step in range(20):
        assert set(c.train_batch(step, 4).flatten().tolist()) <= train_letters
    for i in range(5):
        assert set(c.val_batch(i, 3).flatten().tolist()) <= val_letters


def test_missing_or_empty_folder_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        ByteCorpus(tmp_path / "nope")
    with pytest.raises(DataError, match=r"\.py"):
        ByteCorpus(tmp_path)
    with pytest.raises(ValueError, match="val_fraction"):
        ByteCorpus(tmp_path, val_fraction=1.5)


def test_missing_stdlib_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path / "gone")})
    with pytest.raises(DataError, match="standard library"):
        ByteCorpus()
