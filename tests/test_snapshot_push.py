"""Buddy replication under concurrency: real SnapshotKeeper servers over TCP on localhost.
Several pushes of one point at once (a retried push, two pushers) and pushes while the
receiver's retention runs must each be confirmed, never fail on a file that vanished, and leave
the held copy complete and byte-identical to the source.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from records import as_record

from controller.node.snapshots import KEEP, UNNAMED_KEEP, SnapshotKeeper, pull, push
from optimus.checkpoint import snapshot_files
from optimus.checkpoint.snapshot_files import (
    check_shard,
    point_name,
    points,
    sha256_file,
    shard_files,
    write_marker,
)
from optimus.supervision.ports import unclaimed_port

SECRET = secrets.token_bytes(32)  # the job's key (snapshot_link.read_secret)
RANKS = [0, 1, 2, 3]
PUSHERS = 6
ROUNDS = 8


@pytest.fixture
def keeper(tmp_path):
    """`keeper(node)`: a SnapshotKeeper serving on localhost, closed after the test."""
    made = []

    def make(node: str) -> SnapshotKeeper:
        made.append(SnapshotKeeper(tmp_path / node, node, SECRET, "127.0.0.1"))
        return made[-1]
    yield make
    for k in made:
        k.close()


def _take(own: Path, step: int, ranks: list[int], size: int = 192 << 10,
          generation: int = 0) -> Path:
    """A point as ranks write it: each data file in place, then its marker."""
    point = own / point_name(step, generation)
    point.mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        data, _ = shard_files(point, rank)
        data.write_bytes(os.urandom(size))
        write_marker(point, rank, {"rank": rank, "step": step, "bytes": size,
                                   "sha256": sha256_file(data), "time": float(step)})
    return point


def _push_at_once(addr: str, point: Path, parts: list[list[int]]) -> list[str | None]:
    """One push of the point per entry of `parts` (the ranks it sends), all released together:
    None for each confirmed, else its error."""
    start = threading.Barrier(len(parts))

    def one(ranks):
        start.wait()
        try:
            push(addr, SECRET, point, ranks)
        except Exception as e:  # noqa: BLE001 - the outcome is what the test asserts on
            return f"{type(e).__name__}: {e}"
        return None
    with ThreadPoolExecutor(len(parts)) as pool:
        return list(pool.map(one, parts))


@contextlib.contextmanager
def _retaining(keeper: SnapshotKeeper):
    """The keeper's tick (retention, its report) running over and over meanwhile."""
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            keeper.poll(None, None)
    thread = threading.Thread(target=tick)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _assert_identical(source: Path, copy: Path, ranks: list[int]) -> None:
    for rank in ranks:
        meta, problem = check_shard(copy, rank)
        assert problem is None, problem
        data, _ = shard_files(copy, rank)
        assert meta == check_shard(source, rank)[0]
        assert data.read_bytes() == shard_files(source, rank)[0].read_bytes()
    leftovers = [n for n in os.listdir(copy) if n.startswith(".")]
    assert leftovers == []  # no half-written marker or data file stays behind


def test_concurrent_pushes_of_one_point_are_all_confirmed_and_leave_one_exact_copy(keeper):
    a, b = keeper("a"), keeper("b")
    for step in range(1, ROUNDS + 1):
        source = _take(a.own, step, RANKS)
        assert _push_at_once(b.address, source, [RANKS] * PUSHERS) == [None] * PUSHERS
        _assert_identical(source, b.held / source.name, RANKS)
    # Nothing private to a receive is left in held/: only point folders.
    assert sorted(os.listdir(b.held)) == [point_name(s, 0) for s in range(1, ROUNDS + 1)]


def test_pushes_while_the_receiver_retains_are_confirmed_and_retention_still_decides(keeper):
    a, b = keeper("a"), keeper("b")
    with _retaining(b):
        for step in range(1, ROUNDS + 1):
            # Two pushers of the point, each with half of its ranks, each part pushed twice.
            source = _take(a.own, step, RANKS)
            parts = [RANKS[:2], RANKS[2:]] * (PUSHERS // 2)
            assert _push_at_once(b.address, source, parts) == [None] * len(parts)
            # The newest point holds every rank: retention keeps it whole.
            _assert_identical(source, b.held / source.name, RANKS)
    b.poll(None, None)  # no usable point named: the newest UNNAMED_KEEP stay
    assert [p.name for *_, p in points(b.held)] == \
        [point_name(s, 0) for s in range(ROUNDS - UNNAMED_KEEP + 1, ROUNDS + 1)]
    b.keep = point_name(ROUNDS, 0)  # one named (the steady state): the newest KEEP
    b.poll(None, None)
    assert [p.name for *_, p in points(b.held)] == \
        [point_name(s, 0) for s in range(ROUNDS - KEEP + 1, ROUNDS + 1)]


def test_a_second_push_of_a_held_point_changes_nothing(keeper):
    a, b = keeper("a"), keeper("b")
    source = _take(a.own, 5, RANKS)
    push(b.address, SECRET, source, RANKS)
    held = b.held / source.name
    before = {n: os.stat(held / n).st_ino for n in os.listdir(held)}
    push(b.address, SECRET, source, RANKS)
    assert {n: os.stat(held / n).st_ino for n in os.listdir(held)} == before
    _assert_identical(source, held, RANKS)


def test_the_agents_tick_replicates_each_newest_point_while_the_buddy_retains(keeper):
    """The path the agents take: A's poll pushes its newest complete point of the running
    generation to B; B's poll runs retention meanwhile."""
    a, b = keeper("a"), keeper("b")
    plan = as_record({"generation": 0, "nodes": ["a", "b"], "ranks_per_node": 2,
                      "buddies": {"a": {"node": "b", "addr": b.address}}})
    with _retaining(b):
        for step in range(1, ROUNDS + 1):
            source = _take(a.own, step, [0, 1])
            while source.name not in a.replicated and source.name not in a.failed:
                a.poll(plan, 0)
                time.sleep(0.005)
            assert a.failed == {}
            assert a.replicated[source.name] == "b"
            _assert_identical(source, b.held / source.name, [0, 1])


def test_a_pull_while_the_holder_retains_gets_the_exact_point(keeper):
    a, b, c = keeper("a"), keeper("b"), keeper("c")
    with _retaining(b), _retaining(c):
        for step in range(1, ROUNDS + 1):
            source = _take(a.own, step, RANKS)
            push(b.address, SECRET, source, RANKS)
            pull(b.address, SECRET, c.held / source.name, RANKS, c.lock)
            _assert_identical(source, c.held / source.name, RANKS)


def test_a_plans_pull_that_ends_tells_the_agent_at_once_whether_it_got_the_point(keeper):
    """The agent launches a plan whose point it pulls when the pull ends, not at its next
    tick (a heartbeat interval later: ~0.5 s of a restart in bench/recovery.py)."""
    a, b, c = keeper("a"), keeper("b"), keeper("c")
    source = _take(a.own, 3, [2, 3])
    push(b.address, SECRET, source, [2, 3])  # b holds node a's shards of step 3
    ended = threading.Event()
    c.on_pulled = ended.set
    plan = {"generation": 1, "nodes": ["x", "c"], "ranks_per_node": 2,
            "memory": {"step": 3, "generation": 0,
                       "holders": {"c": {"node": "b", "addr": b.address}}}}
    first = c.resume_dir(as_record(plan))
    assert ended.wait(30)
    assert first[0] in ("waiting", "ready")  # (a pull may end before it is asked about)
    assert c.resume_dir(as_record(plan)) == ("ready", c.held / source.name)
    _assert_identical(source, c.held / source.name, [2, 3])
    ended.clear()  # a holder gone: the pull fails, and says so as soon
    gone = {**plan, "generation": 2, "memory": {**plan["memory"], "holders": {
        "c": {"node": "b", "addr": f"127.0.0.1:{unclaimed_port('127.0.0.1')}"}}}}
    c.held.joinpath(source.name).rename(c.held / "elsewhere")
    assert c.resume_dir(as_record(gone))[0] in ("waiting", "ready")
    assert ended.wait(30)
    assert c.resume_dir(as_record(gone))[0] == "ready" and c.fetch_error()


def test_a_shard_that_fails_its_checksum_is_refused_with_the_reason(keeper):
    a, b = keeper("a"), keeper("b")
    source = _take(a.own, 3, [0])
    data, _ = shard_files(source, 0)
    data.write_bytes(b"\0" * data.stat().st_size)  # same size, other bytes
    with pytest.raises(ValueError, match="fails its sha256 check"):
        push(b.address, SECRET, source, [0])
    assert points(b.held) == []


def test_a_poll_reads_each_marker_at_most_once_and_between_ticks_only_unsent_points(
        keeper, monkeypatch):
    """At 12 ranks a node the agent polls every 50 ms: a poll on the tick (retention, the
    report) reads each shard marker once; one between ticks, only the markers of points not
    sent yet; one that finds a push ended reports at once."""
    reads = Counter()
    real = snapshot_files._complete

    def counted(point_dir, rank):
        if point_dir.is_relative_to(a.root):  # not b's, receiving the push
            reads[(point_dir.name, point_dir.parent.name, rank)] += 1
        return real(point_dir, rank)
    monkeypatch.setattr(snapshot_files, "_complete", counted)

    def poll(full: bool) -> dict | None:
        reads.clear()
        return a.poll(plan, 0, [], full=full)

    a, b = keeper("a"), keeper("b")
    plan = as_record({"generation": 0, "nodes": ["a", "b"], "ranks_per_node": 2,
                      "buddies": {"a": {"node": "b", "addr": b.address}}})
    for step in (1, 2, 3):
        _take(a.own, step, [0, 1], size=1024)
        _take(a.held, step, [2, 3], size=1024)
    markers = {(point_name(s, 0), folder, r) for s in (1, 2, 3)
               for folder, ranks in (("own", (0, 1)), ("held", (2, 3))) for r in ranks}

    a.keep = point_name(3, 0)  # a usable point named (the steady state): the newest KEEP stay
    report = poll(full=True)  # the tick: step 1 goes in both folders, step 3 goes to b
    assert dict(reads) == {m: 1 for m in markers}
    kept = [point_name(2, 0), point_name(3, 0)]
    assert sorted(report["own"]) == kept and sorted(report["held"]) == kept
    assert report["own"][kept[1]] == [0, 1] and report["held"][kept[1]] == [2, 3]
    assert report["replicated"] == {}
    assert [p.name for *_, p in points(a.own)] == kept

    deadline = time.monotonic() + 30
    while (report := poll(full=False)) is None:  # the push runs: nothing is read meanwhile
        assert not reads
        assert time.monotonic() < deadline, "the push did not end"
        time.sleep(0.005)
    assert report["replicated"] == {kept[1]: "b"}  # reported as soon as b has it
    assert max(reads.values()) == 1
    assert poll(full=False) is None and not reads  # all sent: nothing to read

    _take(a.own, 4, [0], size=1024)  # being written: rank 1's shard is not there yet
    assert poll(full=False) is None
    assert dict(reads) == {(point_name(4, 0), "own", 0): 1}
    _take(a.own, 4, [1], size=1024)
    assert poll(full=False) is None  # complete: its push starts
    assert dict(reads) == {(point_name(4, 0), "own", r): 1 for r in (0, 1)}
    assert poll(full=True) is not None  # the tick reports it, each marker read once
    assert max(reads.values()) == 1
