"""A lost replica's own survivors stay in process (supervision.on_replica_loss: continue), under
the control plane: real redis-server, controller, agents and ranks; two replicas of one node
with two ranks each (the model sharded inside a replica). A rank of one replica is killed: the
other replica trains on; the killed rank's peer in its replica leaves that launch on the lost
peer's error and becomes a rank of the replica's next launch in the same process, beside a new
process in the killed one's place; the replica is healed back in and ends bit-equal."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from controller.node import replica_worlds
from controller.node.ranks import RankProcess
from optimus.contract.records import Plan
from optimus.data.audit import audit_run
from tests.cluster import metrics
from tests.replica_cluster import events, rank_pids, replica_job, start, wait_stepping

STEPS = 40
pytestmark = pytest.mark.timeout(400)


# (0, 0, kill): the writer replica's rank 0 (it hosts its world's store and the quorum's) is
# SIGKILLed, its rank 1 survives; (1, 1, freeze): replica 1's rank 1 is SIGSTOPped (its heartbeat
# falls overdue; its agent kills it at once, which frees its peer blocked in a collective with
# it), its rank 0 survives.
@pytest.mark.parametrize(("victim", "position", "fault"), [(0, 0, "kill"), (1, 1, "freeze")])
def test_a_lost_replicas_other_ranks_go_on_in_process_into_its_next_launch(
        victim, position, fault, redis_server, procs, tmp_path):
    run = tmp_path / "run"
    job = replica_job(tmp_path, run, 2, steps=STEPS, batch_size=8, min_replicas=1,
                      flaky_failures=3)
    store = start(procs, redis_server, job, nodes=2, ranks_per_node=2)
    controller = procs.procs["c1"]
    wait_stepping(procs, store, 2, 5, ranks=2)
    nodes = store.plan()["nodes"]
    lost, other = nodes[victim], nodes[1 - victim]
    pids = rank_pids(store, lost)
    others = rank_pids(store, other)
    assert len(pids) == 2
    os.kill(pids[position], signal.SIGSTOP if fault == "freeze" else signal.SIGKILL)
    controller.wait(timeout=300)

    record = store.job_record()
    assert record["state"] == "COMPLETED", record
    assert record["generation"] == "0" and record["restarts"] == "1"
    assert [(e["replica"], e["members"]) for e in events(store, "replica_lost")] == [
        (str(victim), f"[{1 - victim}]")]
    assert [e["replicas"] for e in events(store, "replica_rejoined")] == [f"[{victim}]"]
    launches = {n: [e for e in events(store, "launch") if n in e.get("message", "")]
                for n in nodes}
    assert len(launches[other]) == 1 and launches[other][0]["pids"] == ",".join(map(str, others))
    first, again = launches[lost]
    assert first["pids"] == ",".join(map(str, pids))
    relaunched = [int(p) for p in again["pids"].split(",")]
    survivor = 1 - position
    assert again["in_process"] == "1", again  # the survivor, not a new process
    assert relaunched[survivor] == pids[survivor]
    assert relaunched[position] != pids[position]
    assert "(1 of them in process) (replica" in again["message"]

    rows = metrics(run)
    assert [r["step"] for r in rows if "loss" in r and "event" not in r] == list(
        range(1, STEPS + 1))
    quorums = [r for r in rows if r.get("event") == "quorum"]
    assert quorums[-1]["members"] == [0, 1] and quorums[-1]["healed"] == [victim]
    end = [r for r in rows if r.get("event") == "replicas"]
    assert end and end[-1]["members"] == [0, 1] and end[-1]["step"] == STEPS
    audit = audit_run(run)
    assert audit.ok, audit.lines()
    assert audit.absent and all(out == [victim] for _, out in audit.absent)


def _plan(culprit: dict | None) -> Plan:
    return Plan.parse({
        "version": 1, "generation": 0, "action": "run", "nodes": ["n0", "n1"],
        "ranks_per_node": 3, "world_size": 6, "master_addr": "h0", "master_port": 4000,
        "job_file": "/j.yaml", "log_dir": "/l", "culprit": culprit,
        "replicas": {"addrs": ["h0", "h1"], "ports": [4000, 4100], "launches": [0, 1],
                     "after": [0, 2]},
        "quorum": {"version": 1, "id": 2, "members": [0], "store_addr": "h0",
                   "store_port": 4000}})


def _ranks() -> list[RankProcess]:
    return [RankProcess(3 + i, i, SimpleNamespace(pid=100 + i, returncode=None), Path("/x"),
                        0.0) for i in range(3)]


def test_a_relaunch_kills_its_culprit_at_once_and_waits_a_bound_for_the_others(monkeypatch):
    """The agent's side, one node of the relaunched replica 1: the culprit the plan names is
    killed at once; the others, still running, are waited for until they leave the launch in
    process (or die), at most LEAVE_LAUNCH_S; then the relaunch goes on."""
    procs, killed = _ranks(), []

    def kill(p):
        p.kill_sent = True
        killed.append(p.rank)

    survivors = replica_worlds.Survivors()
    plan = _plan({"node": "n1", "rank": 4})
    assert not survivors.gone(procs, plan, "n1", kill)  # ranks 3 and 5 still run
    assert killed == [4]
    procs[0].left = 0  # rank 3 left the launch: it waits in process
    assert not survivors.gone(procs, plan, "n1", kill)
    procs[2].popen.returncode = 1  # rank 5 exited
    assert survivors.gone(procs, plan, "n1", kill)
    assert killed == [4]  # nobody else was killed
    # A culprit on another node, or a node's fault here (rank None: every rank of it).
    procs = _ranks()
    assert not replica_worlds.Survivors().gone(procs, _plan({"node": "n0", "rank": 0}), "n1",
                                               kill)
    assert replica_worlds.Survivors().gone(procs, _plan({"node": "n1", "rank": None}), "n1",
                                           kill)
    # No rank leaves: the bound passes, and the relaunch goes on (it kills them).
    procs, survivors = _ranks(), replica_worlds.Survivors()
    assert not survivors.gone(procs, _plan(None), "n1", kill)
    later = time.monotonic() + replica_worlds.LEAVE_LAUNCH_S + 1
    monkeypatch.setattr(replica_worlds.time, "monotonic", lambda: later)
    assert survivors.gone(procs, _plan(None), "n1", kill)
