"""GPipe (fill-drain) schedule.

GPipe: Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism", NeurIPS 2019, section 2.2 (all micro-batches forward, then all backward, the
gradients of the mini-batch applied once at the end). The per-rank order mirrors PyTorch's
``torch.distributed.pipelining.ScheduleGPipe`` (torch 2.13): rank ``r`` runs ``rF0 .. rF(m-1)``
then ``rB0 .. rB(m-1)``; with a forward-only placement it is PyTorch's ``_ScheduleForwardOnly``.
"""

from __future__ import annotations

from engine.baselines.common import check_micro_batches, check_pipeline_placement, finish_schedule
from engine.placement import Placement
from engine.schedule import Block, Schedule


def gpipe(placement: Placement, m: int) -> Schedule:
    """GPipe: every device runs all its forwards, then all its backwards, in micro-batch order.

    Source: Huang et al., NeurIPS 2019, section 2.2; order mirrors PyTorch ``ScheduleGPipe``
    (``_ScheduleForwardOnly`` for a forward-only placement). Peak activation memory is ``m``
    micro-batches on every device.

    Args:
        placement: a plain pipeline placement, ``pipeline_placement(num_devices)`` (optionally
            ``forward_only=True``).
        m: micro-batches, at least 1.

    Returns:
        The validated schedule, named ``"gpipe"``.

    Raises:
        ScheduleError: ``m < 1`` (rule ``"micro-batches"``).
        PlacementError: the placement is not a plain pipeline with full backward blocks.
    """
    check_micro_batches(m, "gpipe")
    pp, _ = check_pipeline_placement(placement, "gpipe", split_backward=False, allow_forward_only=True)
    orders = []
    for rank in range(pp):
        order = [Block(rank, "F", i) for i in range(m)]
        if not placement.forward_only:
            order += [Block(rank, "B", i) for i in range(m)]
        orders.append(order)
    pytorch = "_ScheduleForwardOnly" if placement.forward_only else "ScheduleGPipe"
    return finish_schedule(placement, m, orders, "gpipe",
                           {"pytorch": pytorch, "source": "Huang et al. 2019 (GPipe), section 2.2"})
