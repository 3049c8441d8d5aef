"""The controller's relay against a real redis-server: each node writes its own keys, and only
its word about itself reaches the job-wide records (controller/control/relay.py, issue 29
item 5). What a node writes here is what its own ACL user may write (tests/test_trust_acl.py).
"""

from __future__ import annotations

import json
import time

import pytest
from cluster import relay
from records import exit_record, run_plan

from controller.control.relay import Relay, parse_row
from controller.store.own import row_text
from controller.store.store import Store

PLAN = run_plan(2, ["n0", "n1"], ranks_per_node=2)


def _store(redis_server) -> Store:
    store = Store(redis_server.url, "j")
    store.set_plan(PLAN)
    for node in ("n0", "n1", "n2"):
        store.own.register_node(node, {"host": node, "health": "ok"})
    return store


def _exit(node: str, rank: int, generation: int = 2, **more):
    return exit_record(node, rank, generation, local_rank=rank % 2, **more)


def _forge(store: Store, node: str, name: str, **token) -> None:
    """What node's own user may do beyond what its agent does: any entry in its own keys, and
    the row token that says so."""
    pipe = store.r.pipeline()
    store.own.put_row(pipe, node, **token)
    pipe.execute()


def test_an_exit_is_relayed_only_for_a_rank_the_plan_puts_on_its_node(redis_server):
    store = _store(redis_server)
    store.own.report_exit(_exit("n1", 3))  # n1 holds ranks 2 and 3
    store.own.report_exit(_exit("n1", 0))  # rank 0 is n0's
    store.own.report_exit(_exit("n2", 2))  # n2 runs nothing of generation 2
    store.own.report_exit(_exit("n1", 2, generation=3))  # not planned yet
    store.own.report_exit(_exit("n1", 0, generation=1))  # an older generation: kept as history
    store.r.xadd(store.k("node:n1:exits"), {"json": json.dumps(_exit("n0", 1).record())})
    store.r.xadd(store.k("node:n1:exits"), {"json": "[1, 2]"})
    # Whole and well typed, or refused with the line that names the field.
    store.r.xadd(store.k("node:n1:exits"), {"json": json.dumps(
        {k: v for k, v in _exit("n1", 2).record().items() if k != "pid"})})
    store.r.xadd(store.k("node:n1:exits"), {"json": json.dumps(
        {**_exit("n1", 2).record(), "rank": "2"})})
    _forge(store, "n1", "exits", exits=time.time_ns())
    said = relay(store)
    assert [(r["node"], r["rank"], r["generation"]) for _, r in store.exits()] == [
        ("n1", 3, 2), ("n1", 0, 1)]
    assert sorted(m for k, m in said if k == "relay_refused") == sorted([
        "not relayed from node n1: an exit record: generation 2's plan does not put rank 0 "
        "on n1",
        "not relayed from node n2: an exit record: generation 2's plan does not put rank 2 "
        "on n2",
        "not relayed from node n1: an exit record: generation 3 is not planned yet",
        "not relayed from node n1: an exit record: it names node 'n0'",
        "not relayed from node n1: an exit record: it is no JSON object",
        "not relayed from node n1: an exit record: field 'pid' is missing",
        "not relayed from node n1: an exit record: field 'rank' should be a valid integer "
        "(got '2')"])


def test_a_leader_that_takes_over_relays_nothing_twice_and_skips_nothing(redis_server):
    store = _store(redis_server)
    store.own.report_exit(_exit("n0", 0))
    store.event("agent:n0", "note", "first")  # an agent's store speaks for its node...
    store.own.speak_as("n0")
    store.event("agent:n0", "note", "mine")  # ...once it is told which
    assert store.fence.hold_lease("a", 60)
    first = Relay(store, lambda *a, **f: None, holder="a")
    first.run(PLAN)
    store.own.report_exit(_exit("n0", 1))
    store.event("agent:n0", "note", "later")
    store.r.delete(store.k("leader"))  # a's lease ran out (a paused) and b took it over
    assert store.fence.hold_lease("b", 60)
    Relay(store, lambda *a, **f: None, holder="b").run(PLAN)  # from the stored cursors
    store.own.report_exit(_exit("n0", 0, generation=1))
    first.run(PLAN)  # a wakes up mid-tick, caches and all: it writes nothing
    assert first.cursors is None  # and reads the cursors again if it ever leads again
    assert [r["rank"] for _, r in store.exits()] == [0, 1]
    notes = [(e["actor"], e["message"]) for _, e in store.events() if e["kind"] == "note"]
    assert notes == [("agent:n0", "first"), ("agent:n0", "mine"), ("agent:n0", "later")]


def test_an_event_is_relayed_under_its_nodes_name_whatever_it_says(redis_server):
    store = _store(redis_server)
    store.r.xadd(store.k("node:n1:events"), {
        "time": "1", "actor": "controller", "kind": "failure", "node": "n0",
        "message": "x" * 20_000, **{f"f{i}": "v" for i in range(50)}})
    _forge(store, "n1", "events", events=time.time_ns())
    relay(store)
    ((_, event),) = store.events()
    assert (event["actor"], event["node"], event["kind"]) == ("agent:n1", "n1", "failure")
    assert len(event["message"]) == 8_192 and len(event) <= 34


def test_a_rendezvous_port_comes_from_the_node_of_rank_0_only(redis_server):
    store = _store(redis_server)
    n1 = Store(redis_server.url, "j")
    n1.own.speak_as("n1")
    n1.own.set_master_port(2, 4242)
    said = relay(store)
    assert store.master_port(2) is None
    assert said == [("relay_refused", "not relayed from node n1: a rendezvous port for "
                     "generation 2, whose rank 0 the plan puts on another node")]
    n0 = Store(redis_server.url, "j")
    n0.own.speak_as("n0")
    n0.own.set_master_port(2, 5151)
    relay(store)
    assert store.master_port(2) == 5151


def test_stacks_are_relayed_for_the_nodes_own_ranks(redis_server):
    store = _store(redis_server)
    n1 = Store(redis_server.url, "j")
    n1.own.speak_as("n1")
    n1.own.put_stacks(2, {2: "stack of 2", 0: "a stack for n0's rank", 3: "stack of 3"})
    said = relay(store)
    assert store.reports.stacks(2) == {2: "stack of 2", 3: "stack of 3"}
    assert [k for k, _ in said] == ["relay_refused"]


def test_summaries_and_deadlines_are_relayed_for_the_plans_nodes_only(redis_server):
    from controller.store.summaries import NodeSummary

    store = _store(redis_server)
    now = time.time()
    summary = NodeSummary(max_step=9, min_step=8, outside=1, nonfinite=True, compute_s=0.25)
    for node in ("n0", "n2"):
        store.own.agent_tick(node, {"state": "running"}, {}, now - 5, False, summary)
    relay(store)
    assert store.overdue(now) == {"n0": now - 5}
    summaries = store.summaries
    assert summaries.node_steps() == {"n0": 9.0} and summaries.compute_scores() == {"n0": 0.25}
    assert store.summaries.sweep(["n0", "n1"]).nonfinite == ["n0"]
    assert set(store.agent_beats()) == {"n0", "n1", "n2"}  # every node's agent beat


def test_a_row_the_agent_would_not_write_is_not_relayed(redis_server):
    store = _store(redis_server)
    relay(store)
    before = store.agent_beats()["n1"]
    for text in ("r2 nan", row_text({"beat": 1.0}).replace("r2", "r1"),
                 row_text({"beat": float("nan")}), row_text({"beat": 1.0}) + " extra"):
        store.r.set(store.k("node:n1:row"), text)
        said = relay(store)
        assert store.agent_beats()["n1"] == before, text
        assert said == [("relay_refused", "not relayed from node n1: its row is not one the "
                         "agent writes")]
    assert parse_row(row_text({"beat": 2.5, "deadline": None}))["beat"] == 2.5


def test_snapshot_reports_and_earlier_incarnations_are_relayed_and_dropped(redis_server):
    store = _store(redis_server)
    store.own.set_snapshots("n1", {"incarnation": "a", "own": {}}, first=True)
    relay(store)
    store.own.set_snapshots("n1", {"incarnation": "b", "own": {}}, first=True)  # a restart
    store.r.hset(store.k("node:n1:snapshots"), "@../x y", "{}")  # no incarnation name
    relay(store)
    assert {k: v["incarnation"] for k, v in store.reports.snapshots().items()} == {"n1": "b",
                                                                          "n1@a": "a"}
    store.reports.drop_snapshots(["n1@a"])
    store.own.set_snapshots("n1", {"incarnation": "b", "own": {"x": [0]}})
    relay(store)
    assert set(store.reports.snapshots()) == {"n1"}  # dropped where the node keeps it too


def test_a_node_found_once_it_writes_and_a_non_name_never(redis_server):
    store = Store(redis_server.url, "j")
    store.r.set(store.k("node:bad name:row"), row_text({"beat": time.time()}))
    store.r.set(store.k("node:n5:row"), row_text({"beat": time.time()}))
    relay(store)
    assert set(store.agent_beats()) == {"n5"}


def test_a_pass_that_fails_to_write_is_done_again_whole(redis_server, monkeypatch):
    """Redis gone between the reads and the writes: the cursors read were not stored, so the
    next pass relays the same records, once."""
    from controller.store.store import StoreUnavailable

    store = _store(redis_server)
    store.own.report_exit(_exit("n0", 1))
    passes = Relay(store, lambda *a, **f: None)
    real = store.mirror.write

    def down(w, holder=None):
        raise StoreUnavailable("Redis did not answer")
    monkeypatch.setattr(store.mirror, "write", down)
    with pytest.raises(StoreUnavailable):
        passes.run(PLAN)
    monkeypatch.setattr(store.mirror, "write", real)
    passes.run(PLAN)
    passes.run(PLAN)
    assert [r["rank"] for _, r in store.exits()] == [1]


def test_a_row_written_before_the_one_relayed_is_not_relayed(redis_server):
    """A write a network cut held in the kernel's send buffer reaches Redis after the heal,
    over the agent's newer row: relayed, its beat would make a healthy node's agent seconds
    silent. Earlier by both its writer's monotonic clock (seq) and its beat: skipped; the next
    row goes through; either clock alone going back (a reboot, an NTP step) is believed."""
    store = _store(redis_server)
    passes = Relay(store, lambda *a, **f: None)
    key = store.k("node:n0:row")

    def write(beat: float, seq: float, info: str = "7") -> None:
        store.r.set(key, row_text({"beat": beat, "info": info, "seq": seq}))
        passes.run(PLAN)

    write(1000.0, seq=50.0)
    assert store.agent_beats()["n0"] == 1000.0
    write(987.0, seq=37.0)  # 13 s older: the late write
    assert store.agent_beats()["n0"] == 1000.0
    write(1001.0, seq=51.0)
    assert store.agent_beats()["n0"] == 1001.0
    write(1002.0, seq=2.0, info="8")  # the host rebooted: its monotonic clock starts again
    assert store.agent_beats()["n0"] == 1002.0
    write(990.0, seq=3.0, info="8")  # NTP stepped the wall clock back: the agent's word
    assert store.agent_beats()["n0"] == 990.0
    # the row an agent writes carries its clock, rising with every write
    first = parse_row(store.r.get(store.k("node:n1:row")))["seq"]
    store.own.speak_as("n1")
    store.own.register_node("n1", {"host": "n1", "health": "ok"})
    assert parse_row(store.r.get(store.k("node:n1:row")))["seq"] > first
