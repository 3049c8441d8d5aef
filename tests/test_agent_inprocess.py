"""The agent's side of in-process restart (controller/node/lifecycle.py), on real processes
that stand in for ranks (a shell that ignores SIGTERM): who is killed at a failed generation's
grace and who is given longer to leave, how a rank that left is reported, and how a waiting
rank is told to go."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections import deque
from pathlib import Path

from records import run_plan

from controller.node.lifecycle import LEAVE_S
from controller.node.ranks import RankProcess
from controller.store.store import Store
from optimus.contract.records import Culprit, Plan

# Generation 0 of two ranks on n0, restarting in process.
IN_PROCESS = Plan.parse(run_plan(0, ["n0"], 2, restart="in_process"))


@contextlib.contextmanager
def _agent(redis_server, tmp_path, monkeypatch, socket_dir):
    from controller.node.agent import Agent

    monkeypatch.setenv("OPTIMUS_WARM_START", "0")  # no warm process: ranks are ours here
    store = Store(redis_server.url, "j")
    agent = Agent(store, "n0", socket_dir=str(socket_dir), snapshot_root=tmp_path / "snap")
    procs = []
    try:
        yield agent, store, procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()
        agent.spawner.close()
        agent.snapshots.close()
        agent.ranks.close()


def _rank(agent, procs, rank: int, local_rank: int, tmp_path: Path) -> RankProcess:
    # A rank blocked where a SIGTERM cannot reach it (a collective with a dead peer); it says
    # so once SIGTERM is ignored (an ignored signal stays ignored across exec), before any
    # stop can reach it.
    popen = subprocess.Popen(["sh", "-c", "trap '' TERM; echo ignoring; exec sleep 300"],
                             stdout=subprocess.PIPE, start_new_session=True)
    procs.append(popen)
    assert popen.stdout.readline() == b"ignoring\n"
    popen.stdout.close()
    log = tmp_path / f"rank{rank}.log"
    log.write_text("RuntimeError: Read error [127.0.0.1]:1: Connection reset by peer\n"
                   "generation 0 ended under this rank: a peer is gone\n")
    p = RankProcess(rank, local_rank, popen, log, time.time(), compute=deque(maxlen=4))
    agent.ranks.procs[local_rank] = p
    return p


def _left_rank(agent, procs, tmp_path: Path, exit_code: int) -> RankProcess:
    """Rank 0 of a generation 0 that restarts in process, after its "ready" beat."""
    agent.ranks.generation, agent.ranks.plan = 0, IN_PROCESS
    p = _rank(agent, procs, 0, 0, tmp_path)
    agent.ranks.left(p, {"phase": "ready", "exit_code": exit_code, "generation": 0})
    return p


def _own(store: Store, what: str) -> list[dict]:
    return [f for _, f in store.r.xrange(store.k(f"node:n0:{what}"))]


def test_the_culprit_dies_at_the_grace_and_the_others_get_longer_to_leave(
        redis_server, tmp_path, monkeypatch, socket_dir):
    with _agent(redis_server, tmp_path, monkeypatch, socket_dir) as (agent, store, procs):
        agent.ranks.generation, agent.ranks.plan = 0, IN_PROCESS
        failed = IN_PROCESS.model_copy(update={"action": "stop", "culprit": Culprit(
            node="n0", rank=1)})  # generation 0 failed: rank 1's fault
        survivor, culprit = (_rank(agent, procs, r, r, tmp_path) for r in (0, 1))
        agent.ranks.stop(1.0)
        assert survivor.stop_sent and culprit.stop_sent  # both were told (SIGTERM)
        for p in (survivor, culprit):
            p.stop_sent = time.monotonic() - 0.01  # the grace is over
        agent.ranks.escalate(failed)
        assert culprit.popen.wait(timeout=10) == -9  # SIGKILL, at the grace
        assert survivor.popen.poll() is None and survivor.spared
        assert survivor.stop_sent - time.monotonic() > LEAVE_S - 1  # max(grace, LEAVE_S) more
        survivor.stop_sent = time.monotonic() - 0.01  # and that is over too
        agent.ranks.escalate(failed)
        assert survivor.popen.wait(timeout=10) == -9
        agent.store.flush_events()
        (said,) = [e for e in _own(store, "events") if e["kind"] == "restart"]
        assert said["restart"] == "process" and said["rank"] == "0"
        assert "did not leave its generation in process" in said["message"]


def test_a_rank_that_left_is_reported_as_its_exit_would_be_and_runs_no_more(
        redis_server, tmp_path, monkeypatch, socket_dir):
    with _agent(redis_server, tmp_path, monkeypatch, socket_dir) as (agent, store, procs):
        p = _left_rank(agent, procs, tmp_path, exit_code=1)
        agent.ranks.flush_exits()
        (record,) = [json.loads(f["json"]) for f in _own(store, "exits")]
        assert (record["code"], record["signal"], record["by_agent"], record["in_process"]) == (
            1, None, False, True)
        assert "Connection reset by peer" in record["tail"]  # the controller: collateral
        assert p.ready and not p.running and not agent.ranks.live()
        assert agent.ranks.waiting() == {0: p}
        agent.ranks.stop(1.0)  # the generation stops: a stop is not for a rank that left
        assert p.stop_sent is None and p.popen.poll() is None
        # A forged status is refused as any: not an int in 0..255 is reported as 1.
        q = _rank(agent, procs, 1, 1, tmp_path)
        agent.ranks.left(q, {"phase": "ready", "exit_code": "0; rm -rf", "generation": 0})
        agent.ranks.flush_exits()
        assert json.loads(_own(store, "exits")[-1]["json"])["code"] == 1


def test_a_waiting_rank_with_no_next_generation_is_told_to_exit_then_killed(
        redis_server, tmp_path, monkeypatch, socket_dir):
    with _agent(redis_server, tmp_path, monkeypatch, socket_dir) as (agent, store, procs):
        p = _left_rank(agent, procs, tmp_path, exit_code=0)
        # The next generation runs elsewhere: this node's waiting rank is dismissed.
        agent.ranks.follow(Plan.parse(run_plan(1, ["n1", "n2"])))
        assert json.loads(agent.files.next_path(0).read_text()) == {"exit": True, "generation": 0,
                                                                     "launch": 0}
        assert p.popen.poll() is None  # it has its time to exit on its own
        p.stop_sent = time.monotonic() - 0.01
        agent.ranks.escalate(None)  # it did not: killed
        assert p.popen.wait(timeout=10) == -9
        agent.ranks.reap()
        agent.ranks.flush_exits()
        assert len(_own(store, "exits")) == 1  # its leaving, and not its death again


def test_a_new_agent_waits_for_a_resubmission_before_leaving_on_an_ended_plan(
        redis_server, tmp_path, monkeypatch, socket_dir):
    """The ended plan a new agent finds may be the last submission's, which a controller
    started beside it (--resubmit, --allocation) is about to replace: it leaves on it only once
    it has been up FRESH_END_S. An agent that saw the job run leaves at once."""
    from controller.node import lifecycle

    ended = Plan.parse({"version": 1, "generation": 0, "action": "end", "nodes": ["n0"],
                        "reason": "FAILED"})
    with _agent(redis_server, tmp_path, monkeypatch, socket_dir) as (agent, store, procs):
        agent.ranks.follow(ended)
        assert not agent.ranks.ended  # a new agent: the end may be an earlier submission's
        agent.ranks.end_seen -= lifecycle.FRESH_END_S  # no new plan came in time
        agent.ranks.follow(ended)
        assert agent.ranks.ended
        agent.ranks.ended, agent.ranks.end_seen = False, time.monotonic()  # as new again
        agent.ranks.follow(Plan.parse(run_plan(0, ["n1"])))  # a spare here
        agent.ranks.follow(ended)
        assert agent.ranks.ended  # it saw the job run: the end is this submission's, at once
