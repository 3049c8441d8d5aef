"""When the nodes' own pushes do not meet, the controller names the point they all push next
(controller/control/snapshot_watch.py): the rule, the store's key as an agent's tick reads it,
and real agents' keepers over TCP meeting on it, so that a usable memory point exists again."""

from __future__ import annotations

import time
from pathlib import Path

from records import as_record
from test_snapshot_push import SECRET, keeper  # noqa: F401 (keeper: a fixture)
from test_snapshot_push import _take as take

from controller.control.recovery import memory_point
from controller.control.snapshot_watch import ALIGN_READS, SnapshotWatch, align_point
from controller.node.snapshots import SnapshotKeeper, _shared, push
from controller.store.store import Store
from optimus.checkpoint.snapshot_files import (
    point_name,
)

PLAN = {"generation": 2, "nodes": ["a", "b"], "ranks_per_node": 2,
        "buddies": {"a": {"node": "b", "addr": "b:1"}, "b": {"node": "a", "addr": "a:1"}}}


def _p(step: int, generation: int = 2) -> str:
    return point_name(step, generation)


def skewed() -> dict[str, dict]:
    """a and b took steps 1-6 whole; a's pushes went for 1, 3, 5, b's for 2, 4, 6 (each kept
    its newest two confirmed and what is newer): no point is confirmed by both."""
    return {"a": {"own": {_p(s): [0, 1] for s in (3, 4, 5, 6)},
                  "held": {_p(s): [2, 3] for s in (4, 6)},
                  "replicated": {_p(3): "b", _p(5): "b"}},
            "b": {"own": {_p(s): [2, 3] for s in (4, 5, 6)},
                  "held": {_p(s): [0, 1] for s in (3, 5)},
                  "replicated": {_p(4): "a", _p(6): "a"}}}


def test_skewed_pushes_leave_no_usable_point_and_the_newest_whole_one_is_named():
    reports = skewed()
    assert memory_point(PLAN, reports, {"a", "b"}, None)[0] is None
    assert align_point(PLAN, reports, None, None, 0) == _p(6)


def test_the_named_point_stays_named_until_every_node_confirmed_it_or_it_timed_out():
    reports = skewed()
    reports["a"]["own"][_p(7)] = [0, 1]
    reports["b"]["own"][_p(7)] = [2, 3]
    assert align_point(PLAN, reports, None, _p(6), 1) == _p(6)  # not the newer 7
    assert align_point(PLAN, reports, None, _p(6), ALIGN_READS) == _p(7)  # gave way to newer
    assert align_point(PLAN, reports, None, _p(7), ALIGN_READS) is None  # none newer: none
    reports["a"]["replicated"][_p(6)] = "b"  # a sent it too: 6 is usable now
    reports["b"]["held"][_p(6)] = [0, 1]
    assert memory_point(PLAN, reports, {"a", "b"}, None)[0]["step"] == 6
    assert align_point(PLAN, reports, 6, _p(6), 1) == _p(7)  # past the usable one


def test_a_point_some_node_has_not_taken_whole_is_not_named():
    reports = skewed()
    reports["b"]["own"][_p(6)] = [2]  # rank 3's shard is still being written
    assert align_point(PLAN, reports, None, None, 0) == _p(5)


def test_nothing_is_named_at_or_below_the_usable_point_or_of_another_generation():
    reports = skewed()
    assert align_point(PLAN, reports, 6, None, 0) is None
    old = {n: {"own": {_p(9, 1): r["own"][_p(6)]}, "replicated": {}}
           for n, r in reports.items()}
    assert align_point(PLAN, old, None, None, 0) is None  # generation 1's


def test_nothing_is_named_where_a_node_has_no_buddy():
    plan = {**PLAN, "buddies": {"a": PLAN["buddies"]["a"]}}  # b serves no snapshots
    assert align_point(plan, skewed(), None, None, 0) is None


def test_the_watch_writes_the_named_point_where_an_agents_tick_reads_it(redis_server,
                                                                        monkeypatch):
    store = Store(redis_server.url, "j")
    reports = skewed()
    monkeypatch.setattr(store.reports, "snapshots", lambda: reports)
    watch, job = SnapshotWatch(store), {}
    watch.check(PLAN, job)
    assert job == {}  # nothing usable to show

    def told(generation: int) -> tuple[str | None, str | None]:
        tick = store.own.agent_tick("a", {"generation": generation, "state": "running"}, {},
                                    None, False)
        return tick.align, tick.keep
    assert told(2) == (_p(6), None)  # push 6; nothing usable to keep yet
    assert told(1) == (None, None)  # another generation's agent is told nothing
    for bad in ("../../etc", "step_1.gen_2 " + "x" * 300, ""):
        store.r.set(store.k("gen:2:align"), bad)  # no point names: ignored
        assert told(2) == (None, None)
    # Once every node confirmed it the point is usable: shown, and kept, nothing to push.
    reports["a"]["replicated"][_p(6)] = "b"
    reports["b"]["held"][_p(6)] = [0, 1]
    watch.read_at = 0.0
    watch.written = None
    watch.check(PLAN, job)
    assert job == {"memory_snapshot": 6}
    assert told(2) == (None, _p(6))


# --- real keepers: the agents' pushes meet on the named point ---------------------------------

def _take(own, step: int, ranks: list[int]):
    return take(own, step, ranks, size=4096, generation=2)


def _push_named(k: SnapshotKeeper, plan: dict) -> None:
    """The agent's poll starts the push of the named point; it ends (and nothing after it is
    started: a test of what one push does)."""
    record = as_record(plan)  # as the agent reads it
    k.poll(record, 2)
    assert k._pushing == k.align  # not its newest
    deadline = time.monotonic() + 60
    while not k._push.done():
        assert time.monotonic() < deadline, "the push did not end"
        time.sleep(0.005)
    assert k._push_ended(record) and k.failed == {} and k.align in k.replicated


def _pushed(pusher: SnapshotKeeper, buddy: SnapshotKeeper, *steps: int) -> None:
    """What the pusher's own choices sent earlier."""
    for step in steps:
        push(buddy.address, SECRET, pusher.own / _p(step), [0, 1] if pusher.node == "a" else
             [2, 3])
        pusher.replicated[_p(step)] = buddy.node


def test_skewed_keepers_meet_on_the_named_point_and_keep_it_until_a_newer_one_is_usable(
        keeper):  # noqa: F811 (test_snapshot_push's fixture)
    a, b = keeper("a"), keeper("b")
    plan = {**PLAN, "buddies": {"a": {"node": "b", "addr": b.address},
                                "b": {"node": "a", "addr": a.address}}}

    def take(*steps: int) -> None:
        for step in steps:
            _take(a.own, step, [0, 1])
            _take(b.own, step, [2, 3])

    def reports() -> dict[str, dict]:
        """Each agent's tick without a push of its own: retention, then its report."""
        for k in (a, b):
            k.unreported()
        return {k.node: k.poll(None, None, []) for k in (a, b)}

    def usable() -> int | None:
        point, _ = memory_point(plan, reports(), {"a", "b"}, None)
        return point and point["step"]
    take(*range(1, 11))
    _pushed(a, b, 7, 9)  # each pushed its newest when its last push ended: they never met
    _pushed(b, a, 8, 10)
    seen = reports()
    assert memory_point(plan, seen, {"a", "b"}, None)[0] is None
    named = align_point(plan, seen, None, None, 0)
    assert named == _p(10)
    for k in (a, b):  # the agents' next tick reads it
        k.align = named
    take(11, 12)
    _pushed(a, b, 11)  # in flight when the name came
    _pushed(b, a, 12)  # b's own choice: the named point went already
    _push_named(a, plan)
    assert usable() == 10
    # Each confirms newer points by its own choice again; 10 is kept while it is named, though
    # a confirmed two newer ones (11, 13) and b holds two newer copies of a's ranks.
    take(13, 14)
    _pushed(a, b, 13)
    _pushed(b, a, 14)
    assert usable() == 10
    seen = reports()
    assert align_point(plan, seen, 10, named, 1) == _p(14)  # the next one to meet on
    for k in (a, b):
        k.align = _p(14)
    _push_named(a, plan)
    assert usable() == 14
    # Nothing newer to name: the name goes, and with it the points kept for it.
    seen = reports()
    assert align_point(plan, seen, 14, _p(14), 1) is None
    for k in (a, b):
        k.align, k.keep = None, _p(14)  # and the usable point named to keep
    seen = reports()
    assert sorted(seen["a"]["own"]) == [_p(13), _p(14)]
    assert sorted(seen["b"]["held"]) == [_p(13), _p(14)]
    # The usable point is named to keep: a confirms two newer ones b has not, and 14 stays
    # usable (without the name a and b would drop their copies of a's 14).
    for k in (a, b):
        k.keep = _p(14)
    take(15, 16)
    _pushed(a, b, 15, 16)
    assert usable() == 14
    # Without a name (a generation's first seconds, a controller that lags or is away) each
    # keeps its newest UNNAMED_KEEP, and the newest point it shares with its buddy: 14 stays
    # usable however far a's pushes run ahead (it was lost once the skew outgrew UNNAMED_KEEP).
    for k in (a, b):
        k.keep = None
    assert usable() == 14
    take(*range(17, 25))
    _pushed(a, b, *range(17, 25))
    seen = reports()
    assert usable() == 14
    assert sorted(seen["a"]["own"]) == [_p(s) for s in (14, 21, 22, 23, 24)]  # one more only
    assert sorted(seen["b"]["held"]) == [_p(s) for s in (14, 21, 22, 23, 24)]
    # b's push of a newer point both confirmed moves the shared point on, and 14 goes.
    _pushed(b, a, 24)
    assert usable() == 24
    assert _p(14) not in reports()["a"]["own"]


def test_with_no_point_named_a_node_whose_pushes_ran_ahead_keeps_the_one_both_confirmed(
        keeper):  # noqa: F811 (test_snapshot_push's fixture)
    """b's pushes lag (8 is the newest it sent) while a's ran far ahead (10 to 20 confirmed by
    b), then b is lost before the controller named any point to keep (a generation's first
    seconds; the controller stopped). 8 is the one point whose every shard has a copy off its
    node: a keeps its own 8 and the copy of b's, so the next generation resumes from memory.
    (Seen in CI under a CPU hog, twice with a keeping only its two newest confirmed, then, with
    UNNAMED_KEEP, once more when a ran more than four points ahead: the job restarted from
    scratch.)"""
    a, b = keeper("a"), keeper("b")
    ahead = range(6, 21, 2)
    for step in ahead:
        _take(a.own, step, [0, 1])
        _take(b.own, step, [2, 3])
    _pushed(a, b, *ahead)
    _pushed(b, a, 6, 8)
    reports = {}
    for k in (a, b):
        k.unreported()
        reports[k.node] = k.poll(None, None, [])
    assert sorted(reports["a"]["own"]) == [_p(s) for s in (8, 14, 16, 18, 20)]
    lost_b = {"a": reports["a"], "b@1.aa": reports["b"]}  # its last report, kept apart
    point, why = memory_point(PLAN, lost_b, {"a"}, None)
    assert point == {"step": 8, "generation": 2, "slots": [["a"], ["a"]]} and why is None
    # Once a usable point is named the steady rule is back: the newest two confirmed, the
    # named one (and the one shared with b, the same here).
    a.keep = _p(8)
    a.unreported()
    assert sorted(a.poll(None, None, [])["own"]) == [_p(8), _p(18), _p(20)]


def test_the_watch_reads_every_second_until_a_point_is_named_to_keep(monkeypatch):
    """A generation's first usable point is named within FIRST_CHECK_S of existing, not
    CHECK_S: until then the nodes keep more (UNNAMED_KEEP); once named, every CHECK_S."""
    from controller.control import snapshot_watch

    now = [1000.0]
    monkeypatch.setattr(snapshot_watch.time, "monotonic", lambda: now[0])
    reports, written, reads = skewed(), [], []

    class Reports:
        def snapshots(self):
            reads.append(now[0])
            return reports

        def drop_snapshots(self, keys):
            pass

    class Store:
        def __init__(self):
            self.reports = Reports()

        def set_snapshot_align(self, generation, push, keep):
            written.append(keep)
    watch, job = SnapshotWatch(Store()), {}
    watch.check(PLAN, job)
    assert written == [None]  # nothing usable yet: pushes named only
    reports["a"]["replicated"][_p(6)] = "b"
    reports["b"]["held"][_p(6)] = [0, 1]
    now[0] += snapshot_watch.FIRST_CHECK_S / 2
    watch.check(PLAN, job)
    assert len(reads) == 1
    now[0] += snapshot_watch.FIRST_CHECK_S / 2  # the next read comes after a second, not five
    watch.check(PLAN, job)
    assert len(reads) == 2 and written[-1] == _p(6) and job == {"memory_snapshot": 6}
    now[0] += snapshot_watch.FIRST_CHECK_S
    watch.check(PLAN, job)
    assert len(reads) == 2  # one is named: back to every CHECK_S
    now[0] += snapshot_watch.CHECK_S
    watch.check(PLAN, job)
    assert len(reads) == 3


def test_a_lone_node_keeps_its_two_newest_whatever_is_named(keeper):  # noqa: F811
    """A node that sends and holds no copies is out of step with no one: no point is ever
    named for it, and it keeps its newest two, not four."""
    a = keeper("a")
    for step in range(1, 7):
        _take(a.own, step, [0, 1])
    a.unreported()
    assert sorted(a.poll(None, None, [])["own"]) == [_p(5), _p(6)]


def test_the_shared_point_is_the_oldest_of_each_held_ranks_newest_one_in_common():
    """Two nodes push here (ranks 2-3 and 4-5): the point kept is the newest this node
    confirmed whose shards of every rank held here it holds too, the slower pusher's. A rank
    held here that shares no point with it, a point its buddy has not confirmed, or one a
    rollback made void, gives none."""
    def points(*entries):
        return [(step, 2, Path(_p(step)), dict.fromkeys(ranks, {})) for step, ranks in entries]
    own = points(*((s, [0, 1]) for s in range(1, 9)))
    held = points((3, [2, 3, 4, 5]), (5, [2, 3, 4, 5]), (6, [2, 3]), (7, [2, 3]))
    confirmed = {_p(s) for s in range(1, 9)}
    assert _shared(own, held, confirmed, []) == _p(5)  # ranks 4-5's newest in common
    assert _shared(own, held, confirmed - {_p(5)}, []) == _p(3)  # 5 not confirmed by the buddy
    assert _shared(own, [*held, *points((8, [6]))], confirmed, []) == _p(5)  # 6 shares 8
    assert _shared(own[:2], held, confirmed, []) is None  # no point in common with 2-5
    assert _shared(own, [], confirmed, []) is None  # a node no one pushes to
    # generation 3 resumed from step 4: generation 2's later points are void
    assert _shared(own, held, confirmed, [[3, 4]]) == _p(3)
