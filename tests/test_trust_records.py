"""Records an agent's (or the operator's) credentials can write, read back as anything at all.

The store keeps what decodes to a JSON object and skips the rest (controller/store/decode.py):
a value that is not JSON, a JSON list, nesting that exhausts the parser, a rank field that is
no local rank. Before, one such value raised in `json.loads` inside the controller's tick (or
the agent's loop, for a command) and stopped it. docs/security.md, "Redis".
"""

from __future__ import annotations

import json
import time

import yaml
from cluster import wait_for, write_job

from controller.control.controller import Controller
from controller.control.settings import settings_for
from controller.store.store import Store
from optimus.config import validate_job

GARBAGE = ["not json", "[1, 2]", "7", "[" * 100_000, '"a string"']


def _job(tmp_path, nodes: int = 2):
    raw = yaml.safe_load(write_job(tmp_path / "job.yaml", tmp_path / "run", name="j").read_text())
    config = validate_job(raw, world=nodes)
    return config, settings_for(config, str(tmp_path / "job.yaml"), [], nodes, 1)


def _beat(step: int) -> dict:
    return {"step": step, "generation": 0, "time": time.time(), "phase": "compute"}


def test_unreadable_records_are_skipped_and_the_controller_ticks_on(redis_server, tmp_path):
    config, settings = _job(tmp_path)
    store = Store(redis_server.url, "j")
    for name in ("n0", "n1"):
        store.own.register_node(name, {"host": name, "health": "ok", "snapshot_addr": ""})
    for i, value in enumerate(GARBAGE):  # node records, as an agent's HSET writes them
        store.r.hset(store.k("nodes"), f"bad{i}", value)
        store.r.zadd(store.k("agents"), {f"bad{i}": time.time()})
    store.r.hset(store.k("node:n0:ranks"), mapping={
        "0": json.dumps(_beat(3)), "1": "not json", "x": json.dumps(_beat(4)),
        "-1": json.dumps(_beat(5)), "2": "[" * 100_000})
    for value in GARBAGE:
        store.r.xadd(store.k("exits"), {"json": value})
    store.r.xadd(store.k("exits"), {"other": "no json field"})

    ctl = Controller(store, config, settings, ident="c")
    for _ in range(3):
        ctl.tick()  # raised ValueError (nodes) before; RecursionError for the deep nesting
    assert store.plan()["nodes"] == ["n0", "n1"]
    assert set(store.nodes()) == {"n0", "n1"}
    assert set(store.node_info(["n0", "bad0", "bad1", "bad3"])) == {"n0"}
    assert list(store.rank_beats("n0")) == [0] and store.rank_beats("n0")[0]["step"] == 3
    assert store.exits() == []
    assert store.excluded() == {}


def test_an_agent_skips_commands_that_are_not_objects(redis_server):
    store = Store(redis_server.url, "j")
    store.own.register_node("n0", {"host": "n0", "health": "ok", "snapshot_addr": ""})
    for value in [*GARBAGE, json.dumps({"kind": "health_check"})]:
        store.r.rpush(store.k("commands:n0"), value)
    tick = store.own.agent_tick("n0", {"state": "idle"}, {}, None, False)
    assert tick.commands == [{"kind": "health_check"}]


def test_a_bad_tile_command_naming_no_tile_is_refused_and_the_agent_goes_on(redis_server, procs,
                                                                            relayed):
    """`int(command["tile"])` raised in the agent's loop for a tile like "x" (the operator's
    credentials may push any JSON object into a node's command list)."""
    relayed("j")
    store = Store(redis_server.url, "j")
    agent = procs.start("agent", "agent", "--job", "j", "--node", "n0", "--redis",
                        redis_server.url, "--interval", "0.25")
    wait_for(lambda: "n0" in store.nodes(), 120, "the agent to register")
    for tile in ("x", -1, True, 10**9):
        store.push_command("n0", {"kind": "bad_tile", "tile": tile})
    store.push_command("n0", {"kind": "health_check"})

    def health_events() -> list[str]:
        return [e["message"] for _, e in store.events(count=100) if e["kind"] == "health"]
    wait_for(health_events, 60, "the health check after the commands")
    assert agent.poll() is None
    assert health_events() == ["health check on demand: n0 ok"]  # no tile was made bad
    ignored = [e["message"] for _, e in store.events(count=100) if "ignored" in e["message"]]
    assert ignored == [f"a bad_tile command for n0 ignored: tile {t!r} is no tile index"
                       for t in ("x", "-1", "True", "1000000000")]


def _planned(redis_server, config, settings) -> tuple[Store, Controller]:
    """Two registered nodes and a controller that has planned generation 0 on them."""
    store = Store(redis_server.url, "j")
    for name in ("n0", "n1"):
        store.own.register_node(name, {"host": name, "health": "ok", "snapshot_addr": ""})
    ctl = Controller(store, config, settings, ident="c")
    wait_for(lambda: ctl.tick() and (store.plan() or {}).get("action") == "run", 20,
             "generation 0 planned")
    return store, ctl


def test_a_planned_node_whose_beat_redis_lost_is_judged_silent_from_then_not_for_ever(
        redis_server, tmp_path):
    """Redis restarted empty after a tick read the job record: the beats the rest of the tick
    read were gone, and the node was "silent for ever", lost and excluded at once (CI,
    test_control_plane's Redis restart). Now it is silent from when the controller first
    found no beat, and lost only after agent_timeout_s of that."""
    import dataclasses

    config, settings = _job(tmp_path)
    settings = dataclasses.replace(settings, agent_timeout_s=1.0)
    store, ctl = _planned(redis_server, config, settings)
    store.r.delete(store.k("agents"), store.k("node:n1:row"))  # n1's beat, gone
    ctl.relay.forget()
    ctl.tick()
    assert store.excluded() == {} and store.job_record()["state"] == "RUNNING"
    time.sleep(1.2)  # past agent_timeout_s with no beat from n1 (n0 beat once more)
    store.own.register_node("n0", {"host": "n0", "health": "ok", "snapshot_addr": ""})
    ctl.tick()
    excluded = store.excluded()
    assert list(excluded) == ["n1"], excluded
    assert "its agent has been silent for 1." in excluded["n1"]["reason"]


def test_a_tick_that_finds_redis_emptied_keeps_the_journal_for_the_rebuild(redis_server,
                                                                          tmp_path):
    """Redis restarted empty under a tick: its writes left a job record without a state, and
    the journal was rewritten from it, so the rebuild found no job and submitted it afresh
    (generation 1 from the last checkpoint: CI, test_control_plane's Redis restart)."""
    config, settings = _job(tmp_path)
    store, ctl = _planned(redis_server, config, settings)
    journal = json.loads(ctl.journal.read_text())
    assert journal["job"]["state"] == "RUNNING"
    store.r.flushdb()
    store.update_job({"reason": "a write that landed after the restart"})
    ctl._write_journal()
    assert json.loads(ctl.journal.read_text()) == journal


def _kinds(store: Store, kind: str) -> list[str]:
    return [e["message"] for _, e in store.events(count=1000) if e["kind"] == kind]


def test_a_state_a_retried_write_planted_in_an_emptied_redis_is_rebuilt_around(redis_server,
                                                                             tmp_path):
    """A write in flight when Redis restarted empty was retried into the new one and set a
    state (the tick that decided COMPLETED, say): the record had a state, so no rebuild ran,
    and the job went on with a record of two fields (no generation, no name) and a journal
    rewritten from them. Now the record is not whole without `created`: rebuilt from the
    journal, with the planted fields (newer) kept over it."""
    import dataclasses

    config, settings = _job(tmp_path)
    store, ctl = _planned(redis_server, config, dataclasses.replace(settings,
                                                                   agent_timeout_s=0.5))
    journal = json.loads(ctl.journal.read_text())
    store.r.flushdb()
    store.update_job({"state": "RUNNING", "restarts": "3"})  # newer than the journal's 0
    ctl._write_journal()
    assert json.loads(ctl.journal.read_text()) == journal  # not rewritten from two fields
    ctl.tick()
    record = store.job_record()
    assert record["generation"] == journal["job"]["generation"] == "0"
    assert record["created"] == journal["job"]["created"] and record["name"] == "j"
    assert journal["job"]["restarts"] == "0" and record["restarts"] == "3"  # kept over it
    assert len(_kinds(store, "rebuilt")) == 1 and _kinds(store, "submitted") == []


def test_a_job_that_ended_stays_ended_when_its_controller_finds_redis_emptied(redis_server,
                                                                            tmp_path):
    """Redis restarted empty while the controller that ended the job waited for the agents'
    goodbyes: it took the ended journal for a new job's start, submitted it again and ran a
    generation 0 anew (CI, test_control_plane's Redis restart under a CPU hog: "rebuilt"
    never said). Now the job stays as it ended; a controller that starts on that journal
    still submits a new job."""
    config, settings = _job(tmp_path)
    store, ctl = _planned(redis_server, config, settings)
    store.update_job({"state": "COMPLETED", "reason": "all 2 ranks of generation 0 finished"})
    ctl._write_journal()
    store.r.flushdb()
    started = time.monotonic()
    ctl.tick()
    assert time.monotonic() - started < settings.agent_timeout_s  # no wait for the agents
    record = store.job_record()
    assert (record["state"], record["generation"]) == ("COMPLETED", "0"), record
    assert store.plan()["generation"] == 0
    assert len(_kinds(store, "rebuilt")) == 1 and _kinds(store, "submitted") == []

    store.r.flushdb()
    Controller(store, config, settings, ident="new").tick()
    assert store.job_record()["state"] != "COMPLETED"
    assert len(_kinds(store, "submitted")) == 1 and _kinds(store, "rebuilt") == []


def test_a_resubmission_reaches_a_controller_still_leading_the_job_it_ended(redis_server,
                                                                           tmp_path):
    """Helm's controllers stay up after the job ends. `--resubmit` of a FAILED job resets the
    store under the one still leading, which must then find no journal of the ended job (it
    would keep the job FAILED, as it does after losing Redis): its next tick submits anew."""
    from controller.cli.main import _resubmit

    config, settings = _job(tmp_path)
    store, ctl = _planned(redis_server, config, settings)
    store.update_job({"state": "FAILED", "reason": "5 restarts used up"})
    ctl._write_journal()
    _resubmit(store, config)
    ctl.tick()
    assert store.job_record()["state"] != "FAILED"
    assert len(_kinds(store, "submitted")) == 2  # the first submission's, and this one's
    assert _kinds(store, "rebuilt") == []
    assert [m for m in _kinds(store, "resubmitted") if "was FAILED" in m]


def test_a_tick_whose_redis_restarted_empty_under_it_decides_nothing(redis_server, tmp_path):
    """Redis restarted empty while a tick observed: it had read the whole job record before
    the restart and the nodes after it, decided 'waiting for nodes: 0 healthy node(s)', and
    wrote that state into the empty Redis; the rebuild kept it over the journal (a planted
    state is newer) and the job started generation 1 from its last checkpoint instead of
    going on with generation 0 (CI, test_control_plane's Redis restart). Now a tick applies
    nothing once the record it read is gone: the next one rebuilds from the journal."""
    import dataclasses

    config, settings = _job(tmp_path)
    store, ctl = _planned(redis_server, config, dataclasses.replace(settings,
                                                                   agent_timeout_s=2.0))
    observe = ctl.observer.observe

    def restarted_under(record, relay):  # the record was read before the restart
        store.r.flushdb()
        ctl.observer.observe = observe
        return observe(record, relay)

    ctl.observer.observe = restarted_under
    ctl.tick()
    assert store.job_record() == {} and store.plan() is None  # nothing decided on zero nodes
    for name in ("n0", "n1"):  # the agents re-register within an interval
        store.own.register_node(name, {"host": name, "health": "ok", "snapshot_addr": ""})
    ctl.tick()
    record = store.job_record()
    assert (record["state"], record["generation"]) == ("RUNNING", "0"), record
    assert store.plan()["generation"] == 0
    said = [e["message"] for _, e in store.events(count=1000)]
    assert len(_kinds(store, "rebuilt")) == 1 and not [m for m in said if "waiting" in m], said
