"""Replicas that carry on, under the control plane (supervision.on_replica_loss: continue): real
redis-server, controller, agents and ranks, three replicas of one node each. A rank killed or
frozen in one replica takes only that replica out: the others keep their processes and step
on in the same generation, the lost one is relaunched, let back in once it waits and healed
from a peer; the run ends with every replica's state equal bit for bit, every step logged
once, and the samples the absent replica did not train accounted for."""

from __future__ import annotations

import os
import signal

import pytest

from controller.store.store import Store
from optimus.data.audit import audit_run
from tests.cluster import metrics, wait_for, write_job
from tests.replica_cluster import events, rank_pids, step_of

STEPS = 60
pytestmark = pytest.mark.timeout(400)


# kill: the writer's rank SIGKILLed; freeze: SIGSTOPped (its heartbeat falls overdue); again:
# killed, then its relaunched rank killed once it is let back in (during or right after its
# heal); failover: killed, then the leading controller killed while the replica is out (a
# standby controller lets it back in); spare: killed, its node excluded (flaky_failures 1) with
# no spare free, so the replica waits out of the quorum until a spare's agent starts.
@pytest.mark.parametrize("fault", ["kill", "freeze", "again", "failover", "spare"])
def test_a_lost_replica_leaves_the_others_stepping_and_rejoins_healed(fault, redis_server,
                                                                        procs, tmp_path):
    run = tmp_path / "run"
    # Paced steps (a sleep, not the machine's speed), so the fault lands mid-run; rank 0 of
    # each replica's world is every replica's rank (each world is one rank).
    pace = [{"kind": "slow_rank", "rank": 0, "step": 0, "seconds": 0.25, "generation": 0}]
    total = STEPS * 2 if fault == "spare" else STEPS  # time for a spare's agent to start
    job = write_job(tmp_path / "job.yaml", run, steps=total, faults=pace, batch_size=6,
                    on_replica_loss="continue", min_replicas=2,
                    # the node is kept (its replica restarts on it), but for `spare`
                    flaky_failures=1 if fault == "spare" else 3,
                    hang_floor_s=60.0)
    text = job.read_text().replace("parallel:\n  ep: 1", "parallel:\n  ep: 1\n  replicas: 3")
    job.write_text(text)
    common = ["controller", str(job), "--nodes", "3", "--ranks-per-node", "1", "--redis",
              redis_server.url, "--exit-when-done", "--lease", "2"]
    procs.start("c1", *common, "--id", "c1")
    store = Store(redis_server.url, "e2e")
    if fault == "failover":
        wait_for(lambda: store.fence.leader() == "c1", 30, "c1 to lead")
        procs.start("c2", *common, "--id", "c2")
    for i in range(3):
        procs.start(f"agent{i}", "agent", "--job", "e2e", "--node", f"node{i}", "--redis",
                    redis_server.url, "--interval", "0.25")
    controller = procs.procs["c1"]

    def stepping() -> bool:
        assert controller.poll() is None, procs.log("c1")[-2000:]
        return bool(store.plan()) and min(step_of(store, f"node{i}") for i in range(3)) >= 5

    wait_for(stepping, 180, "every replica to reach step 5")
    plan = store.plan()
    victim = plan["nodes"][0]  # replica 0: the writer, and the host of the quorum's store
    survivors = {n: rank_pids(store, n) for n in plan["nodes"][1:]}
    pid = rank_pids(store, victim)[0]
    os.kill(pid, signal.SIGSTOP if fault == "freeze" else signal.SIGKILL)
    if fault == "failover":
        wait_for(lambda: events(store, "replica_lost"), 60, "replica 0 to leave")
        controller.kill()
        controller = procs.procs["c2"]
        wait_for(lambda: store.fence.leader() == "c2", 30, "c2 to take over")
    if fault == "spare":
        wait_for(lambda: events(store, "replica_lost"), 60, "replica 0 to leave")
        assert list(store.excluded()) == [victim]
        procs.start("agent3", "agent", "--job", "e2e", "--node", "node3", "--redis",
                    redis_server.url, "--interval", "0.25")
    if fault == "again":
        wait_for(lambda: events(store, "replica_rejoined"), 60, "replica 0 to be let in")
        relaunched = rank_pids(store, victim)
        assert relaunched and relaunched[0] != pid
        os.kill(relaunched[0], signal.SIGKILL)

    controller.wait(timeout=300)
    twice = 2 if fault == "again" else 1
    record = store.job_record()
    assert record["state"] == "COMPLETED", record
    assert record["generation"] == "0" and record["restarts"] == str(twice)  # nobody else
    for node, pids in survivors.items():  # the survivors' processes are the ones launched
        launches = [e for e in events(store, "launch") if e.get("node") == node
                    or node in e.get("message", "")]
        assert len(launches) == 1 and launches[0]["pids"] == ",".join(map(str, pids))
    lost = events(store, "replica_lost")
    assert [(e["replica"], e["members"]) for e in lost] == [("0", "[1, 2]")] * twice, lost
    assert [e["replicas"] for e in events(store, "replica_rejoined")] == ["[0]"] * twice
    failure = events(store, "failure")[0]
    assert failure["node"] == victim and failure["excluded"] == ("1" if fault == "spare" else "0")
    if fault == "spare":  # replica 0 started again on the spare, in node0's slot
        assert store.plan()["nodes"] == ["node3", "node1", "node2"]
        assert [e["spares"] for e in events(store, "replica_spare")] == ['["node3"]']
    if fault == "failover":
        assert [e["controller"] for e in events(store, "leader")] == ["c1", "c2"]

    rows = metrics(run)
    steps = [r["step"] for r in rows if "loss" in r and "event" not in r]
    assert steps == list(range(1, total + 1))  # every step logged once, by whoever wrote
    # a relaunched replica reads no checkpoint, and logs nothing before it is let in
    assert not [r for r in rows if r.get("event") == "resume"]
    quorums = [r for r in rows if r.get("event") == "quorum"]
    assert quorums[-1]["members"] == [0, 1, 2] and quorums[-1]["healed"] == [0]
    # (a relaunched rank killed before its quorum met leaves a `quorum_missed`, no heal)
    assert quorums[-1]["source"] in (1, 2)
    end = [r for r in rows if r.get("event") == "replicas"]
    assert end and end[-1]["members"] == [0, 1, 2] and end[-1]["step"] == total
    audit = audit_run(run)
    assert audit.ok, audit.lines()
    assert audit.absent and all(out == [0] for _, out in audit.absent)  # replica 0's slices
    # the writer was lost: replica 1 wrote the steps it had not, from its own figures
    caught = [r for r in rows if r.get("event") == "metrics_caught_up"]
    assert all(r["lost"] == 0 for r in caught)


def test_an_operators_exclusion_takes_only_that_replica_out_onto_the_spare(redis_server, procs,
                                                                            tmp_path):
    """`optimus node exclude` on a node of replica 0 while it trains, a spare registered: only
    replica 0 leaves, relaunched on the spare in the node's slot and healed back in; the other
    replicas keep their processes; nothing failed, so no restart is counted."""
    run = tmp_path / "run"
    pace = [{"kind": "slow_rank", "rank": 0, "step": 0, "seconds": 0.25, "generation": 0}]
    job = write_job(tmp_path / "job.yaml", run, steps=STEPS, faults=pace, batch_size=6,
                    on_replica_loss="continue", min_replicas=2, hang_floor_s=60.0)
    job.write_text(job.read_text().replace("parallel:\n  ep: 1",
                                           "parallel:\n  ep: 1\n  replicas: 3"))
    procs.start("c1", "controller", str(job), "--nodes", "3", "--ranks-per-node", "1",
                "--redis", redis_server.url, "--exit-when-done", "--lease", "2")
    store = Store(redis_server.url, "e2e")
    for i in range(4):  # node3: the spare
        procs.start(f"agent{i}", "agent", "--job", "e2e", "--node", f"node{i}", "--redis",
                    redis_server.url, "--interval", "0.25")
    wait_for(lambda: bool(store.plan()) and min(step_of(store, n) for n in store.plan()["nodes"])
             >= 5, 180, "every replica to reach step 5")
    plan = store.plan()
    victim, survivors = plan["nodes"][0], {n: rank_pids(store, n) for n in plan["nodes"][1:]}
    spare = ({"node0", "node1", "node2", "node3"} - set(plan["nodes"])).pop()
    said = procs.start("exclude", "node", "exclude", victim, "--job", "e2e", "--yes",
                       "--reason", "memory errors", env={"REDIS_URL": redis_server.url})
    assert said.wait(60) == 0, procs.log("exclude")
    procs.procs["c1"].wait(timeout=300)
    record = store.job_record()
    assert record["state"] == "COMPLETED", record
    assert record["generation"] == "0" and record["restarts"] == "0"  # not a failure
    assert not events(store, "failure") and not events(store, "restarting")
    lost = events(store, "replica_lost")
    assert [(e["replica"], e["members"]) for e in lost] == [("0", "[1, 2]")]
    assert f"node {victim} excluded by an operator (" in lost[0]["message"]
    assert "memory errors" in lost[0]["message"]
    assert lost[0]["spares"] == f'["{spare}"]' and lost[0]["waiting"] == "[]"  # at once
    assert store.plan()["nodes"] == [spare, *plan["nodes"][1:]]
    for node, pids in survivors.items():
        launches = [e for e in events(store, "launch") if e.get("node") == node
                    or node in e.get("message", "")]
        assert len(launches) == 1 and launches[0]["pids"] == ",".join(map(str, pids))
    rows = metrics(run)
    assert [r["step"] for r in rows if "loss" in r and "event" not in r] == list(
        range(1, STEPS + 1))
    quorums = [r for r in rows if r.get("event") == "quorum"]
    assert quorums[-1]["members"] == [0, 1, 2] and quorums[-1]["healed"] == [0]
    end = [r for r in rows if r.get("event") == "replicas"]
    assert end and end[-1]["members"] == [0, 1, 2] and end[-1]["step"] == STEPS
    audit = audit_run(run)
    assert audit.ok, audit.lines()
