"""Errors of the stage worker (``docs/runtime-worker.md``, "Failure modes")."""

from __future__ import annotations

from engine.errors import TesselError

__all__ = ["StepError", "WorkerError", "describe_exception", "step_error"]


class WorkerError(TesselError):
    """A worker was used wrongly (not set up, a batch of the wrong shape, a bad world size)."""


class StepError(TesselError, RuntimeError):
    """An instruction of :meth:`runtime.worker.StageWorker.step` failed.

    ``str(err)`` is ``"rank R (pipeline rank P, replica D) failed at step S, instruction I (INS):
    <cause type>: <cause>"``; ``__cause__`` is the original exception. Attributes (they survive
    pickling, e.g. through Ray): ``rank``, ``pp_rank``, ``dp_index``, ``step``, ``index`` (position
    in the stream, ``None`` when waiting for sends at the end of the step), ``instruction``
    (``"I (INS)"``, e.g. ``"3 (SEND 1B0 to 0)"``, or ``None``). A ``RuntimeError`` too, so
    ``except RuntimeError`` still catches it.
    """

    rank: int
    pp_rank: int
    dp_index: int
    step: int
    index: int | None
    instruction: str | None


def step_error(message: str, *, rank: int, pp_rank: int, dp_index: int, step: int, index: int | None,
               instruction: str | None) -> StepError:
    """A :class:`StepError` with ``message`` and its attributes set (the caller chains the cause)."""
    err = StepError(message)
    err.rank, err.pp_rank, err.dp_index, err.step = rank, pp_rank, dp_index, step
    err.index, err.instruction = index, instruction
    return err


def describe_exception(e: BaseException, outer_chars: int = 160) -> str:
    """One line naming what went wrong: ``"Type: message"`` with whitespace collapsed. Where ``e``
    wraps a cause (``raise ... from cause``, as torch.distributed.pipelining's stage backward
    wraps its autograd error in a multi-line report), the innermost cause comes first and the
    wrapper follows, cut to ``outer_chars``: ``"Inner: msg (in Outer: report...)"``."""
    chain: list[BaseException] = []
    while e is not None and e not in chain and len(chain) < 8:
        chain.append(e)
        e = e.__cause__   # type: ignore[assignment]

    def one(x: BaseException) -> str:
        msg = " ".join(str(x).split())
        return f"{type(x).__name__}: {msg}" if msg else type(x).__name__

    head = one(chain[-1])
    if len(chain) == 1:
        return head
    outer = one(chain[0])
    return f"{head} (in {outer[:outer_chars]}{'...' if len(outer) > outer_chars else ''})"
