"""The committed-checkpoint layout: manifests, commit markers, verification and retention.

A checkpoint of step n lives in `<root>/step_<n:09d>/`: DCP's shard files and `.metadata`,
perhaps small per-rank files, and, once committed, `optimus.json` (the manifest: step, tokens,
layout, config hash, data state, and the size and sha256 of every file) and the marker
`COMMITTED`, which holds the manifest's own sha256. The marker is renamed into place last, so a
directory without it is a save that never finished: invisible to resume, and cleaned up.

A checksum proves integrity, not origin: anyone who can write the folder can recompute them all.
So a commit given the run's key (trust.py) also writes `optimus.json.hmac`, an HMAC-SHA256 of the
manifest's bytes, before the marker; `read_manifest(..., key=...)` then refuses a manifest whose
MAC is missing or wrong (`UntrustedCheckpoint`), and one that a `step_<n>` folder of another
step holds (an older checkpoint of the run renamed to look newer).

Every write goes through a temp file (named `.tmp*`) and `os.replace`; deletions remove the
marker first. A crash at any moment therefore leaves each checkpoint either committed and whole
or uncommitted — never committed and broken.

Pure Python and the standard library, no torch: the operator's CLI imports this.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from optimus.files import fsync_path, write_atomic

__all__ = [
    "COMMIT_MARKER", "FORMAT", "MAC", "MANIFEST", "CheckpointError", "UntrustedCheckpoint",
    "apply_retention", "clean_partial", "commit", "committed_steps", "file_digests",
    "is_committed", "latest_committed", "latest_loadable", "read_manifest", "retention",
    "step_dir", "step_of", "verify", "write_note",
]

MANIFEST = "optimus.json"
MAC = "optimus.json.hmac"  # HMAC-SHA256 of the manifest's bytes under the run's key, in hex
COMMIT_MARKER = "COMMITTED"
QUARANTINE_NOTE = "QUARANTINED.json"  # why a checkpoint was set aside (quarantine.py)
FORMAT = 1
TMP_PREFIX = ".tmp"

_CHUNK = 8 << 20  # bytes hashed per read
_HASH_THREADS = 4  # hashlib releases the GIL, so a few threads keep several disks busy
_STEP_RE = re.compile(r"step_(\d{9,})")
_RESERVED = ("format", "files", "committed_at")
_UNLISTED = (MANIFEST, MAC, COMMIT_MARKER, QUARANTINE_NOTE)  # beside the files a manifest lists


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: the message names the file and what to do."""


class UntrustedCheckpoint(CheckpointError):
    """A committed checkpoint whose manifest this run's key does not authenticate."""

    def __init__(self, step_path: Path | str, reason: str):
        self.path, self.reason = Path(step_path), reason
        super().__init__(f"{step_path} was not written by this run: {reason}")


def step_dir(root: Path | str, step: int) -> Path:
    """`<root>/step_<step:09d>`."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a checkpoint step is a non-negative int, not {step!r}")
    return Path(root) / f"step_{step:09d}"


def step_of(path: Path | str) -> int | None:
    """The step a directory named `step_<n:09d>` holds, else None."""
    m = _STEP_RE.fullmatch(Path(path).name)
    if m is None or f"step_{int(m[1]):09d}" != m[0]:
        return None
    return int(m[1])


# --- hashing -----------------------------------------------------------------------------------

def _listed(step_path: Path) -> list[str]:
    """Relative posix paths of the files a manifest covers."""
    out = []
    for p in step_path.rglob("*"):
        rel = p.relative_to(step_path)
        if any(part.startswith(TMP_PREFIX) for part in rel.parts) or rel.as_posix() in (
                _UNLISTED) or p.is_symlink() or not p.is_file():
            continue
        out.append(rel.as_posix())
    return sorted(out)


def _sha256(path: Path, sync: bool = False) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
        if sync:  # make the bytes we are about to vouch for durable before the marker
            os.fsync(f.fileno())
    return h.hexdigest()


def _hash_all(paths: list[Path], sync: bool = False) -> list[str]:
    if len(paths) <= 1:
        return [_sha256(p, sync) for p in paths]
    with ThreadPoolExecutor(min(_HASH_THREADS, len(paths))) as pool:
        return list(pool.map(lambda p: _sha256(p, sync), paths))


def _digests(step_path: Path, sync: bool) -> dict[str, dict]:
    rels = _listed(step_path)
    paths = [step_path / r for r in rels]
    sizes = [p.stat().st_size for p in paths]
    hashes = _hash_all(paths, sync)
    return {r: {"size": s, "sha256": h} for r, s, h in zip(rels, sizes, hashes, strict=True)}


def file_digests(step_path: Path) -> dict[str, dict]:
    """`{relative path: {"size", "sha256"}}` for every file but the manifest, marker and temps."""
    return _digests(Path(step_path), sync=False)


# --- atomic writes -----------------------------------------------------------------------------

def _write_atomic(path: Path, data: bytes) -> None:
    write_atomic(path, data, path.with_name(f"{TMP_PREFIX}.{path.name}.{os.getpid()}"))


def write_note(path: Path, note: dict) -> None:
    """A small JSON file, written atomically (a note beside a checkpoint's files)."""
    _write_atomic(Path(path), (json.dumps(note, indent=1) + "\n").encode())


def commit(step_path: Path, meta: dict, key: bytes | None = None) -> dict:
    """Checksum every file, write the manifest (and, given the run's `key`, its MAC), then
    rename the commit marker into place.

    `meta` holds at least "step" and anything JSON-serialisable (tokens, layout, config_hash,
    data state...). Call it once every rank has finished writing; it returns the manifest.
    """
    step_path = Path(step_path)
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"commit needs meta['step'] as an int, got {step!r}")
    if step_of(step_path) not in (None, step):
        raise ValueError(f"meta['step']={step} does not match the directory {step_path.name}")
    if clash := [k for k in _RESERVED if k in meta]:
        raise ValueError(f"meta may not set {clash}: commit writes them")
    if not step_path.is_dir():
        raise CheckpointError(f"{step_path} does not exist: the save wrote nothing to commit")
    if is_committed(step_path):
        raise CheckpointError(f"{step_path} is already committed; save step {step} only once")

    digests = _digests(step_path, sync=True)
    for d in {(step_path / r).parent for r in digests}:
        fsync_path(d)
    manifest = {"format": FORMAT, **meta, "files": digests, "committed_at": time.time()}
    data = (json.dumps(manifest, indent=1, sort_keys=False) + "\n").encode()
    _write_atomic(step_path / MANIFEST, data)
    if key is not None:
        _write_atomic(step_path / MAC, (mac_of(data, key) + "\n").encode())
    _write_atomic(step_path / COMMIT_MARKER, (hashlib.sha256(data).hexdigest() + "\n").encode())
    fsync_path(step_path)
    fsync_path(step_path.parent)
    return manifest


# --- reading -----------------------------------------------------------------------------------

def is_committed(step_path: Path | str) -> bool:
    return (Path(step_path) / COMMIT_MARKER).is_file()


def mac_of(manifest: bytes, key: bytes) -> str:
    return hmac.new(key, manifest, hashlib.sha256).hexdigest()


def read_manifest(step_path: Path | str, key: bytes | None = None) -> dict:
    """The manifest of a committed checkpoint, checked against the hash in its marker; given
    the run's `key`, also against its MAC (else UntrustedCheckpoint)."""
    step_path = Path(step_path)
    marker, path = step_path / COMMIT_MARKER, step_path / MANIFEST
    if not marker.is_file():
        raise CheckpointError(f"{step_path} is not a committed checkpoint (no {COMMIT_MARKER} "
                              "marker): its save never finished; resume from a committed one")
    damaged = "the checkpoint is damaged; resume from an earlier committed one"
    try:
        data = path.read_bytes()
        recorded = marker.read_text().strip()
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror}; {damaged}") from None
    if hashlib.sha256(data).hexdigest() != recorded:
        raise CheckpointError(f"{path} does not match the sha256 recorded in {marker}: the "
                              f"manifest or the marker changed after commit; {damaged}")
    if key is not None:
        _authenticate(step_path, data, key)
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); {damaged}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
            isinstance(d, dict) and isinstance(d.get("size"), int)
            and isinstance(d.get("sha256"), str) for d in files.values()):
        raise CheckpointError(f"{path} has no valid `files` table; {damaged}")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {manifest.get('format')!r}; this optimus reads "
                              f"format {FORMAT}: load it with the optimus version that wrote it")
    return manifest


def _authenticate(step_path: Path, data: bytes, key: bytes) -> None:
    """The same bytes that are parsed next: a manifest swapped in between is never read."""
    try:
        recorded = (step_path / MAC).read_text().strip()
    except FileNotFoundError:
        raise UntrustedCheckpoint(step_path, f"it has no {MAC} (committed before optimus "
                                  "signed checkpoints, or not by optimus)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UntrustedCheckpoint(step_path, f"its {MAC} cannot be read "
                                  f"({type(e).__name__})") from None
    if not hmac.compare_digest(recorded.encode(), mac_of(data, key).encode()):
        raise UntrustedCheckpoint(step_path, f"its {MAC} does not match this run's key "
                                  "(another run wrote it, or its manifest was rewritten)")
    try:
        step = json.loads(data).get("step")
    except (ValueError, AttributeError):
        return  # read_manifest says what is wrong with it
    named = step_of(step_path)
    if named is not None and step != named:
        raise UntrustedCheckpoint(step_path, f"it is the checkpoint of step {step}, put in "
                                  f"the folder of step {named}")


def committed_steps(root: Path | str) -> list[int]:
    """Steps with a committed checkpoint under `root`, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = [step_of(p) for p in root.iterdir() if p.is_dir() and is_committed(p)]
    return sorted(s for s in steps if s is not None)


def latest_committed(root: Path | str) -> Path | None:
    steps = committed_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def verify(step_path: Path | str, deep: bool = True) -> list[str]:
    """Problems with one checkpoint, one line each naming the file; [] when it is whole.

    deep=False compares sizes only; deep=True also recomputes every sha256.
    """
    step_path = Path(step_path)
    try:
        listed = read_manifest(step_path)["files"]
    except CheckpointError as e:
        return [str(e)]
    name = step_path.name
    problems, to_hash = [], []
    present = set(_listed(step_path))
    for rel, want in sorted(listed.items()):
        shown = f"{name}/{rel}"
        if rel not in present:
            problems.append(f"missing: {shown} is listed in the manifest but absent")
            continue
        size = (step_path / rel).stat().st_size
        if size != want["size"]:
            what = "truncated" if size < want["size"] else "size mismatch"
            problems.append(f"{what}: {shown} is {size} bytes, the manifest says {want['size']}")
        elif deep:
            to_hash.append(rel)
    for rel, got in zip(to_hash, _hash_all([step_path / r for r in to_hash]), strict=True):
        if got != listed[rel]["sha256"]:
            problems.append(f"checksum mismatch: {name}/{rel} has sha256 {got[:12]}…, the "
                            f"manifest says {listed[rel]['sha256'][:12]}…")
    problems += [f"unexpected file: {name}/{rel} is not in the manifest"
                 for rel in sorted(present - set(listed))]
    return problems


def latest_loadable(root: Path | str, deep: bool = True) -> tuple[Path | None, list[str]]:
    """The newest committed checkpoint that verifies, and why each newer one was skipped."""
    skipped = []
    for step in reversed(committed_steps(root)):
        path = step_dir(root, step)
        problems = verify(path, deep=deep)
        if not problems:
            return path, skipped
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        skipped.append(f"{path.name} is corrupt ({'; '.join(problems[:3])}{more})")
    return None, skipped


# --- cleaning and retention --------------------------------------------------------------------

def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def clean_partial(root: Path | str, keep: Iterable[int] = ()) -> list[Path]:
    """Delete uncommitted step dirs (but those in `keep`, e.g. a save in flight) and temp files."""
    root, keep = Path(root), set(keep)
    if not root.is_dir():
        return []
    removed = []
    for p in sorted(root.iterdir()):
        step = step_of(p)
        if p.name.startswith(TMP_PREFIX):
            stale = [p]
        elif step is None or not p.is_dir() or step in keep:
            stale = []
        elif not is_committed(p):
            stale = [p]
        else:  # a committed dir: only temp files its commit left behind
            stale = sorted(q for q in p.iterdir() if q.name.startswith(TMP_PREFIX))
        for q in stale:
            _remove(q)
            removed.append(q)
    return removed


def retention(steps: list[int], keep_last: int, keep_every: int) -> set[int]:
    """The steps to keep: the newest `keep_last` (all of them when there are fewer), plus every
    multiple of `keep_every` (when > 0)."""
    if keep_last < 0 or keep_every < 0:
        raise ValueError(f"keep_last={keep_last} and keep_every={keep_every} must be >= 0")
    ordered = sorted(steps)
    keep = set(ordered[max(len(ordered) - keep_last, 0):])
    if keep_every:
        keep |= {s for s in ordered if s % keep_every == 0}
    return keep


def apply_retention(root: Path | str, keep_last: int, keep_every: int) -> list[int]:
    """Delete the committed checkpoints `retention` does not keep; returns their steps.

    keep_last must be >= 1: the newest committed checkpoint is never deleted.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} would delete the newest committed checkpoint; "
                         "keep at least 1")
    steps = committed_steps(root)
    doomed = sorted(set(steps) - retention(steps, keep_last, keep_every))
    for step in doomed:
        path = step_dir(root, step)
        (path / COMMIT_MARKER).unlink()  # uncommitted first: a crash now leaves a partial dir
        fsync_path(path)
        shutil.rmtree(path)
    return doomed
