"""The ranks' network named (controller/control/fabric.py): the addresses a failed rank could not
reach, read from real torch 2.13 messages (tests/connect_errors.json says how they were
captured); whose address each is; the rule that names the one node in every failing pair; the
mesh check's ring; and what `decide` does with the agents' mesh reports and the ranks' exits.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from controller.control import fabric
from controller.control.decide import (
    RESTARTING,
    RUNNING,
    Exit,
    JobView,
    NodeView,
    Observed,
    Settings,
    decide,
)
from controller.control.detect import CAUSES, COLLATERAL, exit_evidence
from controller.control.fabric import Ring, culprit, mesh_report, owners, ring, unreached

TAILS = json.loads((Path(__file__).parent / "connect_errors.json").read_text())
NOW = 1000.0
S = Settings(nodes=3, ranks_per_node=1, heartbeat_interval_s=0.5, heartbeat_timeout_s=5,
             agent_timeout_s=5, max_restarts=5, backoff_s=1, failure_grace_s=2,
             launch={"job_file": "/jobs/x.yaml", "log_dir": "/runs/x/logs"})
# As in the capture: node0-node2 at 10.99.0.1-3 (node1 was cut), and a spare.
ADDRS = {"node0": "10.99.0.1", "node1": "10.99.0.2", "node2": "10.99.0.3", "spare": "10.99.0.4"}


# --- what ranks said -------------------------------------------------------------------------

def test_a_gloo_rendezvous_that_found_no_route_names_the_peer_and_the_ranks_own_address():
    # node1, cut off, could not reach node0; node2 could not reach node1.
    assert unreached(TAILS["gloo_rendezvous_no_route_cut_node"]) == (("10.99.0.1", "10.99.0.2"),)
    assert unreached(TAILS["gloo_rendezvous_no_route_to_cut_node"]) == (
        ("10.99.0.2", "10.99.0.3"),)


def test_the_tcpstores_no_route_names_the_store_not_the_garbage_address_beside_it():
    tail = TAILS["tcpstore_no_route"]
    assert "111.85.0.0:40011" in tail  # torch prints an unset sockaddr beside the real one
    assert unreached(tail) == (("10.99.0.1", ""),)


@pytest.mark.parametrize("name", ["gloo_rendezvous_waiting_side", "gloo_rendezvous_silent_drop",
                                  "gloo_rendezvous_refused_dead_peer",
                                  "gloo_collective_timeout_recv", "gloo_collective_timeout_send",
                                  "tcpstore_timed_out_refused"])
def test_what_names_nobody_or_is_an_answer_is_no_evidence_of_the_network(name):
    # A refusal is the peer's process gone (a dead peer's, here); a TCPStore timing out is what
    # a store not up yet gives too; gloo's waiting side and its collectives name no address.
    assert unreached(TAILS[name]) == ()


@pytest.mark.parametrize("name", [k for k in TAILS if not k.startswith("_")])
def test_every_captured_failure_is_a_peers_failure_for_the_exit_rules(name):
    e = Exit("node1", 1, 0, code=1, tail=TAILS[name], time=NOW)
    assert exit_evidence(e).kind == COLLATERAL


def test_nccls_socket_errors_are_read_in_the_form_its_socket_code_prints():
    # NCCL's src/misc/socket.cc: "socketStartConnect: Connect to %s failed : %s", the address
    # as "<host><<port>>" (ncclSocketToString), torch quoting it after "Last error:".
    tail = ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
            "remote process exited or there was a network error, NCCL version 2.21.5\n"
            "ncclRemoteError: A call failed possibly due to a network error or a remote process "
            "exiting prematurely.\nLast error:\nsocketStartConnect: Connect to 10.99.0.2<43215> "
            "failed : No route to host\n"
            "socketStartConnect: Connect to fe80::2%eth1<43216> failed : Network is unreachable")
    assert unreached(tail) == (("10.99.0.2", ""), ("fe80::2", ""))
    assert unreached(tail.replace("No route to host", "Connection refused")) == (
        ("fe80::2", ""),)


def test_the_reading_is_bounded_and_takes_only_addresses():
    many = "\n".join(f"failed to connect, error=SO_ERROR: No route to host, "
                     f"remote=[10.1.{i // 250}.{i % 250 + 1}]:1" for i in range(1000))
    assert len(unreached(many)) == fabric.TAIL_ADDRESSES
    old = "SO_ERROR: No route to host, remote=[10.7.7.7]:1\n" + "x" * fabric.TAIL_CHARS
    assert unreached(old) == ()  # only the last TAIL_CHARS are read
    junk = ("No route to host, remote=[999.1.1.1]:1 remote=[127.0.0.1]:2 remote=[::]:3 "
            "network address of (localhost, 29500)")
    assert unreached(junk) == ()


# --- whose address -----------------------------------------------------------------------------

def test_an_address_belongs_to_the_one_node_that_registered_it():
    infos = {"node0": {"host": "node0.cluster", "addresses": ["10.99.0.1", "172.17.0.1",
                                                              "127.0.0.1", "fe80::1%eth0"]},
             "node1": {"host": "10.99.0.2", "addresses": ["172.17.0.1", 7, "x" * 300]},
             "node2": {"host": "node2", "addresses": "10.99.0.3"},  # not a list: not read
             "node3": "not a record"}
    assert owners(infos) == {"10.99.0.1": "node0", "fe80::1": "node0", "node0.cluster": "node0",
                             "10.99.0.2": "node1", "node2": "node2"}
    many = {"n": {"addresses": [f"10.0.0.{i}" for i in range(1, 100)]}}
    assert len(owners(many)) == fabric.MAX_ADDRESSES


# --- the rule ---------------------------------------------------------------------------------

def test_the_culprit_is_the_one_node_in_every_failing_pair():
    pair = frozenset
    assert culprit([pair("AB"), pair("BC")]) == "B"
    assert culprit([pair("AB"), pair("BC"), pair("BD"), pair("AB")]) == "B"
    assert culprit([pair("AB")]) is None  # two nodes only: A's fault or B's
    assert culprit([pair("AB"), pair("AB")]) is None
    assert culprit([pair("AB"), pair("CD")]) is None  # two separate faults
    assert culprit([pair("AB"), pair("BC"), pair("CD")]) is None
    assert culprit([]) is None


# --- the ring ---------------------------------------------------------------------------------

def test_each_node_probes_its_two_neighbours_and_every_node_is_probed_once_per_side():
    nodes = [f"n{i:05d}" for i in range(10_000)]
    spares = ["s1", "s0", "nosrv"]
    addrs = {n: f"{n}:4100" for n in [*nodes, "s0", "s1"]}
    r = Ring.of({"nodes": nodes, "peers": ring(nodes, spares, addrs)})
    assert r.members[:2] == ("n00000", "n00001") and r.members[-2:] == ("s1", "s0")
    assert "nosrv" not in r.members  # a spare without a server is probed by nobody
    probes = {m: r.peers(m) for m in r.members}
    assert all(len(p) == 2 for p in probes.values())
    assert sum(len(p) for p in probes.values()) == 2 * len(r.members)  # O(nodes)
    probed = [q for p in probes.values() for q in p]
    assert sorted(probed) == sorted([*r.members, *r.members])  # each by both neighbours
    assert probes["s0"] == {"s1": "s1:4100", "n00000": "n00000:4100"}  # the ring closes
    # Before a launch node 0 (the rendezvous) too, once.
    assert r.peers("n05000", launch=True) == {"n04999": "n04999:4100",
                                              "n05001": "n05001:4100",
                                              "n00000": "n00000:4100"}
    assert len(r.peers("n00001", launch=True)) == 2  # its neighbour already
    assert r.peers("elsewhere") == {}


def test_a_small_ring_probes_what_there_is():
    two = Ring.of({"nodes": ["a", "b"], "peers": ring(["a", "b"], [], {"a": "a:1", "b": "b:1"})})
    assert two.peers("a") == {"b": "b:1"} and two.peers("b", launch=True) == {"a": "a:1"}
    one = Ring.of({"nodes": ["a"], "peers": ring(["a"], [], {"a": "a:1"})})
    assert one.peers("a", launch=True) == {}
    # A plan node without a server stays in the ring ("" address): its agent probes others.
    assert ring(["a", "b"], [], {"a": "a:1"}) == [["a", "a:1"], ["b", ""]]


def test_a_mesh_report_is_this_generations_and_names_only_the_reporters_peers():
    plan = {"generation": 4, "nodes": ["n0", "n1", "n2", "n3"],
            "peers": ring(["n0", "n1", "n2", "n3"], [], {})}
    r = Ring.of(plan)

    def report(**said) -> str:
        return json.dumps({"generation": 4, "unreachable": [], **said})
    assert mesh_report(report(unreachable=["n3", "n1", "n0"]), "n2", r, 4) == (
        ("n0", "n1", "n3"), False)  # n0: node 0, probed before a launch
    assert mesh_report(report(unreachable=["n0", "n2", 5]), "n1", r, 4) == (("n0", "n2"), False)
    assert mesh_report(report(unreachable=["n3"]), "n1", r, 4) == ((), False)  # not its peer
    assert mesh_report(report(refused=True, unreachable=["n0"]), "n2", r, 4) == (("n0",), True)
    assert mesh_report(report(refused="yes"), "n2", r, 4) == ((), False)
    for bad in (json.dumps({"generation": 3, "unreachable": ["n1"]}),
                json.dumps({"generation": True, "unreachable": ["n1"]}),
                json.dumps({"generation": 4, "unreachable": "n1"}), "[]", "{", "", None,
                report(unreachable=["n1"] * 2000)):
        assert mesh_report(bad, "n2", r, 4) is None, bad


# --- decide -----------------------------------------------------------------------------------

def _plan(nodes=("node0", "node1", "node2"), spares=("spare",), gen=0) -> dict:
    addrs = {n: f"{ADDRS[n]}:4100" for n in ADDRS}
    return {"generation": gen, "action": "run", "nodes": list(nodes), "ranks_per_node": 1,
            "world_size": len(nodes), "peers": ring(list(nodes), list(spares), addrs)}


def _running(plan=None, mesh=None, refused=(), exits=(), job=None, now=NOW,
             excluded=None) -> Observed:
    plan = plan or _plan()
    job = job or JobView(state=RUNNING, generation=plan["generation"],
                         progress_gen=plan["generation"], progress_step=5, progress_at=now,
                         progress_moves=3)
    return Observed(now=now, job=job, plan=plan, nodes={}, exits=list(exits), latest_step=4,
                    agent_beats={n: now - 0.2 for n in plan["nodes"]},
                    addresses={a: n for n, a in ADDRS.items()}, mesh=mesh or {},
                    mesh_refused=frozenset(refused), excluded=excluded or {})


def test_a_node_its_neighbours_cannot_reach_is_excluded_as_cut_off_and_replaced():
    mesh = {"node0": ("node1",), "node2": ("node1",), "node1": ("node0", "node2")}
    d = decide(_running(mesh=mesh), S)
    what = ("node node1 is cut off from its peers on the ranks' network: node0, node2 could not "
            "reach it at 10.99.0.2; it could not reach node0, node2 at 10.99.0.1, 10.99.0.3 "
            "(by mesh checks)")
    assert d.exclude == [("node1", what)]  # the healthy reporters are not
    assert d.causes == {"node1": "network"}  # not lifted as a lost node's would be
    assert d.plan["action"] == "stop" and d.plan["culprit"] == {"node": "node1", "rank": None}
    assert d.job["state"] == RESTARTING and d.job["restart_causes"] == {"network": 1}
    assert d.job["last_failure"]["cause"] == "network"
    assert d.job["last_failure"]["evidence"] == "hard"
    assert "network" in CAUSES


def test_the_cut_node_alone_saying_so_is_enough_and_one_reporter_alone_names_nobody():
    d = decide(_running(mesh={"node1": ("node0", "node2")}), S)
    assert [n for n, _ in d.exclude] == ["node1"]
    # node0 could not reach node1: node0's fault as much as node1's. Nothing happens.
    d = decide(_running(mesh={"node0": ("node1",)}), S)
    assert d.exclude == [] and d.plan is None and d.job == {}


def test_two_separate_faults_name_nobody_by_this_rule():
    plan = _plan(nodes=("node0", "node1", "node2", "spare"), spares=())
    d = decide(_running(plan=plan, mesh={"node0": ("node1",), "node2": ("spare",)}), S)
    assert d.exclude == [] and d.plan is None


def test_with_two_nodes_and_a_spare_the_spare_is_the_third_witness():
    # A -> B fails, B -> S fails, S -> B fails, A -> S answers.
    plan = _plan(nodes=("node0", "node1"))  # ring: node0, node1, spare
    assert Ring.of(plan).peers("spare") == {"node1": "10.99.0.2:4100",
                                            "node0": "10.99.0.1:4100"}
    mesh = {"node0": ("node1",), "node1": ("node0", "spare"), "spare": ("node1",)}
    d = decide(_running(plan=plan, mesh=mesh), S)
    assert [n for n, _ in d.exclude] == ["node1"] and d.job["state"] == RESTARTING
    # Without the spare's word: node0 and node1 blame each other; nobody is named.
    d = decide(_running(plan=plan, mesh={"node0": ("node1",), "node1": ("node0",)}), S)
    assert d.exclude == [] and d.plan is None


def test_a_spare_cut_off_is_excluded_without_a_restart():
    plan = _plan(nodes=("node0", "node1"))
    mesh = {"node0": ("spare",), "node1": ("spare",), "spare": ("node0", "node1")}
    d = decide(_running(plan=plan, mesh=mesh), S)
    assert [n for n, _ in d.exclude] == ["spare"] and "node spare is cut off" in d.exclude[0][1]
    assert d.plan is None and "state" not in d.job  # the generation runs on
    assert d.causes == {"spare": "network"}
    excluded = {"spare": d.exclude[0][1]}
    assert decide(_running(plan=plan, mesh=mesh, excluded=excluded), S).exclude == []


def test_a_launch_refused_on_the_mesh_check_replaces_the_culprit_and_does_not_stop_the_job():
    # Before launch every node refused: node0 and node2 could not reach node1, nor it them.
    mesh = {"node0": ("node1",), "node2": ("node1",), "node1": ("node0", "node2")}
    d = decide(_running(mesh=mesh, refused=("node0", "node1", "node2")), S)
    assert [n for n, _ in d.exclude] == ["node1"]
    assert d.job["state"] == RESTARTING and d.job.get("desired") is None


def test_refusals_with_no_culprit_hold_the_generation_then_restart_it_excluding_nobody():
    plan = _plan(nodes=("node0", "node1"), spares=())
    mesh = {"node0": ("node1",), "node1": ("node0",)}
    first = decide(_running(plan=plan, mesh=mesh, refused=("node0", "node1")), S)
    assert first.exclude == [] and first.plan is None and first.job == {"failure_since": NOW}
    job = JobView(state=RUNNING, generation=0, progress_gen=0, progress_step=5,
                  progress_at=NOW, progress_moves=3, failure_since=NOW)
    d = decide(_running(plan=plan, mesh=mesh, refused=("node0", "node1"), job=job,
                        now=NOW + S.settle_s), S)
    assert d.exclude == [] and d.job["state"] == RESTARTING
    assert "node0, node1 could not reach node0 -> node1, node1 -> node0" in d.job["reason"]
    assert "no single node is in every failing pair" in d.job["reason"]


def _exit(node: str, rank: int, tail: str) -> Exit:
    return Exit(node, rank, 0, code=1, tail=tail, time=NOW)


def test_the_ranks_own_words_name_the_cut_node_without_any_mesh_report():
    # What the captured rendezvous left: node1's rank could not reach node0, node2's could not
    # reach node1, node0's rank only timed out waiting.
    exits = [_exit("node0", 0, TAILS["gloo_rendezvous_waiting_side"]),
             _exit("node1", 1, TAILS["gloo_rendezvous_no_route_cut_node"]),
             _exit("node2", 2, TAILS["gloo_rendezvous_no_route_to_cut_node"])]
    d = decide(_running(exits=exits), S)
    assert d.exclude == [("node1", "node node1 is cut off from its peers on the ranks' network: "
                                   "node2 could not reach it at 10.99.0.2; it could not reach "
                                   "node0 at 10.99.0.1 (by the ranks' connections)")]
    assert d.job["last_failure"]["cause"] == "network"
    # Only the cut node's word: one pair, nobody by the rule; its peers' errors are collateral.
    d = decide(_running(exits=exits[:2]), S)
    assert d.exclude == [] and d.job == {"failure_since": NOW}


def test_an_address_claimed_by_no_node_or_a_rank_elsewhere_names_nobody():
    wrong_local = TAILS["gloo_rendezvous_no_route_cut_node"]  # local=[10.99.0.2]: node1's
    exits = [_exit("node0", 0, wrong_local),  # says it ran on node1: not node0's word
             _exit("node2", 2, TAILS["gloo_rendezvous_no_route_to_cut_node"])]
    obs = _running(exits=exits)
    assert [(f.reporter, f.peer) for f in fabric.failures(obs)] == [("node2", "node1")]
    unknown = Observed(**{**obs.__dict__, "addresses": {}})
    assert fabric.failures(unknown) == []


# --- the plan ---------------------------------------------------------------------------------

def _node(name: str, addr: str = "") -> NodeView:
    return NodeView(name=name, host=name, alive=True, healthy=True, last_beat=NOW,
                    snapshot_addr=addr)


def test_a_new_plan_carries_the_ring_of_its_nodes_then_the_spares_with_a_server():
    nodes = {"a": _node("a", "a:1"), "b": _node("b", "b:1"), "c": _node("c", "c:1"),
             "d": _node("d")}
    s = Settings(nodes=2, ranks_per_node=1, launch=S.launch)
    d = decide(Observed(now=NOW, job=JobView(), plan=None, nodes=nodes), s)
    assert d.plan["nodes"] == ["a", "b"]
    assert d.plan["peers"] == [["a", "a:1"], ["b", "b:1"], ["c", "c:1"]]  # d has no server


def test_a_spare_that_arrives_joins_the_ring_of_the_running_plan():
    plan = {**_plan(nodes=("node0", "node1"), spares=()), "buddies": {}}
    spares = {"node0": "10.99.0.1:4100", "node1": "10.99.0.2:4100", "spare": "10.99.0.4:4100"}
    obs = Observed(**{**_running(plan=plan).__dict__, "spares": spares})
    d = decide(obs, S)
    assert d.plan["peers"] == [["node0", "10.99.0.1:4100"], ["node1", "10.99.0.2:4100"],
                               ["spare", "10.99.0.4:4100"]]
    assert d.plan["generation"] == 0 and d.plan["action"] == "run"  # the same, re-issued
    again = Observed(**{**obs.__dict__, "plan": d.plan})
    assert decide(again, S).plan is None  # nothing changed: not re-issued


def test_the_verdict_costs_little_at_scale():
    nodes = [f"n{i:05d}" for i in range(10_000)]
    plan = _plan(nodes=nodes, spares=())
    plan["peers"] = ring(nodes, [], {n: f"{n}:1" for n in nodes})
    mesh = {"n04999": ("n05000",), "n05001": ("n05000",), "n05000": ("n04999", "n05001")}
    obs = Observed(now=NOW, job=JobView(state=RUNNING), plan=plan, nodes={}, mesh=mesh)
    started = time.perf_counter()
    verdict = fabric.cut(obs)
    assert verdict.node == "n05000"
    assert time.perf_counter() - started < 1.0  # a ring of 10,000 indexed once: milliseconds


def test_a_node_that_says_nothing_itself_is_left_to_the_lost_node_rule():
    # node0 and node2 cannot reach node1, which reports nothing: its host may be down (then its
    # agent falls silent and it is lost, an exclusion lifted should it return), not its link.
    d = decide(_running(mesh={"node0": ("node1",), "node2": ("node1",)}), S)
    assert d.exclude == [] and d.plan is None
    assert fabric.cut(_running(mesh={"node0": ("node1",), "node2": ("node1",)})).node is None
