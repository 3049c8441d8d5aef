"""Records read back from Redis: a JSON object, or nothing.

Whoever holds an agent's or the operator's credentials can write these keys (docs/security.md),
so a value may be anything: the store keeps what decodes to a JSON object and skips the rest,
as it skips a record under no node name (names.py), rather than let one bad value raise in a
controller's tick or an agent's loop.
"""

from __future__ import annotations

import json

from optimus.checkpoint.snapshot_files import parse_point


def record(raw: object) -> dict | None:
    """`raw` decoded, if it is the JSON text of an object; None for anything else (not JSON, a
    list or a number, nesting deep enough to exhaust the parser)."""
    if not isinstance(raw, (str, bytes, bytearray)):
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def local_rank(raw: object) -> int | None:
    """A local rank as a hash field names it: a small non-negative integer, else None."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    return int(text) if isinstance(text, str) and text.isdigit() and len(text) <= 6 else None


def points(raw: object, count: int) -> list[str | None]:
    """`count` space-separated snapshot point names (snapshot_files.point_name); each that is
    no point name ("-", anything else) is None."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    words = text.split(" ", count) if isinstance(text, str) and len(text) <= 200 else []
    words = (words + [""] * count)[:count]
    return [w if len(w) <= 64 and parse_point(w) else None for w in words]
