"""A plan with measured costs (profile-guided prediction), re-simulated.

:func:`with_segment_times` puts measured per-segment times into a plan,
:func:`with_calibration` a :class:`~engine.cost.calibrate.Calibration` of measured block and
optimizer times, and :func:`calibrate_plan` does it from the measured timelines of a launch,
checking the calibrated prediction on steps it did not see (``tessel launch --calibrate``,
``tessel demo``). :func:`resimulate` predicts a loaded or edited plan's timeline.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Sequence

from engine.cost.calibrate import Calibration, calibrate, calibrated_durations
from engine.errors import TesselError
from engine.io.plan import Plan
from engine.layout import RankLayout
from engine.plan.core_sharing import shared_core_step_time, uncontended_timeline
from engine.plan.metrics import predict
from engine.schedule import Schedule
from engine.timeline import Timeline

__all__ = ["CalibrationCheck", "calibrate_plan", "resimulate", "with_calibration", "with_segment_times"]


def resimulate(plan: Plan) -> Timeline:
    """Re-lower (:func:`engine.plan.lowering.lower_plan`: MoE all-to-alls and tied all-reduces
    included) and re-simulate a (loaded or edited) plan with its stored cost model and optimizer
    (``plan.parallel.optimizer``, ``adam`` when absent; the placement carries the memory).
    A plan calibrated by :func:`with_calibration` predicts its optimizer step with the measured
    rate (``plan.meta["calibration"]``). The timeline of :func:`engine.plan.metrics.predict`, so
    its numbers are :func:`engine.plan.metrics.predicted_metrics`'s.

    Raises:
        PlanFormatError, TransformError, DeadlockError: as :func:`engine.plan.metrics.predict`.
    """
    return predict(plan)[0]


def _with_block_durations(plan: Plan, durations: list[float], segments: list[dict],
                          meta: dict) -> tuple[Plan, Timeline]:
    """The plan with new per-block ``durations`` (seconds, in placement block order), segment
    dicts and extra ``meta``, re-simulated; the orders are unchanged and metrics recomputed."""
    s = plan.schedule
    schedule = Schedule(plan.placement.with_durations(durations), s.num_micro_batches, s.orders, s.name, dict(s.meta))
    new = Plan(plan.model, plan.parallel, segments, schedule, plan.cost, dict(plan.metrics), {**plan.meta, **meta},
               tied_weights=list(plan.tied_weights))
    tl, metrics = predict(new)
    new.metrics.update(metrics)
    return new, tl


def with_segment_times(plan: Plan, times: list[tuple[float, float]]) -> tuple[Plan, Timeline]:
    """The plan with measured per-segment ``(forward_s, backward_s)`` durations, re-simulated.

    ``times`` comes from e.g. ``runtime.profile.measure_segment_times``. F blocks take the
    forward time, B blocks the backward time; split I/W blocks share the backward time in their
    current proportion. The schedule's orders are unchanged; metrics are recomputed.

    Raises:
        TesselError: ``times`` does not have one entry per segment.
    """
    pl = plan.placement
    if len(times) != pl.num_segments:
        raise TesselError(f"got times for {len(times)} segments, the plan has {pl.num_segments}")
    split: dict[int, float] = {}
    for b in pl.blocks:
        if b.kind in ("I", "W"):
            split[b.segment] = split.get(b.segment, 0.0) + b.duration
    durations = []
    for b in pl.blocks:
        f, bw = times[b.segment]
        if b.kind == "F":
            durations.append(f)
        elif b.kind == "B":
            durations.append(bw)
        else:
            durations.append(bw * (b.duration / split[b.segment] if split[b.segment] > 0 else 0.5))
    segments = [dict(seg, forward_time=times[i][0], backward_time=times[i][1]) for i, seg in enumerate(plan.segments)]
    return _with_block_durations(plan, durations, segments, {"segment_times": "measured"})


def _recompute_times(plan: Plan) -> list[float]:
    """Per segment, the seconds of recomputed forward in each of its backward blocks (0 without
    activation recomputation)."""
    return [float(seg.get("recompute_time", 0.0) or 0.0) for seg in plan.segments]


def _recompute_mode(plan: Plan) -> str:
    """The plan's activation recomputation as a calibration records it
    (:attr:`engine.cost.calibrate.Calibration.recompute`): ``plan.parallel.recompute`` where some
    segment recomputes (``per-stage`` where only a per-stage override does), else ``none``."""
    if not any(_recompute_times(plan)):
        return "none"
    mode = str(getattr(plan.parallel, "recompute", "none") or "none")
    return mode if mode != "none" else "per-stage"


def with_calibration(plan: Plan, calibration: Calibration) -> tuple[Plan, Timeline]:
    """The plan with costs measured on the target machine, re-simulated (profile-guided prediction).

    Every block takes the calibration's (trimmed mean) measured duration of its segment and kind (blocks
    it never measured keep theirs); the optimizer step takes the measured seconds per parameter
    byte. The calibration is kept in ``plan.meta["calibration"]``, so :func:`resimulate` (and a
    saved and reloaded plan) predicts with it too. The schedule's orders are unchanged.

    Args:
        plan: the plan that was measured (or one with the same segments).
        calibration: from :func:`engine.cost.calibrate.calibrate` on measured timelines, e.g. a
            short profiling launch (``runtime.launch(...).timelines``).

    Returns:
        ``(calibrated plan, its predicted timeline)``; ``plan.metrics`` are recomputed.

    Raises:
        TesselError: the calibration names a segment the plan does not have.
    """
    pl = plan.placement
    unknown = sorted({s for s, _ in calibration.block_seconds if not 0 <= s < pl.num_segments})
    if unknown:
        raise TesselError(f"the calibration has times for segments {unknown}, the plan has segments "
                          f"0..{pl.num_segments - 1}; calibrate from a launch of this plan")
    recompute = _recompute_times(plan)
    segments = [dict(seg, forward_time=calibration.block_time(i, "F", seg.get("forward_time", 0.0)),
                     backward_time=calibration.block_time(i, "B", seg.get("backward_time", 0.0), recompute[i]))
                for i, seg in enumerate(plan.segments)]
    return _with_block_durations(plan, calibrated_durations(pl.blocks, calibration, recompute), segments,
                                 {"calibration": calibration.to_dict()})


@dataclass
class CalibrationCheck:
    """What :func:`calibrate_plan` found.

    Attributes:
        plan: the plan calibrated from every measured step (save it with ``engine.io.save_plan``).
        timeline: the calibrated prediction that was checked (from the first half of the steps
            when ``held_out``, else from all of them).
        predicted_makespan: that prediction's step time (seconds): its makespan, or on ranks sharing
            cores (``shared_cores``) the longer step they take.
        measured_makespan: the median measured makespan of the checked steps (seconds).
        error: ``measured / predicted - 1`` (NaN for a zero prediction).
        steps: the measured steps used.
        checked: how many of them the prediction was compared with.
        held_out: whether the checked steps were left out of the checked prediction's calibration.
    """

    plan: Plan
    timeline: Timeline
    predicted_makespan: float
    measured_makespan: float
    error: float
    steps: int
    checked: int
    held_out: bool

    def to_dict(self) -> dict:
        """The numbers (seconds), without the plan and timeline."""
        return {"predicted_makespan": self.predicted_makespan, "measured_makespan": self.measured_makespan,
                "error": self.error, "steps": self.steps, "held_out": self.held_out}


def calibrate_plan(plan: Plan, timelines: Sequence[Timeline], *, shared_cores: int | None = None) -> CalibrationCheck:
    """Calibrate ``plan`` from measured steps (e.g. ``runtime.LaunchResult.timelines`` without the
    warm-up step) and check the calibrated prediction.

    With at least 4 timelines the first half calibrates and the prediction is compared with the
    median makespan of the second half (steps the calibration did not see); with fewer, the
    calibration is compared with the steps it came from. The returned plan is calibrated from all
    of them (:func:`with_calibration`).

    ``shared_cores``: the launch's ranks all ran on one host with this many cores, fewer than the
    ranks. Their measured compute blocks are then reduced to the work they did
    (:func:`engine.plan.core_sharing.uncontended_timeline`), so the calibration describes a rank
    with a core of its own. The checked prediction is the plan's step on that host
    (:func:`engine.plan.core_sharing.shared_core_step_time`).

    The calibration records the plan's activation recomputation
    (:attr:`~engine.cost.calibrate.Calibration.recompute`), so that ``tessel tune`` predicts
    recomputing candidates with the launches of recomputing plans
    (:func:`engine.cost.calibrate.layout_calibration`).

    The returned plan's calibration also holds the step residual
    (:attr:`~engine.cost.calibrate.Calibration.step_residual`): the median measured step of all the
    timelines over the plan's prediction from the calibration's compute scale (its block times
    left out, as ``tessel tune`` transfers it to other plans). The checked prediction does not
    use it: the check's error is the block-level model's.

    Raises:
        CostModelError: no timeline (:func:`engine.cost.calibrate.calibrate`).
        TesselError: the timelines name a segment the plan does not have.
    """
    tls = list(timelines)
    par = plan.parallel
    layout = RankLayout(par.tp, par.dp, par.pp, par.layout)

    fitted = tls if shared_cores is None else [uncontended_timeline(t, layout, par.devices, shared_cores) for t in tls]
    planned = {(b.segment, b.kind): b.duration for b in plan.placement.blocks}
    recompute = dict(enumerate(_recompute_times(plan)))

    def step_of(timeline: Timeline) -> float:
        return timeline.makespan if shared_cores is None else shared_core_step_time(timeline, layout, par.devices,
                                                                                     shared_cores)

    cal = replace(calibrate(fitted, planned=planned, replicas=par.dp, recompute=recompute),
                  recompute=_recompute_mode(plan))
    # the residual against the prediction the tuner makes of this plan: compute scale, not its block times
    transferred = step_of(with_calibration(plan, cal.transferable())[1])
    if transferred > 0:
        kind = "split" if plan.placement.split_backward else "whole"
        cal = replace(cal, step_residual={kind: statistics.median(t.makespan for t in tls) / transferred})
    new, tl = with_calibration(plan, cal)
    held_out = len(tls) >= 4
    if held_out:
        half = len(tls) // 2
        _, tl = with_calibration(plan, calibrate(fitted[:half], planned=planned, replicas=par.dp, recompute=recompute))
        checked = tls[half:]
    else:
        checked = tls
    measured = statistics.median(t.makespan for t in checked)
    predicted = step_of(tl)
    err = measured / predicted - 1 if predicted > 0 else math.nan
    return CalibrationCheck(new, tl, predicted, measured, err, len(tls), len(checked), held_out)
