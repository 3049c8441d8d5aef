"""The time a restart costs the job, as the controller counts it (actions.restarted,
watching.track_progress): from the moment the job was last at its furthest step before the
restart until a later generation passes that step, less the steps in between at the usual step
time. Per cause in the job record, the last recovery beside it, a `recovered` event; the
exporter's counter and gauge (tests/test_exporter*.py read them from a real scrape).
"""

from __future__ import annotations

import json
from dataclasses import replace

from controller.control import records
from controller.control.actions import restarted
from controller.control.decide import decide
from controller.control.view import RUNNING, Decision, JobView, Observed, Settings
from controller.control.watching import track_progress

S = Settings(nodes=2, ranks_per_node=1, heartbeat_interval_s=0.5, agent_timeout_s=5,
             launch={"job_file": "/jobs/x.yaml", "log_dir": "/runs/x/logs"})
PLAN = {"generation": 4, "nodes": ["n0", "n1"], "ranks_per_node": 1, "world_size": 2,
        "action": "run"}
BEHIND = {"generation": 3, "step": 40, "at": 100.0, "cause": "rank_exit"}


def running(**fields) -> JobView:
    """Generation 4 at step 30; the restart of generation 3 found the job at step 40."""
    return JobView(**{"state": RUNNING, "generation": 4, "progress_gen": 4,
                      "progress_step": 30, "progress_at": 110.0, "progress_moves": 2,
                      "step_times": (0.4, 0.5, 0.5, 9.0), "behind": BEHIND, **fields})


def tracked(job: JobView, progress: int, now: float) -> Decision:
    d = Decision()
    track_progress(Observed(now=now, job=job, plan=PLAN, nodes={}, progress=progress), S, d)
    return d


def test_a_restart_remembers_where_the_job_was_and_keeps_the_first_one():
    job = JobView(progress_gen=3, progress_step=40, progress_at=100.0,
                  restart_causes={"rank_exit": 2})
    assert restarted(job, "node_lost", 105.0) == {
        "restart_causes": {"rank_exit": 2, "node_lost": 1},
        "behind": {"generation": 3, "step": 40, "at": 100.0, "cause": "node_lost"}}
    # A second restart before a generation got back there: the time is the first one's.
    again = restarted(replace(job, behind=BEHIND), "hang", 130.0)
    assert again["behind"] == BEHIND and again["restart_causes"]["hang"] == 1
    # A generation that never moved: from when the restart was decided.
    fresh = restarted(JobView(), "operator", 7.0)["behind"]
    assert (fresh["step"], fresh["at"], fresh["generation"]) == (-1, 7.0, None)


def test_passing_the_step_counts_the_time_lost_less_the_steps_between():
    d = tracked(running(lost_s={"rank_exit": 1.5, "hang": 60.0}), progress=42, now=130.0)
    # 30 s since step 40 was reached, 2 steps at the median step time (0.5 s): 29 s lost.
    assert d.job["lost_s"] == {"rank_exit": 30.5, "hang": 60.0}
    assert d.job["last_recovery"] == {"generation": 4, "cause": "rank_exit", "seconds": 29.0,
                                      "step": 42, "time": 130.0}
    assert d.job["behind"] is None
    (kind, message, fields), = d.events
    assert kind == "recovered" and fields == {"generation": 4, "cause": "rank_exit",
                                              "seconds": 29.0, "step": 40}
    assert message == ("generation 4 passed step 40, where the rank_exit restart found the "
                       "job: 29.0 s lost")


def test_nothing_is_counted_before_the_step_is_passed_or_by_the_failed_generation():
    assert "lost_s" not in tracked(running(), progress=40, now=130.0).job  # at it, not past
    assert "behind" not in tracked(running(), progress=35, now=130.0).job
    # The failed generation's own last steps (before its stop lands) are not a recovery.
    old = replace(running(), generation=3, progress_gen=3, progress_step=39)
    d = Decision()
    track_progress(Observed(now=130.0, job=old, plan={**PLAN, "generation": 3}, nodes={},
                            progress=41), S, d)
    assert "lost_s" not in d.job and d.job["progress_step"] == 41
    # No restart pending: nothing.
    assert "lost_s" not in tracked(running(behind=None), progress=50, now=130.0).job


def test_a_short_history_and_a_fast_return_never_count_below_zero():
    d = tracked(running(step_times=()), progress=41, now=100.5)
    assert d.job["last_recovery"]["seconds"] == 0.5  # no step time known: the wall time
    d = tracked(running(step_times=(5.0,)), progress=45, now=101.0)
    assert d.job["last_recovery"]["seconds"] == 0.0


def test_the_fields_round_trip_through_the_job_record():
    d = tracked(running(), progress=42, now=130.0)
    raw = {k: json.dumps(v) if isinstance(v, dict | list) else str(v)
           for k, v in {**d.job, "state": RUNNING}.items() if v is not None}
    job = records.job_view(raw)
    assert job.lost_s == {"rank_exit": 29.0} and job.behind is None
    assert job.last_recovery["seconds"] == 29.0


def test_the_decision_of_a_failure_remembers_where_the_job_was():
    from controller.control.view import Exit

    job = JobView(state=RUNNING, generation=3, progress_gen=3, progress_step=40,
                  progress_at=100.0, progress_moves=5)
    obs = Observed(now=120.0, job=job, plan={**PLAN, "generation": 3}, nodes={},
                   exits=[Exit("n1", 1, 3, code=1, tail="RuntimeError: boom", time=119.0,
                               local_rank=0)],
                   agent_beats={"n0": 119.9, "n1": 119.9}, progress=40)
    d = decide(obs, S)
    assert d.job["behind"] == {"generation": 3, "step": 40, "at": 100.0, "cause": "rank_exit"}


def test_a_record_that_is_not_what_the_controller_writes_reads_as_none():
    for raw in ('{"step": "40", "at": 1.0, "cause": "hang"}', '["a list"]',
                '{"step": 40, "cause": "hang"}', '{"step": 40, "at": 1.0, "cause": 7}'):
        assert records.job_view({"state": RUNNING, "behind": raw}).behind is None, raw
    job = records.job_view({"state": RUNNING, "lost_s": '{"hang": 2.5, "x": "3", "y": null}'})
    assert job.lost_s == {"hang": 2.5}
    assert records.job_view({"state": RUNNING, "lost_s": "[1]"}).lost_s == {}
