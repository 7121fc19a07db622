"""A plan's lowering options and its instruction streams: what the plan records, as one
:class:`~engine.dependency.LowerOptions` that the runtime's worker also starts from.

:func:`plan_lower_options` reads the plan (``dp``/``tp``, the segments' parameter bytes and
tensor-parallel collectives, the MoE layers of each segment, the tied weights, the CoCoNet
transformations, the optimizer and the rank layout); :func:`lower_plan` lowers it (SuperScaler phase 3,
:func:`engine.dependency.lower`). ``runtime.worker.lowering`` replaces the bytes with what its
modules measure (:func:`dataclasses.replace`), so its stream equals :func:`lower_plan`'s for a
fresh plan.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping

from engine.dependency import ExecutionPlan, LowerOptions, TiedGroup, lower
from engine.dependency.options import OPTIMIZER_KINDS
from engine.errors import PlanFormatError

if TYPE_CHECKING:
    from engine.io.plan import Plan

__all__ = ["lower_plan", "plan_lower_options", "plan_tied_groups"]


def plan_tied_groups(plan: Plan) -> list[TiedGroup]:
    """The plan's tied-weight groups (``plan.tied_weights``; empty for plans written before they
    were recorded).

    Raises:
        PlanFormatError: a malformed entry (names ``tied_weights[i]``).
    """
    out = []
    for i, g in enumerate(plan.tied_weights or []):
        try:
            out.append(TiedGroup.from_dict(g))
        except (KeyError, TypeError, ValueError) as e:
            raise PlanFormatError(f"field 'tied_weights[{i}]' is malformed ({type(e).__name__}: {e})") from None
    return out


def _segment_moe_layers(segments: list[dict]) -> dict[int, list]:
    """Each segment's MoE layers (``segments[i]["moe"]``, :class:`engine.models.moe.comm.MoELayer`),
    for the segments that have any.

    Raises:
        PlanFormatError: a malformed ``moe`` entry.
    """
    if not any(s.get("moe") for s in segments):
        return {}
    # the MoE layers' module loads torch: only a plan of a MoE model needs it
    from engine.models.moe.comm import MoELayer

    out = {}
    for i, s in enumerate(segments):
        try:
            layers = [MoELayer.from_dict(x) for x in s.get("moe") or []]
        except (KeyError, TypeError, ValueError) as e:
            raise PlanFormatError(f"field 'segments[{i}].moe' is malformed ({type(e).__name__}: {e})") from None
        if layers:
            out[int(s["index"])] = layers
    return out


def _expert_parallel(segments: list[dict], dp: int, tp: int,
                     seg_bytes: dict[int, int]) -> tuple[dict[int, list[int]], dict[int, int]]:
    """``(alltoalls, replicated bytes)`` of the segments' MoE layers under expert parallelism over
    ``dp`` replicas: each MoE segment's forward all-to-all bytes, and its parameter bytes less
    this replica's experts (experts are owned by one replica: only the replicated parameters are
    all-reduced). No all-to-alls without MoE layers or with ``dp == 1``.

    Raises:
        PlanFormatError: a malformed ``moe`` entry.
        TransformError: a segment's experts do not divide by ``dp``.
    """
    moe = _segment_moe_layers(segments)
    replicated = dict(seg_bytes)
    if dp <= 1 or not moe:
        return {}, replicated
    from engine.models.moe.comm import check_expert_parallel, expert_param_bytes_per_rank, moe_segment_collectives

    alltoalls: dict[int, list[int]] = {}
    for k, layers in moe.items():
        check_expert_parallel(layers, dp, f"segment {k}")
        alltoalls[k] = moe_segment_collectives(layers, dp, "F")
        replicated[k] = max(0, seg_bytes[k] - expert_param_bytes_per_rank(layers, dp) // max(1, tp))
    return alltoalls, replicated


def plan_lower_options(plan: Plan, *, segment_param_bytes: Mapping[int, int] | None = None,
                       segment_allreduce_bytes: Mapping[int, int] | None = None,
                       optimizer_kind: str | None = None) -> LowerOptions:
    """The :class:`~engine.dependency.LowerOptions` of everything ``plan`` records: ``dp``, ``tp``,
    the segments' parameter bytes, the bytes their data-parallel all-reduce carries (parameter
    bytes less this replica's experts), the MoE all-to-alls of each segment with ``dp > 1``, the
    tied weights, the segments' tensor-parallel collectives, the CoCoNet transformations and
    their gradient bucket size, the optimizer, the precision policy and the rank layout
    (``plan.parallel.layout``, whose device ids the simulator times every collective over:
    :mod:`engine.layout`).

    Args:
        plan: the plan.
        segment_param_bytes: override the plan's per-segment parameter bytes (e.g. a runtime
            worker's measured module bytes); then they are also the data-parallel all-reduce
            bytes unless ``segment_allreduce_bytes`` is given.
        segment_allreduce_bytes: bytes each segment's data-parallel ALLREDUCE reduces (default:
            the plan's replicated bytes).
        optimizer_kind: ``adam`` or ``adama`` (default ``plan.parallel.optimizer``; ``adam`` for
            one unknown to the planner, e.g. the runtime's ``sgd``).

    Raises:
        PlanFormatError: a malformed ``moe`` or ``tied_weights`` entry.
        TransformError: a segment's experts do not divide by the plan's ``dp``.
    """
    par = plan.parallel
    seg_bytes = {int(s["index"]): int(s.get("param_bytes", 0)) for s in plan.segments}
    alltoalls, replicated = _expert_parallel(plan.segments, par.dp, par.tp, seg_bytes)
    if segment_param_bytes is not None:
        seg_bytes = dict(segment_param_bytes)
        replicated = dict(segment_param_bytes)
    if segment_allreduce_bytes is not None:
        replicated = dict(segment_allreduce_bytes)
    opt = optimizer_kind or par.optimizer
    inner = {int(s["index"]): [tuple(c) for c in s.get("tp_collectives") or []] for s in plan.segments}
    return LowerOptions(dp=par.dp, tp=par.tp, dp_shard=par.dp_shard, reshard_after_forward=par.reshard_after_forward,
                        fsdp_units=_fsdp_units(plan.segments, seg_bytes) if par.dp_shard > 1 else None,
                        segment_param_bytes=seg_bytes, segment_allreduce_bytes=replicated,
                        optimizer_kind=opt if opt in OPTIMIZER_KINDS else "adam", alltoalls=alltoalls,
                        tied=plan_tied_groups(plan), transforms=par.transforms,
                        grad_bucket_bytes=par.grad_bucket_bytes, segment_tp_collectives=inner,
                        layout=par.layout, precision=par.precision)


def _fsdp_units(segments: list[dict], seg_bytes: Mapping[int, int]) -> dict[int, list[tuple[int, float]]]:
    """Each segment's FSDP units (``segments[i]["fsdp_units"]``, :func:`engine.transform.fsdp_units`),
    their bytes scaled to ``seg_bytes`` (a runtime worker's measured bytes; the plan's otherwise).

    Raises:
        PlanFormatError: a malformed ``fsdp_units`` entry.
    """
    out: dict[int, list[tuple[int, float]]] = {}
    for i, s in enumerate(segments):
        try:
            units = [(int(b), float(t)) for b, t in s.get("fsdp_units") or []]
        except (TypeError, ValueError) as e:
            raise PlanFormatError(f"field 'segments[{i}].fsdp_units' is malformed ({type(e).__name__}: {e}); "
                                  "expected [[parameter bytes, forward seconds], ...]") from None
        k = int(s["index"])
        total, want = sum(b for b, _ in units), seg_bytes.get(k, 0)
        if units and total > 0 and want != total:
            units = [(b * want // total, t) for b, t in units]
        if units:
            out[k] = units
    return out


def lower_plan(plan: Plan, options: LowerOptions | None = None, **overrides: Any) -> ExecutionPlan:
    """Lower a (loaded or edited) plan with everything it records (:func:`plan_lower_options`):
    its schedule, ``dp``/``tp``, the segments' parameter bytes, the MoE layers of each segment
    (expert-parallel ``ALLTOALL`` instructions with ``dp > 1``), its tied weights (the tied
    ``ALLREDUCE`` before ``OPTIM`` on each holding rank) and its CoCoNet transformations.

    Args:
        plan: the plan.
        options: the options to lower with (default :func:`plan_lower_options` of ``plan``).
        overrides: ``segment_param_bytes``, ``segment_allreduce_bytes`` or ``optimizer_kind`` as
            :func:`plan_lower_options` takes them (without ``options``), or any
            :class:`~engine.dependency.LowerOptions` field to replace in ``options``.

    Raises:
        PlanFormatError: a malformed ``moe`` or ``tied_weights`` entry.
        TransformError: a segment's experts do not divide by the plan's ``dp``.
    """
    if options is None:
        options = plan_lower_options(plan, **overrides)
    elif overrides:
        options = replace(options, **overrides)
    return lower(plan.schedule, options)
