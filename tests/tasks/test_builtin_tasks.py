"""The built-in tasks (``tasks.get_task``): shapes, dtypes, determinism, the data they are made of
(checked against the byte corpus and scikit-learn's digits directly), masking rates, span
corruption that decodes back to its window, and losses against a hand computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.errors import TaskError
from tasks import TASKS, TaskContext, get_task
from tasks.corpus import ByteCorpus
from tasks.span import span_corruption_lengths

T = 32


def _ctx(**kw) -> TaskContext:
    return TaskContext(**{"seq_len": T, "seed": 0, "model_name": "m", **kw})


# ----------------------------------------------------------------------------- registry
def test_unknown_task_names_the_valid_ones():
    with pytest.raises(TaskError, match=r"unknown task 'nope'; valid tasks: causal-lm, masked-lm, seq2seq, "
                                        r"image-classification, contrastive, or user code"):
        get_task("nope", _ctx())
    assert set(TASKS) >= {"causal-lm", "masked-lm", "seq2seq", "image-classification", "contrastive"}


def test_units_and_inputs():
    assert get_task("causal-lm", _ctx()).unit == "tokens"
    assert get_task("masked-lm", _ctx(vocab_size=260)).input_names == ("input_ids",)
    s = get_task("seq2seq", _ctx(vocab_size=300))
    assert s.input_names == ("input_ids", "decoder_input_ids") and s.num_inputs == 2
    d = get_task("image-classification", _ctx(seq_len=None))
    assert d.unit == "samples" and d.num_inputs == 1


# ----------------------------------------------------------------------------- causal-lm
def test_causal_lm_is_the_shifted_byte_corpus_window():
    task = get_task("causal-lm", _ctx(seed=3))
    corpus = ByteCorpus(seq_len=T, seed=3)           # the legacy batch of the same step
    for step in (0, 5):
        ids, labels = task.train_batch(step, 4)
        rows = corpus.train_batch(step, 4)
        assert ids.dtype == labels.dtype == torch.int64 and ids.shape == labels.shape == (4, T)
        assert torch.equal(ids, rows[:, :-1]) and torch.equal(labels, rows[:, 1:])
    vi, vl = task.val_batch(1, 4)
    vrows = corpus.val_batch(1, 4)
    assert torch.equal(vi, vrows[:, :-1]) and torch.equal(vl, vrows[:, 1:])
    assert not torch.equal(task.train_batch(0, 4)[0], task.train_batch(1, 4)[0])


def test_causal_lm_loss_and_count():
    task = get_task("causal-lm", _ctx())
    ids, labels = task.train_batch(0, 2)
    logits = torch.randn(2, T, 256, generator=torch.Generator().manual_seed(0))
    by_hand = -torch.log_softmax(logits, -1).gather(-1, labels[..., None]).mean()
    assert torch.allclose(task.loss(logits, labels), by_hand, rtol=1e-6)
    assert task.count(labels) == 2 * T


def test_causal_lm_refuses_a_small_vocabulary():
    with pytest.raises(TaskError, match="vocabulary of 100"):
        get_task("causal-lm", _ctx(vocab_size=100))
    with pytest.raises(TaskError, match="sequence length"):
        get_task("causal-lm", _ctx(seq_len=None))


# ----------------------------------------------------------------------------- masked-lm
def test_masked_lm_masks_like_bert():
    vocab, rows, t = 260, 256, 128
    task = get_task("masked-lm", _ctx(seq_len=t, vocab_size=vocab, seed=1))
    ids, labels = task.train_batch(7, rows)
    raw = ByteCorpus(seq_len=t - 1, seed=1).train_batch(7, rows)   # the windows before masking
    assert ids.shape == labels.shape == (rows, t) and ids.dtype == labels.dtype == torch.int64
    selected = labels != -100
    n = round(0.15 * t)
    assert (selected.sum(1) == n).all()                      # BERT's num_to_predict per row
    assert torch.equal(labels[selected], raw[selected])      # targets are the original bytes
    assert torch.equal(ids[~selected], raw[~selected])       # the rest is untouched
    sel_in, sel_raw = ids[selected], raw[selected]
    total = sel_in.numel()
    masked = (sel_in == vocab - 1).float().sum() / total
    kept = (sel_in == sel_raw).float().sum() / total
    changed = ((sel_in != vocab - 1) & (sel_in != sel_raw)).float().sum() / total
    assert abs(masked - 0.8) < 0.03 and abs(kept - 0.1) < 0.02 and abs(changed - 0.1) < 0.02
    assert (ids < 256).logical_or(ids == vocab - 1).all()    # random replacements are bytes
    # deterministic in (seed, step); other steps differ
    again = task.train_batch(7, rows)
    assert torch.equal(again[0], ids) and torch.equal(again[1], labels)
    assert not torch.equal(task.train_batch(8, rows)[1], labels)


def test_masked_lm_loss_is_mean_over_selected_positions():
    task = get_task("masked-lm", _ctx(vocab_size=260))
    ids, labels = task.train_batch(0, 3)
    logits = torch.randn(3, T, 260, generator=torch.Generator().manual_seed(1))
    sel = labels != -100
    by_hand = -torch.log_softmax(logits[sel], -1).gather(-1, labels[sel][:, None]).mean()
    assert torch.allclose(task.loss(logits, labels), by_hand, rtol=1e-6)


def test_masked_lm_needs_a_mask_id():
    with pytest.raises(TaskError, match=r"\[MASK\].*vocab_size=256"):
        get_task("masked-lm", _ctx(vocab_size=256))


# ----------------------------------------------------------------------------- seq2seq
def _decode(inp: list[int], tgt: list[int], vocab: int) -> list[int]:
    """Undo span corruption: each sentinel in the input becomes the target's bytes after it."""
    spans: dict[int, list[int]] = {}
    cur = None
    for x in tgt:
        if x >= 256:
            cur = x
            spans[cur] = []
        else:
            spans[cur].append(x)
    out: list[int] = []
    for x in inp:
        out += spans[x] if x >= 256 else [x]
    return out


def test_seq2seq_span_corruption_decodes_to_the_window():
    vocab, rows, t = 300, 64, 64
    task = get_task("seq2seq", _ctx(seq_len=t, vocab_size=vocab, seed=2))
    raw_len, tgt_len = span_corruption_lengths(t)
    inp, dec, lab = task.train_batch(4, rows)
    assert inp.shape == (rows, t) and dec.shape == lab.shape == (rows, tgt_len)
    assert inp.dtype == dec.dtype == lab.dtype == torch.int64
    raw = ByteCorpus(seq_len=raw_len - 1, seed=2).train_batch(4, rows)
    noise = (raw_len - t + tgt_len) // 2   # T = raw - noise + spans, T' = noise + spans
    spans = tgt_len - noise
    lengths = []
    for r in range(rows):
        i, l_ = inp[r].tolist(), lab[r].tolist()
        assert _decode(i, l_, vocab) == raw[r].tolist()
        sentinels = [x for x in i if x >= 256]
        assert sentinels == [vocab - 1 - k for k in range(spans)] == [x for x in l_ if x >= 256]
        assert i[-1] == vocab - 1 - (spans - 1)               # the window ends in noise (T5)
        run, row = 0, []
        for x in l_[1:] + [vocab]:
            if x >= 256:
                row.append(run)
                run = 0
            else:
                run += 1
        assert len(row) == spans and sum(row) == noise
        lengths += row
    assert min(lengths) >= 1 and abs(sum(lengths) / len(lengths) - 3.0) < 0.5   # mean span length 3
    assert (dec[:, 0] == 0).all() and torch.equal(dec[:, 1:], lab[:, :-1])      # shifted right, start id 0
    again = task.train_batch(4, rows)
    assert all(torch.equal(a, b) for a, b in zip(again, (inp, dec, lab)))
    vi, _, vl = task.val_batch(0, 8)
    vraw = ByteCorpus(seq_len=raw_len - 1, seed=2).val_batch(0, 8)
    assert all(_decode(vi[r].tolist(), vl[r].tolist(), vocab) == vraw[r].tolist() for r in range(8))


def test_seq2seq_loss_count_and_vocab_check():
    task = get_task("seq2seq", _ctx(vocab_size=300))
    inp, dec, lab = task.train_batch(0, 2)
    logits = torch.randn(2, lab.shape[1], 300, generator=torch.Generator().manual_seed(2))
    by_hand = -torch.log_softmax(logits, -1).gather(-1, lab[..., None]).mean()
    assert torch.allclose(task.loss(logits, lab), by_hand, rtol=1e-6)
    assert task.count(lab) == 2 * T
    with pytest.raises(TaskError, match="sentinel"):
        get_task("seq2seq", _ctx(vocab_size=257))


# ----------------------------------------------------------------------------- image-classification
def test_digits_split_and_batches():
    from sklearn.datasets import load_digits

    d = load_digits()
    task = get_task("image-classification", _ctx(seq_len=None, seed=5))
    key = lambda img, y: (tuple((img.flatten() * 16).round().int().tolist()), int(y))  # noqa: E731
    all_samples = [key(torch.tensor(im, dtype=torch.float32) / 16, y) for im, y in zip(d.images, d.target)]
    train_keys = {all_samples[i] for i in task.train_index.tolist()}
    val_keys = {all_samples[i] for i in task.val_index.tolist()}
    assert len(task.train_index) == 1500 and len(task.val_index) == 297
    assert set(task.train_index.tolist()).isdisjoint(task.val_index.tolist())
    assert sorted(task.train_index.tolist() + task.val_index.tolist()) == list(range(1797))
    images, labels = task.train_batch(3, 64)
    assert images.shape == (64, 1, 8, 8) and images.dtype == torch.float32 and labels.dtype == torch.int64
    assert images.min() >= 0 and images.max() <= 1 and labels.max() < 10
    assert all(key(images[r, 0], labels[r]) in train_keys for r in range(64))
    vimages, vlabels = task.val_batch(0, 32)
    assert all(key(vimages[r, 0], vlabels[r]) in val_keys for r in range(32))
    assert torch.equal(task.train_batch(3, 64)[0], images) and not torch.equal(task.train_batch(4, 64)[0], images)
    # another seed, another split
    other = get_task("image-classification", _ctx(seq_len=None, seed=6))
    assert not torch.equal(other.val_index, task.val_index)
    logits = torch.randn(64, 10, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(task.loss(logits, labels), F.cross_entropy(logits, labels))
    assert task.count(labels) == 64
