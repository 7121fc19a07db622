"""Zero-bubble schedules: the backward is split into input-gradient ``I`` and weight-gradient ``W``.

Source: Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024 (arXiv 2401.10241,
2023). ``I`` (called B in the paper) is on the critical path between stages; ``W`` only has to
run before the optimizer step, so it can fill bubbles.

* :func:`zb_h1` — the paper's handcrafted **ZB-H1** (section 3.1, Figure 3 top): the same
  warm-up as 1F1B, ``F``/``I`` alternate in steady state and rank ``r`` postpones its first ``r``
  ``W`` passes to the cool-down, where they fill the tail bubble. No rank ever holds more than
  ``pp`` micro-batches whose ``W`` has not run, so the peak memory equals 1F1B's (``pp``
  activations, reached on rank 0 by 1F1B); the bubble drops to about a third of 1F1B's when
  ``T_F = T_I = T_W``. The order mirrors PyTorch's
  ``torch.distributed.pipelining.ScheduleInterleavedZeroBubble`` built with ONE stage per rank
  (torch 2.13): its warm-up is ``pp - r - 1`` forwards (``multiply_factor=1``) and its
  ``num_1f1b_microbatches = rank`` delays the ``W`` of rank ``r`` by ``r`` steps — exactly
  ZB-H1. (PyTorch's class docstring calls it "ZB1P"; with several stages per rank it is an
  interleaved variant, built here by :func:`interleaved_zero_bubble`.)
* :func:`interleaved_zero_bubble` — the same class with ``v >= 2`` stages per rank.
* :func:`zb_v` — the paper's **ZB-V** (section 6, Figure 8): two chunks per rank in a V (rank
  ``r`` holds segments ``r`` and ``2 pp - 1 - r``), mirroring PyTorch ``ScheduleZBVZeroBubble``.
  It is not ZB-H1: it needs a V-shaped placement, built by :func:`zbv_placement`.
"""

from __future__ import annotations

from dataclasses import replace

from engine.baselines.common import check_micro_batches, check_pipeline_placement, finish_schedule
from engine.baselines.interleaved import interleaved_rank_order, micro_batches_per_round
from engine.placement import Placement, pipeline_placement
from engine.schedule import Block, Schedule

_SOURCE = "Qi et al. 2023, Zero Bubble Pipeline Parallelism (arXiv 2401.10241)"


def _zero_bubble_orders(pp: int, v: int, m: int, mpr: int) -> list[list[Block]]:
    orders = []
    for rank in range(pp):
        warmup = min((v - 1) * mpr + (pp - 1 - rank), v * m)
        orders.append(interleaved_rank_order(rank, pp, v, m, mpr, warmup, zero_bubble=True))
    return orders


def zb_h1(placement: Placement, m: int) -> Schedule:
    """ZB-H1: 1F1B with the backward split, rank ``r`` deferring its first ``r`` ``W`` passes.

    Rank ``r`` runs ``pp - r - 1`` warm-up forwards, then steps ``F, I`` (plus, from step ``r``
    on, the ``W`` of the oldest pending ``I``), then the remaining ``I`` (each followed by a
    ``W`` from step ``r`` on), then the leftover ``W``. Every rank peaks at ``pp`` micro-batches
    not yet through ``W`` (1F1B's rank-0 peak).

    Source: Qi et al. 2023, section 3.1 (ZB-H1); order mirrors PyTorch
    ``ScheduleInterleavedZeroBubble`` with one stage per rank.

    Args:
        placement: ``pipeline_placement(num_devices, split_backward=True)``.
        m: micro-batches; PyTorch's flexible-rounds rule applies (``m`` a multiple of
            ``max(1, m // num_devices)``), so every ``m < 2 * num_devices`` and every multiple
            of ``num_devices`` is accepted.

    Raises:
        ScheduleError: bad ``m`` (rule ``"micro-batches"``).
        PlacementError: the placement is not a plain pipeline with I/W blocks.
    """
    pp, v = check_pipeline_placement(
        placement, "zb-h1", split_backward=True,
        how_to_build="pipeline_placement(num_devices, split_backward=True)",
    )
    mpr = micro_batches_per_round(m, pp, "zb-h1")
    meta = {"pytorch": "ScheduleInterleavedZeroBubble (1 stage per rank)", "source": f"{_SOURCE}, section 3.1 (ZB-H1)"}
    return finish_schedule(placement, m, _zero_bubble_orders(pp, v, m, mpr), "zb-h1", meta)


def interleaved_zero_bubble(placement: Placement, m: int) -> Schedule:
    """PyTorch's interleaved zero-bubble schedule over ``v >= 2`` segments per device.

    Interleaved 1F1B's chunk order (see :mod:`engine.baselines.interleaved`) with a warm-up of
    ``min((v - 1) * mpr + pp - 1 - r, v m)`` forwards and the ZB-H1 handling of ``I``/``W``.

    Source: Qi et al. 2023 (zero-bubble I/W split); order mirrors PyTorch
    ``ScheduleInterleavedZeroBubble`` (which its docstring calls the paper's "ZB1P").

    Args:
        placement: ``pipeline_placement(num_devices, virtual_stages=v, split_backward=True)``, ``v >= 2``.
        m: micro-batches (flexible-rounds rule, as for :func:`zb_h1`).

    Raises:
        ScheduleError: bad ``m`` (rule ``"micro-batches"``).
        PlacementError: wrong placement.
    """
    pp, v = check_pipeline_placement(
        placement, "interleaved-zb", split_backward=True, min_virtual_stages=2, max_virtual_stages=None,
        how_to_build="pipeline_placement(num_devices, virtual_stages=2, split_backward=True)",
    )
    mpr = micro_batches_per_round(m, pp, "interleaved-zb")
    meta = {
        "pytorch": "ScheduleInterleavedZeroBubble", "virtual_stages": v, "micro_batches_per_round": mpr,
        "source": _SOURCE,
    }
    return finish_schedule(placement, m, _zero_bubble_orders(pp, v, m, mpr), "interleaved-zb", meta)


def v_device(segment: int, num_devices: int, virtual_stages: int = 2) -> int:
    """Device of ``segment`` in ZB-V's V shape: ``s`` for ``s < pp``, else ``2 pp - 1 - s``."""
    return segment if segment < num_devices else 2 * num_devices - 1 - segment


def zbv_placement(num_devices: int, **kwargs) -> Placement:
    """The V-shaped placement of ZB-V: 2 segments per device, segment ``s`` on :func:`v_device`.

    Takes the keyword arguments of :func:`engine.placement.pipeline_placement` except
    ``virtual_stages`` (always 2) and ``split_backward`` (always ``True``); per-segment lists
    are indexed by segment, as there.
    """
    base = pipeline_placement(num_devices, virtual_stages=2, split_backward=True, **kwargs)
    blocks = tuple(replace(b, devices=(v_device(b.segment, num_devices),)) for b in base.blocks)
    return Placement(num_devices, blocks, name="zbv", static_memory=base.static_memory)


def zb_v(placement: Placement, m: int) -> Schedule:
    """ZB-V: two chunks per rank in a V, warm-up then ``F I W`` per chunk, zero bubble when
    ``T_F = T_I = T_W``, peak memory like 1F1B's.

    Rank ``r`` holds chunk 0 = segment ``r`` and chunk 1 = segment ``2 pp - 1 - r``. Warm-up:
    ``2 (pp - r) - 1`` chunk-0 forwards, ``r`` (chunk-1, chunk-0) forward pairs, ``pp - r``
    chunk-1 ``F I W`` triples; steady state: chunk-0 ``F I W`` then chunk-1 ``F I W``; cool-down:
    ``r`` chunk-0/chunk-1 ``I`` pairs, ``pp - r`` chunk-0 ``I W`` pairs, then the pending ``W``.
    As in PyTorch, the pattern is generated for ``max(2 pp - 1, m)`` micro-batches and the blocks
    of micro-batches ``>= m`` are dropped, so any ``m >= 1`` works.

    Source: Qi et al. 2023, section 6 (ZB-V); order mirrors PyTorch ``ScheduleZBVZeroBubble``.

    Args:
        placement: :func:`zbv_placement` ``(num_devices)``.
        m: micro-batches, at least 1.

    Raises:
        ScheduleError: ``m < 1`` (rule ``"micro-batches"``).
        PlacementError: the placement is not ZB-V's V shape with I/W blocks.
    """
    check_micro_batches(m, "zb-v")
    pp, _ = check_pipeline_placement(
        placement, "zb-v", split_backward=True, min_virtual_stages=2, max_virtual_stages=2,
        device_of=v_device, how_to_build="engine.baselines.zbv_placement(num_devices)",
    )
    n = max(2 * pp - 1, m)
    orders = []
    for rank in range(pp):
        c0, c1 = rank, 2 * pp - 1 - rank
        cnt = {(k, c): 0 for k in "FIW" for c in (c0, c1)}
        order: list[Block] = []

        # this rank's order and counters, bound as defaults (put runs within this iteration only)
        def put(kind: str, seg: int, order: list[Block] = order, cnt: dict[tuple[str, int], int] = cnt) -> None:
            order.append(Block(seg, kind, cnt[(kind, seg)]))
            cnt[(kind, seg)] += 1

        for _ in range(2 * (pp - rank) - 1):
            put("F", c0)
        for _ in range(rank):
            put("F", c1)
            put("F", c0)
        for _ in range(pp - rank):
            put("F", c1)
            put("I", c1)
            put("W", c1)
        while cnt[("F", c1)] < cnt[("F", c0)] or cnt[("F", c0)] < n:
            if cnt[("F", c0)] < n:
                put("F", c0)
            put("I", c0)
            put("W", c0)
            put("F", c1)
            put("I", c1)
            put("W", c1)
        for _ in range(rank):
            put("I", c0)
            put("I", c1)
        for _ in range(pp - rank):
            put("I", c0)
            put("W", c0)
        while cnt[("W", c1)] < cnt[("I", c1)]:
            put("W", c1)
        while cnt[("W", c0)] < cnt[("I", c0)]:
            put("W", c0)
        orders.append([b for b in order if b.micro_batch < m])
    meta = {"pytorch": "ScheduleZBVZeroBubble", "source": f"{_SOURCE}, section 6 (ZB-V)"}
    return finish_schedule(placement, m, orders, "zb-v", meta)
