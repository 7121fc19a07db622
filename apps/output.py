"""Console output helpers for the CLI: tables, units, the final JSON line."""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence


def fmt_ms(seconds: float) -> str:
    """Seconds as milliseconds text."""
    return f"{seconds * 1e3:,.3f} ms"


def fmt_gib(nbytes: float) -> str:
    """Bytes as GiB text."""
    return f"{nbytes / 2**30:,.2f} GiB"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def emit_json(obj: dict) -> None:
    """Print ``obj`` as one JSON line: the last line of stdout for ``--json``."""
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()
