"""A Tessel plan for a captured model on a placement shape: what ``tessel search --model`` writes
and the app's Search tab loads for a model plan.

:func:`model_search_plan` captures the model, builds the shape's placement with the model's real
costs and memory (:func:`engine.shape_costs.model_shape_placement`), runs the Tessel search
(:func:`engine.tessel.tessel_search`) and returns an ordinary :class:`~engine.io.Plan`
(:func:`engine.plan.from_search.plan_from_search`): the model reference (task, micro-batch shape,
dtype, parameter count, and the stage split the runtime needs: ``layers`` when a segment runs on
several devices, since such a block is tensor-parallel over them), the segments with their
layers, the searched schedule and the predicted metrics. ``tessel launch`` trains it.

This module captures models, so it imports torch (``engine.plan`` loads it lazily).

Source: Tessel (Lin et al., HPCA 2024), sections III-IV (placement, repetend search, completion).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.baselines.generic import gpipe_any
from engine.config import ModelRef, ParallelConfig
from engine.cost import CostModel
from engine.dependency import TiedGroup
from engine.errors import TesselError, TransformError
from engine.graph import capture
from engine.io.plan import Plan
from engine.models import build_model
from engine.plan.compare import ScheduleMetrics, compare_baselines
from engine.plan.from_search import plan_from_search
from engine.plan.limits import check_memory_limit
from engine.plan.lowering import lower_plan
from engine.plan.metrics import predicted_metrics
from engine.precision import get_policy, plan_precision
from engine.recompute import check_recompute
from engine.shape_costs import model_shape_placement
from engine.shapes import SHAPES, UnknownShapeError, find_shape
from engine.split import (
    choose_split,
    record_tp_plan,
    supports_layer_split,
    tensor_parallel_refusal,
)
from engine.tessel import tessel_search
from engine.tessel.comm import step_tail
from engine.tp_plan import check_tp_plan_matches
from engine.transform import LOSS_PARALLEL_TASKS, tied_parameter_groups

__all__ = ["SearchPlan", "model_search_plan"]


@dataclass
class SearchPlan:
    """What :func:`model_search_plan` found.

    Attributes:
        plan: the plan (``Plan``), ready for ``save_plan`` and ``tessel launch``; its ``metrics`` are
            :func:`engine.plan.metrics.predicted_metrics` of it plus the search's summary
            (``period``, bounds, timings) (:func:`engine.plan.from_search.plan_from_search`).
        result: the :class:`engine.tessel.SearchResult` (period, bounds, timings).
        timeline: the predicted timeline of the plan (:func:`engine.plan.metrics.predict`; seconds, bytes).
        placement: the model-aware placement searched.
        cost: the :class:`engine.cost.CostModel` used.
        variant: ``name -> Placement`` of the same model for :func:`engine.plan.compare.compare_baselines`:
            ``"zb-h1"`` the V placement with the backward split into I and W, ``"interleaved"`` two
            virtual stages per device, ``"v"`` the plain V placement.
        plan_for: ``schedule -> Plan``: the same model's plan running ``schedule`` (on the searched
            placement or one of the ``variant`` placements), the segments and tied weights of its
            placement; what the search table predicts baseline rows from.
    """

    plan: Any
    result: Any
    timeline: Any
    placement: Any
    cost: Any
    variant: Callable[[str], Any]
    plan_for: Callable[[Any], Any] | None = None

    def predict(self, schedule: Any) -> dict:
        """:func:`engine.plan.metrics.predicted_metrics` of :attr:`plan_for` ``(schedule)`` (seconds, bytes)."""
        if self.plan_for is None:
            raise ValueError("this SearchPlan has no plan_for")
        return predicted_metrics(self.plan_for(schedule))

    def v_baselines(self, memory_limit: float | None = None) -> list[ScheduleMetrics]:
        """The predefined schedules on the same model's plain pipeline: GPipe and 1F1B on the V
        placement, interleaved 1F1B and ZB-H1 on their variants, for the same data per step
        (``m x data_per_instance`` micro-batches: X's instances carry two), each predicted as a
        plan of its own (:meth:`predict`, so tied weights and the optimizer step count as in
        ``tessel show``); each :class:`engine.plan.compare.ScheduleMetrics` named ``"<schedule> (V)"``
        (seconds, bytes; ``memory_limit`` in bytes marks the rows above it)."""
        m = self.result.schedule.num_micro_batches * self.placement.data_per_instance
        rows = compare_baselines(self.variant("v"), m, memory_limit=memory_limit, cost=self.cost, variant=self.variant,
                                 predict=self.predict if self.plan_for is not None else None)
        for r in rows:
            r.name = f"{r.name} (V)"
        return rows


def _tied_groups(module: Any, parts: list[dict], num_segments: int) -> tuple[list[dict], list]:
    """The segments of a search plan's ``parts`` and their tied-weight groups, as
    ``runtime.stages.build_stages`` builds them.

    The model's own tied parameters (GPT-2's ``wte``/``lm_head``) are held by every part whose
    layers contain them (:func:`engine.transform.tied_parameter_groups`); each holder but the first
    keeps its own copy, already counted in its ``param_bytes`` by
    :func:`engine.shape_costs.model_shape_placement` (``tied_module=``), as
    :func:`engine.transform.add_tied_copies` counts it for :func:`engine.plan.make.make_plan`. Beyond
    ``len(parts)`` segments (X: model replicas, segment ``k`` of replica ``c`` is ``c x parts + k``)
    every group spans all replicas, and each part's other parameters are tied with their copies
    (Chimera's stage-pair all-reduce; one group per part named ``"part k"`` of its bytes less the
    model's tied copies it holds).

    Returns:
        ``(segments, groups)``: the segment dicts (``index``; replicas ``replica_of``) and the
        :class:`engine.dependency.TiedGroup` list, sorted by members.
    """
    k = len(parts)
    model_groups = tied_parameter_groups(module, [list(p.get("layers") or []) for p in parts])
    segments = [{"index": i, **p} for i, p in enumerate(parts)]
    replicas = max(1, num_segments // k) if k else 1
    segments += [{**segments[s % k], "index": s, "replica_of": s % k} for s in range(k, num_segments)]
    if replicas <= 1:
        return segments, list(model_groups)
    groups = [TiedGroup(tuple(sorted((s + c * k, n) for c in range(replicas) for s, n in g.members)), g.nbytes)
              for g in model_groups]
    for i in range(k):
        held = sum(g.nbytes for g in model_groups if i in g.segments())
        nbytes = max(0, int(segments[i]["param_bytes"]) - held)
        groups.append(TiedGroup(tuple((i + c * k, f"part {i}") for c in range(replicas)), nbytes))
    return segments, sorted(groups, key=lambda g: g.members)


class _ModelPlans:
    """The plans of one captured model on the searched placement and its baseline variants: what
    :func:`model_search_plan` builds a plan of each schedule from."""

    def __init__(self, bundle: Any, graph: Any, cost: Any, shape: str, devices: int, *, split_backward: bool,
                 forward_only: bool, micro_batch_size: int, memory_limit: float | None,
                 precision: str = "32-true", recompute: str = "none", tp_plan: dict[str, str] | None = None) -> None:
        self.bundle, self.graph, self.cost = bundle, graph, cost
        self.tp_plan = tp_plan
        self.precision, self.recompute = precision, recompute
        self.devices, self.forward_only, self.micro_batch_size = devices, forward_only, micro_batch_size
        self.placement, self.parts = model_shape_placement(
            graph, cost, shape, devices, split_backward=split_backward, forward_only=forward_only,
            loss_parallel=bundle.task in LOSS_PARALLEL_TASKS, tied_module=bundle.module, precision=precision,
            recompute=recompute, tp_plan=tp_plan)
        self.variants: dict[str, tuple[Any, list[dict]]] = {}
        multi = any(len(b.devices) > 1 for b in self.placement.blocks)
        replicas = self.placement.data_per_instance > 1
        # an all-device block runs tensor-parallel over its devices, and X's second model replica is a
        # copy of the first's stages: both on eager decoder stages; a model without them is still
        # planned, and the runtime refuses its launch in one sentence
        needs_layers = multi or replicas
        can = supports_layer_split(bundle.module)
        if tp_plan is not None:
            check_tp_plan_matches(tp_plan, bundle.module, bundle.name)
            if not multi:
                raise TransformError(f"a tensor-parallel plan shards the all-device blocks of M, NN or X, and the "
                                     f"{self.placement.name} placement has none; search one of those shapes, or "
                                     "drop the tensor-parallel plan")
        why = tensor_parallel_refusal(bundle.module, bundle.name, tp_plan) if multi and can else None
        if why:   # all-device blocks run tensor-parallel: a plan the ranks cannot shard is refused now
            raise TransformError(why)
        self.split = "layers" if needs_layers and can else choose_split(bundle.module, recompute=recompute)
        self.meta: dict[str, Any] = {"memory_unit": "bytes"}
        self.sharded = multi and self.split == "layers"
        record_tp_plan(self.meta, bundle.module, tp_plan, sharded=self.sharded)
        if memory_limit is not None:
            self.meta["memory_limit"] = memory_limit

    def variant_parts(self, name: str) -> tuple[Any, list[dict]]:
        """The same model's ``interleaved``, ``v`` or (any other name) split-backward V placement and parts."""
        if name not in self.variants:
            g, c, n = self.graph, self.cost, self.devices
            kw = {"tied_module": self.bundle.module, "precision": self.precision, "recompute": self.recompute}
            if name == "interleaved":
                self.variants[name] = model_shape_placement(g, c, "interleaved", n, forward_only=self.forward_only,
                                                            **kw)
            elif name == "v":
                self.variants[name] = model_shape_placement(g, c, "v", n, forward_only=self.forward_only, **kw)
            else:
                self.variants[name] = model_shape_placement(g, c, "v", n, split_backward=True, **kw)
        return self.variants[name]

    def variant(self, name: str) -> Any:
        """:meth:`variant_parts`' placement."""
        return self.variant_parts(name)[0]

    def build(self, schedule: Any, placement: Any, parts: list[dict], split: str) -> Plan:
        """The plan of ``schedule`` on ``placement`` cut into ``parts`` (no metrics)."""
        bundle = self.bundle
        # X: a second model replica, its stage k repeats part k; tied copies counted where they are held
        segments, tied = _tied_groups(bundle.module, parts, placement.num_segments)
        if placement.name == "K":   # each tower starts from its own model input (the text ids, the code ids)
            sources = [b.segment for b in placement.blocks if b.kind == "F" and not b.deps]
            for i, s in enumerate(sources):
                segments[s] = {**segments[s], "inputs": [i]}
        batch = self.micro_batch_size * schedule.num_micro_batches * placement.data_per_instance
        ref = ModelRef(name=bundle.name, source=bundle.source, config=bundle.config,
                       micro_batch_size=self.micro_batch_size, batch_size=batch, seq_len=bundle.seq_len,
                       dtype=self.graph.graph.get("dtype", "float32"), num_params=self.graph.graph.get("num_params"),
                       task=bundle.task, split=split)
        searched = placement is self.placement
        par = {"dp": 1, "tp": 1, "pp": placement.num_devices, "micro_batches": schedule.num_micro_batches,
               "devices": placement.num_devices, "optimizer": "adam", "precision": self.precision,
               "recompute": self.recompute}
        if searched and self.sharded and self.tp_plan is not None:   # the all-device blocks run the user's plan
            par["tp_plan"] = dict(self.tp_plan)
        meta = dict(self.meta) if searched else {k: v for k, v in self.meta.items() if k != "tp_plan"}
        return Plan(model=ref, parallel=ParallelConfig.from_dict(par), segments=segments, schedule=schedule,
                    cost=self.cost.to_dict(), metrics={}, meta=meta, tied_weights=[g.to_dict() for g in tied])

    def plan_for(self, schedule: Any) -> Plan:
        """The plan of ``schedule`` on the searched placement or one of its variants (matched by identity).

        Raises:
            ValueError: a schedule on a placement this search did not build.
        """
        if schedule.placement is self.placement:
            return self.build(schedule, self.placement, self.parts, self.split)
        for vpl, vparts in self.variants.values():
            if schedule.placement is vpl:
                return self.build(schedule, vpl, vparts, choose_split(self.bundle.module, recompute=self.recompute))
        raise ValueError(f"schedule {schedule.name!r} runs on a placement this search did not build")


def model_search_plan(model: str, shape: str, devices: int, micro_batches: int, *, micro_batch_size: int = 1,
                      seq_len: int | None = None, task: str | None = None, device_type: str = "h100",
                      memory_limit: float | None = None, split_backward: bool = False, forward_only: bool = False,
                      cost: Any = None, link: str | None = None, precision: str | None = None,
                      recompute: str = "none", dtype: str | None = None, tp_plan: dict[str, str] | None = None,
                      **search_kw: Any) -> SearchPlan:
    """Search ``shape`` on ``devices`` devices for ``model`` and return the plan.

    Args:
        model: a registry name or ``module:callable`` (:func:`engine.models.build_model`).
        shape: ``v``, ``x``, ``m``, ``nn``, ``interleaved``, ``mllm`` or (a two-tower model) ``k``
            (:data:`engine.shapes.SHAPES`; ``finetune`` and ``alphafold`` take no model); recorded
            as ``meta["shape"]`` (its canonical name).
        devices: devices (the pipeline ranks of the placement).
        micro_batches: ``m``, placement instances per step.
        micro_batch_size, seq_len: the micro-batch shape the model is captured (and trained) with.
        task: the training task (:mod:`tasks`); ``None``: the model's own.
        device_type: the cost model's device (``h100``, ``a100``, ``cpu``); ignored with ``cost``.
        memory_limit: bytes per device (static memory included), ``None`` for no limit.
        split_backward: split each ``B`` into ``I`` and ``W``.
        forward_only: inference placement.
        cost: a :class:`~engine.cost.CostModel` to use instead of ``device_type``'s.
        link: the link between every pair of ranks (:func:`engine.cost.parse_link`); ``None``: the
            device's defaults; ignored with ``cost``.
        precision: the precision policy (:mod:`engine.precision`); ``None``: from ``dtype``, else
            the device type's default (``bf16-mixed`` on GPUs, ``32-true`` on ``cpu``;
            :func:`engine.precision.resolve_precision`). The model is captured in its compute
            dtype, the cost model uses that dtype's peak, memory counts its bytes per parameter.
        recompute: activation recomputation (``none``, ``selective``, ``full``), recorded in
            ``plan.parallel.recompute``.
        dtype: the old way to say the precision (``float32``, ``bfloat16``, ``float16``); with
            ``precision`` it must be the policy's compute dtype.
        tp_plan: a tensor-parallel plan for the transformer blocks (:mod:`engine.tp_plan`, ``tessel
            search --tp-plan``) replacing the model's own in the all-device blocks (M, NN, X): costed,
            recorded in ``plan.parallel.tp_plan`` and executed by the runtime.
        search_kw: passed to :func:`engine.tessel.tessel_search` (``time_limit``, ``seed``, ...).

    Raises:
        TesselError: an unknown model or shape, a shape the model cannot fill, an unknown or
            contradicting precision / dtype, an unknown recomputation, a memory limit that
            is not a positive finite number, or an infeasible one
            (:class:`engine.tessel.InfeasibleMemoryError`).

    A placement with multi-device blocks or model replicas (X) records ``split="layers"`` where the
    model has the layer split (:func:`engine.split.supports_layer_split`); other models keep their usual split and
    ``runtime.stages.check_executable`` refuses to launch them, naming the block.
    """
    spec = find_shape(shape)
    if spec is None:
        raise UnknownShapeError(f"unknown placement shape {shape!r}; valid shapes are: {', '.join(SHAPES)}")
    if spec.model_parts is None and spec.name != "k":   # refused before the model is built and captured
        raise TesselError(spec.no_model)
    if memory_limit is not None:
        memory_limit = check_memory_limit(memory_limit)
    precision = plan_precision(precision, dtype, device_type if cost is None else cost.device.name,
                               None if cost is None else cost.dtype)
    check_recompute(recompute)
    compute = get_policy(precision).compute_dtype
    bundle = build_model(model, batch_size=micro_batch_size, seq_len=seq_len, task=task,
                         dtype=getattr(torch, compute))
    if task is not None:
        bundle.task = task
    graph = capture(bundle.module, bundle.example_inputs, name=bundle.name)
    cost = cost if cost is not None else CostModel.for_device(device_type, link=link, inter_link=link, dtype=compute)
    plans = _ModelPlans(bundle, graph, cost, shape, devices, split_backward=split_backward, forward_only=forward_only,
                        micro_batch_size=micro_batch_size, memory_limit=memory_limit, precision=precision,
                        recompute=recompute, tp_plan=tp_plan)
    pl = plans.placement
    # the search sees what the plan's simulation will time: the transfers between devices (cost
    # model links), each rank's optimizer step and tied-weight all-reduce after its last block, and
    # the step's makespan as the plan predicts it
    if search_kw.get("comm", cost) is not None:
        search_kw.setdefault("comm", cost)
        search_kw.setdefault("tail", step_tail(lower_plan(plans.plan_for(gpipe_any(pl, 1))), cost))
        search_kw.setdefault("evaluate", lambda schedule: predicted_metrics(plans.plan_for(schedule))["makespan"])
    res = tessel_search(pl, micro_batches, memory_limit=memory_limit, **search_kw)
    plan, timeline = plan_from_search(res, plans.plan_for(res.schedule), memory_limit=memory_limit, shape=spec.name)
    return SearchPlan(plan, res, timeline, pl, cost, plans.variant, plans.plan_for)
