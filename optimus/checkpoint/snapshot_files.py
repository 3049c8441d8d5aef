"""How in-memory snapshots lie in a node's snapshot folder: names, markers and checksums.

Shared by the ranks that write them (optimus/checkpoint/snapshot.py) and the node agent that
keeps, replicates and serves them (controller/node/snapshots.py). No torch here: the agent does not
import it.

    <node folder>/own/step_000000120.gen_0003/rank_00004.pt     this node's ranks' shards
                                              rank_00004.json   its marker, written last
    <node folder>/held/step_000000120.gen_0003/rank_00007.pt    replicas of other nodes' shards

A point (step, generation) names one snapshot of the whole job; a shard is one rank's part of
it. A shard is complete once its marker exists (the rank renames the data file in first, then
writes the marker) and the data file has the marker's size; its marker carries the sha256 that
every copy is checked against (the buddy on receipt, the rank before loading).

Lineage. A point belongs to the line of generations it was taken in. Every plan carries its
lineage: `[generation, resume step]` for the generations before it and itself (-1: from
scratch). A generation that resumed from step r abandons every older generation's state past r,
so a point (s, g) is void once some generation after g resumed from a step below s: it is
never loaded, and the agents remove it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import BinaryIO

_POINT = re.compile(r"^step_(\d+)\.gen_(\d+)$")
_MARKER = re.compile(r"^rank_(\d+)\.json$")
OWN, HELD = "own", "held"


def point_name(step: int, generation: int) -> str:
    return f"step_{step:09d}.gen_{generation:04d}"


def parse_point(name: str) -> tuple[int, int] | None:
    """(step, generation) of a point folder's name; None for anything else."""
    m = _POINT.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


LINEAGE_MAX = 64  # entries a plan carries (older ones void nothing a node still holds)


def void(step: int, generation: int, lineage: list) -> bool:
    """Whether the point (step, generation) lies on a line of generations a later generation
    abandoned: one after `generation` resumed from a step below `step`."""
    return any(g > generation and r < step for g, r in lineage)


def extend_lineage(lineage: list, generation: int, resume_step: int | None) -> list:
    """The lineage of a new generation resuming from `resume_step` (None: scratch). An entry
    that a later one with a lower or equal step covers voids nothing more, so it goes: the list
    keeps increasing steps, and is bounded."""
    step = -1 if resume_step is None else resume_step
    kept = [[g, r] for g, r in lineage if r < step]
    return [*kept, [generation, step]][-LINEAGE_MAX:]


def shard_files(point_dir: Path, rank: int) -> tuple[Path, Path]:
    """A shard's data file and its marker."""
    return point_dir / f"rank_{rank:05d}.pt", point_dir / f"rank_{rank:05d}.json"


def points(folder: Path) -> list[tuple[int, int, Path]]:
    """The point folders under `folder`, oldest step first: (step, generation, path)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = [(*p, folder / n) for n in names if (p := parse_point(n))]
    return sorted(found)


def complete_shards(point_dir: Path) -> dict[int, dict]:
    """rank -> marker, for each shard in `point_dir` whose data file is all there."""
    out = {}
    try:
        names = os.listdir(point_dir)
    except FileNotFoundError:
        return out
    for name in names:
        m = _MARKER.match(name)
        if m and (meta := _complete(point_dir, int(m.group(1)))) is not None:
            out[int(m.group(1))] = meta
    return out


def _complete(point_dir: Path, rank: int) -> dict | None:
    data, marker = shard_files(point_dir, rank)
    try:
        meta = json.loads(marker.read_text())
        return meta if data.stat().st_size == meta["bytes"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # being replaced, or not one of ours


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_shard(point_dir: Path, rank: int) -> tuple[dict | None, str | None]:
    """The shard's marker after checking its bytes against it, or (None, what is wrong)."""
    try:
        meta, f = open_shard(point_dir, rank)
    except ValueError as e:
        return None, str(e)
    with f:
        problem = check_open(meta, f)
    return (None, problem) if problem else (meta, None)


def open_shard(point_dir: Path, rank: int) -> tuple[dict, BinaryIO]:
    """The shard's marker and its data file open for reading, not yet checked (check_open):
    what is read through the handle stays there even if the point is removed meanwhile.
    Raises ValueError saying what is missing."""
    data, marker = shard_files(point_dir, rank)
    try:
        meta = json.loads(marker.read_text())
    except FileNotFoundError:
        raise ValueError(f"no shard of rank {rank} in {point_dir}") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"the marker of rank {rank} in {point_dir} is unreadable: {e}") from None
    try:
        return meta, open(data, "rb")
    except FileNotFoundError:
        raise ValueError(f"{data} is missing") from None


def check_open(meta: dict, f: BinaryIO) -> str | None:
    """What is wrong with an open shard's bytes against its marker (size, sha256), or None;
    leaves the file at its start."""
    size = os.fstat(f.fileno()).st_size
    if size != meta.get("bytes"):
        return f"{f.name} has {size} bytes, its marker says {meta.get('bytes')}"
    f.seek(0)
    digest = hashlib.file_digest(f, "sha256").hexdigest()
    f.seek(0)
    if digest != meta.get("sha256"):
        return f"{f.name} fails its sha256 check"
    return None


def write_marker(point_dir: Path, rank: int, meta: dict) -> None:
    """The marker, atomically (renamed in): its presence says the shard is complete."""
    _, marker = shard_files(point_dir, rank)
    tmp = marker.with_name(f".{marker.name}.tmp")
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, marker)


def install_shards(incoming: Path, point_dir: Path, markers: list[dict]) -> None:
    """Move received and checked data files from a private folder into `point_dir`, each
    before its marker. A shard already there with the same sha256 stays as it is (a second
    push of a point changes nothing); one with other bytes loses its marker first, so that no
    reader pairs the old marker with the new bytes. The caller holds the lock its folder's
    retention takes: between the folder's creation and its markers, the point looks empty."""
    point_dir.mkdir(parents=True, exist_ok=True)
    for meta in markers:
        rank = int(meta["rank"])
        data, marker = shard_files(point_dir, rank)
        there = _complete(point_dir, rank)
        if there is not None and there.get("sha256") == meta["sha256"]:
            continue
        marker.unlink(missing_ok=True)
        os.replace(shard_files(incoming, rank)[0], data)
        write_marker(point_dir, rank, meta)


def remove_point(point_dir: Path) -> None:
    shutil.rmtree(point_dir, ignore_errors=True)
