"""A stage worker's tensor-parallel communication outside the DTensor modules: CoCoNet's
``scatter-send`` (a stage sends its ``1/tp`` slice of the boundary activation; the receiving
tensor rank all-gathers it from its group). Reached only for plans whose transformations
``runtime.worker.config.EXECUTED_TRANSFORMS`` lists."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.dependency import Instruction
from runtime.worker.errors import WorkerError
from runtime.worker.step_state import StepState

if TYPE_CHECKING:
    from runtime.worker.stage_worker import StageWorker

__all__ = ["gather_boundary"]


def gather_boundary(w: StageWorker, ins: Instruction, st: StepState) -> None:
    """``ALLGATHER`` of a received block (``scatter-send``): all-gather the ``1/tp`` slices of its
    boundary tensors from this rank's tensor group. Raises :class:`WorkerError` until the runtime
    executes the transformation."""
    raise WorkerError("the runtime does not execute 'scatter-send' yet")
