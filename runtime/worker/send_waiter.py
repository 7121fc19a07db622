"""Completion of a step's point-to-point sends, waited off the compute path.

:class:`SendWaiter` (gloo: ``Work.wait()``; CUDA/NCCL: polling ``Work.is_completed()``) stamps each
SEND event's end; :func:`poll_completion` is the non-blocking poll.

Source: torch.distributed work handles (``isend`` returns a ``Work`` with ``wait`` and
``is_completed``), https://pytorch.org/docs/stable/distributed.html.
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from engine.timeline import Event

__all__ = ["SendWaiter", "poll_completion"]


class SendWaiter:
    """Waits a step's isends on a helper thread, in post order, and stamps each SEND event's end.

    gloo's send work only reports completion through ``wait()`` (``is_completed()`` stays False
    until then and it has no future), so a helper thread waits them while the compute stream goes
    on. A send is stamped when it AND every earlier-posted send are done (an upper bound on its
    true completion, exact when sends complete in order). The sent tensors stay referenced until
    then. :meth:`close` (end of step) joins the thread and re-raises the first error.

    CUDA (``device`` given, NCCL): ``Work.wait()`` only makes the calling thread's current stream
    wait for the transfer and returns at once, and synchronizing that stream would also wait for
    the compute kernels queued after it. So the thread instead polls ``is_completed()`` (a query of
    the work's CUDA end event, no synchronization) with a short back-off (50 us doubling to 1 ms),
    and fails with a timeout error after ``timeout``; then ``wait()`` surfaces an error NCCL
    recorded. A SEND's end is therefore the time the transfer's kernel was seen finished (at most
    about 1 ms late), and :meth:`close` returns only when every send of the step has completed.
    The thread sets ``device`` as its current CUDA device (the current device is per thread).
    """

    def __init__(self, now, timeout: timedelta, device: Any = None):
        self.now = now
        self.timeout = timeout
        self.device = device
        self.error: BaseException | None = None
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="tessel-send-waiter", daemon=True)
        self.thread.start()

    def add(self, works: list, tensors: list, ev: Event) -> None:
        if not works:
            ev.end = ev.start
            return
        self.q.put((works, tensors, ev))

    def _run(self) -> None:
        if self.device is not None and getattr(self.device, "type", None) == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            item = self.q.get()
            if item is None:
                return
            works, _tensors, ev = item
            if self.error is not None:
                continue
            try:
                for w in works:
                    if self.device is not None:
                        poll_completion(w, self.timeout.total_seconds())
                    w.wait(self.timeout)
            except BaseException as e:  # noqa: BLE001 - re-raised by close()
                self.error = e
            ev.end = self.now()

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error

    def abandon(self) -> None:
        """Stop after the sends already queued (the step failed; the thread is a daemon)."""
        self.q.put(None)


def poll_completion(work: Any, timeout_s: float, *, min_sleep: float = 5e-5, max_sleep: float = 1e-3) -> float:
    """Wait until ``work.is_completed()`` without blocking a CUDA stream (see :class:`SendWaiter`).

    Args:
        work: a ``torch.distributed`` work handle (or anything with ``is_completed()``).
        timeout_s: seconds before giving up.
        min_sleep, max_sleep: back-off between polls (seconds), doubling from the first to the second.

    Returns:
        seconds waited.

    Raises:
        TimeoutError: not completed within ``timeout_s`` (names the work).
    """
    t0 = time.perf_counter()
    sleep = min_sleep
    while not work.is_completed():
        waited = time.perf_counter() - t0
        if waited > timeout_s:
            raise TimeoutError(f"a point-to-point send ({work!r}) did not complete within {timeout_s:g} s "
                               "(is its receiver alive and posting its receives in this sender's order?)")
        time.sleep(sleep)
        sleep = min(sleep * 2, max_sleep)
    return time.perf_counter() - t0
