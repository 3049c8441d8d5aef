"""The controller: a reconcile loop over one job, with a leader lease.

    optimus controller JOB --nodes N --ranks-per-node R [--redis URL]

Every tick (0.25 s) the controller that holds the lease observes the job (observe.py: the job
record, the plan, agents, exits of this generation, overdue heartbeats, silent agents' hosts,
the latest committed checkpoint), asks `decide` what to do, and applies it (`apply`: the
checkpoints it sets aside, on disk; then all it writes, exclusions, plan, job record and events,
in one transaction that lands only while this controller still holds the lease:
controller/store/fence.py). Standbys renew nothing and try for the lease each tick; when the
leader dies, one takes over within a lease period and carries on from the store, since that is
where all the state is. A leader cut off mid-decision leaves nothing of it behind, and a plan
in flight whose record never landed (a half-written state) is adopted, not stopped (decide.py
`_adopt`). The ranks notice nothing: only a new plan would touch them.

Which checkpoint the next generation starts from is the ranks' to decide; the controller
predicts it for the plan and reports what they loaded (controller/control/checkpoints.py).

Besides Redis, the leader keeps a journal, `<run_dir>/controller.json` (the job record, the plan
and the exclusions, written atomically on every change). If Redis comes back empty, the journal
and the agents' reports (each agent re-registers and says which generation it runs) rebuild the
state; the checkpoints were never in Redis (a journal naming a node by anything but a node name is
refused whole: controller/control/journal.py). It also mirrors the job's events stream into
`<run_dir>/events.jsonl` (controller/control/event_log.py), the history `optimus report` draws.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path

from controller.control.checkpoints import CheckpointView
from controller.control.decide import (
    ACTIVE,
    TERMINAL,
    Decision,
    Observed,
    Settings,
    decide,
)
from controller.control.event_log import EventLog
from controller.control.journal import read_journal
from controller.control.observe import Observer
from controller.control.relay import Relay
from controller.control.snapshot_watch import SnapshotWatch
from controller.disk import Rewritten
from controller.store import wake
from controller.store.fence import Batch
from controller.store.names import RULE
from controller.store.store import Store, StoreUnavailable
from optimus.config import ConfigError, JobConfig

log = logging.getLogger("optimus.controller")

TICK_S = 0.25
# Job record fields that change every step: not worth a journal write (and an fsync) each.
VOLATILE = frozenset({"progress_gen", "progress_step", "progress_at", "progress_moves",
                      "step_times", "hang_since", "failure_since", "latest_checkpoint",
                      "memory_snapshot"})


def whole(record: dict[str, str]) -> bool:
    """A job record as the controller keeps it: `created` is written only when a job is
    submitted and restored only by a rebuild, so a write a retry carried into a Redis that
    restarted empty (even one setting `state`) leaves a record that is not whole."""
    return bool(record.get("created") and record.get("state"))


class Controller:
    def __init__(self, store: Store, job: JobConfig, settings: Settings, *,
                 ident: str | None = None, lease_s: float = 5.0):
        self.store, self.job, self.s = store, job, settings
        self.ident = ident or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.lease_s = lease_s
        self.leading = False
        self.checkpoint_dir = job.resolved_checkpoint_dir
        self.journal = Path(job.resolved_run_dir) / "controller.json"
        self._journal = Rewritten(self.journal, "the journal")
        self._journaled: str | None = None
        self._led = False  # this controller has seen the job's whole record (see `_rebuild`)
        self._latest_shown: int | None = None
        self._isolated_said: dict[str, str] = {}  # node -> the refusal said (`_say_isolated`)
        self.snapshot_watch = SnapshotWatch(store)
        self.checkpoints = CheckpointView(self.checkpoint_dir, store)
        self.observer = Observer(store, settings, self.checkpoint_dir, self.checkpoints)
        self.event_log = EventLog(store, Path(job.resolved_run_dir) / "events.jsonl")
        self.waker = wake.Waker(store, wake.CONTROLLER, paced=True)  # nodes may publish
        self.relay = Relay(store, lambda kind, message, **f: self._event(
            kind, message, send=False, **f), holder=self.ident)

    def run(self, exit_when_done: bool = False) -> str | None:
        """Reconcile until the job ends (with `exit_when_done`) or forever; its final state."""
        while True:
            started = time.monotonic()
            state = self.tick()
            if exit_when_done and state in TERMINAL and not self.relay.agents_left():
                return state  # once the agents' goodbyes are relayed (or DRAIN_S passed)
            # Sooner when an agent's word comes (a rank exited, a node's state changed, a
            # rendezvous port to relay) or this tick set a plan (controller/store/wake.py).
            self.waker.wait(max(TICK_S - (time.monotonic() - started), 0.0))

    def tick(self) -> str | None:
        """One pass: hold the lease, then observe, decide, apply. The job's state, if leading."""
        try:
            leading = self.store.fence.hold_lease(self.ident, self.lease_s)
        except StoreUnavailable as e:
            if self.leading:
                log.warning("lost Redis; acting no more until it answers: %s", e)
            self.leading = False
            self.event_log.forget()
            self.relay.forget()
            return None
        if leading and not self.leading:
            self._event("leader", f"controller {self.ident} leads", send=False)  # sent below
        self.leading = leading
        if not leading:
            self.event_log.forget()  # whoever leads appends meanwhile
            self.relay.forget()  # and relays: its cursors are in the store
            return None
        try:
            self.store.flush_events()  # what an outage held back, before anything new
            obs = self.observe()
            self._say_refused_names()
            self._say_isolated()
            decision = decide(obs, self.s)
            # Redis restarted empty while this tick read it: the decision stands on what the
            # restart half erased (a whole record, then no nodes) and is not applied.
            if not whole(self.store.job_record()):
                log.warning("Redis lost the job record under this tick; its decision is "
                            "dropped and the next tick rebuilds from the journal")
                return None
            if not self.apply(decision, obs):
                return None  # refused: another controller leads, or none does
            self.event_log.mirror()  # this tick's events too: the last tick's are on disk
            return decision.job.get("state", obs.job.state)
        except StoreUnavailable as e:
            log.warning("Redis unavailable mid-tick; retrying: %s", e)
            return None

    def release(self) -> None:
        self.waker.close()
        self.observer.close()
        with contextlib.suppress(StoreUnavailable):
            self.store.fence.release_lease(self.ident)

    def observe(self) -> Observed:
        record = self.store.job_record()
        if not whole(record):  # none, or a retried write landed in a Redis that restarted
            record = self._rebuild()
        self._led = True
        return self.observer.observe(record, self.relay)

    def _say_refused_names(self) -> None:
        """Once each: a name read from Redis that is no node name, whose records the store
        skipped (written with an agent's credentials, not by an agent: it checks its own), and
        a plan or exit record the store refused (the line names its field)."""
        for name in self.store.names.take():
            self._event("name_refused", f"a node named {name} is ignored: not a node name "
                        f"({RULE}); its records in Redis are skipped", send=False)
        for line in self.store.records.take():  # the contract's records (decode.checked)
            self._event("record_refused", f"a record in Redis is ignored: {line}", send=False)

    def _say_isolated(self) -> None:
        """Once each: a node that advertises loopback while others run on other hosts is never
        planned on; the event says how to fix it, and its agent is told (it leaves with that
        line: an agent's credentials may not read the other nodes' records to find out)."""
        for node, why in sorted(self.observer.isolated.items()):
            if self._isolated_said.get(node) != why:
                self._event("node_refused", why, send=False, node=node)
                self.store.push_command(node, {"kind": "refused", "why": why})
        self._isolated_said = dict(self.observer.isolated)

    # --- apply ---------------------------------------------------------------------------------

    def apply(self, d: Decision, obs: Observed) -> bool:
        """Carry out `d`: the checkpoints it sets aside (on disk, first: the plan relies on
        it), then everything it writes, events included, as one transaction that lands only
        while this controller holds the lease (controller/store/fence.py). False: refused
        there, as another controller leads or none does; the decision is dropped whole, no
        journal written, and this controller tries for the lease next tick as a standby."""
        for step, why in d.set_aside:  # before anything else: the plan relies on it
            try:
                self.checkpoints.set_aside(step, why, by=f"controller {self.ident}")
            except OSError as e:  # try again next tick; plan nothing that could load it
                log.warning("cannot set aside the checkpoint of step %d: %s", step, e)
                return True
        b = Batch()
        for node, reason in dict(d.exclude).items():  # its cause: whether forgive.py may lift it
            self.store.exclude(node, reason, by=f"controller {self.ident}",
                               cause=d.causes.get(node, ""), batch=b)
        for node, record in d.operator_exclude:
            self.store.exclude(node, **record, batch=b)
        for node in d.include:
            self.store.include(node, batch=b)
        if d.control is not None:
            self.store.set_control(d.control, batch=b)
        for node, command in d.commands:
            self.store.push_command(node, command, batch=b)
        if d.plan is not None:
            new = d.plan["action"] == "run" and (
                obs.plan is None or d.plan["generation"] != obs.plan["generation"])
            if new:
                d.plan["exits_from"] = self.store.last_exit_id()
                self.store.summaries.keep_rows(d.plan["nodes"], batch=b)
            self.store.set_plan(d.plan, batch=b)
        if obs.latest_step != self._latest_shown:  # None (all set aside) deletes it
            d.job["latest_checkpoint"] = obs.latest_step  # for `optimus job status`
        if obs.plan and obs.plan.get("action") == "run" and obs.job.state in ACTIVE:
            self.snapshot_watch.check(obs.plan, d.job)  # memory_snapshot, the point to align on
        if d.job:
            self.store.update_job(d.job, batch=b)
        for kind, message, fields in d.events:
            self._event(kind, message, send=False, batch=b, **fields)
        self.store.flush_events()  # what this tick said before it decided, first
        if not self.store.commit(b, self.ident):
            log.warning("the leader lease moved on before this controller's decision landed: "
                        "nothing of it is written (%d event(s) dropped); acting as a standby",
                        len(b.events))
            self.leading = False
            self.event_log.forget()
            self.relay.forget()
            return False
        self._latest_shown = obs.latest_step
        if d.plan is not None:
            self.waker.poke()  # what the plan starts or stops is judged next, not a tick later
        if (set(d.job) - VOLATILE or d.plan is not None or d.exclude or d.operator_exclude
                or d.include or d.control is not None or self._journal.failing):
            self._write_journal()
        return True

    def _event(self, kind: str, message: str, send: bool = True, batch: Batch | None = None,
               **fields) -> None:
        """An event; an operator's request is recorded under the operator's name (`actor`).
        Unsent, it waits in the store's queue for the next flush; a decision's, in its `batch`."""
        log.info("%s: %s", kind, message)
        actor = fields.pop("actor", "controller")
        self.store.queue_event(actor, kind, message, batch=batch, controller=self.ident,
                               **fields)
        if send:
            self.store.flush_events()

    # --- the journal and rebuilding from it ----------------------------------------------------

    def _write_journal(self) -> None:
        """On every change that matters after a loss of Redis: not on progress bookkeeping;
        and every tick while the disk refuses it (controller/disk.py), said once each way."""
        record = {k: v for k, v in self.store.job_record().items() if k not in VOLATILE}
        if not whole(record):  # Redis restarted empty under this tick: the journal keeps the
            return  # last good state, which the next tick rebuilds from
        state = {"job": record, "plan": self.store.plan(), "excluded": self.store.excluded(),
                 "control": self.store.control()}
        text = json.dumps(state, indent=1, sort_keys=True)
        if text == self._journaled and not self._journal.failing:
            return
        turn = self._journal.write(text.encode())
        if self._journal.failing is None:
            self._journaled = text
        if turn is not None:
            self._event("disk", f"controller {self.ident} {turn.text}" + (
                "" if turn.ok else "; it supervises on from Redis and tries again every tick"),
                ok=turn.ok, path=str(self.journal))

    def _rebuild(self) -> dict[str, str]:
        """No whole job record in Redis: a new job, or Redis restarted empty. Restore from the
        journal and wait for the agents to report. A journal whose job ended is a new job's
        start, unless this controller led that job (Redis lost while it waited for the agents'
        goodbyes: the job stays ended, not run again). What writes the store's retries carried
        across the restart left (a plan, a few job fields, even a state) is newer than the
        journal and kept over it; a tick that found the record gone before it applied its
        decision wrote nothing (`tick`)."""
        planted, planted_plan = self.store.job_record(), self.store.plan()
        try:
            journal = read_journal(self.journal)
        except ConfigError as e:
            self._event("journal_refused", f"{e}; the job goes on without it", send=False)
            journal = {}
        record = journal.get("job") or {}
        if not record or (record.get("state") in TERMINAL and not self._led):
            fresh = {"state": "PENDING", "reason": "waiting for the first generation",
                     "name": self.job.name, "nodes": self.s.nodes,
                     "ranks_per_node": self.s.ranks_per_node, "created": time.time(),
                     "restarts": 0, "generation": -1}
            self.store.update_job(fresh)
            self._event("submitted", f"job {self.job.name}: {self.s.nodes} node(s) x "
                        f"{self.s.ranks_per_node} rank(s)")
            return self.store.job_record()
        record = {**{k: v for k, v in record.items() if k not in ("failure_since", "next_plan_at")},
                  **planted}
        record.setdefault("created", time.time())  # a journal older than the field: whole now
        for node, entry in journal.get("excluded", {}).items():
            self.store.exclude(node, **{"reason": "restored", "by": "?", **entry})
        if journal.get("control"):
            self.store.set_control(journal["control"])
        plan = planted_plan or journal.get("plan")
        if plan:
            plan = {**plan, "exits_from": "0"}  # the exits stream was lost with Redis
            self.store.set_plan(plan)
            # its cursors went with Redis too; the agents of a job that ended are not waited for
            self.relay.forget()
            deadline = time.time() + (0 if record.get("state") in TERMINAL
                                      else self.s.agent_timeout_s)
            while time.time() < deadline:  # agents re-register within one interval
                self.relay.run(plan)
                beats = self.store.agent_beats()
                if all(n in beats for n in plan["nodes"]):
                    break
                time.sleep(TICK_S)
        self.store.update_job(record)
        reporting = sorted(self.store.agent_beats())
        self._event("rebuilt", f"Redis held no state for job {self.job.name}; rebuilt from "
                    f"{self.journal} (state {record.get('state')}, generation "
                    f"{record.get('generation')}) and {len(reporting)} agent(s) reporting")
        return self.store.job_record()
