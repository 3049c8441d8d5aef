"""A job that shrank (no spare left, `supervision.min_nodes`) grows back when nodes are free
again: the rule (decide._grow), then end to end with a real Redis, controller, agents and gloo
ranks: a node lost with no spare, the run goes on on one node, the node's agent comes back and
is included, the run grows back to two at its next checkpoint and completes, every sample read
exactly once."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from cluster import ROOT, wait_for, write_job
from test_decide import NOW, busy, running

from controller.control.decide import RESTARTING, Settings, decide
from controller.store.store import Store
from optimus.data.audit import audit_run

S = Settings(nodes=2, ranks_per_node=1, heartbeat_interval_s=0.5, heartbeat_timeout_s=5,
             agent_timeout_s=5, stop_grace_s=30, node_counts=(2, 1))


def shrunk(**more):
    plan = {"generation": 1, "action": "run", "nodes": ["n0"], "ranks_per_node": 1,
            "world_size": 1, "resume_step": 10}
    return running(plan=plan, **{"job": busy(generation=1), "latest_step": 20,
                                 "spare_count": 1, **more})


def test_a_shrunk_generation_grows_back_once_a_node_is_free_and_its_checkpoint_committed():
    d = decide(shrunk(), S)
    assert d.plan["action"] == "stop" and d.plan["save"] is True  # saves, then stops
    assert d.job["state"] == RESTARTING and d.job["next_plan_at"] == NOW
    assert d.job["restart_causes"] == {"resize": 1} and "restarts" not in d.job
    (kind, message, fields), = [e for e in d.events if e[0] == "grow"]
    assert message == ("1 node(s) free again: generation 1 saves a checkpoint and stops, the "
                       "next runs on 2 of 2 nodes instead of 1 (the data-parallel degree grows "
                       "with them)")
    for no in (shrunk(latest_step=10),  # no checkpoint of its own yet: it would reshard from it
               shrunk(latest_step=None), shrunk(spare_count=0), shrunk(spare_count=None),
               shrunk(job=busy(generation=1, desired="pause"))):
        d = decide(no, S)
        assert not [e for e in d.events if e[0] == "grow"] and d.plan is None
    full = running(spare_count=3, latest_step=50)  # on all its nodes: nothing to grow
    assert not [e for e in decide(full, dataclasses.replace(S, ranks_per_node=2)).events
                if e[0] == "grow"]


def _optimus(*args: str, url: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controller", *args, "--job", "e2e",
                           "--redis", url], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)


def test_a_lost_node_shrinks_the_run_and_its_return_grows_it_back(redis_server, procs,
                                                                  tmp_path):
    run = tmp_path / "run"
    # Node rank 1 dies at step 15; generation 1 (one node) is paced so that the node's return
    # comes while it runs, however fast the machine.
    job = write_job(tmp_path / "job.yaml", run, steps=80, async_mode="sync", min_nodes=1,
                    faults=[{"kind": "kill_node", "node": 1, "step": 15},
                            {"kind": "slow_rank", "rank": 0, "step": 1, "seconds": 0.25,
                             "generation": 1}])
    procs.start("c1", "controller", str(job), "--nodes", "2", "--ranks-per-node", "1",
                "--redis", redis_server.url, "--exit-when-done")
    for i in range(2):
        procs.start(f"agent{i}", "agent", "--job", "e2e", "--node", f"node{i}",
                    "--redis", redis_server.url, "--interval", "0.25")
    store = Store(redis_server.url, "e2e")
    wait_for(lambda: (store.plan() or {}).get("generation", 0) >= 1
             and store.plan()["action"] == "run", 240, "generation 1")
    plan = store.plan()
    assert plan["world_size"] == 1 and "shrunk to 1 of 2 nodes" in plan["reason"]
    (lost,) = list(store.excluded())
    procs.start("agent-back", "agent", "--job", "e2e", "--node", lost,
                "--redis", redis_server.url, "--interval", "0.25")
    out = _optimus("node", "include", lost, "--yes", url=redis_server.url)
    assert out.returncode == 0, out.stderr
    wait_for(lambda: (store.plan() or {}).get("world_size") == 2, 240, "the grown generation")
    procs.procs["c1"].wait(timeout=300)
    record = store.job_record()
    assert record["state"] == "COMPLETED", record
    causes = json.loads(record["restart_causes"])
    assert causes.get("resize") == 1, causes
    events = [json.loads(t) for t in (run / "events.jsonl").read_text().splitlines()]
    (grow,) = [e for e in events if e["kind"] == "grow"]
    assert (grow["nodes"], grow["to"]) == ("1", "2")
    audit = audit_run(run)
    assert audit.ok, audit.problems
    assert audit.unread == [] and audit.skipped == []
