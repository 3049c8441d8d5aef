"""controller/control/recovery.py, rule by rule: the window wrong arithmetic opens (whose
evidence, which resume step), what is set aside and the event that says so, the `loaded` event
for each way a generation can start, who holds each node's snapshot copy, and `memory_point`:
which point it takes newest first (skipping void, incomplete, lost and distrusted ones), the disk
step as its floor, the slots it returns and the reason it gives; then the distrust window's edges
and which earlier incarnations' reports a usable point outlives.
"""

from __future__ import annotations

from controller.control.detect import HARD, Evidence
from controller.control.recovery import (
    _distrusted,
    buddies,
    clock,
    distrust,
    loaded,
    memory_point,
    outlived,
    set_aside,
    window,
)
from controller.control.view import Decision, JobView, Observed
from optimus.checkpoint.snapshot_files import point_name

NOW = 1000.0
PLAN = {"generation": 1, "nodes": ["n0", "n1"], "ranks_per_node": 2, "resume_step": 40}
ADDRS = {n: f"host-{n}:7000" for n in ("n0", "n1", "n2", "n3", "n4", "s0", "s1")}


def bad_tile(node: str, what: str) -> Evidence:
    return Evidence(node, what, HARD, NOW, "bad_tile", tile=f"{node}/0")


def snap(own=None, held=None, taken=None) -> dict:
    """An agent's report: point -> ranks whose shards it has whole (own, held), and when."""
    def named(points):
        return {point_name(*p): ranks for p, ranks in (points or {}).items()}
    return {"addr": "x:1", "own": named(own), "held": named(held), "taken": named(taken)}


def swapped(*steps: int, generation: int = 1) -> dict[str, dict]:
    """n0 and n1 each own their ranks' shards of these points and hold the other's copy; n2
    has nothing of them."""
    return {"n0": snap(own={(s, generation): [0, 1] for s in steps},
                       held={(s, generation): [2, 3] for s in steps}),
            "n1": snap(own={(s, generation): [2, 3] for s in steps},
                       held={(s, generation): [0, 1] for s in steps}),
            "n2": snap()}


# --- wrong arithmetic: the window and what it sets aside ---------------------------------------

def test_the_window_joins_earlier_suspect_nodes_and_keeps_the_first_evidence():
    job = JobView(suspect={"nodes": ["n3"]}, resumed_gen=1, resumed_step=30)
    wrong = [bad_tile("n1", "bad tile n1/0: first"), bad_tile("n0", "bad tile n0/0: second")]
    assert window(job, PLAN, wrong) == {"nodes": ["n0", "n1", "n3"], "generation": 1,
                                        "evidence": "bad tile n1/0: first", "resumed_step": 30}


def test_the_window_takes_the_planned_resume_step_until_rank_0_reports_this_generations():
    job = JobView(suspect=None, resumed_gen=0, resumed_step=30)  # the previous generation's
    suspect = window(job, PLAN, [bad_tile("n1", "x")])
    assert (suspect["nodes"], suspect["resumed_step"]) == (["n1"], 40)


def test_distrust_names_each_node_once():
    assert distrust([bad_tile("n1", "a"), bad_tile("n0", "b"), bad_tile("n1", "c")]) == (
        "n0, n1 computed wrong, so nothing since n0, n1 last passed the health check is trusted; "
        "the checkpoints committed after that are set aside")


def test_set_aside_quarantines_the_suspect_steps_in_order_and_says_why_with_the_evidence():
    suspect = {"nodes": ["n1"], "generation": 1, "evidence": "bad tile n1/0: NaN"}
    obs = Observed(now=NOW, job=JobView(suspect=suspect), plan=PLAN, nodes={},
                   suspect_steps={60: "committed after n1 last passed", 50: "resumed past"})
    d = Decision()
    set_aside(obs, d)
    assert d.set_aside == [(50, "resumed past"), (60, "committed after n1 last passed")]
    assert d.job == {"suspect": {**suspect, "set_aside": True}}
    assert d.events == [("quarantine", "checkpoint(s) of step 50, 60 set aside as suspect: "
                         "committed after n1 last passed (evidence: bad tile n1/0: NaN)",
                         {"steps": [50, 60], "nodes": ["n1"]})]


def test_set_aside_with_nothing_suspect_marks_the_window_done_without_an_event():
    d = Decision()
    set_aside(Observed(now=NOW, job=JobView(), plan=PLAN, nodes={}), d)
    assert (d.set_aside, d.job, d.events) == ([], {"suspect": {"set_aside": True}}, [])


# --- what a generation loaded ------------------------------------------------------------------

def load(report, *, resumed_gen=0, planned=40) -> Decision:
    obs = Observed(now=NOW, job=JobView(resumed_gen=resumed_gen), nodes={}, resumed=report,
                   plan={**PLAN, "resume_step": planned})
    d = Decision()
    loaded(obs, d)
    return d


def test_a_load_as_planned_is_recorded_once_with_its_source():
    d = load({"step": 40, "source": "memory"})
    assert d.job == {"resumed_gen": 1, "resumed_step": 40}
    assert d.events == [("loaded", "generation 1 resumed from the memory snapshot of step 40",
                         {"generation": 1, "step": 40, "planned_step": 40, "source": "memory",
                          "quarantined": []})]
    assert load({"step": 40}, resumed_gen=1).events == []  # already recorded
    assert load(None).events == [] and load(None).job == {}  # rank 0 has not reported


def test_a_load_other_than_planned_names_the_plan_and_each_checkpoint_set_aside():
    d = load({"step": 30, "quarantined": [{"step": 40}, {"step": 35, "reason": "bad sha256"}]})
    (kind, message, fields), = d.events
    assert message == ("generation 1 resumed from the checkpoint of step 30, not from step 40 "
                       "as planned: rank 0 set aside step 40 (corrupt); step 35 (bad sha256)")
    assert (fields["source"], fields["quarantined"]) == ("disk", [40, 35])


def test_a_load_from_or_instead_of_scratch_says_scratch():
    (_, message, fields), = load({"step": None}).events
    assert message == "generation 1 resumed from scratch, not from step 40 as planned"
    assert (fields["step"], fields["planned_step"]) == ("", 40)
    (_, message, fields), = load({"step": 40}, planned=None).events
    assert message == "generation 1 resumed from the checkpoint of step 40, not from scratch " \
                      "as planned"
    assert (fields["step"], fields["planned_step"]) == (40, "")
    assert load({"step": None}, planned=None).events[0][1] == "generation 1 resumed from scratch"


# --- buddies -----------------------------------------------------------------------------------

def test_each_spare_holds_two_nodes_copies_then_the_next_node_holds_them():
    held = buddies(["n0", "n1", "n2", "n3", "n4"], ["s0", "s1"], ADDRS)
    assert {k: v["node"] for k, v in held.items()} == {
        "n0": "s0", "n1": "s1", "n2": "s0", "n3": "s1", "n4": "n0"}
    assert held["n4"] == {"node": "n0", "addr": "host-n0:7000"}


def test_without_spares_each_node_holds_the_next_ones_copy_in_a_ring():
    assert {k: v["node"] for k, v in buddies(["n0", "n1", "n2"], [], ADDRS).items()} == {
        "n0": "n1", "n1": "n2", "n2": "n0"}
    assert {k: v["node"] for k, v in buddies(["n0", "n1"], [], ADDRS).items()} == {
        "n0": "n1", "n1": "n0"}
    assert buddies(["n0"], [], ADDRS) == {}  # alone: nobody else to hold its copy


def test_a_spare_or_node_without_a_snapshot_address_holds_no_copy():
    addrs = {"n0": "host-n0:7000", "n1": "", "s1": "host-s1:7000"}
    held = buddies(["n0", "n1", "n2"], ["s0", "s1"], addrs)  # s0 has no address: one spare
    assert {k: v["node"] for k, v in held.items()} == {"n0": "s1", "n1": "s1", "n2": "n0"}
    assert buddies(["n0", "n1"], [], addrs) == {"n1": {"node": "n0", "addr": "host-n0:7000"}}


# --- memory_point ------------------------------------------------------------------------------

def test_nothing_to_say_without_a_plan_or_reports():
    assert memory_point(None, swapped(44), {"n0", "n1"}, 40) == (None, None)
    assert memory_point(PLAN, {}, {"n0", "n1"}, 40) == (None, None)


def test_each_slot_lists_the_alive_nodes_holding_exactly_its_ranks():
    alive = {"n0", "n1", "n2"}
    assert memory_point(PLAN, swapped(44), alive, None) == (
        {"step": 44, "generation": 1, "slots": [["n0", "n1"], ["n0", "n1"]]}, None)
    point, why = memory_point(PLAN, swapped(44), {"n1", "n2"}, None)
    assert (point["slots"], why) == ([["n1"], ["n1"]], None)


def test_a_point_at_exactly_the_disk_step_is_used_and_none_older():
    assert memory_point(PLAN, swapped(44), {"n0", "n1"}, 44)[0]["step"] == 44
    assert memory_point(PLAN, swapped(44), {"n0", "n1"}, 45) == (None, None)


def test_the_newest_usable_point_wins_over_older_ones():
    assert memory_point(PLAN, swapped(42, 46, 44), {"n0", "n1"}, 40)[0]["step"] == 46


def test_a_void_point_is_skipped_for_an_older_one_on_the_plans_line():
    plan = {**PLAN, "lineage": [[0, -1], [1, 40]]}  # generation 1 resumed from 40
    reports = swapped(42)
    for name, r in swapped(45, generation=0).items():  # generation 0's, past 40: abandoned
        r["own"].update(reports[name]["own"])
        r["held"].update(reports[name]["held"])
        reports[name] = r
    assert memory_point(plan, reports, {"n0", "n1"}, 40) == (
        {"step": 42, "generation": 1, "slots": [["n0", "n1"], ["n0", "n1"]]}, None)


def test_a_point_missing_a_replica_is_incomplete_and_the_newest_such_is_named():
    # Step 48: n1's shards have no copy; step 46: n0's have none.
    reports = {"n0": snap(own={(46, 1): [0, 1], (48, 1): [0, 1]}, held={(48, 1): [2, 3]}),
               "n1": snap(own={(46, 1): [2, 3], (48, 1): [2, 3]}, held={(46, 1): [2, 3]})}
    assert memory_point(PLAN, reports, {"n0", "n1"}, 40) == (None, (
        "no snapshot newer than the disk checkpoint is complete on every rank and replicated "
        "(the newest taken: step 48)"))


def test_an_incomplete_newest_point_gives_way_to_a_complete_older_one_silently():
    reports = swapped(44)
    reports["n0"]["own"][point_name(46, 1)] = [0, 1]  # 46: written, not replicated yet
    assert memory_point(PLAN, reports, {"n0", "n1"}, 40) == (
        {"step": 44, "generation": 1, "slots": [["n0", "n1"], ["n0", "n1"]]}, None)


def test_a_lost_point_names_its_first_lost_slot_and_the_earlier_incarnation_by_node():
    reports = {"n0": snap(own={(44, 1): [0, 1]}), "n1": snap(own={(44, 1): [2, 3]}),
               "n2@3": snap(held={(44, 1): [0, 1, 2, 3]})}  # n2 before it restarted
    assert memory_point(PLAN, reports, {"n2"}, 40) == (None, (
        "the memory snapshot of step 44 is lost: node n0 and the node holding its copy (n2) "
        "are both gone"))


def test_the_reason_beside_a_usable_point_is_the_newest_refused_ones():
    reports = swapped(44, 46, 48)
    reports["n0"]["taken"] = {point_name(s, 1): t for s, t in ((44, 90.0), (46, 110.0),
                                                                (48, 120.0))}
    point, why = memory_point(PLAN, reports, {"n0", "n1"}, 40, {"nodes": ["n1"], "since": 100.0})
    assert point["step"] == 44
    assert why == ("the memory snapshot of step 48 was taken after n1 last passed its health "
                   "check (1970-01-01T00:01:40Z): not trusted")


def test_a_point_is_trusted_when_its_earliest_shard_was_written_by_the_last_pass():
    since = {"nodes": ["n1"], "since": 100.0}
    reports = swapped(44)
    reports["n0"]["taken"] = {point_name(44, 1): 105.0}
    reports["n1"]["taken"] = {point_name(44, 1): 100.0, "junk": "not a time"}
    assert memory_point(PLAN, reports, {"n0", "n1"}, 40, since)[0]["step"] == 44
    reports["n1"]["taken"] = {point_name(44, 1): 100.5}
    assert memory_point(PLAN, reports, {"n0", "n1"}, 40, since) == (None, (
        "the memory snapshot of step 44 was taken after n1 last passed its health check "
        "(1970-01-01T00:01:40Z): not trusted"))


# --- the distrust window's edges ---------------------------------------------------------------

def test_no_window_distrusts_nothing():
    assert _distrusted(44, 200.0, None) is None
    assert _distrusted(44, 200.0, {}) is None


def test_a_window_since_a_pass_trusts_points_taken_at_or_before_it():
    window = {"nodes": ["n0", "n1"], "since": 100.0}
    assert _distrusted(44, 100.0, window) is None
    assert _distrusted(44, 100.5, window) == (
        "the memory snapshot of step 44 was taken after n0, n1 last passed its health check "
        "(1970-01-01T00:01:40Z): not trusted")
    assert _distrusted(44, None, window).startswith("the memory snapshot of step 44 was taken")


def test_a_window_without_a_pass_trusts_points_up_to_the_step_it_resumed_from():
    window = {"nodes": ["n1"], "since": None, "after_step": 40}
    assert _distrusted(40, 500.0, window) is None
    assert _distrusted(41, None, window) == (
        "the memory snapshot of step 41 was computed on n1, which has no passing health check "
        "on record: not trusted")
    assert _distrusted(30, None, {"nodes": []}) == (
        "the memory snapshot of step 30 was computed on a node, which has no passing health "
        "check on record: not trusted")


def test_clock_reads_utc_or_says_unknown():
    assert clock(100.0) == "1970-01-01T00:01:40Z"
    assert clock(None) == "an unknown time"


# --- outlived reports --------------------------------------------------------------------------

def test_an_earlier_incarnations_report_is_outlived_once_all_it_names_is_older():
    reports = {"n0@1": snap(own={(40, 1): [0, 1]}, held={(38, 0): [2, 3]}),
               "n1@2": snap(held={(44, 0): [0, 1]}),  # as new as the point: still proof
               "n1": snap(own={(30, 0): [2, 3]}),  # the live incarnation's: always kept
               "n3@1": snap()}
    assert outlived(reports, 44) == ["n0@1", "n3@1"]
    assert outlived(reports, 45) == ["n0@1", "n1@2", "n3@1"]


def test_a_name_that_is_no_point_counts_as_step_0():
    reports = {"n2@1": {"own": {"partial": []}}}
    assert outlived(reports, 0) == []
    assert outlived(reports, 1) == ["n2@1"]
