"""Name -> predefined schedule builder, and the placement each one needs.

>>> from engine.placement import pipeline_placement
>>> from engine.baselines.registry import build_schedule, placement_requirements
>>> req = placement_requirements("zb-h1")
>>> pl = pipeline_placement(4, virtual_stages=req.virtual_stages, split_backward=req.split_backward)
>>> build_schedule("zb-h1", pl, 8).name
'zb-h1'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine.baselines.dualpipe_v import dualpipe_v
from engine.baselines.gpipe import gpipe
from engine.baselines.interleaved import interleaved_1f1b
from engine.baselines.looped_bfs import looped_bfs
from engine.baselines.one_f_one_b import one_f_one_b
from engine.baselines.zero_bubble import interleaved_zero_bubble, zb_h1, zb_v, zbv_placement
from engine.errors import PlacementError, UnknownScheduleError
from engine.placement import Placement, pipeline_placement
from engine.schedule import Schedule

Builder = Callable[[Placement, int], Schedule]

#: The predefined schedules by name. Each builder takes ``(placement, m)`` and returns a
#: validated :class:`~engine.schedule.Schedule`.
SCHEDULES: dict[str, Builder] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb-h1": zb_h1,
    "interleaved-zb": interleaved_zero_bubble,
    "zb-v": zb_v,
    "looped-bfs": looped_bfs,
    "dualpipev": dualpipe_v,
}


@dataclass(frozen=True)
class PlacementRequirements:
    """What placement a predefined schedule needs.

    Attributes:
        virtual_stages: the segments per device to build with by default.
        min_virtual_stages: fewest segments per device accepted.
        max_virtual_stages: most segments per device accepted (``None``: no maximum).
        split_backward: whether the backward must be split into I and W blocks.
        shape: ``"looped"`` (segment ``s`` on device ``s % num_devices``, as built by
            :func:`~engine.placement.pipeline_placement`) or ``"v"`` (the V of ZB-V and DualPipeV,
            built by :func:`~engine.baselines.zero_bubble.zbv_placement`).
        pytorch: the ``torch.distributed.pipelining`` schedule class whose order is mirrored.
    """

    virtual_stages: int
    min_virtual_stages: int
    max_virtual_stages: int | None
    split_backward: bool
    shape: str
    pytorch: str

    def make_placement(self, num_devices: int, virtual_stages: int | None = None, **kwargs) -> Placement:
        """A placement meeting these requirements; ``kwargs`` go to ``pipeline_placement``."""
        v = self.virtual_stages if virtual_stages is None else virtual_stages
        if self.shape == "v":
            if v != 2:
                raise PlacementError(f"the V placement of ZB-V and DualPipeV has exactly 2 segments per device, "
                                     f"not {v}")
            return zbv_placement(num_devices, **kwargs)
        return pipeline_placement(num_devices, virtual_stages=v, split_backward=self.split_backward, **kwargs)


_REQUIREMENTS: dict[str, PlacementRequirements] = {
    "gpipe": PlacementRequirements(1, 1, 1, False, "looped", "ScheduleGPipe"),
    "1f1b": PlacementRequirements(1, 1, 1, False, "looped", "Schedule1F1B"),
    "interleaved": PlacementRequirements(2, 2, None, False, "looped", "ScheduleInterleaved1F1B"),
    "zb-h1": PlacementRequirements(1, 1, 1, True, "looped", "ScheduleInterleavedZeroBubble (1 stage per rank)"),
    "interleaved-zb": PlacementRequirements(2, 2, None, True, "looped", "ScheduleInterleavedZeroBubble"),
    "zb-v": PlacementRequirements(2, 2, 2, True, "v", "ScheduleZBVZeroBubble"),
    "looped-bfs": PlacementRequirements(2, 1, None, False, "looped", "ScheduleLoopedBFS"),
    "dualpipev": PlacementRequirements(2, 2, 2, True, "v", "ScheduleDualPipeV"),
}


def _lookup(name: str) -> str:
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in SCHEDULES:
        raise UnknownScheduleError(f"unknown schedule {name!r}; valid schedules are: {', '.join(SCHEDULES)}")
    return key


def placement_requirements(name: str) -> PlacementRequirements:
    """The placement the schedule ``name`` needs (virtual stages, split backward, shape).

    Raises:
        UnknownScheduleError: (a ValueError) unknown name; the message lists the valid ones.
    """
    return _REQUIREMENTS[_lookup(name)]


def build_schedule(name: str, placement: Placement, m: int) -> Schedule:
    """Build the predefined schedule ``name`` over ``placement`` for ``m`` micro-batches.

    Raises:
        UnknownScheduleError: (a ValueError) unknown name (lists the valid ones).
        ScheduleError: ``m`` not accepted by the schedule (rule ``"micro-batches"``): ``1f1b``
            needs ``m >= num_devices``; ``interleaved``, ``zb-h1`` and ``interleaved-zb`` need
            ``m`` to be a multiple of ``max(1, m // num_devices)`` (PyTorch's rule); ``dualpipev``
            needs ``m >= 2 * num_devices``.
        PlacementError: the placement does not meet :func:`placement_requirements`.
    """
    return SCHEDULES[_lookup(name)](placement, m)
