"""The whole planning pipeline in one call: capture -> transform -> schedule -> lower -> simulate.

``make_plan("gpt2", devices=4, micro_batches=8, schedule="1f1b")`` returns a
:class:`PlanResult` with the :class:`~engine.io.Plan` (ready for ``save_plan``), the predicted
:class:`~engine.timeline.Timeline` and the captured :class:`~engine.graph.OpGraph`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence, cast

from engine.baselines import build_schedule, placement_requirements
from engine.coconet import (
    DEFAULT_GRAD_BUCKET_BYTES,
    DEFAULT_OVERLAP_CHUNKS,
    check_transforms,
    parse_transforms,
)
from engine.config import ModelRef, OptimizerKind
from engine.cost import CostModel
from engine.cost.calibrate import Calibration, calibrated_durations
from engine.dependency import ExecutionPlan, TiedGroup, lower
from engine.errors import PlanFormatError, TesselError
from engine.graph import OpGraph, capture
from engine.io.plan import Plan
from engine.models import ModelBundle, build_model
from engine.models.moe.comm import (
    MoELayer,
    check_expert_parallel,
    expert_param_bytes_per_rank,
    find_moe_layers,
    moe_segment_collectives,
    segment_moe_layers,
)
from engine.models.moe.hf_moe import traceable_experts
from engine.placement import Placement
from engine.schedule import Schedule
from engine.split import choose_split
from engine.timeline import Timeline
from engine.transform import (
    LOSS_PARALLEL_TASKS,
    PARAM_STATE_FACTOR,
    ParallelConfig,
    Segment,
    TransformError,
    add_tied_copies,
    check_optimizer,
    gradient_bytes,
    split_segments,
    tied_parameter_groups,
)


@dataclass
class PlanResult:
    """What :func:`make_plan` produces.

    Attributes:
        plan: the versioned plan (save with :func:`engine.io.save_plan`).
        timeline: the predicted timeline of one step.
        graph: the captured operator graph of one micro-batch.
        execution: the per-rank instruction streams.
        warnings: things the user should know (memory above capacity, ...).
        timings: seconds spent in each phase (``capture``, ``transform``, ``schedule``, ``simulate``).
    """

    plan: Plan
    timeline: Timeline
    graph: OpGraph
    execution: ExecutionPlan
    warnings: list[str] = field(default_factory=list)
    timings: dict = field(default_factory=dict)


def placement_from_segments(segments: list[Segment], config: ParallelConfig, schedule: str = "1f1b", *,
                            forward_only: bool = False, optimizer: str = "adam",
                            tied_grad_bytes: Mapping[int, int] | None = None) -> Placement:
    """The placement a predefined schedule needs (looped V/interleaved, or ZB-V's V shape), with
    durations, activation memory and boundary tensors from the segments.

    Memory of a training placement: static memory per device = parameters of its segments with
    Adam's m and v (``PARAM_STATE_FACTOR`` = 3 x parameter bytes, for both optimizers); per
    segment, the gradient buffer and transient gradient of
    :func:`engine.transform.gradient_bytes` (``adam``: a buffer of the segment's parameter bytes
    from its first backward to the optimizer step; ``adama``: only a transient gradient of its
    largest parameter tensor during each backward, plus ``tied_grad_bytes[segment]``: the
    gradients of tied copies, which ``runtime.worker`` does not fold but keeps until the step)
    as ``grad_memory``/``grad_transient``. Inference (``forward_only``): the parameters only.

    Raises:
        TransformError: an unknown optimizer.
    """
    check_optimizer(optimizer)
    req = placement_requirements(schedule)
    base = req.make_placement(
        config.pp, virtual_stages=config.virtual_stages,
        forward=[s.forward_time for s in segments], backward=[s.backward_time for s in segments],
        activation_bytes=[s.activation_bytes for s in segments], forward_only=forward_only,
        outputs=[s.output for s in segments],
        input_grads=[segments[i - 1].output_grad if i > 0 else None for i in range(len(segments))],
    )
    static = [0] * config.pp
    for s in segments:
        static[base.spec("F", s.index).devices[0]] += s.param_bytes * (1 if forward_only else PARAM_STATE_FACTOR)
    if forward_only:
        return replace(base, static_memory=tuple(static))
    tied_g = dict(tied_grad_bytes or {}) if optimizer == "adama" else {}
    grads = [gradient_bytes(optimizer, s.param_bytes, s.max_param_bytes) for s in segments]
    grads = [(g + tied_g.get(s.index, 0), t) for (g, t), s in zip(grads, segments)]
    return replace(base, static_memory=tuple(static), grad_memory=tuple(g for g, _ in grads),
                   grad_transient=tuple(t for _, t in grads))


def make_plan(
    model: str | ModelBundle,
    *,
    task: str | None = None,
    devices: int = 4,
    micro_batches: int = 8,
    schedule: str = "1f1b",
    device_type: str = "h100",
    dp: int = 1,
    tp: int = 1,
    virtual_stages: int | None = None,
    micro_batch_size: int = 1,
    seq_len: int | None = None,
    dtype: str = "float32",
    memory_limit: float | None = None,
    optimizer: str = "adam",
    cost: CostModel | None = None,
    profile: bool = False,
    link: str | None = None,
    transforms: str | Sequence[str] | None = None,
    grad_bucket_bytes: int = DEFAULT_GRAD_BUCKET_BYTES,
    overlap_chunks: int = DEFAULT_OVERLAP_CHUNKS,
    progress: Callable[[str], None] | None = None,
) -> PlanResult:
    """Plan a model end to end.

    Args:
        model: a registry name (``gpt2``, ``gpt3-175b``, ``module:callable``...) or a built bundle.
        task: the training task recorded in the plan (``causal-lm``, ``masked-lm``, ``seq2seq``,
            ``image-classification``, ``module:callable``; :mod:`tasks`); ``None``: the model's own.
        devices: total devices; the pipeline degree is ``devices / (dp * tp)``.
        micro_batches: ``m`` per step.
        schedule: ``gpipe``, ``1f1b``, ``interleaved`` or ``zb-h1``.
        device_type: cost table entry (``h100``, ``a100``, ``cpu``).
        dp, tp: data- and tensor-parallel degrees.
        virtual_stages: segments per rank (default 2 for ``interleaved``, else 1).
        micro_batch_size: samples per micro-batch.
        seq_len: tokens per sample (model default if ``None``).
        dtype: parameter/activation dtype of the captured model and the cost table's peak
            (``float32``, ``bfloat16``, ``float16``).
        memory_limit: bytes per device for the split and the memory check (device capacity if ``None``).
        optimizer: ``adam`` (``torch.optim.Adam`` with gradient accumulation: each stage holds a
            gradient buffer of its parameter bytes from its first backward to the optimizer step)
            or ``adama`` (AdamA: micro-batch gradients folded into m and v and freed; only a
            transient gradient of the largest parameter tensor during each backward, and
            data-parallel replicas all-reduce m and v, 2x the parameter bytes, once per step).
            Recorded in ``plan.parallel.optimizer``; the predicted memory curves and peaks
            follow it.
        cost: a prepared cost model (e.g. with profiled op times); overrides ``device_type`` and ``link``.
        link: the link between every pair of ranks (:func:`engine.cost.parse_link`: ``nvlink``,
            ``infiniband``, ``emulated:1gbit`` for the emulated network, ``10gbit@5us``); ``None``:
            the device's defaults (NVLink within a node and InfiniBand across for GPUs, loopback
            for ``cpu``).
        profile: time every distinct op of the captured graph on this machine (cached, see
            :func:`engine.cost.profile_ops`) and use the measured times; ``device_type`` should then
            describe this machine (``cpu`` here).
        transforms: CoCoNet's transformations (``"sharded-update,overlap-grad-sync"`` or a list;
            :mod:`engine.coconet`), recorded in ``plan.parallel.transforms``, lowered, simulated and
            executed by the runtime.
        grad_bucket_bytes: the bucket size of ``overlap-grad-sync`` (bytes, a multiple of 4).
        overlap_chunks: the chunks of ``chunked-overlap``.
        progress: called with the name of each phase as it starts.

    Raises:
        TesselError: bad names or degrees, an unknown optimizer, a model that cannot be captured,
            a schedule that needs more micro-batches, a transformation the plan cannot take (each a
            one-sentence message).
    """
    check_optimizer(optimizer)
    tf = parse_transforms(transforms)
    say = progress or (lambda _msg: None)
    warnings_pre: list[str] = []
    timings: dict[str, float] = {}
    if devices < 1 or dp < 1 or tp < 1:
        raise TransformError(f"devices, dp and tp must be positive, got devices={devices}, dp={dp}, tp={tp}")
    if memory_limit is not None and not (memory_limit > 0 and math.isfinite(memory_limit)):
        raise TransformError(f"memory_limit must be a positive, finite number of bytes, got {memory_limit!r}")
    if devices % (dp * tp):
        raise TransformError(f"--devices {devices} is not divisible by dp*tp = {dp * tp}; pick devices = dp * tp * pp")
    pp = devices // (dp * tp)
    req = placement_requirements(schedule)
    vs = req.virtual_stages if virtual_stages is None else virtual_stages
    config = ParallelConfig(dp=dp, tp=tp, pp=pp, virtual_stages=vs, micro_batches=micro_batches,
                            micro_batch_size=micro_batch_size, transforms=tf, grad_bucket_bytes=grad_bucket_bytes,
                            overlap_chunks=overlap_chunks)
    config.check()

    t0 = time.perf_counter()
    say("capture")
    import torch

    tdtype = getattr(torch, dtype, None)
    if not isinstance(tdtype, torch.dtype):
        raise TransformError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    bundle = model if isinstance(model, ModelBundle) else build_model(model, batch_size=micro_batch_size,
                                                                      seq_len=seq_len, dtype=tdtype, task=task)
    if task is not None:
        bundle.task = task
    # MoE expert parallelism over the data-parallel group: experts must split evenly over dp
    moe_layers = find_moe_layers(bundle.module, max(1, bundle.batch_size * (bundle.seq_len or 1)))
    check_expert_parallel(moe_layers, dp, bundle.name)
    check_transforms(tf, dp=dp, tp=tp, pp=pp, optimizer=optimizer, split=choose_split(bundle.module, tp),
                     expert_parallel=dp > 1 and bool(moe_layers), seq_len=bundle.seq_len)
    # HF MoE blocks: capture their experts with a traceable implementation (same math and FLOPs)
    with traceable_experts(bundle.module):
        graph = capture(bundle.module, bundle.example_inputs, name=bundle.name)
    timings["capture"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    say("transform")
    if cost is None:
        table = None
        if profile:
            say("profile")
            from engine.cost import profile_ops

            ops = [graph.nodes[n] for n in graph.nodes if graph.nodes[n].get("op") == "call_function"]
            local = "cuda" if torch.cuda.is_available() else "cpu"
            if (local == "cpu") != (device_type == "cpu"):
                warnings_pre.append(f"op times were measured on this machine ({local}) "
                                    f"but --device-type is {device_type}")
            table = profile_ops(ops, device=local)
        cost = CostModel.for_device(device_type, link=link, inter_link=link, profile=table, dtype=dtype)
    segments, warnings = split_segments(graph, cost, config, memory_limit=memory_limit, optimizer=optimizer,
                                        loss_parallel=bundle.task in LOSS_PARALLEL_TASKS)
    warnings = warnings_pre + warnings
    seg_layers = [s.layers for s in segments]
    tied = tied_parameter_groups(bundle.module, seg_layers)
    segments = add_tied_copies(segments, tied)
    seg_moe = segment_moe_layers(moe_layers, seg_layers)
    segments = [_expert_parallel_split(s, seg_moe.get(s.index, []), dp, tp) for s in segments]
    placement = placement_from_segments(segments, config, schedule, optimizer=optimizer,
                                        tied_grad_bytes=_tied_bytes_per_segment(tied))
    timings["transform"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    say("schedule")
    sched: Schedule = build_schedule(schedule, placement, micro_batches)
    limit = memory_limit
    sched.validate(limit)
    timings["schedule"] = time.perf_counter() - t0

    seg_dicts = [_segment_dict(s, seg_moe.get(s.index, [])) for s in segments]
    cap = memory_limit if memory_limit is not None else cost.device.mem_capacity
    plan = Plan(
        model=ModelRef(name=bundle.name, source=bundle.source, config=bundle.config,
                       micro_batch_size=micro_batch_size, batch_size=micro_batch_size * micro_batches * dp,
                       seq_len=bundle.seq_len, dtype=graph.graph.get("dtype", "float32"),
                       num_params=graph.graph.get("num_params"), task=bundle.task,
                       split=choose_split(bundle.module, tp)),
        parallel=replace(config, optimizer=cast(OptimizerKind, optimizer)),
        segments=seg_dicts,
        schedule=sched,
        cost=cost.to_dict(),
        meta={"warnings": warnings, **({"memory_limit": memory_limit} if memory_limit is not None else {})},
        tied_weights=[g.to_dict() for g in tied],
    )

    t0 = time.perf_counter()
    say("simulate")
    # the plan's numbers come from the plan alone (engine.plan_metrics), as show/search/launch compute them
    from engine.plan_metrics import predict_execution

    execution, timeline, metrics = predict_execution(plan)
    plan.metrics = metrics
    timings["simulate"] = time.perf_counter() - t0

    over = [d for d, p in enumerate(metrics["peak_memory"]) if p > cap]
    if over:
        warnings.append(
            f"predicted peak memory on device(s) {over} is above {cap / 2**30:.1f} GiB; "
            "add devices, tensor parallelism (--tp) or fewer micro-batches in flight (1f1b)"
        )
    return PlanResult(plan, timeline, graph, execution, warnings, timings)


def _expert_parallel_split(seg: Segment, moe: list[MoELayer], dp: int, tp: int) -> Segment:
    """``seg`` with the parameter bytes of ONE expert-parallel rank: of each MoE layer's experts
    (``expert_param_bytes``, already split ``tp`` ways like every parameter) a replica holds
    ``1/dp`` (``ep = dp``). Unchanged without MoE layers or with ``dp == 1``."""
    if not moe or dp <= 1:
        return seg
    full = sum(ml.expert_param_bytes for ml in moe) // tp
    mine = expert_param_bytes_per_rank(moe, dp) // tp
    return replace(seg, param_bytes=max(0, seg.param_bytes - full + mine))


def _segment_dict(seg: Segment, moe: list[MoELayer]) -> dict:
    """The plan JSON dict of a segment; ``"moe"`` (its MoE layers, :class:`MoELayer` dicts) only
    when it has any, so plans of dense models are unchanged."""
    d = seg.to_dict()
    if moe:
        d["moe"] = [ml.to_dict() for ml in moe]
    return d


def _tied_bytes_per_segment(tied: list[TiedGroup]) -> dict[int, int]:
    out: dict[int, int] = {}
    for g in tied:
        for s in g.segments():
            out[s] = out.get(s, 0) + g.nbytes
    return out


def _segment_moe(seg: dict, where: str) -> list[MoELayer]:
    raw = seg.get("moe") or []
    try:
        return [MoELayer.from_dict(x) for x in raw]
    except (KeyError, TypeError, ValueError) as e:
        raise PlanFormatError(f"field '{where}.moe' is malformed ({type(e).__name__}: {e})") from None


def _lower_from(schedule: Schedule, segments: list[dict], *, dp: int, tp: int, optimizer_kind: str,
                tied: list[TiedGroup], segment_param_bytes: Mapping[int, int] | None = None,
                segment_allreduce_bytes: Mapping[int, int] | None = None, transforms: tuple[str, ...] = (),
                grad_bucket_bytes: int | None = None) -> ExecutionPlan:
    seg_bytes = {int(s["index"]): int(s.get("param_bytes", 0)) for s in segments}
    moe = {int(s["index"]): _segment_moe(s, f"segments[{i}]") for i, s in enumerate(segments)}
    moe = {k: v for k, v in moe.items() if v}
    alltoalls = {}
    replicated = dict(seg_bytes)
    if dp > 1:
        for k, layers in moe.items():
            check_expert_parallel(layers, dp, f"segment {k}")
            alltoalls[k] = moe_segment_collectives(layers, dp, "F")
            # experts are owned by one replica: only the replicated parameters are all-reduced
            replicated[k] = max(0, seg_bytes[k] - expert_param_bytes_per_rank(layers, dp) // max(1, tp))
    if segment_param_bytes is not None:
        seg_bytes = dict(segment_param_bytes)
        replicated = dict(segment_param_bytes)
    if segment_allreduce_bytes is not None:
        replicated = dict(segment_allreduce_bytes)
    inner = {int(s["index"]): [tuple(c) for c in s.get("tp_collectives") or []] for s in segments}
    return lower(schedule, dp=dp, segment_param_bytes=seg_bytes, optimizer_kind=optimizer_kind,
                 alltoalls=alltoalls, tied=tied, segment_allreduce_bytes=replicated, transforms=transforms, tp=tp,
                 grad_bucket_bytes=grad_bucket_bytes, segment_tp_collectives=inner)


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


def lower_plan(plan: Plan, *, segment_param_bytes: Mapping[int, int] | None = None,
               segment_allreduce_bytes: Mapping[int, int] | None = None,
               optimizer_kind: str | None = None) -> ExecutionPlan:
    """Lower a (loaded or edited) plan with everything it records: its schedule, ``dp``, the
    segments' parameter bytes, the MoE layers of each segment (``segments[i]["moe"]``: expert-
    parallel ``ALLTOALL`` instructions with ``dp > 1``) and its tied weights
    (``plan.tied_weights``: the tied ``ALLREDUCE`` before ``OPTIM`` on each holding rank).

    Args:
        plan: the plan.
        segment_param_bytes: override the plan's per-segment parameter bytes (e.g. a runtime
            worker's measured module bytes); then they are also the data-parallel all-reduce
            bytes unless ``segment_allreduce_bytes`` is given.
        segment_allreduce_bytes: bytes each segment's data-parallel ALLREDUCE reduces (default:
            the plan's replicated bytes: parameter bytes minus this rank's experts).
        optimizer_kind: ``adam`` or ``adama`` (default ``plan.parallel.optimizer``; ``adam`` for
            one unknown to the planner, e.g. the runtime's ``sgd``).

    Raises:
        PlanFormatError: a malformed ``moe`` or ``tied_weights`` entry.
        TransformError: a segment's experts do not divide by the plan's ``dp``.
    """
    opt = optimizer_kind or plan.parallel.optimizer
    par = plan.parallel
    return _lower_from(plan.schedule, plan.segments, dp=par.dp,
                       tp=par.tp, optimizer_kind=opt if opt in ("adam", "adama") else "adam",
                       tied=plan_tied_groups(plan), segment_param_bytes=segment_param_bytes,
                       segment_allreduce_bytes=segment_allreduce_bytes, transforms=par.transforms,
                       grad_bucket_bytes=par.grad_bucket_bytes)


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


def _with_block_durations(plan: Plan, durations: list[float], segments: list[dict],
                          meta: dict) -> tuple[Plan, Timeline]:
    """The plan with new per-block ``durations`` (seconds, in placement block order), segment
    dicts and extra ``meta``, re-simulated; the orders are unchanged and metrics recomputed."""
    s = plan.schedule
    schedule = Schedule(plan.placement.with_durations(durations), s.num_micro_batches, s.orders, s.name, dict(s.meta))
    new = Plan(plan.model, plan.parallel, segments, schedule, plan.cost, dict(plan.metrics), {**plan.meta, **meta},
               tied_weights=list(plan.tied_weights))
    from engine.plan_metrics import predict

    tl, metrics = predict(new)
    new.metrics.update(metrics)
    return new, tl


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
    segments = [dict(seg, forward_time=calibration.block_time(i, "F", seg.get("forward_time", 0.0)),
                     backward_time=calibration.block_time(i, "B", seg.get("backward_time", 0.0)))
                for i, seg in enumerate(plan.segments)]
    return _with_block_durations(plan, calibrated_durations(pl.blocks, calibration), segments,
                                 {"calibration": calibration.to_dict()})


def resimulate(plan: Plan) -> Timeline:
    """Re-lower (:func:`lower_plan`: MoE all-to-alls and tied all-reduces included) and
    re-simulate a (loaded or edited) plan with its stored cost model and optimizer
    (``plan.parallel.optimizer``, ``adam`` when absent; the placement carries the memory).
    A plan calibrated by :func:`with_calibration` predicts its optimizer step with the measured
    rate (``plan.meta["calibration"]``). The timeline of :func:`engine.plan_metrics.predict`, so its
    numbers are :func:`engine.plan_metrics.predicted_metrics`'s.

    Raises:
        PlanFormatError, TransformError, DeadlockError: as :func:`engine.plan_metrics.predict`.
    """
    from engine.plan_metrics import predict

    return predict(plan)[0]


__all__ = ["PlanResult", "make_plan", "resimulate", "with_calibration", "with_segment_times", "placement_from_segments",
           "lower_plan", "plan_tied_groups", "TesselError"]
