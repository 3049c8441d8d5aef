"""Recovery from in-memory snapshots under the whole control plane: a real redis-server, the
controller, agents (each holding its node's snapshots in shared memory and a buddy's copy) and
gloo ranks; faults are real SIGKILLs, of a rank, of a node's agent with its ranks, and of a node
together with the node holding its copy (then the job falls back to disk, saying why).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from cluster import ROOT, Processes, RedisServer, metrics, relay, wait_for, write_job

from controller.store.store import Store
from optimus.data.audit import audit_run

STEPS = 30
FAULT_STEP = 15
EVERY = 2


def _events(run: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    return [e for e in rows if e.get("kind") == kind]


def _resumes(run: Path) -> list[dict]:
    return [m for m in metrics(run) if m.get("event") == "resume"]


def _last_step_before_restart(run: Path) -> int:
    rows = metrics(run)
    first_resume = next(i for i, m in enumerate(rows) if m.get("event") == "resume")
    return max(m["step"] for m in rows[:first_resume] if "loss" in m)


def _exactly_once(run: Path) -> None:
    audit = audit_run(run)  # every sample of the run read exactly once, across the restart
    assert audit.ok, audit.problems
    assert (audit.steps, audit.generations, audit.end) == (STEPS, 2, STEPS * 8)


def test_a_killed_rank_resumes_from_the_memory_snapshot(tmp_path):
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", run, steps=STEPS, memory_every=EVERY,
                    faults=[{"kind": "kill_rank", "rank": 1, "step": FAULT_STEP}])
    out = subprocess.run([sys.executable, "-m", "controller", "run", str(job), "--nodes", "2",
                          "--ranks-per-node", "1", "--spares", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    (resume,) = _resumes(run)
    assert resume["source"] == "memory", (resume, _events(run, "generation"))
    # The rank dies as it starts FAULT_STEP. Lost: the steps since the newest snapshot that had
    # reached its buddy; how many more intervals than one depends on how far replication had
    # come beside training (one more on a quiet machine, more under a CPU hog).
    assert EVERY <= resume["step"] < FAULT_STEP, resume
    assert resume["step"] % EVERY == 0
    assert re.search(rf"generation 1 on .* from the memory snapshot of step {resume['step']}",
                     out.stdout), out.stdout
    assert "nothing read from disk" in resume["message"]
    _exactly_once(run)


def _start(tmp_path: Path, redis_server: RedisServer, procs: Processes) -> tuple[Path, Store]:
    """Four agents register first, then the controller plans generation 0 on two of them: each
    node's buddy is then a spare (node0 -> node2, node1 -> node3)."""
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", run, steps=STEPS, memory_every=EVERY)
    store = Store(redis_server.url, "e2e")
    for i in range(4):
        procs.start(f"agent{i}", "agent", "--job", "e2e", "--node", f"node{i}", "--redis",
                    redis_server.url, "--interval", "0.25")
    # Relayed as the controller would (it starts after): the records are the nodes' own.
    wait_for(lambda: relay(store) is not None and len(store.nodes()) == 4, 60,
             "four agents to register")
    procs.start("controller", "controller", str(job), "--nodes", "2", "--ranks-per-node", "1",
                "--redis", redis_server.url, "--exit-when-done")
    wait_for(lambda: (store.plan() or {}).get("generation") == 0, 60, "generation 0")
    plan = store.plan()
    assert plan["nodes"] == ["node0", "node1"]
    assert {n: b["node"] for n, b in plan["buddies"].items()} == {"node0": "node2",
                                                                  "node1": "node3"}
    return run, store


def _rank0_step(store: Store) -> int:
    beat = store.rank_beats("node0").get(0)
    return beat["step"] if beat else -1


def _kill_nodes(store: Store, *nodes: str) -> None:
    for node in nodes:
        store.push_command(node, {"kind": "kill_node", "time": time.time(), "by": "test"})


def test_a_lost_node_is_replaced_by_its_buddy_which_holds_its_shards(tmp_path, redis_server,
                                                                     procs):
    run, store = _start(tmp_path, redis_server, procs)
    wait_for(lambda: _rank0_step(store) >= FAULT_STEP, 300, f"step {FAULT_STEP}")
    _kill_nodes(store, "node1")
    procs.procs["controller"].wait(timeout=180)
    assert store.job_record()["state"] == "COMPLETED"
    plan = store.plan()
    assert plan["nodes"] == ["node0", "node3"]  # the buddy took the lost node's place
    (resume,) = _resumes(run)
    assert resume["source"] == "memory"
    last = _last_step_before_restart(run)  # the last step generation 0 finished
    # The point the controller chose, and no newer than what was trained. How near to `last`
    # depends on how far replication had come beside training (a point counts once its copy
    # is on the buddy: under a CPU hog step 14's, with 16 and 18 trained): memory_point's
    # rules are tested on their own (tests/test_recovery_rules.py).
    assert resume["step"] == plan["resume_step"], (resume, plan["resume_step"])
    assert EVERY <= resume["step"] <= last, (last, resume)
    # node3 loaded node1's shards from its own memory: nothing fetched, nothing read from disk.
    assert not [e for e in _events(run, "snapshot") if "fetch" in e["message"]]
    _exactly_once(run)


def test_a_node_lost_with_its_buddy_falls_back_to_disk_and_says_why(tmp_path, redis_server,
                                                                    procs):
    run, store = _start(tmp_path, redis_server, procs)
    wait_for(lambda: _rank0_step(store) >= FAULT_STEP, 300, f"step {FAULT_STEP}")
    # node1's copy is on node3, a spare: node3 dies first, then node1 at once. (Both commands
    # together, node1 could be found lost before node3's agent had read its own: node3, alive
    # then, replaced it with the copy, as it should.) The dead spare is not chosen: its agent
    # is silent and its host refuses a connection (probe.py), though it is within the agent
    # timeout still.
    _kill_nodes(store, "node3")
    wait_for(lambda: procs.procs["agent3"].poll() is not None, 60, "node3's agent to die")
    _kill_nodes(store, "node1")
    procs.procs["controller"].wait(timeout=180)
    assert store.job_record()["state"] == "COMPLETED"
    (generation,) = [e["message"] for e in _events(run, "generation")
                     if e["message"].startswith("generation 1 ")]
    # Both are right, whichever the load decides: the newest snapshot's copies were still in
    # flight when the nodes went, or it was held and is lost with node1 and node3.
    found = re.search(r"from the checkpoint of step (\d+) \(memory snapshot not used: (the "
                      r"memory snapshot of step \d+ is lost: node node1 and the node holding its "
                      r"copy \(node3\) are both gone|no snapshot newer than the disk checkpoint "
                      r"is complete on every rank and replicated \(the newest taken: step "
                      r"\d+\))\)", generation)
    assert found, generation
    disk = int(found.group(1))  # 10, or 20 on a machine slow enough to commit it before the kill
    (resume,) = _resumes(run)
    assert resume["source"] == "disk" and resume["step"] == disk and disk % 10 == 0
    _exactly_once(run)
