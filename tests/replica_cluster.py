"""The parts the control-plane tests of replicas that carry on share (tests/test_replica_*.py):
the job, the controller and agents started on a real redis-server, and what they read back."""

from __future__ import annotations

import json
from pathlib import Path

from controller.store.store import Store
from tests.cluster import wait_for, write_job

# Paced steps (a sleep, not the machine's speed), so that a fault lands mid-run: rank 0 of each
# replica's world is every replica's.
PACE = [{"kind": "slow_rank", "rank": 0, "step": 0, "seconds": 0.25, "generation": 0}]


def replica_job(tmp_path: Path, run: Path, replicas: int, **options) -> Path:
    """The tiny job of tests/cluster.py as `replicas` replicas that carry on, paced."""
    options.setdefault("faults", PACE)
    options.setdefault("hang_floor_s", 60.0)
    job = write_job(tmp_path / "job.yaml", run, on_replica_loss="continue", **options)
    job.write_text(job.read_text().replace("parallel:\n  ep: 1",
                                           f"parallel:\n  ep: 1\n  replicas: {replicas}"))
    return job


def start(procs, redis_server, job: Path, *, nodes: int, ranks_per_node: int,
          agents: int | None = None) -> Store:
    """The controller (c1) and an agent per node (node0, node1, ...; `agents` of them)."""
    procs.start("c1", "controller", str(job), "--nodes", str(nodes), "--ranks-per-node",
                str(ranks_per_node), "--redis", redis_server.url, "--exit-when-done",
                "--lease", "2", "--id", "c1")
    for i in range(nodes if agents is None else agents):
        procs.start(f"agent{i}", "agent", "--job", "e2e", "--node", f"node{i}", "--redis",
                    redis_server.url, "--interval", "0.25")
    return Store(redis_server.url, "e2e")


def events(store: Store, kind: str) -> list[dict]:
    return [e for _, e in store.events(count=10_000) if e["kind"] == kind]


def rank_pids(store: Store, node: str) -> list[int]:
    """The PIDs of `node`'s ranks, by local rank, as its agent last said."""
    raw = store.agent_status([node]).get(node, {}).get("pids") or "[]"
    return json.loads(raw) if raw.startswith("[") else []


def step_of(store: Store, node: str, ranks: int = 1) -> int:
    """The least step `node`'s `ranks` ranks have reached (-1 until each has beaten)."""
    beats = store.rank_beats(node)
    return min((b["step"] for b in beats.values()), default=-1) if len(beats) >= ranks else -1


def wait_stepping(procs, store: Store, nodes: int, step: int, ranks: int = 1) -> None:
    """Until every node's ranks have reached `step` (the controller still running)."""
    controller = procs.procs["c1"]

    def stepping() -> bool:
        assert controller.poll() is None, procs.log("c1")[-2000:]
        return bool(store.plan()) and min(step_of(store, f"node{i}", ranks)
                                          for i in range(nodes)) >= step

    wait_for(stepping, 240, f"every replica to reach step {step}")
