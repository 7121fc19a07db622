"""The whole planning pipeline in one call: capture -> transform -> schedule -> lower -> simulate.

``make_plan("gpt2", devices=4, micro_batches=8, schedule="1f1b")`` returns a
:class:`PlanResult` with the :class:`~engine.io.Plan` (ready for ``save_plan``), the predicted
:class:`~engine.timeline.Timeline` and the captured :class:`~engine.graph.OpGraph`. One function
per phase: :func:`parallel_config` (the arguments), :func:`capture_model`,
:func:`transform_model` (SuperScaler phase 1: segments and their placement), the schedule,
:func:`build_plan`, and the prediction (:func:`engine.plan.metrics.predict_execution`).

This module captures models, so it imports torch (``engine.plan`` loads it lazily).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence, cast

import torch

from engine.baselines import build_schedule, placement_requirements
from engine.coconet import (
    DEFAULT_GRAD_BUCKET_BYTES,
    DEFAULT_OVERLAP_CHUNKS,
    CoCoNetError,
    check_transforms,
    parse_transforms,
)
from engine.config import MAX_MICRO_BATCHES, ModelRef, OptimizerKind
from engine.cost import CostModel, profile_ops
from engine.cost.calibrate import Calibration
from engine.dependency import ExecutionPlan, TiedGroup
from engine.errors import ScheduleError
from engine.graph import OpGraph, capture
from engine.io.plan import Plan
from engine.models import ModelBundle, build_model
from engine.models.moe.comm import (
    MoELayer,
    check_expert_parallel,
    expert_param_bytes_per_rank,
    find_moe_layers,
    segment_moe_layers,
)
from engine.models.moe.hf_moe import traceable_experts
from engine.placement import Placement, recompute_in_split_backward
from engine.plan import capture_cache
from engine.plan.limits import MemoryLimitError, check_memory_limit
from engine.plan.metrics import memory_advice, predict_execution
from engine.precision import get_policy, plan_precision
from engine.recompute import check_recompute, stage_granularities
from engine.schedule import Schedule
from engine.split import choose_split, is_hf_t5, record_tp_plan, tensor_parallel_refusal, tp_transform_refusal
from engine.timeline import Timeline
from engine.tp_plan import check_tp_plan_matches
from engine.transform import (
    LOSS_PARALLEL_TASKS,
    LayerCost,
    ParallelConfig,
    Segment,
    TransformError,
    add_tied_copies,
    check_optimizer,
    gradient_bytes,
    resident_state_bytes,
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

    Memory of a training placement under ``config.precision`` (:mod:`engine.precision`,
    Megatron-LM's bytes per parameter): static memory per device = weights, master weights and
    Adam's m and v of its segments (:func:`engine.transform.resident_state_bytes`; ``32-true``:
    ``PARAM_STATE_FACTOR`` = 3 x parameter bytes, for both optimizers; the sharded update's
    saving is taken off by the lowering); per segment, the gradient buffer and transient gradient of
    :func:`engine.transform.gradient_bytes` in the policy's gradient dtype (``adam``: a buffer of
    the segment's parameters from its first backward to the optimizer step; ``adama``: only a transient gradient of its
    largest parameter tensor during each backward, plus ``tied_grad_bytes[segment]``: the
    gradients of tied copies, which ``runtime.worker`` does not fold but keeps until the step)
    as ``grad_memory``/``grad_transient``. Inference (``forward_only``): the parameters only.
    With activation recomputation (``Segment.recompute_time``, :mod:`engine.recompute`) the
    recomputed forward is in both the ``I`` and the ``W`` block of a split backward (two autograd
    passes: :func:`engine.placement.recompute_in_split_backward`), and each device's static memory holds its
    largest recomputation working set (``Segment.recompute_transient_bytes``): it is live during a
    backward, when the in-flight activations are at their level, so the peak counts it in full.

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
    prec = config.precision
    for s in segments:
        static[base.spec("F", s.index).devices[0]] += (
            s.param_bytes if forward_only else resident_state_bytes(s.param_bytes, prec))
    if forward_only:
        return replace(base, static_memory=tuple(static))
    base = recompute_in_split_backward(base, [s.recompute_time for s in segments])
    working = [0] * config.pp   # one backward at a time per device: its largest recomputation working set
    for s in segments:
        d = base.spec("F", s.index).devices[0]
        working[d] = max(working[d], s.recompute_transient_bytes)
    static = [x + w for x, w in zip(static, working)]
    pol = get_policy(prec)
    tied = tied_grad_bytes or {}
    tied_g = {k: pol.scale(v, pol.grad_bytes) for k, v in tied.items()} if optimizer == "adama" else {}
    grads = [gradient_bytes(optimizer, s.param_bytes, s.max_param_bytes, prec) for s in segments]
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
    dp_shard: int = 1,
    reshard_after_forward: bool | None = None,
    virtual_stages: int | None = None,
    micro_batch_size: int = 1,
    seq_len: int | None = None,
    dtype: str | None = None,
    precision: str | None = None,
    recompute: str = "none",
    stage_recompute: Sequence[str] | None = None,
    memory_limit: float | None = None,
    optimizer: str = "adam",
    cost: CostModel | None = None,
    profile: bool = False,
    link: str | None = None,
    inter_link: str | None = None,
    devices_per_node: int = 8,
    transforms: str | Sequence[str] | None = None,
    grad_bucket_bytes: int = DEFAULT_GRAD_BUCKET_BYTES,
    overlap_chunks: int = DEFAULT_OVERLAP_CHUNKS,
    tp_plan: dict[str, str] | None = None,
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
        dp, tp: data- and tensor-parallel degrees (``dp`` = ``dp_replicate x dp_shard``).
        dp_shard: of ``dp``, the fully sharded degree (FSDP2, ZeRO-3; :mod:`engine.dependency.fsdp`);
            it divides ``dp``, and ``dp // dp_shard`` replicas of the shard group make HSDP.
        reshard_after_forward: FSDP2's option (:attr:`engine.config.ParallelConfig.reshard_after_forward`);
            ``None``: torchtitan's default (``True`` without a pipeline, ``False`` with one).
        virtual_stages: segments per rank (default 2 for ``interleaved``, else 1).
        micro_batch_size: samples per micro-batch.
        seq_len: tokens per sample (model default if ``None``).
        dtype: the old way to say the precision (``float32`` -> ``32-true``, ``bfloat16`` ->
            ``bf16-true``, ``float16`` -> ``16-mixed``; :func:`engine.precision.resolve_precision`);
            with ``precision`` it must be the policy's compute dtype.
        precision: the precision policy (``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``;
            :mod:`engine.precision`); ``None``: from ``dtype``, else the device type's default
            (``bf16-mixed`` on GPUs, ``32-true`` on ``cpu``). The model is captured in the
            policy's compute dtype (activations stored in it), the cost model uses that dtype's
            peak, and the memory model counts Megatron-LM's bytes per parameter. Recorded in
            ``plan.parallel.precision``.
        recompute: activation recomputation (``none``, ``selective``, ``full``;
            :mod:`engine.recompute`), recorded in ``plan.parallel.recompute``.
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
        inter_link: the link between nodes, in the same spellings; ``None``: ``link`` (or the
            device's default when that is ``None`` too).
        devices_per_node: devices on one node; device ``i`` is on node ``i // devices_per_node``
            (:mod:`engine.layout`), which decides the link between two ranks and, on a Ray
            cluster, the node ``tessel launch --address`` runs each rank on.
        profile: time every distinct op of the captured graph on this machine (cached, see
            :func:`engine.cost.profile_ops`) and use the measured times; ``device_type`` should then
            describe this machine (``cpu`` here).
        transforms: CoCoNet's transformations (``"sharded-update,overlap-grad-sync"`` or a list;
            :mod:`engine.coconet`), recorded in ``plan.parallel.transforms``, lowered, simulated and
            executed by the runtime.
        grad_bucket_bytes: the bucket size of ``overlap-grad-sync`` (bytes, a multiple of 4).
        overlap_chunks: the chunks of ``chunked-overlap``.
        tp_plan: a tensor-parallel plan for the transformer blocks replacing the model's own
            (:mod:`engine.tp_plan`, ``tessel plan --tp-plan``), recorded in ``plan.parallel.tp_plan``,
            costed (:class:`engine.tp_plan.ShardedSublayers`) and executed by the runtime.
        progress: called with the name of each phase as it starts.
        stage_recompute: per-stage recomputation overriding ``recompute``: one granularity per
            pipeline stage (``pp`` values; an interleaved rank's segments share its value) or per
            segment (:func:`engine.recompute.stage_granularities`); each segment records its own
            in the plan where it differs from ``recompute``, and the runtime wraps each stage's
            blocks as its segment says.

    Raises:
        TesselError: bad names or degrees, an unknown optimizer, precision or recomputation, a
            ``dtype`` that contradicts ``precision``, a model that cannot be captured, a schedule
            that needs more micro-batches, a transformation the plan cannot take (each a
            one-sentence message); a schedule above ``memory_limit`` (:class:`ScheduleError`, rule
            ``memory``) names the term that dominates the peak and the smallest fix
            (:func:`engine.plan.metrics.memory_advice`).
    """
    say = progress or (lambda _msg: None)
    timings: dict[str, float] = {}
    precision = plan_precision(precision, dtype, device_type if cost is None else cost.device.name,
                               None if cost is None else cost.dtype)
    compute = get_policy(precision).compute_dtype
    config = parallel_config(devices, micro_batches=micro_batches, schedule=schedule, dp=dp, tp=tp,
                             dp_shard=dp_shard, reshard_after_forward=reshard_after_forward,
                             virtual_stages=virtual_stages, micro_batch_size=micro_batch_size,
                             memory_limit=memory_limit, optimizer=optimizer, transforms=transforms,
                             grad_bucket_bytes=grad_bucket_bytes, overlap_chunks=overlap_chunks,
                             precision=precision, recompute=recompute, tp_plan=tp_plan)

    grans = stage_granularities(recompute, config.num_segments, config.pp, stage_recompute)
    t0 = time.perf_counter()
    say("capture")
    captured = capture_model(model, config, task=task, seq_len=seq_len, dtype=compute,
                             recomputes=any(g != "none" for g in grans))
    timings["capture"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    say("transform")
    if cost is None:
        cost = _cost_model(captured.graph, device_type, link=link, profile=profile, dtype=compute, say=say,
                           warnings=captured.warnings, inter_link=inter_link, devices_per_node=devices_per_node)
    timings["transform"] = time.perf_counter() - t0
    res = plan_from_capture(captured, config, cost, schedule, memory_limit=memory_limit,
                            stage_recompute=None if stage_recompute is None else grans, say=say)
    res.timings = {**timings, "transform": timings["transform"] + res.timings["transform"],
                   **{k: v for k, v in res.timings.items() if k != "transform"}}
    return res


def plan_from_capture(captured: CapturedModel, config: ParallelConfig, cost: CostModel, schedule: str, *,
                      memory_limit: float | None = None, stage_recompute: Sequence[str] | None = None,
                      say: Callable[[str], None] | None = None, cut: TransformedModel | None = None,
                      calibration: Mapping | None = None) -> PlanResult:
    """:func:`make_plan` after the capture: transform (SuperScaler phase 1), the predefined
    ``schedule`` (phase 2), the plan, its lowering and simulation (phase 3) and the memory check,
    for an already captured model and cost model (``tessel tune`` captures once per micro-batch
    size and calls this for every configuration; :func:`recheck_capture` adapts the capture).

    Args:
        captured: :func:`capture_model`'s result for ``config.micro_batch_size``.
        config: the configuration (:func:`parallel_config`).
        cost: the cost model.
        schedule: a predefined schedule name (:data:`engine.baselines.SCHEDULES`).
        memory_limit: bytes per device (device capacity if ``None``).
        stage_recompute: per-segment granularities overriding ``config.recompute``.
        say: called with the name of each phase as it starts.
        cut: :func:`transform_model`'s result for exactly these arguments, when the caller has it.
        calibration: a measured calibration (:meth:`engine.cost.calibrate.Calibration.to_dict`) kept in
            ``plan.meta["calibration"]``, so the prediction uses its point-to-point, collective and
            optimizer costs (:class:`engine.cost.calibrate.CalibratedCost`); its per-segment block
            times belong to the plan it was measured on and should be left out. Without them, its
            ``compute_scale`` multiplies the block durations (:func:`transferable_scale`; a ``cut``
            given by the caller must have been made with it).

    Raises:
        TesselError: as :func:`make_plan` (a split that does not fit, a schedule that needs more
            micro-batches, a schedule above ``memory_limit``).
    """
    say = say or (lambda _msg: None)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    if cut is None:
        cut = transform_model(captured, config, cost, schedule, memory_limit=memory_limit,
                              stage_recompute=stage_recompute, compute_scale=transferable_scale(calibration))
    timings["transform"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    say("schedule")
    sched: Schedule = build_schedule(schedule, cut.placement, config.micro_batches)
    over_limit: ScheduleError | None = None
    # the sharded update and FSDP shard the static memory in the lowering: their limit is checked
    # on the simulated peak below, which counts the shards (and FSDP's gathered units)
    sharded = config.fully_sharded or ("sharded-update" in config.transforms and config.dp > 1)
    try:
        sched.validate(None if sharded else memory_limit)
    except ScheduleError as e:
        if e.rule != "memory":
            raise
        over_limit = e   # raised below with what dominates the peak and the smallest fix
    timings["schedule"] = time.perf_counter() - t0

    plan = build_plan(captured, cut, config, sched, cost, memory_limit=memory_limit)
    if calibration:
        plan.meta["calibration"] = dict(calibration)
    record_tp_plan(plan.meta, captured.bundle.module, config.tp_plan,
                   sharded=config.tp > 1 and captured.split == "layers")

    t0 = time.perf_counter()
    say("simulate")
    # the plan's numbers come from the plan alone (engine.plan.metrics), as show/search/launch compute them
    execution, timeline, metrics = predict_execution(plan)
    plan.metrics = metrics
    timings["simulate"] = time.perf_counter() - t0
    if sharded and memory_limit is not None and over_limit is None:
        peaks = metrics["peak_memory"]
        d = max(range(len(peaks)), key=lambda i: peaks[i])
        if peaks[d] > memory_limit:
            over_limit = ScheduleError("memory", f"device {d} peaks at {peaks[d]:,.0f} bytes, above the memory "
                                       f"limit of {memory_limit:,.0f}", d, None)
    if over_limit is not None:
        raise ScheduleError("memory", f"{over_limit}; {memory_advice(plan)}", over_limit.device,
                            over_limit.block) from None

    warnings = cut.warnings   # the plan's meta warnings are this list: the memory warning joins them
    cap = memory_limit if memory_limit is not None else cost.device.mem_capacity
    over = [d for d, p in enumerate(metrics["peak_memory"]) if p > cap]
    if over:
        warnings.append(f"predicted peak memory on device(s) {over} is above {cap / 2**30:.1f} GiB; "
                        + memory_advice(plan))
    return PlanResult(plan, timeline, captured.graph, execution, warnings, timings)


def parallel_config(devices: int, *, micro_batches: int, schedule: str, dp: int = 1, tp: int = 1,
                    dp_shard: int = 1, reshard_after_forward: bool | None = None,
                    virtual_stages: int | None = None, micro_batch_size: int = 1, memory_limit: float | None = None,
                    optimizer: str = "adam", transforms: str | Sequence[str] | None = None,
                    grad_bucket_bytes: int = DEFAULT_GRAD_BUCKET_BYTES,
                    overlap_chunks: int = DEFAULT_OVERLAP_CHUNKS, precision: str = "32-true",
                    recompute: str = "none", tp_plan: dict[str, str] | None = None) -> ParallelConfig:
    """:func:`make_plan`'s arguments checked, as the plan's :class:`~engine.config.ParallelConfig`
    (``pp = devices / (dp * tp)``; ``virtual_stages`` default: the schedule's; ``precision`` and
    ``recompute`` recorded as given: :mod:`engine.precision`, :mod:`engine.recompute`).

    Raises:
        TesselError: an unknown optimizer, transformation, schedule, precision or recomputation;
            non-positive degrees; devices not divisible by ``dp * tp``; a memory limit that is not
            a positive finite number; more micro-batches than :data:`engine.config.MAX_MICRO_BATCHES`.
    """
    check_optimizer(optimizer)
    get_policy(precision)
    check_recompute(recompute)
    tf = parse_transforms(transforms)
    if devices < 1 or dp < 1 or tp < 1:
        raise TransformError(f"devices, dp and tp must be positive, got devices={devices}, dp={dp}, tp={tp}")
    if memory_limit is not None:
        try:
            check_memory_limit(memory_limit, what="memory_limit (bytes)")
        except MemoryLimitError as e:   # a planning argument: the planner's error, as every other one here
            raise TransformError(str(e)) from None
    if devices % (dp * tp):
        raise TransformError(f"--devices {devices} is not divisible by dp*tp = {dp * tp}; pick devices = dp * tp * pp")
    req = placement_requirements(schedule)
    vs = req.virtual_stages if virtual_stages is None else virtual_stages
    config = ParallelConfig(dp=dp, tp=tp, pp=devices // (dp * tp), virtual_stages=vs, micro_batches=micro_batches,
                            micro_batch_size=micro_batch_size, dp_shard=dp_shard,
                            reshard_after_forward=reshard_after_forward, transforms=tf,
                            grad_bucket_bytes=grad_bucket_bytes,
                            overlap_chunks=overlap_chunks, optimizer=cast(OptimizerKind, optimizer),
                            precision=precision, recompute=recompute, tp_plan=tp_plan)
    config.check()
    if micro_batches > MAX_MICRO_BATCHES:
        raise TransformError(f"micro_batches = {micro_batches:,} is more than a plan can hold ({MAX_MICRO_BATCHES:,}: "
                             "its schedule lists every micro-batch's blocks and the simulator runs each); use fewer "
                             "micro-batches, a larger micro-batch size or more data-parallel replicas")
    return config


@dataclass
class CapturedModel:
    """:func:`capture_model`'s result.

    Attributes:
        bundle: the built model, its example inputs and task.
        graph: the operator graph of one micro-batch.
        moe_layers: the model's MoE layers (expert parallelism over the data-parallel group).
        split: the stage split the runtime will use (:func:`engine.split.choose_split`).
        warnings: things the user should know, gathered while planning.
    """

    bundle: ModelBundle
    graph: OpGraph
    moe_layers: list[MoELayer]
    split: str
    warnings: list[str] = field(default_factory=list)


def capture_model(model: str | ModelBundle, config: ParallelConfig, *, task: str | None = None,
                  seq_len: int | None = None, dtype: str = "float32", recomputes: bool | None = None) -> CapturedModel:
    """Build (unless given) and capture ``model`` for one micro-batch of ``config.micro_batch_size``
    samples, after checking its experts split over ``config.dp`` and the plan's transformations
    (:func:`engine.coconet.check_transforms`); HF MoE blocks are captured with a traceable
    implementation of their experts (same math and FLOPs). ``recomputes``: whether any stage
    recomputes activations (``None``: ``config.recompute`` says), which takes the layer split
    (:func:`engine.split.choose_split`).

    Raises:
        TesselError: an unknown dtype or model, experts that do not split over ``dp``, a
            transformation the plan cannot take, a model that cannot be captured.
    """
    tdtype = getattr(torch, dtype, None)
    if not isinstance(tdtype, torch.dtype):
        raise TransformError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    key = capture_cache.cache_key(model, config.micro_batch_size, seq_len, dtype, task)
    kept = capture_cache.get(key)
    if kept is not None:   # the same built-in model traced before at this shape, dtype and task
        return recheck_capture(kept, config, recomputes=recomputes)
    bundle = model if isinstance(model, ModelBundle) else build_model(
        model, batch_size=config.micro_batch_size, seq_len=seq_len, dtype=tdtype, task=task)
    if task is not None:
        bundle.task = task
    # MoE expert parallelism over the data-parallel group: experts must split evenly over dp
    moe_layers = find_moe_layers(bundle.module, max(1, bundle.batch_size * (bundle.seq_len or 1)))
    split = _checked_split(bundle, moe_layers, config, recomputes)
    with traceable_experts(bundle.module):
        graph = capture(bundle.module, bundle.example_inputs, name=bundle.name)
    captured = CapturedModel(bundle, graph, moe_layers, split)
    capture_cache.put(key, CapturedModel(bundle, graph, moe_layers, split))
    return captured


def recheck_capture(captured: CapturedModel, config: ParallelConfig, *,
                    recomputes: bool | None = None) -> CapturedModel:
    """``captured`` (a capture of ``config.micro_batch_size`` samples) for another configuration:
    its experts checked to split over ``config.dp``, the stage split chosen for ``config.tp``,
    recomputation and ``config.dp_shard`` (:func:`engine.split.choose_split`) and the plan's transformations checked
    (:func:`engine.coconet.check_transforms`). The graph is shared, not copied: a capture does
    not depend on the degrees. ``recomputes``: whether any stage recomputes (``None``:
    ``config.recompute != "none"``).

    Raises:
        TesselError: experts that do not split over ``dp``, a transformation the plan cannot take.
    """
    split = _checked_split(captured.bundle, captured.moe_layers, config, recomputes)
    return CapturedModel(captured.bundle, captured.graph, captured.moe_layers, split, list(captured.warnings))


def _checked_split(bundle: ModelBundle, moe_layers: list[MoELayer], config: ParallelConfig,
                   recomputes: bool | None) -> str:
    """The stage split of ``bundle`` under ``config`` after the checks that depend on the degrees
    (experts over ``dp``, the transformations); see :func:`recheck_capture`."""
    check_expert_parallel(moe_layers, config.dp, bundle.name)
    if recomputes is None:
        recomputes = config.recompute != "none"
    split = choose_split(bundle.module, config.tp, "full" if recomputes else "none", config.dp_shard)
    check_transforms(config.transforms, dp=config.dp, tp=config.tp, pp=config.pp, optimizer=config.optimizer,
                     split=split, expert_parallel=config.dp > 1 and bool(moe_layers), seq_len=bundle.seq_len)
    if config.tp_plan is not None:
        check_tp_plan_matches(config.tp_plan, bundle.module, bundle.name)
    why = (tensor_parallel_refusal(bundle.module, bundle.name, config.tp_plan) if config.tp > 1 and split == "layers"
           else None)
    if why:
        raise TransformError(why)
    why = tp_transform_refusal(bundle.module, bundle.name, parse_transforms(config.transforms), tp=config.tp,
                               tp_plan=config.tp_plan, moe=bool(moe_layers))
    if why:
        raise CoCoNetError(why)
    if is_hf_t5(bundle.module) and config.dp_shard > 1 and split == "layers":
        raise TransformError(f"{bundle.name!r} is a T5, whose eager stages (needed here for tensor parallelism or "
                             "recomputation) the runtime does not shard with FSDP2; plan it with dp_shard 1")
    return split


def _cost_model(graph: OpGraph, device_type: str, *, link: str | None, profile: bool, dtype: str,
                say: Callable[[str], None], warnings: list[str], inter_link: str | None = None,
                devices_per_node: int = 8) -> CostModel:
    """The cost model of ``device_type`` (``profile``: with the op times measured on this machine,
    a warning appended when this machine is not that kind of device)."""
    table = None
    if profile:
        say("profile")
        ops = [graph.nodes[n] for n in graph.nodes if graph.nodes[n].get("op") == "call_function"]
        local = "cuda" if torch.cuda.is_available() else "cpu"
        if (local == "cpu") != (device_type == "cpu"):
            warnings.append(f"op times were measured on this machine ({local}) but --device-type is {device_type}")
        table = profile_ops(ops, device=local)
    return CostModel.for_device(device_type, link=link, inter_link=inter_link or link, profile=table, dtype=dtype,
                                devices_per_node=devices_per_node)


@dataclass
class TransformedModel:
    """:func:`transform_model`'s result (SuperScaler phase 1).

    Attributes:
        segments: the stages, with tied copies and this rank's share of the experts counted.
        tied: the tied-parameter groups across segments.
        segment_moe: each segment's MoE layers.
        placement: the placement the schedule needs, with the segments' costs and memory.
        warnings: the capture's warnings plus the split's.
    """

    segments: list[Segment]
    tied: list[TiedGroup]
    segment_moe: dict[int, list[MoELayer]]
    placement: Placement
    warnings: list[str]


def transferable_scale(calibration: Mapping | None) -> Calibration | None:
    """The calibration document (:meth:`~engine.cost.calibrate.Calibration.to_dict`) as a
    :class:`~engine.cost.calibrate.Calibration` whose ``compute_scale`` applies to other plans: one
    with no per-segment block times (those replace the durations of the plan they were measured
    on) and a non-empty scale. ``None`` otherwise.

    Raises:
        CostModelError: a malformed document (names the field).
    """
    if not calibration or calibration.get("blocks") or not calibration.get("compute_scale"):
        return None
    return Calibration.from_dict(dict(calibration))


def transform_model(captured: CapturedModel, config: ParallelConfig, cost: CostModel, schedule: str, *,
                    memory_limit: float | None = None,
                    stage_recompute: Sequence[str] | None = None,
                    layers: Sequence[LayerCost] | None = None,
                    compute_scale: Calibration | None = None) -> TransformedModel:
    """Cut the captured graph into segments under ``memory_limit`` (bytes per device;
    :func:`engine.transform.split_segments`), count the tied copies and each expert-parallel
    rank's experts in them, and build the placement ``schedule`` needs
    (:func:`placement_from_segments`); ``stage_recompute``: the per-segment override of
    ``config.recompute``, ``layers``: the layers' costs when the caller has them
    (:func:`engine.transform.split_segments`); ``compute_scale``: a calibration whose per-kind
    measured factor scales the placement's block durations
    (:meth:`engine.cost.calibrate.Calibration.scaled`: a backward's recomputed forward at the
    forward's factor).

    Raises:
        TransformError: a split that does not fit.
    """
    bundle, optimizer = captured.bundle, config.optimizer
    segments, warnings = split_segments(captured.graph, cost, config, memory_limit=memory_limit, optimizer=optimizer,
                                        loss_parallel=bundle.task in LOSS_PARALLEL_TASKS,
                                        stage_recompute=stage_recompute, layers=layers)
    seg_layers = [s.layers for s in segments]
    tied = tied_parameter_groups(bundle.module, seg_layers)
    segments = add_tied_copies(segments, tied, config.tp)
    seg_moe = segment_moe_layers(captured.moe_layers, seg_layers)
    segments = [_expert_parallel_split(s, seg_moe.get(s.index, []), config.dp, config.tp) for s in segments]
    placement = placement_from_segments(segments, config, schedule, optimizer=optimizer,
                                        tied_grad_bytes=_tied_bytes_per_segment(tied, config.tp))
    if compute_scale is not None:
        recompute = {s.index: s.recompute_time for s in segments}
        placement = placement.with_durations([compute_scale.scaled(b.kind, b.duration, recompute.get(b.segment, 0.0))
                                              for b in placement.blocks])
    return TransformedModel(segments, tied, seg_moe, placement, captured.warnings + warnings)


def build_plan(captured: CapturedModel, cut: TransformedModel, config: ParallelConfig, schedule: Schedule,
               cost: CostModel, *, memory_limit: float | None = None) -> Plan:
    """The :class:`~engine.io.Plan` of ``schedule`` on the transformed model (no metrics yet)."""
    bundle, graph = captured.bundle, captured.graph
    mbs = config.micro_batch_size
    return Plan(
        model=ModelRef(name=bundle.name, source=bundle.source, config=bundle.config,
                       micro_batch_size=mbs, batch_size=mbs * config.micro_batches * config.dp,
                       seq_len=bundle.seq_len, dtype=graph.graph.get("dtype", "float32"),
                       num_params=graph.graph.get("num_params"), task=bundle.task, split=captured.split),
        parallel=config,
        segments=[_segment_dict(s, cut.segment_moe.get(s.index, []), config.recompute, config.fully_sharded)
                  for s in cut.segments],
        schedule=schedule,
        cost=cost.to_dict(),
        meta={"warnings": cut.warnings, **({"memory_limit": memory_limit} if memory_limit is not None else {})},
        tied_weights=[g.to_dict() for g in cut.tied],
    )


def _expert_parallel_split(seg: Segment, moe: list[MoELayer], dp: int, tp: int) -> Segment:
    """``seg`` with the parameter bytes of ONE expert-parallel rank: of each MoE layer's experts
    (``expert_param_bytes``, already split ``tp`` ways like every parameter) a replica holds
    ``1/dp`` (``ep = dp``). Unchanged without MoE layers or with ``dp == 1``."""
    if not moe or dp <= 1:
        return seg
    full = sum(ml.expert_param_bytes for ml in moe) // tp
    mine = expert_param_bytes_per_rank(moe, dp) // tp
    return replace(seg, param_bytes=max(0, seg.param_bytes - full + mine))


def _segment_dict(seg: Segment, moe: list[MoELayer], recompute: str = "none", fully_sharded: bool = False) -> dict:
    """The plan JSON dict of a segment; ``"moe"`` (its MoE layers, :class:`MoELayer` dicts) only
    when it has any, so plans of dense models are unchanged; ``"recompute"`` whenever the segment's
    granularity differs from the plan's ``recompute`` (a per-stage override of ``none`` included),
    so :func:`engine.recompute.plan_granularities` reads every segment's back; ``"fsdp_units"``
    (``[[parameter bytes, forward seconds], ...]``, :func:`engine.transform.fsdp_units`) in a
    fully sharded plan."""
    d = seg.to_dict()
    if fully_sharded and seg.fsdp_units:
        d["fsdp_units"] = [[int(b), float(t)] for b, t in seg.fsdp_units]
    if seg.recompute != recompute:
        d["recompute"] = seg.recompute
    if moe:
        d["moe"] = [ml.to_dict() for ml in moe]
    return d


def _tied_bytes_per_segment(tied: list[TiedGroup], tp: int = 1) -> dict[int, int]:
    """Per segment, one tensor rank's bytes of the tied weights it holds (``nbytes / tp``)."""
    out: dict[int, int] = {}
    for g in tied:
        for s in g.segments():
            out[s] = out.get(s, 0) + g.nbytes // max(1, tp)
    return out


__all__ = ["CapturedModel", "PlanResult", "TransformedModel", "build_plan", "capture_model", "make_plan",
           "parallel_config", "placement_from_segments", "plan_from_capture", "recheck_capture", "transferable_scale",
           "transform_model"]
