"""The controller's limits, each pinned exactly at its edge and one past it.

Progress and stalls: the first two moves of a generation are not step times, the stall clock
of an older generation is never read, startup gets its own timeout until the second move, a
stall is strictly longer than its threshold. Hangs: two sample nodes besides the culprits, the
stacks awaited up to exactly stack_wait_s, the first culprit blamed, each stack cut to its last
4000 characters. Planning: the first generation's wait for late agents, the generation number,
the nodes that still drain the last generation, the memory snapshot (which spare takes a lost
node's slot and where its shards come from, the lineage as rank 0 corrected it, a bad tile's
window from the observation or from the job record, each alone), the failed-saves streak,
messages that name what they cut short.
"""

from __future__ import annotations

import dataclasses
import json

from test_decide import NOW, H, S, beat, busy, node, running, running_plan

from controller.control.decide import (
    RESTARTING,
    RUNNING,
    WAITING,
    JobView,
    NodeView,
    Observed,
    Settings,
    decide,
    names,
)
from optimus.checkpoint.snapshot_files import point_name

SHRINKS = Settings(**{**S.__dict__, "node_counts": (2, 1)})


def dumped(d) -> list[str]:
    """The nodes asked for stacks, in order."""
    return [n for n, command in d.commands if command["kind"] == "dump_stacks"]


# --- progress and stalls (H: hang_timeout_s 10, startup_timeout_s 60, stack_wait_s 8) ------------

def test_a_new_generation_starts_its_progress_clock_from_nothing():
    d = decide(running(job=busy(progress_gen=None, hang_since=NOW - 3), progress=40), H)
    assert d.job == {"progress_gen": 0, "progress_step": -1, "progress_at": NOW,
                     "progress_moves": 0, "hang_since": None}


def test_the_third_move_is_the_first_sampled_as_a_step_time():
    d = decide(running(job=busy(progress_moves=1, progress_at=NOW - 2), progress=6), H)
    assert d.job["progress_moves"] == 2 and "step_times" not in d.job  # the first step
    d = decide(running(job=busy(progress_moves=2, progress_at=NOW - 2), progress=7), H)
    assert d.job["progress_moves"] == 3 and d.job["step_times"] == [1.0]
    assert d.job["progress_step"] == 7 and d.job["progress_at"] == NOW


def test_step_times_keep_the_last_32_samples():
    job = busy(step_times=tuple(float(i) for i in range(32)), progress_at=NOW - 4)
    d = decide(running(job=job, progress=7), H)
    assert d.job["step_times"] == [float(i) for i in range(1, 32)] + [2.0]


def test_a_stall_is_strictly_longer_than_its_threshold():
    assert dumped(decide(running(job=busy(progress_at=NOW - 10), progress=5), H)) == []
    assert dumped(decide(running(job=busy(progress_at=NOW - 10.5), progress=5), H)) != []


def test_startup_has_its_own_timeout_until_the_generations_second_move():
    starting = busy(progress_moves=1, progress_at=NOW - 11)
    assert dumped(decide(running(job=starting, progress=5), H)) == []
    assert dumped(decide(running(job=busy(progress_moves=1, progress_at=NOW - 61), progress=5),
                         H)) != []
    assert dumped(decide(running(job=busy(progress_moves=2, progress_at=NOW - 11), progress=5),
                         H)) != []


def test_with_a_history_the_stall_bound_adapts_and_a_save_keeps_the_fixed_one():
    """hang_floor_s 2, k 4, 8 timed steps of 0.5 s: a stall of 3 s is a hang (not 10 s), but
    not while a rank reports saving or evaluating (then T = 10 s)."""
    adaptive = Settings(**{**H.__dict__, "hang_floor_s": 2.0})
    timed = busy(progress_moves=2 + 8, step_times=(0.5,) * 8, progress_at=NOW - 3)
    d = decide(running(job=timed, progress=5), adaptive)
    assert dumped(d) != [] and "(threshold 2.0 s)" in d.events[0][1]
    assert dumped(decide(running(job=timed, progress=5, long_phase=True), adaptive)) == []
    saving_long = busy(progress_moves=10, step_times=(0.5,) * 8, progress_at=NOW - 10.5)
    d = decide(running(job=saving_long, progress=5, long_phase=True), adaptive)
    assert dumped(d) != [] and "(threshold 10.0 s)" in d.events[0][1]
    # one timed step short of the history: still the fixed bound
    young = busy(progress_moves=2 + 7, step_times=(0.5,) * 8, progress_at=NOW - 3)
    assert dumped(decide(running(job=young, progress=5), adaptive)) == []


def test_the_stall_clock_of_an_older_generation_is_never_read():
    job = busy(generation=1, progress_gen=0, progress_at=NOW - 100)
    d = decide(running(job=job, plan=running_plan(gen=1), progress=5), H)
    assert d.commands == [] and d.job["progress_gen"] == 1 and d.job["progress_at"] == NOW


# --- hangs: which stacks are asked for and awaited ----------------------------------------------

FOUR = ("n0", "n1", "n2", "n3")
BEHIND = {"n1": {0: beat(2, 6, "optim"), 1: beat(3, 7, "grad_sync")}}  # rank 2 is a step behind


def four(**more) -> Observed:
    return running(nodes={n: node(n, generation=0, live=2) for n in FOUR},
                   plan={**running_plan(), "nodes": list(FOUR), "world_size": 8},
                   progress=7, suspects=BEHIND, **more)


def test_a_hang_asks_the_culprits_and_two_other_nodes_for_stacks_saying_how_long():
    d = decide(four(job=busy(progress_step=7, progress_at=NOW - 11)), H)
    assert dumped(d) == ["n1", "n0", "n2"]
    assert d.events == [("suspect", "generation 0: no step past 7 for 11.0 s (threshold 10.0 s) "
                         "while heartbeats are fresh; holding the others up: rank 2 on n1 "
                         "(local 0): step 6, phase optim for 20.0 s; collecting stacks", {})]


def test_a_hang_is_decided_once_the_culprits_and_two_samples_stacks_are_in():
    job = busy(progress_step=7, progress_at=NOW - 11, hang_since=NOW - 1)
    two = {2: "culprit", 0: "sample n0"}
    assert decide(four(job=job, stacks=two), H).plan is None  # n2's rank 4 is not in yet
    long = "a" + "b" * 4000
    d = decide(four(job=job, stacks={**two, 4: long}), H)
    assert d.plan["action"] == "stop"
    assert d.job["reason"] == ("hung: no step past 7 for 11.0 s (threshold 10.0 s): rank 2 on n1 "
                               "(local 0): step 6, phase optim for 20.0 s, while the others "
                               "wait in a collective")
    (stacks,) = [json.loads(f["stacks"]) for k, _, f in d.events if k == "failure"]
    assert stacks == {"0": "sample n0", "2": "culprit", "4": "b" * 4000}  # the last 4000


def test_of_two_ranks_behind_the_first_nodes_is_blamed():
    both = {"n0": {0: beat(0, 6, "optim")}, "n1": {0: beat(2, 6, "optim")}}
    job = busy(progress_step=7, progress_at=NOW - 11, hang_since=NOW - 9)
    d = decide(running(job=job, progress=7, suspects=both), H)
    assert d.job["failures"] == {"n0": [NOW]} and d.job["last_failure"]["node"] == "n0"
    assert d.job["reason"].endswith("rank 0 on n0 (local 0): step 6, phase optim for 20.0 s; "
                                    "rank 2 on n1 (local 0): step 6, phase optim for 20.0 s, "
                                    "while the others wait in a collective")


# --- planning the next generation -------------------------------------------------------------

def test_a_first_generation_says_where_it_runs_and_from_what_exactly():
    obs = Observed(now=NOW, job=JobView(), plan=None, nodes={n: node(n) for n in ("n0", "n1")},
                   latest_step=None)
    d = decide(obs, S)
    assert d.plan["reason"] == "generation 0 on n0, n1 from scratch"
    assert (d.plan["master_port"], d.plan["resume_step"], d.plan["failed_saves"],
            d.plan["lineage"]) == (0, None, 0, [[0, -1]])


def test_the_size_check_failures_named_are_the_first_three():
    skipped = ("step 50: rank 1 short", "step 45: rank 0 short", "step 44: x", "step 43: y")
    obs = Observed(now=NOW, job=JobView(), plan=None, nodes={n: node(n) for n in ("n0", "n1")},
                   latest_step=40, skipped=skipped)
    assert decide(obs, S).plan["reason"] == (
        "generation 0 on n0, n1 from the checkpoint of step 40 (newer ones fail their size "
        "check: step 50: rank 1 short; step 45: rank 0 short; step 44: x)")


def test_a_wait_for_nodes_says_so_again_when_its_reason_changes():
    job = JobView(state=WAITING, reason="waiting for nodes: an older reason")
    d = decide(Observed(now=NOW, job=job, plan=None, nodes={"n0": node("n0")}), S)
    assert d.job == {"state": WAITING, "reason": "waiting for nodes: the layout needs 2 x 2 "
                     "ranks, 1 healthy node(s) available"}
    wide = Settings(**{**S.__dict__, "nodes": 3, "node_counts": (3, 2)})
    d = decide(Observed(now=NOW, job=JobView(), plan=None, nodes={"n0": node("n0")}), wide)
    assert d.job["reason"].startswith("waiting for nodes: the layout needs 2 to 3 x 2 ranks")


def test_the_first_generation_waits_to_start_on_the_largest_count_it_has():
    three = Settings(**{**S.__dict__, "nodes": 3, "node_counts": (3, 2, 1)})
    d = decide(Observed(now=NOW, job=JobView(), plan=None,
                        nodes={n: node(n) for n in ("n0", "n1")}), three)
    assert d.job["reason"] == ("waiting up to 5 s for 3 nodes before starting on 2: 2 healthy "
                               "node(s) so far")


def test_only_the_first_generation_waits_for_late_agents():
    job = JobView(state=RESTARTING, generation=0, restarts=1)  # no backoff on record
    d = decide(Observed(now=NOW, job=job, plan={**running_plan(), "action": "stop"},
                        nodes={"n0": node("n0"), "n1": node("n1", alive=False)}), SHRINKS)
    assert d.plan["nodes"] == ["n0"] and d.job["state"] == RUNNING



def test_a_generation_number_is_never_reused_whichever_record_is_ahead():
    nodes = {n: node(n) for n in ("n0", "n1")}
    stop = {**running_plan(gen=3), "action": "stop"}
    behind = JobView(state=RESTARTING, generation=1, next_plan_at=NOW)  # plan written last
    assert decide(Observed(now=NOW, job=behind, plan=stop, nodes=nodes), S).plan[
        "generation"] == 4
    ahead = JobView(state=RESTARTING, generation=5, next_plan_at=NOW)  # plan not written
    assert decide(Observed(now=NOW, job=ahead, plan=stop, nodes=nodes), S).plan[
        "generation"] == 6


def test_a_node_with_one_live_rank_holds_the_next_generation_a_lost_agents_do_not():
    job = JobView(state=RESTARTING, generation=0, restarts=1, next_plan_at=NOW)
    stop = {**running_plan(), "action": "stop"}
    one = {"n0": node("n0", generation=0, live=1), "n1": node("n1", generation=0),
           "n2": node("n2")}
    assert decide(Observed(now=NOW, job=job, plan=stop, nodes=one), S).plan is None
    lost = {**one, "n0": node("n0", alive=False, generation=0, live=1)}
    assert decide(Observed(now=NOW, job=job, plan=stop, nodes=lost), S).plan["nodes"] == [
        "n1", "n2"]
    older = {**one, "n0": node("n0", generation=-1, live=2)}  # an earlier generation's ranks
    assert decide(Observed(now=NOW, job=job, plan=stop, nodes=older), S).plan["generation"] == 1


# --- the failed-saves streak -------------------------------------------------------------------

def test_the_failed_saves_streak_is_the_longest_a_node_said_and_never_negative():
    job = JobView(state=RESTARTING, generation=0, restarts=1, next_plan_at=NOW)
    said = {n: NodeView(**{**node(n, generation=0).__dict__, "failed_saves": k})
            for n, k in (("n0", 1), ("n1", 3))}
    stop = {**running_plan(), "action": "stop"}
    assert decide(Observed(now=NOW, job=job, plan=stop, nodes=said), S).plan["failed_saves"] == 3
    quiet = {n: node(n, generation=0) for n in ("n0", "n1")}
    for carried in (-2, "3", 0):
        plan = {**stop, "failed_saves": carried}
        assert decide(Observed(now=NOW, job=job, plan=plan, nodes=quiet), S).plan[
            "failed_saves"] == 0


# --- resuming from a memory snapshot -----------------------------------------------------------

def _p(step: int, gen: int = 0) -> str:
    return point_name(step, gen)


def _snap(own=None, held=None, taken=None) -> dict:
    return {"addr": "x:1", "own": own or {}, "held": held or {}, "taken": taken or {}}


def _addressed(**views: NodeView) -> dict[str, NodeView]:
    return {n: NodeView(**{**v.__dict__, "snapshot_addr": f"host-{n}:7000"})
            for n, v in views.items()}


RESTARTED = JobView(state=RESTARTING, generation=0, restarts=1, next_plan_at=NOW)
STOPPED_PLAN = {**running_plan(), "action": "stop"}


def test_a_lost_nodes_slot_goes_to_the_first_free_spare_fetching_from_the_first_holder():
    nodes = _addressed(n0=node("n0", alive=False, excluded="lost"), n1=node("n1"),
                       n2=node("n2"), n3=node("n3"), n4=node("n4", healthy=False))
    reports = {"n1": _snap(own={_p(44): [2, 3]}, held={_p(44): [0, 1]}),
               "n4": _snap(held={_p(44): [0, 1, 2, 3]})}  # alive but unhealthy: a holder only
    d = decide(Observed(now=NOW, job=RESTARTED, plan=STOPPED_PLAN, nodes=nodes, latest_step=40,
                        snapshots=reports), S)
    assert d.plan["nodes"] == ["n2", "n1"]  # n2 and n3 are free; neither holds n0's copy
    assert d.plan["memory"] == {"step": 44, "generation": 0,
                                "holders": {"n2": {"node": "n1", "addr": "host-n1:7000"}}}


def test_a_point_on_the_line_rank_0_abandoned_is_not_resumed_from():
    # Generation 1 was planned from step 40, which was corrupt: rank 0 loaded step 30. Step 35
    # of generation 0 is ahead of where the line really restarted.
    job = JobView(state=RESTARTING, generation=1, restarts=1, next_plan_at=NOW,
                  resumed_gen=1, resumed_step=30)
    plan = {**running_plan(gen=1), "action": "stop", "lineage": [[0, -1], [1, 40]]}
    nodes = _addressed(**{n: node(n) for n in ("n0", "n1", "n2")})
    reports = {"n0": _snap(own={_p(35): [0, 1]}), "n1": _snap(own={_p(35): [2, 3]}),
               "n2": _snap(held={_p(35): [0, 1, 2, 3]})}
    d = decide(Observed(now=NOW, job=job, plan=plan, nodes=nodes, latest_step=30,
                        snapshots=reports), S)
    assert "memory" not in d.plan and d.plan["resume_step"] == 30
    # What generation 0's rank 0 loaded says nothing of generation 1: the plan's line stands.
    stale = JobView(**{**job.__dict__, "resumed_gen": 0})
    d = decide(Observed(now=NOW, job=stale, plan=plan, nodes=nodes, latest_step=30,
                        snapshots=reports), S)
    assert d.plan["memory"]["step"] == 35 and d.plan["lineage"] == [[0, -1], [2, 35]]


def _two_points() -> tuple[dict, dict]:
    """Points 20 (taken at 100) and 40 (at 300) of n0 and n1, replicated on n2; n1 excluded."""
    nodes = _addressed(n0=node("n0"), n1=node("n1", excluded="bad tile"), n2=node("n2"))
    taken = {_p(20): 100.0, _p(40): 300.0}
    reports = {"n0": _snap(own={_p(20): [0, 1], _p(40): [0, 1]}, taken=taken),
               "n1": _snap(own={_p(20): [2, 3], _p(40): [2, 3]}, taken=taken),
               "n2": _snap(held={_p(20): [0, 1, 2, 3], _p(40): [0, 1, 2, 3]})}
    return nodes, reports


def test_a_bad_tiles_window_observed_alone_refuses_the_points_after_its_last_pass():
    nodes, reports = _two_points()
    distrust = {"nodes": ["n1"], "since": 200.0, "after_step": None}
    d = decide(Observed(now=NOW, job=RESTARTED, plan=STOPPED_PLAN, nodes=nodes, latest_step=10,
                        snapshots=reports, distrust=distrust), S)
    assert d.plan["memory"]["step"] == 20 and "step 40 was taken after n1" in d.plan["reason"]


def test_a_suspect_job_alone_refuses_the_points_after_the_failing_generations_resume():
    nodes, reports = _two_points()
    window = {"nodes": ["n1"], "generation": 0, "evidence": "bad tile", "resumed_step": 20,
              "set_aside": True}  # set aside in an earlier tick; no distrust observed now
    job = JobView(**{**RESTARTED.__dict__, "suspect": window})
    d = decide(Observed(now=NOW, job=job, plan=STOPPED_PLAN, nodes=nodes, latest_step=10,
                        snapshots=reports), S)
    assert d.plan["memory"]["step"] == 20  # what the failing generation resumed from
    assert "memory snapshot of step 40 was computed on n1, which has no passing health check" \
        in d.plan["reason"]


# --- messages stay small -----------------------------------------------------------------------

def test_names_lists_eight_nodes_and_counts_the_rest():
    eight = [f"n{i}" for i in range(8)]
    assert names(eight) == "n0, n1, n2, n3, n4, n5, n6, n7"
    assert names([*eight, "n8"]) == "n0, n1, n2, n3, n4, n5, n6, n7 and 1 more"
    assert names([*eight, "n8", "n9"], shown=2) == "n0, n1 and 8 more"


def test_a_spare_that_missed_beats_is_launched_on_only_once_it_beats_again_or_is_gone():
    """Killed a moment before the node it was to replace, a spare is still alive to the
    controller (its probe not yet answered, agent_timeout_s not passed): the plan waits for
    it rather than launching on it (or resuming from the copy it held)."""
    restarting = JobView(state=RESTARTING, generation=0, restarts=1, next_plan_at=NOW - 1)
    plan = {**running_plan(), "action": "stop"}
    drained = {"n0": node("n0", excluded="killed", generation=0), "n1": node("n1", generation=0),
               "n2": dataclasses.replace(node("n2"), silent=True)}

    def planned(nodes):
        return decide(Observed(now=NOW, job=restarting, plan=plan, nodes=nodes,
                               latest_step=40), S).plan

    assert planned(drained) is None
    held = decide(Observed(now=NOW, job=restarting, plan=plan, nodes=drained, latest_step=40), S)
    assert held.job["reason"].startswith("next generation held: spare n2 missed its agent's")
    assert [(kind, fields) for kind, _, fields in held.events] == [("held", {"nodes": ["n2"]})]
    said = dataclasses.replace(restarting, reason=held.job["reason"])  # said once, not each tick
    again = decide(Observed(now=NOW, job=said, plan=plan, nodes=drained, latest_step=40), S)
    assert again.plan is None and "reason" not in again.job and not again.events
    assert planned({**drained, "n2": node("n2")})["nodes"] == ["n1", "n2"]  # it beat again
    gone = {**drained, "n2": dataclasses.replace(node("n2", alive=False), silent=True),
            "n3": node("n3")}
    assert planned(gone)["nodes"] == ["n1", "n3"]
    # A survivor's own silence is the lost-node rule's to judge (detect.py), not this one's.
    quiet_survivor = {**drained, "n1": dataclasses.replace(drained["n1"], silent=True),
                      "n2": node("n2")}
    assert planned(quiet_survivor)["nodes"] == ["n1", "n2"]
