"""Measure each segment's forward and backward time on this machine, as the runtime runs it.

The engine's op profiler times aten ops one by one and takes backward as a multiple of
forward; this module times the real stage modules (``runtime.stages.build_stages``) on one
micro-batch, forward and full backward, with one intra-op thread as every rank runs. Plug the
result into the plan with :func:`engine.plan.calibrate.with_segment_times` for a prediction that
carries the runtime's own overheads (Python dispatch, autograd, the real backward cost).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from runtime.stages import build_stages


def measure_segment_times(plan, *, repeat: int = 5, warmup: int = 2, seed: int = 0, threads: int = 1
                          ) -> list[tuple[float, float]]:
    """Median ``(forward_s, backward_s)`` per segment for one micro-batch.

    Args:
        plan: an :class:`engine.io.Plan` (its model, micro-batch size and sequence length).
        repeat: timed repetitions (median taken); ``warmup`` untimed ones first.
        threads: intra-op threads while timing (the runtime's ranks use 1).

    Returns:
        One ``(forward seconds, backward seconds)`` per segment, in segment order. The last
        segment's forward includes the cross-entropy loss.

    Raises:
        RuntimeNotSupported: the plan cannot be executed by the runtime (see ``runtime.stages.checks``).
    """
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        stages = build_stages(plan, seed=seed)
        mbs, T = stages.micro_batch_size, stages.seq_len
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, stages.output.shape[-1], (mbs, T + 1), generator=gen)
        S = len(stages.modules)
        fwd: list[list[float]] = [[] for _ in range(S)]
        bwd: list[list[float]] = [[] for _ in range(S)]
        for it in range(warmup + repeat):
            values: tuple = (ids[:, :-1],)
            for s in range(S):
                metas = stages.inputs if s == 0 else stages.boundaries[s - 1]
                ins = tuple(v.detach().requires_grad_(True) if m.requires_grad else v.detach()
                            for v, m in zip(values, metas))
                t0 = time.perf_counter()
                outs = stages.modules[s](*ins)
                if s == S - 1:
                    logits = outs[0]
                    root = [F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))]
                    grads = None
                else:
                    root = [o for o, m in zip(outs, stages.boundaries[s]) if m.requires_grad]
                    grads = [torch.ones_like(o) for o in root]
                t1 = time.perf_counter()
                torch.autograd.backward(root, grads)
                t2 = time.perf_counter()
                for p in stages.modules[s].parameters():
                    p.grad = None
                if it >= warmup:
                    fwd[s].append(t1 - t0)
                    bwd[s].append(t2 - t1)
                values = tuple(o.detach() for o in outs)
        return [(statistics.median(f), statistics.median(b)) for f, b in zip(fwd, bwd)]
    finally:
        torch.set_num_threads(saved)
