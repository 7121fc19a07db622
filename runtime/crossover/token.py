"""The per-device compute token of the CrossoverScheduler (docs/ARCHITECTURE.md, Sources).

Co-located data-parallel jobs take turns on a device: a job ACQUIRES the device's token before
its step's first forward and RELEASES it as soon as it has posted its gradient all-reduce, so
that while one job synchronises gradients another computes. :class:`ComputeToken` is that token
for the jobs of one process (one Ray actor = one device), built on ``threading.Condition``.

Fairness: FIFO tickets. Every ``acquire`` takes a ticket in arrival order and the token goes to
the oldest waiting ticket when it is free, so when two jobs both wait they strictly alternate, and
no job waits behind more than ``jobs - 1`` compute sections.

Deadlock freedom: a holder only runs LOCAL work (forward, backward, copying gradients into the
all-reduce buffer and posting the asynchronous collective) between acquire and release, never a
wait on another rank, so every holder releases in bounded time and every waiter is eventually
served (FIFO). The waits on other ranks (the all-reduce itself) happen after the release. This is
why :mod:`runtime.crossover` accepts only pure data-parallel plans (``pp == 1``): a pipeline
stage waits for its neighbours' activations in the middle of its compute.

Instrumentation: every hold is recorded as a :class:`TokenInterval` ``(device, job, acquire,
release)`` in seconds of ``time.perf_counter()`` (one clock for every process of a machine on
Linux). With ``exclusive=False`` (the "uncoordinated" mode) nothing blocks, but the compute
sections are recorded the same way, so the two modes can be compared.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import EllipsisType

from engine.errors import TesselError

__all__ = ["ComputeToken", "TokenError", "TokenInterval", "overlapping_intervals"]


class TokenError(TesselError):
    """The token was used wrongly (acquired twice by one job), timed out, or was closed."""


@dataclass(frozen=True)
class TokenInterval:
    """One hold of a device's compute token.

    Attributes:
        device: the device (actor rank).
        job: the job index.
        acquire, release: ``time.perf_counter()`` seconds when the job got and gave back the token.
        step: the job's step (``None`` for an evaluation).
    """

    device: int
    job: int
    acquire: float
    release: float
    step: int | None = None

    def to_list(self) -> list:
        return [self.device, self.job, self.acquire, self.release, self.step]


class ComputeToken:
    """A fair (FIFO) mutual-exclusion token for the compute of co-located jobs on one device.

    Args:
        device: the device (actor rank) it guards, recorded in the intervals.
        exclusive: ``True`` (crossover): one holder at a time. ``False`` (uncoordinated): never
            blocks, only records the compute sections.
        timeout: seconds an :meth:`acquire` may wait before raising :class:`TokenError`
            (``None``: forever).

    Thread-safe. :meth:`release` is idempotent (a job that does not hold the token releases
    nothing), so callers can release in ``finally`` after a failure.
    """

    def __init__(self, device: int = 0, *, exclusive: bool = True, timeout: float | None = None):
        self.device = int(device)
        self.exclusive = bool(exclusive)
        self.timeout = timeout
        self._cond = threading.Condition()
        self._queue: collections.deque[int] = collections.deque()   # waiting tickets, oldest first
        self._tickets = itertools.count()
        self._holder: int | None = None                             # job holding it (exclusive mode)
        self._held: dict[int, tuple[float, int | None]] = {}        # job -> (acquire time, step)
        self._intervals: list[TokenInterval] = []
        self._closed = False
        self.max_holders = 0                                         # most simultaneous holders seen

    @property
    def holder(self) -> int | None:
        """The job holding the token (exclusive mode), else ``None``."""
        with self._cond:
            return self._holder

    def held_by(self, job: int) -> bool:
        """Whether ``job`` is inside a compute section now."""
        with self._cond:
            return job in self._held

    def acquire(self, job: int, step: int | None = None, *,
                timeout: float | None | EllipsisType = ...) -> float:
        """Wait for the token (FIFO) and take it for ``job``; returns the seconds waited.

        Raises:
            TokenError: ``job`` already holds it, the wait exceeded ``timeout`` seconds (default: the
                token's own), or the token was closed while waiting.
        """
        timeout = self.timeout if timeout is ... else timeout
        t0 = time.perf_counter()
        with self._cond:
            if self._closed:
                raise TokenError(f"device {self.device}'s compute token is closed")
            if job in self._held:
                raise TokenError(f"job {job} already holds device {self.device}'s compute token")
            if self.exclusive:
                ticket = next(self._tickets)
                self._queue.append(ticket)
                deadline = None if timeout is None else t0 + timeout
                try:
                    while True:
                        if self._closed:
                            raise TokenError(f"device {self.device}'s compute token was closed while job {job} waited")
                        if self._holder is None and self._queue[0] == ticket:
                            break
                        left = None if deadline is None else deadline - time.perf_counter()
                        if left is not None and left <= 0:
                            raise TokenError(
                                f"job {job} waited {timeout:g} s for device {self.device}'s compute token "
                                f"(held by job {self._holder})")
                        self._cond.wait(left)
                except BaseException:
                    self._queue.remove(ticket)
                    self._cond.notify_all()
                    raise
                self._queue.popleft()
                self._holder = job
            now = time.perf_counter()
            self._held[job] = (now, step)
            self.max_holders = max(self.max_holders, len(self._held))
            return now - t0

    def release(self, job: int) -> bool:
        """Give the token back (record the interval, wake the next ticket); ``False`` if ``job``
        did not hold it."""
        with self._cond:
            got = self._held.pop(job, None)
            if got is None:
                return False
            self._intervals.append(TokenInterval(self.device, job, got[0], time.perf_counter(), got[1]))
            if self.exclusive and self._holder == job:
                self._holder = None
                self._cond.notify_all()
            return True

    def intervals(self, clear: bool = False) -> list[TokenInterval]:
        """The recorded holds, in release order (``clear``: forget them afterwards)."""
        with self._cond:
            out = list(self._intervals)
            if clear:
                self._intervals.clear()
            return out

    def close(self) -> None:
        """Wake every waiter with :class:`TokenError` and refuse further acquires."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def overlapping_intervals(intervals: Iterable[TokenInterval | tuple | list]) -> list[tuple]:
    """Pairs of holds of DIFFERENT jobs on the SAME device whose times overlap.

    Args:
        intervals: :class:`TokenInterval` or ``(device, job, acquire, release, ...)`` sequences.

    Returns:
        ``[(a, b), ...]`` as given; empty when the token was exclusive.
    """
    items = [iv if isinstance(iv, TokenInterval) else TokenInterval(*iv) for iv in intervals]
    by_dev: dict[int, list[TokenInterval]] = collections.defaultdict(list)
    for iv in items:
        by_dev[iv.device].append(iv)
    out = []
    for ivs in by_dev.values():
        ivs.sort(key=lambda x: x.acquire)
        for i, a in enumerate(ivs):
            for b in ivs[i + 1:]:
                if b.acquire >= a.release:
                    break
                if b.job != a.job:
                    out.append((a, b))
    return out
