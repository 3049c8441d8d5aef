"""controller/control/detect.py, rule by rule: what each exit status and last line says about a
rank, which evidence a snapshot holds (bad tiles, lost nodes at the timeout and one past it,
frozen ranks of the plan only), the hang threshold and which rank a hang blames (only this
generation's plan members count), stragglers against the median of the others, and the flaky
node's window, each pinned at its boundary.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from controller.control.detect import (
    COLLATERAL,
    HARD,
    SOFT,
    Evidence,
    _median_without,
    describe_rank,
    evidence,
    exit_evidence,
    flaky,
    hang_culprits,
    in_long_phase,
    stall_threshold,
    straggling,
)
from controller.control.view import Exit, JobView, Observed, Overdue, Settings

NOW = 1000.0
# agent_silence_s = 2 x 0.5 = 1.0 s; agent_timeout_s = 5 s.
S = Settings(nodes=2, ranks_per_node=2, heartbeat_interval_s=0.5, agent_timeout_s=5,
             hang_timeout_s=10, hang_step_factor=4, straggler_factor=2, flaky_failures=2,
             flaky_window_s=100, launch={"job_file": "/jobs/x.yaml", "log_dir": "/runs/x/logs"})
PLAN = {"generation": 1, "nodes": ["n0", "n1"], "ranks_per_node": 2}


def observed(**fields) -> Observed:
    """Generation 1 on n0 and n1, both agents beating just now, nothing wrong yet."""
    more = {"agent_beats": {"n0": NOW - 0.5, "n1": NOW - 0.5}, **fields}
    return Observed(now=NOW, job=more.pop("job", JobView()), plan=more.pop("plan", PLAN),
                    nodes={}, **more)


def beat(rank: int, step: int, phase: str, generation: int = 1, finite: bool = True) -> dict:
    return {"rank": rank, "step": step, "phase": phase, "phase_since": NOW - 20,
            "finite": finite, "generation": generation}


# --- one rank's exit ---------------------------------------------------------------------------

def test_exit_87_is_hard_evidence_against_the_ranks_own_tile():
    e = Exit("n1", 3, 1, code=87, time=NOW - 1, local_rank=1)
    assert exit_evidence(e) == Evidence(
        "n1", "bad tile n1/1 (rank 3): its own loss or gradients were NaN/Inf", HARD, NOW - 1,
        "bad_tile", 3, "n1/1")


def test_exit_88_is_collateral_whatever_its_last_line_says():
    for tail in ("", "ValueError: the loss was NaN"):
        e = Exit("n0", 1, 1, code=88, tail=tail, time=NOW)
        assert exit_evidence(e) == Evidence("n0", e.describe(), COLLATERAL, NOW, "rank_exit", 1)


def test_a_peers_connection_error_as_last_line_makes_an_exit_collateral_any_other_soft():
    def kind(code, tail=""):
        return exit_evidence(Exit("n0", 1, 1, code=code, tail=tail, time=NOW)).kind

    assert kind(1, "RuntimeError: Connection reset by peer") == COLLATERAL
    assert kind(1, "torch.distributed.DistStoreError: wait timed out") == COLLATERAL
    assert kind(1, "ValueError: shapes do not match") == SOFT
    assert kind(1) == SOFT
    assert kind(86) == kind(89) == SOFT  # only 87 and 88 are statuses of their own
    soft = exit_evidence(Exit("n0", 1, 1, code=None, signal=9, time=NOW))
    assert (soft.kind, soft.cause, soft.rank, soft.tile) == (SOFT, "rank_exit", 1, "")


def test_only_hard_bad_tile_evidence_of_a_tile_that_computed_is_wrong_arithmetic():
    def wrong(kind=HARD, cause="bad_tile", computed=True):
        return Evidence("n0", "x", kind, NOW, cause, computed=computed).wrong_arithmetic

    assert wrong() is True
    assert wrong(computed=False) is False  # idle since its last pass: nothing it made is bad
    assert wrong(kind=SOFT) is False
    assert wrong(cause="node_lost") is False


def test_failure_fields_leave_the_rank_empty_when_evidence_names_none():
    assert Evidence("n0", "x", HARD, NOW, "node_lost").fields() == {
        "node": "n0", "rank": "", "tile": "", "cause": "node_lost", "evidence": "hard"}
    assert Evidence("n1", "x", SOFT, NOW, "heartbeat", 0).fields()["rank"] == 0


# --- the evidence in a snapshot ----------------------------------------------------------------

def test_a_failed_health_check_names_its_tile_and_whether_it_computed_since_its_pass():
    bad = {"n0": "n0/1: matmul mismatch: off by 0.3", "n2": "n2/0: matmul mismatch"}
    found = evidence(observed(unhealthy=bad), S)
    assert found == [Evidence("n0", "bad tile n0/1: matmul mismatch: off by 0.3", HARD, NOW,
                              "bad_tile", tile="n0/1", computed=True)]  # n2 is no plan node
    idle, = evidence(observed(unhealthy=bad, unhealthy_idle=frozenset({"n0"})), S)
    assert idle.computed is False and idle.wrong_arithmetic is False


def test_nonfinite_blames_the_first_of_the_nodes_ranks_that_reported_its_own_nan():
    beats = {2: beat(6, 7, "backward", finite=False), 0: beat(4, 7, "grad_sync"),
             1: beat(5, 7, "backward", finite=False)}
    found, = evidence(observed(nonfinite=frozenset({"n1", "n2"}), suspects={"n1": beats}), S)
    assert found == Evidence(
        "n1", "bad tile n1/1 (rank 5, step 7), n1/2 (rank 6, step 7): its own loss or "
        "gradients were NaN/Inf", HARD, NOW, "bad_tile", 5, "n1/1")


def test_nonfinite_without_the_ranks_beats_names_the_node_only():
    found, = evidence(observed(nonfinite=frozenset({"n0"})), S)
    assert (found.what, found.rank, found.tile) == (
        "bad tile n0: its own loss or gradients were NaN/Inf", None, "")


def test_a_node_is_lost_one_past_the_agent_timeout_not_at_it():
    found = evidence(observed(agent_beats={"n0": NOW - 5.0, "n1": NOW - 5.5}), S)
    assert found == [Evidence("n1", "node n1 lost: its agent has been silent for 5.5 s", HARD,
                              NOW - 5.5, "node_lost")]


def test_a_node_whose_agent_never_beat_is_lost_since_ever():
    found = evidence(observed(agent_beats={"n0": NOW - 0.5, "n1": None}), S)
    assert found == [Evidence("n1", "node n1 lost: its agent has been silent for ever", HARD,
                              0.0, "node_lost")]


def test_an_overdue_rank_whose_agent_missed_beats_makes_its_node_lost_not_frozen():
    late = Overdue("n0", 1, "no heartbeat for 6.0 s", since=NOW - 6)
    # Past agent_silence_s (1 s): lost, and the rank's silence is no evidence of its own.
    found = evidence(observed(overdue=[late], agent_beats={"n0": NOW - 1.5, "n1": NOW - 1.5}), S)
    assert [(e.node, e.cause, e.time) for e in found] == [("n0", "node_lost", NOW - 1.5)]
    # At exactly agent_silence_s the agent is on time: the rank is frozen, its node is not lost.
    found = evidence(observed(overdue=[late], agent_beats={"n0": NOW - 1.0, "n1": NOW}), S)
    assert found == [Evidence("n0", "rank 1 on n0: no heartbeat for 6.0 s", SOFT, NOW - 6,
                              "heartbeat", 1)]


def test_only_a_confirmed_overdue_rank_of_a_plan_node_is_frozen():
    overdue = [Overdue("n2", 4, "no heartbeat", since=NOW - 6),
               Overdue("n0", 0, "no heartbeat", since=NOW - 6, confirmed=False),
               Overdue("n1", 3, "no heartbeat for 7.0 s", since=NOW - 7)]
    assert evidence(observed(overdue=overdue), S) == [
        Evidence("n1", "rank 3 on n1: no heartbeat for 7.0 s", SOFT, NOW - 7, "heartbeat", 3)]


def test_evidence_lists_exits_then_bad_tiles_then_lost_nodes_then_frozen_ranks():
    found = evidence(observed(
        exits=[Exit("n0", 1, 1, code=0), Exit("n0", 0, 1, code=1, time=NOW, by_agent=True),
               Exit("n0", 1, 1, code=1, time=NOW)],
        unhealthy={"n0": "n0/0: bad"}, agent_beats={"n0": NOW, "n1": NOW - 9},
        overdue=[Overdue("n0", 0, "x", since=NOW - 6)]), S)
    assert [(e.node, e.cause) for e in found] == [
        ("n0", "rank_exit"), ("n0", "bad_tile"), ("n1", "node_lost"), ("n0", "heartbeat")]


# --- a hang ------------------------------------------------------------------------------------

def test_the_hang_threshold_is_fixed_until_the_generation_has_a_history():
    """Before `hang_history` timed steps of this generation (its first steps, compiles):
    max(T, k x p99); T = 10, k = 4 here."""
    assert stall_threshold(JobView(), S) == 10  # no step timed yet
    assert stall_threshold(JobView(step_times=(1.0,), progress_moves=3), S) == 10  # 4 s < T
    # the p99 of 3 samples is their largest: 4 x 5 s
    assert stall_threshold(JobView(step_times=(1.0, 5.0, 3.0), progress_moves=5), S) == 20


def test_then_it_adapts_to_the_step_times_down_to_the_floor():
    """From `hang_history` (8) timed steps on: max(floor, k x p99), far under T for fast
    steps: a 5 s step is judged hung after 50 s, not 600."""
    s = replace(S, hang_timeout_s=600, hang_floor_s=30, hang_step_factor=10)
    history = JobView(step_times=(5.0,) * 32, progress_moves=2 + 8)
    assert stall_threshold(history, s) == 50
    assert stall_threshold(replace(history, progress_moves=2 + 7), s) == 600  # one short
    fast = replace(history, step_times=(0.2,) * 32)
    assert stall_threshold(fast, s) == 30  # 10 x 0.2 s: the floor
    # p99, not the median: one slow step in a hundred does not move it, two do
    times = (1.0,) * 98 + (9.0,)
    assert stall_threshold(replace(history, step_times=times[-32:]), s) == 90  # 1 in 32
    hundred = replace(history, step_times=(1.0,) * 99 + (9.0,))
    assert stall_threshold(hundred, s) == 30
    assert stall_threshold(replace(hundred, step_times=(1.0,) * 98 + (9.0, 9.0)), s) == 90
    # a save or an evaluation has no history of its own: the fixed bound
    assert stall_threshold(history, s, long_phase=True) == 600
    slow = replace(history, step_times=(90.0,) * 32)  # steps longer than T/k: k x p99 wins
    assert stall_threshold(slow, s) == stall_threshold(slow, s, long_phase=True) == 900


def test_a_save_or_an_evaluation_is_what_a_rank_heartbeat_says():
    saving = {"n0": {0: beat(0, 10, "checkpoint")}, "n1": {0: beat(2, 10, "checkpoint_sync")}}
    assert in_long_phase(saving, 1)
    assert in_long_phase({"n1": {1: beat(3, 10, "eval")}}, 1)
    assert not in_long_phase(saving, 2)  # another generation's beats say nothing of this one
    assert not in_long_phase({"n0": {0: beat(0, 10, "grad_sync")}}, 1)
    assert not in_long_phase({}, 1)


def test_a_hang_blames_the_ranks_behind_the_furthest_step_in_node_order():
    suspects = {"n1": {0: beat(2, 10, "grad_sync"), 1: beat(3, 9, "forward")},
                "n0": {1: beat(1, 9, "backward"), 0: beat(0, 10, "grad_sync")}}
    assert hang_culprits(observed(suspects=suspects)) == [
        ("n0", 1, suspects["n0"][1]), ("n1", 1, suspects["n1"][1])]


def test_the_furthest_step_is_the_progress_seen_when_there_is_one():
    suspects = {"n0": {0: beat(0, 10, "grad_sync")}, "n1": {0: beat(2, 10, "grad_sync")}}
    culprits = hang_culprits(observed(suspects=suspects, progress=11))
    assert [(n, lr) for n, lr, _ in culprits] == [("n0", 0), ("n1", 0)]


def test_without_progress_the_furthest_step_is_the_highest_step_beaten():
    # The rank behind waits in a collective, the one ahead does not: behind still wins.
    suspects = {"n0": {0: beat(0, 9, "grad_sync")}, "n1": {0: beat(2, 10, "forward")}}
    assert [n for n, *_ in hang_culprits(observed(suspects=suspects))] == ["n0"]


def test_only_this_generations_beats_of_plan_members_can_be_hang_culprits():
    suspects = {"n0": {0: beat(0, 10, "grad_sync"), 1: beat(1, 3, "forward", generation=0)},
                "n1": {0: beat(2, 10, "grad_sync"), 1: beat(3, 9, "backward")},
                "n2": {0: beat(4, 1, "forward")}}  # a node no longer in the plan
    assert hang_culprits(observed(suspects=suspects)) == [("n1", 1, suspects["n1"][1])]
    stale = {"n0": {0: beat(0, 3, "forward", generation=0)}, "n2": {0: beat(4, 1, "forward")}}
    assert hang_culprits(observed(suspects=stale)) == []


def test_at_the_front_step_the_rank_outside_the_collective_is_blamed_while_others_wait():
    suspects = {"n0": {0: beat(0, 10, "grad_sync"), 1: beat(1, 10, "data")},
                "n1": {0: beat(2, 10, "checkpoint_sync"), 1: beat(3, 10, "sync")}}
    assert hang_culprits(observed(suspects=suspects)) == [("n0", 1, suspects["n0"][1])]
    # Nobody among the beats waits; a node whose ranks all wait (not in `suspects`) still counts.
    outside = {"n0": {0: beat(0, 10, "forward")}, "n1": {0: beat(2, 10, "optimizer")}}
    assert hang_culprits(observed(suspects=outside)) == []
    assert [n for n, *_ in hang_culprits(observed(suspects=outside,
                                                  waiting_in_collective=1))] == ["n0", "n1"]
    waiting = {"n0": {0: beat(0, 10, "grad_sync")}, "n1": {0: beat(2, 10, "sync")}}
    assert hang_culprits(observed(suspects=waiting)) == []  # all in it: nobody to name


def test_a_hung_rank_is_described_by_rank_step_phase_and_time_in_it():
    assert describe_rank("n1", 1, beat(3, 9, "forward"), NOW) == (
        "rank 3 on n1 (local 1): step 9, phase forward for 20.0 s")
    assert describe_rank("n1", 1, {"step": 9}, NOW) == (
        "rank ? on n1 (local 1): step 9, phase None for 0.0 s")


# --- stragglers --------------------------------------------------------------------------------

def test_a_straggler_is_slower_than_factor_times_the_median_of_the_other_plan_nodes():
    plan = {"generation": 1, "nodes": ["n0", "n1", "n2", "n3"]}
    compute = {"n0": 0.1, "n1": 0.1, "n2": 0.1, "n3": 0.5, "n9": 5.0}  # n9: outside the plan
    assert straggling(observed(plan=plan, compute=compute), S) == {
        "n3": "node n3 is a straggler: compute 500 ms per step (median over its last 20 "
              "sampled steps) against 100 ms for the others, 5.0x > 2x"}


def test_a_node_exactly_factor_times_the_median_is_no_straggler_one_past_it_is():
    plan = {"generation": 1, "nodes": ["n0", "n1", "n2"]}
    at = {"n0": 0.25, "n1": 0.25, "n2": 0.5}
    assert straggling(observed(plan=plan, compute=at), S) == {}
    assert list(straggling(observed(plan=plan, compute={**at, "n2": 0.5001}), S)) == ["n2"]


def test_two_nodes_compare_with_each_other_and_one_node_with_nobody():
    two = straggling(observed(compute={"n0": 0.1, "n1": 0.3}), S)
    assert list(two) == ["n1"] and "against 100 ms for the others, 3.0x" in two["n1"]
    assert straggling(observed(compute={"n0": 0.1, "n9": 9.0}), S) == {}
    assert straggling(observed(compute=None), S) == {}  # not read this tick


def test_no_straggler_is_named_against_a_median_of_zero():
    plan = {"generation": 1, "nodes": ["n0", "n1", "n2"]}
    assert straggling(observed(plan=plan, compute={"n0": 0.0, "n1": 0.0, "n2": 0.3}), S) == {}


def test_the_median_without_one_element_is_the_median_of_the_rest():
    for length in range(2, 8):
        ordered = [float(2 ** k) for k in range(length)]
        for i in range(length):
            rest = ordered[:i] + ordered[i + 1:]
            assert _median_without(ordered, i) == statistics.median(rest), (length, i)


# --- flaky nodes -------------------------------------------------------------------------------

def test_a_node_is_flaky_at_flaky_failures_within_the_window_counting_its_edge():
    assert flaky({"n0": [NOW - 100]}, "n0", NOW, S) == (True, [NOW - 100, NOW])
    assert flaky({"n0": [NOW - 100.5]}, "n0", NOW, S) == (False, [NOW])
    assert flaky({"n1": [NOW - 1]}, "n0", NOW, S) == (False, [NOW])
    assert flaky({}, "n0", NOW, Settings(nodes=2, ranks_per_node=2)) == (True, [NOW])
