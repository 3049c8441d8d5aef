"""Whose checkpoint it is: each run's key, and the loads it authenticates.

A checksum proves integrity, not origin: whoever can write a checkpoint folder can recompute
every sha256 of its manifest. So each run holds a key, 32 random bytes, in
`<run_dir>/secrets/checkpoint.key` (the folder mode 700, the file 600), outside its checkpoint
folder; rank 0 makes it at the run's first commit and signs every manifest with it
(manifest.py: an HMAC-SHA256 of the manifest's bytes in `optimus.json.hmac`). A load (resume,
`optimus checkpoint inspect | verify | export`, `optimus eval`) accepts a checkpoint only when
the key authenticates its manifest, or when the operator trusts it (`Trust`): one whose MAC is
missing (written before checkpoints were signed, or by hand) or made with another key (another
run's) is refused in one line that says how to accept it. Whatever is accepted, its files are
still read without running code (safe_pickle.py).

The key is read here and used by manifest.py only; it is never printed, logged, put in an
event or passed on a command line. It is used only while this user owns it and its folder and
no one else can read it or write the folder: a key or folder swapped in by someone else would
make their checkpoints pass.

Where a command knows only the checkpoint directory (`--dir`, a step folder), the key is the one
beside it, `<dir>/../secrets/checkpoint.key`: the run's own when checkpoint.dir is the default
`{run_dir}/checkpoints`. `--job` finds the run's key wherever its checkpoint.dir is.

Pure Python and the standard library, like manifest.py: the operator's CLI imports this.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from optimus.checkpoint.manifest import (
    CheckpointError,
    UntrustedCheckpoint,
    read_manifest,
    step_of,
)
from optimus.files import fsync_path

__all__ = ["KEY_FILE", "SECRETS", "Trust", "key_file_for", "read_key", "run_key_file"]

SECRETS = "secrets"
KEY_FILE = "checkpoint.key"
KEY_BYTES = 32
TRUST_HINT = "if you trust whoever wrote it, pass --trust-checkpoint"


def run_key_file(run_dir: Path | str) -> Path:
    """Where a run keeps its key: `<run_dir>/secrets/checkpoint.key`."""
    return Path(run_dir) / SECRETS / KEY_FILE


def key_file_for(root: Path | str) -> Path:
    """The key beside a checkpoint directory: its run's, for checkpoint.dir `{run_dir}/...`."""
    return run_key_file(Path(root).parent)


def read_key(path: Path | str, *, create: bool = False) -> bytes | None:
    """The run's key in `path`; None when there is none (made first, with `create`).

    CheckpointError, in one line, when the file or its folder is not this user's alone.
    """
    path = Path(path)
    if create:
        _create(path)
    try:
        folder = os.lstat(path.parent)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: the key is a symbolic link
        raise CheckpointError(f"cannot open this run's key {path} ({e.strerror}): it must be a "
                              "file of this user's, not a link; remove it and commit again "
                              "to make a new one") from None
    with os.fdopen(fd, "rb") as f:
        _check_mine(path.parent, folder, stat.S_ISDIR, 0o022, "700")
        _check_mine(path, os.fstat(f.fileno()), stat.S_ISREG, 0o077, "600")
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise CheckpointError(f"this run's key {path} holds {len(key)} bytes, not "
                              f"{KEY_BYTES}: remove it (the checkpoints it signed then need "
                              "--trust-checkpoint) and commit again to make a new one")
    return key


def _check_mine(path: Path, st: os.stat_result, kind, others: int, mode: str) -> None:
    if not kind(st.st_mode):
        raise CheckpointError(f"{path} is not a {'folder' if mode == '700' else 'file'} of its "
                              "own (a link?): the run's key is used only from its own secrets "
                              "folder")
    if st.st_uid != os.geteuid():
        raise CheckpointError(f"{path} belongs to uid {st.st_uid}, not to this user "
                              f"({os.geteuid()}): the run's key is used only when it and its "
                              "folder are this user's")
    if st.st_mode & others:
        raise CheckpointError(f"{path} has mode {stat.S_IMODE(st.st_mode):o}: others may "
                              f"{'read' if mode == '600' else 'write'} it; "
                              f"chmod {mode} {path}")


def _create(path: Path) -> None:
    """Write a new key, once: a file made whole under a temporary name, then linked into place
    (a key made meanwhile by another process wins)."""
    path.parent.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path.parent, 0o700)  # the umask may only take bits away
    if os.path.lexists(path):
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links
            if not os.path.lexists(path):
                os.rename(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(path.parent)


@dataclass(frozen=True)
class Trust:
    """What a load accepts: checkpoints this run's key (in `key_file`) authenticates, and those
    the operator trusts besides: any (`any`: --trust-checkpoint) or that of one step (`step`:
    checkpoint.trust_step). `hint` ends a refusal: how to accept the checkpoint."""

    key_file: Path
    any: bool = False
    step: int | None = None
    hint: str = TRUST_HINT

    def covers(self, step_path: Path | str) -> bool:
        return self.any or (self.step is not None and step_of(step_path) == self.step)

    def signing_key(self) -> bytes:
        """The key a commit signs with, made at the run's first commit."""
        return read_key(self.key_file, create=True)

    def manifest(self, step_path: Path | str) -> tuple[dict, str | None]:
        """The manifest of a committed checkpoint, and None when this run's key authenticates
        it, or why not when the operator trusts it. Otherwise UntrustedCheckpoint: one line
        naming the checkpoint, why, and the hint."""
        try:
            try:
                key = read_key(self.key_file)
            except CheckpointError as e:
                raise UntrustedCheckpoint(step_path, f"this run's key cannot be used: {e}") \
                    from None
            if key is None:
                raise UntrustedCheckpoint(step_path, f"this run has no key at {self.key_file} "
                                          "(made at a run's first commit, in "
                                          f"<run_dir>/{SECRETS}/{KEY_FILE})")
            return read_manifest(step_path, key), None
        except UntrustedCheckpoint as e:
            if self.covers(step_path):
                return read_manifest(step_path), e.reason
            raise UntrustedCheckpoint(step_path, f"{e.reason}; {self.hint}") from None
