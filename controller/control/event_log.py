"""The job's events, mirrored from Redis into `<run_dir>/events.jsonl` by the leading controller.

Redis keeps the events stream only as long as Redis lives (`optimus run`'s private Redis goes
with the run); the run directory keeps them for good, beside `metrics.jsonl`, so that
`optimus report` and anyone after the run can read the control plane's history.

One JSON object per line, in stream order: {"id": the stream id, "time": seconds since the epoch,
"actor", "kind", "message", and the event's other fields as Redis holds them (strings)}.

Append-only and without duplicates: the file's last line says which stream id was mirrored last,
so a controller that starts to lead (a restart, a failover to the standby) carries on after it.
Each tick costs one XRANGE that usually returns nothing. The mirror trails the stream by at most
a tick; a write that fails (a full disk) is tried again on the next tick, from the same id.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from controller.store.store import Store

log = logging.getLogger("optimus.controller")

BATCH = 1000  # events copied per tick at most: a long backlog is caught up over a few ticks
TAIL_CHUNK = 65_536


class EventLog:
    def __init__(self, store: Store, path: Path):
        self.store, self.path = store, path
        self.last_id: str | None = None  # None: not known yet (read from the file first)
        self.size = -1  # the file's size after this controller's last append

    def forget(self) -> None:
        """Another controller may lead now and append: read the file again before writing."""
        self.last_id = None

    def mirror(self) -> int:
        """Copy the events newer than the last mirrored one; how many were copied. A file
        another controller appended to since (this one paused between its decision and its
        mirror while a standby took over) is read again first: no line twice."""
        if self.last_id is None:
            self.last_id, self.size = self._start_id(), self._size()
        elif self._size() != self.size:  # another leader appended while this one was paused
            self.size = self._size()
            written = last_mirrored_id(self.path)
            if _id_key(written) > _id_key(self.last_id):
                self.last_id = written
        new = self.store.events(count=BATCH, after=self.last_id)
        if not new:
            return 0
        text = "".join(json.dumps(_line(i, e)) + "\n" for i, e in new)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                if f.tell() and not _ends_with_newline(self.path):
                    f.write("\n")  # a line cut short by a crash stays a line of its own
                f.write(text)
        except OSError as e:
            log.warning("cannot append the events to %s (tried again next tick): %s",
                        self.path, e)
            return 0
        self.last_id = new[-1][0]
        self.size = self._size()
        return len(new)

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return -1

    def _start_id(self) -> str:
        """The id after which to copy: the file's last one. A stream whose newest id is older
        than that is another stream (a Redis that came back empty on a host whose clock is
        behind): none of it was mirrored yet, so it is copied whole."""
        last = last_mirrored_id(self.path)
        if last == "0":
            return "0"
        newest = self.store.events_tail(1)
        if newest and _id_key(newest[-1][0]) < _id_key(last):
            return "0"
        return last


def last_mirrored_id(path: Path) -> str:
    """The stream id on the file's last complete line ("0": no file, or no such line). Reads
    backwards from the end, so it costs the same for a file of any length."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            size = TAIL_CHUNK
            while True:
                start = max(end - size, 0)
                f.seek(start)
                lines = f.read(end - start).splitlines()
                if start > 0:
                    lines = lines[1:]  # the first may be the end of a longer line
                for raw in reversed(lines):
                    try:
                        event = json.loads(raw)
                    except ValueError:
                        continue  # cut short
                    if isinstance(event, dict) and event.get("id"):
                        return str(event["id"])
                if start == 0:
                    return "0"
                size *= 4
    except FileNotFoundError:
        return "0"


def _line(stream_id: str, event: dict[str, str]) -> dict:
    fields = dict(event)
    try:
        when = float(fields.pop("time"))
    except (KeyError, ValueError):
        when = None
    return {"id": stream_id, "time": when, "actor": fields.pop("actor", ""),
            "kind": fields.pop("kind", ""), "message": fields.pop("message", ""), **fields}


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _id_key(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)
