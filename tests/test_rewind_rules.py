"""The controller's rewind (controller/control/rewind.py, decide.py), rule by rule: the ranks'
request read from their exits, the window and the point to resume from, the abandoned line set
aside, the budget, an operator's rewind, and the agent's environment for the ranks."""

from __future__ import annotations

import dataclasses
import json

from test_decide import NOW, busy, node, running, running_plan

from controller.control import operator
from controller.control.decide import RESTARTING, RUNNING, JobView, Observed, Settings, decide
from controller.control.recovery import memory_point
from controller.control.rewind import request_of
from controller.control.view import Exit, Request
from controller.node.ranks import skip_steps
from optimus.contract.records import Plan

S = Settings(nodes=2, ranks_per_node=2, heartbeat_interval_s=0.5, heartbeat_timeout_s=5,
             agent_timeout_s=5, max_restarts=2, backoff_s=1, failure_grace_s=2,
             rewind_skip_before=2, rewind_skip_after=3, rewind_back=5, rewind_budget=2,
             rewind_budget_steps=1000, batch_size=8,
             launch={"job_file": "/jobs/x.yaml", "log_dir": "/runs/x/logs"})


def asks(rank: int, step: int = 50, since: int | None = None, line: str | None = None,
         at: float = NOW) -> Exit:
    said = {"step": step, "verdict": "spike", "rule": "loss", "value": 9.5, "threshold": 3.25,
            **({"since": since} if since else {})}
    tail = "step 49 ...\n" + (line if line is not None else
                               "rewind-request " + json.dumps(said)) + "\n"
    return Exit(f"n{rank // 2}", rank, 0, code=90, tail=tail, time=at, local_rank=rank % 2)


def test_the_ranks_request_is_read_only_from_a_well_formed_bounded_line():
    assert request_of(asks(0))["step"] == 50 and request_of(asks(0))["since"] == 50
    assert request_of(asks(0, since=20))["since"] == 20
    assert request_of(asks(0, since=80))["since"] == 50  # after the step: not a rise's start
    for junk in ("rewind-request {", "rewind-request []", 'rewind-request {"step": "50"}',
                 'rewind-request {"step": 0}', 'rewind-request {"step": true}',
                 "rewind-request " + json.dumps({"step": 5, "x": "y" * 3000})):
        assert request_of(asks(0, line=junk)) is None, junk
    assert request_of(Exit("n0", 0, 0, code=90, tail="")) is None


def test_some_ranks_asking_wait_for_the_others_then_the_generation_stops_without_saving():
    d = decide(running(exits=[asks(0), asks(1)]), S)
    assert d.plan is None and d.job.get("state") is None  # the others' exits are on their way
    d = decide(running(exits=[asks(r) for r in range(4)]), S)
    assert d.plan["action"] == "stop" and d.plan["save"] is False
    assert d.job["state"] == RESTARTING and "restarts" not in d.job  # no failure
    assert d.job["restart_causes"] == {"rewind": 1} and d.job["next_plan_at"] == NOW
    # spike 50: skip 48..53 (2 before, 3 after); resume at least 5 steps before 48
    assert d.job["skips"] == [[48, 53]]
    assert d.job["suspect"] == {"nodes": [], "generation": 0, "resumed_step": 42,
                                "rewind": "the spike at step 50",
                                "evidence": "spike at step 50 (loss 9.5 > 3.25)"}
    (entry,) = d.job["rewinds"]
    assert (entry["step"], entry["first"], entry["last"], entry["to"], entry["by"],
            entry["resume_step"]) == (50, 48, 53, 42, "controller", None)
    (kind, message, fields), = [e for e in d.events if e[0] == "rewind"]
    assert message == ("rewind (spike at step 50 (loss 9.5 > 3.25)): the next generation "
                       "resumes from the newest point at or before step 42 and skips the "
                       "batches of steps 48..53")
    assert (fields["step"], fields["first"], fields["last"], fields["to"]) == (50, 48, 53, 42)
    # after settle_s, ranks of every node are enough (a rank lost meanwhile)...
    late = decide(running(exits=[asks(0, at=NOW - 10), asks(2, at=NOW - 10)]), S)
    assert late.plan["save"] is False and late.job["skips"] == [[48, 53]]
    # ... but one node's ranks alone (which that node controls) are no rewind: a failure
    alone = decide(running(exits=[asks(0, at=NOW - 10), asks(1, at=NOW - 10)]), S)
    assert "skips" not in alone.job and "suspect" not in alone.job
    assert [k for k, _, _ in alone.events if k in ("failure", "rewind")] == ["failure"]


def test_a_divergence_goes_back_before_its_rise_and_the_window_starts_at_step_one():
    d = decide(running(exits=[asks(r, step=300, since=101) for r in range(4)]), S)
    assert d.job["skips"] == [[298, 303]] and d.job["suspect"]["resumed_step"] == 95
    d = decide(running(exits=[asks(r, step=2) for r in range(4)]), S)
    assert d.job["skips"] == [[1, 5]] and d.job["suspect"]["resumed_step"] == 0


def test_no_readable_request_or_disagreeing_ones_pause_the_job_rather_than_guess():
    for exits in ([asks(r, line="rewind-request ???") for r in range(4)],
                  [asks(0), asks(1), asks(2, step=7), asks(3, step=7)]):
        d = decide(running(exits=exits), S)
        assert d.plan["action"] == "stop" and d.plan["save"] is False
        assert d.job["desired"] == "pause" and d.control == {"pause": True}
        assert "suspect" not in d.job and "skips" not in d.job


def test_the_budget_pauses_the_rewind_it_would_exceed_and_an_operators_do_not_count():
    done = [{"step": 100, "by": "controller"}, {"step": 600, "by": "controller"},
            {"step": 900, "by": "ops@desk"}]
    d = decide(running(exits=[asks(r, step=1050) for r in range(4)], job=busy(rewinds=done)), S)
    assert d.job["desired"] == "pause" and d.control == {"pause": True}
    (message,) = [m for k, m, _ in d.events if k == "rewind_budget"]
    assert message.startswith("rewind budget used: 2 rewind(s) of at most 2 within 1000 steps "
                              "(at step 100, 600), now one at step 1050")
    assert d.job["skips"] == [[1048, 1053]]  # the rewind is planned all the same
    d = decide(running(exits=[asks(r, step=1150) for r in range(4)], job=busy(rewinds=done)), S)
    assert "desired" not in d.job  # step 100 is out of the span
    zero = dataclasses.replace(S, rewind_budget=0)
    d = decide(running(exits=[asks(r) for r in range(4)]), zero)
    assert d.job["desired"] == "pause"  # every rewind pauses


def test_once_no_rank_runs_the_abandoned_line_is_set_aside_and_the_plan_carries_the_windows():
    window = {"nodes": [], "generation": 0, "resumed_step": 42,
              "rewind": "the spike at step 50", "evidence": "spike at step 50"}
    job = JobView(state=RESTARTING, generation=0, next_plan_at=NOW, suspect=window,
                  skips=([10, 12], [48, 53]),
                  rewinds=({"step": 11, "resume_step": 8},
                           {"step": 50, "resume_step": None, "by": "controller"}))
    nodes = {"n0": node("n0", generation=0), "n1": node("n1", generation=0), "n2": node("n2")}
    stopped = {**running_plan(), "action": "stop", "save": False}
    aside = {45: "a rewind goes back to step 42", 48: "a rewind goes back to step 42"}
    d = decide(Observed(now=NOW, job=job, plan=stopped, nodes=nodes, latest_step=40,
                        suspect_steps=aside), S)
    assert d.set_aside == [(45, aside[45]), (48, aside[48])]
    assert d.plan["action"] == "run" and d.plan["resume_step"] == 40
    assert d.plan["skips"] == [[10, 12], [48, 53]]
    assert d.job["rewinds"][-1]["resume_step"] == 40 and d.job["suspect"] is None
    assert d.job["rewinds"][0] == {"step": 11, "resume_step": 8}
    assert d.job["state"] == RUNNING
    assert skip_steps(Plan.parse(d.plan).skips) == "10-12,48-53"  # as an agent reads it


def test_memory_points_after_the_point_a_rewind_goes_back_to_are_not_trusted():
    plan = running_plan()
    point = {f"step_{s:09d}.gen_0000": [0, 1] for s in (40, 44)}
    other = {f"step_{s:09d}.gen_0000": [2, 3] for s in (40, 44)}
    reports = {"n0": {"own": point, "held": other}, "n1": {"own": other, "held": point}}
    distrust = {"nodes": [], "since": None, "after_step": 42, "rewind": "the spike at step 50"}
    found, why = memory_point(plan, reports, {"n0", "n1"}, 30, distrust)
    assert found["step"] == 40
    assert why == ("the memory snapshot of step 44 is of the line a rewind abandons (it goes "
                   "back to step 42: the spike at step 50)")


def _operator(to=None, skip=None, samples=None, rid="1-0") -> Request:
    return Request(id=rid, action="rewind", actor="ops", host="desk", reason="bad shard",
                   to=to, skip=skip, samples=samples)


def test_an_operators_rewind_goes_to_the_step_asked_and_answers_the_request():
    d = decide(running(requests=[_operator(to=30, skip=(31, 40))]), S)
    assert d.plan["action"] == "stop" and d.plan["save"] is False
    assert d.job["skips"] == [[31, 40]] and d.job["suspect"]["resumed_step"] == 30
    (fields,) = [f for k, _, f in d.events if k == "rewind"]
    assert fields["request"] == "1-0" and fields["by"] == "ops@desk"
    assert fields["reason"] == "asked by ops@desk: bad shard"
    assert d.job["rewinds"][-1]["by"] == "ops@desk"
    # --skip-samples: the steps after --to that hold them, whole batches of 8
    d = decide(running(requests=[_operator(to=30, samples=20)]), S)
    assert d.job["skips"] == [[31, 33]]
    d = decide(running(requests=[_operator(to=30)]), S)  # no window: back to 30 only
    assert "skips" not in d.job and d.job["suspect"]["resumed_step"] == 30
    # a job between generations: the window now, the plan once the line is set aside
    waiting = Observed(now=NOW, job=JobView(state="WAITING", generation=3), plan=None,
                       nodes={}, requests=[_operator(to=5)])
    d = decide(waiting, S)
    assert d.plan is None and d.job["state"] == RESTARTING
    assert d.job["suspect"]["rewind"] == "asked by ops@desk"


def test_an_operators_rewind_is_refused_with_a_reason():
    assert operator.refusal("rewind", RUNNING, None) == \
        "a rewind needs the step to go back to (--to STEP)"
    assert "must come after the step rewound to (30)" in operator.refusal(
        "rewind", RUNNING, None, to=30, skip=(30, 40))
    assert operator.refusal("rewind", "COMPLETED", None, to=3) == "the job has ended (COMPLETED)"
    d = decide(running(requests=[_operator(to=30, rid="1-0"), _operator(to=20, rid="2-0")]), S)
    refused = [f["request"] for k, _, f in d.events if k == "refused"]
    assert refused == ["2-0"] and d.job["suspect"]["resumed_step"] == 30


def test_the_agent_passes_only_well_formed_windows_to_the_ranks():
    assert skip_steps([[3, 4], [5, 5]]) == "3-4,5-5"
    assert skip_steps([[0, 4], [5, 2], [1], ["1", "2"], [True, 2], "1-2"]) == ""
    assert skip_steps("1-2") == skip_steps(None) == ""
