"""The controller: a reconcile loop over one job, with a leader lease.

    optimus controller JOB --nodes N --ranks-per-node R [--redis URL]

Every tick (0.25 s) the controller that holds the lease observes the job (`observe`: the job
record, the plan, agents, exits of this generation, overdue heartbeats, the latest committed
checkpoint), asks `decide` what to do, and applies it (`apply`: exclusions, then the plan, then
the job record, then events). Standbys renew nothing and try for the lease each tick; when the
leader dies, one takes over within a lease period and carries on from the store, since that is
where all the state is. The ranks notice nothing: only a new plan would touch them.

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
import dataclasses
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path

from controller.control import records
from controller.control.checkpoints import CheckpointView
from controller.control.decide import (
    ACTIVE,
    TERMINAL,
    Decision,
    JobView,
    NodeView,
    Observed,
    Overdue,
    Settings,
    decide,
)
from controller.control.detect import in_long_phase, stall_threshold
from controller.control.event_log import EventLog
from controller.control.journal import read_journal
from controller.control.relay import Relay
from controller.control.snapshot_watch import SnapshotWatch
from controller.disk import Rewritten
from controller.store import wake
from controller.store.names import RULE
from controller.store.store import Store, StoreUnavailable
from optimus.checkpoint.manifest import committed_steps
from optimus.config import ConfigError, JobConfig

log = logging.getLogger("optimus.controller")

TICK_S = 0.25
HANG_CANDIDATES = 16  # nodes read in full when a hang is suspected; more: nobody stands out
STRAGGLER_CHECK_S = 5.0  # how often the compute scores (one entry per node) are read
REFUSAL_CHECK_S = 5.0  # how often the plan's agents are asked whether they refused it
# Job record fields that change every step: not worth a journal write (and an fsync) each.
VOLATILE = frozenset({"progress_gen", "progress_step", "progress_at", "progress_moves",
                      "step_times", "hang_since", "failure_since", "latest_checkpoint",
                      "memory_snapshot"})


class Controller:
    def __init__(self, store: Store, job: JobConfig, settings: Settings, *,
                 ident: str | None = None, lease_s: float = 5.0):
        self.store, self.job, self.s = store, job, settings
        self._unbeaten: dict[tuple[int, str], float] = {}  # (generation, node): first missed
        self.ident = ident or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.lease_s = lease_s
        self.leading = False
        self.checkpoint_dir = job.resolved_checkpoint_dir
        self.journal = Path(job.resolved_run_dir) / "controller.json"
        self._journal = Rewritten(self.journal, "the journal")
        self._journaled: str | None = None
        self._compute_read = 0.0
        self._index_key: tuple | None = None
        self._index: dict[str, int] = {}
        self._latest_shown: int | None = None
        self._refusals_read = 0.0
        # (registrations, excluded, unhealthy) when the spares were last read: any change, a
        # node registering, back under its name, included again or healthy again, reads them.
        self._agents_seen: tuple | None = None
        self._eligible: frozenset[str] = frozenset()  # could be spares, as _spares last read
        self._unhealthy_seen: frozenset = frozenset()
        self.snapshot_watch = SnapshotWatch(store)
        self.checkpoints = CheckpointView(self.checkpoint_dir, store)
        self.event_log = EventLog(store, Path(job.resolved_run_dir) / "events.jsonl")
        self.waker = wake.Waker(store, wake.CONTROLLER)
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
            leading = self.store.hold_lease(self.ident, self.lease_s)
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
            decision = decide(obs, self.s)
            self.apply(decision, obs)
            self.event_log.mirror()  # this tick's events too: the last tick's are on disk
            return decision.job.get("state", obs.job.state)
        except StoreUnavailable as e:
            log.warning("Redis unavailable mid-tick; retrying: %s", e)
            return None

    def release(self) -> None:
        self.waker.close()
        with contextlib.suppress(StoreUnavailable):
            self.store.release_lease(self.ident)

    # --- observe -------------------------------------------------------------------------------

    def observe(self) -> Observed:
        record = self.store.job_record()
        if not record.get("state"):  # none, or a retried write landed in a Redis that restarted
            record = self._rebuild()
        now = time.time()
        job = records.job_view(record)
        if job.progress_at is not None:
            job = dataclasses.replace(job, progress_at=self._excused(job.progress_at))
        plan = self.store.plan()
        self.relay.run(plan)  # what the nodes wrote under their own keys, before it is read
        entries, raw, control = self.store.operator_view(job.requests_seen)
        excluded = {n: e["reason"] for n, e in entries.items()}
        draining = frozenset(n for n, e in entries.items() if e.get("mode") == "drain")
        requests = [records.request(i, r) for i, r in raw]
        if job.state in ACTIVE and plan is not None and plan["action"] == "run":
            requests = self._refusals(job, plan) + requests
        operator = {"requests": requests, "control": control, "draining": draining,
                    "known_nodes": frozenset(self.store.nodes()) if requests else frozenset()}
        steps = committed_steps(self.checkpoint_dir)
        latest = steps[-1] if steps else None
        if job.state in ACTIVE and plan is not None and plan["action"] == "run":
            return self._observe_running(now, job, plan, excluded, latest, operator)
        latest, skipped, suspect = self.checkpoints.resume_point(job, steps)
        unhealthy, idle = self._unhealthy(self.store.sweep([]).unhealthy)
        # Planning, draining, stopping: every node, once per tick (no generation is running,
        # or it is being torn down; at scale this is the rare path).
        info = self.store.nodes()
        beats = self.store.agent_beats()
        names = sorted(set(info) | set(beats))
        status = self.store.agent_status(names)
        nodes = {}
        for name in names:
            st, node_info = status.get(name, {}), info.get(name, {})
            nodes[name] = NodeView(
                name=name, host=node_info.get("host", st.get("host", name)),
                alive=(name in beats and now - self._excused(beats[name])
                       <= self.s.agent_timeout_s and st.get("state") != "gone"),
                healthy=node_info.get("health") == "ok",
                health=node_info.get("health_detail", node_info.get("health", "unknown")),
                excluded=excluded.get(name),
                generation=int(st["generation"]) if st.get("generation") else None,
                live_ranks=int(st.get("live_ranks", 0)), last_beat=beats.get(name, 0.0),
                snapshot_addr=node_info.get("snapshot_addr", ""),
                failed_saves=records.count(st.get("failed_saves")))
        return Observed(now=now, job=job, plan=plan, nodes=nodes, latest_step=latest,
                        skipped=skipped, suspect_steps=suspect, unhealthy=unhealthy,
                        unhealthy_idle=idle, snapshots=self.store.snapshots(),
                        distrust=self.checkpoints.distrust,
                        excluded=excluded, **operator)

    def _refusals(self, job: JobView, plan: dict) -> list:
        """An agent that cannot run this generation (the job's fault, e.g. float8 where it
        cannot run) says so in its own record (`refused`, controller/node/checks.py): a stop
        of the job, with its reason, as if an operator had asked. Read every REFUSAL_CHECK_S,
        one field per plan node; not once the job is stopping. First in the tick's requests,
        under the last request's id: `requests_seen` moves only with operators' requests."""
        if job.desired == "stop" or time.monotonic() - self._refusals_read < REFUSAL_CHECK_S:
            return []
        self._refusals_read = time.monotonic()
        for node, raw in sorted(self.store.agent_field(plan["nodes"], "refused").items()):
            try:
                said = json.loads(raw) if raw else None
            except ValueError:
                continue
            if isinstance(said, dict) and said.get("generation") == plan["generation"]:
                return [records.request(job.requests_seen, {
                    "action": "stop", "actor": f"agent:{node}",
                    "host": str(said.get("host", ""))[:253],
                    "reason": str(said.get("reason", ""))[:2000]})]
        return []

    def _unhealthy(self, nodes: list[str]) -> tuple[dict[str, str], frozenset[str]]:
        """Nodes whose last health check failed: why; and those of them on which no rank ran
        since their last passing check (their bad tile computed nothing of this job since)."""
        info = self.store.node_info(nodes)
        return ({n: records.health(i) for n, i in info.items()},
                frozenset(n for n, i in info.items() if i.get("ran_since_ok") is False))

    def _observe_running(self, now: float, job: JobView, plan: dict, excluded: dict,
                         latest: int | None, operator: dict) -> Observed:
        """A running generation: a fixed number of round trips, each O(nodes that matter) but
        the agents' beat times (one ZMSCORE over the plan's nodes)."""
        gen = plan["generation"]
        sweep = self.store.sweep(plan["nodes"], plan["ranks_per_node"])
        unhealthy, idle = self._unhealthy(sweep.unhealthy)
        self._unhealthy_seen = frozenset(sweep.unhealthy)
        exits = [records.exit_record(r) for _, r in self.store.exits(plan.get("exits_from", "0"))
                 if r.get("generation") == gen]
        if sum(e.ok for e in exits) >= plan["world_size"]:  # read after the exits, which
            steps = committed_steps(self.checkpoint_dir)  # follow the final commit
            latest = steps[-1] if steps else None
        index = self._node_index(plan)
        suspects = self.store.rank_beats_of([n for n in sweep.nonfinite if n in index])
        waiting, long_phase = 0, False
        # Past the least bound a stall may be judged by (detect.stall_threshold): read who
        # holds it up, and whether a rank saves or evaluates (its own, longer bound).
        stalled_job = (job.progress_at is not None and job.progress_gen == gen and now
                       - job.progress_at > min(stall_threshold(job, self.s),
                                               self.s.startup_timeout_s))
        if stalled_job and sweep.max_step is not None:
            # Only the plan's members: a lost node's rows may outlive it until the next plan.
            candidates = [n for n in self.store.behind(sweep.max_step) if n in index] or [
                n for n in self.store.outside_collectives(limit=HANG_CANDIDATES + 1)
                if n in index]
            if len(candidates) <= HANG_CANDIDATES:  # more: nobody stands out
                waiting = len(plan["nodes"]) - len(candidates)
                suspects.update(self.store.rank_beats_of(candidates))
            else:  # but a sample says whether they save or evaluate (every rank, at scale)
                long_phase = in_long_phase(self.store.rank_beats_of(candidates[:2]), gen)
        # Only this generation's beats: a node's older ranks said nothing about this one.
        suspects = {n: {lr: b for lr, b in beats.items() if b.get("generation") == gen}
                    for n, beats in suspects.items()}
        long_phase = long_phase or in_long_phase(suspects, gen)
        stacks = self.store.stacks(gen) if job.hang_since is not None else {}
        resumed = self.checkpoints.report(plan) if job.resumed_gen != gen else None
        compute = None
        if time.monotonic() - self._compute_read >= STRAGGLER_CHECK_S:
            self._compute_read = time.monotonic()
            compute = self.store.compute_scores()
        agent_beats = {n: None if b is None else self._excused(b)
                       for n, b in sweep.agent_beats.items()}
        # A planned node with no beat at all: it beat before the plan named it, so Redis lost
        # the beat (restarted empty after this tick read the job record: the next tick
        # rebuilds) or a new leader's relay has not mirrored it yet. It is judged silent from
        # when this controller first found it so, not "for ever" (which excluded a healthy
        # node at once when Redis restarted mid-tick).
        self._unbeaten = {n: t for n, t in self._unbeaten.items()
                          if n[0] == gen and agent_beats.get(n[1], 0) is None}
        for n, b in agent_beats.items():
            if b is None:
                agent_beats[n] = self._unbeaten.setdefault((gen, n), now)
        spares = self._spares(plan, excluded, now, compute is not None)
        spare_count = (None if compute is None else
                       len(self._eligible - set(plan["nodes"])))  # for watching.stragglers
        return Observed(now=now, job=job, plan=plan, nodes={}, exits=exits,
                        overdue=self._overdue(plan, now, sweep.agent_beats),
                        latest_step=latest,
                        agent_beats=agent_beats, progress=sweep.max_step,
                        unhealthy=unhealthy, unhealthy_idle=idle,
                        nonfinite=frozenset(sweep.nonfinite),
                        suspects=suspects, waiting_in_collective=waiting, stacks=stacks,
                        long_phase=long_phase,
                        compute=compute, spare_count=spare_count, excluded=excluded,
                        resumed=resumed,
                        paused_nodes=sweep.paused_nodes, spares=spares,
                        **operator)

    def _spares(self, plan: dict, excluded: dict, now: float, due: bool) -> dict | None:
        """The snapshot addresses of the plan's nodes and of the spares, read when an agent
        registered, or the exclusions or the unhealthy nodes changed (checked every
        STRAGGLER_CHECK_S, one GET): a spare that arrives after the plan becomes a buddy
        (decide._rebuddy). None when not read. Keeps the nodes that could be spares
        (`self._eligible`: registered, healthy, beating, not excluded) for `spare_count`."""
        if not due:
            return None
        seen = (self.store.registrations(), frozenset(excluded), self._unhealthy_seen)
        if seen == self._agents_seen:
            return None
        self._agents_seen = seen
        in_plan = set(plan["nodes"])
        info, beats = self.store.nodes(), self.store.agent_beats()
        self._eligible = frozenset(
            n for n, i in info.items() if n not in excluded and i.get("health") == "ok"
            and n in beats and now - self._excused(beats[n]) <= self.s.agent_timeout_s)
        return {n: i["snapshot_addr"] for n, i in sorted(info.items())
                if isinstance(i.get("snapshot_addr"), str) and i["snapshot_addr"]
                and (n in in_plan or n in self._eligible)}

    def _overdue(self, plan: dict, now: float,
                 agent_beats: dict[str, float | None]) -> list[Overdue]:
        """The overdue ranks of late plan nodes, read in one round trip. A node's rank is
        `confirmed` overdue once its agent beat after the deadline (and still relays the old
        heartbeat); a rank with no heartbeat of this generation is past its startup timeout."""
        late = self.store.overdue(now)
        index = self._node_index(plan)
        late = {n: d for n, d in late.items() if n in index}
        found = []
        rpn = plan["ranks_per_node"]
        for node, beats in self.store.rank_beats_of(sorted(late)).items():
            first = index[node] * rpn
            confirmed = (agent_beats.get(node) or 0.0) > late[node]
            for local_rank in range(rpn):
                beat = beats.get(local_rank)
                if beat is None or beat.get("generation") != plan["generation"]:
                    found.append(Overdue(node, first + local_rank, "no heartbeat within "
                                         f"startup_timeout_s={self.s.startup_timeout_s:g}",
                                         late[node], confirmed))
                    continue
                age = now - self._excused(beat["time"])
                if age > self.s.heartbeat_timeout_s:
                    found.append(Overdue(node, first + local_rank,
                                         f"no heartbeat for {age:.1f} s (step {beat['step']}, "
                                         f"phase {beat['phase']})", beat["time"], confirmed))
        return found

    def _excused(self, t: float) -> float:
        """A time that silence is counted from: never before this controller last found Redis
        unreachable. A failover or an outage silences every agent at once (they cannot write);
        judged on the wall clock alone, it would look like every node lost."""
        return max(t, self.store.trouble_at)

    def _node_index(self, plan: dict) -> dict[str, int]:
        """Node -> node rank of the plan's generation (cached: plans are long at scale)."""
        key = (plan["generation"], plan.get("issued"))
        if self._index_key != key:
            self._index_key, self._index = key, {n: i for i, n in enumerate(plan["nodes"])}
        return self._index

    def _say_refused_names(self) -> None:
        """Once each: a name read from Redis that is no node name, whose records the store
        skipped (written with an agent's credentials, not by an agent: it checks its own)."""
        for name in self.store.names.take():
            self._event("name_refused", f"a node named {name} is ignored: not a node name "
                        f"({RULE}); its records in Redis are skipped", send=False)

    # --- apply ---------------------------------------------------------------------------------

    def apply(self, d: Decision, obs: Observed) -> None:
        for step, why in d.set_aside:  # before anything else: the plan relies on it
            try:
                self.checkpoints.set_aside(step, why, by=f"controller {self.ident}")
            except OSError as e:  # try again next tick; plan nothing that could load it
                log.warning("cannot set aside the checkpoint of step %d: %s", step, e)
                return
        for node, reason in dict(d.exclude).items():
            self.store.exclude(node, reason, by=f"controller {self.ident}")
        for node, record in d.operator_exclude:
            self.store.exclude(node, **record)
        for node in d.include:
            self.store.include(node)
        if d.control is not None:
            self.store.set_control(d.control)
        for node, command in d.commands:
            self.store.push_command(node, command)
        if d.plan is not None:
            new = d.plan["action"] == "run" and (
                obs.plan is None or d.plan["generation"] != obs.plan["generation"])
            if new:
                d.plan["exits_from"] = self.store.last_exit_id()
                self.store.keep_rows(d.plan["nodes"])
            self.store.set_plan(d.plan)
            self.waker.poke()  # what the plan starts or stops is judged next, not a tick later
        if obs.latest_step != self._latest_shown:  # None (all set aside) deletes it
            d.job["latest_checkpoint"] = obs.latest_step  # for `optimus job status`
            self._latest_shown = obs.latest_step
        if obs.plan and obs.plan.get("action") == "run" and obs.job.state in ACTIVE:
            self.snapshot_watch.check(obs.plan, d.job)  # memory_snapshot, the point to align on
        if d.job:
            self.store.update_job(d.job)
        for kind, message, fields in d.events:  # queued at once: an outage loses none
            self._event(kind, message, send=False, **fields)
        self.store.flush_events()
        if (set(d.job) - VOLATILE or d.plan is not None or d.exclude or d.operator_exclude
                or d.include or d.control is not None or self._journal.failing):
            self._write_journal()

    def _event(self, kind: str, message: str, send: bool = True, **fields) -> None:
        """An event; an operator's request is recorded under the operator's name (`actor`).
        Unsent, it waits in the store's queue for the next flush."""
        log.info("%s: %s", kind, message)
        actor = fields.pop("actor", "controller")
        self.store.queue_event(actor, kind, message, controller=self.ident, **fields)
        if send:
            self.store.flush_events()

    # --- the journal and rebuilding from it ----------------------------------------------------

    def _write_journal(self) -> None:
        """On every change that matters after a loss of Redis: not on progress bookkeeping;
        and every tick while the disk refuses it (controller/disk.py), said once each way."""
        record = {k: v for k, v in self.store.job_record().items() if k not in VOLATILE}
        if not record.get("state"):  # Redis restarted empty under this tick: the journal keeps
            return  # the last good state, which the next tick rebuilds from
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
        """No job record in Redis: a new job, or Redis restarted empty (a write the retries
        carried across the restart may have left a few fields). Restore from the journal (if
        it holds a job that has not ended) and wait for the agents to report."""
        try:
            journal = read_journal(self.journal)
        except ConfigError as e:
            self._event("journal_refused", f"{e}; the job goes on without it", send=False)
            journal = {}
        record = journal.get("job") or {}
        if not record or record.get("state") in TERMINAL:
            fresh = {"state": "PENDING", "reason": "waiting for the first generation",
                     "name": self.job.name, "nodes": self.s.nodes,
                     "ranks_per_node": self.s.ranks_per_node, "created": time.time(),
                     "restarts": 0, "generation": -1}
            self.store.update_job(fresh)
            self._event("submitted", f"job {self.job.name}: {self.s.nodes} node(s) x "
                        f"{self.s.ranks_per_node} rank(s)")
            return self.store.job_record()
        for node, entry in journal.get("excluded", {}).items():
            self.store.exclude(node, **{"reason": "restored", "by": "?", **entry})
        if journal.get("control"):
            self.store.set_control(journal["control"])
        plan = journal.get("plan")
        if plan:
            plan = {**plan, "exits_from": "0"}  # the exits stream was lost with Redis
            self.store.set_plan(plan)
            deadline = time.time() + self.s.agent_timeout_s
            self.relay.forget()  # its cursors went with Redis too
            while time.time() < deadline:  # agents re-register within one interval
                self.relay.run(plan)
                beats = self.store.agent_beats()
                if all(n in beats for n in plan["nodes"]):
                    break
                time.sleep(TICK_S)
        self.store.update_job({k: v for k, v in record.items()
                               if k not in ("failure_since", "next_plan_at")})
        reporting = sorted(self.store.agent_beats())
        self._event("rebuilt", f"Redis held no state for job {self.job.name}; rebuilt from "
                    f"{self.journal} (state {record.get('state')}, generation "
                    f"{record.get('generation')}) and {len(reporting)} agent(s) reporting")
        return self.store.job_record()
