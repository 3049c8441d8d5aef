"""What `decide` does with one tick's evidence, pinned at the edges the rules draw.

Beside tests/test_decide.py: which state takes a snapshot (terminal, an operator's stop,
stopping, a generation running, between generations) and what each says; whom a failure blames
when several ranks have evidence (the earliest primary one; the first collateral one names the
wait); when collateral-only evidence stops waiting; where the restart budget ends
(`restarts > max_restarts`); which rank's words end a job whose saves failed; an operator's
exclusion of several nodes at once; and the buddies message of a large plan. Planning, progress,
stalls and hangs: tests/test_decide_limits.py.
"""

from __future__ import annotations

from test_decide import NOW, SAVES, H, S, busy, node, running, running_plan

from controller.control.decide import (
    FAILED,
    RESTARTING,
    RUNNING,
    STOPPED,
    STOPPING,
    Exit,
    JobView,
    Observed,
    decide,
)

PEER = "gloo::IoException: Connection reset by peer"


def killed(node_name: str, rank: int, at: float = NOW) -> Exit:
    return Exit(node_name, rank, 0, code=None, signal=9, time=at)


def peer(node_name: str, rank: int, at: float = NOW) -> Exit:
    return Exit(node_name, rank, 0, code=1, tail=PEER, time=at)


def events(d, kind: str) -> list[str]:
    return [message for k, message, _ in d.events if k == kind]


# --- which state takes the tick ------------------------------------------------------------------

def test_a_bad_tile_on_a_node_already_excluded_is_not_excluded_again():
    bad = {"n2": "n2/0: fixed-seed matmul gave 1.0"}
    assert decide(running(unhealthy=bad, excluded={"n2": "bad tile n2/0"}), S).exclude == []
    assert decide(running(unhealthy=bad), S).exclude == [("n2", "bad tile n2/0: fixed-seed "
                                                                "matmul gave 1.0")]


def test_checkpoints_already_set_aside_are_not_set_aside_again():
    window = {"nodes": ["n1"], "generation": 0, "resumed_step": 10, "evidence": "bad tile",
              "set_aside": True}
    job = JobView(state=RESTARTING, generation=0, restarts=1, next_plan_at=NOW + 5,
                  suspect=window)
    plan = {**running_plan(), "action": "stop", "save": False}
    nodes = {n: node(n, generation=0) for n in ("n0", "n1", "n2")}
    d = decide(Observed(now=NOW, job=job, plan=plan, nodes=nodes, latest_step=10,
                        suspect_steps={30: "committed after n1 last passed"}), S)
    assert d.set_aside == [] and d.events == [] and d.job == {}  # backing off, nothing new


def test_a_terminal_job_without_a_plan_gets_an_end_plan_for_no_generation():
    d = decide(Observed(now=NOW, job=JobView(state=FAILED, reason="gave up"), plan=None,
                        nodes={}), S)
    assert d.plan == {"generation": -1, "nodes": [], "world_size": 0, "action": "end",
                      "grace_s": 2, "reason": "gave up", "issued": NOW, "save": True}
    assert d.job == {}


def test_an_operator_stop_names_who_asked_and_why_or_an_operator():
    job = busy(desired="stop", desired_by="alice", desired_reason="budget")
    d = decide(running(job=job), S)
    assert d.job == {"state": STOPPING, "reason": "stop asked by alice (budget): ranks save "
                     "and exit"}
    assert events(d, "stopping") == ["stop asked by alice (budget): generation 0 saves a "
                                     "checkpoint and exits"]
    assert d.plan["reason"] == "stop asked by alice (budget)" and d.plan["grace_s"] == 30
    d = decide(running(job=busy(desired="stop")), S)
    assert d.job["reason"] == "stop asked by an operator: ranks save and exit"


def test_a_stop_before_any_plan_or_between_generations_ends_the_job_at_once():
    job = JobView(desired="stop", desired_by="alice")
    d = decide(Observed(now=NOW, job=job, plan=None, nodes={"n0": node("n0")}), S)
    assert d.job["state"] == STOPPED and d.plan["action"] == "end"
    assert d.job["reason"] == "stopped by alice before any rank ran"
    # The failed generation's ranks still drain under a stop plan: nothing runs to save.
    between = JobView(state=RESTARTING, generation=0, restarts=1, desired="stop",
                      desired_by="alice", next_plan_at=NOW + 5)
    draining = {n: node(n, generation=0, live=1) for n in ("n0", "n1")}
    d = decide(Observed(now=NOW, job=between, plan={**running_plan(), "action": "stop"},
                        nodes=draining), S)
    assert d.job["state"] == STOPPED and d.plan["action"] == "end"
    assert d.job["reason"] == "stopped by alice while generation 0 was stopping"
    assert d.plan["save"] is True  # its stop saved: so may the end
    # A generation stopped without a checkpoint (wrong arithmetic) is never told to save.
    d = decide(Observed(now=NOW, job=between, nodes=draining,
                        plan={**running_plan(), "action": "stop", "save": False}), S)
    assert (d.job["state"], d.plan["action"], d.plan["save"]) == (STOPPED, "end", False)
    d = decide(Observed(now=NOW, job=JobView(state=FAILED, reason="gave up"), nodes=draining,
                        plan={**running_plan(), "action": "stop", "save": False}), S)
    assert (d.plan["action"], d.plan["save"]) == ("end", False)
    d = decide(Observed(now=NOW, job=busy(desired="stop", desired_by="alice"),
                        plan={**running_plan(), "action": "stop"}, nodes=draining), S)
    assert d.job["state"] == STOPPED  # a stop plan is not a running generation, whatever state


def test_a_stop_of_a_generation_still_running_under_a_restarting_state_drains_it():
    job = JobView(state=RESTARTING, generation=0, desired="stop", desired_by="alice")
    d = decide(running(job=job), S)
    assert d.job["state"] == STOPPING and d.plan["action"] == "stop"


def test_stopping_ends_stopped_saying_the_latest_checkpoint_or_none():
    job = JobView(state=STOPPING, generation=0, desired="stop")
    gone = {n: node(n, generation=0) for n in ("n0", "n1")}
    stop = {**running_plan(), "action": "stop"}
    d = decide(Observed(now=NOW, job=job, plan=stop, nodes=gone, latest_step=None), S)
    assert d.job["state"] == STOPPED
    assert d.job["reason"] == "stopped by an operator; latest committed checkpoint"
    d = decide(Observed(now=NOW, job=JobView(**{**job.__dict__, "desired_by": "alice"}),
                        plan=stop, nodes=gone, latest_step=40), S)
    assert d.job["reason"] == "stopped by alice; latest committed checkpoint at step 40"
    d = decide(Observed(now=NOW, job=job, plan=None, nodes=gone), S)
    assert d.job["state"] == STOPPED and d.plan["generation"] == -1


def test_a_running_state_without_its_plan_plans_one_and_a_restarting_one_stops_a_run_plan():
    # The job record was written, the plan was not (the controller died between the two).
    job = JobView(state=RUNNING, generation=0)
    nodes = {n: node(n) for n in ("n0", "n1")}
    d = decide(Observed(now=NOW, job=job, plan=None, nodes=nodes, latest_step=None), S)
    assert d.plan["action"] == "run" and d.plan["generation"] == 1  # 0 was taken
    # A state written before its plan's stop: the generation is stopped first.
    job = JobView(state=RESTARTING, generation=0, restarts=1, reason="rank 1 died",
                  next_plan_at=NOW)
    d = decide(running(job=job), S)
    assert d.plan["action"] == "stop" and d.plan["grace_s"] == 2
    assert d.plan["reason"] == "rank 1 died" and d.plan["generation"] == 0 and d.job == {}


# --- whom a failure blames ---------------------------------------------------------------------

def test_the_earliest_primary_evidence_is_the_culprit_whatever_the_order_seen():
    later, earlier = killed("n0", 1, NOW - 0.1), killed("n1", 2, NOW - 0.3)
    d = decide(running(exits=[later, earlier]), S)
    assert d.exclude == [("n1", "rank 2 on n1 ended with SIGKILL (9)")]
    assert d.job["reason"] == "rank 2 on n1 ended with SIGKILL (9)"


def test_collateral_evidence_names_the_first_peer_while_it_waits_and_says_so_once():
    first, second = peer("n1", 3), peer("n0", 1)
    d = decide(running(exits=[first, second]), S)
    assert d.job == {"failure_since": NOW} and d.plan is None
    assert events(d, "suspect") == [
        f"generation 0: rank 3 on n1 ended with exit code 1: {PEER}; waiting up to 6 s for the "
        "cause"]
    d = decide(running(exits=[first, second], job=busy(failure_since=NOW), now=NOW + 5.9), S)
    assert d.job == {} and d.events == [] and d.plan is None


def test_collateral_alone_restarts_unattributed_naming_every_node_and_the_first_peer():
    first, second = peer("n1", 3), peer("n0", 1)
    d = decide(running(exits=[first, second], job=busy(failure_since=NOW), now=NOW + 6), S)
    assert d.exclude == [] and d.job["state"] == RESTARTING
    assert d.job["reason"] == (f"ranks on n0, n1 lost their peers and no culprit showed within "
                               f"6 s (rank 3 on n1 ended with exit code 1: {PEER})")
    assert d.job["restart_causes"] == {"unattributed": 1}
    assert d.job["last_failure"] == {"generation": 0, "node": "", "rank": "", "tile": "",
                                     "cause": "unattributed", "evidence": "",
                                     "excluded": False, "saves": True, "time": NOW + 6}
    assert events(d, "failure")[0].endswith("; nobody excluded")


def test_nothing_found_clears_a_pending_failure_and_a_quiet_tick_writes_nothing():
    d = decide(running(job=busy(failure_since=NOW - 1)), S)
    assert d.job == {"failure_since": None} and d.events == []
    assert decide(running(), S).job == {}


def test_a_failure_event_says_who_failed_and_what_was_done():
    d = decide(running(exits=[killed("n0", 1)]), S)
    assert events(d, "failure") == ["generation 0 failed: rank 1 on n0 ended with SIGKILL (9); "
                                    "node n0 excluded"]
    assert events(d, "restarting") == ["restart 1 of at most 2: generation 1 after 1 s, from "
                                       "the latest committed checkpoint"]


def test_wrong_arithmetic_restarts_from_before_the_tiles_last_passing_check():
    d = decide(running(unhealthy={"n1": "n1/0: fixed-seed matmul gave 1.0"}), S)
    assert events(d, "restarting") == [
        "restart 1 of at most 2: generation 1 after 1 s, from the newest checkpoint committed "
        "before the bad tile's last passing health check"]


def test_the_last_restart_allowed_is_taken_and_the_one_past_it_fails_the_job():
    d = decide(running(exits=[killed("n0", 1)], job=busy(restarts=1)), S)  # max_restarts=2
    assert d.job["state"] == RESTARTING and d.job["restarts"] == 2
    assert d.job["next_plan_at"] == NOW + 2  # backoff doubles
    assert events(d, "restarting")[0].startswith("restart 2 of at most 2: generation 1 after 2 s")
    d = decide(running(exits=[killed("n0", 1)], job=busy(restarts=2)), S)
    assert d.job["state"] == FAILED and d.job["restarts"] == 3
    assert d.job["reason"] == ("2 restarts used up (max_restarts=2); last failure: rank 1 on n0 "
                               "ended with SIGKILL (9)")


def test_restart_causes_add_to_the_counts_already_kept():
    job = busy(restart_causes={"rank_exit": 2, "hang": 1})
    d = decide(running(exits=[killed("n0", 1)], job=job), H)
    assert d.job["restart_causes"] == {"rank_exit": 3, "hang": 1}


def test_a_hang_where_every_rank_waits_restarts_unattributed_to_a_node_as_a_hang():
    job = busy(progress_at=NOW - 11, hang_since=NOW - H.stack_wait_s)  # exactly the wait
    d = decide(running(job=job, progress=5), H)
    what = "hung: no step past 5 for 11.0 s (threshold 10.0 s), every rank waiting"
    assert d.job["reason"] == f"{what}; no culprit" and d.exclude == []
    assert d.job["restart_causes"] == {"hang": 1}
    assert (d.job["last_failure"]["node"], d.job["last_failure"]["cause"],
            d.job["last_failure"]["excluded"]) == ("", "hang", False)
    (message,) = events(d, "failure")
    assert message == f"generation 0 failed: {what}; no culprit; nobody excluded"
    assert [f["stacks"] for k, _, f in d.events if k == "failure"] == ["{}"]


def test_evidence_seen_during_a_stall_is_acted_on_instead_of_asking_for_stacks():
    job = busy(progress_at=NOW - 11)
    d = decide(running(job=job, progress=5, exits=[killed("n1", 2)]), H)
    assert d.commands == [] and d.job["reason"] == "rank 2 on n1 ended with SIGKILL (9)"


# --- stragglers are judged only while the job trains and its scores were read -------------------

def test_no_straggler_is_judged_while_a_pause_is_wanted_or_the_scores_were_not_read():
    slow = {"n0": 0.10, "n1": 0.35}
    asked = busy(desired="pause", desired_by="ana")  # RUNNING: the pause is on its way
    d = decide(running(job=asked, compute=slow), H)
    assert events(d, "straggler") == [] and "stragglers" not in d.job
    paused = busy(state="PAUSED", desired="pause", desired_by="ana")
    d = decide(running(job=paused, compute=slow, paused_nodes=2), H)
    assert d.events == [] and d.job == {}
    d = decide(running(job=busy(stragglers=("n1",)), compute=None), H)
    assert "stragglers" not in d.job  # not read this tick: the list stands


# --- a job whose checkpoint saves failed -------------------------------------------------------

def test_saves_failed_on_every_rank_but_rank_0_ends_the_job_at_once():
    said = "error: 3 checkpoint saves failed in a row"
    exits = [killed("n0", 0)] + [Exit(f"n{r // 2}", r, 0, code=89, tail=said, time=NOW)
                                 for r in (1, 2, 3)]
    d = decide(running(exits=exits), SAVES)
    assert d.job["state"] == FAILED and d.job["reason"].startswith("3 checkpoint saves failed")


def test_the_wait_for_rank_0_runs_from_the_lowest_failed_ranks_exit():
    early = Exit("n0", 1, 0, code=89, tail="error: disk full", time=NOW - 10)
    late = Exit("n1", 2, 0, code=89, tail="error: disk full too", time=NOW)
    d = decide(running(exits=[late, early]), SAVES)
    assert d.job["state"] == FAILED and d.job["reason"].startswith("disk full; not restarted")


def test_a_failed_save_is_said_by_the_last_error_line_else_by_the_exit():
    tail = "error: first try failed\nstep 12\nerror: the retry failed too\n[W1 warning]"
    d = decide(running(exits=[Exit("n0", 0, 0, code=89, tail=tail, time=NOW)]), SAVES)
    assert d.job["reason"].startswith("the retry failed too; not restarted")
    quiet = [Exit("n1", 2, 0, code=89, time=NOW), Exit("n0", 0, 0, code=89, time=NOW)]
    d = decide(running(exits=quiet), SAVES)
    said = ("exit code 89 (its checkpoint saves failed (the final step's, or max_failed_saves "
            "in a row))")
    assert d.job["reason"].startswith(f"rank 0 on n0 ended with {said}; not restarted")
    d = decide(running(exits=quiet[:1], now=NOW + 6), SAVES)
    assert d.job["reason"].startswith(f"rank 2 on n1 ended with {said}; not restarted")


# --- an operator's exclusion of running nodes ---------------------------------------------------

def test_excluding_running_nodes_names_the_first_reason_and_it_or_them():
    d = decide(running(excluded={"n1": "ECC errors"}), S)
    assert d.job["reason"] == ("n1 excluded (ECC errors): generation 0 saves a checkpoint and "
                               "stops, the next runs without it")
    d = decide(running(excluded={"n1": "fan", "n0": "ECC errors"}), S)
    assert d.job["reason"] == ("n0, n1 excluded (ECC errors): generation 0 saves a checkpoint "
                               "and stops, the next runs without them")
    assert d.plan["action"] == "stop" and d.job["next_plan_at"] == NOW


def test_an_exclusion_in_the_same_tick_as_a_failure_is_a_leave_not_a_restart():
    d = decide(running(excluded={"n1": "ECC errors"}, exits=[killed("n1", 2)],
                       spares={"n2": "host-n2:7000"}), S)
    assert "restarts" not in d.job and d.job["restart_causes"] == {"operator": 1}
    assert d.plan["action"] == "stop" and d.exclude == []
    assert events(d, "failure") == [] and events(d, "buddies") == []


def test_a_large_plans_buddies_message_names_the_first_eight_nodes():
    nodes = [f"n{i}" for i in range(9)]
    spares = {f"s{i}": f"host-s{i}:7000" for i in range(5)}  # two nodes' copies each
    views = {n: node(n, generation=0, live=2) for n in nodes}
    d = decide(running(nodes=views, plan={**running_plan(), "nodes": nodes}, spares=spares), S)
    (message,) = events(d, "buddies")
    assert message.endswith("now go n0 -> s0; n1 -> s1; n2 -> s2; n3 -> s3; n4 -> s4; "
                            "n5 -> s0; n6 -> s1; n7 -> s2")
    assert d.plan["buddies"]["n8"]["node"] == "s3"
