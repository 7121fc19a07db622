"""Byte-level language-model data from the CPython standard library sources.

The implementation lives in :mod:`tasks.corpus` (the built-in text tasks read it and ``tasks``
may not import ``runtime``); this module keeps the names importable from ``runtime.data``.
"""

from __future__ import annotations

from engine.errors import DataError
from tasks.corpus import ByteCorpus, stdlib_root

__all__ = ["ByteCorpus", "DataError", "stdlib_root"]
