"""The rules of the health check done ahead of a plan (controller/node/checks.py): when the agent
runs it, when a plan may take it instead of a check of its own, and when it may not.

The check itself is replaced by a counter that answers as told (the real one runs in
tests/test_health_warm.py and under the control plane in tests/test_detection.py); what is
asserted is which check each decision stands on.
"""

from __future__ import annotations

import pytest
from records import run_plan

from controller.node import checks
from controller.node.checks import AGAIN_S, FRESH_S, Checks
from controller.node.commands import Commands
from controller.node.voice import Voice
from optimus.contract.records import Plan


class _Spawner:
    checks_cheaply = True

    @staticmethod
    def warming() -> bool:
        return False


class _Own:
    """The node's own records, as the checks write them: each record published."""

    def __init__(self):
        self.health: list[dict] = []

    def set_health(self, node: str, info: dict) -> None:
        self.health.append(dict(info))


class _Store:
    def __init__(self):
        self.own = _Own()


class _Voice:
    def __init__(self):
        self.events: list[tuple[str, str]] = []

    def event(self, kind: str, message: str, **fields) -> None:
        self.events.append((kind, message))

    def outage(self, e: Exception) -> None:
        raise AssertionError(e)


class _Ranks:
    """The ranks' side as the commands read it: none here."""

    @staticmethod
    def live() -> bool:
        return False


class _Node:
    """A node's checks (`part`), with the ranks' state they are told as the test sets it: no
    ranks run unless `live` says."""

    def __init__(self):
        self.store, self.spawner, self.voice = _Store(), _Spawner(), _Voice()
        self.events = self.voice.events
        self.ended, self.live, self.generation, self.latest_plan = False, False, None, None
        self.part = Checks(self.store, "n0", "h0", self.spawner, None, self.voice,
                           {"health": "ok"})  # as its registration's check left it
        self.commands = Commands(self.store, "n0", self.voice, _Ranks(), self.part, None)

    def check_ahead(self) -> None:
        """The agent's turn of it, at the end of its tick."""
        self.part.check_ahead(self.generation, live=self.live, job_ended=self.ended,
                              plan=self.latest_plan)


@pytest.fixture
def node(monkeypatch):
    """A node whose checks are counted (`node.count`), answering `node.answer`, at a clock
    the test moves (`node.now`)."""
    n = _Node()
    n.count, n.answer, n.now = 0, "ok", 1000.0

    def check(name, corrupt, spawner):
        n.count += 1
        if n.answer == "ok" and not corrupt:
            return {"devices": 1, "device_kind": "cpu", "health": "ok", "health_detail": "",
                    "ok_at": n.now}
        return {"devices": 1, "health": "bad", "health_detail": f"{name}/0: wrong"}
    monkeypatch.setattr(checks, "health_check", check)
    monkeypatch.setattr(checks.time, "monotonic", lambda: n.now)
    return n


def _generation_ran(node: _Node, generation: int) -> None:
    """Ranks of `generation` ran here and have left it."""
    node.generation, node.live = generation, False
    node.part.ranks_started()


def test_a_generations_end_is_checked_once_and_the_next_plan_stands_on_that_check(node):
    _generation_ran(node, 3)
    node.check_ahead()
    node.check_ahead()  # the same end: not again
    assert node.count == 1 and node.part.ran_since_ok is False
    node.now += FRESH_S / 2
    assert node.part.healthy_for(4) and node.count == 1  # the plan launches on it
    assert node.store.own.health[-1]["health"] == "ok" and node.store.own.health[-1]["ran_since_ok"]


def test_a_plan_checks_for_itself_when_the_check_ahead_is_stale_or_ranks_ran_since(node):
    _generation_ran(node, 3)
    node.check_ahead()
    node.now += FRESH_S + 1
    assert node.part.healthy_for(4) and node.count == 2  # too old: checked again
    assert node.part.ahead is None  # the plan took it: its ranks start now
    node.part.ahead = {"at": node.now, "result": {"health": "ok"}}  # fresh, but ranks ran since
    node.part.ranks_started()
    assert node.part.healthy_for(5) and node.count == 3


def test_a_failed_check_ahead_is_neither_kept_nor_said_and_the_plans_own_check_reports(node):
    _generation_ran(node, 3)
    node.answer = "bad"
    node.check_ahead()
    assert node.count == 1 and node.part.ahead is None and node.store.own.health == []
    assert node.events == []  # said by the plan's check, as before
    node.check_ahead()
    assert node.count == 1  # not every tick: again after AGAIN_S
    assert not node.part.healthy_for(4) and node.count == 2
    assert node.store.own.health[-1]["health"] == "bad"
    assert node.events and "fails its health check before generation 4" in node.events[-1][1]


def test_an_idle_node_keeps_a_fresh_check_where_a_check_is_cheap(node):
    node.check_ahead()  # a spare, never ran anything: its first check
    assert node.count == 1
    node.now += AGAIN_S - 1
    node.check_ahead()
    assert node.count == 1
    node.now += 2
    node.check_ahead()
    assert node.count == 2  # kept fresh: a plan within FRESH_S of it needs no check
    node.now += FRESH_S - 1
    assert node.part.healthy_for(0) and node.count == 2
    node.spawner.checks_cheaply = False  # a fresh interpreter a check: no idle re-checks
    node.now += AGAIN_S * 4
    node.check_ahead()
    assert node.count == 2


def test_no_check_ahead_while_ranks_run_a_plan_waits_or_the_job_ended(node):
    _generation_ran(node, 3)
    node.live = True
    node.check_ahead()
    node.live, node.latest_plan = False, Plan.parse(run_plan(4, ["n0"]))
    node.check_ahead()  # the plan's own check runs now instead
    node.latest_plan, node.ended = None, True
    node.check_ahead()
    assert node.count == 0


def test_a_tile_made_bad_voids_the_check_ahead(node):
    _generation_ran(node, 3)
    node.check_ahead()
    node.commands.take({"kind": "bad_tile", "tile": 0})
    assert node.part.ahead is None
    assert not node.part.healthy_for(4) and node.count == 2  # the plan's check sees the tile


def test_a_spare_gone_bad_is_said_at_once_and_again_only_when_it_changes(node):
    """A spare (no rank ran there since its last pass) whose check ahead fails: published and
    said, as a check on demand is, so that the controller excludes it before a plan names it;
    the same result again is not said again; a pass after a repair is."""
    node.check_ahead()
    assert node.count == 1 and node.store.own.health == [] and node.events == []  # ok: unchanged
    node.commands.take({"kind": "bad_tile", "tile": 0})
    node.now += AGAIN_S
    node.check_ahead()
    assert node.count == 2 and node.part.ahead is None
    published = node.store.own.health[-1]
    assert published["health"] == "bad" and not published["ran_since_ok"]
    assert node.events[-1] == ("health", "health check while idle: n0 bad tile n0/0: wrong")
    node.now += AGAIN_S
    node.check_ahead()
    assert node.count == 3 and len(node.store.own.health) == 1  # still bad: not said again
    node.part.corrupt_tiles.clear()  # repaired
    node.now += AGAIN_S
    node.check_ahead()
    assert node.store.own.health[-1]["health"] == "ok" and node.part.ahead is not None
    assert node.events[-1] == ("health", "health check while idle: n0 ok")


def test_a_node_whose_ranks_ran_leaves_a_failed_check_ahead_to_the_plan(node):
    """Where ranks ran since the last pass, a failing check ahead says nothing: the plan's own
    check reports it, and the controller sets the work since that pass aside (unchanged)."""
    _generation_ran(node, 3)
    node.commands.take({"kind": "bad_tile", "tile": 0})
    node.check_ahead()
    assert node.count == 1 and node.store.own.health == []
    assert [kind for kind, _ in node.events] == ["chaos"]


def test_a_pass_after_the_ranks_left_moves_ok_at_but_not_where_a_window_opens(node):
    """The pass published once a generation's ranks left (forgive.py's proof) vouches for
    nothing they computed: a NaN of theirs found now still sets aside all since the pass they
    ran after (`window_from`, controller/control/checkpoints.py). The next plan's ranks start
    from the new pass, which is then where a window of theirs opens."""
    # the pass generation 3 ran after
    node.part.info = {**node.part.info, "ok_at": 900.0, "window_from": 900.0}
    _generation_ran(node, 3)
    node.check_ahead()
    published = node.store.own.health[-1]
    assert (published["ok_at"], published["window_from"]) == (node.now, 900.0)
    node.now += FRESH_S / 2
    assert node.part.healthy_for(4) and node.count == 1  # the plan launches on it
    assert node.store.own.health[-1]["window_from"] == node.now - FRESH_S / 2


class _Requests:
    """A store that keeps operators' requests and events apart."""

    def __init__(self):
        self.requests, self.events = [], []

    def request(self, action, actor, host, reason=""):
        self.requests.append((action, actor, reason))

    def event(self, actor, kind, message, **fields):
        self.events.append((kind, message))


def test_an_agent_that_cannot_run_the_job_refuses_it_in_its_own_record(monkeypatch):
    """The agent's reaction to a job its node cannot run (the decision is
    `check_float8_here`'s, tests/test_float8.py): no launch, and its refusal with the reason in
    its own record, not in the operators' `requests` (tests/test_trust_secrets.py: the
    controller stops the job under the shipped ACL)."""
    why = "job.yaml: training.float8: tensorwise cannot run here: ..."
    monkeypatch.setattr(checks, "job_problem_here", lambda job_file, overrides: why)
    store = _Requests()
    part = Checks(store, "node0", "h", _Spawner(), None, Voice(store, "node0"), {})
    assert part.can_run(Plan.parse(run_plan(3, ["node0"], job_file="job.yaml"))) is False
    assert store.requests == []
    assert part.refusal == {"generation": 3, "host": "h", "reason": why}
    assert store.events == [("refused", f"node0 refuses generation 3: {why}")]
    monkeypatch.setattr(checks, "job_problem_here", lambda job_file, overrides: None)
    assert part.can_run(Plan.parse(run_plan(4, ["node0"], job_file="job.yaml"))) is True
    assert part.refusal is None
