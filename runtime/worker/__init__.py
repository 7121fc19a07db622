"""The stage worker: one rank of a pipelined (and data-parallel) training run.

:class:`StageWorker` (``stage_worker``) composes the package's parts: ``config``
(:class:`WorkerConfig`), ``groups`` (process groups), ``p2p``/``p2p_order``/``send_waiter``
(point-to-point matching), ``buffers`` (receive buffers), ``optimizer`` (Adam/SGD/AdamA),
``grad_sync`` (gradient all-reduces), ``interpreter``/``compute`` (one handler per instruction op),
``training_step``/``evaluation``, ``metrics``, ``state`` (checkpoints), ``device`` and ``errors``.
Design: ``docs/runtime-worker.md``.
"""

from __future__ import annotations

from runtime.worker.config import OPTIMIZERS, P2P_MATCHING, WorkerConfig
from runtime.worker.errors import StepError, WorkerError
from runtime.worker.stage_worker import StageWorker
from runtime.worker.state import merge_model_state

__all__ = ["OPTIMIZERS", "P2P_MATCHING", "StageWorker", "StepError", "WorkerConfig", "WorkerError",
           "merge_model_state"]
