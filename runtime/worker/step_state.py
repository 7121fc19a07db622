"""Per-step bookkeeping of :meth:`runtime.worker.StageWorker.step` (dropped at the end of the step)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.timeline import Event
from runtime.worker.send_waiter import SendWaiter

__all__ = ["StepState"]


@dataclass
class StepState:
    """What one step's instructions hand each other (keys ``(segment, micro_batch)`` unless said)."""

    model_inputs: list[tuple[torch.Tensor, ...]]
    """Per micro-batch of this replica, the task's model inputs (``task.input_names`` order),
    each ``[mbs, ...]`` (causal-lm: ``(input_ids [mbs, seq_len],)``)."""
    targets: list[tuple[torch.Tensor, ...]]
    """Per micro-batch, the task's targets, each ``[mbs, ...]`` (causal-lm: ``(labels [mbs, seq_len],)``)."""
    outputs: dict[tuple[int, int], Any] = field(default_factory=dict)
    """Stage outputs awaiting SEND or the next local stage."""
    ctx: dict[tuple[int, int], tuple] = field(default_factory=dict)
    """``(inputs, outputs, scaled loss, scaled aux loss)`` of each forward, for its backward."""
    in_grads: dict[tuple[int, int], list] = field(default_factory=dict)
    """Input gradients awaiting SEND or the previous local stage's backward."""
    wstate: dict[tuple[int, int], tuple] = field(default_factory=dict)
    """What ``W`` needs after ``I``."""
    losses: dict[int, float] = field(default_factory=dict)
    """Micro-batch -> the task's loss (mean cross-entropy, nats/token, for the language tasks)."""
    aux: dict[tuple[int, int], float] = field(default_factory=dict)
    """Unscaled MoE aux loss of each forward."""
    moe: list[dict] = field(default_factory=list)
    """Routing metrics per (segment, micro-batch, layer)."""
    tied_done: set[int] = field(default_factory=set)
    """Local tied groups reduced this step."""
    t0: float = 0.0
    """``time.perf_counter()`` at the step's start."""
    events: list[Event] = field(default_factory=list)
    """One event per executed instruction (and all-to-all)."""
    sends: SendWaiter | None = None
    """Waits the isends and stamps SEND ends."""
    allreduces: list[tuple] = field(default_factory=list)
    """Posted DP all-reduces: ``(work, segment, event)``."""
    recvs: dict[tuple, tuple] = field(default_factory=dict)
    """``(block, peer) -> (buffers, irecv works, src)`` posted early (tag matching)."""
    owork: dict[tuple, Any] = field(default_factory=dict)
    """Ordered matching: ``(src, message) -> posted irecv work``."""
    cursor: dict[int, int] = field(default_factory=dict)
    """Ordered matching: src -> messages of its order posted."""

    def start_clock(self) -> None:
        """Set :attr:`t0` to now; :meth:`now` counts from it."""
        self.t0 = time.perf_counter()

    def now(self) -> float:
        """Seconds since :attr:`t0`."""
        return time.perf_counter() - self.t0
