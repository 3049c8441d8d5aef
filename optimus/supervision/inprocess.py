"""In-process restart: a rank that outlives its generation.

Under an agent that restarts in process (supervision.restart "in_process", the default: the
agent then gives each rank OPTIMUS_NEXT_FILE), a rank whose generation ends without a fault of
its own does not exit. It ends the generation's work (its process groups destroyed, the save in
flight dropped, its helpers stopped: optimus/train.py), says so in a heartbeat of phase "ready"
that carries the exit status it would otherwise have had, and waits. The agent then writes the
next generation's word into that file, one JSON object, replaced atomically:

    {"generation": 3, "env": {"OPTIMUS_RANK": "5", ...}, "log": "<log_dir>/gen_0003/rank_00005.log"}

and the rank takes that environment (the OPTIMUS_* variables of a launch: its new rank, world,
rendezvous, resume point), appends its output to the new log and trains the next generation:
the same process, past its imports and device context (DTensor's cached sharding decisions
and compiled graphs are dropped: they hold the last generation's meshes, runtime/dist.py).
When no generation comes for it, the agent writes
{"exit": true, "generation": <the one it left>}, and it exits 0 (a SIGTERM outside training
does nothing: `hold_sigterm`). So a fault costs the healthy ranks a new rendezvous and a load,
not a new process each.

Replicas that carry on (docs/replicas.md) relaunch one replica within a generation: a word
that carries "launch": n (OPTIMUS_REPLICA_LAUNCH, its replica's launch count) is for that
replica's launch n of the same generation. The survivors of a lost replica's rank so stay in
process too: they left its launch on the lost peer's error, and the word makes them ranks of
the next launch, beside a new process in the lost one's place. A rank takes a word only for a
(generation, launch) after the one it left, and an exit only for that one.

A rank's own fault still ends it: only the error a collective raises because a peer is gone
(`peer_failure`: the text gloo, NCCL and the TCP store give, e.g. "Connection closed by peer")
is the peers' fault. Anything else exits as before (NaN/Inf 87/88, a failed final save 89, a
user error 2, any other exception 1) and the agent starts a new process in its place. A
generation stopped by the agent (a SIGTERM: every rank stops after one same step, with its
checkpoint) ends in "ready" too, with status 0.

`PEER_FAILURE` is the contract's (optimus/contract/phases.py): the controller reads it too (a
rank that exits on one is collateral, not a culprit).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from optimus.contract.env import NEXT_FILE, PREFIX, REPLICA_LAUNCH, SNAPSHOT_RESUME
from optimus.contract.phases import PEER_FAILURE
from optimus.files import file_stamp

POLL_S = 0.02
_NEXT_LIMIT = 1 << 20  # bytes of the agent's word (a launch environment: a few KiB)
# Variables a launch may set that the next one may leave out: not carried over.
_LAUNCH_ONLY = (SNAPSHOT_RESUME,)


def launch_count(environ=None) -> int:
    """Which launch of its replica within the generation this rank is (0: the first, and
    outside replica mode); a value that is not a count is 0: the agent sets it."""
    raw = (os.environ if environ is None else environ).get(REPLICA_LAUNCH, "0")
    return int(raw) if raw.isdigit() and len(raw) <= 9 else 0


def enabled() -> bool:
    """Whether this rank's agent restarts it in process."""
    return bool(os.environ.get(NEXT_FILE))


def peer_failure(exc: BaseException) -> bool:
    """Whether `exc` (or what it was raised from) is a collective's report of a lost peer, or
    says by its type that the rank is to leave as on one (`peer_failure`: ReplicaOut)."""
    seen = 0
    while exc is not None and seen < 8:
        if getattr(type(exc), "peer_failure", False) is True:
            return True
        if isinstance(exc, (RuntimeError, OSError, TimeoutError)) and \
                PEER_FAILURE.search(str(exc)[:4096]):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


@dataclass(frozen=True)
class Word:
    """The agent's word for the next generation (or its replica's next launch): an
    environment and a log (generation -1: exit)."""

    generation: int
    env: dict[str, str]
    log: str
    launch: int = 0


def read_word(path: Path, after: tuple[int, int]) -> Word | None:
    """The word in `path` if it names a (generation, launch) after `after`, the one the rank
    left; Word(-1, ...) for an exit meant for that rank (its generation and launch are
    `after`: a word left for a rank dismissed earlier from the same slot is not this one's);
    None while there is none (or it is not yet whole). A word that is not what the agent
    writes is ignored (the file is the agent's; this is a bound, not a trust decision)."""
    try:
        with open(path, "rb") as f:
            data = f.read(_NEXT_LIMIT + 1)
    except OSError:
        return None
    if len(data) > _NEXT_LIMIT:
        return None
    try:
        word = json.loads(data)
    except ValueError:
        return None
    if not isinstance(word, dict):
        return None
    launch = word.get("launch", 0)
    if not _count(launch):
        return None
    if word.get("exit") is True:
        return Word(-1, {}, "") if (word.get("generation"), launch) == after else None
    gen, env, log = word.get("generation"), word.get("env"), word.get("log")
    if (not _count(gen) or (gen, launch) <= after
            or not isinstance(env, dict) or not isinstance(log, str)
            or not all(isinstance(k, str) and k.startswith(PREFIX) and isinstance(v, str)
                       for k, v in env.items())):
        return None
    return Word(gen, env, log, launch)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def hold_sigterm() -> None:
    """Under an agent that restarts in process, a SIGTERM outside training does nothing (in
    training, commands.py's handler makes it a stop after one same step). The agent's
    SIGTERM stops a generation; one that reaches a rank after it left that generation (a
    peer died under it first) must not end the process the next generation is to reuse.
    The agent tells a waiting rank to exit in its file instead, and dies with its ranks."""
    if enabled():
        signal.signal(signal.SIGTERM, lambda *_: None)


def release_memory() -> None:
    """Between generations: the last one's objects freed (its model, optimizer, loader: they sit
    in reference cycles), and the heap's free pages handed back to the system (glibc keeps
    them otherwise, and a rank's resident memory would creep up generation by generation)."""
    gc.collect()
    if "torch.distributed.device_mesh" in sys.modules:  # a generation built meshes
        from optimus.runtime.dist import drop_stale_groups

        if drop_stale_groups():
            gc.collect()  # the groups the stale meshes held
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def wait_for_next(exit_code: int, interval_s: float,
                  meanwhile: Callable[[], None] | None = None) -> Word | None:
    """Between generations: heartbeats of phase "ready" (carrying `exit_code`) until the agent
    names the next generation (its Word) or says exit (None). `meanwhile` runs once after the
    first beat: what the rank can do while the next generation is planned."""
    from optimus.runtime import launch_env
    from optimus.supervision.heartbeat import start_heartbeat

    launch = launch_env()
    beat = start_heartbeat(launch, interval_s)
    beat.left(exit_code)
    try:
        if meanwhile is not None:
            meanwhile()
            beat.freed()
        path, seen = Path(os.environ[NEXT_FILE]), None
        while True:
            now = file_stamp(path)  # read only what changed: the agent replaces it whole
            if now is not None and now != seen:
                seen = now
                word = read_word(path, (launch.restart_count, launch_count()))
                if word is not None:
                    return None if word.generation < 0 else word
            time.sleep(POLL_S)
    finally:
        beat.close()


def enter(word: Word) -> None:
    """Become the next generation's rank: its environment, its log on stdout and stderr."""
    for name in _LAUNCH_ONLY:
        if name not in word.env:
            os.environ.pop(name, None)
    os.environ.update(word.env)
    fd = os.open(word.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
