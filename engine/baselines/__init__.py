"""Predefined pipeline schedules (SuperScaler phase 2 baselines), each mirroring a
``torch.distributed.pipelining`` schedule class of torch 2.13:

==================  ===========================================  =====================================
name                builder                                      PyTorch class
==================  ===========================================  =====================================
``gpipe``           :func:`gpipe`                                ``ScheduleGPipe``
``1f1b``            :func:`one_f_one_b`                          ``Schedule1F1B``
``interleaved``     :func:`interleaved_1f1b`                     ``ScheduleInterleaved1F1B``
``zb-h1``           :func:`zb_h1`                                ``ScheduleInterleavedZeroBubble``, 1 stage/rank
``interleaved-zb``  :func:`interleaved_zero_bubble`              ``ScheduleInterleavedZeroBubble``, v >= 2
``zb-v``            :func:`zb_v` (placement: :func:`zbv_placement`)  ``ScheduleZBVZeroBubble``
``looped-bfs``      :func:`looped_bfs`                           ``ScheduleLoopedBFS``
``dualpipev``       :func:`dualpipe_v` (placement: :func:`zbv_placement`)  ``ScheduleDualPipeV``
==================  ===========================================  =====================================

Every builder takes ``(placement, m)`` and returns a validated :class:`engine.schedule.Schedule`;
:func:`build_schedule` and :func:`placement_requirements` look them up by name.
"""

from engine.baselines.dualpipe_v import dualpipe_v
from engine.baselines.generic import gpipe_any, in_flight_caps, one_f_one_b_any  # noqa: F401  (policies for any placement)
from engine.baselines.gpipe import gpipe
from engine.baselines.interleaved import interleaved_1f1b
from engine.baselines.looped_bfs import looped_bfs
from engine.baselines.one_f_one_b import one_f_one_b
from engine.baselines.registry import SCHEDULES, PlacementRequirements, build_schedule, placement_requirements
from engine.baselines.zero_bubble import interleaved_zero_bubble, zb_h1, zb_v, zbv_placement

__all__ = [
    "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "interleaved_zero_bubble", "zb_v", "zbv_placement",
    "looped_bfs", "dualpipe_v",
    "SCHEDULES", "PlacementRequirements", "build_schedule", "placement_requirements",
]
