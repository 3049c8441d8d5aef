"""Crash-safe file writes shared by data preparation and checkpoints; sizes for people."""

from __future__ import annotations

import os
from pathlib import Path


def human_bytes(n: int) -> str:
    """`n` bytes in binary units, one decimal: "512 B", "1.5 GiB"."""
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            break
        size /= 1024
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"


def fsync_path(path: Path) -> None:
    """Make `path` durable: a file's contents, or (a folder) a rename or new file in it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_stamp(path: Path) -> tuple[int, int, int] | None:
    """What changes when a writer replaces `path` whole (a new inode) or rewrites it: read a
    file again only when this changed. None when it cannot be looked at."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def write_atomic(path: Path, data: bytes, tmp: Path) -> None:
    """Write `data` to `tmp`, fsync it, and rename it over `path`: old or new, never half."""
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
