"""The ``contrastive`` task (docstring / function-body pairs of the CPython sources) and the
two-tower model it trains (``two-tower-tiny``): pairs checked against ``ast`` directly, batches
deterministic and split by file, the symmetric InfoNCE loss against a hand computation, and the
model against its own towers and head."""

from __future__ import annotations

import ast

import pytest
import torch

from engine.errors import TaskError
from tasks import TaskContext, get_task
from tasks.contrastive import PAD, contrastive_loss, function_pairs

T = 48


def _task(seed: int = 0):
    return get_task("contrastive", TaskContext(seq_len=T, vocab_size=256, seed=seed, model_name="two-tower-tiny"))


def test_pairs_are_each_functions_docstring_and_its_code_without_it():
    path = ast.__file__
    pairs = function_pairs(path)
    src = open(path, "rb").read()
    tree = ast.parse(src)
    want = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and ast.get_docstring(n) and len(n.body) > 1]
    assert len(pairs) == len(want) > 10
    for (doc, code), node in zip(pairs, want):
        assert doc == ast.get_docstring(node).encode()
        assert code.lstrip().startswith((b"def ", b"async def ", b"@"))
        assert ast.get_docstring(node).splitlines()[0].encode() not in code   # the docstring is gone
        assert ast.parse(b"if 1:\n" + code if code.startswith(b" ") else code)   # the rest still parses


def test_batches_are_deterministic_padded_bytes_from_disjoint_files():
    task = _task()
    text, code, ids = task.train_batch(3, 8)
    assert text.shape == code.shape == (8, T) and ids.shape == (8,)
    assert text.dtype == code.dtype == ids.dtype == torch.int64
    assert int(text.min()) >= 0 and int(text.max()) < 256
    assert all(torch.equal(a, b) for a, b in zip(task.train_batch(3, 8), (text, code, ids)))
    assert not torch.equal(task.train_batch(4, 8)[0], text)
    for row in text:   # padding only at the end
        nz = (row != PAD).nonzero()
        assert len(nz) and int(nz.max()) == len(nz) - 1
    assert not set(task.train_files) & set(task.val_files) and task.val_files
    assert task.val_batch(0, 4)[0].shape == (4, T)


def test_symmetric_infonce_by_hand():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 4, generator=g)
    ids = torch.tensor([7, 8, 9, 10])
    rows = -torch.log_softmax(logits, 1).diag().mean()
    cols = -torch.log_softmax(logits, 0).diag().mean()
    assert torch.allclose(contrastive_loss(logits, ids), (rows + cols) / 2, rtol=1e-6)
    dup = torch.tensor([7, 7, 9, 10])   # the same pair drawn twice: both codes are positives of both texts
    lp = torch.log_softmax(logits, 1)
    row0 = -(lp[0, 0] + lp[0, 1]) / 2
    got = contrastive_loss(logits, dup)
    assert not torch.allclose(got, contrastive_loss(logits, ids))
    lpc = torch.log_softmax(logits, 0)
    by_hand = 0.5 * ((row0 + -(lp[1, 0] + lp[1, 1]) / 2 - lp[2, 2] - lp[3, 3]) / 4
                     + (-(lpc[0, 0] + lpc[1, 0]) / 2 - (lpc[0, 1] + lpc[1, 1]) / 2 - lpc[2, 2] - lpc[3, 3]) / 4)
    assert torch.allclose(got, by_hand, rtol=1e-6)
    with pytest.raises(TaskError, match="logits \\[B, B\\]"):
        contrastive_loss(torch.zeros(4, 5), ids)


def test_two_tower_model_is_its_towers_and_head():
    from engine.models import build_model

    b = build_model("two-tower-tiny", batch_size=4, seq_len=T, device="cpu")
    assert b.task == "contrastive" and len(b.example_inputs) == 2
    text, code, ids = _task().train_batch(0, 4)
    m = b.module
    logits = m(text, code)
    a = torch.nn.functional.normalize(m.text(text), dim=-1)
    c = torch.nn.functional.normalize(m.code(code), dim=-1)
    assert torch.allclose(logits, a @ c.T / m.config.temperature, rtol=1e-5, atol=1e-6)
    assert not list(m.head.parameters())
    loss = _task().loss(logits, ids)
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())


def test_contrastive_refuses_models_without_a_sequence():
    with pytest.raises(TaskError, match="needs a model with a sequence length"):
        get_task("contrastive", TaskContext(seq_len=None))
