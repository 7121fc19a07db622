"""Exceptions shared by the engine.

Every error a user can cause derives from :class:`TesselError`, so the CLI can print
its one-sentence message and exit non-zero without a traceback. The CLI's exit statuses:

* ``0`` success;
* ``2`` a user mistake (:class:`TesselError`, argparse's own usage errors, unreadable files);
* ``3`` a run failure (:class:`RunError`: a rank crashed, a step timed out, a checkpoint could
  not be written) and any unexpected internal error;
* ``130`` interrupted (SIGINT / Ctrl-C).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_USER_ERROR = 2
EXIT_RUN_FAILURE = 3
EXIT_INTERRUPTED = 130


class TesselError(Exception):
    """Base class of user-facing errors: ``str(err)`` is a complete sentence.

    Attributes:
        exit_status: the CLI's exit status for this error (``2``, a user mistake).
    """

    exit_status: int = EXIT_USER_ERROR


class RunError(TesselError):
    """A run failed through no mistake in its input: a rank died, a step timed out, a
    checkpoint could not be written. The CLI exits with status ``3``."""

    exit_status: int = EXIT_RUN_FAILURE


class PlacementError(TesselError, ValueError):
    """A placement is malformed: a device out of range, a cycle, a backward without forward."""


class ScheduleError(TesselError):
    """A schedule violates a rule.

    Attributes:
        rule: one of ``"completeness"``, ``"device"``, ``"dependency"``, ``"deadlock"``,
            ``"memory"``, ``"micro-batches"``.
        device: the device (rank) where the first violation was found, or ``None``.
        block: the offending block as an action string like ``"1B3"``, or ``None``.
    """

    def __init__(self, rule: str, message: str, device: int | None = None, block: str | None = None):
        super().__init__(message)
        self.rule = rule
        self.device = device
        self.block = block


class DeadlockError(TesselError):
    """The simulator found ranks that wait on each other forever.

    Attributes:
        waiting: ``{rank: "instruction it waits at"}`` for every rank that is stuck.
    """

    def __init__(self, message: str, waiting: dict[int, str]):
        super().__init__(message)
        self.waiting = waiting


class PlanFormatError(TesselError, ValueError):
    """A plan/CSV file is malformed or has an unknown version; the message names the field path."""


# ----------------------------------------------------------------------------- Tessel's search
# Raised by :mod:`engine.tessel` (the repetend search, the exact solver, the improvement); here so
# that every tessel module raises them without importing the search.


class InfeasibleMemoryError(TesselError):
    """The memory limit is below what one micro-batch at a time needs.

    Attributes:
        smallest: the smallest feasible limit (bytes or the placement's memory units).
        device: the device that needs it.
    """

    def __init__(self, message: str, smallest: float, device: int):
        super().__init__(message)
        self.smallest = smallest
        self.device = device


class SearchCancelled(TesselError):
    """The search was cancelled before any solution was found."""
