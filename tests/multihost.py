"""What tests/test_multihost.py and tests/test_multihost_faults.py share: starting a job on
simulated hosts (tests/hosts.py), watching it and stopping it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
from cluster import metrics_so_far, wait_for
from hosts import Hosts, same_host

from controller.store.names import own

ENDLESS = 1_000_000  # steps: a job that runs until the test has seen enough, then is stopped


def events(run: Path, kind: str | None = None) -> list[dict]:
    rows = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    return [e for e in rows if kind is None or e.get("kind") == kind]


def live_events(store, kind: str) -> list[dict]:
    return [e for _, e in store.events(count=100_000) if e.get("kind") == kind]


def rank0_step(store, plan: dict) -> int:
    """The step rank 0's heartbeat says (relayed by the controller), -1 before any."""
    beat = store.rank_beats(plan["nodes"][0]).get(0)
    return beat["step"] if beat else -1


def start(h: Hosts, job: Path, nodes: list[str], plan_nodes: int, **agent_kwargs) -> None:
    """Agents first, all registered, then the controller: generation 0 runs on the first
    `plan_nodes` of them in name order, the others are spares."""
    store = h.store("e2e")  # write_job's name
    for node in nodes:
        h.start_agent(node, **agent_kwargs)
    wait_for(lambda: all(registered(store, n) for n in nodes) or agent_died(h, nodes), 60,
             f"{nodes} to register")
    assert not agent_died(h, nodes), {n: h.log(f"agent-{n}")[-2000:] for n in nodes}
    h.start_controller(job, nodes=plan_nodes)


def trains(run: Path, store) -> bool:
    """Whether the plan's generation has launched whole and trains: rank 0 logged a step
    since that generation's start (a stop asked while a generation launches waits out the
    stop's grace for a rank held in a rendezvous whose rank 0 never comes)."""
    generation = (store.plan() or {}).get("generation", 0)
    rows = metrics_so_far(run)
    start = max((i for i, m in enumerate(rows) if m.get("event") == "start"
                 and m.get("generation") == generation), default=None if generation else -1)
    return start is not None and any("loss" in m for m in rows[start + 1:])


def registered(store, node: str) -> bool:
    """Whether `node`'s agent has written its record (under its own keys: the controller, not
    started yet, relays it)."""
    return bool(store.r.exists(store.k(own(node, "info"))))


def agent_died(h: Hosts, nodes: list[str]) -> bool:
    return any(h.procs[f"agent-{n}"].poll() is not None for n in nodes)


def finished(h: Hosts, timeout: float, controller: str = "controller") -> None:
    """Until `controller` has exited (--exit-when-done: the job ended), which it did cleanly."""
    proc = h.procs[controller]
    wait_for(lambda: proc.poll() is not None, timeout, f"{controller} to exit (the job to end)")
    assert proc.returncode == 0, h.log(controller)[-4000:]


def ranks_in_their_hosts(h: Hosts, store, plan: dict) -> None:
    """Every rank of `plan` runs in its agent's host (network, hostname, /etc/hosts): forked
    by a warm process that joined them (tests/hosts.py), never in the test's namespace."""
    for node in plan["nodes"]:
        (launch,) = [e for e in live_events(store, "launch") if e.get("node") == node
                     and e["message"].startswith(f"generation {plan['generation']}:")]
        agent = h.procs[f"agent-{node}"].pid
        for pid in map(int, launch["pids"].split(",")):
            assert same_host(pid, agent), (node, pid)
            assert not same_host(pid, os.getpid()), (node, pid)
            if h.warm_server:  # a fork of a warm process the server forked: imports saved
                assert psutil.Process(pid).parent().ppid() == h.warm_server.pid, (node, pid)


def stop(h: Hosts, store, run: Path, controller: str = "controller") -> None:
    """Once the running generation trains, ask the job to stop (the ranks agree on a step,
    save and exit) and wait for the end."""
    wait_for(lambda: trains(run, store), 120, "the running generation to train")
    store.request("stop", "test", "test", reason="the test has seen what it came for")
    finished(h, 240, controller)


def steps(run: Path) -> int:
    return max((m["step"] for m in metrics_so_far(run) if "loss" in m), default=0)


def cut_for(h: Hosts, run: Path, host: str, net: str, seconds: float) -> list[int]:
    """Cut `host` off `net` for `seconds`; the last step logged, second by second meanwhile."""
    h.cut(host, net)
    trace, cut_at = [steps(run)], time.monotonic()
    while time.monotonic() - cut_at < seconds:
        time.sleep(min(1.0, seconds - (time.monotonic() - cut_at)))
        trace.append(steps(run))
    h.heal(host, net)
    return trace


def generation(store, g: int, timeout: float = 60) -> dict:
    """The plan of generation `g`, once it is the store's."""
    return wait_for(lambda: (p := store.plan()) and p.get("generation") == g and p, timeout,
                    f"generation {g}")
