"""DualPipeV: DeepSeek's DualPipe folded onto one pipeline, in the V placement of ZB-V.

Source: DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv 2412.19437), section 3.2.1
(DualPipe), and the "DualPipeV" cut-in-half variant of https://github.com/deepseek-ai/DualPipe.
Rank ``r`` holds two chunks in a V (segments ``r`` and ``2 pp - 1 - r``, the placement of
:func:`engine.baselines.zero_bubble.zbv_placement`); in the steady state every step pairs the
forward of one chunk with the backward of the other, which DeepSeek overlaps (computation of
one with the communication of the other); warm-up and cool-down use the zero-bubble split of
the backward into ``I`` and ``W``.

The order mirrors PyTorch's ``torch.distributed.pipelining.ScheduleDualPipeV`` (torch 2.13,
``_calculate_single_rank_operations``) mapped to our blocks on the split-backward V placement:

* PyTorch's ``I`` and ``W`` are ours;
* a full backward ``B`` (``FULL_BACKWARD``, used where PyTorch does not split) is its ``I``
  immediately followed by its ``W`` (the same work: ``I + W = B``);
* an ``OVERLAP_F_B`` compound action, whose sub-actions are a forward and a full backward, is
  the forward followed by that backward's ``I`` and ``W``: the order in which
  ``_PipelineScheduleRuntime`` runs the sub-actions when no overlap function is registered. Our
  blocks run one at a time per device, so the overlap itself (hiding one block's communication
  behind the other's compute) is not modelled; the simulator charges the transfers as usual.
"""

from __future__ import annotations

from collections import defaultdict

from engine.baselines.common import check_micro_batches, check_pipeline_placement, finish_schedule
from engine.baselines.zero_bubble import v_device
from engine.errors import ScheduleError
from engine.placement import Placement
from engine.schedule import Block, Schedule

_SOURCE = "DeepSeek-AI 2024, DeepSeek-V3 Technical Report (arXiv 2412.19437), section 3.2.1 (DualPipe)"


class _RankOrder:
    """One rank's order being built, with PyTorch's counters and pending-``W`` queue."""

    def __init__(self) -> None:
        self.order: list[Block] = []
        self.next_mb: defaultdict[tuple[str, int], int] = defaultdict(int)  # (F|I, segment) -> micro-batch
        self.pending_w: list[Block] = []  # W of split backwards not yet run, oldest first

    def forward(self, seg: int) -> None:
        self.order.append(Block(seg, "F", self.next_mb[("F", seg)]))
        self.next_mb[("F", seg)] += 1

    def backward_input(self, seg: int) -> None:
        """PyTorch ``BACKWARD_INPUT``: the ``I`` now, its ``W`` queued."""
        mb = self.next_mb[("I", seg)]
        self.next_mb[("I", seg)] += 1
        self.order.append(Block(seg, "I", mb))
        self.pending_w.append(Block(seg, "W", mb))

    def full_backward(self, seg: int) -> None:
        """PyTorch ``FULL_BACKWARD``: ``I`` then ``W`` of the same micro-batch, nothing queued."""
        mb = self.next_mb[("I", seg)]
        self.next_mb[("I", seg)] += 1
        self.order += [Block(seg, "I", mb), Block(seg, "W", mb)]

    def overlap(self, f_seg: int, b_seg: int) -> None:
        """PyTorch ``OVERLAP_F_B`` of ``(F f_seg, B b_seg)``: the forward, then the full backward."""
        self.forward(f_seg)
        self.full_backward(b_seg)

    def weight_if_pending(self) -> None:
        if self.pending_w:
            self.order.append(self.pending_w.pop(0))


def _rank_order(rank: int, pp: int, m: int) -> list[Block]:
    """PyTorch ``ScheduleDualPipeV._calculate_single_rank_operations`` for ``rank``, step by step."""
    s0, s1 = rank, 2 * pp - 1 - rank
    o = _RankOrder()
    for _ in range(2 * (pp - rank - 1)):  # step 1: F0
        o.forward(s0)
    for _ in range(rank + 1):  # step 2: F0 F1
        o.forward(s0)
        o.forward(s1)
    for _ in range(pp - rank - 1):  # step 3: I1 W F1 (zero bubble)
        o.backward_input(s1)
        o.weight_if_pending()
        o.forward(s1)
    for i in range(m - 2 * pp + rank + 1):  # step 4 (main): F0 B1 - F1 B0, overlapped pairs
        if i == 0 and rank == pp - 1:  # PyTorch does not overlap these two, to shrink the bubble
            o.forward(s0)
            o.full_backward(s1)
        else:
            o.overlap(s0, s1)
        o.overlap(s1, s0)
    for _ in range(pp - rank - 1):  # step 5: B1 - F1 B0
        o.full_backward(s1)
        o.overlap(s1, s0)
    split = False
    for i in range(rank + 1):  # step 6: B1 B0, zero bubble (I only) from the middle on
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        (o.backward_input if split else o.full_backward)(s1)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        (o.backward_input if split else o.full_backward)(s0)
    for _ in range(pp - rank - 1):  # step 7: W B0
        o.weight_if_pending()
        (o.backward_input if split else o.full_backward)(s0)
    for _ in range(rank + 1):  # step 8: W
        o.weight_if_pending()
    return o.order


def dualpipe_v(placement: Placement, m: int) -> Schedule:
    """DualPipeV on the V placement (rank ``r`` holds segments ``r`` and ``2 pp - 1 - r``).

    Rank ``r``: ``2 (pp - r - 1)`` chunk-0 forwards, ``r + 1`` chunk-0/chunk-1 forward pairs,
    ``pp - r - 1`` chunk-1 ``I W F`` triples; the main phase of ``m - 2 pp + r + 1`` steps, each
    (F chunk 0, B chunk 1) then (F chunk 1, B chunk 0); ``pp - r - 1`` steps of B chunk 1 then
    (F chunk 1, B chunk 0); ``r + 1`` chunk-1/chunk-0 backward pairs, split into ``I`` (``W``
    deferred) from the middle one on; ``pp - r - 1`` steps of a deferred ``W`` and a chunk-0
    backward; then the remaining ``W``. A full backward is ``I`` then ``W``; PyTorch's
    ``OVERLAP_F_B`` pair is the forward then the backward (module docstring).

    Source: DeepSeek-V3 Technical Report (arXiv 2412.19437), section 3.2.1, and
    github.com/deepseek-ai/DualPipe (DualPipeV); order mirrors PyTorch ``ScheduleDualPipeV``
    (torch 2.13).

    Args:
        placement: :func:`engine.baselines.zbv_placement` ``(num_devices)`` (the V, with the
            backward split into ``I`` and ``W``).
        m: micro-batches, at least ``2 * num_devices`` (PyTorch's rule: as many as stages).

    Raises:
        ScheduleError: ``m < 2 * num_devices`` (rule ``"micro-batches"``).
        PlacementError: the placement is not the V shape with I/W blocks.
    """
    check_micro_batches(m, "dualpipev")
    pp, _ = check_pipeline_placement(
        placement, "dualpipev", split_backward=True, min_virtual_stages=2, max_virtual_stages=2,
        device_of=v_device, how_to_build="engine.baselines.zbv_placement(num_devices)",
    )
    if m < 2 * pp:
        raise ScheduleError(
            "micro-batches",
            f"dualpipev needs at least as many micro-batches as stages (like PyTorch's ScheduleDualPipeV), "
            f"but m = {m} with {2 * pp} stages on {pp} devices; use m >= {2 * pp}",
        )
    orders = [_rank_order(rank, pp, m) for rank in range(pp)]
    meta = {"pytorch": "ScheduleDualPipeV", "source": _SOURCE}
    return finish_schedule(placement, m, orders, "dualpipev", meta)
