"""Ctrl-C during a launch: the first SIGINT asks the step loop to stop after the current step
(which then checkpoints and says how to resume); a second one stops at once. Used by the single
launch (:mod:`runtime.launcher`) and the co-located one (:mod:`runtime.crossover.launcher`)."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

__all__ = ["StopRequest", "stop_on_sigint"]


class StopRequest:
    """Whether a SIGINT asked the step loop to stop after the current step."""

    requested: bool = False


@contextlib.contextmanager
def stop_on_sigint() -> Iterator[StopRequest]:
    """While the block runs, the first SIGINT only sets the returned request; a second one raises
    ``KeyboardInterrupt`` at once. Outside the main thread, or
    where SIGINT is ignored or handled by someone else than Python's default, nothing is installed
    (the request then never gets set)."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield stop
        return

    def handler(signum: int, frame: Any) -> None:
        # no I/O here: the main thread may be inside a write to the same stream (a reentrant write
        # raises); the loop tells the callbacks once the step is done
        if stop.requested:
            raise KeyboardInterrupt
        stop.requested = True

    signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
