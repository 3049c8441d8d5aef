"""Memory snapshots under replicas that carry on (supervision.on_replica_loss: continue): only
the writer replica (the lowest member) takes them, its shards named by its ranks in its
replica's world; a point is whole once each position's shards are there, whichever replica
wrote it (while another is out, too); a restart of the whole job (below min_replicas) resumes
every replica from it. The rules first (recovery.slot_shards, memory_point,
snapshot_watch.writers / align_point), then the whole control plane: real redis-server,
controller, agents holding the snapshots and their buddies' copies, and gloo ranks."""

from __future__ import annotations

import os
import signal

import pytest

from controller.control.recovery import memory_point, slot_shards
from controller.control.snapshot_watch import align_point, writers
from optimus.checkpoint.snapshot_files import point_name
from optimus.data.audit import audit_run
from tests.cluster import metrics
from tests.replica_cluster import events, rank_pids, replica_job, start, wait_stepping

# Two replicas of two nodes, one rank each: n0 n1 (replica 0), n2 n3 (replica 1).
NODES = ["n0", "n1", "n2", "n3"]
PLAN = {"generation": 0, "nodes": NODES, "ranks_per_node": 1,
        "buddies": {n: {"node": b, "addr": "x:1"}
                    for n, b in zip(NODES, NODES[1:] + NODES[:1], strict=True)},
        "replicas": {"addrs": ["h0", "h2"], "ports": [1, 2], "launches": [0, 1],
                     "after": [0, 2]}}
P12, P14 = point_name(12, 0), point_name(14, 0)


def report(own=None, held=None, replicated=()) -> dict:
    return {"addr": "x:1", "own": own or {}, "held": held or {},
            "replicated": {p: "b" for p in replicated}}


def test_each_node_slot_writes_and_loads_its_ranks_in_its_replicas_world():
    assert slot_shards(PLAN) == [{0}, {1}, {0}, {1}]
    assert slot_shards({**PLAN, "ranks_per_node": 2}) == [{0, 1}, {2, 3}, {0, 1}, {2, 3}]
    assert slot_shards({k: v for k, v in PLAN.items() if k != "replicas"}) == [{0}, {1}, {2},
                                                                               {3}]


def test_a_point_the_present_replica_took_restores_every_replica():
    """Replica 0 is out; replica 1 (now the writer) took step 12 and its buddies hold the
    copies: the point is whole, each slot of both replicas served by the nodes holding its
    position's shards."""
    reports = {"n0": report(), "n1": report(),
               "n2": report(own={P12: [0]}, replicated=[P12]),
               "n3": report(own={P12: [1]}, held={P12: [0]}, replicated=[P12]),
               "n0@1": report(held={P12: [1]})}  # n3's copy, on n0's last incarnation
    point, why = memory_point(PLAN, reports, set(NODES), 10)
    assert why is None
    assert point == {"step": 12, "generation": 0,
                     "slots": [["n2", "n3"], ["n3"], ["n2", "n3"], ["n3"]]}
    assert writers(PLAN, reports, P12) == ["n2", "n3"]
    # a position whose shards have no copy on another node: not committed
    reports["n0@1"] = report()
    assert memory_point(PLAN, reports, set(NODES), 10)[0] is None
    # one position written by one replica and the other by another is no point of one writer
    split = {"n0": report(own={P14: [0]}), "n3": report(own={P14: [1]})}
    assert writers(PLAN, split, P14) is None


def test_a_copy_on_a_node_of_another_replica_counts_for_that_nodes_own_slot_too():
    """Two replicas of one node: n1 (replica 1) holds the copy of the writer n0's shard, which
    is also what n1's own slot loads: the point is committed, and n1 loads it from memory."""
    plan = {**PLAN, "nodes": ["n0", "n1"], "replicas": {**PLAN["replicas"], "addrs": ["a", "b"]}}
    reports = {"n0": report(own={P12: [0]}, replicated=[P12]), "n1": report(held={P12: [0]})}
    point, why = memory_point(plan, reports, {"n0", "n1"}, 10)
    assert (point, why) == ({"step": 12, "generation": 0, "slots": [["n0", "n1"]] * 2}, None)
    assert memory_point(plan, reports, {"n1"}, 10)[0]["slots"] == [["n1"], ["n1"]]


def test_the_nodes_align_on_the_writers_points_only():
    """align_point names the newest point the writer replica took whole and has not yet
    replicated; the other replica's nodes, which take none, do not hold it back."""
    reports = {"n0": report(own={P12: [0], P14: [0]}, replicated=[P12]),
               "n1": report(own={P12: [1], P14: [1]}, replicated=[P12]),
               "n2": report(), "n3": report()}
    assert align_point(PLAN, reports, None, None, 0) == P14
    assert align_point(PLAN, reports, 12, None, 0) == P14
    reports["n1"]["replicated"][P14] = "b"
    reports["n0"]["replicated"][P14] = "b"
    assert align_point(PLAN, reports, 12, None, 0) is None  # confirmed by both writers


STEPS = 30


@pytest.mark.timeout(400)
def test_below_min_replicas_the_whole_job_resumes_from_the_writers_memory_snapshot(
        redis_server, procs, tmp_path):
    """Two replicas with min_replicas 2, snapshots every 2 steps, disk every 10: replica 1's
    rank is killed past step 14; too few would be left, so the job restarts, and both
    replicas resume from the newest snapshot the writer (replica 0) took, newer than the disk
    checkpoint. Replica 1's rank loads replica 0's shard: the same position, bit-equal state."""
    run = tmp_path / "run"
    job = replica_job(tmp_path, run, 2, steps=STEPS, batch_size=6, memory_every=2,
                      min_replicas=2, flaky_failures=3)
    store = start(procs, redis_server, job, nodes=2, ranks_per_node=1)
    controller = procs.procs["c1"]
    wait_stepping(procs, store, 2, 15)
    victim = store.plan()["nodes"][1]  # replica 1: it takes no snapshot
    os.kill(rank_pids(store, victim)[0], signal.SIGKILL)
    controller.wait(timeout=300)

    record = store.job_record()
    assert record["state"] == "COMPLETED", record
    assert record["generation"] == "1" and record["restarts"] == "1"
    restarting = events(store, "restarting")
    assert "supervision.min_replicas=2" in restarting[0]["message"]
    rows = metrics(run)
    resumes = [r for r in rows if r.get("event") == "resume"]
    assert len(resumes) == 1 and resumes[0]["source"] == "memory", resumes
    step = resumes[0]["step"]
    assert step > 10 and step % 2 == 0  # newer than the disk checkpoint of step 10
    # Every replica's rank loaded it (replica 1's from replica 0's shard of its position):
    # generation 1's first quorum met at that step, nobody healed.
    for rank_log in sorted((run / "logs" / "gen_0001").glob("rank_*.log")):
        assert f"ready at step {step}," in rank_log.read_text(), rank_log
    quorums = [r for r in rows if r.get("event") == "quorum"]
    assert quorums[-1]["steps"] == [step, step] and quorums[-1]["healed"] == [], quorums
    end = [r for r in rows if r.get("event") == "replicas"]
    assert end and end[-1]["members"] == [0, 1] and end[-1]["step"] == STEPS
    audit = audit_run(run)
    assert audit.ok, audit.lines()
