"""User tasks given as ``package.module:callable`` (``tasks.user``): the example task through
``get_task``, and one clear sentence for every way a user task can be wrong."""

from __future__ import annotations

import pytest
import torch
from user_task_example import ByteClassTask, byte_class

from engine.errors import TaskError
from tasks import TaskContext, get_task
from tasks.registry import check_task_name

CTX = TaskContext(seq_len=16, vocab_size=256, seed=4, model_name="gpt2-tiny")


def test_example_task_through_get_task():
    task = get_task("user_task_example:make_task", CTX)
    assert task.name == "user_task_example:make_task" and task.unit == "tokens"
    assert task.input_names == ("input_ids",)
    ids, classes = task.train_batch(2, 5)
    ref = ByteClassTask(16, seed=4).train_batch(2, 5)   # called with the context's seq_len and seed
    assert torch.equal(ids, ref[0]) and torch.equal(classes, ref[1])
    assert ids.shape == classes.shape == (5, 16)
    # the classes are a hand count of the bytes
    for b, c in zip(ids.flatten().tolist(), classes.flatten().tolist()):
        ch = chr(b)
        want = 0 if ch.isascii() and ch.isalpha() else 1 if ch.isdigit() else 2 if ch in " \t\r\n" else 3
        assert c == want
    assert torch.equal(byte_class(torch.tensor([65, 48, 32, 33])), torch.tensor([0, 1, 2, 3]))
    logits = torch.randn(5, 16, 256, generator=torch.Generator().manual_seed(0))
    loss = task.loss(logits, classes)
    by_hand = -torch.log_softmax(logits[..., :4], -1).gather(-1, classes[..., None]).mean()
    assert loss.shape == () and torch.allclose(loss, by_hand, rtol=1e-6)
    assert task.count(classes) == 5 * 16                 # tokens: rows x T
    assert torch.equal(task.example_inputs(3)[0], task.train_batch(0, 3)[0])


@pytest.mark.parametrize("name, message", [
    ("user_task_example:no_loss_task", r"returned a Broken without loss; a task needs train_batch"),
    ("user_task_example:needs_tokenizer", r"requires argument\(s\) tokenizer_path"),
    ("user_task_example:nothing_here", r"module 'user_task_example' has no attribute 'nothing_here'"),
    ("no_such_module_xyz:make", r"cannot import module 'no_such_module_xyz'"),
    ("user_task_example:NUM_CLASSES", r"'NUM_CLASSES' is not callable"),
])
def test_user_task_errors_are_one_sentence(name, message):
    with pytest.raises(TaskError, match=message) as e:
        get_task(name, CTX)
    assert "\n" not in str(e.value) and name.split(":")[0] in str(e.value)


def test_user_task_batches_are_checked():
    task = get_task("user_task_example:ragged_task", CTX)
    with pytest.raises(TaskError, match=r"every tensor's first dimension must be 3"):
        task.train_batch(0, 3)


def test_task_names_are_checked_without_importing():
    assert check_task_name("any.module:fn") == "any.module:fn"
    for bad in ("causal", ":fn", "mod:"):
        with pytest.raises(TaskError, match="unknown task"):
            check_task_name(bad)
