"""Interleaved 1F1B with virtual stages (Megatron-LM's interleaved schedule).

Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021, section 2.2.2 ("Schedule with Interleaved Stages"). Each device holds
``v`` model chunks (segments ``r, r + pp, r + 2 pp, ...``) and works depth-first: micro-batches
go through one local chunk in groups ("rounds") before moving to the next chunk.

The order mirrors PyTorch's ``torch.distributed.pipelining.ScheduleInterleaved1F1B`` (torch 2.13,
``_calculate_single_rank_operations`` + ``_get_1f1b_rank_ops``), including its relaxation of the
paper's ``m % pp == 0``: with ``rounds = max(1, m // pp)`` any ``m`` divisible by ``rounds`` works
(e.g. ``pp = 4`` with ``m = 3`` or ``m = 10``, but not ``m = 9``).
"""

from __future__ import annotations

from collections import defaultdict

from engine.baselines.common import check_micro_batches, check_pipeline_placement, finish_schedule
from engine.errors import ScheduleError
from engine.placement import Placement
from engine.schedule import Block, Schedule


def micro_batches_per_round(m: int, pp: int, schedule: str) -> int:
    """PyTorch's flexible-rounds rule for interleaved schedules; returns micro-batches per round.

    ``rounds = max(1, m // pp)`` and ``m`` must be a multiple of ``rounds``: any ``m < 2 pp`` works
    (one round), and from ``2 pp`` on ``m`` must split evenly into ``m // pp`` rounds (every
    multiple of ``pp`` does).

    Raises:
        ScheduleError: rule ``"micro-batches"``.
    """
    check_micro_batches(m, schedule)
    rounds = max(1, m // pp)
    if m % rounds:
        lower, upper = rounds * (m // rounds), rounds * (m // rounds + 1)
        raise ScheduleError(
            "micro-batches",
            f"{schedule} needs the micro-batch count to be a multiple of its number of rounds "
            f"max(1, m // pp) (like PyTorch's interleaved schedules), but m = {m} with pp = {pp} "
            f"gives {rounds} rounds; use e.g. m = {lower} or m = {upper}",
        )
    return m // rounds


def interleaved_rank_order(
    rank: int, pp: int, v: int, m: int, mpr: int, warmup: int, *, zero_bubble: bool = False
) -> list[Block]:
    """One rank's order in PyTorch's looped 1F1B family (``_get_1f1b_rank_ops``).

    Step ``k`` of the ``v * m`` forwards runs local chunk ``(k // mpr) % v``; backward step ``k``
    runs chunk ``v - 1 - (k // mpr) % v``; micro-batches are counted per chunk. After ``warmup``
    forwards, each step is one forward plus one backward, then the remaining backwards.

    With ``zero_bubble`` the backward is the input-gradient ``I``; after the first ``rank`` of
    them, every ``I`` is followed by the weight-gradient ``W`` of the oldest pending ``I``, and
    the still-pending ``W`` close the order (PyTorch ``ScheduleInterleavedZeroBubble``).
    """
    total = v * m
    nxt: defaultdict[tuple[str, int], int] = defaultdict(int)  # (kind, segment) -> next micro-batch

    def take(kind: str, segment: int) -> Block:
        mb = nxt[(kind, segment)]
        nxt[(kind, segment)] = mb + 1
        return Block(segment, kind, mb)

    def fwd_segment(k: int) -> int:
        return ((k // mpr) % v) * pp + rank

    def bwd_segment(k: int) -> int:
        return (v - 1 - (k // mpr) % v) * pp + rank

    bkind = "I" if zero_bubble else "B"
    order: list[Block] = [take("F", fwd_segment(k)) for k in range(warmup)]
    pending_w: list[int] = []  # segments of I blocks whose W has not run yet, oldest first
    for k in range(total):  # k-th backward; forward step warmup + k runs alongside while any remain
        if warmup + k < total:
            order.append(take("F", fwd_segment(warmup + k)))
        seg = bwd_segment(k)
        order.append(take(bkind, seg))
        if zero_bubble:
            pending_w.append(seg)
            if k >= rank:
                order.append(take("W", pending_w.pop(0)))
    order += [take("W", seg) for seg in pending_w]
    return order


def interleaved_1f1b(placement: Placement, m: int) -> Schedule:
    """Interleaved 1F1B over ``v >= 2`` segments per device.

    Rank ``r`` warms up with ``min((v - 1) * mpr + 2 (pp - 1 - r), v m)`` forwards, where
    ``mpr = m // max(1, m // pp)`` micro-batches form a round, then alternates one forward and
    one backward, then drains. Forward step ``k`` uses local chunk ``(k // mpr) % v``.

    Source: Narayanan et al., SC 2021, section 2.2.2; order mirrors PyTorch
    ``ScheduleInterleaved1F1B``.

    Args:
        placement: ``pipeline_placement(num_devices, virtual_stages=v)`` with ``v >= 2``
            (segment ``s`` on device ``s % num_devices``, full backward).
        m: micro-batches; ``m`` must be a multiple of ``max(1, m // num_devices)``.

    Raises:
        ScheduleError: bad ``m`` (rule ``"micro-batches"``).
        PlacementError: the placement is not an interleaved pipeline with full backward blocks.
    """
    pp, v = check_pipeline_placement(
        placement, "interleaved", split_backward=False, min_virtual_stages=2, max_virtual_stages=None,
        how_to_build="pipeline_placement(num_devices, virtual_stages=2)",
    )
    mpr = micro_batches_per_round(m, pp, "interleaved")
    orders = []
    for rank in range(pp):
        warmup = min((v - 1) * mpr + 2 * (pp - 1 - rank), v * m)
        orders.append(interleaved_rank_order(rank, pp, v, m, mpr, warmup))
    meta = {
        "pytorch": "ScheduleInterleaved1F1B", "virtual_stages": v, "micro_batches_per_round": mpr,
        "source": "Narayanan et al. 2021 (Megatron-LM), section 2.2.2",
    }
    return finish_schedule(placement, m, orders, "interleaved", meta)
