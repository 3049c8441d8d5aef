"""Checkpoints set aside: committed ones that fail verification, or that a bad tile makes suspect.

A checkpoint is set aside in one rename, out of the `step_<n>` namespace, to
`<root>/quarantine/step_<n:09d>.<UTC time>/`, with `QUARANTINED.json` inside saying why. It is
then neither committed (`committed_steps` lists `step_<n>` folders only) nor partial (cleanup
removes uncommitted `step_<n>` folders only), so nothing loads it, counts it toward retention or
deletes it; a later save of step n writes a fresh `step_<n>`. Its files, marker and manifest stay
as they were: the evidence, for `optimus checkpoint list` / `verify` and for whoever looks into
it. Nothing removes quarantined checkpoints: delete them by hand once looked at.

Who sets aside (one writer at a time, so no two ever race on a folder):
- rank 0 at resume (`pick_loadable`), each committed checkpoint newer than the one it loads that
  fails verification ("corrupt");
- the controller, before it plans the generation after evidence of wrong arithmetic (a bad tile,
  NaN from a rank's own tile), each checkpoint committed after that node last passed its health
  check ("suspect"); no rank of the job runs then.

Pure Python and the standard library, like manifest.py: the controller and the CLI import it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from optimus.checkpoint.manifest import (
    QUARANTINE_NOTE,
    committed_steps,
    step_dir,
    step_of,
    verify,
    write_note,
)
from optimus.files import fsync_path

__all__ = ["QUARANTINE", "QUARANTINE_NOTE", "pick_loadable", "quarantine", "quarantined"]

QUARANTINE = "quarantine"  # <root>/quarantine/


def quarantine(root: Path | str, step: int, reason: str, *, kind: str = "corrupt",
               problems: list[str] | tuple[str, ...] = (), by: str = "") -> Path:
    """Move the committed checkpoint of `step` to `<root>/quarantine/`; its new path.

    kind: "corrupt" (it fails verification) or "suspect" (it may hold wrong weights). The rename
    comes first, then the note: a crash between the two leaves it set aside, without its note.
    """
    root = Path(root)
    source = step_dir(root, step)
    aside = root / QUARANTINE
    aside.mkdir(exist_ok=True)
    now = time.time()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    target = aside / f"{source.name}.{stamp}"
    n = 1
    while target.exists():  # the same step set aside twice within a second
        target, n = aside / f"{source.name}.{stamp}-{n}", n + 1
    os.rename(source, target)
    fsync_path(root)
    fsync_path(aside)
    note = {"step": step, "kind": kind, "reason": reason, "problems": list(problems),
            "quarantined_at": now, "by": by, "was": source.name}
    write_note(target / QUARANTINE_NOTE, note)
    return target


def quarantined(root: Path | str) -> list[dict]:
    """Every checkpoint set aside under `root`, oldest first: its note plus "path" (a folder
    whose note is missing or unreadable says so in "reason")."""
    aside = Path(root) / QUARANTINE
    if not aside.is_dir():
        return []
    found = []
    for path in aside.iterdir():
        if not path.is_dir():
            continue
        try:
            note = json.loads((path / QUARANTINE_NOTE).read_text())
            if not isinstance(note, dict):
                raise ValueError("not an object")
        except (OSError, ValueError) as e:
            name = path.name.split(".", 1)[0]
            note = {"step": step_of(name), "kind": "unknown",
                    "reason": f"no readable {QUARANTINE_NOTE} ({type(e).__name__})",
                    "quarantined_at": path.stat().st_mtime}
        found.append({**note, "path": str(path)})
    return sorted(found, key=lambda n: (n.get("quarantined_at") or 0, n["path"]))


def pick_loadable(root: Path | str, deep: bool = True, *,
                  by: str = "") -> tuple[Path | None, list[str], list[dict]]:
    """The newest committed checkpoint that verifies; why each newer one was skipped; and those
    set aside (each {"step", "path", "reason"}).

    A newer one that fails verification is set aside, unless the failure was an I/O error
    reading its manifest ("cannot read ..."): a file system that is down for a moment must not
    set a whole run's checkpoints aside. Such a one is skipped and stays committed.
    """
    skipped, aside = [], []
    for step in reversed(committed_steps(root)):
        path = step_dir(root, step)
        problems = verify(path, deep=deep)
        if not problems:
            return path, skipped, aside
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        reason = f"{'; '.join(problems[:3])}{more}"
        skipped.append(f"{path.name} is corrupt ({reason})")
        if any(p.startswith("cannot read ") for p in problems):
            continue
        target = quarantine(root, step, reason, problems=problems, by=by)
        aside.append({"step": step, "path": str(target), "reason": reason})
    return None, skipped, aside
