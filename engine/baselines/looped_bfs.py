"""Looped breadth-first pipeline schedule (Looped BFS).

Source: Lamy-Poirier, "Breadth-First Pipeline Parallelism", MLSys 2023 (arXiv 2211.05953),
section 3 (the looped placement run breadth-first). Each device holds ``v`` model chunks in the
looped placement (segments ``r, r + pp, r + 2 pp, ...``, as interleaved 1F1B); where
interleaved 1F1B goes depth-first (a few micro-batches through every local chunk, then the
next few), Looped BFS goes breadth-first: ALL micro-batches through a chunk before the next
chunk starts, then all backwards, the last chunk first. Like GPipe it keeps the activations of
every micro-batch of every local chunk until the backward phase (peak ``v m`` activations per
device), in exchange for the fewest chunk switches.

The order mirrors PyTorch's ``torch.distributed.pipelining.ScheduleLoopedBFS`` (torch 2.13,
``_calculate_single_rank_operations``), including its backward order: micro-batches in
DESCENDING order (``m - 1`` first), local chunks from the last to the first.
"""

from __future__ import annotations

from engine.baselines.common import check_micro_batches, check_pipeline_placement, finish_schedule
from engine.placement import Placement
from engine.schedule import Block, Schedule

_SOURCE = "Lamy-Poirier 2023, Breadth-First Pipeline Parallelism (arXiv 2211.05953), section 3"


def looped_bfs(placement: Placement, m: int) -> Schedule:
    """Looped BFS over ``v >= 1`` segments per device: every forward, chunk by chunk, then
    every backward, last chunk first and latest micro-batch first.

    Rank ``r`` runs ``F`` of micro-batches ``0..m-1`` for segment ``r``, then for segment
    ``r + pp``, ... ``r + (v - 1) pp``; then ``B`` of micro-batches ``m-1..0`` for segment
    ``r + (v - 1) pp``, ... down to segment ``r``. With ``v = 1`` this is GPipe with the
    backwards in reverse micro-batch order.

    Source: Lamy-Poirier 2023 (Breadth-First Pipeline Parallelism), section 3; order mirrors
    PyTorch ``ScheduleLoopedBFS`` (torch 2.13), which accepts any number of stages per rank and
    any ``m >= 1``.

    Args:
        placement: ``pipeline_placement(num_devices, virtual_stages=v)`` (segment ``s`` on device
            ``s % num_devices``, full backward ``B`` blocks).
        m: micro-batches, at least 1.

    Raises:
        ScheduleError: ``m < 1`` (rule ``"micro-batches"``).
        PlacementError: the placement is not a looped pipeline with full backward blocks.
    """
    check_micro_batches(m, "looped-bfs")
    pp, v = check_pipeline_placement(
        placement, "looped-bfs", split_backward=False, min_virtual_stages=1, max_virtual_stages=None,
        how_to_build="pipeline_placement(num_devices, virtual_stages=2)",
    )
    orders = []
    for rank in range(pp):
        segments = range(rank, pp * v, pp)
        order = [Block(s, "F", mb) for s in segments for mb in range(m)]
        order += [Block(s, "B", mb) for s in reversed(segments) for mb in reversed(range(m))]
        orders.append(order)
    meta = {"pytorch": "ScheduleLoopedBFS", "virtual_stages": v, "source": _SOURCE}
    return finish_schedule(placement, m, orders, "looped-bfs", meta)
