"""The agent's private folders, under names anyone could guess: `/tmp/optimus-<uid>` (the ranks'
heartbeat socket, control and chaos files) and `/dev/shm/optimus-<uid>` (in-memory snapshots).

On a shared login node another user could make such a folder first, and then read, replace
or redirect what the agent keeps there. So a folder is made with mode 0700, and one found
already there is used only when it is a real folder (no link), owned by this user, and
writable by no one else; one left group- or world-readable by an older Optimus is narrowed to
0700. Anything else is refused in one line that names the folder and what to do.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


class UnsafeFolder(Exception):
    """A private folder that someone else made, or can write into."""


def private_folder(path: Path) -> Path:
    """`path`, a folder only this user can enter (see the top of this module)."""
    path = Path(path)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)  # the umask may only take bits away
    info = os.lstat(path)
    uid = os.getuid()
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFolder(f"{path} is not a folder (a link or a file) where this agent keeps "
                           "its private files; fix: remove it, or set TMPDIR to a folder of "
                           "your own")
    if info.st_uid != uid:
        raise UnsafeFolder(f"{path} belongs to uid {info.st_uid}, not to this user (uid {uid}): "
                           "whoever made it could read or replace this agent's files; fix: "
                           "have it removed, or set TMPDIR to a folder of your own")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        raise UnsafeFolder(f"{path} is writable by other users (mode {mode:04o}), so what it "
                           f"holds may not be this agent's; fix: remove it (rm -r {path}) and "
                           "start the agent again")
    if mode & 0o077:
        os.chmod(path, 0o700)  # ours, only readable by others: as an older Optimus left it
    return path
