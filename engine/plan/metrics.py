"""A plan's predicted metrics, computed from the plan alone: the one source of every predicted number.

``tessel plan``, ``tessel search`` (its plan and its table), ``tessel show``, ``tessel launch``'s
"predicted" column and the app all print what :func:`predicted_metrics` returns for the same
plan, so they agree; ``plan.metrics`` as saved by :func:`engine.plan.make.make_plan` and
:func:`engine.plan.from_search.plan_from_search` equals ``predicted_metrics(load_plan(path))``
(plus, for a searched plan, the search's summary).

The prediction lowers the plan with everything it records (:func:`engine.plan.lowering.lower_plan`:
segments' parameter bytes, ``dp``/``tp``, tied weights, CoCoNet transformations, MoE all-to-alls)
and simulates it (:func:`engine.simulate.simulate`) with its stored cost model
(``plan.cost``; a calibration in ``plan.meta["calibration"]`` included). A plan without a cost
model is abstract (``tessel search`` without ``--model``): its times and memory are in the
placement's own units, ``time_unit`` says so and it has no tokens.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from engine.cost import CostModel
from engine.cost.calibrate import CalibratedCost, Calibration
from engine.dependency import ExecutionPlan
from engine.plan.lowering import lower_plan
from engine.precision import PrecisionPolicy, get_policy
from engine.recompute import plan_granularities
from engine.simulate import simulate
from engine.timeline import Timeline

if TYPE_CHECKING:
    from engine.io.plan import Plan

__all__ = ["predict", "predict_execution", "predicted_metrics", "is_abstract", "tokens_per_step", "METRIC_KEYS",
           "model_flops", "memory_breakdown", "memory_advice", "peak_flops", "plan_facts", "MEMORY_BREAKDOWN_KEYS"]

#: The keys :func:`predicted_metrics` always returns.
METRIC_KEYS = ("makespan", "bubble_ratio", "bubble_ratios", "peak_memory", "time_unit", "memory_unit",
               "tokens_per_step", "tokens_per_second", "memory_capacity", "model_flops", "tflops_per_device",
               "mfu", "memory_breakdown")

#: The keys of ``metrics["memory_breakdown"]`` (:func:`memory_breakdown`).
MEMORY_BREAKDOWN_KEYS = ("device", "peak", "parameter_bytes", "weights_and_optimizer_states", "gradients",
                         "activations_per_micro_batch", "micro_batches_in_flight")


def is_abstract(plan: Plan) -> bool:
    """Whether ``plan`` is in abstract units: it records no cost model (``plan.cost`` empty), as
    ``tessel search`` without ``--model`` (placement shapes or a placement JSON file) writes."""
    return not plan.cost


def tokens_per_step(plan: Plan) -> int:
    """Tokens (samples for a task without a sequence) one step of ``plan`` trains on:
    ``micro_batch_size x seq_len x micro-batches x data replicas``, where the data replicas are
    ``dp`` times the placement's ``data_per_instance`` (2 for Tessel's X shape: two model
    replicas per instance) and the micro-batches are the schedule's. 0 for an abstract plan.
    """
    if is_abstract(plan):
        return 0
    ref = plan.model
    replicas = max(1, int(plan.parallel.dp)) * max(1, int(plan.placement.data_per_instance))
    return int(ref.micro_batch_size) * int(ref.seq_len or 1) * int(plan.schedule.num_micro_batches) * replicas


def _memory_capacity(plan: Plan) -> float | None:
    """The per-device memory the plan was checked against: ``plan.meta["memory_limit"]`` (bytes, or
    units for an abstract plan) where the planner recorded one, else the cost model's device
    capacity (bytes); ``None`` for an abstract plan without a limit."""
    limit = plan.meta.get("memory_limit")
    if limit is not None:
        return float(limit)
    if is_abstract(plan):
        return None
    return float(CostModel.from_dict(plan.cost).device.mem_capacity)


def model_flops(plan: Plan) -> float:
    """Model FLOPs of one step of ``plan`` as Megatron-LM counts them (Narayanan et al., SC'21,
    section 5.1: forward + backward = 3 x forward; recomputation is hardware FLOPs, not model
    FLOPs): ``3 x forward FLOPs of one micro-batch x micro-batches x data replicas``. The forward
    FLOPs of one micro-batch are the segments' ``flops`` (per tensor-parallel rank) x ``tp``,
    each model part once (a replica segment, ``replica_of``, is another micro-batch's); the data
    replicas are ``dp x data_per_instance`` (:func:`tokens_per_step`). 0.0 for an abstract plan
    or one whose segments record no FLOPs.
    """
    if is_abstract(plan):
        return 0.0
    forward = sum(float(s.get("flops", 0.0) or 0.0) for s in plan.segments if s.get("replica_of") is None)
    forward *= max(1, int(plan.parallel.tp))
    replicas = max(1, int(plan.parallel.dp)) * max(1, int(plan.placement.data_per_instance))
    return 3.0 * forward * int(plan.schedule.num_micro_batches) * replicas


def _in_flight(plan: Plan, timeline: Timeline, device: int, act: dict[int, int]) -> float:
    """The most micro-batches of activations ``device`` holds at once over the step: each
    (segment, micro-batch) counts its share of the device's activations per micro-batch from the
    start of its forward to the end of its last backward block (``B``, or ``W``)."""
    total = sum(act.values())
    if total <= 0 or plan.placement.forward_only:
        return 1.0 if total > 0 else 0.0
    starts: dict[tuple[int, int], float] = {}
    ends: dict[tuple[int, int], float] = {}
    for e in timeline.events:
        if e.rank != device or e.stream != "compute" or e.segment not in act:
            continue
        key = (e.segment, e.micro_batch)
        if e.op == "F":
            starts[key] = min(starts.get(key, e.start), e.start)
        elif e.op in ("B", "W", "I"):
            ends[key] = max(ends.get(key, e.end), e.end)
    points = sorted([(t, 1, act[k[0]]) for k, t in starts.items()]
                    + [(t, 0, -act[k[0]]) for k, t in ends.items() if k in starts])
    held = best = 0
    for _, _, delta in points:
        held += delta
        best = max(best, held)
    return best / total


def memory_breakdown(plan: Plan, execution: ExecutionPlan, timeline: Timeline) -> dict | None:
    """What the device with the highest predicted peak holds (bytes): ``device``, ``peak``,
    ``parameter_bytes`` (its weights), ``weights_and_optimizer_states`` (its static memory: weights,
    master weights, Adam's states, sharded by ``sharded-update``; under FSDP the shards of the
    parameters and Adam's states), ``gradients`` (its segments' gradient buffers; FSDP's in its
    reduce dtype, sharded without a pipeline), ``activations_per_micro_batch`` (what one micro-batch's forward blocks on
    it keep for the backward) and ``micro_batches_in_flight`` (the most micro-batches of those
    it holds at once, :func:`_in_flight`). ``None`` for an abstract plan."""
    if is_abstract(plan):
        return None
    peaks = timeline.peak_memory()
    if not peaks:
        return None
    d = max(range(len(peaks)), key=lambda i: peaks[i])
    pl = plan.placement
    act: dict[int, int] = {}
    for i in pl.blocks_on(d):
        b = pl.blocks[i]
        if b.kind == "F" and b.memory > 0:
            act[b.segment] = act.get(b.segment, 0) + int(b.memory)
    grads = sum(pl.grad_bytes(s) for s in pl.grad_segments_on(d))
    par = plan.parallel
    if par.fully_sharded:   # the gradient buffer in FSDP's reduce dtype, sharded without a pipeline
        pol = get_policy(par.precision)
        grads = grads * pol.fsdp_reduce_bytes // pol.grad_bytes // (par.dp_shard if par.pp == 1 else 1)
    static = execution.static_memory[d] if d < len(execution.static_memory) else pl.static_bytes(d)
    params = execution.param_bytes[d] if d < len(execution.param_bytes) else 0
    return {"device": d, "peak": int(peaks[d]), "parameter_bytes": int(params),
            "weights_and_optimizer_states": int(static), "gradients": int(grads),
            "activations_per_micro_batch": int(sum(act.values())),
            "micro_batches_in_flight": round(_in_flight(plan, timeline, d, act), 3)}


def plan_facts(plan: Plan) -> dict:
    """What every report states about a plan (issue 31): ``precision`` (the policy),
    ``recompute``, ``seq_len`` (tokens per sequence, ``None`` for a model without one) and
    ``global_batch`` (sequences per step: micro-batch size x micro-batches x data replicas,
    :func:`tokens_per_step`'s count without the sequence length), and ``stage_recompute``: each
    segment's granularity where a per-stage override makes them differ
    (:func:`engine.recompute.plan_granularities`), else ``None``."""
    par, ref = plan.parallel, plan.model
    replicas = max(1, int(par.dp)) * max(1, int(plan.placement.data_per_instance))
    batch = int(ref.micro_batch_size or 1) * int(plan.schedule.num_micro_batches) * replicas
    grans = plan_granularities(plan)
    stages = grans if any(g != par.recompute for g in grans) else None
    return {"precision": par.precision, "recompute": par.recompute, "seq_len": ref.seq_len, "global_batch": batch,
            "stage_recompute": stages}


def peak_flops(plan: Plan) -> float:
    """The device's dense peak FLOP/s in the plan's compute dtype (the cost model's dtype, the
    policy's compute dtype for a plan made with one); 0.0 when unknown."""
    try:
        cost = CostModel.from_dict(plan.cost)
        return float(cost.device.peak(cost.dtype))
    except (ValueError, KeyError, TypeError):
        return 0.0


def memory_advice(plan: Plan) -> str:
    """One sentence naming the term that dominates a plan's peak memory and the smallest change
    that fits it under its capacity (``plan.metrics``' ``memory_breakdown`` and
    ``memory_capacity``; computed when missing).

    The terms: ``weights and optimizer states`` (+ gradients) against ``activations per
    micro-batch x micro-batches in flight``. The fixes tried, smallest first: for states,
    ``--transform sharded-update`` (dp > 1: Megatron's distributed optimizer divides master
    weights and Adam's states by dp), then ``--dp-shard dp`` (FSDP2 shards the weights, gradients
    and Adam's states), then ``k`` times the tensor/pipeline parallelism; for
    activations, a smaller micro-batch, ``--schedule 1f1b`` (at most pp in flight),
    ``--recompute full`` (each layer keeps only its input: Korthikanti et al. 2022, ``2sbh`` of
    ``34sbh`` bytes per layer, an estimate), then more tensor/pipeline parallelism.
    """
    m = plan.metrics if plan.metrics.get("memory_breakdown") else predicted_metrics(plan)
    mb, cap = m.get("memory_breakdown"), m.get("memory_capacity")
    if not mb or not cap:
        return "add devices, tensor parallelism (--tp) or fewer micro-batches in flight (1f1b)"
    def size(x: float) -> str:
        return f"{x / 2**30:.1f} GiB" if x >= 2**30 else f"{x / 2**20:.2f} MiB"
    states = mb["weights_and_optimizer_states"] + mb["gradients"]
    act_mb, inflight = mb["activations_per_micro_batch"], mb["micro_batches_in_flight"]
    acts = act_mb * inflight
    peak = max(mb["peak"], states + acts)
    extra = max(0.0, peak - states - acts)   # transients, buffers
    par = plan.parallel
    where = (f"the peak (device {mb['device']}, {size(peak)}) is "
             + (f"weights and optimizer states ({size(mb['weights_and_optimizer_states'])}) plus gradients "
                f"({size(mb['gradients'])})" if states >= acts else
                f"activations: {size(act_mb)} per micro-batch x {inflight:g} micro-batches in flight"))
    room = cap - extra
    fix = None
    if states >= acts:
        pol = get_policy(par.precision)
        if par.dp > 1 and "sharded-update" not in par.transforms and not par.fully_sharded:
            saved = pol.sharded_saving(mb["parameter_bytes"], par.dp)
            if states - saved + acts <= room:
                fix = "--transform sharded-update (Megatron's distributed optimizer)"
            elif _fsdp_states(mb["parameter_bytes"], pol, par.dp, par.pp) + acts <= room:
                fix = f"--dp-shard {par.dp} (FSDP2: parameters, gradients and Adam's states sharded over dp)"
        if fix is None and room > acts:
            k = max(2, math.ceil(states / (room - acts)))
            fix = f"{k}x the tensor or pipeline parallelism (--tp {par.tp * k} or {k}x the pipeline stages)"
    else:
        mbs = int(plan.model.micro_batch_size)
        if mbs > 1 and room > states:
            fit = int(mbs * (room - states) / acts) if acts else mbs
            if 1 <= fit < mbs:
                fix = f"--micro-batch-size {fit}"
        if fix is None and inflight > par.pp and plan.schedule.name not in ("1f1b", "zb-h1"):
            if states + act_mb * par.pp <= room:
                fix = "--schedule 1f1b (at most pp micro-batches in flight)"
        if fix is None and par.recompute != "full" and states + acts * 2 / 34 <= room:
            fix = "--recompute full"
        if fix is None and room > 0:
            k = max(2, math.ceil((states + acts) / room))
            fix = f"{k}x the tensor or pipeline parallelism (--tp {par.tp * k} or {k}x the pipeline stages)"
    return where + "; " + (f"the smallest fix that fits: {fix}" if fix else
                          "add devices, tensor or pipeline parallelism, or a larger device")


def _fsdp_states(param_bytes: int, pol: PrecisionPolicy, dp_shard: int, pp: int) -> float:
    """About the bytes of a device's ``param_bytes`` of weights and their states under FSDP over
    ``dp_shard`` ranks (:meth:`engine.precision.PrecisionPolicy.fsdp_bytes_per_param`); with a
    pipeline the stage stays gathered, its parameters and gradients whole."""
    count = param_bytes / pol.weight_bytes
    whole = count * (pol.weight_bytes + pol.fsdp_reduce_bytes) if pp > 1 else 0.0
    return count * pol.fsdp_bytes_per_param(dp_shard) + whole


def _lower_and_simulate(plan: Plan) -> tuple[ExecutionPlan, Timeline]:
    """The plan's instruction streams and their simulation with its cost model (and calibration)."""
    cost: Any = CostModel.from_dict(plan.cost) if plan.cost else None
    cal = plan.meta.get("calibration")
    if cal and cost is not None:
        cost = CalibratedCost(cost, Calibration.from_dict(cal))
    execution = lower_plan(plan)
    return execution, simulate(execution, cost)


def _metrics(plan: Plan, timeline: Timeline, execution: ExecutionPlan) -> dict:
    m = timeline.metrics()
    abstract = is_abstract(plan)
    tokens = tokens_per_step(plan)
    makespan = float(m["makespan"])
    m["time_unit"] = "units" if abstract else "s"
    m["memory_unit"] = "units" if abstract else "bytes"
    m["tokens_per_step"] = tokens
    m["tokens_per_second"] = tokens / makespan if tokens and makespan > 0 and math.isfinite(makespan) else 0.0
    if abstract:
        m["tokens_note"] = "an abstract plan (no model, times in units) has no tokens per second"
    m["memory_capacity"] = _memory_capacity(plan)
    flops = model_flops(plan)
    ok = flops > 0 and makespan > 0 and math.isfinite(makespan)
    tflops = flops / makespan / max(1, int(plan.parallel.devices)) / 1e12 if ok else 0.0
    peak = peak_flops(plan)
    m["model_flops"] = flops
    m["tflops_per_device"] = tflops
    m["mfu"] = tflops * 1e12 / peak if ok and peak > 0 else None
    m["memory_breakdown"] = memory_breakdown(plan, execution, timeline)
    return m


def predict(plan: Plan) -> tuple[Timeline, dict]:
    """Lower and simulate ``plan`` and compute its metrics.

    Returns:
        ``(timeline, metrics)``: the predicted :class:`~engine.timeline.Timeline` of one step and
        :func:`predicted_metrics`'s dict.

    Raises:
        PlanFormatError: a malformed ``moe`` or ``tied_weights`` entry.
        TransformError: a segment's experts do not divide by the plan's ``dp``.
        DeadlockError: the plan's device orders deadlock.
    """
    ex, tl = _lower_and_simulate(plan)
    return tl, _metrics(plan, tl, ex)


def predict_execution(plan: Plan) -> tuple[ExecutionPlan, Timeline, dict]:
    """:func:`predict` that also returns the lowered instruction streams (for ``make_plan``)."""
    ex, tl = _lower_and_simulate(plan)
    return ex, tl, _metrics(plan, tl, ex)


def predicted_metrics(plan: Plan) -> dict:
    """A plan's predicted metrics, from the plan alone.

    Returns:
        ``makespan`` (seconds; units for an abstract plan), ``bubble_ratio`` (idle / (devices x
        makespan)), ``bubble_ratios`` (per device), ``peak_memory`` (per device, bytes; units for
        an abstract plan), ``time_unit`` (``"s"`` or ``"units"``), ``memory_unit`` (``"bytes"`` or
        ``"units"``), ``tokens_per_step`` (:func:`tokens_per_step`), ``tokens_per_second``
        (``tokens_per_step / makespan``; 0 only for a plan without tokens, then ``tokens_note``
        says why), ``memory_capacity`` (bytes per device the plan is checked against, or
        ``None``), ``model_flops`` (:func:`model_flops`, FLOPs per step), ``tflops_per_device``
        (``model_flops / makespan / devices / 1e12``, devices = ``dp x tp x pp``), ``mfu`` (model
        FLOPs utilization: TFLOP/s per device over the device's dense peak in the compute dtype;
        ``None`` for an abstract plan or one without FLOPs) and ``memory_breakdown``
        (:func:`memory_breakdown`, ``None`` for an abstract plan).

    Raises:
        PlanFormatError, TransformError, DeadlockError: as :func:`predict`.
    """
    return predict(plan)[1]
