"""Stage construction: a plan's model cut into one stage module per segment.

One module per concern: ``types`` (:class:`TensorMeta`, :class:`StageModule`,
:class:`PipelineStages`), ``errors`` (:class:`RuntimeNotSupported`, :class:`StageSplitError`),
``checks`` (what the runtime refuses to build: :func:`check_executable`, :func:`check_transforms`),
the three split methods, ``tracer_split`` (``torch.distributed.pipelining.pipeline`` with the
``split_policy`` of ``split_policy``; ``eager_moe`` puts the eager MoE layers back),
``module_split`` (slices of an ``nn.Sequential``) and ``layer_split`` (eager decoder stages),
``probe`` (boundary metadata from one micro-batch), ``tied`` (leftover and tied parameters, model
replicas) and ``build`` (:func:`build_stages`, the entry point choosing among the methods).
Design: ``docs/runtime-worker.md``.
"""

from __future__ import annotations

from runtime.stages.build import boundary_specs, build_stage_modules, build_stages, tied_groups
from runtime.stages.checks import EXECUTED_TRANSFORMS, check_executable, check_transforms
from runtime.stages.errors import RuntimeNotSupported, StageSplitError
from runtime.stages.module_split import SequentialStage
from runtime.stages.tracer_split import TracedStage, retarget_device
from runtime.stages.types import PipelineStages, StageModule, TensorMeta

__all__ = ["EXECUTED_TRANSFORMS", "PipelineStages", "RuntimeNotSupported", "SequentialStage", "StageModule",
           "StageSplitError", "TensorMeta", "TracedStage", "boundary_specs", "build_stage_modules", "build_stages",
           "check_executable", "check_transforms", "retarget_device", "tied_groups"]
