"""1F1B (one-forward-one-backward, "PipeDream-Flush") schedule.

Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021, section 2.2.1 ("Default Schedule", PipeDream-Flush's 1F1B). The order
mirrors what PyTorch's ``torch.distributed.pipelining.Schedule1F1B._step_microbatches`` runs
(torch 2.13): rank ``r`` of ``pp`` runs ``pp - r - 1`` warm-up forwards, then alternates one
forward and one backward, then drains the remaining backwards.

Note: PyTorch's *IR* for this class, ``Schedule1F1B._get_pipeline_order`` (what
``_schedule_visualizer.get_schedule_ops`` returns), is off by one on the last rank in torch 2.13:
it lists forwards ``1..m`` instead of ``0..m-1``. The runtime order (``_step_microbatches``), which
is what executes, is the one mirrored here; ``tests/engine/test_baselines.py`` checks both.
"""

from __future__ import annotations

from engine.baselines.common import check_micro_batches, check_pipeline_placement, finish_schedule
from engine.errors import ScheduleError
from engine.placement import Placement
from engine.schedule import Block, Schedule


def check_one_f_one_b_micro_batches(m: int, pp: int) -> None:
    """PyTorch's ``Schedule1F1B`` rule: at least as many micro-batches as pipeline stages.

    Raises:
        ScheduleError: rule ``"micro-batches"``.
    """
    check_micro_batches(m, "1f1b")
    if m < pp:
        raise ScheduleError(
            "micro-batches",
            f"1f1b needs at least as many micro-batches as pipeline stages (like PyTorch's "
            f"Schedule1F1B), got {m} micro-batches for {pp} stages; use m >= {pp} or gpipe",
        )


def one_f_one_b(placement: Placement, m: int) -> Schedule:
    """1F1B: warm-up forwards, then one forward / one backward, then the remaining backwards.

    Rank ``r`` runs ``w = pp - r - 1`` warm-up forwards ``F0..F(w-1)``, then ``m - w`` pairs
    ``F(w+i), B(i)``, then ``B(m-w)..B(m-1)``. Peak activation memory on rank ``r`` is
    ``pp - r`` micro-batches (``pp`` on rank 0), independent of ``m``.

    Source: Narayanan et al., SC 2021, section 2.2.1; order mirrors the runtime of PyTorch
    ``Schedule1F1B`` (see the module note on its IR).

    Args:
        placement: ``pipeline_placement(num_devices)`` (one segment per device, full backward).
        m: micro-batches, ``m >= num_devices`` (PyTorch's requirement).

    Raises:
        ScheduleError: ``m < num_devices`` (rule ``"micro-batches"``).
        PlacementError: the placement is not a plain pipeline with full backward blocks.
    """
    pp, _ = check_pipeline_placement(placement, "1f1b", split_backward=False)
    check_one_f_one_b_micro_batches(m, pp)
    orders = []
    for rank in range(pp):
        warmup = pp - rank - 1
        order = [Block(rank, "F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Block(rank, "F", warmup + i), Block(rank, "B", i)]
        order += [Block(rank, "B", i) for i in range(m - warmup, m)]
        orders.append(order)
    meta = {"pytorch": "Schedule1F1B", "source": "Narayanan et al. 2021 (Megatron-LM), section 2.2.1"}
    return finish_schedule(placement, m, orders, "1f1b", meta)
