"""Wakes (controller/store/wake.py) on a real redis-server: a listener cut short by a publish,
many wakes answered by one look, a poke, and the fallbacks that keep a loop polling when the
channel cannot be had (an ACL from before wakes, Redis gone). The deadlines here are the
listener's whole interval (30 s): a woken wait returns True, a wait that times out returns
False, whatever the machine's load; no test measures how fast."""

from __future__ import annotations

import threading
import time

import redis
from records import exit_record, run_plan

from controller.store import wake
from controller.store.acl import create_node_users
from controller.store.store import Store

LONG_S = 30.0  # a listener's interval in these tests: no wait that returns True ran it out


def test_a_publish_cuts_the_wait_short(redis_server):
    store = Store(redis_server.url, "j")
    waker = wake.Waker(store, wake.AGENTS)
    assert waker.wait(0.2) is False  # nothing came: slept the interval (and subscribed)
    timer = threading.Timer(0.3, wake.publish, (store, wake.AGENTS))
    timer.start()
    try:
        assert waker.wait(LONG_S) is True
    finally:
        timer.cancel()
        waker.close()


def test_many_wakes_are_one_look_and_another_channel_wakes_nobody(redis_server):
    store = Store(redis_server.url, "j")
    waker = wake.Waker(store, wake.AGENTS)
    waker.wait(0)  # subscribed
    other = Store(redis_server.url, "k")  # another job's agents' channel
    wake.publish(other, wake.AGENTS)
    wake.publish(store, wake.CONTROLLER)  # the controller's channel, not the agents'
    for _ in range(5):
        wake.publish(store, wake.AGENTS)
    assert waker.wait(LONG_S) is True
    # The five are answered by that one look; on a loaded machine Redis may not have flushed
    # the last of them to the socket when the look drained it: at most one more look then.
    assert waker.wait(0.3) is False or waker.wait(0.3) is False
    waker.close()


def test_a_poke_looks_again_soon_without_a_wake(redis_server):
    waker = wake.Waker(Store(redis_server.url, "j"), wake.CONTROLLER)
    waker.poke()
    assert waker.wait(LONG_S) is True
    assert waker.wait(0.2) is False  # a poke is spent by one wait
    waker.close()


def test_a_set_plan_a_control_word_an_exit_and_a_port_wake_who_reads_them(redis_server):
    store = Store(redis_server.url, "j")
    agents = wake.Waker(store, wake.AGENTS)
    controller = wake.Waker(store, wake.CONTROLLER)
    agents.wait(0)
    controller.wait(0)
    store.set_plan(run_plan(1, ["node0"], issued=1.0))
    assert agents.wait(LONG_S) is True
    store.set_control({"pause": True})
    assert agents.wait(LONG_S) is True
    node = Store(redis_server.url, "j")
    node.own.speak_as("node0")
    node.own.report_exit(exit_record("node0", 0))
    assert controller.wait(LONG_S) is True
    node.own.set_master_port(1, 29500)
    assert controller.wait(LONG_S) is True
    assert agents.wait(0.2) is False  # a node's writes wake the controller, not the agents
    agents.close()
    controller.close()


def test_a_node_user_hears_its_agents_channel_and_wakes_the_controller_only(redis_server):
    admin = redis.Redis(port=redis_server.port)
    create_node_users(admin, "j", {"node0": "pw0"})
    url = f"redis://optimus-node-node0:pw0@127.0.0.1:{redis_server.port}/0"
    node = Store(url, "j")
    controller = wake.Waker(Store(redis_server.url, "j"), wake.CONTROLLER)
    listening = wake.Waker(node, wake.AGENTS)
    controller.wait(0)
    listening.wait(0)
    wake.publish(node, wake.CONTROLLER)
    assert controller.wait(LONG_S) is True
    wake.publish(node, wake.AGENTS)  # refused by the ACL: a node cannot wake every agent
    wake.publish(Store(redis_server.url, "j"), wake.AGENTS)
    assert listening.wait(LONG_S) is True
    assert listening.wait(0.2) is False  # only the controller's wake came
    # A node cannot listen in on the controller's channel: that waker falls back to polling.
    spying = wake.Waker(node, wake.CONTROLLER)
    assert spying.wait(0.2) is False and spying._refused
    for publisher in (node, Store(redis_server.url, "j")):
        wake.publish(publisher, wake.CONTROLLER)
    assert spying.wait(0.2) is False  # still polling: no error, no wake
    for w in (controller, listening, spying):
        w.close()


def test_without_the_channel_in_its_acl_a_loop_polls_as_before(redis_server, caplog):
    """An ACL file written before wakes: the agent warns once and sleeps its interval."""
    admin = redis.Redis(port=redis_server.port)
    admin.execute_command("ACL", "SETUSER", "old", "on", ">pw", "~optimus:*", "resetchannels",
                          "+@all")
    store = Store(f"redis://old:pw@127.0.0.1:{redis_server.port}/0", "j")
    waker = wake.Waker(store, wake.AGENTS)
    with caplog.at_level("WARNING", logger="optimus.wake"):
        assert waker.wait(0.2) is False
        assert waker.wait(0.2) is False
    warnings = [r.message for r in caplog.records if "cannot subscribe" in r.message]
    assert len(warnings) == 1 and "docs/security.md" in warnings[0]
    store.set_plan(run_plan(1, ["node0"], issued=1.0))  # its publish refused
    assert store.plan()["generation"] == 1  # and the plan written all the same


def test_redis_gone_mid_wait_is_a_plain_sleep(redis_server):
    store = Store(redis_server.url, "j", retry_s=0.5)
    waker = wake.Waker(store, wake.AGENTS)
    waker.wait(0)
    redis_server.kill()
    started = time.monotonic()
    assert waker.wait(0.3) is False  # no exception: the loop goes on polling
    assert time.monotonic() - started >= 0.3  # and it did sleep (no busy loop)
    assert waker.wait(0.1) is False  # not retried before RETRY_S
    wake.publish(store, wake.AGENTS)  # a publish into the void is no error either
    waker.close()


def test_an_agent_follows_a_new_plan_at_once_not_at_its_next_tick(redis_server, tmp_path,
                                                                  monkeypatch, socket_dir):
    """An agent ticking every 30 s takes a plan set after its first tick within that interval:
    only the plan's wake can have made it look (it then exits: the plan ends the job), and the
    controller hears its state change the same way."""
    from controller.node.agent import Agent

    monkeypatch.setenv("OPTIMUS_WARM_START", "0")
    store = Store(redis_server.url, "j")
    controller = wake.Waker(store, wake.CONTROLLER)
    controller.wait(0)
    agent = Agent(Store(redis_server.url, "j"), "n0", interval_s=LONG_S,
                  socket_dir=str(socket_dir), snapshot_root=tmp_path / "snap")
    agent.ranks.end_seen = None  # as an agent that saw the job run: it leaves at the end
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + LONG_S / 2
    while not store.agent_status(["n0"]).get("n0") and time.monotonic() < deadline:
        time.sleep(0.05)  # its first tick: status written
    assert store.agent_status(["n0"]).get("n0"), "the agent's first tick"
    assert controller.wait(LONG_S) is True  # its first state, told
    store.set_plan({"generation": 0, "action": "end", "nodes": [], "issued": time.time(),
                    "grace_s": 1.0})
    thread.join(LONG_S * 0.8)  # before its next tick would have come
    assert not thread.is_alive(), "the agent did not take the plan before its next tick"
    controller.close()


def test_a_flood_of_wakes_makes_a_look_every_min_gap_not_a_busy_loop(redis_server):
    """A node's password may publish on wake:controller: a flood of them is a look every
    MIN_GAP_S at most, and each wait returns (the drain is bounded)."""
    store = Store(redis_server.url, "j")
    waker = wake.Waker(store, wake.CONTROLLER)
    waker.wait(0)
    flooding = threading.Event()

    def flood() -> None:
        node = Store(redis_server.url, "j")
        while not flooding.is_set():
            pipe = node.r.pipeline(transaction=False)
            for _ in range(200):
                pipe.publish(node.k(wake.CONTROLLER), b"")
            pipe.execute()
    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        assert all(waker.wait(LONG_S) for _ in range(10))
        assert time.monotonic() - started >= 9 * wake.MIN_GAP_S
    finally:
        flooding.set()
        thread.join(10)
        waker.close()


def test_a_ranks_exit_cuts_the_agents_wait_short_once(redis_server):
    """The agent waits on its ranks' pidfds beside the channel (controller/node/ranks.py
    `ExitWatch`): a rank's death ends the wait (True, well inside the interval); a death not
    yet reaped wakes it once more at most, then waits on the cadence, not in a spin."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from controller.node.ranks import ExitWatch

    waker = wake.Waker(Store(redis_server.url, "j"), wake.AGENTS)
    watch = ExitWatch()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    rank = SimpleNamespace(popen=SimpleNamespace(pid=child.pid, returncode=None))
    try:
        assert len(watch.fds([rank])) == 1
        assert waker.wait(0.05, watch.fds([rank])) is False  # alive: the interval runs out
        threading.Timer(0.2, child.kill).start()
        assert waker.wait(LONG_S, watch.fds([rank])) is True  # its death, not the 30 s
        child.wait()  # reaped, but the agent has not seen its status yet
        assert waker.wait(LONG_S, watch.fds([rank])) is True  # once more: it ends at once
        assert watch.fds([rank]) == []  # then spent: the agent's cadence finds it
        rank.popen.returncode = -9
        assert watch.fds([rank]) == []
    finally:
        child.kill()
        child.wait()
        watch.close()
        waker.close()


def test_a_paced_listener_spends_no_more_than_half_its_time_on_wakes(redis_server):
    """The controller's waker is paced (nodes may publish on its channel): after a look that
    took 0.3 s, a wake makes the next look come 0.3 s on at the soonest, not MIN_GAP_S."""
    store = Store(redis_server.url, "j")
    waker = wake.Waker(store, wake.CONTROLLER, paced=True)
    try:
        waker.wait(0)
        time.sleep(0.3)  # the look
        wake.publish(store, wake.CONTROLLER)
        started = time.monotonic()
        assert waker.wait(LONG_S) is True
        assert time.monotonic() - started >= 0.29  # a sleep returns no sooner than asked
    finally:
        waker.close()
