"""Helpers shared by the predefined schedules: stage-to-rank mapping, placement and
micro-batch checks, and the final validation every schedule goes through."""

from __future__ import annotations

from typing import Callable

from engine.errors import PlacementError, ScheduleError
from engine.placement import Placement
from engine.schedule import Block, Schedule, validate


def looped_device(segment: int, num_devices: int, virtual_stages: int) -> int:
    """Device of ``segment`` in a plain or interleaved pipeline: ``segment % num_devices``.

    This is :func:`engine.placement.pipeline_placement`'s mapping and PyTorch's "loop" style.
    """
    return segment % num_devices


def check_pipeline_placement(
    placement: Placement,
    schedule: str,
    *,
    split_backward: bool,
    min_virtual_stages: int = 1,
    max_virtual_stages: int | None = 1,
    device_of: Callable[[int, int, int], int] = looped_device,
    allow_forward_only: bool = False,
    how_to_build: str = "pipeline_placement(num_devices)",
) -> tuple[int, int]:
    """Check that ``placement`` is the pipeline shape a predefined schedule is written for.

    Every segment must have its forward and its backward (``B``, or ``I`` and ``W`` when
    ``split_backward``) on the single device ``device_of(segment, num_devices, virtual_stages)``,
    and the number of segments must be ``num_devices * virtual_stages`` with ``virtual_stages``
    in ``[min_virtual_stages, max_virtual_stages]``.

    Args:
        placement: the placement to check.
        schedule: schedule name used in the error messages.
        split_backward: whether the schedule needs the backward split into I and W blocks.
        min_virtual_stages, max_virtual_stages: allowed segments per device (``None``: no maximum).
        device_of: ``(segment, num_devices, virtual_stages) -> device``.
        allow_forward_only: accept a placement with forward blocks only (inference).
        how_to_build: the call that builds a suitable placement, quoted in the error messages.

    Returns:
        ``(num_devices, virtual_stages)``.

    Raises:
        PlacementError: the placement does not fit, with a sentence saying what to build instead.
    """
    pp = placement.num_devices
    n_seg = placement.num_segments
    hint = f"build it with {how_to_build}"
    if n_seg == 0 or n_seg % pp:
        raise PlacementError(
            f"{schedule} needs a pipeline placement whose segment count is a multiple of the "
            f"{pp} devices, got {n_seg} segments; {hint}"
        )
    v = n_seg // pp
    if v < min_virtual_stages or (max_virtual_stages is not None and v > max_virtual_stages):
        want = (
            f"exactly {min_virtual_stages}" if min_virtual_stages == max_virtual_stages
            else f"at least {min_virtual_stages}" if max_virtual_stages is None
            else f"{min_virtual_stages} to {max_virtual_stages}"
        )
        raise PlacementError(
            f"{schedule} needs {want} segment(s) per device (virtual stages), but the placement "
            f"has {n_seg} segments on {pp} devices ({v} per device); {hint}"
        )
    forward_only = placement.forward_only
    if forward_only and not allow_forward_only:
        raise PlacementError(f"{schedule} is a training schedule but the placement has no backward blocks; {hint}")
    if not forward_only and placement.split_backward != split_backward:
        if split_backward:
            raise PlacementError(
                f"{schedule} needs the backward split into input-gradient (I) and weight-gradient (W) "
                f"blocks, but the placement has full backward (B) blocks; {hint}"
            )
        raise PlacementError(
            f"{schedule} runs full backward (B) blocks, but the placement splits the backward into "
            f"I and W blocks; {hint}"
        )
    kinds = ("F",) if forward_only else ("F", "I", "W") if split_backward else ("F", "B")
    expected = {(k, s) for k in kinds for s in range(n_seg)}
    present = {b.key for b in placement.blocks}
    if present != expected:
        extra = sorted(f"{s}{k}" for k, s in present - expected)
        missing = sorted(f"{s}{k}" for k, s in expected - present)
        raise PlacementError(
            f"{schedule} needs exactly the blocks {'/'.join(kinds)} of every segment; the placement "
            f"has extra {extra or 'none'} and lacks {missing or 'none'}; {hint}"
        )
    for b in placement.blocks:
        want_dev = device_of(b.segment, pp, v)
        if b.devices != (want_dev,):
            raise PlacementError(
                f"{schedule} expects block {b.segment}{b.kind} on device {want_dev} alone, but the "
                f"placement runs it on device(s) {list(b.devices)}; {hint}"
            )
    return pp, v


def check_micro_batches(m: int, schedule: str) -> None:
    """Raise ``ScheduleError(rule="micro-batches")`` unless ``m`` is a positive integer."""
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ScheduleError("micro-batches", f"{schedule} needs at least one micro-batch, got {m!r}")


def finish_schedule(placement: Placement, m: int, orders: list[list[Block]], name: str, meta: dict) -> Schedule:
    """Wrap per-device orders into a :class:`Schedule` and validate it (raises ``ScheduleError``)."""
    s = Schedule(placement, m, orders, name=name, meta=meta)
    validate(s)
    return s
