"""The timed window of one bench/mfu.py run, and the host synchronisations of each step in it.

A run of `steps` steps: the first `warmup` are dropped (compilation, the allocator's first
blocks), the last one closes the window, and the steps between are timed. The device is
synchronised at the window's two ends only, so the window's wall time is exact whatever a step
leaves queued, and nothing is added inside it: a step that does not wait for the device lets
the next one's launches overlap its kernels, as in training. The figure is the window's mean
step (`step_s`); `step_times_s` are the host's marks between step starts.

On CUDA, torch's sync debug mode ("warn") is on inside the window: every synchronising call
torch makes (`.item()`, a blocking copy, `nonzero`, a stream synchronisation) warns, and the
warnings are counted per step, with the line of Python that made each. A logged step reads its
loss on the host (one synchronisation at least); an unlogged one has no reason to wait for the
device: target 0. On a CPU there is nothing to wait for: the mode is left alone and the counts
are None ("n/a (cpu)"). torch's own caveat: collectives (torch.distributed) are not covered.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's warning, c10/cuda
ANYWHERE = f".*{SYNC_MESSAGE}"  # a filter's message is matched from the start
UNLOGGED_SYNC_TARGET = 0  # synchronisations in an unlogged step of the trainer


def short(path: str) -> str:
    """A file's path from the repository's root when it is in it (optimus/train.py)."""
    return path[len(REPO) + 1:] if path.startswith(REPO + os.sep) else path


def is_sync(w: warnings.WarningMessage) -> bool:
    return SYNC_MESSAGE in str(w.message)


def sync_warning_problem() -> str | None:
    """None if torch's sync debug mode warns here on a known synchronisation (`.item()` of a
    CUDA tensor), else why not: without this, a count of 0 could mean a mode that never
    warns. Needs CUDA."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", message=ANYWHERE)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            torch.ones((), device="cuda").item()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    if not any(is_sync(w) for w in caught):
        return (f"torch {torch.__version__}'s sync debug mode did not warn on .item() "
                f"(warned: {[str(w.message)[:80] for w in caught]})")
    return None


class StepWindow:
    """Marks each step's start (`step_start(step)`, steps counted from 1) and, inside the timed
    window, counts the sync warnings between one mark and the next. A context manager: the
    warnings are caught while it is open; other warnings are shown when it closes."""

    def __init__(self, device: torch.device, steps: int, warmup: int,
                 logged: Callable[[int], bool], count_syncs: bool | None = None):
        if steps - warmup < 2:
            raise ValueError(f"{steps} steps with {warmup} dropped leave no step to time (the "
                             "last one closes the window)")
        self.first, self.last = warmup + 1, steps  # the first timed step; the closing step
        self.logged = logged
        self.cuda = device.type == "cuda"
        self.counting = self.cuda if count_syncs is None else count_syncs
        self.not_counted = None if self.counting else "cpu"  # why no count, or None
        self.marks: dict[int, float] = {}
        self._at: dict[int, int] = {}  # step -> warnings caught before it started
        self._caught: list[warnings.WarningMessage] = []
        self._catch = None

    def __enter__(self) -> StepWindow:
        if self.counting and self.cuda:
            problem = sync_warning_problem()
            if problem:
                self.counting, self.not_counted = False, problem
        self._catch = warnings.catch_warnings(record=True)
        self._caught = self._catch.__enter__()
        warnings.filterwarnings("always", message=ANYWHERE)
        return self

    def step_start(self, step: int) -> None:
        if not self.first <= step <= self.last:
            return
        if step == self.last and self.cuda:
            torch.cuda.set_sync_debug_mode(0)
        if step in (self.first, self.last) and self.cuda:
            torch.cuda.synchronize()
        self.marks[step] = time.perf_counter()
        self._at[step] = len(self._caught)
        if step == self.first and self.cuda and self.counting:
            torch.cuda.set_sync_debug_mode("warn")

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode(0)
        caught = list(self._caught)
        self._catch.__exit__(*exc)
        self._caught = caught
        for w in caught:  # what the run warned besides, as it would have been shown
            if not is_sync(w):
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)

    # --- what the window saw ------------------------------------------------------------------

    def timed(self) -> list[int]:
        return list(range(self.first, self.last))

    def complete(self) -> bool:
        return all(s in self.marks for s in (*self.timed(), self.last))

    def syncs(self) -> dict | None:
        """Per step of the window: its sync warnings; their means over the unlogged and the
        logged steps; and the lines that made them (file:line -> count), the unlogged steps'
        apart. None where not counted on a CPU; the reason where not counted elsewhere."""
        if not self.counting or not self.complete():
            return None if self.not_counted in (None, "cpu") else {"unlogged": None,
                                                                   "why": self.not_counted}
        per_step, sites = {}, {True: Counter(), False: Counter()}
        for step in self.timed():
            mine = [w for w in self._caught[self._at[step]:self._at[step + 1]] if is_sync(w)]
            per_step[step] = len(mine)
            sites[bool(self.logged(step))].update(f"{short(w.filename)}:{w.lineno}"
                                                  for w in mine)

        def mean(steps):
            return sum(per_step[s] for s in steps) / len(steps) if steps else None

        unlogged = [s for s in per_step if not self.logged(s)]
        logged = [s for s in per_step if self.logged(s)]
        return {"unlogged": mean(unlogged), "logged": mean(logged),
                "unlogged_steps": unlogged, "per_step": per_step,
                "sites": dict(sites[False].most_common()),
                "sites_logged": dict(sites[True].most_common())}

    def figures(self) -> dict:
        """The window's wall time, its mean step and the marks between, and the syncs."""
        if not self.complete():
            raise RuntimeError(f"the window saw the starts of steps {sorted(self.marks)}, not "
                               f"{self.first}..{self.last}: its caller did not mark each step")
        steps = self.timed()
        times = [self.marks[s + 1] - self.marks[s] for s in steps]
        return {"step_times_s": times, "window_s": sum(times), "step_s": sum(times) / len(times),
                "syncs": self.syncs()}


def syncs_text(syncs: dict | None) -> str:
    """'2' or '0.5', or 'n/a (cpu)' where nothing was counted, or 'n/a (why)'."""
    if syncs is None:
        return "n/a (cpu)"
    if syncs["unlogged"] is None:
        return f"n/a ({syncs.get('why', 'no unlogged step timed')})"
    return f"{syncs['unlogged']:g}"


@contextlib.contextmanager
def optimus_step_starts(callback: Callable[[int], None]):
    """Calls `callback(step)` at the start of each of the trainer's steps.

    optimus.train.train has no per-step hook of its own yet; its loop calls
    `RankFaults.step_start(step)` (fault injection's point at a step's start) first thing in
    every step, and this wraps that method for the duration. If the trainer stops calling it,
    nothing is marked and the window says so (`StepWindow.figures`), rather than timing the
    wrong thing.
    """
    from optimus.supervision.faults import RankFaults

    original = RankFaults.step_start

    def step_start(self, step: int) -> None:
        callback(step)
        original(self, step)

    RankFaults.step_start = step_start
    try:
        yield
    finally:
        RankFaults.step_start = original
