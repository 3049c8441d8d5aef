"""The Redis schema module against a real redis-server: lease, agent tick, sweeps, outages."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from cluster import ROOT, free_port, relay, wait_for
from records import exit_record, run_plan

from controller.store.store import Store, StoreUnavailable, prefix
from controller.store.summaries import NodeSummary


def test_keys_share_one_cluster_slot_tag():
    assert prefix("gpt-1p3b") == "optimus:{gpt-1p3b}:"


def test_one_leader_at_a_time_and_the_lease_expires(redis_server):
    a, b = Store(redis_server.url, "j"), Store(redis_server.url, "j")
    assert a.fence.hold_lease("a", 0.5) and not b.fence.hold_lease("b", 0.5)
    assert a.fence.hold_lease("a", 0.5)  # renewed by its holder
    assert a.fence.leader() == "a"
    time.sleep(0.7)  # a stops renewing
    assert b.fence.hold_lease("b", 0.5) and not a.fence.hold_lease("a", 0.5)
    a.fence.release_lease("a")  # not a's to release
    assert b.fence.leader() == "b"
    b.fence.release_lease("b")
    assert a.fence.leader() is None


def test_agent_tick_is_one_round_trip_that_writes_beats_and_reads_plan_and_chaos(redis_server):
    s = Store(redis_server.url, "j")
    s.set_plan(run_plan(3, ["n0"]))
    s.push_command("n0", {"kind": "kill_rank", "rank": 1})
    now = time.time()
    tick = s.own.agent_tick("n0", {"generation": 3, "state": "running", "live_ranks": 2},
                        {0: {"step": 7, "time": now}}, deadline=now - 1, reset_ranks=True)
    assert tick.plan_stamp == "3:run:None"  # generation:action:issued; the plan read apart
    assert tick.commands == [{"kind": "kill_rank", "rank": 1}]
    assert tick.registered is False  # no `nodes` entry yet: the agent must register
    s.own.register_node("n0", {"host": "h", "health": "ok"})
    tick = s.own.agent_tick("n0", {"state": "running"}, {}, deadline=now + 60, reset_ranks=False)
    assert tick.registered and tick.commands == []
    assert s.rank_beats("n0")[0]["step"] == 7
    relay(s)  # the controller's: the job-wide records come from the nodes' own
    assert s.overdue(now) == {}  # deadline moved on
    assert set(s.nodes()) == {"n0"} and set(s.agent_beats()) == {"n0"}
    s.own.agent_tick("n0", {"state": "running"}, {}, deadline=now - 1, reset_ranks=False)
    assert s.overdue(now) == {}  # not relayed yet
    relay(s)
    assert s.overdue(now) == {"n0": now - 1}
    assert s.agent_status(["n0", "n9"]) == {"n0": {"generation": "3", "state": "running",
                                                   "live_ranks": "2"}}


def _summary(allocated: int | None, reserved: int | None) -> NodeSummary:
    return NodeSummary(max_step=4, min_step=4, outside=0, nonfinite=False, compute_s=None,
                       peak_allocated=allocated, peak_reserved=reserved)


def test_peak_memory_is_the_largest_of_any_node_and_leaves_with_its_ranks(redis_server):
    s = Store(redis_server.url, "j")
    s.set_plan(run_plan(0, ["n0", "n1"]))
    tick = {"status": {"state": "running"}, "rank_beats": {}, "deadline": None,
            "reset_ranks": False}
    for node in ("n0", "n1", "n2"):
        s.own.register_node(node, {"host": node, "health": "ok"})
    s.own.agent_tick("n0", **tick, summary=_summary(None, None))  # no step logged yet
    relay(s)
    assert s.summaries.peak_memory() is None
    s.own.agent_tick("n0", **tick, summary=_summary(3 << 30, 5 << 30))
    s.own.agent_tick("n1", **tick, summary=_summary(4 << 30, 4 << 30))
    s.own.agent_tick("n2", **tick, summary=_summary(9 << 30, 9 << 30))  # in no plan: not relayed
    relay(s)
    assert s.summaries.peak_memory() == {"allocated_bytes": 4 << 30, "allocated_node": "n1",
                               "reserved_bytes": 5 << 30, "reserved_node": "n0"}
    s.own.agent_tick("n1", **tick, summary=None)  # its ranks are gone
    relay(s)
    assert s.summaries.peak_memory() == {"allocated_bytes": 3 << 30, "allocated_node": "n0",
                               "reserved_bytes": 5 << 30, "reserved_node": "n0"}


def test_exits_stream_reads_after_a_cursor(redis_server):
    s = Store(redis_server.url, "j")
    s.set_plan(run_plan(0, ["n0"], ranks_per_node=2))
    s.own.register_node("n0", {"host": "n0", "health": "ok"})
    s.own.report_exit(exit_record("n0", 0, code=0))
    assert s.exits() == [] and relay(s) == []  # the node's own stream, until relayed
    cursor = s.last_exit_id()
    s.own.report_exit(exit_record("n0", 1, code=None, signal=9))
    relay(s)
    assert [r["rank"] for _, r in s.exits()] == [0, 1]
    assert [r["rank"] for _, r in s.exits(cursor)] == [1]
    relay(s)  # a pass after takes the cursor the last left: nothing twice
    assert [r["rank"] for _, r in s.exits()] == [0, 1]


def test_reset_forgets_the_job_but_keeps_its_event_history(redis_server):
    s = Store(redis_server.url, "j")
    other = Store(redis_server.url, "other")
    s.update_job({"state": "RUNNING"})
    s.set_plan({"generation": 0, "action": "end", "nodes": []})
    s.event("test", "note", "kept")
    other.update_job({"state": "RUNNING"})
    assert s.reset() == 3  # job, plan, plan:stamp
    assert s.job_record() == {} and s.plan() is None
    assert [e["message"] for _, e in s.events()] == ["kept"]
    assert other.job_record() == {"state": "RUNNING"}  # another job's keys are untouched


def test_an_outage_is_retried_then_reported_once(redis_server):
    s = Store(redis_server.url, "j", retry_s=3.0)
    redis_server.kill()
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="did not answer for 3 s"):
        s.job_record()
    assert time.monotonic() - started >= 2.5  # it retried for its window before saying so
    redis_server.start()  # back, empty: a call in the retry window succeeds
    assert s.job_record() == {}


def test_cli_names_an_unreachable_redis_and_a_wrong_password_in_one_line(tmp_path):
    port = free_port()  # nobody listens
    out = subprocess.run([sys.executable, "-m", "controller", "chaos", "kill-rank", "--job", "j",
                          "--rank", "0", "--redis", f"redis://127.0.0.1:{port}/0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith(f"error: nothing listens at redis://127.0.0.1:{port}/0 "
                                 "(connection refused)")

    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--requirepass", "secret"],
                              stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: subprocess.run(["redis-cli", "-p", str(port), "ping"],
                                        capture_output=True, text=True).stdout.strip()
                 in ("PONG", "NOAUTH Authentication required."), 30, "redis-server up")
        out = subprocess.run([sys.executable, "-m", "controller", "chaos", "kill-rank", "--job",
                              "j", "--rank", "0", "--redis",
                              f"redis://default:wrong@127.0.0.1:{port}/0"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert "refused the credentials" in out.stderr and "wrong" not in out.stderr
        ok = Store(f"redis://default:secret@127.0.0.1:{port}/0", "j")
        ok.ping()  # user and password from the URL
    finally:
        server.kill()
        server.wait()
