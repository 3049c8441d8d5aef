"""The agents' half of the mesh check (controller/node/mesh.py, checks.py) and what the controller
reads of it (controller/control/observe.py): which peers an agent probes, when a peer counts as
out of reach (twice in a row; a refusal is an answer), a launch held while its probes run and
refused when a node of the plan is out of reach, with real sockets where a probe's outcome is
the point and a scripted `connect` where its timing is.
"""

from __future__ import annotations

import json
import logging
import socket
import threading

import pytest
from records import run_plan

from controller.common.probe import NO_ANSWER, NO_ROUTE, REFUSED, probe
from controller.common.ring import ring
from controller.control import observe
from controller.control.observe import Observer
from controller.control.view import JobView, Settings
from controller.node import mesh
from controller.node.checks import Checks
from controller.node.mesh import EVERY_S, MeshCheck
from optimus.contract.records import Plan

# A ring of four plan nodes and a spare: n2 probes n1 and n3 (and n0 before a launch).
NODES = ["n0", "n1", "n2", "n3"]
ADDRS = {n: f"10.0.0.{i + 1}:4100" for i, n in enumerate([*NODES, "s"])}


def _plan(gen: int = 3, nodes=NODES, spares=("s",), addrs=ADDRS) -> dict:
    return {"generation": gen, "action": "run", "nodes": list(nodes),
            "peers": ring(list(nodes), list(spares), addrs)}


def _record(gen: int = 3, nodes=NODES, spares=("s",), addrs=ADDRS) -> Plan:
    """`_plan` as an agent reads it: the typed record of a run plan."""
    return Plan.parse(run_plan(gen, list(nodes), peers=ring(list(nodes), list(spares), addrs)))


class Scripted:
    """A `connect` that answers from a script: host -> outcomes in turn (then its last one)."""

    def __init__(self, **script):
        self.script = {f"10.0.0.{int(k[1:]) + 1}" if k != "s" else "10.0.0.5": list(v)
                       for k, v in script.items()}
        self.calls: list[str] = []

    def __call__(self, host: str, port: int, timeout_s: float):
        self.calls.append(host)
        said = self.script.get(host, [None])
        return said.pop(0) if len(said) > 1 else said[0]


def _host(name: str) -> str:
    return ADDRS[name].split(":")[0]


def test_before_a_launch_a_node_probes_its_neighbours_and_node_0():
    connect = Scripted()
    check = MeshCheck("n2", connect)
    assert check.before_launch(_record()) is True
    assert sorted(connect.calls) == sorted(_host(n) for n in ("n1", "n3", "n0"))
    assert check.report() is None


def test_one_lost_syn_is_not_a_cut_two_in_a_row_refuse_the_launch():
    connect = Scripted(n3=[NO_ANSWER, None])  # answers the second time
    assert MeshCheck("n2", connect).before_launch(_record()) is True
    assert connect.calls.count(_host("n3")) == 2
    check = MeshCheck("n2", Scripted(n3=[NO_ANSWER, NO_ROUTE], n0=[NO_ROUTE]))
    assert check.before_launch(_record()) is False
    assert check.blocked == ["n0", "n3"]
    assert check.report() == {"generation": 3, "unreachable": ["n0", "n3"], "refused": True}


def test_a_refusal_is_an_answer_and_a_spare_out_of_reach_does_not_hold_a_launch():
    assert MeshCheck("n2", Scripted(n1=[REFUSED])).before_launch(_record()) is True
    check = MeshCheck("n3", Scripted(s=[NO_ANSWER]))  # n3's neighbours: n2 and the spare
    assert check.before_launch(_record()) is True
    check.poll(_record())
    assert check.report() == {"generation": 3, "unreachable": ["s"], "refused": False}


def test_a_launch_waits_for_slow_probes_and_is_woken_when_they_end():
    release, woken = threading.Event(), threading.Event()

    def slow(host, port, timeout_s):
        release.wait(5)
        return None
    check = MeshCheck("n2", slow, on_done=woken.set)
    assert check.before_launch(_record()) is None  # waited QUICK_S in line, no longer
    assert check.before_launch(_record()) is None and not woken.is_set()
    release.set()
    assert woken.wait(5)
    for _ in range(100):  # the last probe's future settles right after its callback
        if check.before_launch(_record()) is not None:
            break
        threading.Event().wait(0.01)
    assert check.before_launch(_record()) is True
    check.close()


def test_while_a_generation_runs_two_failures_in_a_row_report_a_neighbour_and_an_answer_clears(
        monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(mesh.time, "monotonic", lambda: clock[0])
    connect = Scripted(n3=[NO_ANSWER, NO_ANSWER, None])
    check = MeshCheck("n2", connect)

    def turn(seconds: float) -> dict | None:
        clock[0] += seconds
        check.poll(_record())
        for st in check.peers.values():  # the probes end before the next tick
            if st.future is not None:
                st.future.result(5)
        check.poll(_record())  # collected (and no new probe: not due yet)
        return check.report()
    assert turn(0) is None  # one failure
    assert sorted(check.peers) == ["n1", "n3"]  # neighbours only: node 0 only before a launch
    assert turn(EVERY_S / 2) is None  # not due: no probe
    assert connect.calls.count(_host("n3")) == 1
    assert turn(EVERY_S) == {"generation": 3, "unreachable": ["n3"], "refused": False}
    assert turn(EVERY_S) is None  # it answered
    assert connect.calls.count(_host("n3")) == 3
    check.poll(_record().model_copy(update={"action": "stop"}))
    assert check.peers == {} and check.report() is None
    check.close()


def test_a_launch_refused_stays_reported_for_its_generation_and_a_new_one_starts_afresh():
    check = MeshCheck("n2", Scripted(n1=[NO_ANSWER]))
    assert check.before_launch(_record(gen=3)) is False
    check.poll(_record(gen=3))
    assert check.report()["unreachable"] == ["n1"] and check.report()["refused"]
    check.connect = Scripted()
    assert check.before_launch(_record(gen=4)) is True and check.report() is None
    check.close()


def test_a_peer_without_a_snapshot_server_is_not_probed_and_said_once(caplog):
    addrs = {**ADDRS, "n3": ""}
    connect = Scripted()
    check = MeshCheck("n2", connect)
    with caplog.at_level(logging.INFO, logger="optimus.agent"):
        assert check.before_launch(_record(addrs=addrs)) is True
        check.poll(_record(addrs=addrs))
        check.poll(_record(addrs=addrs))
    assert _host("n3") not in connect.calls
    said = [r.getMessage() for r in caplog.records if "not probed" in r.getMessage()]
    assert said == ["mesh check: n3 is not probed from n2: it has no snapshot server (no job "
                    "secret, or its server could not listen)"]
    check.close()


def test_real_sockets_a_listener_answers_and_a_closed_port_is_no_cut():
    with socket.socket() as server, socket.socket() as closed:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
        addrs = {"n0": f"127.0.0.1:{server.getsockname()[1]}",
                 "n1": f"127.0.0.1:{closed.getsockname()[1]}", "n2": "127.0.0.1:1"}
        plan = _record(nodes=["n0", "n1", "n2"], spares=(), addrs=addrs)
        assert probe("127.0.0.1", closed.getsockname()[1]) == REFUSED
        check = MeshCheck("n2", probe)
        assert check.before_launch(plan) is True
        check.close()


# --- the agent's refusal, and what the controller makes of it --------------------------------

class _Voice:
    def __init__(self):
        self.events: list[tuple] = []

    def event(self, kind: str, message: str, **fields) -> None:
        self.events.append((kind, message, fields))


def _checks(connect) -> Checks:
    """Node n2's checks, their events heard (`checks.voice.events`)."""
    return Checks(None, "n2", "host-n2", None, MeshCheck("n2", connect), _Voice(), {})


def test_an_agent_refuses_a_generation_on_its_mesh_check_once_with_cause_network():
    agent = _checks(Scripted(n1=[NO_ANSWER]))
    assert agent.meshed(_record()) is False and agent.meshed(_record()) is False
    why = ("cannot reach n1 (10.0.0.2:4100) on the ranks' network (no answer from its snapshot "
           "server, twice in a row)")
    assert agent.refusal == {"generation": 3, "host": "host-n2", "reason": why,
                             "cause": "network"}
    assert agent.voice.events == [("mesh", f"n2 refuses generation 3: {why}",
                                   {"generation": 3, "refused": True, "peers": "n1"})]
    agent.mesh.close()


def test_an_agent_says_when_a_neighbour_goes_out_of_reach_and_when_it_answers_again(
        monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(mesh.time, "monotonic", lambda: clock[0])
    agent = _checks(Scripted(n3=[NO_ROUTE, NO_ROUTE, None]))
    for _ in range(4):  # a tick every EVERY_S: fail, fail, answer (each probe collected)
        agent.check_mesh(_record())
        for st in agent.mesh.peers.values():
            if st.future is not None:
                st.future.result(5)
        clock[0] += EVERY_S
    assert [(k, m) for k, m, _ in agent.voice.events] == [
        ("mesh", "n2 cannot reach n3 (10.0.0.4:4100) on the ranks' network (mesh check: no "
                 "answer from its snapshot server, twice in a row)"),
        ("mesh", "n2 reaches n3 (10.0.0.4:4100) again on the ranks' network (mesh check)")]
    agent.mesh.close()


class _Store:
    def __init__(self, fields: dict[str, dict[str, str]]):
        self.fields, self.reads = fields, 0

    def agent_field(self, nodes, name):
        self.reads += 1
        return {n: self.fields[name][n] for n in nodes if n in self.fields.get(name, {})}


def _observer(store) -> Observer:
    return Observer(store, Settings(nodes=4, ranks_per_node=1), None, None)


def test_a_mesh_refusal_is_not_a_stop_of_the_job_a_float8_refusal_is():
    plan = _plan()
    network = {"generation": 3, "host": "h", "reason": "cannot reach n1", "cause": "network"}
    store = _Store({"refused": {"n0": json.dumps(network), "n2": json.dumps(network)}})
    assert _observer(store)._refusals(JobView(state="RUNNING"), plan) == []
    job_fault = {"generation": 3, "host": "h", "reason": "no float8 here"}
    store.fields["refused"]["n3"] = json.dumps(job_fault)
    [stop] = _observer(store)._refusals(JobView(state="RUNNING"), plan)
    assert (stop.action, stop.actor, stop.reason) == ("stop", "agent:n3", "no float8 here")


def test_the_controller_reads_the_rings_reports_checked_and_not_every_tick(monkeypatch):
    clock = [50.0]
    monkeypatch.setattr(observe.time, "monotonic", lambda: clock[0])
    # The ring: n0 n1 n2 n3 s (n0's neighbours: s and n1).
    said = {"n0": {"generation": 3, "unreachable": ["n1", "s", "n3"], "refused": True},
            "n2": {"generation": 3, "unreachable": ["n1", "n0"], "refused": False},  # n0: ok
            "s": {"generation": 3, "unreachable": ["n3", "n2"]},  # n2 is not its neighbour
            "n3": {"generation": 2, "unreachable": ["n2"]}}  # an older generation's
    store = _Store({"mesh": {n: json.dumps(r) for n, r in said.items()}})
    obs = _observer(store)
    reports, refused = obs._mesh_reports(_plan())
    assert reports == {"n0": ("n1", "s"), "n2": ("n0", "n1"), "s": ("n3",)}
    assert refused == frozenset({"n0"})
    store.fields["mesh"] = {}
    clock[0] += observe.MESH_CHECK_S / 2
    assert obs._mesh_reports(_plan()) == (reports, refused) and store.reads == 1
    clock[0] += observe.MESH_CHECK_S
    assert obs._mesh_reports(_plan()) == ({}, frozenset()) and store.reads == 2
    store.fields["mesh"] = {"n2": json.dumps(said["n2"])}
    assert obs._mesh_reports(_plan(gen=4)) == ({}, frozenset())  # a new generation: read now
    assert store.reads == 3


@pytest.mark.parametrize("outcome", [NO_ANSWER, NO_ROUTE])
def test_what_counts_as_out_of_reach(outcome):
    assert outcome in mesh.OUT_OF_REACH and REFUSED not in mesh.OUT_OF_REACH
