"""The rules of the health check done ahead of a plan (controller/node/checks.py): when the agent
runs it, when a plan may take it instead of a check of its own, and when it may not.

The check itself is replaced by a counter that answers as told (the real one runs in
tests/test_health_warm.py and under the control plane in tests/test_detection.py); what is
asserted is which check each decision stands on.
"""

from __future__ import annotations

import pytest

from controller.node import checks
from controller.node.checks import AGAIN_S, FRESH_S, Checks
from controller.node.commands import Commands


class _Spawner:
    checks_cheaply = True

    @staticmethod
    def warming() -> bool:
        return False


class _Store:
    def __init__(self):
        self.health: list[dict] = []

    def set_health(self, node: str, info: dict) -> None:
        self.health.append(dict(info))


class _Node(Checks, Commands):
    """An agent's state as the checks read it: no ranks run unless `live` says."""

    def __init__(self):
        self.node, self.ended, self.live, self.generation = "n0", False, False, None
        self.ran_since_ok, self.latest_plan = False, None
        self.info = {"health": "ok"}  # as its registration's check left it
        self.corrupt_tiles: set[int] = set()
        self.spawner, self.store, self.events = _Spawner(), _Store(), []

    def _live(self) -> bool:
        return self.live

    def _event(self, kind: str, message: str, **fields) -> None:
        self.events.append((kind, message))

    def _note_outage(self, e: Exception) -> None:
        raise AssertionError(e)


@pytest.fixture
def node(monkeypatch):
    """A node whose checks are counted (`node.checks`), answering `node.answer`, at a clock
    the test moves (`node.now`)."""
    n = _Node()
    n.checks, n.answer, n.now = 0, "ok", 1000.0

    def check(name, corrupt, spawner):
        n.checks += 1
        if n.answer == "ok" and not corrupt:
            return {"devices": 1, "device_kind": "cpu", "health": "ok", "health_detail": "",
                    "ok_at": n.now}
        return {"devices": 1, "health": "bad", "health_detail": f"{name}/0: wrong"}
    monkeypatch.setattr(checks, "health_check", check)
    monkeypatch.setattr(checks.time, "monotonic", lambda: n.now)
    return n


def _generation_ran(node: _Node, generation: int) -> None:
    """Ranks of `generation` ran here and have left it."""
    node.generation, node.ran_since_ok, node.live = generation, True, False


def test_a_generations_end_is_checked_once_and_the_next_plan_stands_on_that_check(node):
    _generation_ran(node, 3)
    node._check_ahead()
    node._check_ahead()  # the same end: not again
    assert node.checks == 1 and node.ran_since_ok is False
    node.now += FRESH_S / 2
    assert node._healthy_for(4) and node.checks == 1  # the plan launches on it
    assert node.store.health[-1]["health"] == "ok" and node.store.health[-1]["ran_since_ok"]


def test_a_plan_checks_for_itself_when_the_check_ahead_is_stale_or_ranks_ran_since(node):
    _generation_ran(node, 3)
    node._check_ahead()
    node.now += FRESH_S + 1
    assert node._healthy_for(4) and node.checks == 2  # too old: checked again
    assert node.ahead is None  # the plan took it: its ranks start now
    node.ahead = {"at": node.now, "result": {"health": "ok"}}  # fresh, but ranks ran since
    node.ran_since_ok = True
    assert node._healthy_for(5) and node.checks == 3


def test_a_failed_check_ahead_is_neither_kept_nor_said_and_the_plans_own_check_reports(node):
    _generation_ran(node, 3)
    node.answer = "bad"
    node._check_ahead()
    assert node.checks == 1 and node.ahead is None and node.store.health == []
    assert node.events == []  # said by the plan's check, as before
    node._check_ahead()
    assert node.checks == 1  # not every tick: again after AGAIN_S
    assert not node._healthy_for(4) and node.checks == 2
    assert node.store.health[-1]["health"] == "bad"
    assert node.events and "fails its health check before generation 4" in node.events[-1][1]


def test_an_idle_node_keeps_a_fresh_check_where_a_check_is_cheap(node):
    node._check_ahead()  # a spare, never ran anything: its first check
    assert node.checks == 1
    node.now += AGAIN_S - 1
    node._check_ahead()
    assert node.checks == 1
    node.now += 2
    node._check_ahead()
    assert node.checks == 2  # kept fresh: a plan within FRESH_S of it needs no check
    node.now += FRESH_S - 1
    assert node._healthy_for(0) and node.checks == 2
    node.spawner.checks_cheaply = False  # a fresh interpreter a check: no idle re-checks
    node.now += AGAIN_S * 4
    node._check_ahead()
    assert node.checks == 2


def test_no_check_ahead_while_ranks_run_a_plan_waits_or_the_job_ended(node):
    _generation_ran(node, 3)
    node.live = True
    node._check_ahead()
    node.live, node.latest_plan = False, {"action": "run", "nodes": ["n0"], "generation": 4}
    node._check_ahead()  # the plan's own check runs now instead
    node.latest_plan, node.ended = None, True
    node._check_ahead()
    assert node.checks == 0


def test_a_tile_made_bad_voids_the_check_ahead(node):
    _generation_ran(node, 3)
    node._check_ahead()
    node._command({"kind": "bad_tile", "tile": 0})
    assert node.ahead is None
    assert not node._healthy_for(4) and node.checks == 2  # the plan's check sees the tile


def test_a_spare_gone_bad_is_said_at_once_and_again_only_when_it_changes(node):
    """A spare (no rank ran there since its last pass) whose check ahead fails: published and
    said, as a check on demand is, so that the controller excludes it before a plan names it;
    the same result again is not said again; a pass after a repair is."""
    node._check_ahead()
    assert node.checks == 1 and node.store.health == [] and node.events == []  # ok: unchanged
    node._command({"kind": "bad_tile", "tile": 0})
    node.now += AGAIN_S
    node._check_ahead()
    assert node.checks == 2 and node.ahead is None
    assert node.store.health[-1]["health"] == "bad" and not node.store.health[-1]["ran_since_ok"]
    assert node.events[-1] == ("health", "health check while idle: n0 bad tile n0/0: wrong")
    node.now += AGAIN_S
    node._check_ahead()
    assert node.checks == 3 and len(node.store.health) == 1  # still bad: not said again
    node.corrupt_tiles.clear()  # repaired
    node.now += AGAIN_S
    node._check_ahead()
    assert node.store.health[-1]["health"] == "ok" and node.ahead is not None
    assert node.events[-1] == ("health", "health check while idle: n0 ok")


def test_a_node_whose_ranks_ran_leaves_a_failed_check_ahead_to_the_plan(node):
    """Where ranks ran since the last pass, a failing check ahead says nothing: the plan's own
    check reports it, and the controller sets the work since that pass aside (unchanged)."""
    _generation_ran(node, 3)
    node._command({"kind": "bad_tile", "tile": 0})
    node._check_ahead()
    assert node.checks == 1 and node.store.health == []
    assert [kind for kind, _ in node.events] == ["chaos"]


def test_a_pass_after_the_ranks_left_moves_ok_at_but_not_where_a_window_opens(node):
    """The pass published once a generation's ranks left (forgive.py's proof) vouches for
    nothing they computed: a NaN of theirs found now still sets aside all since the pass they
    ran after (`window_from`, controller/control/checkpoints.py). The next plan's ranks start
    from the new pass, which is then where a window of theirs opens."""
    node.info = {**node.info, "ok_at": 900.0, "window_from": 900.0}  # the pass gen 3 ran after
    _generation_ran(node, 3)
    node._check_ahead()
    published = node.store.health[-1]
    assert (published["ok_at"], published["window_from"]) == (node.now, 900.0)
    node.now += FRESH_S / 2
    assert node._healthy_for(4) and node.checks == 1  # the plan launches on it
    assert node.store.health[-1]["window_from"] == node.now - FRESH_S / 2
