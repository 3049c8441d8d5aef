"""A leader cut off mid-decision leaves nothing of it behind, and a stale leader's writes never
land (controller/store/fence.py); a plan in flight whose record never landed is adopted
(decide.py `_adopt`). docs/control-plane.md, "High availability".

Before, `Controller.apply` wrote a decision as many calls and only the lease renewal checked the
lease: a leader cut off right after its plan for generation 1 left the plan (which the agents
started) without its job record (RUNNING, generation 1) or its `generation` event, and the
standby stopped the healthy generation: one fault, two restarts.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import redis
import yaml
from cluster import ROOT, RedisServer, wait_for, write_job
from test_decide import NOW, S, node, running, running_plan

from controller.control.controller import Controller
from controller.control.decide import (
    PAUSING,
    RESTARTING,
    RUNNING,
    Decision,
    JobView,
    decide,
)
from controller.control.settings import settings_for
from controller.store.store import Store
from optimus.config import validate_job

# --- adoption, as a rule -------------------------------------------------------------------------

IN_FLIGHT = {**running_plan(gen=1), "reason": "generation 1 on n0, n1 from the checkpoint of "
             "step 40", "issued": NOW - 2}
HALF = JobView(state=RESTARTING, generation=0, restarts=1, reason="rank 1 on n1 died",
               next_plan_at=NOW - 3)  # the failure's record landed, generation 1's did not


def test_a_running_plan_newer_than_the_record_is_adopted_not_stopped():
    nodes = {n: node(n, generation=1, live=2) for n in ("n0", "n1")}
    d = decide(running(nodes=nodes, job=HALF, plan=IN_FLIGHT), S)
    assert d.plan is None  # before: a stop of generation 1, and a generation 2 after it
    assert (d.job["state"], d.job["generation"], d.job["reason"]) == (
        RUNNING, 1, IN_FLIGHT["reason"])
    assert d.job["next_plan_at"] is None and d.job["failure_since"] is None
    assert [(kind, fields) for kind, _, fields in d.events] == [("adopted", {"generation": 1})]
    assert "RESTARTING, generation 0" in d.events[0][1]

    pausing = JobView(**{**HALF.__dict__, "desired": "pause"})
    d = decide(running(nodes=nodes, job=pausing, plan=IN_FLIGHT), S)
    assert d.plan is None and (d.job["state"], d.job["generation"]) == (PAUSING, 1)


def test_only_a_newer_plan_with_ranks_running_is_adopted():
    # Its ranks gone: nothing runs to adopt; the next generation is planned past it.
    idle = {n: node(n, generation=1, live=0) for n in ("n0", "n1")}
    d = decide(running(nodes=idle, job=HALF, plan=IN_FLIGHT), S)
    assert d.plan["generation"] == 2 and d.plan["action"] == "run"
    assert "adopted" not in [kind for kind, _, _ in d.events]
    # Not newer than the record (a state written before its plan): stopped, as before.
    live = {n: node(n, generation=0, live=2) for n in ("n0", "n1")}
    d = decide(running(nodes=live, job=HALF, plan=running_plan(gen=0)), S)
    assert d.plan["action"] == "stop" and d.plan["generation"] == 0 and d.job == {}


# --- fencing, against a real Redis ---------------------------------------------------------------

def _job(tmp_path):
    raw = yaml.safe_load(write_job(tmp_path / "job.yaml", tmp_path / "run", name="j").read_text())
    config = validate_job(raw, world=2)
    return config, settings_for(config, str(tmp_path / "job.yaml"), [], 2, 1)


def _leading(url: str, tmp_path, ident: str = "a", **store_kw) -> tuple[Store, Controller]:
    """Two registered nodes and controller `ident` leading generation 0 on them."""
    config, settings = _job(tmp_path)
    store = Store(url, "j", **store_kw)
    for name in ("n0", "n1"):
        store.own.register_node(name, {"host": name, "health": "ok", "snapshot_addr": ""})
    ctl = Controller(store, config, settings, ident=ident)
    wait_for(lambda: ctl.tick() and (store.plan() or {}).get("action") == "run", 20,
             "generation 0 planned")
    return store, ctl


def _next_generation(ctl: Controller) -> tuple[Decision, object]:
    """A decision with a write of every kind: generation 1 planned and recorded, an exclusion,
    an agent's command, its event."""
    obs = ctl.observe()
    reason = "generation 1 on n0, n1 from scratch"
    d = Decision(job={"state": RUNNING, "generation": 1, "reason": reason},
                 plan={**obs.plan, "generation": 1, "reason": reason, "issued": time.time()},
                 exclude=[("n9", "bad tile 0")], commands=[("n0", {"kind": "health_check"})])
    d.note("generation", reason)
    return d, obs


def _state(store: Store) -> dict:
    return {"plan": store.plan(), "job": store.job_record(), "excluded": store.excluded(),
            "commands": store.r.lrange(store.k("commands:n0"), 0, -1),
            "events": store.events(count=1000)}


def _execs(port: int) -> int:
    """How many EXECs the server has run (one that ran nothing included)."""
    with redis.Redis(port=port) as r:
        return r.info("commandstats").get("cmdstat_exec", {}).get("calls", 0)


def test_a_decision_of_the_lease_holder_lands_whole_in_one_transaction(redis_server, tmp_path):
    store, ctl = _leading(redis_server.url, tmp_path)
    d, obs = _next_generation(ctl)
    execs = _execs(redis_server.port)
    assert ctl.apply(d, obs) is True
    assert _execs(redis_server.port) - execs == 1  # before: one per write (plan, record, ...)
    state = _state(store)
    assert (state["plan"]["generation"], state["plan"]["action"]) == (1, "run")
    assert store.r.get(store.k("plan:stamp")).startswith("1:run:")
    assert (state["job"]["state"], state["job"]["generation"]) == ("RUNNING", "1")
    assert state["excluded"]["n9"]["reason"] == "bad tile 0"
    assert [json.loads(c) for c in state["commands"]] == [{"kind": "health_check"}]
    said = [e for _, e in state["events"] if e["kind"] == "generation"]
    assert said[-1]["message"] == "generation 1 on n0, n1 from scratch"
    assert said[-1]["controller"] == "a"
    assert json.loads(ctl.journal.read_text())["plan"]["generation"] == 1
    assert ctl.leading


def test_a_controller_that_lost_its_lease_applies_nothing_and_stands_down(redis_server,
                                                                          tmp_path):
    store, ctl = _leading(redis_server.url, tmp_path)
    journal = ctl.journal.read_text()
    for moved in ("taken", "expired"):
        d, obs = _next_generation(ctl)
        store.r.delete(store.k("leader"))  # b's, from the last round
        assert store.fence.hold_lease("a", 5.0)
        before = _state(store)
        if moved == "taken":
            store.r.set(store.k("leader"), "b", px=5000)
        else:
            store.r.delete(store.k("leader"))
        assert ctl.apply(d, obs) is False
        assert _state(store) == before, moved  # no plan 1, no record 1, no n9, no event
        assert ctl.leading is False
        assert ctl.journal.read_text() == journal
        ctl.leading = True


class Link:
    """A TCP link to Redis that a test cuts and heals. What crosses it while it is cut is held
    and delivered on the heal, as TCP delivers what it retransmits once a network is back;
    `late` is what reached Redis so."""

    def __init__(self, port: int):
        self.to, self.up, self.late = port, threading.Event(), bytearray()
        self.up.set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self._listener.accept()
            except OSError:
                return
            far = socket.create_connection(("127.0.0.1", self.to))
            self._sockets += [near, far]
            for src, dst, to_redis in ((near, far, True), (far, near, False)):
                threading.Thread(target=self._pump, args=(src, dst, to_redis),
                                 daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, to_redis: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if not self.up.is_set():
                    self.up.wait()
                    if to_redis:
                        self.late += data
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.up.set()
        for s in [self._listener, *self._sockets]:
            s.close()


def test_a_decision_carried_across_a_cut_is_refused_once_the_lease_moved(redis_server,
                                                                        tmp_path, monkeypatch):
    """The link of leader `a` is cut after it read the lease as its own and before its EXEC
    reached Redis; its lease expires, `b` takes it, the link heals. The held EXEC reaches Redis
    and runs nothing; `a`'s retry reads the lease again and writes nothing either."""
    link = Link(redis_server.port)
    try:
        store, ctl = _leading(link.url, tmp_path, timeout_s=0.3, retry_s=10)
        other = Store(redis_server.url, "j")
        d, obs = _next_generation(ctl)

        def move_lease():
            wait_for(lambda: other.fence.hold_lease("b", 30), 5,
                     "a's lease to expire and b to take it")
            link.up.set()

        def cut(pipe):  # queued after the lease was read as a's, before EXEC is sent
            if not cut.done:
                cut.done = True
                link.up.clear()
                threading.Thread(target=move_lease, daemon=True).start()
        cut.done = False
        commit = store.commit

        def cut_first(batch, holder):
            batch.writes.insert(0, cut)
            return commit(batch, holder)
        monkeypatch.setattr(store, "commit", cut_first)

        assert store.fence.hold_lease("a", 2.0)  # b may take it 2 s after this, not before
        before, execs = _state(other), _execs(redis_server.port)
        started = time.monotonic()
        assert ctl.apply(d, obs) is False
        assert time.monotonic() - started > 0.5  # it waited out the cut, retrying
        assert b"EXEC" in link.late and b"generation 1 on n0, n1" in link.late
        wait_for(lambda: _execs(redis_server.port) - execs == 1, 5, "the held EXEC to arrive")
        time.sleep(0.2)
        assert _state(other) == before  # that EXEC ran nothing: the lease was b's by then
        assert other.fence.leader() == "b" and ctl.leading is False
    finally:
        link.close()


def test_a_new_leader_adopts_a_plan_in_flight_whose_record_never_landed(redis_server,
                                                                       tmp_path):
    """The half state a leader cut off before fencing left: the failure's record (RESTARTING,
    generation 0) and generation 1's plan, which the agents run; not its record or its event."""
    store, old = _leading(redis_server.url, tmp_path, ident="old")
    store.update_job({"state": RESTARTING, "reason": "rank 1 on n1 died", "restarts": 1,
                      "next_plan_at": time.time()})
    plan = {**store.plan(), "generation": 1, "reason": "generation 1 on n0, n1 from scratch",
            "issued": time.time()}
    store.set_plan(plan)
    for name in ("n0", "n1"):
        store.own.agent_tick(name, {"state": "running", "generation": 1, "live_ranks": 1}, {},
                         None, False)
    store.r.delete(store.k("leader"))  # the old leader is cut off: its lease ran out

    config, settings = _job(tmp_path)
    new = Controller(Store(redis_server.url, "j"), config, settings, ident="new")
    assert new.tick() == RUNNING
    record = store.job_record()
    assert (record["state"], record["generation"], record["reason"]) == (
        RUNNING, "1", plan["reason"])
    assert (store.plan()["generation"], store.plan()["action"]) == (1, "run")  # not stopped
    kinds = [e["kind"] for _, e in store.events(count=1000)]
    adopted = [e for _, e in store.events(count=1000) if e["kind"] == "adopted"]
    assert len(adopted) == 1 and adopted[0]["generation"] == "1"
    assert adopted[0]["controller"] == "new"
    assert kinds.count("restarting") == 0 and kinds.count("generation") == 1  # generation 0's


def test_a_single_write_needs_no_transaction_an_operator_may_not_run(tmp_path):
    """The operator's credentials may RPUSH a node's commands, and no MULTI: a write of one
    command goes alone, as before writes could be batched."""
    acl = (ROOT / "deploy" / "redis-users.acl").read_text().replace("CHANGE-ME", "pw")
    (tmp_path / "users.acl").write_text(acl)
    server = RedisServer(tmp_path / "redis", "--aclfile", str(tmp_path / "users.acl"))
    try:
        url = f"redis://{{}}@127.0.0.1:{server.port}/0"
        Store(url.format("optimus-operator:pw-operator"), "j").push_command(
            "n0", {"kind": "health_check"})
        controller = Store(url.format("optimus-controller:pw-controller"), "j")
        assert controller.r.lrange(controller.k("commands:n0"), 0, -1) == [
            '{"kind": "health_check"}']
    finally:
        server.stop()


def test_a_paused_leaders_mirror_appends_no_event_twice(redis_server, tmp_path):
    """A leader paused between its decision and its mirror, a standby leading meanwhile: the
    standby mirrors the events; the old leader, going on, finds the file grown and appends only
    what is newer."""
    from controller.control.event_log import EventLog

    store = Store(redis_server.url, "j")
    path = tmp_path / "events.jsonl"
    old, new = EventLog(store, path), EventLog(store, path)
    store.event("controller", "a", "first")
    assert old.mirror() == 1
    store.event("controller", "b", "second")
    store.event("controller", "c", "third")
    assert new.mirror() == 3 - 1  # the standby carries on after the file's last line
    store.event("controller", "d", "fourth")
    assert old.mirror() == 1
    kinds = [json.loads(line)["kind"] for line in path.read_text().splitlines()]
    assert kinds == ["a", "b", "c", "d"]


def test_a_decision_outlives_a_restart_of_redis_from_its_append_only_file(tmp_path):
    """A decision is a MULTI/EXEC; Redis (7.0.15 here; fixed upstream by redis/redis#14545)
    replays a transaction from its AOF as the default user and drops it when that user may
    not run its commands, so the ACL file's default user, off (no one can log in as it),
    keeps the controller's write rules: without
    them a requeued job (tests/test_slurm.py) or a resubmitted one (tests/test_pbs.py) came
    back without its RUNNING state and its exclusions."""
    acl = (ROOT / "deploy" / "redis-users.acl").read_text().replace("CHANGE-ME", "pw")
    (tmp_path / "users.acl").write_text(acl)
    server = RedisServer(tmp_path / "redis", "--aclfile", str(tmp_path / "users.acl"),
                         "--appendonly", "yes", "--appendfsync", "always")
    try:
        client = redis.Redis(port=server.port, username="optimus-controller",
                             password="pw-controller", decode_responses=True)
        with client.pipeline(transaction=True) as pipe:
            pipe.hset("optimus:{j}:excluded", "n1", json.dumps({"reason": "r"}))
            pipe.hset("optimus:{j}:job", "state", "RUNNING")
            pipe.execute()
        client.close()
        server.kill()
        server.start()
        client = redis.Redis(port=server.port, username="optimus-controller",
                             password="pw-controller", decode_responses=True)
        assert client.hgetall("optimus:{j}:excluded") == {"n1": '{"reason": "r"}'}
        assert client.hget("optimus:{j}:job", "state") == "RUNNING"
        client.close()
        with contextlib.suppress(redis.AuthenticationError, redis.ResponseError), \
                redis.Redis(port=server.port, username="default", password="") as anyone:
            anyone.ping()
            raise AssertionError("the default user logged in")
        with redis.Redis(port=server.port) as anyone:
            try:
                anyone.get("optimus:{j}:plan")
                raise AssertionError("a client that did not authenticate ran a command")
            except redis.AuthenticationError:
                pass
    finally:
        server.stop()
