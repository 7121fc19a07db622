"""The placement JSON form: one writer, one validating loader.

A placement document holds ``name``, ``num_devices``, ``static_memory`` (bytes per device),
``blocks`` (each ``kind``, ``segment``, ``devices``, ``duration`` (s), ``memory`` (bytes),
``deps`` (indices into ``blocks``, or names like ``"0F"`` when written by hand), ``output``
(``{"shape", "dtype"}`` or ``null``)) and, when set, ``grad_memory``/``grad_transient`` (bytes
per segment). A placement file (``tessel search --placement``) wraps it in the envelope
``{"format": "tessel-placement", "version": 1, ...}`` (:mod:`engine.envelope`); a plan embeds
the same fields without the header under its ``placement`` key (the plan's header covers it, and
plan files and plan hashes stay what they were).

Errors: every malformed input raises :class:`engine.errors.PlacementError` with a sentence that
names the offending JSON field (e.g. ``blocks[3].devices``).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from engine.envelope import Envelope, is_instance
from engine.errors import PlacementError
from engine.io.atomic import atomic_write_text
from engine.placement import BLOCK_KINDS, BlockSpec, Placement, TensorSpec

__all__ = [
    "PLACEMENT_FORMAT", "PLACEMENT_VERSION", "PLACEMENT_ENVELOPE", "parse_blocks",
    "placement_to_dict", "placement_from_dict", "save_placement", "load_placement", "read_json_file",
]

#: ``format`` field of a placement JSON file.
PLACEMENT_FORMAT = "tessel-placement"
#: Version of the placement JSON written by :func:`save_placement` (the only one read).
PLACEMENT_VERSION = 1
#: The placement file's envelope (messages like ``version is 2, but this Tessel reads version 1``).
PLACEMENT_ENVELOPE = Envelope(PLACEMENT_FORMAT, PLACEMENT_VERSION, PlacementError, what="a placement")
_FIELDS = {"name", "num_devices", "static_memory", "blocks", "grad_memory", "grad_transient"}


#: Largest byte (or unit) count a placement file may give: 2^53, the largest integer a float (the
#: simulator's memory curves) holds exactly; a larger one is a typo, and 1e308 overflowed the simulator.
MAX_BYTES = 2**53

_DEP = re.compile(r"^\s*(\d+)\s*([FBIWfbiw])\s*$")
_BLOCK_FIELDS = {"kind", "segment", "devices", "duration", "memory", "deps", "output"}


def _is_int(x: Any) -> bool:
    return is_instance(x, int)


def _is_num(x: Any) -> bool:
    return is_instance(x, (int, float))


def parse_blocks(num_devices: int, blocks: Any, where: str = "blocks") -> tuple[BlockSpec, ...]:
    """Validate a list of block dicts (the ``blocks`` field) into :class:`BlockSpec` s.

    Args:
        num_devices: devices of the placement (device indices must be below it).
        blocks: the list; ``deps`` entries may be indices into it or names like ``"0F"``.
        where: the list's field path for messages.

    Raises:
        PlacementError: a malformed block; the message names it, e.g. ``blocks[3].devices``.
    """
    if not isinstance(blocks, (list, tuple)):
        raise PlacementError(f"{where} must be a list of block objects, got {type(blocks).__name__}")
    raw: list[dict] = []
    keys: dict[tuple[str, int], int] = {}
    for i, b in enumerate(blocks):
        at = f"{where}[{i}]"
        if not isinstance(b, dict):
            raise PlacementError(f"{at} must be an object with kind, segment and devices, got {type(b).__name__}")
        unknown = sorted(set(b) - _BLOCK_FIELDS)
        if unknown:
            raise PlacementError(f"{at}.{unknown[0]} is not a block field; use {', '.join(sorted(_BLOCK_FIELDS))}")
        for f in ("kind", "segment", "devices"):
            if f not in b:
                raise PlacementError(f"{at}.{f} is missing")
        kind = b["kind"]
        if not isinstance(kind, str) or kind.upper() not in BLOCK_KINDS:
            raise PlacementError(f"{at}.kind is {kind!r}; use one of {', '.join(BLOCK_KINDS)}")
        kind = kind.upper()
        seg = b["segment"]
        if not _is_int(seg) or seg < 0:
            raise PlacementError(f"{at}.segment must be a non-negative integer, got {seg!r}")
        devs = b["devices"]
        if _is_int(devs):
            devs = [devs]
        if not isinstance(devs, (list, tuple)) or not devs:
            raise PlacementError(f"{at}.devices must be a non-empty list of device indices, got {b['devices']!r}")
        for d in devs:
            if not _is_int(d):
                raise PlacementError(f"{at}.devices must hold integers, got {d!r}")
            if not 0 <= d < num_devices:
                raise PlacementError(f"{at}.devices names device {d}, outside 0..{num_devices - 1}")
        dur = b.get("duration", 1.0)
        if not _is_num(dur) or not math.isfinite(dur) or dur < 0:
            raise PlacementError(f"{at}.duration must be a non-negative number of seconds, got {dur!r}")
        mem = b.get("memory", 0)
        if _is_num(mem) and float(mem).is_integer():
            mem = int(mem)
        if not _is_int(mem) or abs(mem) > MAX_BYTES:
            raise PlacementError(f"{at}.memory must be an integer (bytes or units) of at most {MAX_BYTES:,} in size, "
                                 f"got {mem!r}")
        deps = b.get("deps", [])
        if not isinstance(deps, (list, tuple)):
            raise PlacementError(f"{at}.deps must be a list of block indices or names like '0F', got {deps!r}")
        out = b.get("output")
        if out is not None and not isinstance(out, TensorSpec):
            if not isinstance(out, dict) or not isinstance(out.get("shape"), (list, tuple)) \
                    or not all(_is_int(x) and 0 <= x <= MAX_BYTES for x in out["shape"]):
                raise PlacementError(f"{at}.output must be null or {{\"shape\": [ints], \"dtype\": str}}, got {out!r}")
            dtype = out.get("dtype", "float32")
            if not isinstance(dtype, str):
                raise PlacementError(f"{at}.output.dtype must be a dtype name, got {dtype!r}")
            parts = out.get("parts")
            if parts is not None and not (isinstance(parts, (list, tuple)) and all(
                    isinstance(p, dict) and isinstance(p.get("shape"), (list, tuple))
                    and all(_is_int(x) and x >= 0 for x in p["shape"]) and isinstance(p.get("dtype", ""), str)
                    and "parts" not in p for p in parts)):
                raise PlacementError(f"{at}.output.parts must be a list of {{\"shape\": [ints], \"dtype\": str}}, "
                                     f"got {parts!r}")
            try:
                out = TensorSpec.from_dict(out)
                nbytes = out.nbytes  # also checks the dtype name
            except ValueError as e:
                raise PlacementError(f"{at}.output.dtype: {e}") from None
            if nbytes > MAX_BYTES:
                raise PlacementError(f"{at}.output is {nbytes:,} bytes, more than {MAX_BYTES:,}; check its shape")
        if (kind, seg) in keys:
            raise PlacementError(f"{at} repeats block {seg}{kind} (already {where}[{keys[(kind, seg)]}])")
        keys[(kind, seg)] = i
        raw.append({"kind": kind, "segment": seg, "devices": tuple(devs), "duration": float(dur),
                    "memory": mem, "deps": deps, "output": out})
    specs = []
    for i, r in enumerate(raw):
        deps = []
        for j, dep in enumerate(r["deps"]):
            at = f"{where}[{i}].deps[{j}]"
            if _is_int(dep):
                if not 0 <= dep < len(raw) or dep == i:
                    raise PlacementError(
                        f"{at} is block index {dep}, which does not exist (0..{len(raw) - 1}, not itself)")
                deps.append(dep)
            elif isinstance(dep, str) and (mt := _DEP.match(dep)):
                key = (mt.group(2).upper(), int(mt.group(1)))
                if key not in keys:
                    raise PlacementError(f"{at} names block {dep.strip()!r}, which is not in the placement")
                deps.append(keys[key])
            else:
                raise PlacementError(f"{at} must be a block index or a name like '0F' (segment then kind), got {dep!r}")
        specs.append(BlockSpec(r["kind"], r["segment"], r["devices"], r["duration"], r["memory"], tuple(deps),
                               r["output"]))
    return tuple(specs)


def _tensor_to_dict(t: TensorSpec | None) -> dict | None:
    return t.to_dict() if t is not None else None


def placement_to_dict(placement: Placement, *, header: bool = True) -> dict:
    """The JSON form of ``placement``.

    Args:
        placement: the placement.
        header: with the envelope ``{"format": "tessel-placement", "version": 1, ...}`` (a
            placement file); ``False`` for the form a plan embeds under ``placement``.

    Returns:
        ``name``, ``num_devices``, ``static_memory``, ``blocks`` (``deps`` as indices) and, only
        when set, ``grad_memory``/``grad_transient``; the header first when ``header``.
    """
    body: dict[str, Any] = {
        "name": placement.name, "num_devices": placement.num_devices,
        "static_memory": list(placement.static_memory),
        "blocks": [
            {"kind": b.kind, "segment": b.segment, "devices": list(b.devices), "duration": b.duration,
             "memory": b.memory, "deps": list(b.deps), "output": _tensor_to_dict(b.output)}
            for b in placement.blocks
        ],
    }
    if placement.grad_memory:
        body["grad_memory"] = list(placement.grad_memory)
    if placement.grad_transient:
        body["grad_transient"] = list(placement.grad_transient)
    return PLACEMENT_ENVELOPE.wrap(body) if header else body


def placement_from_dict(d: Any, *, embedded: bool = False) -> Placement:
    """Inverse of :func:`placement_to_dict`; ``deps`` may be indices or names like ``"0F"``.

    Args:
        d: the parsed JSON value.
        embedded: ``d`` is the ``placement`` field of a plan: the header may be absent (plans
            embed the placement without it); when present it is checked all the same.

    Raises:
        PlacementError: not an object, wrong ``format``, unknown ``version`` or a malformed
            field (named, e.g. ``blocks[3].devices``).
    """
    if embedded and isinstance(d, dict) and "format" not in d and "version" not in d:
        d = PLACEMENT_ENVELOPE.wrap(d)
    PLACEMENT_ENVELOPE.check(d)
    unknown = sorted(set(d) - _FIELDS - {"format", "version"})
    if unknown:
        raise PlacementError(f"{unknown[0]} is not a placement field")
    nd = d.get("num_devices")
    if not _is_int(nd) or nd < 1:
        raise PlacementError(f"num_devices must be a positive integer, got {nd!r}")
    name = d.get("name", "custom")
    if not isinstance(name, str):
        raise PlacementError(f"name must be a string, got {name!r}")
    static = d.get("static_memory", [])
    if not isinstance(static, list):
        raise PlacementError(f"static_memory must be a list of integers, got {static!r}")
    for j, x in enumerate(static):
        if not _is_int(x) or abs(x) > MAX_BYTES:
            raise PlacementError(f"static_memory[{j}] must be an integer of at most {MAX_BYTES:,} bytes, got {x!r}")
    if static and len(static) != nd:
        raise PlacementError(f"static_memory has {len(static)} values but num_devices is {nd}")
    if "blocks" not in d:
        raise PlacementError("blocks is missing")
    specs = parse_blocks(nd, d["blocks"])
    grad = {}
    for key in ("grad_memory", "grad_transient"):
        vals = d.get(key, [])
        if not isinstance(vals, list) or not all(_is_int(x) and abs(x) <= MAX_BYTES for x in vals):
            raise PlacementError(f"{key} must be a list of integers (bytes per segment), got {vals!r}")
        grad[key] = tuple(vals)
    return Placement(nd, specs, name=name, static_memory=tuple(static), **grad)


def save_placement(placement: Placement, path: str | os.PathLike) -> Path:
    """Write ``placement`` as versioned JSON (atomically); returns the path.

    Raises:
        OSError: the file cannot be written.
    """
    return atomic_write_text(path, json.dumps(placement_to_dict(placement), indent=2) + "\n")


def read_json_file(path: str | os.PathLike, what: str, error: type[Exception]) -> Any:
    """The parsed JSON value of the file ``path``, or ``error`` with one sentence naming the file.

    Args:
        path: the file.
        what: what the file should be, for messages (``"placement"``, ``"plan"``).
        error: the exception class raised (a :class:`~engine.errors.TesselError` subclass taking a
            message).

    Raises:
        error: the path is missing or a folder, cannot be read (permissions), is not UTF-8 text
            (a UTF-8 byte-order mark is accepted), is not JSON (with line and column), or nests
            deeper than Python's JSON reader can follow.
    """
    p = Path(path)
    if not p.exists():
        raise error(f"{p}: no such {what} file; check the path")
    if p.is_dir():
        raise error(f"{p} is a folder, not a {what} file; give the path of the JSON file inside it")
    try:
        text = p.read_bytes().decode("utf-8-sig")
    except OSError as e:
        raise error(f"{p}: cannot read the {what} file ({e.strerror or type(e).__name__}); check its permissions") \
            from None
    except UnicodeDecodeError as e:
        raise error(f"{p}: not a JSON {what} file (byte {e.start} is not UTF-8 text)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{p}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise error(f"{p}: not a {what} file (its JSON nests deeper than any {what} does)") from None


def load_placement(path: str | os.PathLike) -> Placement:
    """Read a placement JSON file written by :func:`save_placement` (or by hand).

    Raises:
        PlacementError: the file is missing, a folder, unreadable, not UTF-8 JSON, of another
            ``format``/``version``, or has a malformed field; the message names the file and the
            field path (e.g. ``blocks[3].devices``).
    """
    d = read_json_file(path, "placement", PlacementError)
    try:
        return placement_from_dict(d)
    except PlacementError as e:
        raise PlacementError(f"{path}: {e}") from None
