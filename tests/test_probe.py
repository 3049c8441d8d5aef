"""controller/common/probe.py: what a connection to a silent agent's snapshot server says about
its node, with real sockets (a listening one, a closed port, a listener that never accepts), and
the detect rule that names a node lost on it before agent_timeout_s.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

import yaml
from cluster import wait_for, write_job

from controller.common.probe import (
    FAILS_NEEDED,
    NO_ANSWER,
    NO_ROUTE,
    REFUSED,
    Prober,
    describe,
    parse_address,
    probe,
)
from controller.control.controller import Controller
from controller.control.detect import HARD, Evidence, evidence
from controller.control.settings import settings_for
from controller.control.view import Observed, Overdue, Settings
from controller.store.store import Store
from optimus.config import validate_job

NOW = 1000.0
# agent_silence_s = 2 x 0.5 = 1.0 s; agent_timeout_s = 5 s.
S = Settings(nodes=2, ranks_per_node=1, heartbeat_interval_s=0.5, agent_timeout_s=5,
             launch={"job_file": "/jobs/x.yaml", "log_dir": "/runs/x/logs"})
PLAN = {"generation": 1, "nodes": ["n0", "n1"], "ranks_per_node": 1}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_addresses_are_parsed_strictly():
    assert parse_address("node3:4100") == ("node3", 4100)
    assert parse_address("[::1]:80") == ("::1", 80)
    assert parse_address("10.0.0.5:65535") == ("10.0.0.5", 65535)
    for bad in ("", "node3", "node3:", ":80", "node3:0", "node3:65536", "node3:-1", "a b:80",
                "user@host:80", "host/x:80", "x" * 400 + ":80", None, 4100, ["h", 1]):
        assert parse_address(bad) is None, bad


def test_a_listening_port_answers_a_closed_one_refuses():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        assert probe("127.0.0.1", server.getsockname()[1]) is None
    assert probe("127.0.0.1", _closed_port()) == REFUSED
    assert probe("no-such-host.invalid", 80) == NO_ROUTE


def test_a_stopped_process_s_port_still_answers(tmp_path):
    """The kernel completes the handshake for a stopped process: a frozen or starved agent is
    reachable, never lost by this rule."""
    child = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(8)\n"
        "print(s.getsockname()[1], flush=True); time.sleep(60)")], stdout=subprocess.PIPE,
        text=True)
    try:
        port = int(child.stdout.readline())
        os.kill(child.pid, signal.SIGSTOP)
        assert probe("127.0.0.1", port) is None
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert probe("127.0.0.1", port) == REFUSED
    finally:
        child.kill()
        child.wait()


def test_a_silent_node_is_unreachable_at_its_first_refusal_once_it_was_reached():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    addr = f"127.0.0.1:{server.getsockname()[1]}"
    prober = Prober()
    prober.watch({"n0": addr, "n1": "garbage"})
    # Reached in the background while nobody is silent.
    for _ in range(40):
        prober.unreachable({})
        if ("127.0.0.1", server.getsockname()[1]) in prober.reached:
            break
        time.sleep(0.05)
    assert prober.reached == {("127.0.0.1", server.getsockname()[1])}
    server.close()  # the agent is gone: its port closed
    found = {}
    deadline = time.monotonic() + 10
    while not found and time.monotonic() < deadline:
        found = prober.unreachable({"n0": addr, "n1": "garbage"})
        time.sleep(0.05)
    assert found == {"n0": describe(REFUSED)}  # n1's address is no address: never probed
    assert prober._nodes["n0"].fails == 1  # the host's own word: nothing listens there
    # It beats again: its count starts afresh.
    assert prober.unreachable({}) == {} and "n0" not in prober._nodes
    prober.close()


def test_failures_of_a_node_never_reached_say_nothing():
    """A firewall that keeps the controller from every agent looks like dead hosts: only an
    address that answered once can be judged by its silence."""
    calls = []

    def refused(host, port, timeout_s):
        calls.append((host, port))
        return REFUSED

    prober = Prober(connect=refused)
    prober.watch({"n0": "h0:1", "n1": "h1:1"})
    for _ in range(30):
        assert prober.unreachable({"n0": "h0:1"}) == {}
        time.sleep(0.04)
    assert calls.count(("h0", 1)) >= FAILS_NEEDED  # probed at PROBE_EVERY_S while silent
    assert 1 <= calls.count(("h1", 1)) <= 2  # the baseline: once per BASELINE_EVERY_S
    prober.close()


def test_one_failed_probe_is_not_enough_and_a_success_resets_the_count():
    outcomes = iter([None, NO_ANSWER, None, NO_ANSWER, NO_ANSWER])

    def scripted(host, port, timeout_s):
        return next(outcomes)

    prober = Prober(connect=scripted)
    prober.watch({"n0": "h0:1"})
    seen = []
    for _ in range(80):
        found = prober.unreachable({"n0": "h0:1"} if prober.reached else {})
        seen.append(found)
        if found:
            break
        time.sleep(0.05)
    # baseline reached it; then no answer, an answer, no answer twice: unreachable.
    assert found == {"n0": describe(NO_ANSWER)}
    assert not any(seen[:-1])
    prober.close()


def _observed(**fields) -> Observed:
    more = {"agent_beats": {"n0": NOW - 0.2, "n1": NOW - 0.2}, **fields}
    return Observed(now=NOW, job=more.pop("job", None), plan=PLAN, nodes={}, **more)


def test_an_unreachable_silent_node_is_lost_before_the_agent_timeout():
    why = describe(REFUSED)
    found = evidence(_observed(agent_beats={"n0": NOW - 0.2, "n1": NOW - 1.5},
                               unreachable={"n1": why}), S)
    assert found == [Evidence("n1", f"node n1 lost: its agent has been silent for 1.5 s and "
                              f"{why}", HARD, NOW - 1.5, "node_lost")]
    # Within agent_silence_s the agent is on time, whatever a probe said.
    assert evidence(_observed(agent_beats={"n0": NOW - 0.2, "n1": NOW - 1.0},
                              unreachable={"n1": why}), S) == []
    # A silent agent whose host answers is left to the timeout (and an overdue rank).
    assert evidence(_observed(agent_beats={"n0": NOW - 0.2, "n1": NOW - 4.9}), S) == []
    late = Overdue("n1", 1, "no heartbeat for 6.0 s", since=NOW - 6)
    lost, = evidence(_observed(agent_beats={"n0": NOW - 0.2, "n1": NOW - 1.5}, overdue=[late]),
                     S)
    assert lost.what == "node n1 lost: its agent has been silent for 1.5 s"
    # Past the timeout the timeout says it: the probe adds nothing.
    lost, = evidence(_observed(agent_beats={"n0": NOW - 0.2, "n1": NOW - 5.5},
                               unreachable={"n1": why}), S)
    assert lost.what == "node n1 lost: its agent has been silent for 5.5 s"


def test_each_outcome_says_what_it_means():
    assert describe(REFUSED) == "its host refused a connection to it (the agent is gone)"
    assert describe(NO_ANSWER, 1.5) == "its host did not answer a connection within 1.5 s"
    assert describe(NO_ROUTE) == "its host cannot be reached"


def test_a_silent_node_whose_host_refuses_is_lost_and_the_next_plan_does_not_wait_for_it(
        redis_server, tmp_path):
    """The controller itself, on a real Redis with real listening sockets for the agents'
    snapshot servers: it reaches the two nodes and the spare in the background; n1's agent
    and the spare's fall silent and their ports close (their processes died): n1 is excluded
    as lost on the refusal, long before the (here 300 s) agent timeout; the next generation
    is planned without waiting for n1's ranks, which its stale status still counts as running,
    and without the dead spare, which the timeout still counts as alive: the job waits."""
    raw = yaml.safe_load(write_job(tmp_path / "job.yaml", tmp_path / "run", name="j").read_text())
    config = validate_job(raw, world=2)
    settings = dataclasses.replace(
        settings_for(config, str(tmp_path / "job.yaml"), [], 2, 1), agent_timeout_s=300.0,
        heartbeat_timeout_s=300.0)
    servers = {}
    store = Store(redis_server.url, "j")
    for name in ("n0", "n1", "n2"):
        servers[name] = socket.socket()
        servers[name].bind(("127.0.0.1", 0))
        servers[name].listen(8)
        store.own.register_node(name, {"host": name, "health": "ok",
                                   "snapshot_addr": f"127.0.0.1:{servers[name].getsockname()[1]}"})
    ctl = Controller(store, config, settings, ident="c")
    try:
        def running(*nodes, ranks: int = 1):
            for n in nodes:
                store.own.agent_tick(n, {"state": "running", "generation": 0, "live_ranks": ranks},
                                 {}, None, False)
            ctl.tick()
            return store.job_record().get("state")

        wait_for(lambda: running("n0", "n1") == "RUNNING", 30, "generation 0 running")
        assert store.plan()["nodes"] == ["n0", "n1"]  # n2 is the spare
        wait_for(lambda: running("n0", "n1") and len(ctl.observer.prober.reached) == 3, 30,
                 "the three agents reached once")
        for name in ("n1", "n2"):  # gone: they beat no more, their ports are closed
            servers[name].close()
        wait_for(lambda: running("n0") and "n1" in store.excluded(), 60, "n1 lost")
        reason = store.excluded()["n1"]["reason"]
        assert reason.startswith("node n1 lost: its agent has been silent for ")
        assert reason.endswith("and its host refused a connection to it (the agent is gone)")
        # No spare left and the job waits for its nodes: it says so at once, not after n1's
        # stale status (generation 0, a live rank) or n2's last beat has outlived
        # agent_timeout_s.
        # n0's rank left the stopped generation.
        wait_for(lambda: running("n0", ranks=0) == "WAITING", 60, "the next plan's verdict")
        assert store.plan()["generation"] == 0 and store.plan()["action"] == "stop"
    finally:
        ctl.release()
        for s in servers.values():
            s.close()
