"""Measure operator times on the local device and cache them per hardware.

:func:`profile_ops` replays every distinct op *signature* of an OpGraph (target plus the
shapes/dtypes/literals of its arguments) on random tensors and records the median wall
time. The result, a :class:`ProfileTable`, is cached as JSON under
``$TESSEL_CACHE_DIR`` (default ``~/.cache/tessel``) in ``profile-<hash of device_key>.json``,
so a second run on the same hardware and torch version times nothing again. A cache whose
``device_key`` differs from the current one is ignored.

``torch`` is imported lazily: building or loading a :class:`ProfileTable` and computing
:func:`signature` do not need it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from tqdm.auto import tqdm

from engine.envelope import Envelope
from engine.errors import CostModelError
from engine.io.atomic import atomic_write_text
from engine.io.cache import cache_dir

log = logging.getLogger(__name__)

PROFILE_FORMAT = "tessel-profile"
PROFILE_VERSION = 1
#: The profile table's envelope. Lenient like the cost model's: a document without ``format``
#: or ``version`` is read as this format and version.
PROFILE_ENVELOPE = Envelope(PROFILE_FORMAT, PROFILE_VERSION, CostModelError, what="a profile table",
                            require_format=False, require_version=False)

#: Replays whose materialised inputs exceed this many bytes are skipped (the dev machines
#: have 24 GiB shared by several users).
DEFAULT_MAX_BYTES = 1 << 30


@dataclass
class ProfileTable:
    """Measured op times on one kind of hardware.

    Attributes:
        device_key: hostname-independent hardware description, e.g.
            ``"cpu|AMD EPYC|threads=2|torch=2.13.0"`` (see :func:`device_key`).
        times: op signature (see :func:`signature`) -> median seconds.
        skipped: signature -> reason, for ops that could not be replayed (they fall back
            to the roofline in :class:`~engine.cost.model.CostModel`).
        timed: number of signatures actually timed by the :func:`profile_ops` call that
            returned this table (run statistic: not serialised, not compared).
        cache_hits: number of requested signatures answered from the cache (run statistic).
    """

    device_key: str
    times: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    timed: int = field(default=0, compare=False)
    cache_hits: int = field(default=0, compare=False)

    def get(self, sig: str) -> float | None:
        """Measured seconds for signature ``sig``, or ``None`` if not measured."""
        return self.times.get(sig)

    def __contains__(self, sig: object) -> bool:
        return sig in self.times

    def __len__(self) -> int:
        return len(self.times)

    def to_dict(self) -> dict:
        """JSON-able dict: ``{"format": "tessel-profile", "version": 1, "device_key", "times", "skipped"}``."""
        return PROFILE_ENVELOPE.wrap({
            "device_key": self.device_key,
            "times": dict(sorted(self.times.items())),
            "skipped": dict(sorted(self.skipped.items())),
        })

    @classmethod
    def from_dict(cls, d: dict, path: str = "profile") -> ProfileTable:
        """Inverse of :meth:`to_dict`.

        Raises:
            CostModelError (a ValueError): malformed dict or unknown format/version; the
                message names the field path (prefixed by ``path``).
        """
        PROFILE_ENVELOPE.check(d, path=path)
        if not isinstance(d.get("device_key"), str):
            raise CostModelError(f"{path}.device_key: expected a string")
        times = d.get("times", {})
        skipped = d.get("skipped", {})
        if not isinstance(times, dict) or not all(isinstance(v, (int, float)) for v in times.values()):
            raise CostModelError(f"{path}.times: expected an object of signature -> seconds")
        if not isinstance(skipped, dict):
            raise CostModelError(f"{path}.skipped: expected an object of signature -> reason")
        return cls(d["device_key"], {str(k): float(v) for k, v in times.items()},
                   {str(k): str(v) for k, v in skipped.items()})

    def save(self, path: str | os.PathLike) -> Path:
        """Write the table as JSON to ``path`` atomically (temp file in the same folder, then
        ``os.replace``), creating parent folders. Returns the path."""
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> ProfileTable:
        """Read a table written by :meth:`save`.

        Raises:
            OSError: the file cannot be read.
            CostModelError (a ValueError): not valid JSON or not a profile table.
        """
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise CostModelError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d, path=str(path))


# ---------------------------------------------------------------- signatures

def _is_tensor_desc(x: Any) -> bool:
    return isinstance(x, dict) and "shape" in x and "dtype" in x


def _dtype_name(dtype: Any) -> str:
    d = str(dtype)
    return d[len("torch."):] if d.startswith("torch.") else d


def _norm(x: Any) -> Any:
    """Descriptor normal form: tensors/parameters -> {"shape", "dtype"} (parameter names and
    other metadata dropped, so identical layers share a signature); containers recursed."""
    if _is_tensor_desc(x):
        return {"shape": [int(s) if isinstance(s, (int, float)) else str(s) for s in x["shape"]],
                "dtype": _dtype_name(x["dtype"])}
    if isinstance(x, dict):
        return {str(k): _norm(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_norm(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def signature(node: dict) -> str:
    """Deterministic identity of an op for profiling: its ``target`` plus its normalised
    ``args``/``kwargs`` descriptors (shapes, dtypes, literal values; parameter names are
    ignored), as compact sorted JSON prefixed by the target, e.g.
    ``'aten.mm.default|{"args":[...],"kwargs":{}}'``."""
    body = json.dumps({"args": _norm(list(node.get("args") or [])), "kwargs": _norm(dict(node.get("kwargs") or {}))},
                      sort_keys=True, separators=(",", ":"))
    return f"{node.get('target', '')}|{body}"


# ---------------------------------------------------------------- device key and cache

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def device_key(device: str = "cpu") -> str:
    """Hostname-independent description of the hardware that ``device`` denotes.

    CPU: ``"cpu|<model name from /proc/cpuinfo>|threads=<torch.get_num_threads()>|torch=<version>"``
    (the thread count changes the timings, so it is part of the key).
    CUDA: ``"cuda|<torch.cuda.get_device_name>|torch=<version>"``.

    Raises:
        CostModelError (a ValueError): a device type other than cpu/cuda, or cuda without a GPU.
    """
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return f"cpu|{_cpu_model()}|threads={torch.get_num_threads()}|torch={torch.__version__}"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise CostModelError(f"device {device!r}: CUDA is not available on this machine")
        return f"cuda|{torch.cuda.get_device_name(dev)}|torch={torch.__version__}"
    raise CostModelError(f"unsupported profiling device {device!r}; valid: 'cpu', 'cuda[:i]'")


def default_cache_path(key: str) -> Path:
    """``cache_dir() / "profile-<first 16 hex of sha256(key)>.json"``."""
    return cache_dir() / f"profile-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _load_cache(path: Path, key: str) -> ProfileTable:
    try:
        table = ProfileTable.load(path)
    except FileNotFoundError:
        return ProfileTable(key)
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable profile cache %s: %s", path, e)
        return ProfileTable(key)
    if table.device_key != key:
        log.info("ignoring profile cache %s for another device (%s)", path, table.device_key)
        return ProfileTable(key)
    return table


# ---------------------------------------------------------------- replay

class _Unreplayable(Exception):
    pass


def resolve_op(target: str):
    """``"aten.mm.default"`` -> ``torch.ops.aten.mm.default`` (``"aten.mm"`` means the
    ``default`` overload). Only the ``aten`` namespace is replayed.

    Raises:
        CostModelError (a ValueError): malformed target, another namespace, or unknown op.
    """
    import torch

    parts = str(target).split(".")
    if len(parts) == 2:
        parts.append("default")
    if len(parts) != 3 or parts[0] != "aten":
        raise CostModelError(f"cannot replay {target!r}: not an 'aten.<op>.<overload>' target")
    try:
        return getattr(getattr(torch.ops.aten, parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        raise CostModelError(f"cannot replay {target!r}: no such aten op") from None


def _materialize(x: Any, device, budget: list[int], key: str | None = None) -> Any:
    import torch

    if _is_tensor_desc(x):
        dtype = getattr(torch, _dtype_name(x["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise _Unreplayable(f"unknown dtype {x['dtype']!r}")
        try:
            shape = [int(s) for s in x["shape"]]
        except (TypeError, ValueError):
            raise _Unreplayable(f"symbolic shape {x['shape']!r}") from None
        numel = 1
        for s in shape:
            numel *= s
        budget[0] -= numel * dtype.itemsize
        if budget[0] < 0:
            raise _Unreplayable("inputs exceed max_bytes")
        if dtype == torch.bool:
            return torch.ones(shape, dtype=dtype, device=device)
        if dtype.is_floating_point or dtype.is_complex:
            if dtype.itemsize == 1:
                return torch.randn(shape, device=device).to(dtype)
            return torch.randn(shape, dtype=dtype, device=device)
        return torch.randint(0, 2, shape, dtype=dtype, device=device)
    if isinstance(x, dict):
        return {k: _materialize(v, device, budget, k) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_materialize(v, device, budget) for v in x]
    if key == "device" and isinstance(x, str):
        return device  # captured on meta/fake tensors: replay on the profiling device
    if isinstance(x, str) and x.startswith("torch."):
        obj = getattr(torch, x[len("torch."):], None)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
    if key == "dtype" and isinstance(x, str) and isinstance(getattr(torch, x, None), torch.dtype):
        return getattr(torch, x)
    return x


def _time_one(node: dict, device, warmup: int, repeat: int, max_bytes: int) -> float:
    import torch

    try:
        op = resolve_op(node.get("target", ""))
    except CostModelError as e:
        raise _Unreplayable(str(e)) from None
    budget = [max_bytes]
    try:
        args = _materialize(list(node.get("args") or []), device, budget)
        kwargs = _materialize(dict(node.get("kwargs") or {}), device, budget)
    except _Unreplayable:
        raise
    except Exception as e:  # e.g. negative sizes, dtypes randn cannot make
        raise _Unreplayable(f"cannot build inputs: {type(e).__name__}: {e}") from None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    try:
        with torch.no_grad():
            for _ in range(warmup):
                op(*args, **kwargs)
            sync()
            samples = []
            for _ in range(max(1, repeat)):
                t0 = time.perf_counter()
                op(*args, **kwargs)
                sync()
                samples.append(time.perf_counter() - t0)
    except Exception as e:  # any failure of the op itself: wrong descriptors, unsupported on this device
        raise _Unreplayable(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return statistics.median(samples)


def profile_ops(nodes: Iterable[dict], *, device: str = "cpu", warmup: int = 1, repeat: int = 3,
                cache_path: str | os.PathLike | None = None, progress: bool = True, cache: bool = True,
                max_bytes: int = DEFAULT_MAX_BYTES, threads: int | None = 1) -> ProfileTable:
    """Time every distinct op signature of ``nodes`` on the local ``device``.

    Each op is replayed on random tensors of the described shapes/dtypes (floating ->
    ``randn``, integer -> ``randint`` in [0, 2) so index arguments stay in range, bool ->
    ``ones``) by calling ``torch.ops.aten.<name>.<overload>`` under ``torch.no_grad()``:
    ``warmup`` untimed calls, then ``repeat`` calls timed with ``time.perf_counter`` (with
    ``torch.cuda.synchronize`` on CUDA); the median is recorded in seconds. ``device``
    literals in kwargs (``"meta"`` from capture) are replaced by the profiling device.

    Ops that cannot be replayed (non-aten targets, unknown ops, bad descriptors, errors
    raised by the op, inputs above ``max_bytes``) are skipped, recorded in
    ``table.skipped`` with the reason, and reported once as a logging warning with their
    count and names; the cost model uses the roofline for them.

    Args:
        nodes: op-node attribute dicts (``target``, ``args``, ``kwargs`` are used).
        device: ``"cpu"`` or ``"cuda[:i]"``.
        warmup: untimed calls per signature.
        repeat: timed calls per signature (median taken).
        cache_path: JSON cache file; ``None`` -> :func:`default_cache_path` of the device key.
            A cache written for another device key is ignored (and overwritten).
        progress: show a tqdm progress bar over the signatures to time.
        cache: ``False`` neither reads nor writes a cache.
        max_bytes: skip replays whose inputs need more than this many bytes.
        threads: intra-op threads while timing (default 1, as every runtime rank runs; with the
            default pool on a busy machine single ops stall for whole scheduler slices);
            ``None`` keeps torch's setting. Restored afterwards; part of the cache key.

    Returns:
        A :class:`ProfileTable` holding the requested signatures only (timed now or taken
        from the cache); ``table.timed`` and ``table.cache_hits`` count both kinds.

    Raises:
        CostModelError (a ValueError): unsupported ``device``.
    """
    import torch

    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _profile(nodes, device, warmup, repeat, cache_path, progress, cache, max_bytes)
    finally:
        torch.set_num_threads(saved_threads)


def _profile(nodes, device, warmup, repeat, cache_path, progress, cache, max_bytes) -> ProfileTable:
    import torch

    dev = torch.device(device)
    key = device_key(device)
    path = Path(cache_path) if cache_path is not None else default_cache_path(key)
    cached = _load_cache(path, key) if cache else ProfileTable(key)

    wanted: dict[str, dict] = {}
    for node in nodes:
        wanted.setdefault(signature(node), node)

    result = ProfileTable(key)
    todo = []
    for sig, node in wanted.items():
        if sig in cached.times:
            result.times[sig] = cached.times[sig]
            result.cache_hits += 1
        elif sig in cached.skipped:
            result.skipped[sig] = cached.skipped[sig]
            result.cache_hits += 1
        else:
            todo.append((sig, node))

    if todo:
        newly_skipped: dict[str, str] = {}
        for sig, node in tqdm(todo, desc=f"profiling ops on {device}", unit="op", disable=not progress):
            try:
                result.times[sig] = _time_one(node, dev, warmup, repeat, max_bytes)
                result.timed += 1
            except _Unreplayable as e:
                result.skipped[sig] = str(e)
                newly_skipped[sig] = wanted[sig].get("target", "?")
        if newly_skipped:
            names = sorted(set(newly_skipped.values()))
            log.warning("profiler skipped %d op signature(s) that cannot be replayed (roofline used instead): %s",
                        len(newly_skipped), ", ".join(names))
        if cache:
            cached.times.update(result.times)
            cached.skipped.update({s: r for s, r in result.skipped.items() if s not in cached.times})
            cached.save(path)
    return result
