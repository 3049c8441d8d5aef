"""The controller's rules for hangs, bad tiles, stragglers and flaky nodes."""

from __future__ import annotations

from test_decide import NOW, H, beat, busy, node, running, running_plan

from controller.control.decide import (
    STOPPING,
    Exit,
    Observed,
    Overdue,
    Settings,
    decide,
)


def test_progress_is_tracked_and_step_times_set_the_hang_threshold():
    job = busy(progress_step=10, progress_at=NOW - 2, step_times=(0.5,))
    d = decide(running(job=job, progress=12), H)
    assert d.job["progress_step"] == 12 and d.job["progress_at"] == NOW
    assert d.job["step_times"] == [0.5, 1.0]  # 2 s for 2 steps
    # A new generation restarts the clock and does not sample its resume or first step.
    d = decide(running(job=busy(progress_gen=None), progress=40), H)
    assert d.job["progress_gen"] == 0 and d.job["progress_moves"] == 0
    slow = busy(step_times=(4.0, 4.0, 4.0), progress_at=NOW - 12)  # threshold 4 x 4 = 16 s
    assert decide(running(job=slow, progress=5), H).commands == []
    stalled = busy(step_times=(1.0,), progress_at=NOW - 12)  # threshold max(10, 4) = 10 s
    assert decide(running(job=stalled, progress=5), H).commands != []


def test_a_hang_names_the_rank_behind_asks_for_stacks_then_fails_with_them():
    job = busy(progress_step=7, progress_at=NOW - 11)
    suspects = {"n1": {0: beat(2, 6, "optim"), 1: beat(3, 7, "grad_sync")}}
    d = decide(running(job=job, progress=7, suspects=suspects), H)
    assert d.plan is None and d.job["hang_since"] == NOW
    assert ("n1", {"kind": "dump_stacks", "generation": 0, "local_ranks": [0]}) in d.commands
    assert ("n0", {"kind": "dump_stacks", "generation": 0, "local_ranks": [0]}) in d.commands
    (kind, message, _), = d.events
    assert kind == "suspect" and "rank 2 on n1 (local 0): step 6, phase optim" in message
    # The stacks arrive: the failure names the rank and carries them.
    job = busy(progress_step=7, progress_at=NOW - 11, hang_since=NOW - 0.5)
    culprit_only = {2: "Thread 0x1 (most recent call first):\n  wait"}
    d = decide(running(job=job, progress=7, suspects=suspects, stacks=culprit_only), H)
    assert d.plan is None  # the sample's stack (rank 0, on n0) is not in yet
    d = decide(running(job=job, progress=7, suspects=suspects,
                       stacks={**culprit_only, 0: "Thread 0x2:\n  all_reduce"}), H)
    failure = [e for e in d.events if e[0] == "failure"][0]
    assert "hung: no step past 7" in failure[1] and "rank 2 on n1" in failure[1]
    assert "wait" in failure[2]["stacks"]
    assert d.plan["action"] == "stop"
    assert d.exclude == []  # a soft failure, the first of flaky_failures=2
    assert "node n1 kept: failure 1 of 2" in failure[1]
    assert d.job["failures"] == {"n1": [NOW]}


def test_a_hang_with_everyone_at_the_front_blames_the_rank_outside_the_collective():
    job = busy(progress_step=8, progress_at=NOW - 11, hang_since=NOW - H.stack_wait_s - 1)
    suspects = {"n0": {0: beat(0, 8, "backward")}}
    d = decide(running(job=job, progress=8, suspects=suspects, waiting_in_collective=1), H)
    assert "rank 0 on n0 (local 0): step 8, phase backward" in d.job["reason"]


def test_every_collective_phase_counts_as_waiting_so_a_hang_during_a_save_names_its_rank():
    # Rank 2 hangs in its optimizer while a save is in flight: its peers wait in the save's
    # agreement, the commands agreement and a gradient reduction. Only rank 2 is outside.
    job = busy(progress_step=11, progress_at=NOW - 11, hang_since=NOW - H.stack_wait_s - 1)
    suspects = {"n0": {0: beat(0, 11, "checkpoint_sync"), 1: beat(1, 11, "sync")},
                "n1": {0: beat(2, 11, "optim", since=NOW - 12), 1: beat(3, 11, "grad_sync")}}
    d = decide(running(job=job, progress=11, suspects=suspects), H)
    (failure,) = [e for e in d.events if e[0] == "failure"]
    assert failure[1].startswith("generation 0 failed: hung: no step past 11")
    assert ": rank 2 on n1 (local 0): step 11, phase optim for 12.0 s, while the others " \
           "wait in a collective" in failure[1]
    assert d.job["restart_causes"] == {"hang": 1}
    # The rank still in the save's own work (staging), not in its agreement, is outside too.
    suspects["n0"][0] = beat(0, 11, "checkpoint")
    d = decide(running(job=job, progress=11, suspects=suspects), H)
    assert "rank 0 on n0 (local 0): step 11, phase checkpoint" in d.job["reason"]
    assert "rank 2 on n1" in d.job["reason"]


def test_the_second_soft_failure_in_the_window_excludes_the_node():
    killed = Exit("n0", 1, 0, code=None, signal=9, time=NOW)
    d = decide(running(exits=[killed], job=busy(failures={"n0": [NOW - 50]})), H)
    assert [n for n, _ in d.exclude] == ["n0"]
    d = decide(running(exits=[killed], job=busy(failures={"n0": [NOW - 150]})), H)
    assert d.exclude == []  # the old failure fell out of the 100 s window


def test_bad_tiles_are_excluded_at_once_from_exits_heartbeats_and_health_checks():
    own = Exit("n1", 3, 0, code=87, time=NOW, local_rank=1)
    other = Exit("n0", 0, 0, code=88, time=NOW - 0.1, local_rank=0)
    d = decide(running(exits=[other, own]), H)
    assert d.exclude == [("n1", "bad tile n1/1 (rank 3): its own loss or gradients were "
                                "NaN/Inf")]
    d = decide(running(nonfinite=frozenset({"n0"}),
                       suspects={"n0": {1: beat(1, 9, "grad_sync", finite=False)}}), H)
    assert d.exclude == [("n0", "bad tile n0/1 (rank 1, step 9): its own loss or gradients "
                                "were NaN/Inf")]
    d = decide(running(unhealthy={"n2": "n2/0: fixed-seed matmul gave 1.0"}), H)
    assert d.exclude == [("n2", "bad tile n2/0: fixed-seed matmul gave 1.0")]
    assert d.plan is None  # a spare's bad tile does not stop the generation


def test_a_straggler_is_reported_once_and_excluded_only_when_the_policy_says_so():
    compute = {"n0": 0.10, "n1": 0.35}
    d = decide(running(compute=compute), H)
    assert d.exclude == [] and d.job["stragglers"] == ["n1"]
    (kind, message, fields), = d.events
    assert kind == "straggler" and fields == {"node": "n1"}
    assert "compute 350 ms per step" in message and "3.5x > 2x" in message
    assert decide(running(compute=compute, job=busy(stragglers=("n1",))), H).events == []
    strict = Settings(**{**H.__dict__, "straggler_action": "exclude"})
    d = decide(running(compute=compute), strict)
    assert [n for n, _ in d.exclude] == ["n1"] and d.plan["action"] == "stop"
    assert decide(running(compute={"n0": 0.10, "n1": 0.15}), H).events == []


def test_a_straggler_is_excluded_only_when_a_generation_could_run_without_it():
    compute = {"n0": 0.10, "n1": 0.35}
    strict = Settings(**{**H.__dict__, "straggler_action": "exclude"})
    d = decide(running(compute=compute, spare_count=1), strict)  # a spare takes its place
    assert [n for n, _ in d.exclude] == ["n1"] and d.plan["action"] == "stop"
    d = decide(running(compute=compute, spare_count=0), strict)  # none: a slow job goes on
    assert d.exclude == [] and d.plan is None and d.job["stragglers"] == ["n1"]
    (kind, message, fields), = d.events
    assert kind == "straggler" and fields == {"node": "n1"}
    assert message.endswith("straggler_action=exclude, but nothing could take its place "
                            "(0 spare(s)): it stays in the job until a node can")
    # a spare registers later: the same straggler is excluded then, without a second report
    d = decide(running(compute=compute, spare_count=1, job=busy(stragglers=("n1",))), strict)
    assert [n for n, _ in d.exclude] == ["n1"]
    assert "straggler" not in [k for k, *_ in d.events]
    # a job that may shrink runs on the one node left
    shrinks = Settings(**{**strict.__dict__, "node_counts": (2, 1)})
    d = decide(running(compute=compute, spare_count=0), shrinks)
    assert [n for n, _ in d.exclude] == ["n1"]


def test_a_stop_of_a_running_generation_drains_it_without_the_per_node_view():
    obs = running(job=busy(desired="stop", desired_by="bob"))
    obs = Observed(**{**obs.__dict__, "nodes": {}})  # as observed while RUNNING
    d = decide(obs, H)
    assert d.job["state"] == STOPPING and d.plan["action"] == "stop"


def test_progress_seen_this_tick_is_no_hang_and_an_unconfirmed_overdue_is_no_frozen_rank():
    job = busy(progress_step=7, progress_at=NOW - 60)  # e.g. the controller was paused
    d = decide(running(job=job, progress=9), H)
    assert d.commands == [] and d.job["progress_step"] == 9
    late_tick = Overdue("n1", 2, "no heartbeat for 5.2 s", NOW - 5.2, confirmed=False)
    assert decide(running(overdue=[late_tick]), H).exclude == []


def test_the_straggler_median_leaves_the_node_itself_out():
    scores = {f"n{i}": 0.1 for i in range(5)} | {"n5": 0.25, "n6": 0.26}
    plan = {**running_plan(), "nodes": sorted(scores)}
    nodes = {n: node(n, generation=0, live=2) for n in scores}
    d = decide(running(nodes=nodes, plan=plan, compute=scores), H)
    assert d.job["stragglers"] == ["n5", "n6"]  # each 2.5x the median of the others (0.1)
    assert "250 ms per step" in d.events[0][1] and "against 100 ms" in d.events[0][1]


UNTRUSTED = ("error: checkpoint runs/x/checkpoints/step_10 was not written by this run (its "
             "MAC does not match this run's key); to resume from it anyway: --trust-checkpoint")


def test_every_rank_refusing_the_input_alike_ends_the_job_failed_with_no_restart_or_blame():
    refused = [Exit(f"n{r // 2}", r, r % 2, code=2, tail=f"step 0\n{UNTRUSTED}", time=NOW)
               for r in range(4)]
    d = decide(running(exits=refused), H)
    assert d.job["state"] == "FAILED" and d.plan["action"] == "end"
    assert d.job["reason"] == (
        UNTRUSTED.removeprefix("error: ") + "; not restarted (every rank refused it alike: a "
        "new generation would too): fix it, then resubmit (--resubmit)")
    assert "restarts" not in d.job and d.exclude == []  # no restart spent, nobody blamed
    assert [kind for kind, *_ in d.events] == ["failed"]
    # Without an `error:` line, how rank 0 ended is the reason.
    bare = [Exit(f"n{r // 2}", r, r % 2, code=2, tail="step 0", time=NOW) for r in range(4)]
    assert decide(running(exits=bare), H).job["reason"].startswith(bare[0].describe() + "; ")


def test_some_ranks_refusing_wait_for_the_others_then_go_to_the_usual_rules():
    """A refusal on one node only may be that node's own (its mount, its environment)."""
    refused = [Exit("n1", r, r % 2, code=2, tail=UNTRUSTED, time=NOW) for r in (2, 3)]
    d = decide(running(exits=refused), H)
    assert d.job == {} and d.plan is None and d.exclude == []  # the others' exits may follow
    later = decide(running(exits=refused, now=NOW + H.settle_s - 0.01), H)
    assert later.job == {} and later.plan is None
    # Held from the first refusal on, not the last.
    staggered = [Exit("n1", 2, 0, code=2, tail=UNTRUSTED, time=NOW - 1), refused[1]]
    assert decide(running(exits=staggered, now=NOW + H.settle_s - 0.5), H).plan is not None
    d = decide(running(exits=refused, now=NOW + H.settle_s), H)
    assert d.job["state"] == "RESTARTING" and d.job["restarts"] == 1
    assert d.job["reason"] == f"rank 2 on n1 ended with exit code 2: {UNTRUSTED}"
    assert "node n1 kept: failure 1 of 2" in d.events[0][1]  # a soft failure, as any exit
    # Beside a rank killed: held as long, then the usual rules restart the job.
    mixed = [refused[0], Exit("n0", 0, 0, code=None, signal=9, tail="step 3", time=NOW)]
    assert decide(running(exits=mixed), H).plan is None
    d = decide(running(exits=mixed, now=NOW + H.settle_s), H)
    assert d.job["state"] == "RESTARTING" and d.job["restarts"] == 1
