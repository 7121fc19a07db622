"""The ``contrastive`` task: match CPython docstrings to their function bodies (code search).

Real pairs from every machine's CPython standard library: for each function or method with a
docstring (``ast.get_docstring``) and at least one statement after it, the *text* is the
docstring and the *code* is the function's source with the docstring removed (``def`` line,
body), both as bytes, cut or padded with byte 0 to ``T`` positions. This is CodeSearchNet's
pairing (Husain et al., "CodeSearchNet Challenge", 2019, section 2: a function's documentation
against its code), on bytes instead of tokens.

A batch is ``(text_ids [rows, T], code_ids [rows, T], pair_ids [rows])`` (int64): two model inputs
and the target, a pair's identity (equal ids mark the same function drawn twice). The loss of a
micro-batch is the symmetric InfoNCE of CLIP (Radford et al., 2021, figure 3): for logits ``[B, B]``
from a two-tower model (:class:`engine.models.two_tower.TwoTower`), the mean of the cross-entropy
of each row and of each column against its positives (the matching pairs, normalised). Throughput
counts samples (pairs).

Determinism and the split: the files (those of :mod:`tasks.corpus`' list holding a docstring
quote and a ``def``) are split by file with ``random.Random(seed)`` (10% validation, as the byte
corpus); ``train_batch(step, rows)`` draws a file and a function in it with a generator seeded from
``(seed, step)``. Files are parsed with ``ast`` on first use and cached, so a batch costs at most
``rows`` parses and the first ones a few milliseconds each.
"""

from __future__ import annotations

import ast
import functools
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.errors import DataError, TaskError
from tasks import _seed
from tasks.base import Task, TaskContext, Unit
from tasks.corpus import _find_py_files, stdlib_root

__all__ = ["ContrastivePairs", "function_pairs", "contrastive_loss", "PAD"]

PAD = 0
"""Padding byte id (byte 0 never occurs in the sources)."""

VAL_FRACTION = 0.1


@functools.lru_cache(maxsize=4096)
def function_pairs(path: str) -> tuple[tuple[bytes, bytes], ...]:
    """``(docstring, code)`` byte pairs of every function and method of the file ``path`` that has a
    docstring and a statement after it; the code is the function's source lines without the
    docstring's lines. ``()`` for a file that does not parse."""
    try:
        src = Path(path).read_bytes()
        tree = ast.parse(src)
    except (SyntaxError, ValueError, OSError):
        return ()
    lines = src.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        doc = ast.get_docstring(node)
        first = node.body[0]
        if not doc or first.end_lineno is None or node.end_lineno is None:
            continue
        start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
        code = b"".join(lines[start:first.lineno - 1] + lines[first.end_lineno:node.end_lineno])
        out.append((doc.encode("utf-8", "replace"), code))
    return tuple(out)


def _row(data: bytes, t: int) -> list[int]:
    data = data[:t].replace(b"\x00", b" ")
    return list(data) + [PAD] * (t - len(data))


def contrastive_loss(logits: torch.Tensor, pair_ids: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE: ``logits [B, B]`` (text ``i`` against code ``j``), ``pair_ids [B]`` int64;
    row and column cross-entropies against the positives (``pair_ids[i] == pair_ids[j]``, each row's
    positives sharing probability 1), averaged. A float32 scalar."""
    if logits.dim() != 2 or logits.shape[0] != logits.shape[1] or logits.shape[0] != pair_ids.shape[0]:
        raise TaskError(f"the contrastive loss needs logits [B, B] for B pairs; got logits {tuple(logits.shape)} "
                        f"for {pair_ids.shape[0]} pairs (is the model a two-tower model?)")
    pos = (pair_ids[:, None] == pair_ids[None, :]).float()
    target = pos / pos.sum(dim=1, keepdim=True)
    lg = logits.float()
    return 0.5 * (F.cross_entropy(lg, target) + F.cross_entropy(lg.transpose(0, 1), target))


@functools.lru_cache(maxsize=8)
def _split(seed: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    try:
        files = [p for p in _find_py_files(stdlib_root()) if b'"""' in (b := p.read_bytes()) and b"def " in b]
    except DataError as e:
        raise TaskError(f"the contrastive task needs the CPython sources: {e}") from e
    if len(files) < 2:
        raise TaskError("the contrastive task found fewer than 2 standard library files with docstrings")
    order = [str(p) for p in files]
    random.Random(seed).shuffle(order)
    n_val = min(len(order) - 1, max(1, round(VAL_FRACTION * len(order))))
    return tuple(order[n_val:]), tuple(order[:n_val])


class ContrastivePairs(Task):
    """Docstring / function-body pairs of the CPython sources (see the module docstring).

    Args:
        ctx: ``seq_len`` (``T``, bytes per docstring and per body; required), ``vocab_size``
            (``>= 256`` when known), ``seed``.

    Raises:
        TaskError: no ``seq_len``, a vocabulary under 256, or no standard library sources.
    """

    name = "contrastive"
    unit: Unit = "samples"
    input_names = ("text_ids", "code_ids")

    def __init__(self, ctx: TaskContext):
        if ctx.seq_len is None or ctx.seq_len < 1:
            raise TaskError(f"task contrastive needs a model with a sequence length, but {ctx.model_name} has "
                            f"seq_len={ctx.seq_len}; plan it with --seq-len")
        if ctx.vocab_size is not None and ctx.vocab_size < 256:
            raise TaskError(f"task contrastive reads bytes (ids 0..255) but {ctx.model_name} has a vocabulary of "
                            f"{ctx.vocab_size}; use a model with vocab_size >= 256")
        self.seq_len, self.seed = int(ctx.seq_len), int(ctx.seed)
        self.train_files, self.val_files = _split(self.seed)

    def _batch(self, files: tuple[str, ...], gen: torch.Generator, rows: int) -> tuple[torch.Tensor, ...]:
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        text: list[list[int]] = []
        code: list[list[int]] = []
        ids: list[int] = []
        while len(ids) < rows:
            f = int(torch.randint(0, len(files), (1,), generator=gen))
            pairs = function_pairs(files[f])
            if not pairs:
                continue
            j = int(torch.randint(0, len(pairs), (1,), generator=gen))
            doc, body = pairs[j]
            text.append(_row(doc, self.seq_len))
            code.append(_row(body, self.seq_len))
            ids.append(f * 100_000 + j)
        return torch.tensor(text), torch.tensor(code), torch.tensor(ids)

    def train_batch(self, step: int, rows: int) -> tuple[torch.Tensor, ...]:
        """``(text_ids [rows, T], code_ids [rows, T], pair_ids [rows])`` int64 from the training files,
        deterministic in ``(seed, step)``."""
        return self._batch(self.train_files, _seed.generator(self.seed, step, _seed.TRAIN), rows)

    def val_batch(self, index: int, rows: int) -> tuple[torch.Tensor, ...]:
        """Like :meth:`train_batch` from the held-out files, deterministic in ``(seed, index)``."""
        return self._batch(self.val_files, _seed.generator(self.seed, index, _seed.VAL), rows)

    def loss(self, output: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        """:func:`contrastive_loss` of the model's logits ``[B, B]`` against ``pair_ids [B]``."""
        return contrastive_loss(output, targets[0])
