"""This node's ranks as its agent sees them: their processes, their heartbeats summed up for the
store (the heartbeat deadline, the node's summary, ranks by state), and the last words of one
that exited (the tail of its log)."""

from __future__ import annotations

import os
import select
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.common.exit_text import own_lines
from controller.store.summaries import NodeSummary
from optimus.contract.phases import (
    CHECKPOINT,
    CHECKPOINT_SYNC,
    COLLECTIVE_PHASES,
    DONE,
    PAUSED,
    STARTUP,
)
from optimus.contract.records import Plan

TAIL_LINES = 20
# A rank's state for the ranks-by-state count (the exporter's), from its heartbeat's phase.
RANK_STATES = {STARTUP: "startup", CHECKPOINT: "checkpoint", CHECKPOINT_SYNC: "checkpoint",
               PAUSED: "paused", DONE: "done"}  # any other phase: a step, "training"


@dataclass
class RankProcess:
    rank: int
    local_rank: int
    popen: Any  # subprocess.Popen or spawn.WarmRank: pid, returncode, poll()
    log_path: Path
    started: float
    stop_sent: float | None = None  # when the agent sent SIGTERM
    kill_sent: bool = False
    stacks_path: Path | None = None
    compute: deque = field(default_factory=lambda: deque(maxlen=20))  # per sampled step
    sampled_step: int = -1
    steps_seen: int = 0  # steps this process has reported a compute time for
    left: int | None = None  # the generation it left, to wait in process for the next
    left_launch: int = 0  # ... and its replica's launch in it (replica_worlds.py)
    grace_s: float = 0.0  # of the stop sent to it
    spared: bool = False  # its stop's grace was extended once (lifecycle.py `Ranks.escalate`)

    @property
    def ready(self) -> bool:
        """It left its generation and waits in process (optimus/supervision/inprocess.py)."""
        return self.left is not None

    @property
    def running(self) -> bool:
        """Alive and one of its generation's ranks (not waiting for the next)."""
        return self.popen.returncode is None and not self.ready


# A rank process's first steps (its first step after a start or a resume: allocations, the
# optimizer's state, compiles) are no measure of the node's speed: a new generation's ranks
# would be called stragglers for them.
WARMUP_STEPS = 2


def sample_compute(p: RankProcess, beat: dict) -> None:
    """Keep one compute-time sample per step this rank reports, past its warm-up steps."""
    step, compute = beat.get("step", 0), beat.get("compute_s", 0)
    if step == p.sampled_step or not isinstance(compute, (int, float)) or not compute > 0:
        return
    p.sampled_step = step
    p.steps_seen += 1
    if p.steps_seen > WARMUP_STEPS:
        p.compute.append(float(compute))


def deadline(live: list[RankProcess], beats: dict[int, dict], plan: Plan | None) -> float | None:
    """When this node's earliest rank heartbeat falls overdue (None: no rank to watch)."""
    if plan is None:
        return None
    timeout, startup = plan.heartbeat_timeout_s, plan.startup_timeout_s
    deadlines = []
    for p in live:
        if p.stop_sent is not None:
            continue
        beat = beats.get(p.local_rank)
        deadlines.append(beat["time"] + timeout if beat else p.started + startup)
    return min(deadlines) if deadlines else None


def summary(live: list[RankProcess], beats: dict[int, dict]) -> NodeSummary | None:
    """This node's ranks in a few numbers, for the job-wide sorted sets."""
    seen = [beats[p.local_rank] for p in live if p.stop_sent is None and p.local_rank in beats]
    if not seen:
        return None
    full = [p.compute for p in live if len(p.compute) >= max(p.compute.maxlen // 2, 1)]
    memory = [b["memory"] for b in seen if b.get("memory")]
    return NodeSummary(
        max_step=max(b["step"] for b in seen), min_step=min(b["step"] for b in seen),
        outside=sum(b["phase"] not in COLLECTIVE_PHASES for b in seen),
        nonfinite=not all(b.get("finite", True) for b in seen),
        compute_s=max(statistics.median(c) for c in full) if full else None,
        paused=sum(b["phase"] == PAUSED for b in seen),
        oldest_beat=min(b["time"] for b in seen),
        peak_allocated=max((m["allocated_bytes"] for m in memory), default=None),
        peak_reserved=max((m["reserved_bytes"] for m in memory), default=None))


def rank_states(live: list[RankProcess], beats: dict[int, dict]) -> dict[str, int]:
    """How many of this node's live ranks are in each state (for the exporter)."""
    states = Counter()
    for p in live:
        beat = beats.get(p.local_rank)
        states["stopping" if p.stop_sent is not None else
               RANK_STATES.get(beat["phase"], "training") if beat else "startup"] += 1
    return dict(states)


def log_age(path: Path) -> float | None:
    """Seconds since the rank last wrote to its log (None: no log)."""
    try:
        return max(time.time() - path.stat().st_mtime, 0.0)
    except OSError:
        return None


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - 16384, 0))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(own_lines(text.splitlines())[-lines:])  # not the checkpoint writer's


class ExitWatch:
    """A pidfd (Linux 5.3+) per rank process not yet reaped, readable once it has ended: the
    agent's wait ends on it (controller/store/wake.py), so an exit is reaped and reported at
    once instead of at the loop's next turn (a replica's loss waits on it: docs/replicas.md).
    A process without one (it had ended already, an older kernel) is found at the next turn,
    as every exit was before."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # pid -> its pidfd, or -1 once spent (or none to be had)
        self._fired: set[int] = set()  # pidfds found readable once: given to one wait more

    def fds(self, procs) -> list[int]:
        """The pidfds of `procs` (RankProcess) to wait on. One found readable is given to one
        more wait (which then ends at once) and dropped after: a rank that ended but is not
        reaped yet (a warm-forked rank's status comes from the warm process) is looked at on
        the loop's cadence then, not in a spin."""
        live = {p.popen.pid for p in procs if p.popen.returncode is None}
        for pid in set(self._fds) - live:
            self._close(pid)
        for pid in live - set(self._fds):
            try:
                self._fds[pid] = os.pidfd_open(pid)
            except (OSError, AttributeError):  # gone already, or no pidfds here
                self._fds[pid] = -1
        watched = {fd: pid for pid, fd in self._fds.items() if fd >= 0}
        for fd in select.select(list(watched), [], [], 0)[0] if watched else ():
            if fd in self._fired:
                self._close(watched[fd])
                self._fds[watched[fd]] = -1
            else:
                self._fired.add(fd)
        return [fd for fd in self._fds.values() if fd >= 0]

    def close(self) -> None:
        for pid in list(self._fds):
            self._close(pid)

    def _close(self, pid: int) -> None:
        fd = self._fds.pop(pid)
        if fd >= 0:
            self._fired.discard(fd)
            os.close(fd)


def skip_steps(windows: object) -> str:
    """A plan's rewind windows (`skips`) for the ranks' OPTIMUS_SKIP_STEPS ("A-B,C-D"; optimus/
    stability.py reads it): only [first, last] pairs of whole steps, at most 1,000."""
    if not isinstance(windows, list):
        return ""
    return ",".join(f"{w[0]}-{w[1]}" for w in windows[:1000] if isinstance(w, list)
                    and len(w) == 2 and all(type(x) is int and x >= 1 for x in w)
                    and w[0] <= w[1])
