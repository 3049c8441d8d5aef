"""Replicas that carry on (supervision.on_replica_loss: continue), the controller's rules: a
lost replica leaves the quorum and is relaunched, alone; it is let back in once its ranks wait;
below min_replicas, without a spare or without a culprit, the job restarts as before, and says
why. Pure functions of an observed snapshot, as tests/test_decide.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controller.control.decide import (
    COMPLETED,
    RESTARTING,
    RUNNING,
    Exit,
    JobView,
    NodeView,
    Observed,
    Overdue,
    Settings,
    decide,
)
from controller.node.replica_worlds import own_rank, relaunch_due, world
from optimus.config import ConfigError, check_job, check_replica_nodes, load_job
from optimus.contract import env
from optimus.contract.records import Plan, RecordError

NOW = 1000.0
LAUNCH = {"job_file": "/jobs/x.yaml", "log_dir": "/runs/x/logs"}
# 3 replicas of 2 nodes x 1 rank; a node with flaky_failures 2 is kept on its first failure
S = Settings(nodes=6, ranks_per_node=1, heartbeat_interval_s=0.5, heartbeat_timeout_s=5,
             agent_timeout_s=5, max_restarts=3, flaky_failures=2, launch=LAUNCH, replicas=3,
             on_replica_loss="continue", min_replicas=2)
NODES = [f"n{i}" for i in range(6)]


def node(name: str, *, gen: int | None = 0, launch: int | None = 0, standby: int = 0,
         port: int = 0, alive: bool = True, excluded: str | None = None) -> NodeView:
    return NodeView(name=name, host=f"host-{name}", alive=alive, healthy=True,
                    excluded=excluded, generation=gen, live_ranks=1, last_beat=NOW - 0.5,
                    next_port=port, launch=launch, standby=standby)


def plan(members=(0, 1, 2), launches=(0, 0, 0), ports=(4000, 4002, 4004), qid=1) -> dict:
    return {"version": 1, "generation": 0, "action": "run", "nodes": list(NODES),
            "ranks_per_node": 1, "world_size": 6, "master_addr": "host-n0", "master_port": 4000,
            "job_file": "/jobs/x.yaml", "log_dir": "/l",
            "replicas": {"addrs": ["host-n0", "host-n2", "host-n4"], "ports": list(ports),
                         "launches": list(launches), "after": [0, 0, 0]},
            "quorum": {"version": 1, "id": qid, "members": list(members),
                       "store_addr": "host-n0", "store_port": 4000}}


def observed(exits=(), nodes=None, the_plan=None, **more) -> Observed:
    nodes = nodes or {n: node(n, port=5000 + i) for i, n in enumerate(NODES)}
    nodes.setdefault("spare", node("spare", gen=None, launch=None, port=6000))
    job = JobView(state=RUNNING, generation=0, progress_gen=0, progress_step=5,
                  progress_at=NOW, progress_moves=3)
    the_plan = the_plan or plan()
    return Observed(now=NOW, job=job, plan=the_plan, nodes=nodes, exits=list(exits),
                    latest_step=4, agent_beats={n: NOW - 0.5 for n in the_plan["nodes"]},
                    **more)


def killed(node_name: str, rank: int, launch: int = 0) -> Exit:
    return Exit(node_name, rank, 0, code=None, signal=9, tail="step 5", time=NOW - 0.1,
                launch=launch)


def test_a_killed_rank_takes_its_replica_out_of_the_quorum_and_relaunches_it_alone():
    d = decide(observed([killed("n2", 2)]), S)
    p = d.plan
    Plan.parse(p)  # a plan the agents take
    assert p["action"] == "run" and p["generation"] == 0  # nobody else stops
    assert p["quorum"]["id"] == 2 and p["quorum"]["members"] == [0, 2]
    assert p["replicas"]["launches"] == [0, 1, 0]
    assert p["replicas"]["after"][1] == 2  # its new ranks join only a newer quorum
    assert p["replicas"]["ports"][1] == 5002  # its first node's fresh port
    assert p["nodes"] == NODES  # kept on its node (flaky_failures 2)
    # its agent kills the culprit at once; the replica's other ranks may go on in process
    assert p["culprit"] == {"node": "n2", "rank": 2}
    assert d.job["restarts"] == 1 and "state" not in d.job
    kinds = [k for k, *_ in d.events]
    assert kinds == ["failure", "replica_lost"]
    assert "quorum 2 trains on with replicas [0, 2]" in d.events[1][1]


def test_losing_the_lowest_member_moves_the_quorum_store_to_the_next():
    p = decide(observed([killed("n1", 1)]), S).plan
    assert p["quorum"]["members"] == [1, 2]
    assert (p["quorum"]["store_addr"], p["quorum"]["store_port"]) == ("host-n2", 4002)


def test_an_excluded_node_is_replaced_by_a_spare_in_its_slot():
    strict = replace(S, flaky_failures=1)
    d = decide(observed([killed("n3", 3)]), strict)
    assert d.exclude and d.exclude[0][0] == "n3"
    p = d.plan
    assert p["nodes"] == ["n0", "n1", "n2", "spare", "n4", "n5"]
    assert p["replicas"]["launches"] == [0, 1, 0]
    assert p["replicas"]["ports"][1] == 5002  # the replica's first node is still n2
    assert "on spare spare" in d.events[-1][1]


def test_a_relaunch_waits_for_a_port_its_first_node_has_not_offered_then_takes_it():
    nodes = {n: node(n, port=5000 + i) for i, n in enumerate(NODES)}
    nodes["n2"] = node("n2", port=4002)  # still the port the plan took: not renewed yet
    d = decide(observed([killed("n2", 2)], nodes=nodes), S)
    assert d.plan["replicas"]["ports"][1] == 0
    Plan.parse(d.plan)
    nodes["n2"] = node("n2", port=5002)
    later = decide(observed(nodes=nodes, the_plan=d.plan), S)
    assert later.plan["replicas"]["ports"][1] == 5002


def test_below_min_replicas_the_job_restarts_and_says_why():
    out = plan(members=(0, 2), launches=(0, 1, 0), qid=2)
    d = decide(observed([killed("n4", 4)], the_plan=out), S)
    assert d.plan["action"] == "stop" and d.job["state"] == RESTARTING
    said = dict((k, m) for k, m, _ in d.events)["restarting"]
    assert "replicas do not carry on" in said and "min_replicas=2" in said


def test_with_no_spare_the_replica_waits_out_of_the_quorum_then_starts_on_one():
    strict = replace(S, flaky_failures=1)
    nodes = {n: node(n, port=5000 + i) for i, n in enumerate(NODES)}
    nodes["spare"] = node("spare", gen=None, launch=None, excluded="operator")
    d = decide(observed([killed("n3", 3)], nodes=nodes), strict)
    p = d.plan
    Plan.parse(p)
    assert p["action"] == "run" and p["quorum"]["members"] == [0, 2]
    assert p["replicas"]["ports"][1] == 0 and p["nodes"][3] == "n3"  # parked on its slot
    assert "waits out of the quorum for a spare node in place of n3" in d.events[-1][1]
    # The exclusion lands; the generation goes on (an excluded node of a replica out stops
    # nothing), and the replica stays out while no spare is free.
    nodes["n3"] = replace(nodes["n3"], excluded="rank 3 on n3 ended with SIGKILL (9)")
    waiting = observed(nodes=nodes, the_plan=p, excluded={"n3": "rank 3 ..."})
    assert decide(waiting, strict).plan is None
    # A spare registers: it takes n3's place, with its port; the replica starts there.
    nodes["spare"] = node("spare", gen=None, launch=None, port=6000)
    d = decide(observed(nodes=nodes, the_plan=p, excluded={"n3": "rank 3 ..."}), strict)
    assert d.plan["nodes"] == ["n0", "n1", "n2", "spare", "n4", "n5"]
    assert d.plan["replicas"]["ports"][1] == 5002  # its first node is n2, still there
    assert [k for k, *_ in d.events] == ["replica_spare"]
    # n3's rank's exit is over: its slot is the spare's now
    later = decide(observed([killed("n3", 3)], nodes=nodes, the_plan=d.plan,
                            excluded={"n3": "rank 3 ..."}), strict)
    assert later.plan is None and not later.events


def test_a_lost_node_whose_replica_waits_for_a_spare_is_not_lost_again_every_tick():
    """Its agent silent, n3 is lost once: its replica leaves and waits for a spare. Each tick
    after finds the same silent agent; that is no new failure (no new launch, no event)."""
    nodes = {n: node(n, port=5000 + i) for i, n in enumerate(NODES)}
    nodes["spare"] = node("spare", gen=None, launch=None, excluded="operator")
    silent = observed(nodes=nodes)
    silent.agent_beats["n3"] = NOW - 30  # past agent_timeout_s
    d = decide(silent, S)
    assert d.plan["quorum"]["members"] == [0, 2] and d.plan["replicas"]["launches"] == [0, 1, 0]
    assert "n3" in {n for n, _ in d.exclude}
    nodes["n3"] = replace(nodes["n3"], excluded="node n3 lost", alive=False)
    still = observed(nodes=nodes, the_plan=d.plan, excluded={"n3": "node n3 lost"})
    still.agent_beats["n3"] = NOW - 31
    again = decide(still, S)
    assert again.plan is None and not again.events and not again.exclude
    # A member's node lost meanwhile is judged as ever: replica 2 would leave, below
    # min_replicas (2) with replica 1 out: the job restarts, and says why.
    still.agent_beats["n5"] = NOW - 30
    other = decide(still, S)
    assert other.job["state"] == RESTARTING and "n5" in {n for n, _ in other.exclude}
    assert any("min_replicas=2" in message for _, message, _ in other.events)


def test_exits_of_an_earlier_launch_are_over_not_a_new_failure():
    out = plan(members=(0, 2), launches=(0, 1, 0), qid=2)
    d = decide(observed([killed("n2", 2, launch=0)], the_plan=out), S)
    assert d.plan is None and not d.events
    again = decide(observed([killed("n2", 2, launch=1)], the_plan=out), S)
    assert again.plan["replicas"]["launches"] == [0, 2, 0]  # the new launch died: again
    assert again.plan["quorum"]["id"] == 2  # it was out already: the same quorum


def test_an_out_replicas_stale_heartbeat_is_no_evidence_until_its_new_launch_runs():
    out = plan(members=(0, 2), launches=(0, 1, 0), qid=2)
    late = Overdue("n2", 2, "no heartbeat for 9 s")
    nodes = {n: node(n, port=5000 + i) for i, n in enumerate(NODES)}
    nodes["n2"] = node("n2", launch=0, port=5002)  # its agent has not relaunched yet
    assert decide(observed(nodes=nodes, the_plan=out, overdue=[late]), S).plan is None
    # Relaunched (its view says launch 1), before Redis's heartbeats are reset: the beat older
    # than the plan that relaunched it is the frozen launch's, no new failure.
    out["issued"] = NOW - 0.05
    nodes["n2"] = node("n2", launch=1, port=5002)
    stale = Overdue("n2", 2, "no heartbeat for 9 s", since=NOW - 9)
    assert decide(observed(nodes=nodes, the_plan=out, overdue=[stale]), S).plan is None
    # The new launch's own beat gone stale: its replica leaves again
    new = Overdue("n2", 2, "no heartbeat for 6 s", since=NOW - 0.04)
    again = decide(observed(nodes=nodes, the_plan=out, overdue=[new]), S).plan
    assert again is not None and again["replicas"]["launches"] == [0, 2, 0]


def test_a_replica_whose_every_rank_waits_is_let_back_in():
    out = plan(members=(0, 2), launches=(0, 1, 0), qid=2)
    nodes = {n: node(n, port=5000 + i) for i, n in enumerate(NODES)}
    nodes["n2"] = node("n2", launch=1, standby=1)
    nodes["n3"] = node("n3", launch=1, standby=0)  # one rank not yet waiting
    assert decide(observed(nodes=nodes, the_plan=out), S).plan is None
    nodes["n3"] = node("n3", launch=1, standby=1)
    d = decide(observed(nodes=nodes, the_plan=out), S)
    assert d.plan["quorum"]["id"] == 3 and d.plan["quorum"]["members"] == [0, 1, 2]
    assert [k for k, *_ in d.events] == ["replica_rejoined"]
    old = dict(nodes, n3=node("n3", launch=0, standby=1))  # standbys of the last launch
    assert decide(observed(nodes=old, the_plan=out), S).plan is None


def test_a_rejoin_keeps_the_quorum_store_where_the_members_met():
    out = plan(members=(1, 2), launches=(1, 0, 0), qid=2)
    out["quorum"].update(store_addr="host-n2", store_port=4002)  # replica 1's, since 0 left
    nodes = {n: node(n, port=5000 + i) for i, n in enumerate(NODES)}
    nodes.update(n0=node("n0", launch=1, standby=1), n1=node("n1", launch=1, standby=1))
    quorum = decide(observed(nodes=nodes, the_plan=out), S).plan["quorum"]
    assert quorum["members"] == [0, 1, 2]
    assert (quorum["store_addr"], quorum["store_port"]) == ("host-n2", 4002)  # not replica 0's


def test_the_job_completes_when_the_members_finish_without_the_replica_still_out():
    out = plan(members=(0, 2), launches=(0, 1, 0), qid=2)
    done = [Exit(n, r, 0, code=0, time=NOW) for r, n in enumerate(NODES) if r not in (2, 3)]
    d = decide(observed(done[:-1], the_plan=out), S)
    assert d.job.get("state") != COMPLETED
    d = decide(observed(done, the_plan=out), S)
    assert d.job["state"] == COMPLETED


def test_a_member_let_in_too_late_to_train_is_not_waited_for_at_the_end():
    done = [Exit(n, r, 0, code=0, time=NOW) for r, n in enumerate(NODES) if r not in (2, 3)]
    nodes = {n: node(n, port=5000 + i) for i, n in enumerate(NODES)}
    nodes["n2"] = node("n2", launch=1, standby=1)  # replica 1, let in at the last step
    nodes["n3"] = node("n3", launch=1, standby=0)  # ... one of its ranks got in: it trains
    assert decide(observed(done, nodes=nodes), S).job.get("state") != COMPLETED
    nodes["n3"] = node("n3", launch=1, standby=1)  # none got in
    assert decide(observed(done, nodes=nodes), S).job["state"] == COMPLETED


def test_a_new_generation_names_a_world_per_replica_and_every_replica_in_its_first_quorum():
    nodes = {n: node(n, gen=None, launch=None, port=5000 + i) for i, n in enumerate(NODES)}
    obs = Observed(now=NOW, job=JobView(), plan=None, nodes=nodes)
    p = decide(obs, S).plan
    Plan.parse(p)
    assert p["replicas"]["addrs"] == ["host-n0", "host-n2", "host-n4"]
    assert p["replicas"]["ports"] == [5000, 5002, 5004] and p["master_port"] == 5000
    assert p["quorum"] == {"version": 1, "id": 1, "members": [0, 1, 2],
                           "store_addr": "host-n0", "store_port": 5000}


def test_the_agent_places_each_rank_in_its_replicas_world():
    p = Plan.parse(plan(launches=(0, 1, 0)))
    launch = world(p, "n3", 0, quorum_file="/q")  # replica 1's second node
    assert launch[env.RANK] == "1" and launch[env.WORLD_SIZE] == "2"
    assert launch[env.MASTER_ADDR] == "host-n2" and launch[env.MASTER_PORT] == "4002"
    assert launch[env.REPLICA] == "1" and launch[env.QUORUM_FILE] == "/q"
    assert launch[env.REPLICA_LAUNCH] == "1"  # its replica's second launch: its heartbeats say
    assert relaunch_due(p, "n3", 0) and not relaunch_due(p, "n0", 0)
    # an operator's in-step fault names the job's rank 3; the rank knows itself as 1
    assert own_rank(p, "n3", 3, 0) == 1 and own_rank(None, "n3", 3, 0) == 3


@pytest.mark.parametrize(("bad", "said"), [
    ({"ports": [1, 2]}, "one entry per replica"),
    ({"launches": [0, -1, 0]}, "launches and quorum ids >= 0"),
])
def test_a_plan_whose_replica_worlds_do_not_add_up_is_refused(bad, said):
    p = plan()
    p["replicas"] = {**p["replicas"], **bad}
    with pytest.raises(RecordError, match=said):
        Plan.parse(p)


def test_config_refuses_continue_without_replicas_and_nodes_that_do_not_split():
    job = "jobs/tiny-gpt.yaml"
    with pytest.raises(ConfigError, match="parallel.replicas is 1: there is no other"):
        load_job(job, ["supervision.on_replica_loss=continue"])
    with pytest.raises(ConfigError, match="min_replicas: 4 is more than"):
        load_job(job, ["supervision.on_replica_loss=continue", "parallel.replicas=3",
                       "supervision.min_replicas=4"])
    three = load_job(job, ["supervision.on_replica_loss=continue", "parallel.replicas=3"])
    check_job(three)
    with pytest.raises(ConfigError, match="4 nodes do not split into 3"):
        check_replica_nodes(three, 4)
    check_replica_nodes(three, 6)


def test_an_operators_exclusion_takes_only_that_nodes_replica_out_and_counts_no_restart():
    """n3 (replica 1) excluded by an operator: replica 1 alone leaves, the spare takes n3's
    slot, the generation runs on; no restart counted. Excluding a node of replica 2 then (1 is
    out, min_replicas 2): the generation stops, and says why not the replica alone."""
    excluded = {"n3": "operator: bad memory"}
    d = decide(observed(excluded=excluded), S)
    p = d.plan
    Plan.parse(p)
    assert p["action"] == "run" and p["generation"] == 0
    assert p["quorum"]["members"] == [0, 2] and p["replicas"]["launches"] == [0, 1, 0]
    assert p["nodes"][3] == "spare" and p["replicas"]["ports"][1] == 5002
    assert "restarts" not in d.job and d.job.get("state", RUNNING) == RUNNING
    assert [k for k, *_ in d.events] == ["replica_lost"]
    assert "excluded by an operator (operator: bad memory)" in d.events[0][1]
    # A node of a member replica excluded while replica 1 is out: fewer than min_replicas
    nodes = {n: node(n, port=5000 + i) for i, n in enumerate(p["nodes"])}
    nodes["n3"] = node("n3", gen=None, launch=None, excluded="operator: bad memory")
    more = {**excluded, "n5": "operator: fan"}
    stop = decide(observed(nodes=nodes, the_plan=p, excluded=more), S)
    assert stop.plan["action"] == "stop" and stop.job["state"] == RESTARTING
    assert "not its replica alone" in stop.job["reason"]
    assert "min_replicas=2" in stop.job["reason"]
    # Restart mode: an exclusion stops the generation, as ever
    plain = replace(S, on_replica_loss="restart")
    assert decide(observed(excluded=excluded), plain).plan["action"] == "stop"
