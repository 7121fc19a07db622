"""The vocab-parallel cross-entropy (``runtime.vocab_parallel_loss``) equals ``F.cross_entropy`` on
the unsharded logits: loss and the gradients of the logits, for every reduction, with ignored
rows, with a vocabulary that the ranks split unevenly (torch.chunk's layout, as ``Shard`` uses), and
calls it does not handle (class weights here) fall through to PyTorch's ``loss_parallel`` unchanged.
Two gloo ranks (``worker_harness.WorkerPool``); the reference is PyTorch's own loss in one process.

There is deliberately no ``tests/runtime/__init__.py`` (see ``test_worker.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from worker_harness import WorkerPool


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2)
    yield p
    p.close()


def _cases():
    g = torch.Generator().manual_seed(0)
    out = []
    for vocab in (40, 37):   # 37: ranks hold 19 and 18 columns
        logits = torch.randn(12, vocab, generator=g) * 3
        target = torch.randint(0, vocab, (12,), generator=g)
        target[[2, 7]] = -100
        out.append((logits, target))
    return out


def _kwargs(logits) -> list[dict]:
    """Reductions ours handles, and class weights (PyTorch's ``loss_parallel``; it needs an even
    vocabulary split with weights)."""
    out: list[dict] = [{"reduction": "mean"}, {"reduction": "sum"}, {"reduction": "none"}]
    if logits.shape[1] % 2 == 0:
        out.append({"weight": torch.linspace(0.5, 1.5, logits.shape[1])})
    return out


def loss_task(task: dict) -> dict:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from runtime.vocab_parallel_loss import VocabParallelCrossEntropy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(task["port"]))
    dist.init_process_group("gloo", rank=task["rank"], world_size=task["world"])
    try:
        mesh = init_device_mesh("cpu", (task["world"],))
        results = []
        for logits, target in _cases():
            for kw in _kwargs(logits):
                full = logits.clone().requires_grad_(True)
                sharded = DTensor.from_local(full.chunk(task["world"], dim=1)[task["rank"]].detach().clone(),
                                             mesh, [Shard(1)], run_check=False, shape=full.shape,
                                             stride=full.stride()).requires_grad_(True)
                t = target.clamp(min=0) if "weight" in kw else target   # (torch's weighted loss_parallel
                with loss_parallel(), VocabParallelCrossEntropy():         # fails on ignored rows)
                    loss = F.cross_entropy(sharded, t, **kw)
                    loss.sum().backward()
                value = loss.full_tensor() if isinstance(loss, DTensor) else loss
                results.append((value.detach(), sharded.grad.to_local().clone(), type(loss).__name__))
        return {"results": results}
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_loss_equals_cross_entropy(pool):
    out = pool.run_ok("test_vocab_parallel_loss:loss_task", {"fresh_process": True}, world=2)
    i = 0
    for logits, target in _cases():
        for kw in _kwargs(logits):
            full = logits.clone().requires_grad_(True)
            want = F.cross_entropy(full, target.clamp(min=0) if "weight" in kw else target, **kw)
            want.sum().backward()
            ours = "weight" not in kw   # class weights: PyTorch's loss_parallel handles them
            for rank in (0, 1):
                value, grad, kind = out[rank]["results"][i]
                assert kind == ("Tensor" if ours else "DTensor"), (kw, kind)   # ours returns a plain tensor
                assert torch.allclose(value, want.detach(), rtol=1e-5, atol=1e-6), (logits.shape, kw)
                assert torch.allclose(grad, full.grad.chunk(2, dim=1)[rank], rtol=1e-5, atol=1e-7), (logits.shape, kw)
            i += 1
