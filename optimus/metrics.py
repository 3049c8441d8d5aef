"""Per-step metrics: MFU against one peak table, JSON lines in a file, a bar on a terminal."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

# The peak table lives in optimus/runtime/peaks.py; these names are re-exported from here.
from optimus.runtime.peaks import PEAK_TFLOPS, peak_flops  # noqa: F401


class Laps:
    """Seconds between named points of a rank's start (rendezvous, groups, model, restore,
    data), from when the rank entered train(): where a generation's start goes."""

    def __init__(self) -> None:
        self.entered = time.time()
        self._last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._last
        self._last = now

    def fields(self) -> dict:
        return {"entered": self.entered, **{f"{k}_s": round(v, 4)
                                            for k, v in self.seconds.items()}}

    def __str__(self) -> str:
        return ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items())


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int  # tokens consumed so far, all ranks
    step_time_s: float
    tokens_per_s: float
    mfu: float | None  # 0..1, None where the device's peak is unknown
    checkpoint: dict | None = None  # the checkpointer's counters, when checkpointing
    moe: dict | None = None  # per MoE layer, slots routed to each expert; dropped; aux loss
    data: dict | None = None  # the step's samples: `sample_fingerprint`
    # The largest peak memory of any rank and which rank had it (optimus/runtime/memory.py):
    # {"allocated_bytes", "allocated_rank", "reserved_bytes", "reserved_rank"}
    memory: dict | None = None


CATCH_UP_ROWS = 64
# What a step's row may hold (`record`, `samples`): a peer's rows (a heal's) hold nothing else.
ROW_KEYS = frozenset({"time", *(f.name for f in fields(StepMetrics))})
TAIL_BYTES = 1 << 16  # of metrics.jsonl, for its last step: ~100 rows of a dense model


def last_logged_step(path: Path | None) -> int:
    """The last step metrics.jsonl at `path` holds a row of (0: none), read from its tail."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - TAIL_BYTES, 0))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except (OSError, TypeError):
        return 0
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # the cut first line, or one a lost writer left half written
        if isinstance(row, dict) and "event" not in row and type(row.get("step")) is int:
            return row["step"]
    return 0


def _ends_a_line(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return True
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"
    except OSError:
        return True


def logs_step(step: int, every: int, last: int) -> bool:
    """Whether rank 0 logs `step`'s metrics: every step up to `every` (the loss falls fastest
    at the start, and step 1 shows where it started), then every `every`-th step, and the
    last step of the run."""
    return step <= every or step % every == 0 or step == last


def sample_fingerprint(start: int, batch_size: int, sample_ids: Iterable,
                       reader: tuple[int, int]) -> dict:
    """One step's samples, for `optimus data audit`: the global sample-index range the whole
    step read, [start, end) (every data-parallel rank's share: order is a function of the
    index, so no gathering is needed), and a hash of the sample ids this rank read, with the
    slice it reads, `reader` = (dp degree, microbatches). Two reads of one step under one slice
    hash the same; a step repeated after a restart that hashes otherwise read other data."""
    ids = np.concatenate([np.asarray(x, dtype=np.int64).reshape(-1) for x in sample_ids])
    digest = hashlib.blake2b(ids.astype("<i8", copy=False).tobytes(), digest_size=8)
    return {"start": start, "end": start + batch_size, "ids": digest.hexdigest(),
            "reader": list(reader)}


class MetricsLog:
    """Rank 0's record of training: one JSON object per step in `path`, and a progress display.

    A logged step's line (`logs_step`) holds its metrics; a step between logged ones gets a
    line with only "step" and "data" (its samples' fingerprint). Every generation of a run
    appends to the same file.

    On a terminal it draws a bar; elsewhere (torchrun, CI, an agent's log) it prints a line
    per logged step.
    """

    def __init__(self, path: Path | None, total_steps: int, flops_per_token: int,
                 peak_flops_per_device: float | None, world_size: int,
                 enabled: bool = True):
        self.enabled = enabled
        self.path = path
        # The last rows, written or not: a rank that takes over the writing writes those its
        # lost writer had not (`catch_up`).
        self.recent: deque[dict] = deque(maxlen=CATCH_UP_ROWS)
        self.flops_per_token = flops_per_token
        self.peak = peak_flops_per_device
        self.world_size = world_size
        self.history: list[StepMetrics] = []
        self._file = None
        self._progress = None
        if not enabled:
            return
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1)
        if sys.stdout.isatty():
            self._progress = Progress(
                TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                console=Console(), transient=False)
            self._task = self._progress.add_task("train", total=total_steps, status="")
            self._progress.start()

    def throughput(self, tokens_in_step: int, step_time_s: float) -> tuple[float, float | None]:
        tokens_per_s = tokens_in_step / step_time_s if step_time_s > 0 else 0.0
        mfu = None
        if self.peak:
            mfu = self.flops_per_token * tokens_per_s / (self.peak * self.world_size)
        return tokens_per_s, mfu

    def record(self, m: StepMetrics) -> None:
        self.history.append(m)
        row = {"time": time.time(), **asdict(m)}
        self.recent.append(row)
        if not self.enabled:
            return
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
        mfu = f" mfu {m.mfu:.1%}" if m.mfu is not None else ""
        status = (f"loss {m.loss:.4f} | gnorm {m.grad_norm:.3f} | {m.tokens_per_s:,.0f} tok/s"
                  f" | {m.step_time_s * 1e3:.0f} ms{mfu}")
        if self._progress is not None:
            self._progress.update(self._task, completed=m.step, status=status)
        else:
            print(f"step {m.step:>6} | {status}", flush=True)

    def samples(self, step: int, data: dict | None) -> None:
        """A step that is not logged still leaves its samples' fingerprint: one short line."""
        if data is None:
            return
        row = {"time": time.time(), "step": step, "data": data}
        self.recent.append(row)
        if self.enabled and self._file is not None:
            self._file.write(json.dumps(row) + "\n")

    def adopt(self, rows: list[dict]) -> None:
        """Rows a peer replica kept of steps after this rank's newest (a heal carried this rank
        past steps it did not apply): kept as its own, for a `catch_up`."""
        newest = max((r["step"] for r in self.recent), default=0)
        self.recent.extend(r for r in rows if r["step"] > newest)

    def catch_up(self) -> list[int]:
        """This rank takes the writing over from one that was lost (replicas that carry on):
        the rows it kept of the steps after the file's last, written now; their steps. Each
        member holds the same step figures (the quorum's), its own slice's fingerprint."""
        if not self.enabled or self._file is None:
            return []
        last = last_logged_step(self.path)
        rows = [r for r in self.recent if r["step"] > last]
        if rows and not _ends_a_line(self.path):
            self._file.write("\n")  # a lost writer's last line, cut short: left alone
        for row in rows:
            self._file.write(json.dumps(row) + "\n")
        return [r["step"] for r in rows]

    def event(self, kind: str, message: str, **fields) -> None:
        """Something that is not a step: a resume, a failed save. A JSON line and a log line."""
        if not self.enabled:
            return
        if self._file is not None:
            self._file.write(json.dumps({"time": time.time(), "event": kind,
                                         "message": message, **fields}) + "\n")
        line = f"{kind}: {message}"
        if self._progress is not None:
            self._progress.console.print(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._file is not None:
            self._file.close()
            self._file = None
