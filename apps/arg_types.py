"""argparse ``type=`` functions shared by the sub-commands: a bad value ends in one sentence and exit
status 2 (argparse's ``argument --x: ...``), before anything runs."""

from __future__ import annotations

import argparse
import math

from engine.coconet import TRANSFORMS, parse_transforms
from engine.cost import parse_link
from engine.errors import CoCoNetError, CostModelError, TransformError
from engine.plan.limits import MemoryLimitError, check_memory_limit
from engine.precision import PRECISIONS
from engine.recompute import RECOMPUTE

__all__ = ["PRECISION_HELP", "RECOMPUTE_HELP", "RESHARD_AFTER_FORWARD", "data_parallel_degrees",
           "dtype_name", "precision_name", "recompute_name",
           "link_name", "memory_limit", "non_negative_int", "port_number", "positive_float",
           "positive_int", "transform_help", "transform_names"]


def transform_help() -> str:
    """The ``--transform`` help: CoCoNet's transformations (:data:`engine.coconet.TRANSFORMS`)."""
    return ("CoCoNet's computation/communication transformations, comma-separated: "
            + "; ".join(f"{t.name}: {t.summary} (needs {t.needs})" for t in TRANSFORMS.values()))


def transform_names(text: str) -> tuple[str, ...]:
    """``"a,b"`` as :func:`engine.coconet.parse_transforms` reads it.

    Raises:
        argparse.ArgumentTypeError: an unknown name (the message lists the valid ones).
    """
    try:
        return parse_transforms(text)
    except CoCoNetError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    """A whole number >= 1.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    return _int_at_least(text, 1)


def positive_float(text: str) -> float:
    """A finite number > 0 (``0``, negatives, ``nan`` and ``inf`` are refused).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def memory_limit(text: str) -> float:
    """A per-device memory limit (GiB or activation units): :func:`engine.plan.limits.check_memory_limit`,
    the check the app's Search tab and the planning functions make (``0``, negatives, ``nan`` and
    ``inf`` are refused).

    Raises:
        argparse.ArgumentTypeError: anything else, in one sentence.
    """
    try:
        return check_memory_limit(text)
    except MemoryLimitError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def port_number(text: str) -> int:
    """A TCP port, ``0..65535`` (``0``: the system picks a free one).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    value = _int_at_least(text, 0)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be at most 65535, got {value}")
    return value


def dtype_name(text: str) -> str:
    """A model dtype of :data:`engine.models.registry.MODEL_DTYPES` (``float32``, ``bfloat16``,
    ``float16``).

    Raises:
        argparse.ArgumentTypeError: anything else; the message lists the supported dtypes.
    """
    from engine.models.registry import MODEL_DTYPES

    if text not in MODEL_DTYPES:
        raise argparse.ArgumentTypeError(f"dtype {text!r} is not supported; use one of {', '.join(MODEL_DTYPES)}")
    return text


PRECISION_HELP = ("precision policy (PyTorch Lightning's names): 32-true, bf16-mixed, 16-mixed (low-precision compute, "
                  "fp32 master weights and Adam states, Megatron-LM's 18 / 20 bytes per parameter) or bf16-true "
                  "(default: bf16-mixed on GPU device types, 32-true on cpu; --dtype alone keeps its old meaning)")
RECOMPUTE_HELP = ("activation recomputation: none, selective (the attention core) or full (each layer keeps only its "
                  "input; Korthikanti et al. 2022) (default none)")


def precision_name(text: str) -> str:
    """A precision policy of :data:`engine.precision.PRECISIONS`.

    Raises:
        argparse.ArgumentTypeError: anything else; the message lists the four policies.
    """
    if text not in PRECISIONS:
        raise argparse.ArgumentTypeError(f"precision {text!r} is not a policy; use one of {', '.join(PRECISIONS)}")
    return text


def recompute_name(text: str) -> str:
    """An activation recomputation granularity of :data:`engine.recompute.RECOMPUTE`.

    Raises:
        argparse.ArgumentTypeError: anything else; the message lists the three.
    """
    if text not in RECOMPUTE:
        raise argparse.ArgumentTypeError(f"recomputation {text!r} is not known; use one of {', '.join(RECOMPUTE)}")
    return text


def recompute_names(text: str) -> tuple[str, ...]:
    """Comma-separated granularities of :data:`engine.recompute.RECOMPUTE`, one per pipeline stage
    (``full,full,none,none``) or per segment.

    Raises:
        argparse.ArgumentTypeError: an empty list or an unknown name; the message lists the three.
    """
    names = tuple(x.strip() for x in text.split(","))
    for n in names:
        recompute_name(n)
    return names


def non_negative_int(text: str) -> int:
    """A whole number >= 0.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    return _int_at_least(text, 0)


LINK_HELP = ("the link between ranks: nvlink, pcie, infiniband, loopback, emulated:RATE (the shaped loopback of "
             "benchmarks/emulated_network.py, e.g. emulated:1gbit) or RATE[@LATENCY] (e.g. 10gbit@5us); "
             "default: the device's own (NVLink within a node and InfiniBand across for GPUs, loopback for cpu)")


def link_name(text: str) -> str:
    """``text`` if :func:`engine.cost.parse_link` reads it (kept as written, for the plan's record).

    Raises:
        argparse.ArgumentTypeError: it does not; the message lists the forms.
    """
    try:
        parse_link(text)
    except CostModelError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


#: ``--reshard-after-forward`` (torchtitan's ``fsdp_reshard_after_forward`` spellings) as
#: :attr:`engine.config.ParallelConfig.reshard_after_forward`.
RESHARD_AFTER_FORWARD: dict[str, bool | None] = {"default": None, "always": True, "never": False}


def data_parallel_degrees(dp: int | None, dp_shard: int | None, dp_replicate: int | None) -> tuple[int, int]:
    """``(dp, dp_shard)`` from ``--dp``, ``--dp-shard`` and ``--dp-replicate`` (``None`` when not
    given): ``dp = dp_replicate x dp_shard``; a missing one is implied by the others (``--dp 8
    --dp-shard 2``: 4 replicas), all three absent is ``(1, 1)``.

    Raises:
        TransformError: the three contradict each other, or ``--dp-shard`` does not divide ``--dp``.
    """
    shard = dp_shard or 1
    if dp_replicate is not None:
        total = dp_replicate * shard
        if dp is not None and dp != total:
            raise TransformError(f"--dp {dp} contradicts --dp-replicate {dp_replicate} x --dp-shard {shard} = "
                                 f"{total}; give --dp or the two degrees, not both")
        return total, shard
    total = dp if dp is not None else shard
    if total % shard:
        raise TransformError(f"--dp-shard {shard} does not divide --dp {total}; dp = dp_replicate x dp_shard")
    return total, shard
