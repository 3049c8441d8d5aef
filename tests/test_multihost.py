"""Across hosts and a network (issue 56): every node in a network namespace of its own (its own
addresses, hostname and /etc/hosts), Redis and the controller on other hosts, links cut for
real (tests/hosts.py; what a cut does to TCP is said there). Each test is one job of the tiny
model (tests/cluster.py `write_job`), one rank per node; a job that must outlast what the test
watches runs without end (mh.ENDLESS steps) and is stopped once the test has seen it.

- three hosts replicate their in-memory snapshots over the data network, rank 0's rendezvous
  is planned at a data address, every rank runs in its agent's host; a batch template's
  MASTER_ADDR (an address nobody listens on), RANK and WORLD_SIZE in every agent's
  environment are dropped with one warning each, and the job recovers on the spare from the
  loss of rank 0's node (its agent SIGKILLed, its ranks with it) and completes;
- Redis cut off by silence (its own host's management link down 9 s): no step lost, no
  exclusion, no restart;
- the agents cut off from Redis while the controller still reaches it (the control host's
  management link down 9 s): one restart at most (writes TCP held back during the cut land
  after the heal, 13 s late: the relay does not relay them);
- a node cut off on both networks mid-run: named lost in seconds, the spare takes its place
  from the memory snapshot (the shards its buddy held); healed, its agent beats again and it
  goes back among the spares (flap forgiveness);
- in tests/test_multihost_faults.py: a host whose own name resolves to 127.0.1.1 (Debian's
  /etc/hosts), its agent refused at registration in one line; a node's data link cut, its
  management link up, named by the mesh check before a launch and replaced from memory
  mid-run long before hang_timeout_s; the leader frozen and cut off the instant its plan for
  generation 1 lands, a standby on another host adopting generation 1 (one restart), the old
  leader, healed and thawed, writing no decision.

Time taken here, each test with its set-up (one worker, an idle two-core VM; making the hosts
and starting Redis take ~0.5 s of it; the session's warm server imports the trainer once, ~5 s
of CPU, beside the first test's set-up):
  three hosts, replication, rank 0's node lost          12-15 s
  Redis cut off by silence                              22 s
  agents cut off from Redis                             22-26 s
  a node cut off, replaced, back (two tests, one run)   18-30 s
  a hostname resolving to loopback                      3 s
  a data link cut before launch and mid-run             25-27 s
  the leader cut off mid-decision                       20-25 s
  this file and tests/test_multihost_faults.py, two workers: 8 passed in 102 s
"""

from __future__ import annotations

import ipaddress
import json
import time

import multihost as mh
import pytest
from cluster import metrics, wait_for, write_job
from hosts import (  # noqa: F401 (host_warm_server, hosts: fixtures)
    Hosts,
    host_warm_server,
    hosts,
    same_host,
    simulated_hosts,
)

# What a site's batch template exports into every agent's environment: rank 0 at an address
# nobody listens on (set per test to one of its data network's unused addresses), and the
# ranks of another launcher.
TEMPLATE = {"MASTER_PORT": "29511", "RANK": "5", "WORLD_SIZE": "9", "LOCAL_RANK": "3"}


# --- three hosts, replication over the bridge, a batch template's rendezvous ignored ---------


def test_three_hosts_replicate_over_the_data_network_and_recover_rank_0s_node(
        hosts, tmp_path):  # noqa: F811 (tests/hosts.py's fixture)
    h = hosts("node0", "node1", "node2")
    h.start_redis()
    run = tmp_path / "run"
    steps, fault_step = 120, 12
    job = write_job(tmp_path / "job.yaml", run, steps=steps, memory_every=2)
    nowhere = str(h.data_net.network_address + 250)  # in the data network, never assigned
    mh.start(h, job, ["node0", "node1", "node2"], plan_nodes=2,
           env={**TEMPLATE, "MASTER_ADDR": nowhere})
    store = h.store("e2e")
    plan = mh.generation(store, 0)
    first, second = plan["nodes"]
    (spare,) = {"node0", "node1", "node2"} - {first, second}
    # Rank 0's rendezvous: the data address its node advertised, not loopback, not the
    # template's.
    assert plan["master_addr"] == h[first].data
    assert ipaddress.ip_address(plan["master_addr"]) in h.data_net
    assert {n: i["host"] for n, i in store.nodes().items()} == {
        n: h[n].data for n in ("node0", "node1", "node2")}

    def replicated() -> dict | None:
        """node -> (its snapshot server, a point its buddy confirmed and holds), once every
        node of the plan has one."""
        reports, found = store.reports.snapshots(), {}
        for node in plan["nodes"]:
            buddy = plan["buddies"][node]["node"]
            mine, theirs = reports.get(node, {}), reports.get(buddy, {})
            points = [p for p, b in mine.get("replicated", {}).items()
                      if b == buddy and p in theirs.get("held", {})]
            if not points:
                return None
            found[node] = (mine["addr"], buddy, theirs["addr"], points[-1])
        return found
    copies = wait_for(replicated, 120, "a snapshot of each node held by its buddy")
    for node, (addr, buddy, buddy_addr, _) in copies.items():
        assert buddy != node
        assert addr.rpartition(":")[0] == h[node].data  # served at its data address
        assert buddy_addr.rpartition(":")[0] == h[buddy].data  # pushed to another host
    mh.ranks_in_their_hosts(h, store, plan)

    wait_for(lambda: mh.rank0_step(store, plan) >= fault_step, 120, f"step {fault_step}")
    h.kill(f"agent-{first}")  # SIGKILL: its ranks die with it, as on a real node
    mh.finished(h, 240)

    journal = json.loads((run / "controller.json").read_text())
    assert journal["job"]["state"] == "COMPLETED"
    assert journal["job"]["restarts"] == "1"
    assert list(journal["excluded"]) == [first]
    assert "its host refused a connection" in journal["excluded"][first]["reason"]
    after = journal["plan"]
    # The spare took the lost node's place, rank 0 with it: the rendezvous moved to the
    # spare's data address, where every rank went (none waited at the template's).
    assert after["generation"] == 1 and after["nodes"] == [spare, second]
    assert after["master_addr"] == h[spare].data
    assert [m for m in metrics(run) if "loss" in m][-1]["step"] == steps
    for node in ("node0", "node1", "node2"):
        said = [line for line in h.log(f"agent-{node}").splitlines()
                if "do not inherit" in line]
        assert len(said) == 1, (node, said)
        assert "LOCAL_RANK, MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE" in said[0]


# --- Redis cut off by silence; the agents cut off from it ----------------------------------------

def test_redis_cut_off_by_silence_costs_no_step(
        hosts, tmp_path):  # noqa: F811 (tests/hosts.py's fixture)
    """Redis on a host of its own, its management link down for 9 s while the job runs: the
    agents and the controller all lose it (a silent cut: their connections time out, none is
    refused). The ranks train on; nobody is excluded, in the cut nor in the 10 s after the
    heal (when what the cut held back lands); generation 0 runs on until it is stopped."""
    h = hosts("node0", "node1", "redis")
    h.start_redis("redis")
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", run, steps=mh.ENDLESS)
    mh.start(h, job, ["node0", "node1"], plan_nodes=2)
    store = h.store("e2e")
    plan = mh.generation(store, 0)
    wait_for(lambda: mh.rank0_step(store, plan) >= 10, 120, "step 10")
    trace = mh.cut_for(h, run, "redis", "mgmt", 9)
    # Training went on through the cut: steps in each half of it, none undone (a second
    # without a new step is a slow step on a busy machine, not a stop).
    half = len(trace) // 2
    assert all(b >= a for a, b in zip(trace, trace[1:], strict=False)), trace
    assert trace[0] < trace[half] < trace[-1], trace
    time.sleep(10)  # what the cut held back lands ~4 s after the heal (TCP's backoff)
    assert store.excluded() == {}
    mh.stop(h, store, run)
    journal = json.loads((run / "controller.json").read_text())
    assert journal["job"]["state"] == "STOPPED"
    assert journal["excluded"] == {}
    assert journal["job"]["restarts"] == "0" and journal["plan"]["generation"] == 0
    rows = [m for m in metrics(run) if "loss" in m]
    assert [m["step"] for m in rows] == list(range(1, len(rows) + 1))  # every step, once
    assert rows[-1]["step"] > trace[-1]
    assert not [m for m in metrics(run) if m.get("event") == "resume"]
    assert not mh.events(run, "failure"), mh.events(run, "failure")


def test_agents_cut_off_from_redis_cost_one_restart_at_most(
        hosts, tmp_path):  # noqa: F811 (tests/hosts.py's fixture)
    """Redis and the controller on the control host, whose management link is down for 9 s:
    to the controller (which still reaches Redis) every agent falls silent, and one is lost
    past agent_timeout_s (8 s): one restart, by design, the node forgiven once back (flap
    forgiveness). What must not follow is a second: the agents' Redis clients gave up their
    connections during the cut, but the kernel still holds what they had sent and
    retransmits it after the heal (~13 s after it was sent: TCP's backoff). Each agent's row
    from before the cut then overwrites its fresh one, its beat 13 s old; relayed, a healthy
    node was named "lost: its agent has been silent for 13.4 s" 4.5 s after the heal, and the
    job restarted a second time. The relay knows such a row late by its writer's clock
    (controller/control/relay.py `_late`) and does not relay it."""
    h = hosts("node0", "node1", "node2")
    h.start_redis()
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", run, steps=mh.ENDLESS)
    mh.start(h, job, ["node0", "node1", "node2"], plan_nodes=2)
    store = h.store("e2e")
    plan = mh.generation(store, 0)
    wait_for(lambda: mh.rank0_step(store, plan) >= 10, 120, "step 10")
    mh.cut_for(h, run, "control", "mgmt", 9)
    healed_at = time.time()
    time.sleep(10)
    mh.stop(h, store, run)
    journal = json.loads((run / "controller.json").read_text())
    assert journal["job"]["state"] == "STOPPED"
    late = [e["message"] for e in mh.events(run, "failure") if float(e["time"]) > healed_at]
    assert not late, late
    assert int(journal["job"]["restarts"]) <= 1, mh.events(run, "failure")
    assert journal["excluded"] == {}  # the lost node forgiven


# --- a node cut off, replaced from memory; healed, back ----------------------------------------

NODE_CUT_AT = 12
FORGIVE_S = 30  # how long the run waits for the healed node to go back among the spares


@pytest.fixture(scope="module")
def node_cut(host_warm_server, tmp_path_factory):  # noqa: F811 (tests/hosts.py's)
    """One run for the two tests below: the plan's node 1 cut off on both networks at step
    NODE_CUT_AT, healed once generation 1 runs on the spare, the job stopped once the healed
    node's agent beats again and is back among the spares (or FORGIVE_S later); what was
    seen, when."""
    tmp = tmp_path_factory.mktemp("node-cut")
    with simulated_hosts(tmp / "hosts", ["node0", "node1", "node2"],
                         warm_server=host_warm_server) as h:
        h.start_redis()
        run = tmp / "run"
        job = write_job(tmp / "job.yaml", run, steps=mh.ENDLESS, memory_every=2)
        mh.start(h, job, ["node0", "node1", "node2"], plan_nodes=2)
        store = h.store("e2e")
        plan = mh.generation(store, 0)
        culprit = plan["nodes"][1]
        wait_for(lambda: mh.rank0_step(store, plan) >= NODE_CUT_AT, 120, f"step {NODE_CUT_AT}")
        h.cut(culprit, "both")
        cut_at = time.time()
        step_at_cut = mh.steps(run)  # at least the memory snapshot generation 1 resumes from
        excluded = wait_for(lambda: store.excluded().get(culprit), 60, f"{culprit} excluded")
        named_s = time.time() - cut_at
        wait_for(lambda: (store.job_record().get("state") == "RUNNING"
                          and (store.plan() or {}).get("generation") == 1), 120,
                 "generation 1 running")
        h.heal(culprit, "both")
        healed_at = time.time()

        def beats_again() -> float | None:  # its agent's beat, as the controller relays it
            beat = store.agent_beats().get(culprit, 0.0)
            return beat > healed_at and beat
        back_s = wait_for(beats_again, 60, f"{culprit}'s agent to beat again") - healed_at
        # Back among the spares, while the job runs (flap forgiveness)?
        deadline = time.monotonic() + FORGIVE_S
        while culprit in store.excluded() and time.monotonic() < deadline:
            time.sleep(0.2)
        forgiven = culprit not in store.excluded()
        # Generation 1 trains on: however loaded the machine, its first logged step comes.
        gen1_step = wait_for(lambda: (mh.steps(run) > step_at_cut) and mh.steps(run), 120,
                             "generation 1 to log a step past the cut")
        mh.stop(h, store, run)
        yield {"run": run, "culprit": culprit, "plan0": plan, "excluded": excluded,
               "named_s": named_s, "back_s": back_s, "forgiven": forgiven,
               "gen1_step": gen1_step, "agent_pid": h.procs[f"agent-{culprit}"].pid,
               "agent_log": h.log(f"agent-{culprit}")}


def test_a_node_cut_off_is_replaced_from_its_buddys_copy_and_its_agent_comes_back(node_cut):
    run, culprit = node_cut["run"], node_cut["culprit"]
    # Named lost in seconds: its agent silent, and two probes of its host unanswered (a cut
    # drops them: no refusal), not after the 8 s agent timeout.
    assert node_cut["named_s"] < 8, node_cut
    reason = node_cut["excluded"]["reason"]
    assert f"node {culprit} lost: its agent has been silent" in reason, reason
    journal = json.loads((run / "controller.json").read_text())
    assert journal["job"]["state"] == "STOPPED", journal["job"]
    survivor = node_cut["plan0"]["nodes"][0]
    spare = ({"node0", "node1", "node2"} - set(node_cut["plan0"]["nodes"])).pop()
    # The spare took the cut node's place with the shards its buddy held: from memory.
    gen1 = [e["message"] for e in mh.events(run, "generation")
            if e["message"].startswith("generation 1 ")]
    assert len(gen1) == 1 and f"generation 1 on {survivor}, {spare} from the memory snapshot" \
        in gen1[0], gen1
    resume = [m for m in metrics(run) if m.get("event") == "resume"][0]
    assert resume["source"] == "memory", resume
    assert node_cut["gen1_step"] > resume["step"]  # generation 1 trained on
    # Healed, the cut node's agent (the same process: it never exited) beat again.
    assert node_cut["back_s"] < 30, node_cut
    assert "exits" not in node_cut["agent_log"]


def test_a_node_cut_off_and_healed_goes_back_among_the_spares(node_cut):
    assert node_cut["forgiven"], f"still excluded {FORGIVE_S} s after its agent beat again"
    forgiven = [e for e in mh.events(node_cut["run"], "forgiven")
                if e.get("node") == node_cut["culprit"]]
    assert len(forgiven) == 1, forgiven
    journal = json.loads((node_cut["run"] / "controller.json").read_text())
    assert journal["job"]["restarts"] == "1"  # its return cost the job nothing more
