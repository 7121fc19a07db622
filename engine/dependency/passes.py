"""SuperScaler phase 3 as a list of passes over the instruction streams (as
torch.distributed.pipelining builds its IR with ``_add_send_recv`` and ``_add_reduce_grad``):
:data:`PASSES`, run in order by :func:`lower`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from engine.dependency.compute import add_compute_blocks
from engine.dependency.context import LowerContext
from engine.dependency.expert_alltoall import add_alltoalls
from engine.dependency.fsdp import add_fsdp
from engine.dependency.grad_sync import add_grad_sync
from engine.dependency.instructions import ExecutionPlan
from engine.dependency.optimizer_step import add_optimizer_step
from engine.dependency.options import LowerOptions
from engine.dependency.send_recv import add_send_recv
from engine.dependency.tied_weights import add_tied_allreduces
from engine.schedule import Schedule

__all__ = ["PASSES", "Pass", "lower"]

#: A lowering pass: rewrites :attr:`LowerContext.streams` (and the static memory) in place.
Pass = Callable[[LowerContext], None]

#: The passes, in order: compute blocks; sends and receives (scatter-send, tp-split); the
#: expert-parallel all-to-alls inside their blocks (before the block's sends); fully sharded data
#: parallelism's gathers and reduce-scatters; data-parallel gradient sync after a segment's last
#: backward; tied-weight all-reduces; the optimizer step.
PASSES: tuple[Pass, ...] = (add_compute_blocks, add_send_recv, add_alltoalls, add_fsdp, add_grad_sync,
                            add_tied_allreduces, add_optimizer_step)


def lower(schedule: Schedule, options: LowerOptions | None = None, **kwargs: Any) -> ExecutionPlan:
    """Lower a schedule into per-rank instruction streams (SuperScaler phase 3).

    Args:
        schedule: a schedule that passes ``validate`` (this function does not re-validate).
        options: the :class:`LowerOptions`; ``None``: built from ``kwargs``.
        kwargs: :class:`LowerOptions` fields (``dp=2, segment_param_bytes=...``); with ``options``
            they replace its fields.

    Returns:
        The :class:`ExecutionPlan`. A producer block whose output goes to ``k`` other ranks gets
        ``k`` SENDs; a multi-device producer sends from the first device of its set.

    Raises:
        ValueError: an unknown ``optimizer_kind``, degrees below 1 (:class:`LowerOptions`).
        TypeError: an unknown keyword.
    """
    if options is None:
        options = LowerOptions(**kwargs)
    elif kwargs:
        options = replace(options, **kwargs)
    ctx = LowerContext.start(schedule, options)
    for run in PASSES:
        run(ctx)
    return ctx.result()
