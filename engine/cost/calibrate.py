"""Calibrate a plan's costs from a measured step: profile-guided prediction.

The analytical cost model (roofline, or aten ops profiled one at a time) misses what only the
running system shows: Python and autograd overheads of a whole stage, the optimizer's real
speed, and, where ranks share cores (4 CPU ranks on a 2-core machine), the slowdown of every
block that runs while another rank computes. A short profiling launch measures all of it: this
module takes the measured :class:`~engine.timeline.Timeline` of one or more steps and derives

- the trimmed mean duration (:data:`TRIM` of the samples cut at each end) of every block kind
  of every segment (``F``, ``B``, ``I``, ``W``), which replaces the placement's durations (a
  mean, not the median: a step's time is a sum of block times and measured block times are
  skewed to the right by preemption and cache effects, so the median under-predicts the sum;
  trimmed, so that one preempted block does not move the prediction), and
- the optimizer's seconds per parameter byte (median over ranks of ``OPTIM`` time / bytes),
  which replaces the roofline ``CostModel.optimizer_time``;
- the end-to-end point-to-point time: for every ``RECV``, from the later of the producer
  block's end (on the sending rank) and the receive's post to the data's arrival, i.e. the
  transfer plus the send/receive software path (gloo, Python, pinning); its excess over the
  cost model's ``p2p_time`` becomes a fixed per-transfer overhead. Measured times are per-rank
  step clocks (the launcher starts every rank's step together), so this assumes the ranks'
  step starts are aligned to well under a transfer time;

- a collective's own time: a measured all-reduce on one rank includes the time that rank waits
  for the others, so the collective itself is timed on the rank that arrived last, from its start
  to its end (the same aligned step clocks); its excess over the cost model's
  ``collective_time`` becomes a fixed per-collective overhead (the software path: gloo's
  rendezvous, the gradient copy into the flat buffer, Python). A launch's measured timeline holds
  replica 0's ranks only, so a data-parallel gradient collective (``allreduce s0``: its other
  members are the other replicas) is seen on one rank: with ``replicas`` (the plan's ``dp``) it is
  timed there, over a group of ``replicas`` ranks (replicas run the same blocks, so they reach it
  together and little of that time is waiting).

This is the calibration step of profile-guided planners: FlexFlow's execution simulator
(Jia et al., "Beyond Data and Model Parallelism for Deep Neural Networks", SysML 2019, sec. 5)
measures each operator once on the device and reuses it; Alpa's stage profiler (Zheng et al.,
OSDI 2022, sec. 5.2) times whole stages on the real mesh. Units: seconds and bytes.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

from engine.errors import CostModelError
from engine.timeline import Timeline

COMPUTE_KINDS = ("F", "B", "I", "W")
#: Fraction of the samples cut at each end for the trimmed mean of a block's duration.
TRIM = 0.1


def trimmed_mean(values: Sequence[float], trim: float = TRIM) -> float:
    """Mean of ``values`` without the ``trim`` fraction of the smallest and of the largest
    (at least one value is kept). Raises ValueError for no values or ``trim`` outside [0, 0.5)."""
    if not values:
        raise ValueError("trimmed_mean of no values")
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    v = sorted(values)
    k = min(int(len(v) * trim), (len(v) - 1) // 2)
    return statistics.fmean(v[k:len(v) - k])


@dataclass
class Calibration:
    """Costs measured on the target machine.

    Attributes:
        block_seconds: ``{(segment, kind): seconds}``, the trimmed mean measured duration of one block
            of that segment and kind (``F``/``B``/``I``/``W``) over all ranks, micro-batches and steps.
        optimizer_seconds_per_byte: median over ranks of ``OPTIM`` seconds / parameter bytes of
            the rank; ``None`` if no optimizer step was measured.
        p2p_seconds: ``{nbytes: seconds}``, the median end-to-end time of a point-to-point
            transfer of that size (see the module docstring); empty if none was measured.
        samples: measured compute events used.
        steps: measured timelines (steps) used.
        collectives: ``[(kind, nbytes, group size, seconds), ...]``: each measured collective's
            own time (on the rank that arrived last, see the module docstring).
        compute_scale: ``{kind: ratio}``, measured over planned seconds of the blocks of that kind
            (summed over the measured plan's segments; :func:`calibrate` with ``planned``): how far the
            cost model's compute times fall short on this machine (Python and autograd overheads of
            a whole stage). It transfers to other plans of the same model (``tessel tune
            --calibration``), whose segments differ: a block not in :attr:`block_seconds` takes
            its planned duration times this ratio.
        step_residual: ``{"whole" | "split": ratio}``, the measured step time of the launched plan
            over its calibrated prediction, by the backward kind it was measured on (a whole
            backward, or a split one: ZB-H1): what the block-level model does not see, as one
            factor of the layout (on ranks that share cores: the operating system's interleaving
            of them, Ray's and Python's own threads; anywhere: gaps between blocks). ``tessel
            tune`` multiplies each candidate's predicted step by the residual of its calibration
            and backward kind (:meth:`residual_of`), so the profiled plan is predicted at its
            measurement and the layout's other plans (schedules, recomputation) relative to it.
            Empty where the launch was not checked (:func:`engine.plan.calibrate_plan` sets it).
        recompute: the activation recomputation of the plan it was measured on (``none``,
            ``selective``, ``full``, or ``per-stage`` for a plan whose stages recompute differently;
            :func:`engine.plan.calibrate_plan` sets it).
        recompute_variant: the same layout measured on a plan that recomputes activations
            (:func:`layout_calibration`), with which a recomputing candidate is predicted
            (:meth:`for_plan`): its stages run under ``torch.utils.checkpoint`` (and for GPT-2
            and Llama as eager layer modules, not the traced graphs of a plan without
            recomputation: :func:`engine.split.choose_split`), so its forward, backward and
            recomputed forward run at scales of their own (measured on this project's CPU ranks,
            the forward's scale put the two-tower model's recomputing plans 11-28% too fast).
            ``None``: none was measured.
    """

    block_seconds: dict[tuple[int, str], float] = field(default_factory=dict)
    optimizer_seconds_per_byte: float | None = None
    samples: int = 0
    steps: int = 0
    p2p_seconds: dict[int, float] = field(default_factory=dict)
    collectives: list[tuple[str, int, int, float]] = field(default_factory=list)
    compute_scale: dict[str, float] = field(default_factory=dict)
    step_residual: dict[str, float] = field(default_factory=dict)
    recompute: str = "none"
    recompute_variant: "Calibration | None" = None

    def block_time(self, segment: int, kind: str, default: float, recompute: float = 0.0) -> float:
        """Measured seconds of a ``kind`` block of ``segment``, else ``default`` (planned seconds)
        scaled by :meth:`scaled`."""
        got = self.block_seconds.get((int(segment), str(kind)))
        return got if got is not None else self.scaled(str(kind), default, recompute)

    def scaled(self, kind: str, planned: float, recompute: float = 0.0) -> float:
        """Calibrated seconds of a ``kind`` block planned at ``planned`` seconds, of which
        ``recompute`` seconds are recomputed forward (activation recomputation: a backward block,
        ``B``, ``I`` or ``W``, runs its segment's forward again): that part at the forward's
        scale, the rest at ``kind``'s. A forward runs several times slower than planned here
        (Python per module) while a backward runs near its roofline, so a recomputing backward
        scaled by the backward's scale alone is predicted far too fast."""
        r = min(max(0.0, float(recompute)), planned) if kind in ("B", "I", "W") else 0.0
        return (planned - r) * self.scale_of(kind) + r * self.scale_of("F")

    def scale_of(self, kind: str) -> float:
        """:attr:`compute_scale` of ``kind``; a split backward's ``I`` and ``W`` blocks not measured
        take the backward's (``B``) scale (they are its two halves), then 1."""
        got = self.compute_scale.get(kind)
        if got is None and kind in ("I", "W"):
            got = self.compute_scale.get("B")
        return 1.0 if got is None else float(got)

    def residual_of(self, split_backward: bool) -> float:
        """:attr:`step_residual` of a plan with (``True``) or without a split backward; the other
        kind's where its own was not measured; 1 without either."""
        own, other = ("split", "whole") if split_backward else ("whole", "split")
        got = self.step_residual.get(own, self.step_residual.get(other))
        return 1.0 if got is None else float(got)

    @property
    def recomputes(self) -> bool:
        """Whether it was measured on a plan that recomputes activations."""
        return self.recompute != "none"

    def for_plan(self, recomputes: bool) -> "Calibration":
        """The calibration a plan with (``True``) or without activation recomputation is predicted
        with: :attr:`recompute_variant` for a recomputing plan where one was measured, else this one."""
        return self.recompute_variant if recomputes and self.recompute_variant is not None else self

    def transferable(self) -> "Calibration":
        """This calibration without its per-segment block times (and its recompute variant's), as
        it applies to other plans of the model: their segments differ, so only the compute scale,
        communication, optimizer and step residual carry over."""
        variant = None if self.recompute_variant is None else self.recompute_variant.transferable()
        return replace(self, block_seconds={}, recompute_variant=variant)

    @property
    def split_backward(self) -> bool:
        """Whether it was measured on a split backward (``I`` and ``W`` blocks, a zero-bubble schedule)."""
        return any(k in self.compute_scale for k in ("I", "W"))

    def with_split_backward_of(self, split: "Calibration") -> "Calibration":
        """This calibration (measured on a whole backward, ``B``) with the ``I`` and ``W`` compute
        scales of ``split`` (the same layout measured on a split backward), so a candidate of either
        backward kind is predicted with the scale measured on its own kind: the split backward's
        two autograd passes cost more Python and bookkeeping than one, which a shared ``B`` scale
        cannot carry. Everything else (communication, optimizer, ``F``, ``B``) stays this one's;
        the per-segment block times are dropped (they belong to neither plan alone).

        Raises:
            CostModelError: this one was measured on a split backward, or ``split`` was not.
        """
        if self.split_backward or not split.split_backward:
            raise CostModelError("merging the calibrations of one layout needs one measured on a whole backward "
                                 "(1F1B, GPipe) and one on a split backward (ZB-H1)")
        scale = dict(self.compute_scale)
        scale.update({k: v for k, v in split.compute_scale.items() if k in ("I", "W")})
        residual = {k: v for k, v in self.step_residual.items() if k == "whole"}
        residual.update({k: v for k, v in split.step_residual.items() if k == "split"})
        return replace(self, block_seconds={}, compute_scale=scale, step_residual=residual)

    @classmethod
    def pooled(cls, calibrations: Sequence["Calibration"]) -> "Calibration":
        """One calibration from several profiling launches of ONE layout and backward kind: per
        block, per compute kind, per transfer size and for the optimizer rate the median over the
        launches that measured it; the collectives of all launches (:class:`CalibratedCost` takes
        their median); samples and steps summed.

        Why the median of launches: on ranks that share cores a small model's launch-to-launch
        spread is 20-40% (which rank the OS runs when), far more than the spread of steps within
        one launch, and a candidate's measured step time is compared as the median of its
        launches too. One launch is returned unchanged.

        Raises:
            CostModelError: no calibration, launches of both backward kinds (merge those with
                :meth:`with_split_backward_of` after pooling each kind), or of plans with and
                without recomputation (:func:`layout_calibration` keeps them apart).
        """
        cals = list(calibrations)
        if not cals:
            raise CostModelError("pooling calibrations needs at least one")
        if len(cals) == 1:
            return cals[0]
        if len({c.split_backward for c in cals}) > 1:
            raise CostModelError("pool the launches of each backward kind on their own (1F1B/GPipe apart from "
                                 "ZB-H1), then merge the two with Calibration.with_split_backward_of")
        if len({c.recomputes for c in cals}) > 1:
            raise CostModelError("pool the launches of plans with and without activation recomputation on their "
                                 "own (layout_calibration keeps the recomputing ones as the recompute variant)")

        def median_of(dicts):
            keys = {k for d in dicts for k in d}
            return {k: statistics.median([d[k] for d in dicts if k in d]) for k in sorted(keys)}

        rates = [c.optimizer_seconds_per_byte for c in cals if c.optimizer_seconds_per_byte is not None]
        return cls(block_seconds=median_of([c.block_seconds for c in cals]),
                   optimizer_seconds_per_byte=statistics.median(rates) if rates else None,
                   samples=sum(c.samples for c in cals), steps=sum(c.steps for c in cals),
                   p2p_seconds=median_of([c.p2p_seconds for c in cals]),
                   collectives=[x for c in cals for x in c.collectives],
                   compute_scale=median_of([c.compute_scale for c in cals]),
                   step_residual=median_of([c.step_residual for c in cals]), recompute=cals[0].recompute)

    def to_dict(self) -> dict:
        """JSON form: ``{"blocks": [[segment, kind, seconds], ...], "optimizer_seconds_per_byte", ...}``."""
        return {"blocks": [[s, k, t] for (s, k), t in sorted(self.block_seconds.items())],
                "optimizer_seconds_per_byte": self.optimizer_seconds_per_byte,
                "p2p": [[n, t] for n, t in sorted(self.p2p_seconds.items())],
                "collectives": [list(c) for c in self.collectives],
                "compute_scale": dict(sorted(self.compute_scale.items())),
                "step_residual": dict(sorted(self.step_residual.items())),
                "samples": self.samples, "steps": self.steps, "recompute": self.recompute,
                "recompute_variant": None if self.recompute_variant is None else self.recompute_variant.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        """Inverse of :meth:`to_dict`.

        Raises:
            CostModelError: a malformed document (names the field).
        """
        try:
            blocks = {(int(s), str(k)): float(t) for s, k, t in d.get("blocks", [])}
            spb = d.get("optimizer_seconds_per_byte")
            p2p = {int(n): float(t) for n, t in d.get("p2p", [])}
            colls = [(str(k), int(n), int(g), float(t)) for k, n, g, t in d.get("collectives", [])]
            scale = {str(k): float(v) for k, v in (d.get("compute_scale") or {}).items()}
            residual = {str(k): float(v) for k, v in (d.get("step_residual") or {}).items()}
            if any(k not in ("whole", "split") or not v > 0 for k, v in residual.items()):
                raise ValueError(f"step_residual must map 'whole' and/or 'split' to positive ratios, got {residual}")
            variant = d.get("recompute_variant")
            if variant is not None and not isinstance(variant, dict):
                raise ValueError(f"recompute_variant must be a calibration or null, got {type(variant).__name__}")
            return cls(blocks, None if spb is None else float(spb), int(d.get("samples", 0)), int(d.get("steps", 0)),
                       p2p, colls, scale, residual, str(d.get("recompute", "none")),
                       None if variant is None else cls.from_dict(variant))
        except (TypeError, ValueError) as e:
            raise CostModelError(f"malformed calibration: {e}; expected blocks=[[segment, kind, seconds], ...]") from e


def calibrate(timelines: Timeline | Sequence[Timeline], param_bytes: Sequence[int] | None = None,
              planned: Mapping[tuple[int, str], float] | None = None, replicas: int = 1,
              recompute: Mapping[int, float] | None = None) -> Calibration:
    """Derive a :class:`Calibration` from measured timelines (one per step).

    Args:
        timelines: measured steps (e.g. the last steps of a short profiling launch). The first
            step of a launch includes warm-up (allocator, autograd graph caches); leave it out.
        param_bytes: parameter bytes per pipeline rank, used when a measured ``OPTIM`` event does
            not carry its bytes (``ExecutionPlan.param_bytes``).
        planned: ``{(segment, kind): seconds}``, the measured plan's own block durations; with it
            the calibration gets :attr:`Calibration.compute_scale` (per kind, the measured trimmed
            means summed over segments divided by the planned durations summed over the same ones).
        replicas: the measured plan's data-parallel degree; at 2 or more a collective seen on one
            rank only (the gradient sync among replicas, whose other members the timeline does not
            hold) is timed on that rank as a collective of ``replicas`` ranks.
        recompute: ``{segment: seconds}`` of recomputed forward in each backward block of the
            measured plan (its segments' ``recompute_time``), for :func:`measured_compute_scale`.

    Returns:
        The calibration; block kinds never measured are absent (the plan keeps its own durations).

    Raises:
        CostModelError: no compute event in any timeline (nothing to calibrate from).
    """
    tls = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    per_block: dict[tuple[int, str], list[float]] = {}
    per_byte: list[float] = []
    per_size: dict[int, list[float]] = {}
    samples = 0
    collectives: list[tuple[str, int, int, float]] = []
    for tl in tls:
        collectives += _collective_times(tl, replicas)
        produced = {(e.rank, e.name): e.end for e in tl.events if e.stream == "compute"}
        for e in tl.events:
            if e.op == "RECV" and "<" in e.name:
                block, _, peer = e.name.rpartition("<")
                # peers are named by world rank in measured events; the replica-0 pipeline rank is the same
                end = produced.get((int(peer) % tl.num_devices if peer.isdigit() else -1, block))
                if end is not None and e.end >= end:
                    per_size.setdefault(int(e.nbytes), []).append(e.end - max(end, e.start))
            if e.stream != "compute":
                continue
            if e.op in COMPUTE_KINDS and e.segment >= 0:
                per_block.setdefault((e.segment, e.op), []).append(e.end - e.start)
                samples += 1
            elif e.op == "OPTIM":
                nbytes = e.nbytes or (param_bytes[e.rank] if param_bytes and e.rank < len(param_bytes) else 0)
                if nbytes > 0:
                    per_byte.append((e.end - e.start) / nbytes)
    if not samples:
        raise CostModelError("no measured compute events (F/B/I/W) to calibrate from; pass measured timelines "
                             "of training steps, e.g. LaunchResult.timeline")
    blocks = {k: trimmed_mean(v) for k, v in per_block.items()}
    return Calibration(blocks, statistics.median(per_byte) if per_byte else None, samples, len(tls),
                       {n: statistics.median(v) for n, v in per_size.items()}, collectives,
                       measured_compute_scale(blocks, planned, recompute) if planned else {})


def layout_calibration(launches: Iterable[Calibration]) -> Calibration:
    """One layout's calibration from its profiling launches: those of each backward kind pooled
    (:meth:`Calibration.pooled`), then a whole-backward and a split-backward one merged
    (:meth:`Calibration.with_split_backward_of`), so each candidate is predicted with its own kind's
    compute scale. ``tessel tune --calibration`` takes its files so.

    Launches of plans that recompute activations are merged so on their own and kept as the
    :attr:`~Calibration.recompute_variant` of the others' (a recomputing candidate is predicted
    with it: :meth:`Calibration.for_plan`). A backward kind the recomputing launches did not
    measure takes their measured kind's scale and residual times the ratio the launches without
    recomputation measured between the two kinds (:func:`_filled_from`). Only recomputing
    launches: their calibration, for every candidate.

    Raises:
        CostModelError: no launch.
    """
    groups: dict[bool, dict[bool, list[Calibration]]] = {}
    for c in launches:
        groups.setdefault(c.recomputes, {}).setdefault(c.split_backward, []).append(c)
    if not groups:
        raise CostModelError("a layout's calibration needs at least one profiling launch")
    merged = {}
    for rc, kinds in groups.items():
        pooled = {split: Calibration.pooled(cals) for split, cals in kinds.items()}
        merged[rc] = pooled[False].with_split_backward_of(pooled[True]) if len(pooled) == 2 \
            else next(iter(pooled.values()))
    if len(merged) == 1:
        return next(iter(merged.values()))
    return replace(merged[False], recompute_variant=_filled_from(merged[True], merged[False]))


def _filled_from(variant: Calibration, base: Calibration) -> Calibration:
    """``variant`` (a layout measured with recomputation on one backward kind) with what it did not
    measure of the other kind, relative to what it did by the ratio ``base`` (the layout without
    recomputation) measured between the two: measured on a whole backward, its ``I`` and ``W``
    scales are its ``B`` scale times ``base``'s ``I / B`` and ``W / B``; its missing step residual
    kind is its own residual times ``base``'s ratio of the two kinds. (Measured on a split
    backward, its ``B`` scale is its ``I`` and ``W`` together already.)"""
    scale, residual = dict(variant.compute_scale), dict(variant.step_residual)
    if not variant.split_backward and "B" in scale and base.split_backward and base.scale_of("B") > 0:
        for k in ("I", "W"):
            if k in base.compute_scale:
                scale[k] = scale["B"] * base.compute_scale[k] / base.scale_of("B")
    for have, miss in (("whole", "split"), ("split", "whole")):
        if have in residual and miss not in residual and have in base.step_residual and miss in base.step_residual:
            residual[miss] = residual[have] * base.step_residual[miss] / base.step_residual[have]
    return replace(variant, compute_scale=scale, step_residual=residual)


def measured_compute_scale(measured: Mapping[tuple[int, str], float], planned: Mapping[tuple[int, str], float],
                           recompute: Mapping[int, float] | None = None) -> dict[str, float]:
    """Per block kind, ``sum(measured) / sum(planned)`` over the ``(segment, kind)`` keys both have
    with a positive planned duration (seconds); kinds without one are left out. A split backward's
    ``I`` and ``W`` together also give ``B`` when no ``B`` was measured. ``recompute``:
    ``{segment: seconds}`` of recomputed forward in each of its backward blocks (``B``, ``I``,
    ``W``); that part is taken out of both sums at the forward's measured scale (the inverse of
    :meth:`Calibration.scaled`), so a backward kind's scale is the backward's own."""
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    rc = {int(k): float(v) for k, v in (recompute or {}).items() if v}
    f_scale = 1.0
    if rc:
        f_scale = measured_compute_scale({k: v for k, v in measured.items() if k[1] == "F"}, planned).get("F", 1.0)
    for (seg, kind), t in measured.items():
        p = planned.get((seg, kind))
        if p is not None and p > 0:
            r = min(rc.get(seg, 0.0), p) if kind in ("B", "I", "W") else 0.0
            if r:
                t, p = t - r * f_scale, p - r
                if p <= 0:
                    continue
            num[kind] = num.get(kind, 0.0) + t
            den[kind] = den.get(kind, 0.0) + p
    if "B" not in num and ("I" in num or "W" in num):   # a split backward measured: its I + W stand for B
        num["B"] = num.get("I", 0.0) + num.get("W", 0.0)
        den["B"] = den.get("I", 0.0) + den.get("W", 0.0)
    return {k: num[k] / den[k] for k in num if den[k] > 0 and num[k] > 0}


def _collective_times(tl: Timeline, replicas: int = 1) -> list[tuple[str, int, int, float]]:
    """Each collective of one measured step seen on 2+ ranks (events with the same op and name):
    ``(kind, nbytes, ranks, seconds)`` with the seconds of the rank that started it last; with
    ``replicas >= 2`` also each seen on one rank, as a collective of ``replicas`` ranks."""
    groups: dict[tuple[str, str], list] = {}
    for e in tl.events:
        if e.stream == "collective" and e.op in ("ALLREDUCE", "REDUCESCATTER", "ALLGATHER") and e.end >= e.start:
            groups.setdefault((e.op, e.name), []).append(e)
    out = []
    for (op, _name), evs in groups.items():
        ranks = len({e.rank for e in evs})
        if ranks < 2 and replicas < 2:
            continue
        last = max(evs, key=lambda e: e.start)
        out.append((op.lower(), int(max(e.nbytes for e in evs)), ranks if ranks >= 2 else replicas,
                    last.end - last.start))
    return out


class CalibratedCost:
    """A cost model with the calibrated optimizer rate, point-to-point and collective overheads.

    Implements the simulator's ``CommCost`` protocol (:mod:`engine.simulate`).

    Args:
        base: the plan's cost model (``engine.cost.CostModel``), or any object with
            ``p2p_time``, ``collective_time`` and ``optimizer_time``.
        calibration: measured costs; without an optimizer (p2p) measurement the base's optimizer
            (p2p) time is used.

    Attributes:
        p2p_overhead: seconds added to every transfer between different ranks: the median over
            measured transfer sizes of measured time minus the base model's ``p2p_time``
            (never negative).
        collective_overhead: seconds added to every all-reduce among 2+ ranks: the median of the
            measured all-reduces' own time minus the base model's ``collective_time`` (never
            negative).
        collective_overheads: the same per collective kind measured (``allreduce``,
            ``reducescatter``, ``allgather``: CoCoNet's sharded update); a kind not measured gets
            the all-reduce's.
    """

    def __init__(self, base, calibration: Calibration):
        self.base = base
        self.calibration = calibration
        extra = [t - base.p2p_time(n, 0, 1) for n, t in calibration.p2p_seconds.items()]
        self.p2p_overhead = max(0.0, statistics.median(extra)) if extra else 0.0
        per_kind: dict[str, list[float]] = {}
        for k, n, g, t in calibration.collectives:
            per_kind.setdefault(k, []).append(t - base.collective_time(k, n, list(range(g))))
        self.collective_overheads = {k: max(0.0, statistics.median(v)) for k, v in per_kind.items()}
        self.collective_overhead = self.collective_overheads.get("allreduce", 0.0)

    def p2p_time(self, nbytes: int, src: int, dst: int) -> float:
        t = self.base.p2p_time(nbytes, src, dst)
        return t + self.p2p_overhead if src != dst else t

    def collective_time(self, kind: str, nbytes: int, ranks: list[int]) -> float:
        t = self.base.collective_time(kind, nbytes, ranks)
        if kind not in ("allreduce", "reducescatter", "allgather") or len(set(ranks)) < 2:
            return t
        return t + self.collective_overheads.get(kind, self.collective_overhead)

    def optimizer_time(self, param_bytes: int) -> float:
        spb = self.calibration.optimizer_seconds_per_byte
        return self.base.optimizer_time(param_bytes) if spb is None else spb * max(0, int(param_bytes))

    def __getattr__(self, name: str):   # everything else (to_dict, node_of, ...) is the base model's
        if name in ("base", "calibration", "p2p_overhead", "collective_overhead", "collective_overheads") \
                or name.startswith("__"):
            raise AttributeError(name)   # not set yet (copy/pickle): no recursion into self.base
        return getattr(self.base, name)


def calibrated_durations(blocks: Iterable, calibration: Calibration,
                         recompute: Sequence[float] = ()) -> list[float]:
    """Per placement block (``PlacementBlock`` with ``segment``, ``kind``, ``duration``), the
    calibrated duration in seconds (:meth:`Calibration.block_time`; ``recompute[segment]``: seconds
    of recomputed forward in its backward blocks)."""
    return [calibration.block_time(b.segment, b.kind, b.duration,
                                   recompute[b.segment] if b.segment < len(recompute) else 0.0) for b in blocks]


__all__ = ["Calibration", "CalibratedCost", "calibrate", "calibrated_durations", "layout_calibration",
           "measured_compute_scale",
           "trimmed_mean"]
