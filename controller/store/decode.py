"""Records read back from Redis: a JSON object, or nothing.

Whoever holds an agent's or the operator's credentials can write these keys (docs/security.md),
so a value may be anything: the store keeps what decodes to a JSON object and skips the rest,
as it skips a record under no node name (names.py), rather than let one bad value raise in a
controller's tick or an agent's loop. The contract's records (the plan, an exit record:
optimus/contract/records.py) must also be whole and well typed (`checked`); one that is not is
skipped too, and noted in one line that names its field (`Notes`), which the controller says
once in a `record_refused` event (an agent, in its own).
"""

from __future__ import annotations

import json
import threading
from typing import TypeVar

from optimus.checkpoint.snapshot_files import parse_point
from optimus.contract.records import RecordError

R = TypeVar("R")
REMEMBERED = 1_000  # notes a process keeps to say once; more are dropped unsaid


class Notes:
    """What one process read from Redis and refused, each said once: `take` hands it over."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the exporter reads in its own thread
        self._seen: set[str] = set()
        self._unsaid: list[str] = []

    def note(self, line: str) -> None:
        with self._lock:
            if line not in self._seen and len(self._seen) < REMEMBERED:
                self._seen.add(line)
                self._unsaid.append(line)

    def take(self) -> list[str]:
        with self._lock:
            out, self._unsaid = self._unsaid, []
        return out


def checked(kind: type[R], raw: object, notes: Notes, where: str = "") -> R | None:
    """`raw` (JSON text) as record `kind` (a contract record: its `parse`), or None, noted in
    one line (`where` says which entry) when it is no such record."""
    try:
        return kind.parse(record(raw) if raw is not None else None)
    except RecordError as e:
        notes.note(f"{e.kind}{where}: {e.what}" if where else str(e))
        return None


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
