"""What `optimus run` prints while it follows a job: one line per thing that happened, in order.

Two sources: the control plane's events (Redis), stamped with who said them, and rank 0's
metrics file (`<run_dir>/metrics.jsonl`), from which come the validation losses, the checkpoint
commits and the loss of the progress line. The two are merged by time. What rank 0 did in a
generation is said after the controller's `loaded` event for that generation (what it resumed
from), so each generation reads top to bottom; a progress line (rank 0's step and latest loss)
follows at most every PROGRESS_S while the job is RUNNING. The job's end is said once, by
`optimus run`'s closing line: the controller's own completed/failed/stopped event is left out.
Every line is printed as it is, never read as Rich markup: events carry node names, hosts and
reasons from Redis, which may hold `[/x]` or `[link=...]`.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import math
import os
import time
from pathlib import Path

from rich.console import Console

from controller.control.decide import RUNNING, TERMINAL
from controller.store.store import Store, StoreUnavailable
from optimus.config import JobConfig

PROGRESS_S = 5.0  # at most one progress line this often
MAX_READ = 1 << 20  # bytes of the metrics file read per poll; the rest waits for the next
MAX_LINE = 1 << 20  # a longer "line" is not one of rank 0's rows: dropped
# Rank 0's event rows said as they are: failed, skipped or refused saves and resumes.
SAID = ("checkpoint", "quarantine")
# The controller's events that end the job: the closing line says the same.
ENDED = {state.lower() for state in TERMINAL}


class MetricsTail:
    """The rows appended to a JSON-lines file since the last call. It reads from a remembered
    offset, at most MAX_READ bytes a call, keeps a partial last line for the next call, and
    reads a truncated or replaced file again from its start; lines that are not JSON objects
    are skipped. (Written here: tailing libraries keep their offset in a file of their own, or
    follow with a thread.)"""

    def __init__(self, path: Path, from_end: bool = True):
        self.path = path
        self.offset, self.partial, self.file = 0, b"", None
        if from_end:  # an earlier run's rows in the same run_dir are not this run's
            with contextlib.suppress(OSError):
                st = os.stat(path)
                self.offset, self.file = st.st_size, (st.st_dev, st.st_ino)

    def rows(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if (st.st_dev, st.st_ino) != self.file or st.st_size < self.offset:
                    self.offset, self.partial, self.file = 0, b"", (st.st_dev, st.st_ino)
                f.seek(self.offset)
                chunk = f.read(MAX_READ)
        except OSError:  # not written yet
            return []
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        if len(self.partial) > MAX_LINE:
            self.partial = b""
        rows = []
        for line in lines:
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict):
                    rows.append(row)
        return rows


class Follow:
    """The console of one `optimus run`: `poll` each tick, `drain` once the controller exits."""

    def __init__(self, console: Console, store: Store, job: JobConfig):
        self.console, self.store, self.job = console, store, job
        self.tail = MetricsTail(Path(job.resolved_run_dir) / "metrics.jsonl")
        self.record: dict = {}
        tail = store.events_tail(1)  # the stream outlives a job's reset: no earlier run's
        self.last_event = tail[-1][0] if tail else "-"
        self.loaded: set[int] = set()  # generations whose `loaded` event was said
        self.held: list[dict] = []  # rank 0's rows waiting for their generation's `loaded`
        self.loss: tuple[int, float] | None = None  # rank 0's latest logged (step, loss)
        self.commit: int | None = None  # the last committed step said, in this generation
        self.step_shown, self.shown_at = None, -math.inf
        self.outage = False  # Redis was unreachable at the last poll

    def poll(self, progress: bool = True) -> dict:
        """New events and rows, said in order, then perhaps a progress line; the job record."""
        try:
            events, after = self._events()
            record, plan = self.store.job_record(), self.store.plan()
            step = _rank0_step(self.store, plan)
        except StoreUnavailable as e:
            if not self.outage:  # said once an outage, not every poll
                self._say(f"Redis unavailable: {e}")
            self.outage = True
            return {}
        if self.outage:
            self._say("Redis is back")
        self.outage = False
        self.record, self.last_event = record, after  # all read: an outage midway loses none
        waits_from = _time(plan.get("issued")) if plan and plan.get("action") == "run" else None
        for _, kind, item in heapq.merge(
                ((_time(e.get("time")), "event", e) for e in events),
                ((_time(row.get("time")), "row", row) for row in self.tail.rows()),
                key=lambda t: t[0]):
            if kind == "event":
                self._event(item)
            elif (waits_from is not None and plan["generation"] not in self.loaded
                  and _time(item.get("time")) >= waits_from):
                self.held.append(item)
            else:
                self._row(item)
        if progress:
            self._progress(plan, step)
        return self.record

    def drain(self) -> None:
        """The last events and rows, and any held back: the controller has exited."""
        self.poll(progress=False)
        held, self.held = self.held, []
        for row in held:
            self._row(row)

    def _events(self) -> tuple[list[dict], str]:
        """Every event since the last poll (the stream keeps at most ~10,000), and the last id."""
        events, after = [], self.last_event
        while batch := self.store.events(count=500, after=after):
            events += [e for _, e in batch]
            after = batch[-1][0]
            if len(batch) < 500:
                break
        return events, after

    def _say(self, line: str) -> None:
        self.console.print(line, markup=False)

    def _event(self, e: dict) -> None:
        if e.get("actor") == "controller" and e.get("kind") in ENDED:
            return
        stamp = time.strftime("%H:%M:%S", time.localtime(_time(e.get("time"))))
        self._say(f"{stamp} [{e.get('actor')}] {e.get('kind')}: {e.get('message')}")
        if e.get("kind") == "loaded" and str(e.get("generation", "")).isdigit():
            step = int(e["step"]) if str(e.get("step", "")).isdigit() else 0
            self.loaded.add(int(e["generation"]))
            if self.loss and self.loss[0] > step:  # rolled back: that loss is no longer ahead
                self.loss = None
            self.commit, self.step_shown = None, step
            held, self.held = self.held, []
            for row in held:
                self._row(row)

    def _row(self, row: dict) -> None:
        """A step's row updates the loss and says a new commit; an eval row says its loss. A
        row whose fields are not what rank 0 writes is skipped."""
        with contextlib.suppress(KeyError, TypeError, ValueError):
            if "loss" in row:
                self.loss = (int(row["step"]), float(row["loss"]))
                saves = row.get("checkpoint") or {}
                committed = saves.get("last_commit_step")
                if committed is not None and committed != self.commit:
                    line = (f"  checkpoint step {int(committed)} committed (written in "
                            f"{float(saves['last_write_s']):.1f} s)")
                    self.commit = committed
                    self._say(line)
            elif row.get("event") == "eval":
                self._say(f"  validation loss {float(row['val_loss']):.4f} at step "
                                   f"{int(row['step'])}")
            elif row.get("event") in SAID:  # a failed or skipped save, a checkpoint set aside
                self._say(f"  {row['event']}: {row['message']}")

    def _progress(self, plan: dict | None, step: int | None) -> None:
        """Rank 0's step (its heartbeat's, or the latest logged, whichever is further) and
        latest loss, while the job runs a generation whose load was said."""
        if (self.record.get("state") != RUNNING or not plan
                or plan.get("generation") not in self.loaded):
            return
        at = max(step or 0, self.loss[0] if self.loss else 0)
        now = time.monotonic()
        if at == self.step_shown or now - self.shown_at < PROGRESS_S:
            return
        self._say(f"  generation {plan['generation']}, step {at}/{self.job.optim.steps}"
                           + (f", loss {self.loss[1]:.4f} at step {self.loss[0]}"
                              if self.loss else "")
                           + f", restarts {self.record.get('restarts', 0)}")
        self.step_shown, self.shown_at = at, now


def _rank0_step(store: Store, plan: dict | None) -> int | None:
    """The step in rank 0's heartbeat, when it is of the planned generation."""
    if not plan or not plan.get("nodes"):
        return None
    beat = store.rank_beats(plan["nodes"][0]).get(0)
    return beat.get("step") if beat and beat.get("generation") == plan["generation"] else None


def _time(value) -> float:
    """A record's `time` (a number, or its text in an event); 0 when it is neither."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0
