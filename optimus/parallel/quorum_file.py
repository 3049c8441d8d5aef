"""The quorum file: the controller's word on which replicas train together now, as each rank
reads it (a `Quorum` record, optimus/contract/records.py; optimus/parallel/replicas.py acts on
it)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from optimus.contract.records import Quorum, RecordError
from optimus.files import file_stamp

_QUORUM_LIMIT = 64 << 10  # bytes of a quorum file: a few ids and an address
# How often a wait for the controller's word (the file) or the members' meeting (the store)
# looks: often while the word is due (a failure's new quorum comes within tens of milliseconds
# of the failure, and the survivors wait on it), then every POLL_S (a replica may wait minutes
# out of the quorum). A stat or one store round trip a look.
POLL_S, SOON_POLL_S, SOON_S = 0.01, 0.002, 1.0


def _poll_s(began: float) -> float:
    return SOON_POLL_S if time.monotonic() - began < SOON_S else POLL_S


class QuorumError(RuntimeError):
    """A quorum file or an exchange this rank cannot go on with (said in one line)."""


class ReplicaOut(QuorumError):
    """The controller took this rank's replica out of the quorum after it had been a member:
    that launch of it is over (the controller relaunches the replica, and lets only its new
    launch back in). The rank leaves, as on a lost peer: it may go on in process as a rank of
    that next launch (optimus/supervision/inprocess.py; the words match PEER_FAILURE, which
    the controller reads in its last words)."""

    peer_failure = True  # optimus/supervision/inprocess.py `peer_failure`: by its type


def read_quorum(path: Path) -> Quorum | None:
    """The quorum in `path`, or None while there is none. A file that is not a quorum record is
    an error naming what is wrong (the agent writes it whole: it is never half there)."""
    try:
        with open(path, "rb") as f:
            data = f.read(_QUORUM_LIMIT + 1)
    except FileNotFoundError:
        return None
    if len(data) > _QUORUM_LIMIT:
        raise QuorumError(f"{path}: over {_QUORUM_LIMIT} bytes, not a quorum record")
    try:
        return Quorum.parse(json.loads(data))
    except (ValueError, RecordError) as e:
        raise QuorumError(f"{path}: not a quorum record ({str(e)[:200]})") from None


def wait_for_quorum(path: Path, *, after: int, replica: int, timeout_s: float,
                    beat: Callable[[], None] | None = None, member: bool = False) -> Quorum:
    """The first quorum in `path` newer than id `after` that holds `replica`. A newer one that
    leaves the replica out is skipped by a standby (it waits to be let in), and is the end of
    the launch of a rank that was a `member` (ReplicaOut). Raises QuorumError after
    `timeout_s`."""
    began = time.monotonic()
    deadline, seen = began + timeout_s, None
    while time.monotonic() < deadline:
        now = file_stamp(path)
        if now is not None and now != seen:
            seen = now
            quorum = read_quorum(path)
            if quorum is not None and quorum.id > after and replica in quorum.members:
                return quorum
            if quorum is not None and quorum.id > after and member:
                raise ReplicaOut(f"replica {replica} is out of quorum {quorum.id} "
                                 f"({quorum.members}): the controller relaunches it, and this "
                                 "launch of it ends")
        if beat is not None:
            beat()
        time.sleep(_poll_s(began))
    raise QuorumError(f"no quorum after id {after} holding replica {replica} came within "
                      f"{timeout_s:g} s")


def meet(store, quorum: Quorum, *, position: int, replica: int, path: Path,
         timeout_s: float) -> None:
    """Wait on the quorum's store until every member's rank at `position` has come (each sets
    a key), before the group's own rendezvous, which no newer word can interrupt. A member
    that will not come (it died on its way, or was relaunched: its new ranks wait for a later
    quorum) leaves the others here only until the controller names a newer quorum
    (QuorumError: they meet in that one), not for the whole timeout."""
    here = f"optimus/quorum/{quorum.id}/{position}/here/"
    store.set(here + str(replica), "1")
    keys = [here + str(m) for m in quorum.members]
    began = time.monotonic()
    deadline, seen = began + timeout_s, None
    while not store.check(keys):
        now = file_stamp(path)
        if now != seen:
            seen = now
            newer = read_quorum(path)
            # Looked at the keys once more: a meeting that completed meanwhile is formed by
            # the others, who must not wait for this rank in the group's rendezvous.
            if newer is not None and newer.id > quorum.id and not store.check(keys):
                raise QuorumError(f"quorum {quorum.id} did not meet before the controller "
                                  f"named quorum {newer.id} (replicas {newer.members})")
        if time.monotonic() > deadline:
            raise QuorumError(f"quorum {quorum.id} did not meet within {timeout_s:g} s")
        time.sleep(_poll_s(began))
