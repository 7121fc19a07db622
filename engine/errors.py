"""Exceptions of the engine and the tasks, every class defined here (the runtime keeps its own).

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


class UnknownScheduleError(TesselError, ValueError):
    """A schedule name that is not one of the predefined schedules (:data:`engine.baselines.SCHEDULES`)."""


class PlacementError(TesselError, ValueError):
    """A placement is malformed: a device out of range, a cycle, a backward without forward."""


# ------------------------------------------------------------------ plans, shapes, transformations
class TransformError(TesselError, ValueError):
    """A parallel configuration cannot be applied to the model (the message says what to change);
    raised by :mod:`engine.transform` and ``ParallelConfig.check``."""


class CoCoNetError(TesselError, ValueError):
    """A CoCoNet transformation that does not exist, or whose preconditions the plan lacks (one
    sentence; :mod:`engine.coconet`)."""


class UnknownShapeError(TesselError, ValueError):
    """A shape name that is not in :data:`engine.shapes.SHAPES` (a user mistake: exit status 2, one
    sentence)."""


class CrossoverError(TesselError, ValueError):
    """Jobs that cannot be co-located (a pipeline plan, different device counts, bad mode...;
    :mod:`engine.crossover`).

    The runtime raises its subclass :class:`runtime.runner.CrossoverLaunchError` (also a
    ``LaunchError``) when a co-located launch fails, so ``except CrossoverError`` catches both.
    """


class OutputPathError(TesselError):
    """An output folder or file cannot be written: the folder is a file, a target is a folder
    (:mod:`engine.io.atomic`)."""


# ------------------------------------------------------------------ models, capture, cost model
class ModelNotFoundError(TesselError, ValueError):
    """Unknown model name; the message lists the valid names and the ``module:callable`` form
    (:mod:`engine.models.registry`)."""


class ModelBuildError(TesselError, TypeError):
    """A user's ``module:callable`` cannot build a model: it is not a Python function or
    ``nn.Module`` class (a built-in such as ``os.system``, a plain value), it needs arguments Tessel
    cannot give, it raised, or it returned something other than an ``nn.Module`` or a
    ``(module, example_inputs)`` tuple."""


class ModelArgumentError(TesselError, ValueError):
    """A build argument is out of range: ``batch_size`` or ``seq_len`` below 1, ``seq_len`` beyond
    the model's position table, a dtype outside :data:`engine.models.registry.MODEL_DTYPES`."""


class ModelConfigError(TesselError, ValueError):
    """A Hugging Face ``config.json`` cannot be planned (:mod:`engine.models.hf_config`): the path
    does not exist, a folder holds no ``config.json``, the file is not a JSON object, it has no
    ``model_type``, or the installed ``transformers`` does not know its architecture or cannot
    build it."""


class CaptureError(TesselError, RuntimeError):
    """``torch.export`` could not trace the model (:func:`engine.graph.capture`; a
    :class:`TesselError`, still a ``RuntimeError`` for existing ``except RuntimeError`` handlers).

    The message names the module (path and class) and source line where tracing failed,
    quotes PyTorch's own error, and says what to try. ``module_path`` and ``cause`` are also
    available as attributes."""

    def __init__(self, message: str, *, module_path: str | None = None,
                 cause: BaseException | None = None):
        super().__init__(message)
        self.module_path = module_path
        self.cause = cause


class CostModelError(TesselError, ValueError):
    """A bad argument to the cost model (:mod:`engine.cost`): an unknown device/link/dtype/collective
    name, a negative size, a malformed serialized cost model. It is a :class:`ValueError`."""


# ------------------------------------------------------------------ graph neural networks
class GNNError(TesselError, ValueError):
    """A GNN config, layer argument or graph is malformed (:mod:`engine.gnn`); ``str(err)`` is one
    sentence naming the fix."""


class PartitionError(GNNError):
    """A graph partition was asked for with bad input, or no partition count fits a memory budget
    (:mod:`engine.gnn.partition`)."""


class GNNPlanError(GNNError):
    """A GNN plan cannot be made: a budget too small, a bad partition count or device count
    (:mod:`engine.gnn.plan`)."""


class CharacterizeError(TesselError, ValueError):
    """A GNN characterization was asked for with bad input (a mode, a count, a tensor shape;
    :mod:`engine.gnn.characterize`)."""


# ------------------------------------------------------------------ tasks (data and losses)
class TaskError(TesselError, ValueError):
    """A task cannot be built or used (unknown name, a model its data does not fit, a user task
    without the required methods; :mod:`tasks`); the message says what to change."""


class DataError(TesselError, FileNotFoundError):
    """A task's corpus cannot be built: no source directory, or too little text in it
    (:mod:`tasks.corpus`)."""


class GraphError(TaskError):
    """A graph cannot be built or is malformed (a bad argument, a broken invariant, a corpus too
    small for the classes asked for; :mod:`tasks.graphs`); ``str(err)`` is one sentence naming the fix."""


class TuneError(TesselError, ValueError):
    """``tessel tune`` cannot answer: a tuning space that holds no configuration or has a value that
    is not valid (:mod:`engine.tune.space`); ``str(err)`` is one sentence naming the fix (exit status 2)."""


class NothingFitsError(TuneError):
    """No configuration of the tuning space is predicted to fit in the memory limit; ``str(err)``
    names the smallest change that would fit (:func:`engine.tune.report.nothing_fits_advice`)."""


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
