"""A flap is not a death sentence (controller/control/forgive.py): a node the controller excluded
as lost goes back to the spares once its agent beats again, none of its ranks runs and it
passed a health check after the exclusion, unless it was lost `lost_limit` times within
`lost_window_s`. Operators' exclusions and bad tiles' are never lifted. The rule through
`decide`; the observer's reading of the exclusion records; the agent's check once its ranks
left; and one run with real processes: a node stopped (SIGSTOP) until it is declared lost, then
let go, is a spare again while the job goes on, and the job completes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from dataclasses import replace

from cluster import relay, wait_for, write_job
from test_check_ahead import _generation_ran, node  # noqa: F401 (node: a fixture)
from test_decide import NOW, S, busy

from controller.control import records
from controller.control.decide import NodeView, Observed, Request, decide
from controller.control.forgive import back
from controller.control.observe import Observer
from controller.store.own import as_text
from controller.store.store import Store, StoreUnavailable
from controller.store.summaries import Sweep

LOST_AT = NOW - 30.0
REASON = "node n1 lost: its agent has been silent for 4.1 s"


def returned(**fields) -> NodeView:
    """n1, excluded as lost at LOST_AT and back: its agent beats, no rank of it runs, and it
    passed a health check 20 s after the exclusion."""
    return replace(NodeView(name="n1", host="host-n1", alive=True, healthy=True,
                            excluded=REASON, excluded_at=LOST_AT, checked_at=LOST_AT + 20,
                            last_beat=NOW - 0.2), **fields)


def observed(n1: NodeView | None = None, losses: dict | None = None, now: float = NOW,
             **more) -> Observed:
    """Generation 1 runs on n0 and n2 (the spare took lost n1's place)."""
    plan = {"generation": 1, "action": "run", "nodes": ["n0", "n2"], "ranks_per_node": 2,
            "world_size": 4}
    job = busy(generation=1, progress_gen=1, progress_at=now, losses=losses or {})
    return Observed(now=now, job=job, plan=plan, nodes={}, latest_step=40,
                    agent_beats={"n0": now - 0.1, "n2": now - 0.1},
                    excluded=more.pop("excluded", {"n1": REASON}),
                    lost=more.pop("lost", {"n1": n1 or returned()}), **more)


def _said(d, kind: str) -> list[tuple[str, dict]]:
    return [(message, fields) for k, message, fields in d.events if k == kind]


def test_a_node_lost_once_back_and_well_is_a_spare_again_with_an_event():
    d = decide(observed(), S)
    assert d.include == ["n1"]
    ((message, fields),) = _said(d, "forgiven")
    assert message == ("node n1 back among the spares: excluded as lost 30.0 s ago, its agent "
                       "beats again, none of its ranks runs and it passed a health check 10.0 s "
                       "ago; lost 1 of 3 times within 3600 s")
    assert (fields["node"], fields["losses"], fields["lost_limit"]) == ("n1", 1, 3)
    assert d.job["losses"] == {"n1": [LOST_AT]}  # counted, for its next loss and a next leader


def test_no_check_since_the_exclusion_no_return_yet():
    for unchecked in (returned(checked_at=LOST_AT - 60), returned(checked_at=LOST_AT),
                      returned(checked_at=None)):
        d = decide(observed(unchecked), S)
        assert d.include == [] and d.events == []
        assert d.job["losses"] == {"n1": [LOST_AT]}  # the loss is counted all the same
    d = decide(observed(returned(checked_at=LOST_AT - 60), losses={"n1": [LOST_AT]}), S)
    assert d.include == [] and "losses" not in d.job  # counted once
    d = decide(observed(returned(), losses={"n1": [LOST_AT]}), S)  # its check came
    assert d.include == ["n1"] and "losses" not in d.job


def test_live_ranks_a_silent_agent_or_a_failed_check_keep_it_out_for_now():
    for not_yet in (returned(live_ranks=1), returned(silent=True), returned(alive=False),
                    returned(healthy=False, health="n1/0: wrong")):
        assert not back(not_yet)
        d = decide(observed(not_yet, losses={"n1": [LOST_AT]}), S)
        assert d.include == [] and d.events == [] and d.job == {}, not_yet


def test_lost_limit_times_within_the_window_it_stays_out_said_once():
    before = {"n1": [LOST_AT - 2000, LOST_AT - 1000]}
    d = decide(observed(losses=before), S)
    assert d.include == []
    ((message, fields),) = _said(d, "not_forgiven")
    assert message.startswith("node n1 stays excluded: lost 3 times within 3600 s "
                              "(supervision.lost_limit=3)")
    assert "optimus node include n1" in message and fields["losses"] == 3
    assert len(d.events) == 1
    counted = d.job["losses"]
    assert counted == {"n1": [LOST_AT - 2000, LOST_AT - 1000, LOST_AT]}
    # Not said again; and however long it stays away, it stays out (its earlier losses are
    # kept while this exclusion lasts, though they left the window of now).
    for now in (NOW + 1, NOW + 7200):
        d = decide(observed(losses=counted, now=now), S)
        assert d.include == [] and d.events == [] and d.job == {}


def test_losses_older_than_the_window_do_not_count():
    old = {"n1": [LOST_AT - 5000, LOST_AT - 3601]}
    d = decide(observed(losses=old), S)
    assert d.include == ["n1"] and "lost 1 of 3 times" in _said(d, "forgiven")[0][0]
    assert d.job["losses"] == {"n1": [LOST_AT]}  # and leave the record
    d = decide(observed(losses={"n1": [LOST_AT - 3600]}), replace(S, lost_limit=2))
    assert d.include == [] and _said(d, "not_forgiven")  # 3600 s before: within the window


def test_the_record_keeps_what_counts_for_an_exclusion_in_force_and_drops_the_rest():
    """Written when a loss is counted: every node's losses within the window of now, and
    those of a node kept out within the window of its exclusion, however old."""
    later = NOW + 7200
    kept_out = returned(excluded_at=LOST_AT)
    n3 = returned(name="n3", excluded_at=later - 10, checked_at=later - 1)
    losses = {"n1": [LOST_AT - 2000, LOST_AT - 1000, LOST_AT], "n4": [LOST_AT],
              "n5": [later - 3600]}  # n4, n5: forgiven before
    d = decide(observed(losses=losses, now=later, excluded={"n1": REASON, "n3": REASON},
                        lost={"n1": kept_out, "n3": n3}), S)
    assert d.include == ["n3"]  # the one kept out stays so
    assert d.job["losses"] == {"n1": [LOST_AT - 2000, LOST_AT - 1000, LOST_AT],
                               "n3": [later - 10], "n5": [later - 3600]}


def test_each_lost_node_is_judged_on_its_own_and_an_operators_include_comes_first():
    """An operator's include of a lost node in the same tick is the operator's (one include,
    one event, the loss not counted); a node not back yet holds up no other."""
    n3 = returned(name="n3")
    asked = Request(id="5-0", action="include", actor="ana", host="desk", node="n1",
                    reason="mended")
    lost = {"n1": returned(), "n3": n3}
    d = decide(observed(excluded={"n1": REASON, "n3": REASON}, lost=lost, requests=[asked],
                        known_nodes=frozenset({"n0", "n1", "n2", "n3"})), S)
    assert d.include == ["n1", "n3"] and [k for k, *_ in d.events] == ["include", "forgiven"]
    assert d.job["losses"] == {"n3": [LOST_AT]}
    lost = {"n1": returned(live_ranks=1), "n3": n3}
    d = decide(observed(excluded={"n1": REASON, "n3": REASON}, lost=lost), S)
    assert d.include == ["n3"] and d.job["losses"] == {"n1": [LOST_AT], "n3": [LOST_AT]}


def test_the_count_survives_a_failover_in_the_job_record():
    d = decide(observed(), S)
    record = {"state": "RUNNING", "generation": "1", "losses": as_text(d.job["losses"])}
    job = records.job_view(record)  # as a new leader reads it
    assert job.losses == {"n1": [LOST_AT]}
    second = returned(excluded_at=NOW + 100, checked_at=NOW + 110)
    d = decide(observed(second, losses=job.losses, now=NOW + 120), S)
    assert d.include == ["n1"] and "lost 2 of 3 times" in _said(d, "forgiven")[0][0]
    # What is no list of times reads as none (the rule does arithmetic on them).
    garbled = records.job_view({"losses": json.dumps({"n1": ["x", 5.0, None], "n2": "no"})})
    assert garbled.losses == {"n1": [5.0]}


class _Summaries:
    """The summary rows the observer sweeps: each agent's last beat."""

    def __init__(self, beats):
        self.beats = beats

    def sweep(self, nodes, ranks_per_node=1):
        return Sweep(agent_beats={n: self.beats.get(n) for n in nodes}, max_step=None,
                     min_step=None, nonfinite=[], unhealthy=[])


class _Agents:
    """What the observer reads of the nodes' agents (node_info, agent_status, sweep)."""

    trouble_at = 0.0

    def __init__(self, names):
        self.info = {n: {"host": f"host-{n}", "health": "ok", "health_detail": "",
                         "ok_at": NOW - 1} for n in names}
        self.status = {n: {"state": "idle", "live_ranks": "0"} for n in names}
        self.beats = {n: NOW - 0.1 for n in names}
        self.summaries = _Summaries(self.beats)

    def node_info(self, nodes):
        return {n: self.info[n] for n in nodes if n in self.info}

    def agent_status(self, nodes):
        return {n: self.status[n] for n in nodes if n in self.status}


def test_an_operators_exclusion_and_a_bad_tiles_are_never_lifted():
    """Only the controller's exclusions of lost nodes say so (`cause`: node_lost): an
    operator's, a bad tile's and a record from before causes were written are not read as
    lost, so they are never included, however well their nodes are."""
    entries = {  # as Store.exclude writes them
        "n1": {"reason": REASON, "by": "controller c1", "time": LOST_AT, "mode": "exclude",
               "cause": "node_lost"},
        "n2": {"reason": "bad tile n2/0: fixed-seed matmul gave 1.0", "by": "controller c1",
               "time": LOST_AT, "mode": "exclude", "cause": "bad_tile"},
        "n3": {"reason": "ECC errors", "by": "ana@desk", "host": "desk", "time": LOST_AT,
               "mode": "exclude"},
        "n4": {"reason": "restored", "by": "?", "time": LOST_AT, "mode": "exclude"},
    }
    agents = _Agents(entries)
    observer = Observer(agents, S, None, None)
    try:
        lost = observer._lost(entries, NOW)
        assert list(lost) == ["n1"] and back(lost["n1"])
        assert (lost["n1"].excluded_at, lost["n1"].checked_at) == (LOST_AT, NOW - 1)
        excluded = {n: e["reason"] for n, e in entries.items()}
        d = decide(observed(excluded=excluded, lost=lost), S)
        assert d.include == ["n1"]
        agents.status["n1"]["live_ranks"] = "1"  # its ranks of the old generation still run
        v = observer._lost(entries, NOW)["n1"]
        assert (v.live_ranks, v.silent, v.healthy) == (1, False, True) and not back(v)
        agents.status["n1"]["live_ranks"] = "0"
        agents.beats["n1"] = NOW - 3.0  # its agent missed beats: its records are not read
        v = observer._lost(entries, NOW)["n1"]
        assert (v.silent, v.alive, v.healthy, v.checked_at) == (True, True, False, None)
        assert not back(v)
    finally:
        observer.close()


def test_the_agent_publishes_a_pass_once_its_ranks_left_again_if_redis_refused(
        node):  # noqa: F811 (test_check_ahead's fixture: the agent's checks, faked)
    """The check ahead after a generation's end (its agent back from an outage, the ranks of
    the generation that went on without it killed) is published: the controller's proof that
    the node passed a check after its return. Quietly, and again at the next tick if Redis
    did not take it."""
    outages = []
    own = node.store.own
    own.set_health = lambda n, info, _real=own.set_health: (
        _real(n, info) if outages else (_ for _ in ()).throw(StoreUnavailable("cut off")))
    node.voice.outage = outages.append
    _generation_ran(node, 3)
    node.check_ahead()
    assert node.count == 1 and own.health == [] and len(outages) == 1
    node.check_ahead()  # the next tick: published now, not checked again
    assert node.count == 1 and own.health[-1]["health"] == "ok"
    assert own.health[-1]["ok_at"] == node.now  # when it passed, for the controller
    assert node.events == []  # the record only: every node does this at every generation end
    node.check_ahead()
    assert len(own.health) == 1


STEPS = 30
# Generation 1's ranks are paced (0.3 s more a step) so that it is still running when the
# lost node is back: the test asserts what happens then, not how fast the machine is.
PACE = [{"kind": "slow_rank", "rank": r, "step": 0, "seconds": 0.3, "generation": 1}
        for r in range(2)]


def _events(store: Store, kind: str) -> list[dict]:
    return [e for _, e in store.events(count=10_000) if e.get("kind") == kind]


def test_a_node_stopped_until_it_is_lost_comes_back_as_a_spare(tmp_path, redis_server, procs):
    """node1's agent and rank are stopped (SIGSTOP: a host cut off, its port still taking
    connections) until the controller declares it lost; the job goes on on the spare; let go,
    its agent kills its rank of the old generation, checks the node, and the controller lets
    it back as a spare. The job completes."""
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", run, steps=STEPS, async_mode="sync", faults=PACE,
                    heartbeat_timeout_s=4.0)
    store = Store(redis_server.url, "e2e")
    for i in range(3):
        procs.start(f"agent{i}", "agent", "--job", "e2e", "--node", f"node{i}", "--redis",
                    redis_server.url, "--interval", "0.25")
    wait_for(lambda: relay(store) is not None and len(store.nodes()) == 3, 60,
             "three agents to register")
    procs.start("controller", "controller", str(job), "--nodes", "2", "--ranks-per-node", "1",
                "--redis", redis_server.url, "--exit-when-done")
    wait_for(lambda: (store.plan() or {}).get("generation") == 0, 60, "generation 0")
    assert store.plan()["nodes"] == ["node0", "node1"]
    wait_for(lambda: store.rank_beats("node1").get(0, {}).get("step", -1) >= 12, 120, "step 12")

    ranks = json.loads(store.agent_status(["node1"])["node1"]["pids"])
    stopped = [procs.procs["agent1"].pid, *ranks]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        entry = wait_for(lambda: store.excluded().get("node1"), 60, "node1 declared lost")
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert entry["cause"] == "node_lost" and entry["reason"].startswith("node node1 lost: ")

    (forgiven,) = wait_for(lambda: _events(store, "forgiven"), 60, "node1 back as a spare")
    assert forgiven["node"] == "node1"
    assert "lost 1 of 3 times within 3600 s" in forgiven["message"], forgiven
    assert "node1" not in store.excluded()
    info = store.nodes()["node1"]
    assert info["health"] == "ok" and info["ok_at"] > entry["time"]  # checked after its return
    assert store.job_record()["state"] == "RUNNING"  # while generation 1 runs on

    procs.procs["controller"].wait(timeout=120)
    record = store.job_record()
    assert (record["state"], record["restarts"]) == ("COMPLETED", "1")
    assert json.loads(record["losses"]) == {"node1": [entry["time"]]}
    assert store.plan()["generation"] == 1 and store.plan()["nodes"] == ["node0", "node2"]
    failures = [(e["node"], e["cause"]) for e in _events(store, "failure")]
    assert failures == [("node1", "node_lost")]
    assert json.loads((run / "controller.json").read_text())["excluded"] == {}
