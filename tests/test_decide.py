"""The controller's rules, one by one, as pure functions of an observed snapshot."""

from __future__ import annotations

from controller.control.decide import (
    COMPLETED,
    FAILED,
    RESTARTING,
    RUNNING,
    STOPPED,
    STOPPING,
    WAITING,
    Exit,
    JobView,
    NodeView,
    Observed,
    Overdue,
    Settings,
    decide,
)

S = Settings(nodes=2, ranks_per_node=2, heartbeat_interval_s=0.5, heartbeat_timeout_s=5,
             agent_timeout_s=5,
             max_restarts=2, backoff_s=1, backoff_max_s=3, failure_grace_s=2, stop_grace_s=30,
             launch={"job_file": "/jobs/x.yaml", "log_dir": "/runs/x/logs"})
NOW = 1000.0


def node(name: str, *, alive: bool = True, healthy: bool = True, excluded: str | None = None,
         generation: int | None = None, live: int = 0) -> NodeView:
    return NodeView(name=name, host=f"host-{name}", alive=alive, healthy=healthy,
                    health="ok" if healthy else "matmul mismatch", excluded=excluded,
                    generation=generation, live_ranks=live, last_beat=NOW - 0.5)


def running_plan(gen: int = 0, nodes=("n0", "n1")) -> dict:
    return {"generation": gen, "action": "run", "nodes": list(nodes), "ranks_per_node": 2,
            "world_size": 4}


def running(nodes=None, exits=(), overdue=(), job=None, plan=None, now=NOW, latest_step=40,
            **more) -> Observed:
    nodes = nodes or {n: node(n, generation=0, live=2) for n in ("n0", "n1")}
    nodes.setdefault("n2", node("n2"))  # the spare
    plan = plan or running_plan()
    # Beat ages are relative to `now`: a node's agent keeps beating as the test's clock moves.
    beats = {n: now - (NOW - nodes[n].last_beat) for n in plan["nodes"] if n in nodes}
    return Observed(now=now, job=job or busy(), plan=plan, nodes=nodes, exits=list(exits),
                    overdue=list(overdue), latest_step=latest_step, agent_beats=beats, **more)


def busy(**fields) -> JobView:
    """A running generation 0 that last moved at step 5, just now."""
    return JobView(**{"state": RUNNING, "generation": 0, "progress_gen": 0, "progress_step": 5,
                      "progress_at": NOW, "progress_moves": 3, **fields})


# Hang, straggler and flaky-node settings and a rank's heartbeat, for
# tests/test_decide_faults.py and the other rule tests.
H = Settings(nodes=2, ranks_per_node=2, heartbeat_interval_s=0.5, heartbeat_timeout_s=5,
             agent_timeout_s=5, hang_timeout_s=10, hang_step_factor=4, startup_timeout_s=60,
             straggler_factor=2, flaky_failures=2, flaky_window_s=100, backoff_s=1,
             launch=S.launch)


def beat(rank: int, step: int, phase: str, since: float = NOW - 20, finite: bool = True,
         generation: int = 0):
    return {"rank": rank, "step": step, "phase": phase, "phase_since": since, "finite": finite,
            "generation": generation}


def test_first_generation_takes_nodes_in_name_order_and_starts_from_the_checkpoint():
    obs = Observed(now=NOW, job=JobView(), plan=None,
                   nodes={n: node(n) for n in ("n2", "n0", "n1")}, latest_step=None)
    d = decide(obs, S)
    assert d.plan["action"] == "run" and d.plan["generation"] == 0
    assert d.plan["nodes"] == ["n0", "n1"]
    assert d.plan["master_addr"] == "host-n0" and d.plan["world_size"] == 4
    assert d.plan["job_file"] == "/jobs/x.yaml"  # the launch settings travel in the plan
    assert d.job["state"] == RUNNING and d.job["generation"] == 0
    assert "from scratch" in d.plan["reason"]


def test_a_first_generation_that_may_shrink_waits_for_late_agents_before_starting_short():
    shrinkable = Settings(**{**S.__dict__, "node_counts": (2, 1)})
    one = {"n0": node("n0")}
    d = decide(Observed(now=NOW, job=JobView(), plan=None, nodes=one, latest_step=None),
               shrinkable)
    assert d.plan is None and d.job["state"] == WAITING
    assert d.job["next_plan_at"] == NOW + 5 and "for 2 nodes before starting on 1" in (
        d.job["reason"])
    waiting = JobView(state=WAITING, next_plan_at=NOW + 5)
    both = {n: node(n) for n in ("n0", "n1")}
    d = decide(Observed(now=NOW + 1, job=waiting, plan=None, nodes=both, latest_step=None),
               shrinkable)
    assert d.plan["nodes"] == ["n0", "n1"]  # the late agent came: no need to wait it out
    d = decide(Observed(now=NOW + 1, job=waiting, plan=None, nodes=one, latest_step=None),
               shrinkable)
    assert d.plan is None and d.job == {}  # still waiting, nothing new to say
    d = decide(Observed(now=NOW + 5, job=waiting, plan=None, nodes=one, latest_step=None),
               shrinkable)
    assert d.plan["nodes"] == ["n0"] and "shrunk to 1 of 2 nodes" in d.plan["reason"]


def test_too_few_healthy_nodes_waits_in_a_named_state_saying_why():
    obs = Observed(now=NOW, job=JobView(), plan=None, nodes={
        "n0": node("n0"), "n1": node("n1", healthy=False), "n2": node("n2", excluded="bad"),
        "n3": node("n3", alive=False)})
    d = decide(obs, S)
    assert d.plan is None
    assert d.job["state"] == WAITING
    reason = d.job["reason"]
    assert "needs 2 x 2 ranks, 1 healthy node" in reason
    assert "n1 unhealthy" in reason and "n2 excluded (bad)" in reason and "n3 silent" in reason
    # Nothing new: no second event for the same wait.
    again = decide(Observed(now=NOW + 1, job=JobView(state=WAITING, reason=reason), plan=None,
                            nodes=obs.nodes), S)
    assert again.job == {} and again.events == []


def test_a_killed_rank_is_the_culprit_even_when_a_peer_reported_first():
    peer = Exit("n1", 3, 0, code=1, tail="RuntimeError: Connection closed by peer [x]:1234",
                time=NOW - 0.2)
    killed = Exit("n0", 1, 0, code=None, signal=9, tail="step 12", time=NOW - 0.1)
    d = decide(running(exits=[peer, killed]), S)
    assert d.exclude == [("n0", "rank 1 on n0 ended with SIGKILL (9): step 12")]
    assert d.plan["action"] == "stop" and d.plan["grace_s"] == 2
    assert d.job["state"] == RESTARTING and d.job["restarts"] == 1
    assert d.job["next_plan_at"] == NOW + 1  # backoff 1 s for the first restart


def test_collateral_exits_alone_wait_for_a_culprit_then_restart_without_exclusion():
    peer = Exit("n1", 3, 0, code=1, tail="gloo::IoException: Connection reset by peer",
                time=NOW)
    first = decide(running(exits=[peer]), S)
    assert first.plan is None and first.exclude == []
    assert first.job == {"failure_since": NOW}
    # Still within settle_s (agent timeout + 1): keep waiting.
    job = busy(failure_since=NOW)
    assert decide(running(exits=[peer], job=job, now=NOW + 3), S).plan is None
    # The lost node shows up (its agent fell silent): it is the culprit.
    nodes = {"n0": node("n0", generation=0, live=2),
             "n1": NodeView("n1", "host-n1", alive=False, healthy=True, generation=0,
                            live_ranks=2, last_beat=NOW - 6)}
    d = decide(running(nodes=nodes, exits=[peer], job=job, now=NOW + 5), S)
    assert [n for n, _ in d.exclude] == ["n1"]
    assert "node n1 lost: its agent has been silent for 6.0 s" in d.exclude[0][1]
    # No culprit by the end of the window: restart, nobody excluded.
    d = decide(running(exits=[peer], job=job, now=NOW + S.settle_s), S)
    assert d.exclude == [] and d.job["state"] == RESTARTING
    assert "no culprit" in d.job["reason"]


def test_overdue_heartbeat_names_the_frozen_rank():
    late = Overdue("n1", 2, "no heartbeat for 6.0 s (step 9, phase backward)", NOW - 6)
    d = decide(running(overdue=[late]), S)
    assert d.exclude == [("n1", "rank 2 on n1: no heartbeat for 6.0 s (step 9, phase backward)")]
    assert d.job["state"] == RESTARTING


def test_a_lost_node_is_named_as_lost_not_by_its_silent_ranks():
    nodes = {"n0": node("n0", generation=0, live=2),
             "n1": NodeView("n1", "host-n1", alive=False, healthy=True, generation=0,
                            live_ranks=2, last_beat=NOW - 6)}
    late = Overdue("n1", 2, "no heartbeat for 6.5 s", NOW - 6.5)  # the ranks died first
    d = decide(running(nodes=nodes, overdue=[late]), S)
    assert d.exclude == [("n1", "node n1 lost: its agent has been silent for 6.0 s")]


def test_an_overdue_rank_whose_agent_missed_beats_is_a_lost_node_at_once():
    late = Overdue("n1", 2, "no heartbeat for 3.1 s", NOW - 3.1)
    quiet = {"n0": node("n0", generation=0, live=2),
             "n1": NodeView("n1", "host-n1", alive=True, healthy=True, generation=0,
                            live_ranks=2, last_beat=NOW - 2.6)}  # 0.5 s beats: 5 missed
    d = decide(running(nodes=quiet, overdue=[late]), S)
    assert d.exclude == [("n1", "node n1 lost: its agent has been silent for 2.6 s")]
    beating = {**quiet, "n1": NodeView("n1", "host-n1", alive=True, healthy=True,
                                       generation=0, live_ranks=2, last_beat=NOW - 0.4)}
    d = decide(running(nodes=beating, overdue=[late]), S)
    assert d.exclude == [("n1", "rank 2 on n1: no heartbeat for 3.1 s")]  # a frozen rank


def test_next_generation_waits_for_the_old_ranks_then_the_backoff_then_uses_the_spare():
    job = JobView(state=RESTARTING, generation=0, restarts=1, next_plan_at=NOW + 1)
    stopping = {"n0": node("n0", excluded="killed", generation=0, live=1),
                "n1": node("n1", generation=0, live=0)}
    plan = {**running_plan(), "action": "stop"}
    assert decide(running(nodes=stopping, job=job, plan=plan), S).plan is None  # draining
    drained = {"n0": node("n0", excluded="killed", generation=0), "n1": node("n1", generation=0)}
    assert decide(running(nodes=drained, job=job, plan=plan), S).plan is None  # backoff
    d = decide(running(nodes=drained, job=job, plan=plan, now=NOW + 1), S)
    assert d.plan["generation"] == 1 and d.plan["action"] == "run"
    assert d.plan["nodes"] == ["n1", "n2"]  # the survivor keeps its place; the spare joins
    assert d.plan["master_addr"] == "host-n1"
    assert d.plan["resume_step"] == 40 and "spares brought in: n2" in d.plan["reason"]
    assert d.job["state"] == RUNNING and d.job["generation"] == 1


def test_restarts_are_bounded_and_backoff_grows_to_its_cap():
    assert [S.backoff(n) for n in (1, 2, 3, 4)] == [1, 2, 3, 3]
    killed = Exit("n0", 0, 0, code=None, signal=9, time=NOW)
    d = decide(running(exits=[killed], job=busy(restarts=2)), S)
    assert d.job["state"] == FAILED
    assert "2 restarts used up (max_restarts=2)" in d.job["reason"]
    assert d.plan["action"] == "end"


def test_all_ranks_finishing_completes_the_job_and_a_stop_by_the_agent_is_no_failure():
    done = [Exit(f"n{r // 2}", r, 0, code=0, time=NOW) for r in range(4)]
    d = decide(running(exits=done), S)
    assert d.job["state"] == COMPLETED and d.plan["action"] == "end"
    assert "all 4 ranks of generation 0 finished at step 40" in d.job["reason"]
    terminated = Exit("n0", 0, 0, code=None, signal=15, by_agent=True, time=NOW)
    assert decide(running(exits=done[:3] + [terminated]), S).job == {}


def test_an_operator_stop_drains_then_ends_stopped():
    job = JobView(state=RUNNING, generation=0, desired="stop", desired_by="alice")
    d = decide(running(job=job), S)
    assert d.plan["action"] == "stop" and d.plan["grace_s"] == 30  # time to save
    assert d.job["state"] == STOPPING
    job = JobView(state=STOPPING, generation=0, desired="stop", desired_by="alice")
    assert decide(running(job=job), S).job == {}  # ranks still live
    gone = {n: node(n, generation=0) for n in ("n0", "n1")}
    d = decide(running(nodes=gone, job=job, plan={**running_plan(), "action": "stop"}), S)
    assert d.job["state"] == STOPPED and d.plan["action"] == "end"
    assert "stopped by alice" in d.job["reason"] and "step 40" in d.job["reason"]


def test_a_terminal_job_keeps_telling_agents_to_end():
    job = JobView(state=COMPLETED, generation=0, reason="done")
    d = decide(running(job=job), S)
    assert d.plan["action"] == "end" and d.job == {}
    assert decide(running(job=job, plan={**running_plan(), "action": "end"}), S).plan is None


# --- issue 15: a job is COMPLETED only with its final step committed ---------------------------

SAVES = Settings(**{**S.__dict__, "final_step": 40})
FINAL_FAILED = ("checkpoint: the final checkpoint (step 40) failed, the newest committed is step "
                "30: write failed on rank(s) [0]: OSError: [Errno 28] No space left on device\n"
                "error: the final checkpoint (step 40) failed, the newest committed is step 30: "
                "write failed on rank(s) [0]: OSError: [Errno 28] No space left on device\n"
                "[W1123 20:18:56.123 ProcessGroupGloo.cpp:1] a C++ warning at exit")


def test_completed_needs_the_final_step_committed_when_checkpointing_is_on():
    done = [Exit(f"n{r // 2}", r, 0, code=0, time=NOW) for r in range(4)]
    d = decide(running(exits=done), SAVES)  # latest_step 40: the final step
    assert d.job["state"] == COMPLETED
    d = decide(running(exits=done, latest_step=30), SAVES)
    assert d.job["state"] == FAILED and d.plan["action"] == "end"
    assert d.job["reason"] == (
        "all 4 ranks of generation 0 exited, but the final step 40 has no committed checkpoint "
        "(the newest committed: step 30); resubmit (--resubmit) to continue from it")
    assert decide(running(exits=done, latest_step=None), SAVES).job["state"] == FAILED
    # Checkpointing off (final_step None): finishing is enough.
    assert decide(running(exits=done, latest_step=None), S).job["state"] == COMPLETED


def test_a_failed_final_save_ends_the_job_failed_with_rank_0s_reason_and_no_restart():
    failed = [Exit(f"n{r // 2}", r, 0, code=89, tail=FINAL_FAILED, time=NOW) for r in range(4)]
    d = decide(running(exits=failed, latest_step=30), SAVES)
    assert d.job["state"] == FAILED and d.plan["action"] == "end"
    assert d.job["reason"] == (
        "the final checkpoint (step 40) failed, the newest committed is step 30: write failed "
        "on rank(s) [0]: OSError: [Errno 28] No space left on device; not restarted (a new "
        "generation would fail the same way): fix the checkpoint storage, then resubmit "
        "(--resubmit) to continue from the newest committed checkpoint")
    assert "restarts" not in d.job and d.exclude == []  # no restart, nobody blamed
    assert [kind for kind, *_ in d.events] == ["failed"]


def test_a_rank_stopped_by_failed_saves_waits_briefly_for_rank_0_then_fails_anyway():
    said = "error: 3 checkpoint saves failed in a row (checkpoint.max_failed_saves=3): ..."
    other = Exit("n1", 2, 0, code=89, tail=f"step 12\n{said}", time=NOW)
    d = decide(running(exits=[other]), SAVES)
    assert d.job == {} and d.plan is None  # rank 0's words (its commit's error) are coming
    d = decide(running(exits=[other], now=NOW + S.settle_s), SAVES)
    assert d.job["state"] == FAILED and "restarts" not in d.job
    assert d.job["reason"].startswith("3 checkpoint saves failed in a row")
    first = Exit("n0", 0, 0, code=89, tail=said.replace("...", "rank 0"), time=NOW)
    d = decide(running(exits=[other, first]), SAVES)
    assert d.job["reason"].startswith("3 checkpoint saves failed in a row (checkpoint."
                                      "max_failed_saves=3): rank 0; not restarted")


def test_a_failure_event_carries_its_culprit_in_fields_and_a_plain_failure_saves():
    killed = Exit("n1", 3, 0, code=None, signal=9, time=NOW, local_rank=1)
    d = decide(running(exits=[killed]), S)
    (kind, message, fields), = [e for e in d.events if e[0] == "failure"]
    assert fields == {"generation": 0, "node": "n1", "rank": 3, "tile": "",
                      "cause": "rank_exit", "evidence": "soft", "excluded": True,
                      "saves": True}
    assert d.plan["action"] == "stop" and d.plan["save"] is True
    assert d.job["last_failure"] == {**fields, "time": NOW}
    assert "suspect" not in d.job


def test_wrong_arithmetic_stops_without_a_checkpoint_and_sets_aside_what_followed():
    # A bad tile found by the health check, while the generation (resumed from step 10) runs.
    job = busy(resumed_gen=0, resumed_step=10)
    d = decide(running(job=job, unhealthy={"n1": "n1/0: fixed-seed matmul gave 1.0"}), S)
    assert d.plan["action"] == "stop" and d.plan["save"] is False
    (kind, message, fields), = [e for e in d.events if e[0] == "failure"]
    assert (fields["node"], fields["tile"], fields["cause"], fields["evidence"],
            fields["saves"]) == ("n1", "n1/0", "bad_tile", "hard", False)
    assert "it stops without a checkpoint" in message
    assert d.job["suspect"] == {"nodes": ["n1"], "generation": 0, "resumed_step": 10,
                                "evidence": "bad tile n1/0: fixed-seed matmul gave 1.0"}
    # NaN from a rank's own values is the same evidence; its exit status says so too.
    own = Exit("n0", 1, 0, code=87, time=NOW, local_rank=1)
    d = decide(running(exits=[own]), S)
    assert d.plan["save"] is False and d.job["suspect"]["nodes"] == ["n0"]
    assert [e[2]["rank"] for e in d.events if e[0] == "failure"] == [1]

    # While the stopped generation's ranks live, nothing is set aside; once they are gone,
    # the steps the controller found suspect are, and the plan starts before them.
    suspect = {"nodes": ["n1"], "generation": 0, "resumed_step": 10, "evidence": "bad tile"}
    stopping = {**running_plan(), "action": "stop", "save": False}
    restarting = JobView(state=RESTARTING, generation=0, restarts=1, next_plan_at=NOW - 1,
                         suspect=suspect)
    nodes = {"n0": node("n0", generation=0, live=1), "n1": node("n1", excluded="bad tile"),
             "n2": node("n2")}
    aside = {30: "committed at T, after n1 last passed", 20: "committed at T', after n1"}
    obs = Observed(now=NOW, job=restarting, plan=stopping, nodes=nodes, latest_step=10,
                   suspect_steps=aside)
    d = decide(obs, S)
    assert d.set_aside == [] and d.plan is None
    nodes["n0"] = node("n0", generation=0, live=0)
    d = decide(Observed(**{**obs.__dict__, "nodes": nodes}), S)
    assert d.set_aside == [(20, aside[20]), (30, aside[30])] and d.job["suspect"] is None
    assert ("quarantine", "checkpoint(s) of step 20, 30 set aside as suspect: committed at T, "
            "after n1 last passed (evidence: bad tile)") in [(k, m) for k, m, _ in d.events]
    assert d.plan["action"] == "run" and d.plan["resume_step"] == 10
    assert d.plan["reason"] == ("generation 1 on n0, n2 from the checkpoint of step 10 (set "
                                "aside as suspect: step 20, 30) (spares brought in: n2)")


def test_an_operator_exclusion_and_a_lost_node_still_save_on_the_stop():
    d = decide(running(excluded={"n1": "ECC errors"}), S)
    assert d.plan["action"] == "stop" and d.plan["save"] is True
    lost = running()
    lost = Observed(**{**lost.__dict__, "agent_beats": {"n0": NOW, "n1": NOW - 60}})
    d = decide(lost, S)
    assert "lost" in d.job["reason"] and d.plan["save"] is True and "suspect" not in d.job


def test_what_the_ranks_loaded_is_reported_once_and_named_when_not_as_planned():
    plan = {**running_plan(gen=1), "resume_step": 60}
    job = busy(generation=1, progress_gen=1)
    report = {"step": 50, "quarantined": [{"step": 60, "reason": "checksum mismatch: x"}]}
    d = decide(running(job=job, plan=plan, resumed=report), S)
    assert (d.job["resumed_gen"], d.job["resumed_step"]) == (1, 50)
    (kind, message, fields), = [e for e in d.events if e[0] == "loaded"]
    assert message == ("generation 1 resumed from the checkpoint of step 50, not from step 60 "
                       "as planned: rank 0 set aside step 60 (checksum mismatch: x)")
    assert fields == {"generation": 1, "step": 50, "planned_step": 60, "quarantined": [60],
                      "source": "disk"}
    seen = busy(generation=1, progress_gen=1, resumed_gen=1, resumed_step=50)
    assert [e for e in decide(running(job=seen, plan=plan, resumed=report), S).events
            if e[0] == "loaded"] == []
    d = decide(running(job=job, plan={**plan, "resume_step": None},
                       resumed={"step": None, "quarantined": []}), S)
    assert [m for k, m, _ in d.events if k == "loaded"] == ["generation 1 resumed from scratch"]


def test_a_bad_tile_that_computed_nothing_since_its_last_pass_changes_no_checkpoint():
    # Node n1 failed the check before this generation, having run nothing since it passed
    # (a spare until now): it is excluded, but the stop saves and nothing is suspect.
    d = decide(running(unhealthy={"n1": "n1/0: fixed-seed matmul gave 1.0"},
                       unhealthy_idle=frozenset({"n1"})), S)
    assert {n for n, _ in d.exclude} == {"n1"} and d.plan["save"] is True
    assert "suspect" not in d.job


# --- in-memory snapshots ---------------------------------------------------------------------

def _snap(own=None, held=None) -> dict:
    return {"addr": "x:1", "own": own or {}, "held": held or {}}


P44, P46 = "step_000000044.gen_0000", "step_000000046.gen_0000"


def test_buddies_are_spares_while_they_have_room_then_the_next_node():
    from controller.control.recovery import buddies
    addrs = {n: f"host-{n}:7000" for n in ("n0", "n1", "n2", "s0")}
    assert {k: v["node"] for k, v in buddies(["n0", "n1", "n2"], ["s0"], addrs).items()} == {
        "n0": "s0", "n1": "s0", "n2": "n0"}  # a spare holds at most two nodes' copies
    assert buddies(["n0"], ["s0"], addrs)["n0"] == {"node": "s0", "addr": "host-s0:7000"}
    assert {k: v["node"] for k, v in buddies(["n0", "n1"], [], addrs).items()} == {
        "n0": "n1", "n1": "n0"}
    assert buddies(["n0"], [], addrs) == {}  # alone, no copy elsewhere: never usable


def test_a_memory_point_is_usable_once_every_shard_has_a_replica_and_a_live_holder():
    from controller.control.recovery import memory_point
    plan = running_plan()  # n0: ranks 0, 1; n1: ranks 2, 3
    reports = {"n0": _snap(own={P44: [0, 1], P46: [0, 1]}),
               "n1": _snap(own={P44: [2, 3], P46: [2, 3]}),
               "n2": _snap(held={P44: [0, 1, 2, 3], P46: [0, 1]})}  # n1's 46 not there yet
    alive = {"n0", "n1", "n2"}
    point, why = memory_point(plan, reports, alive, disk_step=40)
    assert point == {"step": 44, "generation": 0,
                     "slots": [["n0", "n2"], ["n1", "n2"]]} and why is None
    assert memory_point(plan, reports, alive, disk_step=45) == (None, (
        "no snapshot newer than the disk checkpoint is complete on every rank and replicated "
        "(the newest taken: step 46)"))
    assert memory_point(plan, reports, alive - {"n0"}, 40)[0]["slots"][0] == ["n2"]
    assert memory_point(plan, reports, {"n1"}, 40) == (None, (
        "the memory snapshot of step 44 is lost: node n0 and the node holding its copy (n2) "
        "are both gone"))
    assert memory_point(plan, {}, alive, 40) == (None, None)  # snapshots off


def test_a_lost_node_is_replaced_by_the_spare_that_holds_its_copy_in_its_slot():
    job = JobView(state=RESTARTING, generation=0, restarts=1, next_plan_at=NOW)
    nodes = {"n0": node("n0", excluded="killed", alive=False, generation=0),
             "n1": node("n1", generation=0), "n2": node("n2"), "n3": node("n3")}
    nodes = {n: NodeView(**{**v.__dict__, "snapshot_addr": f"host-{n}:7000"})
             for n, v in nodes.items()}
    reports = {"n0": _snap(own={P44: [0, 1]}), "n1": _snap(own={P44: [2, 3]}),
               "n2": _snap(held={P44: [2, 3]}), "n3": _snap(held={P44: [0, 1]})}
    plan = {**running_plan(), "action": "stop"}
    d = decide(Observed(now=NOW, job=job, plan=plan, nodes=nodes, latest_step=40,
                        snapshots=reports), S)
    assert d.plan["nodes"] == ["n3", "n1"]  # n3 held n0's shards: it takes n0's slot
    assert d.plan["memory"] == {"step": 44, "generation": 0, "holders": {}}
    assert d.plan["resume_step"] == 44
    assert "from the memory snapshot of step 44" in d.plan["reason"]
    assert {k: v["node"] for k, v in d.plan["buddies"].items()} == {"n3": "n2", "n1": "n2"}
    # Without n3, the spare n2 takes the slot and fetches n0's shards from n3... which is gone:
    # n0's copy is lost with it, and the generation starts from disk, saying why.
    gone = {**nodes, "n3": NodeView(**{**nodes["n3"].__dict__, "alive": False})}
    d = decide(Observed(now=NOW, job=job, plan=plan, nodes=gone, latest_step=40,
                        snapshots=reports), S)
    assert d.plan["nodes"] == ["n1", "n2"] and "memory" not in d.plan
    assert "from the checkpoint of step 40 (memory snapshot not used: the memory snapshot of " \
           "step 44 is lost: node n0 and the node holding its copy (n3) are both gone)" in (
               d.plan["reason"])


def test_a_replacement_without_the_copy_fetches_it_and_a_smaller_generation_uses_disk():
    job = JobView(state=RESTARTING, generation=0, restarts=1, next_plan_at=NOW)
    nodes = {n: NodeView(n, f"host-{n}", alive=n != "n0", healthy=True,
                         excluded="killed" if n == "n0" else None,
                         snapshot_addr=f"host-{n}:7000") for n in ("n0", "n1", "n2")}
    reports = {"n0": _snap(own={P44: [0, 1]}), "n1": _snap(own={P44: [2, 3]}, held={P44: [0, 1]}),
               "n2": _snap(held={P44: [2, 3]})}
    plan = {**running_plan(), "action": "stop"}
    d = decide(Observed(now=NOW, job=job, plan=plan, nodes=nodes, latest_step=40,
                        snapshots=reports), S)
    assert d.plan["nodes"] == ["n2", "n1"]
    assert d.plan["memory"]["holders"] == {"n2": {"node": "n1", "addr": "host-n1:7000"}}
    shrinkable = Settings(**{**S.__dict__, "node_counts": (2, 1)})
    alone = {**nodes, "n2": NodeView("n2", "host-n2", alive=False, healthy=True)}
    d = decide(Observed(now=NOW, job=job, plan=plan, nodes=alone, latest_step=40,
                        snapshots=reports), shrinkable)
    assert d.plan["nodes"] == ["n1"] and "memory" not in d.plan
    assert "memory snapshot not used: the next generation runs on 1 nodes, not 2" in (
        d.plan["reason"])
