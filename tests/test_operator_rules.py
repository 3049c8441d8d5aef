"""Operators' requests as the controller takes them: pure rules over one snapshot."""

from __future__ import annotations

from dataclasses import replace

from test_decide import NOW, S, busy, node, running, running_plan

from controller.control.decide import (
    PAUSED,
    PAUSING,
    RESTARTING,
    RUNNING,
    STOPPING,
    JobView,
    Observed,
    Request,
    Settings,
    decide,
)
from controller.control.operator import refusal


def ask(action: str, n: int = 1, **fields) -> Request:
    return Request(id=f"{n}-0", action=action, actor="ana", host="desk", time=NOW, **fields)


def test_pause_sets_the_control_word_then_pausing_then_paused_once_every_node_is():
    d = decide(running(requests=[ask("pause", reason="maintenance", checkpoint=True)],
                       control={"pause": False, "checkpoint": 2}), S)
    assert d.control == {"pause": True, "checkpoint": 3}  # and a checkpoint first
    assert d.job["state"] == PAUSING and d.job["desired"] == "pause"
    assert d.job["requests_seen"] == "1-0"
    (event,) = [e for e in d.events if e[0] == "pause"]
    assert event[1] == "pause asked by ana@desk, after a checkpoint: maintenance"
    assert event[2] == {"request": "1-0", "actor": "ana", "host": "desk",
                        "reason": "maintenance"}
    job = busy(state=PAUSING, desired="pause", desired_by="ana@desk", requests_seen="1-0")
    half = decide(running(job=job, paused_nodes=1, progress=5), S)
    assert "state" not in half.job  # one node of two has paused: still PAUSING
    full = decide(running(job=job, paused_nodes=2, progress=5), S)
    assert full.job["state"] == PAUSED and "paused at step 5 by ana@desk" in full.job["reason"]


def test_a_paused_job_never_looks_hung_or_slow_and_resume_restarts_the_stall_clock():
    job = busy(state=PAUSED, desired="pause", desired_by="ana@desk", progress_at=NOW - 5000)
    quiet = decide(running(job=job, paused_nodes=2, progress=5, compute={"n0": 1, "n1": 9}), S)
    assert quiet.plan is None and quiet.commands == [] and "state" not in quiet.job
    d = decide(running(job=job, paused_nodes=2, progress=5, requests=[ask("resume")],
                       control={"pause": True, "checkpoint": 0}), S)
    assert d.control == {"pause": False, "checkpoint": 0}
    assert d.job["state"] == RUNNING and d.job["progress_at"] == NOW
    assert [e[0] for e in d.events] == ["resume", "resumed"]


def test_a_failure_while_paused_still_restarts_and_the_next_generation_starts_pausing():
    job = busy(state=PAUSED, desired="pause", desired_by="ana@desk")
    from controller.control.decide import Exit

    d = decide(running(job=job, exits=[Exit("n1", 2, 0, code=None, signal=9)]), S)
    assert d.job["state"] == RESTARTING and d.job["restart_causes"] == {"rank_exit": 1}
    restarting = JobView(state=RESTARTING, generation=0, desired="pause", next_plan_at=NOW)
    nodes = {n: node(n) for n in ("n0", "n2")}
    plan = {**running_plan(), "action": "stop"}
    again = decide(Observed(now=NOW, job=restarting, plan=plan, nodes=nodes), S)
    assert again.plan["generation"] == 1 and again.job["state"] == PAUSING


def test_excluding_a_running_node_checkpoints_and_restarts_without_it_not_as_a_failure():
    d = decide(running(requests=[ask("exclude", node="n1", reason="ECC errors")]), S)
    assert d.operator_exclude == [("n1", {"reason": "ECC errors", "by": "ana@desk",
                                          "host": "desk", "time": NOW, "mode": "exclude"})]
    assert d.plan["action"] == "stop" and d.plan["grace_s"] == S.stop_grace_s  # time to save
    assert d.job["state"] == RESTARTING and d.job["next_plan_at"] == NOW
    assert "restarts" not in d.job and d.job["restart_causes"] == {"operator": 1}
    # Drained ranks gone, the next generation takes the spare and leaves n1 out.
    job = JobView(state=RESTARTING, generation=0, next_plan_at=NOW)
    nodes = {"n0": node("n0"), "n1": node("n1", excluded="ECC errors"), "n2": node("n2")}
    nxt = decide(Observed(now=NOW, job=job, plan={**running_plan(), "action": "stop"},
                          nodes=nodes), S)
    assert nxt.plan["nodes"] == ["n0", "n2"]


def test_drain_leaves_the_running_generation_alone_and_include_brings_a_node_back():
    d = decide(running(requests=[ask("drain", node="n1"), ask("include", 2, node="n2")],
                       excluded={"n2": "old"}, known_nodes=frozenset({"n0", "n1", "n2"})), S)
    assert d.plan is None and "state" not in d.job  # n1 finishes this generation
    assert [(n, r["mode"]) for n, r in d.operator_exclude] == [("n1", "drain")]
    assert d.include == ["n2"] and d.job["requests_seen"] == "2-0"


def test_requests_that_cannot_be_done_are_refused_with_an_event_and_change_nothing():
    d = decide(running(requests=[ask("resume"), ask("exclude", 2, node="n9", reason="x"),
                                 ask("include", 3, node="n0")]), S)
    assert d.control is None and d.operator_exclude == [] and d.include == []
    messages = [e[1] for e in d.events if e[0] == "refused"]
    assert messages == [
        "resume by ana@desk refused: the job is not paused (RUNNING)",
        "exclude by ana@desk refused: no node 'n9' in this job; known: n0, n1, n2",
        "include by ana@desk refused: node n0 is not excluded"]


def test_stop_and_checkpoint_requests():
    d = decide(running(requests=[ask("checkpoint"), ask("stop", 2, reason="budget")],
                       control={"checkpoint": 4}), S)
    assert d.control == {"checkpoint": 5}
    assert d.job["state"] == STOPPING and d.plan["action"] == "stop"
    assert "ana@desk (budget)" in d.job["reason"]
    assert refusal("pause", STOPPING, "stop") == "the job is stopping"
    assert refusal("checkpoint", "WAITING", None) == "no generation is running to checkpoint " \
        "(WAITING)"
    assert refusal("pause", "COMPLETED", None) == "the job has ended (COMPLETED)"


def test_with_too_few_nodes_a_job_that_may_shrink_runs_on_fewer_with_a_smaller_world():
    shrinking = replace(S, node_counts=(2, 1))
    job = JobView(state=RESTARTING, generation=0, next_plan_at=NOW)
    nodes = {"n0": node("n0"), "n1": node("n1", excluded="ECC")}
    d = decide(Observed(now=NOW, job=job, plan={**running_plan(), "action": "stop"},
                        nodes=nodes), shrinking)
    assert d.plan["nodes"] == ["n0"] and d.plan["world_size"] == 2
    assert "shrunk to 1 of 2 nodes" in d.plan["reason"]
    fixed = decide(Observed(now=NOW, job=job, plan={**running_plan(), "action": "stop"},
                            nodes=nodes), S)
    assert fixed.plan is None and "needs 2 x 2 ranks" in fixed.job["reason"]
    assert Settings(nodes=3, ranks_per_node=1).allowed_nodes == (3,)
