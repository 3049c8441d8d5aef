"""A batch template's launcher variables in the agents' environment do not steer their ranks:
the plan says where rank 0 listens, every generation (a real controller, agents and ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cluster import ROOT, wait_for, write_job

from controller.store.names import own
from controller.store.store import Store

# What a site's template exports: the allocation's first node as rank 0 (here an address no
# rank could reach: TEST-NET-1), and a rank of another launcher.
TEMPLATE = {"MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "29511", "RANK": "5",
            "WORLD_SIZE": "9", "LOCAL_RANK": "3"}


def test_master_addr_in_the_agents_environment_is_dropped_and_said_once(tmp_path):
    """Rank 0 is killed at step 6: the next generation's rank 0 is on another node, at the
    plan's address; a rank that took MASTER_ADDR would have waited on 192.0.2.1 from the
    first generation on."""
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", run, steps=12,
                    faults=[{"kind": "kill_rank", "rank": 0, "step": 6}])
    out = subprocess.run([sys.executable, "-m", "controller", "run", str(job), "--nodes", "2",
                          "--ranks-per-node", "1", "--spares", "1"], cwd=ROOT,
                         env={**os.environ, **TEMPLATE, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    journal = json.loads((run / "controller.json").read_text())
    assert journal["job"]["state"] == "COMPLETED" and journal["job"]["restarts"] == "1"
    assert len(journal["excluded"]) == 1  # rank 0's node of generation 0
    logs = sorted((run / "control").glob("agent-*.log"))
    assert len(logs) == 3
    for log in logs:
        said = [line for line in log.read_text().splitlines()
                if "do not inherit" in line]
        assert len(said) == 1, (log.name, said)
        assert "LOCAL_RANK, MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE" in said[0]


def test_an_agent_advertises_the_address_it_is_given(redis_server, procs):
    """`--host` (or OPTIMUS_HOST): the address other hosts reach the node at, in its record
    (what the controller plans rank 0's rendezvous at), instead of its hostname."""
    procs.start("agent-a", "agent", "--job", "e2e", "--node", "node-a", "--redis",
                redis_server.url, "--interval", "0.25", "--host", "10.231.0.11")
    procs.start("agent-b", "agent", "--job", "e2e", "--node", "node-b", "--redis",
                redis_server.url, "--interval", "0.25", env={"OPTIMUS_HOST": "fd00::b"})
    store = Store(redis_server.url, "e2e")

    def host(node: str) -> str | None:  # the node's own record, as the controller mirrors it
        raw = store.r.get(store.k(own(node, "info")))
        return json.loads(raw)["host"] if raw else None

    wait_for(lambda: host("node-a") and host("node-b"), 60, "both agents registered")
    assert (host("node-a"), host("node-b")) == ("10.231.0.11", "fd00::b")


def test_an_address_that_is_neither_a_hostname_nor_an_ip_is_refused_in_one_line():
    for bad in ("node a", "10.0.0.1;reboot", "-x", "a..b", "$(id)"):
        out = subprocess.run([sys.executable, "-m", "controller", "agent", "--job", "j",
                              "--node", "n", "--host", bad], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, env={**os.environ, "REDIS_URL": ""})
        assert out.returncode == 2, (bad, out.stderr)
        lines = [line for line in out.stderr.splitlines() if "Invalid value" in line]
        assert len(lines) == 1 and "neither a hostname" in lines[0], (bad, out.stderr)
        assert "Traceback" not in out.stderr
