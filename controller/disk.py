"""Files the control plane rewrites whole, and a disk that refuses them.

The leading controller rewrites its journal (`<run_dir>/controller.json`) and each agent its
ranks' control file whenever what they hold changes. A full disk, a quota, a filesystem turned
read-only or failing (ENOSPC, EDQUOT, EFBIG, EROFS, EIO) must not end supervision: Redis holds
the job's state and the ranks keep the last word they read. So a write that fails leaves the
file as it was, raises nothing, and is tried again on the writer's next tick; the writer says
so in one event when the writes start failing and in one when they work again, never once a
tick.

A write goes to a temporary file of its own (mkstemp, in the same folder, so that the rename
stays on one filesystem): two controllers sharing a run dir, a leader and the standby taking
over, never write through each other's. The file is fsynced, renamed over the old one, and the
folder fsynced, so that after a crash the file is the old one or the new one, and the new one
once the write has returned.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from optimus.files import fsync_path


def replace_file(path: Path, data: bytes) -> None:
    """Replace `path` with `data`, durably: old or new after a crash, never half. An OSError
    leaves `path` as it was and no temporary file behind."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise
    fsync_path(path.parent)


def reason(e: OSError) -> str:
    """`No space left on device (ENOSPC)`: what people read and what they search for."""
    code = errno.errorcode.get(e.errno or 0)
    return f"{e.strerror} ({code})" if code and e.strerror else str(e)


@dataclass(frozen=True)
class Turn:
    """A change in whether a file's writes work: to be said in one event."""

    ok: bool  # True: they work again; False: they started to fail
    text: str


class Rewritten:
    """One file rewritten whole (`what` names it to people); `failing` holds the last write's
    error while writes fail, None once one has worked."""

    def __init__(self, path: Path, what: str):
        self.path, self.what = Path(path), what
        self.failing: OSError | None = None

    def write(self, data: bytes) -> Turn | None:
        """Replace the file with `data`. Never raises an OSError: what to say when this write
        changed whether they work (the first to fail, the first to work after failures)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_file(self.path, data)
        except OSError as e:
            first, self.failing = self.failing is None, e
            if not first:
                return None
            return Turn(False, f"cannot write {self.what} {self.path}: {reason(e)}")
        if self.failing is None:
            return None
        self.failing = None
        return Turn(True, f"writes {self.what} {self.path} again")
