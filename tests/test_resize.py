"""A job that shrank (no spare left, `supervision.when_no_spare: shrink`) grows back when nodes
are free again: the rule (decide._grow), then end to end with a real Redis, controller, agents
and gloo ranks: a node lost with no spare, the run goes on on one node, the node's agent comes
back and is included, the run grows back to two at its next checkpoint and completes, every
sample read exactly once; and a pipeline that cannot stay on the nodes left goes on on the
planner's layout, exactly as a plain run of that layout from the same checkpoint. The rules
of re-planning: tests/test_replan.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from cluster import ROOT, metrics, train_ranks, wait_for, write_job
from test_decide import NOW, busy, running

from controller.control.decide import RESTARTING, Settings, decide
from controller.store.store import Store
from optimus.checkpoint.manifest import step_dir
from optimus.config import apply_override
from optimus.data.audit import audit_run

S = Settings(nodes=2, ranks_per_node=1, heartbeat_interval_s=0.5, heartbeat_timeout_s=5,
             agent_timeout_s=5, stop_grace_s=30, node_counts=(2, 1),
             launch={"job_file": "/jobs/x.yaml", "log_dir": "/runs/x/logs"})


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


def _start(procs, url: str, job: Path, nodes: int) -> Store:
    """A controller of `nodes` nodes of one rank, and their agents (no spare)."""
    procs.start("c1", "controller", str(job), "--nodes", str(nodes), "--ranks-per-node", "1",
                "--redis", url, "--exit-when-done")
    for i in range(nodes):
        procs.start(f"agent{i}", "agent", "--job", "e2e", "--node", f"node{i}",
                    "--redis", url, "--interval", "0.25")
    return Store(url, "e2e")


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
    store = _start(procs, redis_server.url, job, 2)
    wait_for(lambda: (store.plan() or {}).get("generation", 0) >= 1
             and store.plan()["action"] == "run", 240, "generation 1")
    plan = store.plan()
    assert plan["world_size"] == 1 and "shrunk to 1 of 2 nodes" in plan["reason"]
    (lost,) = list(store.excluded())
    procs.start("agent-back", "agent", "--job", "e2e", "--node", lost,
                "--redis", redis_server.url, "--interval", "0.25")
    # Lost, back and healthy, the node returns to the spares by itself (flap forgiveness,
    # controller/control/forgive.py); an operator's include may come first, or find it done.
    out = _optimus("node", "include", lost, "--yes", url=redis_server.url)
    assert out.returncode == 0 or "is not excluded" in out.stderr, out.stderr
    wait_for(lambda: lost not in store.excluded(), 60, f"{lost} back among the spares")
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


def test_a_pipeline_that_cannot_stay_on_the_nodes_left_is_replanned_and_trains_exactly(
        redis_server, procs, tmp_path):
    """3 nodes, no spare, pp 3: a node lost at step 15 leaves 2, where pp 3 cannot run. The
    controller asks the planner and goes on from the checkpoint of step 10 on its layout (the
    job waits for no one); from there, losses and samples equal a plain run that had that
    layout from the same checkpoint."""
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", run, steps=24, async_mode="sync", min_nodes=2,
                    batch_size=6, faults=[{"kind": "kill_node", "node": 2, "step": 15}])
    raw = yaml.safe_load(job.read_text())
    raw["model"]["n_layers"] = 6
    raw["parallel"].update({"pp": 3, "schedule": "1f1b"})
    raw["data"]["microbatches"] = 3
    job.write_text(yaml.safe_dump(raw))
    store = _start(procs, redis_server.url, job, 3)
    procs.procs["c1"].wait(timeout=600)
    record = store.job_record()
    assert record["state"] == "COMPLETED", record
    plan = store.plan()
    assert plan["generation"] == 1 and plan["world_size"] == 2 and plan["resume_step"] == 10
    assert ".pp3." not in plan["layout"]
    replanned = plan["overrides"]
    events = [json.loads(t) for t in (run / "events.jsonl").read_text().splitlines()]
    (shrunk,) = [e for e in events if e["kind"] == "generation" and e.get("layout")]
    assert (shrunk["layout"], shrunk["nodes"]) == (plan["layout"], "2")
    assert f"shrunk to 2 of 3 nodes: the planner's layout {plan['layout']} instead of " in (
        shrunk["message"])
    assert shrunk["full_layout"].startswith("tp1.pp3.dp1.1f1b")
    # The two survivors' ranks waited in process, but a re-planned layout is a new job file's
    # worth of overrides: each node's launch says its ranks started as new processes, and why.
    relaunched = [e for e in events if e["kind"] == "launch" and e["message"].startswith(
        "generation 1:")]
    assert len(relaunched) == 2 and all(
        e.get("restart") == "process" and e["in_process"] in (0, "0")
        and "re-planned layout" in e["message"] for e in relaunched), relaunched

    # The reference: a plain run with the re-planned layout from the same checkpoint (its
    # run's key beside it, so that it is trusted), on two local ranks.
    ref = tmp_path / "ref"
    (ref / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "secrets", ref / "secrets")
    shutil.copytree(step_dir(run / "checkpoints", 10), step_dir(ref / "checkpoints", 10))
    for assignment in replanned:
        apply_override(raw, assignment)
    raw.update({"run_dir": str(ref), "fault_injection": {"faults": []}})
    (tmp_path / "ref.yaml").write_text(yaml.safe_dump(raw))
    train_ranks(tmp_path / "ref.yaml", 2, timeout=300)

    def after_resume(where: Path) -> dict:
        lines = {m["step"]: m for m in metrics(where) if "loss" in m and m["step"] > 10}
        return {s: (m["loss"], m["data"]) for s, m in sorted(lines.items())}

    ours, theirs = after_resume(run), after_resume(ref)
    assert list(ours) == list(range(11, 25)) and ours == theirs
    audit = audit_run(run)
    assert audit.ok, audit.problems
    assert audit.unread == [] and audit.skipped == []
