"""What `decide` does when the world's size changes and when its own records disagree.

Beside tests/test_decide.py, fast and pure (the end-to-end runs of these rules are
tests/test_resize.py, tests/test_fencing.py and tests/test_ports.py): a shrunk generation grows
back onto freed nodes (only with a checkpoint of its own, only while it runs, to the largest
size that fits, a size between only for a predicted gain, all of them always); a plan whose
record never landed is adopted; node 0's offered port; whether a first generation may start
short; what a new generation carries (the planner's layout, the rewind windows, the pending
rewind's resume point); an operator's rewind takes the whole tick.
"""

from __future__ import annotations

import dataclasses

from test_decide import NOW, S, busy, node, running, running_plan

from controller.control.decide import (
    PAUSED,
    PAUSING,
    RESTARTING,
    RUNNING,
    WAITING,
    Exit,
    JobView,
    Observed,
    Settings,
    decide,
)

# Four nodes of two ranks that may shrink to any count; generation 1 runs on n0 alone, resumed
# from step 10, and step 20 is committed since.
FOUR = Settings(**{**S.__dict__, "nodes": 4, "node_counts": (4, 3, 2, 1)})
GEN_1 = {"generation": 1, "progress_gen": 1}  # its progress clock is its own


def layout(tokens_per_s: float, overrides=(), label: str = "tp1.pp1") -> dict:
    return {"layout": label, "overrides": list(overrides), "tokens_per_s": tokens_per_s}


def shrunk(free: int | None = 3, latest_step: int | None = 20, resume_step: int | None = 10,
           **more) -> Observed:
    plan = {**running_plan(gen=1, nodes=("n0",)), "world_size": 2, "resume_step": resume_step}
    return running(nodes={"n0": node("n0", generation=1, live=2)}, plan=plan,
                   **{"job": busy(**GEN_1), "latest_step": latest_step,
                      "spare_count": free, **more})


def grown_to(d) -> int | None:
    """The size a grow stops the generation for (None: no grow; then no stop either)."""
    grows = [fields["to"] for kind, _, fields in d.events if kind == "grow"]
    assert len(grows) <= 1
    assert (d.plan or {}).get("action") == ("stop" if grows else None)
    return grows[0] if grows else None


# --- growing back onto freed nodes -------------------------------------------------------------

def test_a_shrunk_generation_grows_back_to_all_its_nodes_saving_first_not_a_failure():
    d = decide(shrunk(free=3), FOUR)
    reason = ("3 node(s) free again: generation 1 saves a checkpoint and stops, the next runs "
              "on 4 of 4 nodes instead of 1 (the data-parallel degree grows with them)")
    assert d.events == [("grow", reason, {"generation": 1, "nodes": 1, "to": 4})]
    assert (d.plan["action"], d.plan["save"], d.plan["grace_s"], d.plan["reason"]) == (
        "stop", True, 30, reason)
    assert d.job["state"] == RESTARTING and d.job["next_plan_at"] == NOW  # no backoff
    assert d.job["restart_causes"] == {"resize": 1} and "restarts" not in d.job
    assert d.exclude == []


def test_it_grows_to_the_largest_size_the_free_nodes_make():
    d = decide(shrunk(free=2), FOUR)  # 2 or 3 fit: 3, predicted nothing (a gain assumed)
    assert grown_to(d) == 3
    assert d.job["reason"].endswith("the next runs on 3 of 4 nodes instead of 1 (the "
                                    "data-parallel degree grows with them)")
    assert grown_to(decide(shrunk(free=1), FOUR)) == 2
    assert grown_to(decide(shrunk(free=5), FOUR)) == 4  # more free than it needs


def test_no_free_node_or_an_unread_count_grows_nothing():
    for free in (0, None):
        d = decide(shrunk(free=free), FOUR)
        assert grown_to(d) is None and d.plan is None and d.job == {}


def test_it_grows_only_once_a_checkpoint_newer_than_its_start_is_committed():
    assert grown_to(decide(shrunk(latest_step=None), FOUR)) is None
    assert grown_to(decide(shrunk(latest_step=10), FOUR)) is None  # the one it resumed from
    assert grown_to(decide(shrunk(latest_step=9), FOUR)) is None
    assert grown_to(decide(shrunk(latest_step=11), FOUR)) == 4
    # From scratch, the start is step 0: step 1 is the first of its own.
    assert grown_to(decide(shrunk(latest_step=0, resume_step=None), FOUR)) is None
    assert grown_to(decide(shrunk(latest_step=1, resume_step=None), FOUR)) == 4


def test_a_paused_or_pausing_generation_or_one_resumed_this_tick_does_not_grow():
    pause = {"desired": "pause", "desired_by": "ana"}
    for job in (busy(**GEN_1, **pause), busy(**GEN_1, state=PAUSING, **pause),
                busy(**GEN_1, state=PAUSED, **pause)):
        d = decide(shrunk(job=job), FOUR)
        assert grown_to(d) is None and d.plan is None
    resumed = decide(shrunk(job=busy(**GEN_1, state=PAUSED)), FOUR)  # the pause lifted
    assert grown_to(resumed) is None and resumed.plan is None
    assert resumed.job["state"] == RUNNING  # it runs again first; a later tick grows it


def test_a_size_between_is_grown_to_only_for_a_predicted_gain_at_that_size():
    def predicted(**tokens_per_s) -> Settings:
        return dataclasses.replace(FOUR, layouts={int(k[1:]): layout(v)
                                                  for k, v in tokens_per_s.items()})

    assert grown_to(decide(shrunk(free=2), predicted(n1=500, n3=800))) == 3
    assert grown_to(decide(shrunk(free=2), predicted(n1=500, n3=500))) is None  # no gain
    assert grown_to(decide(shrunk(free=2), predicted(n1=500, n3=400))) is None
    # Judged at the size it would grow to (the next plan takes the largest), not one between.
    assert grown_to(decide(shrunk(free=2), predicted(n1=500, n2=400, n3=800))) == 3
    assert grown_to(decide(shrunk(free=2), predicted(n1=500, n2=800, n3=400))) is None
    # Either size unpredicted: a gain is assumed.
    assert grown_to(decide(shrunk(free=2), predicted(n3=100))) == 3
    assert grown_to(decide(shrunk(free=2), predicted(n1=500))) == 3


def test_back_on_all_its_nodes_it_goes_whatever_the_prediction():
    slower = dataclasses.replace(FOUR, layouts={1: layout(500), 4: layout(400)})
    assert grown_to(decide(shrunk(free=3), slower)) == 4


def test_a_grow_seen_as_a_node_registers_keeps_its_stop_plan():
    # The freed node's agent registers in the same tick (the spares changed): the generation
    # that stops is not re-issued as a running one with new buddies.
    d = decide(shrunk(free=3, spares={"n1": "host-n1:7000"}), FOUR)
    assert grown_to(d) == 4 and d.plan["action"] == "stop"
    assert "buddies" not in d.plan and [k for k, _, _ in d.events] == ["grow"]


def test_a_generation_on_all_its_nodes_never_grows():
    d = decide(running(spare_count=3, latest_step=50), dataclasses.replace(S, node_counts=(2, 1)))
    assert grown_to(d) is None and d.plan is None


# --- a plan whose record never landed -----------------------------------------------------------

IN_FLIGHT = {**running_plan(gen=1), "reason": "generation 1 on n0, n1 from the checkpoint of "
             "step 40"}
HALF = JobView(state=RESTARTING, generation=0, restarts=1, reason="rank 1 on n1 died",
               next_plan_at=NOW - 3)  # the failure's record landed, generation 1's did not
LIVE_1 = {n: node(n, generation=1, live=2) for n in ("n0", "n1")}


def test_a_running_plan_newer_than_the_record_is_adopted_as_it_says():
    d = decide(running(nodes=dict(LIVE_1), job=HALF, plan=IN_FLIGHT), S)
    assert d.plan is None and d.exclude == []
    assert d.job == {"state": RUNNING, "generation": 1, "reason": IN_FLIGHT["reason"],
                     "failure_since": None, "next_plan_at": None, "suspect": None}
    assert d.events == [("adopted", "generation 1 runs on n0, n1 but the job record said "
                         "RESTARTING, generation 0: its plan was written and its record not; "
                         f"recorded as it runs, not stopped ({IN_FLIGHT['reason']})",
                         {"generation": 1})]


def test_an_adopted_plan_without_a_reason_is_named_by_its_generation_and_a_pause_holds():
    unsaid = {k: v for k, v in IN_FLIGHT.items() if k != "reason"}
    d = decide(running(nodes=dict(LIVE_1), job=HALF, plan=unsaid), S)
    assert d.job["reason"] == "generation 1" and d.events[0][1].endswith("(generation 1)")
    pausing = dataclasses.replace(HALF, desired="pause", desired_by="ana")
    d = decide(running(nodes=dict(LIVE_1), job=pausing, plan=IN_FLIGHT), S)
    assert (d.job["state"], d.job["generation"]) == (PAUSING, 1)


def test_only_a_newer_run_plan_is_adopted():
    # The record's own generation running under a restart: stopped, not adopted.
    live_0 = {n: node(n, generation=0, live=2) for n in ("n0", "n1")}
    d = decide(running(nodes=live_0, job=HALF, plan=running_plan(gen=0)), S)
    assert d.plan["action"] == "stop" and d.job == {} and d.events == []
    # A newer generation told to stop, its ranks draining: left to drain, nothing recorded.
    stopping = {**IN_FLIGHT, "action": "stop"}
    d = decide(running(nodes=dict(LIVE_1), job=HALF, plan=stopping), S)
    assert d.plan is None and d.job == {} and d.events == []


# --- node 0's offered port ----------------------------------------------------------------------

RESTARTED = JobView(state=RESTARTING, generation=0, restarts=1, next_plan_at=NOW - 1)


def offering(n0: int, n1: int = 42_000) -> dict:
    return {"n0": dataclasses.replace(node("n0"), next_port=n0),
            "n1": dataclasses.replace(node("n1"), next_port=n1)}


def planned_port(nodes: dict, plan: dict | None = None) -> int:
    job = RESTARTED if plan else JobView()
    d = decide(Observed(now=NOW, job=job, plan=plan, nodes=nodes, latest_step=10), S)
    assert d.plan["nodes"] == ["n0", "n1"]
    return d.plan["master_port"]


def test_a_plan_carries_node_0s_offered_port_not_another_nodes():
    assert planned_port(offering(41_000)) == 41_000
    assert planned_port(offering(0)) == 0  # none offered: the relay picks one


def test_a_port_the_last_plan_took_is_not_offered_again_a_renewed_one_is():
    ended = {**running_plan(), "action": "stop", "master_port": 41_000}
    assert planned_port(offering(41_000), ended) == 0  # n0's status not renewed since
    assert planned_port(offering(43_000), ended) == 43_000
    assert planned_port(offering(0), ended) == 0


# --- whether a first generation may start short -------------------------------------------------

def test_a_job_that_may_not_start_short_starts_whole_at_once_and_shrinks_only_on_the_way():
    whole = dataclasses.replace(S, node_counts=(2, 1), start_short=False)
    both = {n: node(n) for n in ("n0", "n1")}
    d = decide(Observed(now=NOW, job=JobView(), plan=None, nodes=both), whole)
    assert d.plan["nodes"] == ["n0", "n1"] and d.job["state"] == RUNNING  # no wait
    d = decide(Observed(now=NOW + 60, job=JobView(), plan=None, nodes={"n0": node("n0")}), whole)
    assert d.plan is None and d.job["state"] == WAITING
    assert d.job["reason"].startswith("waiting for nodes: the layout needs 2 x 2 ranks")
    # After a failure it goes on short.
    ended = {**running_plan(), "action": "stop"}
    d = decide(Observed(now=NOW, job=RESTARTED, plan=ended,
                        nodes={"n0": node("n0"), "n1": node("n1", alive=False)}), whole)
    assert d.plan["nodes"] == ["n0"] and d.job["state"] == RUNNING


# --- what a new generation carries --------------------------------------------------------------

FULL = layout(1000.0, label="tp1.pp2.dp2")
REPLANNED = layout(600.0, ["parallel.pp=1", "data.microbatches=2"], label="tp1.pp1.dp2")
PLANNED = dataclasses.replace(S, node_counts=(2, 1), layouts={1: REPLANNED, 2: FULL})


def next_generation(nodes: dict, s: Settings = PLANNED, job: JobView = RESTARTED):
    return decide(Observed(now=NOW, job=job, plan={**running_plan(), "action": "stop"},
                           nodes=nodes, latest_step=40), s)


def test_a_shrunk_generation_runs_the_planners_layout_and_says_so():
    d = next_generation({"n0": node("n0"), "n1": node("n1", alive=False)})
    assert d.plan["overrides"] == REPLANNED["overrides"] and d.plan["layout"] == "tp1.pp1.dp2"
    assert d.plan["reason"] == (
        "generation 1 on n0 from the checkpoint of step 40 (shrunk to 1 of 2 nodes: the "
        "planner's layout tp1.pp1.dp2 instead of tp1.pp2.dp2, predicted 600 tokens/s against "
        "1,000 on 2; the checkpoint is resharded to it)")
    (fields,) = [f for kind, _, f in d.events if kind == "generation"]
    assert fields == {"nodes": 1, "layout": "tp1.pp1.dp2", "tokens_per_s": 600.0,
                      "full_layout": "tp1.pp2.dp2", "full_tokens_per_s": 1000.0}
    unknown_full = dataclasses.replace(PLANNED, layouts={1: REPLANNED})
    d = next_generation({"n0": node("n0"), "n1": node("n1", alive=False)}, unknown_full)
    assert [f for kind, _, f in d.events if kind == "generation"] == [{}]


def test_a_generation_on_all_its_nodes_runs_the_job_files_layout():
    d = next_generation({n: node(n) for n in ("n0", "n1")})
    assert "overrides" not in d.plan and "layout" not in d.plan
    assert d.plan["reason"] == "generation 1 on n0, n1 from the checkpoint of step 40"
    assert [f for kind, _, f in d.events if kind == "generation"] == [{}]


def test_a_generation_carries_the_jobs_rewind_windows_and_fills_in_a_pending_rewind():
    both = {n: node(n) for n in ("n0", "n1")}
    assert "skips" not in next_generation(both).plan
    pending = {"step": 45, "first": 43, "last": 47, "resume_step": None, "to": 40,
               "by": "alice", "reason": "asked by alice", "time": NOW - 5}
    job = dataclasses.replace(RESTARTED, skips=([20, 22], [43, 47]), rewinds=(pending,))
    d = next_generation(both, job=job)
    assert d.plan["skips"] == [[20, 22], [43, 47]]
    assert d.job["rewinds"] == [{**pending, "resume_step": 40}]
    done = dataclasses.replace(job, rewinds=({**pending, "resume_step": 40},))
    assert "rewinds" not in next_generation(both, job=done).job  # carried out already


# --- an operator's rewind takes the tick -------------------------------------------------------

def test_an_operators_rewind_is_all_the_tick_decides_a_death_seen_with_it_blames_no_one():
    asked = {"to": 30, "skip": (31, 35), "samples": None, "by": "alice@h",
             "reason": "loss spike", "said": {"request": "7-0"}}
    died = Exit("n1", 2, 0, code=None, signal=9, time=NOW)
    d = decide(running(exits=[died], rewind_asked=asked), S)
    message = ("rewind (asked by alice@h: loss spike): the next generation resumes from the "
               "newest point at or before step 30 and skips the batches of steps 31..35")
    assert (d.plan["action"], d.plan["save"], d.plan["reason"]) == ("stop", False, message)
    assert d.job["state"] == RESTARTING and d.job["reason"] == message
    assert d.exclude == [] and "restarts" not in d.job
    assert [kind for kind, _, _ in d.events] == ["rewind"]
