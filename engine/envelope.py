"""The envelope of every versioned Tessel JSON document: ``{"format": ..., "version": ..., ...}``.

Five formats share it: the plan (``tessel-plan``, :mod:`engine.io.plan`), the placement
(``tessel-placement``, :mod:`engine.io.placement_json`), the cost model (``tessel-cost-model``,
:mod:`engine.cost.model`), the profile table (``tessel-profile``, :mod:`engine.cost.profiler`)
and the checkpoint (``tessel-checkpoint`` and its per-rank ``tessel-rank-state``,
:mod:`runtime.checkpoint`). An :class:`Envelope` names one format; it writes the header
(:meth:`Envelope.wrap`), checks it on reading (:meth:`Envelope.check`: a JSON object, the right
``format``, a readable ``version``) and gives a :class:`FieldReader` whose field access raises
with the field path (e.g. ``schedule.orders[1][4]``). Every error is an instance of the
caller's own error class (``PlanFormatError``, ``PlacementError``, ``CostModelError``,
``CheckpointError``), all :class:`~engine.errors.TesselError` subclasses.

Messages come in two styles (plans keep their historical wording, which users and tests read;
the other formats share the ``"path"`` style):

* ``"field"``: ``"{source}: missing field 'schedule.orders'"``,
  ``"{source}: field 'version' is 2, but this Tessel reads version 1"`` (plans);
* ``"path"``: ``"{source}: blocks[3].devices is missing"``,
  ``"{source}: cost.version is 2, but this Tessel reads version 1"`` (the others).

``source`` (a file name, or ``""``) prefixes every message when given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from engine.errors import TesselError

E = TypeVar("E", bound=TesselError)

__all__ = ["Envelope", "FieldReader", "is_instance", "join_path", "type_name"]


def join_path(path: str, key: str | int) -> str:
    """The path of ``key`` under ``path``: ``join_path("a", "b") == "a.b"``,
    ``join_path("a", 3) == "a[3]"``, ``join_path("", "b") == "b"``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def type_name(typ: type | tuple[type, ...]) -> str:
    """``int`` -> ``"int"``; ``(int, float)`` -> ``"int/float"``; ``NoneType`` -> ``"null"`` (for messages)."""
    types = typ if isinstance(typ, tuple) else (typ,)
    return "/".join("null" if t is type(None) else t.__name__ for t in types)


def is_instance(value: Any, typ: type | tuple[type, ...]) -> bool:
    """``isinstance`` where a JSON boolean is never a number (``True`` is not an ``int``)."""
    types = typ if isinstance(typ, tuple) else (typ,)
    if isinstance(value, bool) and bool not in types:
        return False
    return isinstance(value, types)


@dataclass(frozen=True)
class FieldReader(Generic[E]):
    """Field access into one JSON document whose errors name the field path.

    Attributes:
        error: the exception class raised (the caller's own, a ``TesselError`` subclass).
        source: prefix of every message (a file name, ``"plan"``), or ``""`` for none.
        style: ``"field"`` (``missing field 'a.b'``) or ``"path"`` (``a.b is missing``).
    """

    error: type[E]
    source: str = ""
    style: Literal["field", "path"] = "path"

    def at(self, path: str) -> str:
        """The message prefix naming ``path``: ``"src: field 'a.b'"`` or ``"src: a.b"``."""
        loc = f"field '{path}'" if self.style == "field" else path
        return f"{self.source}: {loc}" if self.source else loc

    def fail(self, path: str, detail: str) -> E:
        """The error ``at(path) + detail``; ``detail`` brings its own separator
        (``" should be ..."``, ``": ..."``). Returned, not raised: ``raise r.fail(...)``."""
        return self.error(self.at(path) + detail)

    def missing(self, path: str) -> E:
        """The error for an absent field ``path``."""
        if self.style == "field":
            return self.error(f"{self.source}: missing field '{path}'" if self.source else f"missing field '{path}'")
        return self.fail(path, " is missing")

    def need(self, obj: Any, key: str, typ: type | tuple[type, ...], path: str) -> Any:
        """``obj[key]``, which must exist and be a ``typ`` (a JSON boolean is not a number).

        Args:
            obj: the enclosing JSON value (anything but an object counts as lacking ``key``).
            key: the field name.
            typ: the accepted Python type(s).
            path: the field's full path for messages, e.g. ``"schedule.orders"``.

        Raises:
            E: the field is missing or of another type (the message names ``path``).
        """
        if not isinstance(obj, dict) or key not in obj:
            raise self.missing(path)
        value = obj[key]
        if not is_instance(value, typ):
            raise self.fail(path, f" should be {type_name(typ)}, got {type(value).__name__}")
        return value

    def optional(self, obj: dict, key: str, typ: type | tuple[type, ...], path: str, default: Any = None) -> Any:
        """``obj.get(key, default)``, which must be a ``typ`` when present (``None`` counts as absent).

        Raises:
            E: the field is present and of another type.
        """
        value = obj.get(key)
        if value is None:
            return default
        if not is_instance(value, typ):
            raise self.fail(path, f" should be {type_name(typ)}, got {type(value).__name__}")
        return value


@dataclass(frozen=True)
class Envelope(Generic[E]):
    """One versioned JSON format: its name, its version and the error class it raises.

    Attributes:
        format: the ``format`` field, e.g. ``"tessel-plan"``.
        version: the ``version`` written and the only one read.
        error: the exception class of every reading error (a ``TesselError`` subclass).
        what: what a document is, for the non-object message (``"a plan"``).
        style: message style of the format's readers (see the module docstring).
        require_format: when ``False`` a document without ``format`` is accepted as this
            format (cost models and profile tables written by hand or before the field existed).
        require_version: when ``False`` a document without ``version`` is read as
            :attr:`version` (cost models, profile tables, rank states written before it existed).
        format_hint: appended to the wrong-format message (e.g. ``"; is this a Tessel plan file?"``).
        version_hint: appended to the wrong-version message.
    """

    format: str
    version: int
    error: type[E]
    what: str = "a document"
    style: Literal["field", "path"] = "path"
    require_format: bool = True
    require_version: bool = True
    format_hint: str = ""
    version_hint: str = ""

    def wrap(self, body: dict) -> dict:
        """``{"format": ..., "version": ..., **body}``: the header first, then the fields of ``body``."""
        return {"format": self.format, "version": self.version, **body}

    def reader(self, source: str = "") -> FieldReader[E]:
        """A :class:`FieldReader` with this format's error class and style."""
        return FieldReader(self.error, source, self.style)

    def check(self, d: Any, source: str = "", path: str = "") -> dict:
        """Check the header of a document read from JSON; return it.

        Args:
            d: the parsed JSON value.
            source: message prefix (file name), ``""`` for none.
            path: the document's own path inside an enclosing document (``"cost"`` when the
                cost model is the ``cost`` field of a plan), ``""`` at the top.

        Raises:
            E: ``d`` is not an object, its ``format`` differs (or is absent while required), or
                its ``version`` is not :attr:`version` (or is absent while required).
        """
        r = self.reader(source)
        if not isinstance(d, dict):
            if path:
                raise r.fail(path, f" should be a JSON object, got {type(d).__name__}")
            detail = f"{self.what} is a JSON object, got {type(d).__name__}"
            raise self.error(f"{source}: {detail}" if source else detail)
        fmt = d.get("format", None if self.require_format else self.format)
        if fmt != self.format:
            raise r.fail(join_path(path, "format"), f" is {fmt!r}, expected {self.format!r}{self.format_hint}")
        ver = d.get("version", None if self.require_version else self.version)
        if ver != self.version or isinstance(ver, bool):
            raise r.fail(join_path(path, "version"),
                         f" is {ver!r}, but this Tessel reads version {self.version}{self.version_hint}")
        return d
