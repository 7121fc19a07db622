"""A Tessel plan for a captured model on a placement shape: what ``tessel search --model`` writes.

:func:`model_search_plan` captures the model, builds the shape's placement with the model's real
costs and memory (:func:`engine.shape_costs.model_shape_placement`), runs the Tessel search
(:func:`engine.tessel.tessel_search`) and returns an ordinary :class:`~engine.io.Plan`: the model
reference (task, micro-batch shape, and the stage split the runtime needs: ``layers`` when a
segment runs on several devices, since such a block is tensor-parallel over them), the segments
with their layers, the searched schedule and the predicted metrics. ``tessel launch`` trains it.

Source: Tessel (Lin et al., HPCA 2024), sections III-IV (placement, repetend search, completion).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["SearchPlan", "model_search_plan"]


@dataclass
class SearchPlan:
    """What :func:`model_search_plan` found.

    Attributes:
        plan: the plan (``Plan``), ready for ``save_plan`` and ``tessel launch``.
        result: the :class:`engine.tessel.SearchResult` (period, bounds, timings).
        timeline: the simulated timeline of the searched schedule (seconds, bytes).
        placement: the model-aware placement searched.
        cost: the :class:`engine.cost.CostModel` used.
        variant: ``name -> Placement`` of the same model for :func:`engine.compare.compare_baselines`:
            ``"zb-h1"`` the V placement with the backward split into I and W, ``"interleaved"`` two
            virtual stages per device, ``"v"`` the plain V placement.
    """

    plan: Any
    result: Any
    timeline: Any
    placement: Any
    cost: Any
    variant: Callable[[str], Any]

    def v_baselines(self, memory_limit: float | None = None) -> list:
        """The predefined schedules on the same model's plain pipeline: GPipe and 1F1B on the V
        placement, interleaved 1F1B and ZB-H1 on their variants, for the same data per step
        (``m x data_per_instance`` micro-batches: X's instances carry two), simulated with the same
        cost model; each :class:`engine.compare.ScheduleMetrics` named ``"<schedule> (V)"``
        (seconds, bytes; ``memory_limit`` in bytes marks the rows above it)."""
        from engine.compare import compare_baselines

        m = self.result.schedule.num_micro_batches * self.placement.data_per_instance
        rows = compare_baselines(self.variant("v"), m, memory_limit=memory_limit, cost=self.cost, variant=self.variant)
        for r in rows:
            r.name = f"{r.name} (V)"
        return rows


def model_search_plan(model: str, shape: str, devices: int, micro_batches: int, *, micro_batch_size: int = 1,
                      seq_len: int | None = None, device_type: str = "h100", memory_limit: float | None = None,
                      split_backward: bool = False, forward_only: bool = False, cost: Any = None,
                      link: str | None = None, **search_kw: Any) -> SearchPlan:
    """Search ``shape`` on ``devices`` devices for ``model`` and return the plan.

    Args:
        model: a registry name or ``module:callable`` (:func:`engine.models.build_model`).
        shape: ``v``, ``x``, ``m``, ``nn`` or ``interleaved`` (:data:`engine.shapes.SHAPES`).
        devices: devices (the pipeline ranks of the placement).
        micro_batches: ``m``, placement instances per step.
        micro_batch_size, seq_len: the micro-batch shape the model is captured (and trained) with.
        device_type: the cost model's device (``h100``, ``a100``, ``cpu``); ignored with ``cost``.
        memory_limit: bytes per device (static memory included), ``None`` for no limit.
        split_backward: split each ``B`` into ``I`` and ``W``.
        forward_only: inference placement.
        cost: a :class:`~engine.cost.CostModel` to use instead of ``device_type``'s.
        link: the link between every pair of ranks (:func:`engine.cost.parse_link`); ``None``: the
            device's defaults; ignored with ``cost``.
        search_kw: passed to :func:`engine.tessel.tessel_search` (``time_limit``, ``seed``, ...).

    Raises:
        TesselError: an unknown model or shape, a shape the model cannot fill, or an infeasible
            memory limit (:class:`engine.tessel.InfeasibleMemoryError`).

    A placement with multi-device blocks or model replicas (X) records ``split="layers"`` where the
    model has the layer split (:func:`engine.split.supports_layer_split`); other models keep their usual split and
    ``runtime.stage.check_executable`` refuses to launch them, naming the block.
    """
    from engine.config import ModelRef, ParallelConfig
    from engine.cost import CostModel
    from engine.dependency import TiedGroup, lower
    from engine.graph import capture
    from engine.io import Plan
    from engine.models import build_model
    from engine.shape_costs import model_shape_placement
    from engine.simulate import simulate
    from engine.split import choose_split, supports_layer_split
    from engine.tessel import tessel_search
    from engine.transform import LOSS_PARALLEL_TASKS

    bundle = build_model(model, batch_size=micro_batch_size, seq_len=seq_len)
    graph = capture(bundle.module, bundle.example_inputs, name=bundle.name)
    cost = cost if cost is not None else CostModel.for_device(device_type, link=link, inter_link=link)
    pl, parts = model_shape_placement(graph, cost, shape, devices, split_backward=split_backward,
                                      forward_only=forward_only, loss_parallel=bundle.task in LOSS_PARALLEL_TASKS)

    def variant(name: str):
        if name == "interleaved":
            return model_shape_placement(graph, cost, "interleaved", devices, forward_only=forward_only)[0]
        if name == "v":
            return model_shape_placement(graph, cost, "v", devices, forward_only=forward_only)[0]
        return model_shape_placement(graph, cost, "v", devices, split_backward=True)[0]

    res = tessel_search(pl, micro_batches, memory_limit=memory_limit, **search_kw)
    segments = [{"index": i, **p} for i, p in enumerate(parts)]
    tied: list[TiedGroup] = []
    if pl.num_segments > len(parts):   # X: a second model replica; its stage k repeats part k
        k = len(parts)
        segments += [{**segments[s % k], "index": s, "replica_of": s % k} for s in range(k, pl.num_segments)]
        # the replicas' gradients are summed per part at the step (Chimera's stage-pair all-reduce)
        tied = [TiedGroup(((i, f"part {i}"), (i + k, f"part {i}")), int(parts[i]["param_bytes"])) for i in range(k)]
    sources = [b.segment for b in pl.blocks if b.kind == "F" and not b.deps]
    if pl.name == "K":   # each tower starts from its own model input (the text ids, the code ids)
        for i, s in enumerate(sources):
            segments[s] = {**segments[s], "inputs": [i]}
    timeline = simulate(lower(res.schedule, tied=tied), cost)
    multi = any(len(b.devices) > 1 for b in pl.blocks)
    replicas = pl.data_per_instance > 1
    # an all-device block runs tensor-parallel over its devices, and X's second model replica is a
    # copy of the first's stages: both on eager decoder stages; a model without them is still
    # planned, and the runtime refuses its launch in one sentence
    needs_layers = multi or replicas
    split = "layers" if needs_layers and supports_layer_split(bundle.module) else choose_split(bundle.module)
    metrics = {**timeline.metrics(), **res.summary()}
    tokens = micro_batch_size * (bundle.seq_len or 1) * micro_batches * pl.data_per_instance
    metrics["tokens_per_step"] = tokens
    metrics["tokens_per_second"] = tokens / metrics["makespan"] if metrics.get("makespan") else 0.0
    ref = ModelRef(name=bundle.name, source=bundle.source, config=bundle.config, micro_batch_size=micro_batch_size,
                   batch_size=micro_batch_size * micro_batches, seq_len=bundle.seq_len, task=bundle.task, split=split)
    parallel = ParallelConfig.from_dict({"dp": 1, "tp": 1, "pp": pl.num_devices, "micro_batches": micro_batches,
                                         "devices": pl.num_devices, "optimizer": "adam"})
    plan = Plan(model=ref, parallel=parallel, segments=segments, schedule=res.schedule, cost=cost.to_dict(),
                metrics=metrics, meta={"memory_unit": "bytes"}, tied_weights=[g.to_dict() for g in tied])
    return SearchPlan(plan, res, timeline, pl, cost, variant)
