"""The second and third fault: records an earlier fault left behind must not mislead the next
decision. Pure rules (lineage of snapshot points, incarnations, a bad tile's window over memory
points, hang culprits of the current generation only, buddies for a late spare, the failed-saves
streak, a killed rank's last words) and the store and agent pieces that keep them true.
"""

from __future__ import annotations

import json
from pathlib import Path

from cluster import relay
from test_decide import NOW, S, beat, busy, node, running, running_plan

from controller.common.exit_text import describe_exit
from controller.control.decide import RESTARTING, RUNNING, JobView, NodeView, Observed, decide
from controller.control.detect import hang_culprits
from controller.control.recovery import memory_point, outlived
from controller.node.snapshots import _retain_held, _retain_own, _scan
from controller.store.store import Store
from controller.store.summaries import NodeSummary
from optimus.checkpoint.snapshot_files import (
    extend_lineage,
    point_name,
    points,
    void,
    write_marker,
)


def _snap(own=None, held=None, taken=None) -> dict:
    return {"addr": "x:1", "own": own or {}, "held": held or {}, "taken": taken or {}}


def _p(step: int, gen: int) -> str:
    return point_name(step, gen)


# --- D1: a point belongs to the lineage it was taken in ----------------------------------------

def test_a_rollback_voids_the_abandoned_points_ahead_of_it_and_nothing_else():
    lineage = extend_lineage(extend_lineage([], 0, None), 1, 40)  # gen 1 resumed from disk 40
    assert lineage == [[0, -1], [1, 40]]
    assert void(55, 0, lineage) and void(41, 0, lineage)
    assert not void(40, 0, lineage) and not void(35, 0, lineage)  # the common past
    assert not void(55, 1, lineage) and not void(45, 1, lineage)  # the new line's own
    # Gen 2 resumes from the memory point (50, 1): 55 of gen 1 is abandoned, 50 is its start.
    lineage = extend_lineage(lineage, 2, 50)
    assert lineage == [[0, -1], [1, 40], [2, 50]]
    assert void(55, 1, lineage) and not void(50, 1, lineage) and void(45, 0, lineage)
    # A later rollback further back covers earlier entries: the list stays short.
    assert extend_lineage(lineage, 3, 30) == [[0, -1], [3, 30]]
    assert extend_lineage([], 0, None) == [[0, -1]] and void(1, -1, [[0, -1]])


def test_memory_point_skips_an_abandoned_line_and_takes_the_newest_usable_point():
    plan = {**running_plan(gen=1), "lineage": [[0, -1], [1, 40]]}
    reports = {"n0": _snap(own={_p(55, 0): [0, 1], _p(45, 1): [0, 1], _p(50, 1): [0, 1]}),
               "n1": _snap(own={_p(45, 1): [2, 3], _p(50, 1): [2, 3]}),
               "n2": _snap(held={_p(55, 0): [0, 1, 2, 3], _p(45, 1): [0, 1, 2, 3],
                                 _p(50, 1): [0, 1, 2, 3]}),
               "n3": _snap(own={_p(55, 0): [2, 3]})}  # gen 0's node, gone
    alive = {"n0", "n1", "n2"}
    point, why = memory_point(plan, reports, alive, disk_step=40)
    assert (point["step"], point["generation"], why) == (50, 1, None)
    # Without the lineage the abandoned 55 would be taken for the newest point.
    assert memory_point({**plan, "lineage": []}, reports, alive, 40)[0]["step"] == 55


def test_memory_point_goes_on_to_an_older_point_when_the_newest_is_lost():
    plan = running_plan()
    reports = {"n0": _snap(own={_p(44, 0): [0, 1], _p(46, 0): [0, 1]}),
               "n1": _snap(own={_p(44, 0): [2, 3]}, held={_p(44, 0): [0, 1]}),
               "n2": _snap(held={_p(44, 0): [2, 3], _p(46, 0): [0, 1, 2, 3]})}
    # 46: n0's copy is on n2 only; n0 and n2 both gone. 44: n0's shards are held by n1.
    point, why = memory_point(plan, reports, {"n1"}, disk_step=40)
    assert point == {"step": 44, "generation": 0, "slots": [["n1"], ["n1"]]}
    assert why == ("the memory snapshot of step 46 is lost: node n0 and the node holding its "
                   "copy (n2) are both gone")  # said beside the older point taken
    # Nothing usable: the reason is the newest refused point's.
    assert memory_point(plan, reports, set(), 40) == (None, (
        "the memory snapshot of step 46 is lost: node n0 and the node holding its copy (n2) are "
        "both gone"))
    # A point at exactly the disk step is used (the memory copy is as new, and nearer).
    assert memory_point(plan, reports, {"n1"}, 44)[0]["step"] == 44
    assert memory_point(plan, reports, {"n1"}, 47) == (None, None)


def test_a_plan_carries_its_lineage_corrected_by_what_rank_0_really_loaded():
    job = JobView(state=RESTARTING, generation=1, restarts=1, next_plan_at=NOW,
                  resumed_gen=1, resumed_step=30)  # the plan said 40; 40 was corrupt
    plan = {**running_plan(gen=1), "action": "stop", "lineage": [[0, -1], [1, 40]],
            "resume_step": 40}
    nodes = {n: node(n) for n in ("n0", "n1")}
    d = decide(Observed(now=NOW, job=job, plan=plan, nodes=nodes, latest_step=30), S)
    assert d.plan["generation"] == 2 and d.plan["lineage"] == [[0, -1], [2, 30]]
    assert d.plan["failed_saves"] == 0


def _point(folder: Path, step: int, gen: int, ranks=(0,)) -> Path:
    path = folder / point_name(step, gen)
    path.mkdir(parents=True)
    for rank in ranks:
        data = path / f"rank_{rank:05d}.pt"
        data.write_bytes(b"x" * 8)
        write_marker(path, rank, {"rank": rank, "bytes": 8, "sha256": "-", "time": 1.0})
    return path


def test_an_agent_removes_void_points_and_keeps_the_new_lines_being_written(tmp_path):
    own, held = tmp_path / "own", tmp_path / "held"
    for step in (50, 55):  # generation 0's, confirmed by the buddy
        _point(own, step, 0)
        _point(held, step, 0, ranks=(1,))
    for step in (45, 50):  # generation 1's, resumed from disk at 40, not confirmed yet
        _point(own, step, 1)
        _point(held, step, 1, ranks=(1,))
    lineage = [[0, -1], [1, 40]]
    _retain_own(_scan(own), {_p(50, 0), _p(55, 0)}, set(), lineage)
    _retain_held(_scan(held), set(), lineage)
    assert [(s, g) for s, g, _ in points(own)] == [(45, 1), (50, 1)]
    assert [(s, g) for s, g, _ in points(held)] == [(45, 1), (50, 1)]
    # Today's rule without the lineage: the old 55 and 50 are the newest two confirmed, and the
    # new line's 45, still being written, goes.
    _point(own, 55, 0)
    _point(own, 50, 0)
    _retain_own(_scan(own), {_p(50, 0), _p(55, 0)}, set(), [])
    assert (45, 1) not in [(s, g) for s, g, _ in points(own)]


# --- D2: a node back under its own name keeps the proof of what it received ---------------------

def test_a_rejoined_node_keeps_its_earlier_incarnations_report_apart(redis_server):
    store = Store(redis_server.url, "inc")
    first = {**_snap(held={_p(44, 0): [2, 3]}), "incarnation": "100.aa"}
    store.own.set_snapshots("n2", first, first=True)
    store.own.set_snapshots("n2", {**first, "held": {_p(44, 0): [2, 3], _p(46, 0): [2, 3]}})
    relay(store)  # the controller's: from the node's own keys to the job-wide record
    assert set(store.reports.snapshots()) == {"n2"}  # the same incarnation: written over
    again = {**_snap(), "incarnation": "200.bb"}
    store.own.set_snapshots("n2", again, first=True)
    relay(store)
    reports = store.reports.snapshots()
    assert reports["n2"] == again
    assert reports["n2@100.aa"]["held"] == {_p(44, 0): [2, 3], _p(46, 0): [2, 3]}
    # An unreadable or hostile earlier record is kept under a fixed name, never its own.
    store.r.hset(store.k("node:n3:snapshots"), "now", json.dumps({"incarnation": "../x y"}))
    store.own.set_snapshots("n3", {**_snap(), "incarnation": "300.cc"}, first=True)
    relay(store)
    assert "n3@earlier" in store.reports.snapshots()
    store.reports.drop_snapshots(["n2@100.aa", "n3@earlier"])
    relay(store)
    assert set(store.reports.snapshots()) == {"n2", "n3"}


def test_an_earlier_incarnation_proves_replication_but_holds_nothing():
    plan = running_plan()  # n0: ranks 0, 1 (buddy n2); n1: ranks 2, 3 (buddy n2)
    reports = {"n0": _snap(own={_p(44, 0): [0, 1]}), "n1": _snap(own={_p(44, 0): [2, 3]}),
               "n2": _snap(),  # n2 came back under its name: an empty report
               "n2@100.aa": _snap(held={_p(44, 0): [0, 1, 2, 3]})}
    point, why = memory_point(plan, reports, {"n0", "n1", "n2"}, disk_step=40)
    assert point == {"step": 44, "generation": 0, "slots": [["n0"], ["n1"]]} and why is None
    # The earlier incarnation is never a holder: n0 lost with it loses n0's slot.
    assert memory_point(plan, reports, {"n1", "n2"}, 40) == (None, (
        "the memory snapshot of step 44 is lost: node n0 and the node holding its copy (n2) are "
        "both gone"))
    assert memory_point(plan, {k: v for k, v in reports.items() if "@" not in k},
                        {"n0", "n1", "n2"}, 40)[0] is None  # today's: the proof was erased
    assert outlived(reports, 46) == ["n2@100.aa"] and outlived(reports, 44) == []


# --- D3: a bad tile's window holds for memory points as for disk -------------------------------

def _after_nan(**job) -> tuple[JobView, dict, dict, dict]:
    window = {"nodes": ["n1"], "generation": 0, "evidence": "bad tile n1/0: NaN",
              "resumed_step": 0, "set_aside": True}
    plan = {**running_plan(), "action": "stop"}
    nodes = {n: NodeView(**{**node(n).__dict__, "snapshot_addr": f"host-{n}:7000"})
             for n in ("n0", "n2")}
    nodes["n1"] = node("n1", excluded="bad tile", alive=True)
    reports = {"n0": _snap(own={_p(20, 0): [0, 1], _p(40, 0): [0, 1]},
                           taken={_p(20, 0): 100.0, _p(40, 0): 300.0}),
               "n1": _snap(own={_p(20, 0): [2, 3], _p(40, 0): [2, 3]},
                           taken={_p(20, 0): 100.0, _p(40, 0): 300.0}),
               "n2": _snap(held={_p(20, 0): [0, 1, 2, 3], _p(40, 0): [0, 1, 2, 3]})}
    return (JobView(state=RESTARTING, generation=0, restarts=1, next_plan_at=NOW,
                    suspect=window, **job), plan, nodes, reports)


def test_after_a_nan_no_memory_point_taken_after_the_tiles_last_good_check_is_resumed():
    job, plan, nodes, reports = _after_nan()
    distrust = {"nodes": ["n1"], "since": 200.0, "after_step": 0}
    d = decide(Observed(now=NOW, job=job, plan=plan, nodes=nodes, latest_step=10,
                        snapshots=reports, distrust=distrust), S)
    assert d.plan["memory"]["step"] == 20  # taken at 100, before the check at 200
    assert "from the memory snapshot of step 20 (memory snapshot not used: the memory " \
           "snapshot of step 40 was taken after n1 last passed its health check " \
           "(1970-01-01T00:03:20Z): not trusted)" in d.plan["reason"]
    assert d.job["suspect"] is None  # the plan acted on the window
    # No passing check on record: only what the failing generation resumed from is trusted.
    d = decide(Observed(now=NOW, job=job, plan=plan, nodes=nodes, latest_step=10,
                        snapshots=reports, distrust={**distrust, "since": None}), S)
    assert "memory" not in d.plan and d.plan["resume_step"] == 10
    assert "memory snapshot of step 40 was computed on n1, which has no passing health check" \
           in d.plan["reason"]


def test_the_window_outlives_the_set_aside_until_the_next_plan():
    """Today's defect: set aside in one tick (during the backoff), planned in a later one, the
    window was gone and the suspect memory point was trusted."""
    job, plan, nodes, reports = _after_nan()
    job = JobView(**{**job.__dict__, "suspect": {**job.suspect, "set_aside": False},
                     "next_plan_at": NOW + 5})
    d = decide(Observed(now=NOW, job=job, plan=plan, nodes=nodes, latest_step=10,
                        snapshots=reports, suspect_steps={}), S)
    assert d.plan is None and d.job["suspect"]["set_aside"] is True  # set aside, backing off
    later = JobView(**{**job.__dict__, "suspect": d.job["suspect"], "next_plan_at": NOW})
    d = decide(Observed(now=NOW + 5, job=later, plan=plan, nodes=nodes, latest_step=10,
                        snapshots=reports, suspect_steps={}), S)
    assert d.set_aside == []  # not again
    assert "memory" not in d.plan and "not trusted" in d.plan["reason"]


# --- D4: only the current generation's members are culprits -----------------------------------

def test_a_hang_after_a_lost_node_blames_the_member_not_the_lost_nodes_records():
    plan = running_plan(gen=1, nodes=("n0", "n4"))
    stale = {0: beat(2, 25, "forward", generation=0)}  # n3: lost in generation 0
    suspects = {"n3": stale, "n4": {0: beat(2, 41, "optim", generation=1),
                                    1: beat(3, 42, "grad_sync", generation=1)},
                "n0": {0: beat(0, 42, "grad_sync", generation=1),
                       1: beat(1, 42, "grad_sync", generation=1)}}
    obs = running(plan=plan, job=busy(generation=1, progress_gen=1), progress=42,
                  suspects=suspects, nodes={n: node(n, generation=1, live=2)
                                            for n in ("n0", "n4")})
    assert [(n, lr) for n, lr, _ in hang_culprits(obs)] == [("n4", 0)]
    # A rejoined n4 still holding a beat of generation 0 is not read as this generation's.
    old = {**suspects, "n4": {0: beat(2, 5, "forward", generation=0),
                              1: beat(3, 42, "grad_sync", generation=1)}}
    obs = running(plan=plan, job=busy(generation=1, progress_gen=1), progress=42,
                  suspects=old, nodes={n: node(n, generation=1, live=2) for n in ("n0", "n4")})
    assert hang_culprits(obs) == []


def test_a_new_plan_removes_the_summary_rows_of_nodes_outside_it(redis_server):
    store = Store(redis_server.url, "rows")
    row = NodeSummary(max_step=25, min_step=25, outside=1, nonfinite=True, compute_s=0.1,
                      paused=0, oldest_beat=1.0, peak_allocated=5, peak_reserved=6)
    for n in ("n0", "n3"):
        store.own.agent_tick(n, {"generation": 0}, {0: {"step": 25}}, 1e12, False, row)
    relay(store, {"generation": 0, "nodes": ["n0", "n3"], "ranks_per_node": 1})
    assert store.summaries.node_steps() == {"n0": 25.0, "n3": 25.0}
    store.summaries.keep_rows(["n0", "n4"])
    relay(store, {"generation": 1, "nodes": ["n0", "n4"], "ranks_per_node": 1})
    summaries = store.summaries
    assert summaries.behind(100) == ["n0"] and summaries.outside_collectives(10) == ["n0"]
    assert summaries.node_steps() == {"n0": 25.0} and summaries.sweep(["n0"]).nonfinite == ["n0"]
    assert store.rank_beats("n3") == {} and store.rank_beats("n0") == {0: {"step": 25}}


def test_every_registration_counts_a_node_back_under_its_own_name_too(redis_server):
    store = Store(redis_server.url, "regs")
    assert store.registrations() == 0
    for name in ("n0", "n1", "n0"):  # the same name again: the agents set is unchanged
        store.own.register_node(name, {"health": "ok"})
        relay(store)  # the controller's, which counts each registration it finds
    assert store.registrations() == 3 and len(store.agent_beats()) == 2


# --- smaller ones ---------------------------------------------------------------------------

def test_a_spare_that_arrives_late_becomes_a_buddy():
    plan = {**running_plan(), "buddies": {"n0": {"node": "n1", "addr": "h1:1"},
                                          "n1": {"node": "n0", "addr": "h0:1"}}}
    d = decide(running(plan=plan, spares={"s0": "hs:1"}), S)
    assert d.plan["generation"] == 0 and d.plan["action"] == "run"
    assert d.plan["buddies"] == {"n0": {"node": "s0", "addr": "hs:1"},
                                 "n1": {"node": "s0", "addr": "hs:1"}}
    assert d.plan["issued"] == NOW and d.events[0][0] == "buddies"
    assert "n0 -> s0; n1 -> s0" in d.events[0][1]
    assert decide(running(plan=d.plan, spares={"s0": "hs:1"}), S).plan is None  # settled
    assert decide(running(plan=plan, spares=None), S).plan is None  # not read this tick
    members = {"n0": "h0:1", "n1": "h1:1"}  # the plan's own nodes come with their addresses
    assert decide(running(plan=plan, spares=members), S).plan is None  # no spare: no change
    d = decide(running(plan=plan, spares={**members, "s0": "hs:1"}), S)
    assert d.plan["buddies"]["n1"] == {"node": "s0", "addr": "hs:1"}


def test_the_failed_saves_streak_carries_into_the_next_generation():
    job = JobView(state=RESTARTING, generation=0, restarts=1, next_plan_at=NOW)
    plan = {**running_plan(), "action": "stop", "failed_saves": 1}
    nodes = {n: NodeView(**{**node(n, generation=0).__dict__, "failed_saves": 2})
             for n in ("n0", "n1")}
    d = decide(Observed(now=NOW, job=job, plan=plan, nodes=nodes, latest_step=20), S)
    assert d.plan["failed_saves"] == 2
    quiet = {n: node(n, generation=0) for n in ("n0", "n1")}  # died before saying anything
    d = decide(Observed(now=NOW, job=job, plan=plan, nodes=quiet, latest_step=20), S)
    assert d.plan["failed_saves"] == 1
    stale = {n: NodeView(**{**node(n, generation=None).__dict__, "failed_saves": 7})
             for n in ("n0", "n1")}  # another generation's word
    d = decide(Observed(now=NOW, job=job, plan=plan, nodes=stale, latest_step=20), S)
    assert d.plan["failed_saves"] == 1
    assert d.job["state"] == RUNNING


def test_a_killed_ranks_old_last_line_is_not_quoted_as_its_end():
    tail = "checkpoint of step 40: write failed: [Errno 28] No space left on device"
    assert describe_exit(1, "n3", None, 9, tail, tail_age=30.0) == (
        "rank 1 on n3 ended with SIGKILL (9)")
    assert describe_exit(1, "n3", None, 9, tail, tail_age=0.5).endswith("No space left on device")
    assert describe_exit(1, "n3", 1, None, "ValueError: x", tail_age=300.0).endswith(
        "ValueError: x")  # an exit code: its last line is why, however old
