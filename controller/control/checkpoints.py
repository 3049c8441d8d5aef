"""The controller's view of the checkpoint directory: which checkpoint the next generation
would load, what a bad tile's window makes suspect, and what rank 0 says it loaded.

The ranks decide where they resume: rank 0 verifies every file's sha256, sets a corrupt
checkpoint aside (optimus/checkpoint/quarantine.py) and falls back. The controller must not
hash terabytes at every restart, so for the plan it only predicts: the newest committed
checkpoint that is not suspect and whose files have the sizes its manifest lists (a listing and
one stat per file, between generations only, again only when the committed steps or the window
change). A flipped byte it cannot see; rank 0's heartbeat (`resume`) then says what it really
loaded and set aside, which decide.py reports.

A bad tile's window (the job record's `suspect`) makes suspect every checkpoint committed after
its node last passed the health check (a rewind's, with no node: every one after the step it goes
back to; controller/control/rewind.py) (the node record's `window_from`, kept by its agent; the
manifests' `committed_at`, read from the newest down to the first one before it). Setting those
aside is the controller's one write here, done only while no rank of the job runs.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from controller.control.recovery import clock
from controller.control.view import JobView
from controller.store.store import Store
from optimus.checkpoint.manifest import CheckpointError, read_manifest, step_dir, verify
from optimus.checkpoint.quarantine import quarantine, quarantined


class CheckpointView:
    def __init__(self, root: Path | str, store: Store):
        self.root, self.store = Path(root), store
        self._key: tuple | None = None  # what `resume_point` last checked
        self._seen: tuple = (None, (), None)
        self.distrust: dict | None = None  # the window as memory points are judged by it

    def resume_point(self, job: JobView, steps: list[int]
                     ) -> tuple[int | None, tuple[str, ...], dict[int, str] | None]:
        """The checkpoint the next generation would load; the newer ones that fail their size
        check, and why; the steps a bad tile's window makes suspect (None: no window)."""
        window = job.suspect
        since = self._window_start(window) if window else None
        self.distrust = {"nodes": window["nodes"], "since": since,
                         "after_step": window.get("resumed_step"),
                         "rewind": window.get("rewind")} if window else None
        key = (tuple(steps), json.dumps(window, sort_keys=True), since)
        if key == self._key:
            return self._seen
        suspect = self._suspect_steps(window, since, steps) if window else None
        latest, skipped = None, []
        for step in reversed(steps):
            if suspect and step in suspect:
                continue
            problems = verify(step_dir(self.root, step), deep=False)
            if not problems:
                latest = step
                break
            skipped.append(f"step {step}: {problems[0]}")
        self._key, self._seen = key, (latest, tuple(skipped), suspect)
        return self._seen

    def _window_start(self, window: dict) -> float | None:
        """When the window's nodes last passed their health check (the earliest of them);
        None when one has no passing check on record."""
        info = self.store.node_info(window["nodes"])
        passed = [_window_from(info.get(n, {})) for n in window["nodes"]]
        return None if None in passed or not passed else min(passed)

    def _suspect_steps(self, window: dict, since: float | None,
                       steps: list[int]) -> dict[int, str]:
        """Committed steps inside the window: committed after `since`; without it, every step
        after the one the failing generation resumed from."""
        nodes = ", ".join(window["nodes"])
        suspect = {}
        for step in reversed(steps):
            if since is None:
                floor = window.get("resumed_step")
                if floor is not None and step <= floor:
                    break
                suspect[step] = (
                    f"a rewind goes back to step {floor} ({window['rewind']}): this "
                    "checkpoint is of the line it abandons"
                    if window.get("rewind") else
                    f"committed by generation {window.get('generation')}, which ran on {nodes} "
                    "(no passing health check of it on record)")
                continue
            try:
                at = read_manifest(step_dir(self.root, step)).get("committed_at")
            except (CheckpointError, OSError):
                at = None
            if isinstance(at, int | float) and at <= since:
                break
            suspect[step] = (f"committed at {clock(at)}, after {nodes} last passed its health "
                             f"check at {clock(since)}")
        return suspect

    def set_aside(self, step: int, why: str, by: str) -> None:
        """Quarantine a suspect checkpoint (gone already, by retention or by hand: nothing to
        do). OSError when it cannot be moved."""
        with contextlib.suppress(FileNotFoundError):
            quarantine(self.root, step, why, kind="suspect", by=by)

    def report(self, plan: dict) -> dict | None:
        """What rank 0 of the running generation says it loaded (None: not yet); the reasons
        for what it set aside come from their notes in the quarantine folder."""
        beat = self.store.rank_beats(plan["nodes"][0]).get(0) if plan["nodes"] else None
        if not beat or beat.get("generation") != plan["generation"] or not beat.get("resume"):
            return None
        report = beat["resume"]
        steps = report.get("quarantined") or []
        notes = {q.get("step"): q for q in quarantined(self.root)} if steps else {}
        aside = [{"step": step, "reason": notes.get(step, {}).get("reason", ""),
                  "path": notes.get(step, {}).get("path", "")} for step in steps]
        return {"step": report.get("step"), "quarantined": aside,
                "source": report.get("source", "disk")}


def _window_from(info: dict) -> float | None:
    """The pass a node's window opens at: its record's `window_from`, which a pass taken after
    its ranks left (the check ahead, published for forgive.py) does not move, unlike `ok_at`
    (controller/node/checks.py); `ok_at` where an older agent wrote no `window_from`."""
    at = info["window_from"] if "window_from" in info else info.get("ok_at")
    return at if isinstance(at, int | float) and not isinstance(at, bool) else None
