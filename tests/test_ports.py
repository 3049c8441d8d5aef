"""The rendezvous port a node's agent holds and offers before a plan asks (controller/node/
ports.py): the kernel gives it to no one else while held, rank 0's store listens on it all the
same, the controller puts node 0's offer into the plan (every node launches at once), and a
port a node wrote is read as a port or as none. And the ports picked for a server that binds
later (optimus/supervision/ports.py: DCP's writers' store, `optimus run`'s Redis, an agent
without an offer, the tests' ranks): below the kernel's ephemeral range."""

from __future__ import annotations

import dataclasses
import random
import socket
import subprocess
import sys

import pytest
from multiproc import ephemeral_start, free_port
from test_decide import NOW, S, node, running_plan

from controller.cli.run import LocalCluster, start_redis
from controller.control import records
from controller.control.decide import RESTARTING, JobView, Observed, decide
from controller.node.ports import PortOffer
from optimus.supervision import ports

STORE = """
import datetime, sys
import torch.distributed as dist
for libuv in (True, False):
    store = dist.TCPStore("0.0.0.0", int(sys.argv[1]), 1, True, use_libuv=libuv,
                          timeout=datetime.timedelta(seconds=30))
    store.set("k", "v")
    assert store.get("k") == b"v"
    del store
print("listened")
"""


def test_an_offered_port_is_no_one_elses_and_rank_0s_store_listens_on_it():
    offer = PortOffer()
    try:
        port = offer.port
        assert 1024 <= port < 65_536
        taken = []
        try:  # what the kernel hands out meanwhile: binds to port 0, outgoing connections
            with socket.socket() as server:
                server.bind(("127.0.0.1", 0))
                server.listen(512)
                for _ in range(100):  # under any somaxconn (128 on older kernels)
                    s = socket.socket()
                    s.bind(("", 0))
                    taken.append(s)
                    c = socket.create_connection(server.getsockname(), timeout=10)
                    taken.append(c)
                    assert port not in (s.getsockname()[1], c.getsockname()[1])
        finally:
            for s in taken:
                s.close()
        # Another process (rank 0) listens on it while this one still holds it: torch's
        # store, with and without libuv.
        out = subprocess.run([sys.executable, "-c", STORE, str(port)], capture_output=True,
                             text=True, timeout=120)
        assert out.stdout.strip() == "listened", out.stderr[-2000:]
        # A socket without SO_REUSEADDR cannot take it.
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(("", port))
    finally:
        offer.close()


def test_a_taken_port_stays_held_until_the_next_is_taken():
    offer = PortOffer()
    try:
        first = offer.port
        assert offer.take() == first  # a plan without a port: the offered one, now
        second = offer.port
        assert second not in (0, first)
        assert offer.take(second) == second  # the plan carried the offer
        third = offer.port
        assert third not in (0, first, second)
        with socket.socket() as s:  # the first is free again, the second still held
            s.bind(("", first))
            with pytest.raises(OSError), socket.socket() as t:
                t.bind(("", second))
        # A plan carrying a port this agent no longer offers (it restarted since): that port,
        # and the offer stays.
        assert offer.take(40_000) == 40_000 and offer.port == third
    finally:
        offer.close()
    assert offer.port == 0


def _plan(nodes, plan=None):
    restarting = JobView(state=RESTARTING, generation=0, restarts=1, next_plan_at=NOW - 1)
    obs = Observed(now=NOW, job=restarting if plan else JobView(), plan=plan, nodes=nodes,
                   latest_step=10 if plan else None)
    return decide(obs, S).plan


def test_the_plan_carries_node_0s_offer_unless_the_last_plan_took_it():
    nodes = {"n0": dataclasses.replace(node("n0"), next_port=41_000),
             "n1": dataclasses.replace(node("n1"), next_port=42_000)}
    first = _plan(nodes)
    assert (first["nodes"], first["master_port"]) == (["n0", "n1"], 41_000)
    ended = {**running_plan(), "action": "stop", "master_port": 41_000}
    again = _plan(nodes, ended)  # n0's status not renewed since: the relay picks one
    assert (again["generation"], again["master_port"]) == (1, 0)
    renewed = {**nodes, "n0": dataclasses.replace(nodes["n0"], next_port=43_000)}
    assert _plan(renewed, ended)["master_port"] == 43_000
    no_offer = {**nodes, "n0": dataclasses.replace(nodes["n0"], next_port=0)}
    assert _plan(no_offer)["master_port"] == 0  # n1's offer is not node 0's


@pytest.mark.parametrize("raw, port", [
    ("29500", 29500), ("1024", 1024), ("65535", 65535), ("1023", 0), ("65536", 0), ("0", 0),
    ("", 0), (None, 0), ("-1", 0), ("2.5e4", 0), ("２９５００", 0), ("029500", 0),
    (" 29500", 0), ("9" * 5000, 0)])
def test_a_port_an_agent_wrote_is_a_port_or_none(raw, port):
    assert records.port(raw) == port


def test_an_unclaimed_port_is_below_the_ephemeral_range_free_and_else_the_kernels(
        monkeypatch, tmp_path):
    """A port picked by bind(0) and closed comes from the range the kernel takes outgoing
    connections' local ports from: a server binding it a moment (or, after a spawn's imports,
    seconds) later could find it taken by any connection of the host meanwhile."""
    first = ephemeral_start()
    picked = [ports.unclaimed_port() for _ in range(50)]
    assert all(ports._LOWEST <= p < first for p in picked), picked
    assert len(set(picked)) == len(picked), picked  # none handed out twice in a row
    loopback = ports.unclaimed_port("127.0.0.1")
    assert ports._LOWEST <= loopback < first
    given, free = ports.unclaimed_port(), ports.unclaimed_port()
    ports._recent.remove(free)  # as if handed out long ago
    with socket.socket() as taken:  # passed over: a port in use, and one handed out lately
        taken.bind(("", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy, given, free])
        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(picks))
        assert ports.unclaimed_port() == free
    monkeypatch.undo()
    # A range that leaves no room below it: the kernel picks.
    (tmp_path / "range").write_text("20500\t65535\n")
    monkeypatch.setattr(ports, "_EPHEMERAL", tmp_path / "range")
    assert ports.unclaimed_port() >= first
    # An unreadable range: Linux's default start (32768) is assumed.
    monkeypatch.setattr(ports, "_EPHEMERAL", tmp_path / "missing")
    assert ports._LOWEST <= ports.unclaimed_port() < 32768


def test_servers_that_bind_later_get_an_unclaimed_port(tmp_path):
    """`optimus run`'s Redis, an agent whose plan carried no port and held no offer, the tests'
    rank 0 store: each binds a port picked before it, so each takes one below the range."""
    first = ephemeral_start()
    cluster = LocalCluster(tmp_path)
    try:
        url = start_redis(cluster)
    finally:
        cluster.stop_all()
    redis_port = int(url.rsplit(":", 1)[1].split("/")[0])
    assert ports._LOWEST <= redis_port < first, url
    offer = PortOffer()
    offer.close()  # holds nothing (no port could be held): take() falls back to a pick
    try:
        assert ports._LOWEST <= offer.take() < first
    finally:
        offer.close()
    assert ports._LOWEST <= free_port() < first
