"""Replicas of several ranks (FSDP2 inside each), in real processes (bench/replica_rank.py): a
quorum group per position, and the replica's ranks agreeing before they apply what crossed over
(optimus/parallel/positions.py), so that a rank lost as its replica exchanges or heals never
leaves one position applying what another does not."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from test_replicas import (  # (it puts bench/ on the path)
    assert_trained_where_member,
    membership,
    params_of,
    reference,
)

from optimus.parallel.positions import Positions
from optimus.parallel.quorum_file import ReplicaOut


def assert_positions_equal_one_process(run, replicas, members: dict[int, list[int]]) -> None:
    """The two `replicas` hold the same bits at each position, and their weights are those of
    one process over the members' data."""
    a, b = replicas
    for p in range(2):
        assert all(torch.equal(x, y) for x, y in zip(run.state(a, p), run.state(b, p),
                                                      strict=True)), p
    want = reference(members, shard=2)
    got = [torch.cat([run.state(a, p)[i] for p in range(2)]) for i in range(4)]
    for g, w in zip(params_of(got), want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_sharded_replicas_heal_each_position_from_its_peer(run_of):
    """Two replicas of two ranks each (FSDP2 inside a replica): a quorum group per position.
    Replica 1 is lost whole (its node) and comes back as two standbys, each healed from the
    rank at its position in replica 0; every position ends with its peer's bits, and the
    weights are those of one process over the members' data."""
    steps = 24
    run = run_of(steps=steps, step_s=0.05, shard=2)
    standbys = run.start(1, after=1)  # for replica 1's two ranks
    run.wait(lambda: run.ready(1, 1))
    run.quorum([0, 1])
    for r in range(2):
        run.start(r)
    victims = [run.procs[1, p] for p in range(2)]
    run.wait(lambda: run.last_step(1) >= 3)
    for v in victims:  # its node lost: both at once (one position's rank lost alone as the
        v.kill()  # other's exchange completes: the next test)
    for v in victims:
        v.wait()
    run.quorum([0])
    run.wait(lambda: run.last_step(0) >= run.last_step(1) + 4)
    run.quorum([0, 1])
    run.finish([run.procs[0, 0], run.procs[0, 1], *standbys])
    members = membership(run, 0)
    assert list(members) == list(range(1, steps + 1))
    for p in range(2):
        lost_at = max(r["step"] for r in run.lines(1, p) if r["pid"] == victims[p].pid)
        assert_trained_where_member(run, members, (0, 1), position=p, lost_at=lost_at)
    for p in range(2):
        healed = [f for f in run.lines(1, p, kind="formed") if f["healed"]]
        assert healed and healed[-1]["healed"] == [1] and healed[-1]["source"] == 0
    assert_positions_equal_one_process(run, (0, 1), members)


def test_a_rank_lost_as_its_replica_exchanges_leaves_no_step_half_applied(run_of):
    """Two replicas of two ranks each. Replica 1's rank at position 1 is lost as step K's
    exchange begins, its replica's own sums done: at position 0 the exchange completes, with
    replica 1's part in it; at position 1 it fails. Replica 0's ranks apply neither: both take
    step K again without replica 1 (a step is never applied at one position with a replica's
    tokens and at another without them); replica 1's other rank leaves without applying it.
    The weights are those of one process over the members' data."""
    steps, k = 14, 5
    run = run_of(steps=steps, step_s=0.05, shard=2)
    standbys = run.start(1, after=1)
    run.wait(lambda: run.ready(1, 1))
    run.quorum([0, 1])
    run.start(0)
    run.start(1, 0, "--die-before-exchange", str(k), "--die-position", "1")
    victim, partner = run.procs[1, 1], run.procs[1, 0]
    run.wait(lambda: victim.poll() is not None and partner.poll() is not None)
    assert victim.returncode == 5 and partner.returncode == 0
    out = run.lines(1, 0, kind="out")
    assert out and "is lost" in out[0]["error"], run.lines(1, 0, kind="out")
    assert run.last_step(1, 0) == k - 1  # its exchange of step K completed: not applied
    run.quorum([0])
    run.wait(lambda: run.last_step(0) >= k + 3)
    run.quorum([0, 1])
    run.finish([run.procs[0, 0], run.procs[0, 1], *standbys])
    members = membership(run, 0)
    assert list(members) == list(range(1, steps + 1))
    assert {r["step"]: r["members"] for r in run.lines(0, 1)} == members  # both positions
    assert members[k - 1] == [0, 1] and members[k] == [0] and members[steps] == [0, 1]
    # Position 0 let its completed exchange go because position 1's failed.
    failed = [f for f in run.lines(0, 0, kind="failed") if f["step"] == k]
    assert failed and "another rank of replica 0" in failed[0]["error"], failed
    assert [f["step"] for f in run.lines(0, 1, kind="failed")] == [k]
    for p in range(2):
        assert_trained_where_member(run, members, (0, 1), position=p)
    assert_positions_equal_one_process(run, (0, 1), members)


def test_a_heal_that_fails_at_one_position_is_taken_at_none(run_of):
    """Three replicas of two ranks each. Replica 2 is let in and healed by replica 0, whose
    rank at position 1 dies as it gives: at position 0 the heal arrives whole and checked, at
    position 1 it fails. Replica 2's ranks take neither (a replica is never half healed); in
    the controller's next quorum both heal from replica 1, and every rank ends with its
    peer's bits."""
    steps = 14
    run = run_of(steps=steps, step_s=0.05, shard=2)
    standbys = run.start(2, after=1)
    run.wait(lambda: run.ready(2, 1))
    run.quorum([0, 1])
    run.start(0, 0, "--die-giving", "--die-position", "1")
    run.start(1)
    run.wait(lambda: run.last_step(0) >= 4)
    run.quorum([0, 1, 2])  # let in at the next switch: replica 0, the lowest ahead, heals it
    healer, partner = run.procs[0, 1], run.procs[0, 0]
    run.wait(lambda: healer.poll() is not None and partner.poll() is not None)
    assert healer.returncode == 4 and partner.returncode == 0
    assert run.lines(0, 0, kind="out")  # its replica's rank lost: it leaves
    run.quorum([1, 2])
    run.finish([run.procs[1, 0], run.procs[1, 1], *standbys])
    for p in range(2):
        assert [m["quorum"] for m in run.lines(2, p, kind="missed")] == [2], p
        healed = [(f["quorum"], f["source"]) for f in run.lines(2, p, kind="formed")
                  if f["healed"]]
        assert healed == [(3, 1)], (p, healed)
    missed = [m["error"] for m in run.lines(2, 0, kind="missed")]
    assert "another rank of replica 2 did not form quorum 2" in missed[0], missed
    members = membership(run, 1)
    assert list(members) == list(range(1, steps + 1)) and members[steps] == [1, 2]
    assert {r["step"]: r["members"] for r in run.lines(1, 1)} == members
    assert_positions_equal_one_process(run, (1, 2), members)


# --- the agreement, without processes ------------------------------------------------------

def _ranks(n: int, fn) -> list:
    """`fn(group, rank)` run by `n` threads, each a rank of one gloo group: what each returned
    or raised."""
    store, out = dist.HashStore(), [None] * n

    def rank(i: int) -> None:
        group = dist.ProcessGroupGloo(store, i, n, timedelta(seconds=20))
        try:
            out[i] = fn(group, i)
        except Exception as e:  # noqa: BLE001 (returned to the test, which checks it)
            out[i] = e
    threads = [threading.Thread(target=rank, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_a_replicas_ranks_apply_only_what_every_rank_has_and_leave_when_it_is_out():
    def never() -> None:
        return None

    every = _ranks(3, lambda g, i: Positions(g, 3, 20).decide(True, 7, never))
    assert all(d.all and (d.low, d.high) == (7, 7) for d in every)
    one_failed = _ranks(3, lambda g, i: Positions(g, 3, 20).decide(i != 1, 7, never))
    assert all(not d.ok and not d.all for d in one_failed)
    apart = _ranks(2, lambda g, i: Positions(g, 2, 20).decide(True, 7 + i, never))
    assert all(d.ok and not d.same and (d.low, d.high) == (7, 8) for d in apart)
    alone = Positions(None, 1, 20).decide(False, 3, never)  # no collective
    assert (alone.ok, alone.low, alone.high) == (False, 3, 3)

    # A rank whose partner has not decided waits; once its replica is out, it leaves.
    out, left = threading.Event(), threading.Event()

    def rank(group, i):
        if i == 0:
            try:
                return Positions(group, 2, 20).decide(
                    True, 7, lambda: "replica 0 is out of quorum 8" if out.is_set() else None)
            finally:
                left.set()
        threading.Timer(0.3, out.set).start()
        assert not left.wait(0.2)  # it waits while its replica is in
        assert left.wait(10)
        return Positions(group, 2, 20).decide(True, 7, never)  # ends the one let go
    waited, _ = _ranks(2, rank)
    assert isinstance(waited, ReplicaOut) and "out of quorum 8" in str(waited), waited
