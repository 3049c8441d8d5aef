"""What the controller sees each tick: the job, its plan, the nodes and their ranks.

`Observer.observe` turns the store (and the checkpoint folder) into an `Observed` for `decide`:
for a running generation a fixed number of round trips, each O(nodes that matter); between
generations every node. It keeps what it learnt across ticks: when each planned node was first
found with no beat, the plan's index of nodes, the spares' addresses, and the prober of silent
agents (controller/common/probe.py). Split from controller.py, which applies the decisions.
"""

from __future__ import annotations

import dataclasses
import json
import time

from controller.common.probe import Prober
from controller.common.reach import isolated
from controller.control import fabric, forgive, records
from controller.control.checkpoints import CheckpointView
from controller.control.decide import ACTIVE, JobView, NodeView, Observed, Overdue, Settings
from controller.control.detect import in_long_phase, stall_threshold
from controller.control.relay import Relay
from controller.store.store import Store
from optimus.checkpoint.manifest import committed_steps

HANG_CANDIDATES = 16  # nodes read in full when a hang is suspected; more: nobody stands out
STRAGGLER_CHECK_S = 5.0  # how often the compute scores (one entry per node) are read
REFUSAL_CHECK_S = 5.0  # how often the plan's agents are asked whether they refused it
MESH_CHECK_S = 2.0  # how often the ring's agents' mesh reports are read (fabric.py)


class Observer:
    def __init__(self, store: Store, settings: Settings, checkpoint_dir, checkpoints:
                 CheckpointView):
        self.store, self.s = store, settings
        self.checkpoint_dir, self.checkpoints = checkpoint_dir, checkpoints
        self._unbeaten: dict[tuple[int, str], float] = {}  # (generation, node): first missed
        self._compute_read = 0.0
        self._index_key: tuple | None = None
        self._index: dict[str, int] = {}
        self._refusals_read = 0.0
        # (registrations, excluded, unhealthy) when the spares were last read: any change, a
        # node registering, back under its name, included again or healthy again, reads them.
        self._agents_seen: tuple | None = None
        self._eligible: frozenset[str] = frozenset()  # could be spares, as _spares last read
        self._unhealthy_seen: frozenset = frozenset()
        self.prober = Prober()  # whether a silent agent's host still takes a connection
        self._watched: tuple | None = None  # (generation, _agents_seen) the prober was given
        self._addresses: dict[str, object] = {}  # registered node -> its snapshot_addr
        self._owners: dict[str, str] = {}  # address -> the node whose record holds it
        self._mesh_read = 0.0
        self._mesh: tuple = (None, {}, frozenset())  # (generation, reports, refused)
        # Nodes that advertise loopback while others run elsewhere (controller/common/reach.py):
        # never planned on; the controller says each once and tells its agent.
        self.isolated: dict[str, str] = {}

    def close(self) -> None:
        self.prober.close()

    def observe(self, record: dict, relay: Relay) -> Observed:
        """The job as `record` (the job record, read this tick) and the store show it; `relay`
        first carries what the nodes wrote under their own keys."""
        now = time.time()
        job = records.job_view(record)
        if job.progress_at is not None:
            job = dataclasses.replace(job, progress_at=self._excused(job.progress_at))
        plan = self.store.plan()
        relay.run(plan)  # what the nodes wrote under their own keys, before it is read
        entries, raw, control = self.store.operator_view(job.requests_seen)
        excluded = {n: e["reason"] for n, e in entries.items()}
        draining = frozenset(n for n, e in entries.items() if e.get("mode") == "drain")
        requests = [records.request(i, r) for i, r in raw]
        if job.state in ACTIVE and plan is not None and plan["action"] == "run":
            requests = self._refusals(job, plan) + requests
        operator = {"requests": requests, "control": control, "draining": draining,
                    "known_nodes": frozenset(self.store.nodes()) if requests else frozenset(),
                    "lost": self._lost(entries, now)}
        steps = committed_steps(self.checkpoint_dir)
        latest = steps[-1] if steps else None
        if job.state in ACTIVE and plan is not None and plan["action"] == "run":
            return self._observe_running(now, job, plan, excluded, latest, operator)
        latest, skipped, suspect = self.checkpoints.resume_point(job, steps)
        unhealthy, idle = self._unhealthy(self.store.summaries.sweep([]).unhealthy)
        # Planning, draining, stopping: every node, once per tick (no generation is running,
        # or it is being torn down; at scale this is the rare path).
        nodes = self._node_views(now, excluded)
        return Observed(now=now, job=job, plan=plan, nodes=nodes, latest_step=latest,
                        skipped=skipped, suspect_steps=suspect, unhealthy=unhealthy,
                        unhealthy_idle=idle, snapshots=self.store.reports.snapshots(),
                        distrust=self.checkpoints.distrust,
                        excluded=excluded, **operator)

    def _lost(self, entries: dict[str, dict], now: float) -> dict[str, NodeView]:
        """The nodes excluded as lost (their exclusion's `cause`; a record without one is
        not), as their agents show them now, for the rule that lets them back
        (controller/control/forgive.py): while there are any, one round trip for their agents'
        beats, and two more for the records of those that beat again (a dead node's never
        does)."""
        at = {n: t for n, e in entries.items()
              if e.get("cause") == forgive.LOST and (t := records.number(e.get("time")))}
        if not at:
            return {}
        names = sorted(at)
        beats = self.store.summaries.sweep(names).agent_beats
        beating = [n for n in names if beats.get(n)
                   and now - self._excused(beats[n]) <= self.s.agent_silence_s]
        info = self.store.node_info(beating)
        status = self.store.agent_status(beating) if beating else {}
        lost = {}
        for name in names:
            i, st, beat = info.get(name, {}), status.get(name, {}), beats.get(name)
            age = now - self._excused(beat) if beat else None
            live = records.count(st.get("live_ranks"))  # unreadable: not known to be idle
            lost[name] = NodeView(
                name=name, host=i.get("host", name),
                alive=age is not None and age <= self.s.agent_timeout_s
                and st.get("state") != "gone",
                healthy=i.get("health") == "ok" and name not in self.isolated,
                health=records.health(i),
                excluded=entries[name].get("reason", ""), excluded_at=at[name],
                live_ranks=1 if live is None else live, last_beat=beat or 0.0,
                silent=age is None or age > self.s.agent_silence_s,
                checked_at=records.number(i.get("ok_at")))
        return lost

    def _node_views(self, now: float, excluded: dict) -> dict[str, NodeView]:
        """Every registered node as its agent shows it: a round trip each for the records,
        beats and statuses."""
        info = self.store.nodes()
        refused = self._isolated(info)
        beats = self.store.agent_beats()
        names = sorted(set(info) | set(beats))
        status = self.store.agent_status(names)
        # an agent that refused itself at registration has said so, and left
        self.isolated = {n: why for n, why in refused.items()
                         if status.get(n, {}).get("state") != "gone"}
        # A node whose agent is silent and whose host refused (or no longer answers) a
        # connection to it is not alive (probe.py): a node of the last plan, whose ranks died
        # with it, so that the next generation does not wait agent_timeout_s for them; a spare,
        # so that it is not chosen to replace one.
        gone = self.prober.unreachable({
            n: info.get(n, {}).get("snapshot_addr") or self._addresses.get(n) for n in names
            if n in beats and now - self._excused(beats[n]) > self.s.agent_silence_s})
        nodes = {}
        for name in names:
            st, node_info = status.get(name, {}), info.get(name, {})
            nodes[name] = NodeView(
                name=name, host=node_info.get("host", st.get("host", name)),
                alive=(name in beats and now - self._excused(beats[name])
                       <= self.s.agent_timeout_s and st.get("state") != "gone"
                       and name not in gone),
                healthy=node_info.get("health") == "ok" and name not in refused,
                health=refused.get(name) or node_info.get("health_detail",
                                                          node_info.get("health", "unknown")),
                excluded=excluded.get(name),
                generation=int(st["generation"]) if st.get("generation") else None,
                live_ranks=int(st.get("live_ranks", 0)), last_beat=beats.get(name, 0.0),
                silent=name in beats and now - self._excused(beats[name]) > self.s.agent_silence_s,
                snapshot_addr=node_info.get("snapshot_addr", ""),
                next_port=records.port(st.get("next_port")),
                failed_saves=records.count(st.get("failed_saves")),
                launch=records.count(st.get("replica_launch")),
                standby=records.count(st.get("standby")) or 0)
        return nodes

    def _refusals(self, job: JobView, plan: dict) -> list:
        """An agent that cannot run this generation (the job's fault, e.g. float8 where it
        cannot run) says so in its own record (`refused`, controller/node/checks.py): a stop
        of the job, with its reason, as if an operator had asked. Read every REFUSAL_CHECK_S,
        one field per plan node; not once the job is stopping. First in the tick's requests,
        under the last request's id: `requests_seen` moves only with operators' requests.
        A refusal on the mesh check (cause "network": a peer out of reach) is no stop: the
        node's fault or its peer's, which fabric.py judges from every agent's report."""
        if job.desired == "stop" or time.monotonic() - self._refusals_read < REFUSAL_CHECK_S:
            return []
        self._refusals_read = time.monotonic()
        for node, raw in sorted(self.store.agent_field(plan["nodes"], "refused").items()):
            try:
                said = json.loads(raw) if raw else None
            except ValueError:
                continue
            if (isinstance(said, dict) and said.get("generation") == plan["generation"]
                    and said.get("cause") != "network"):  # a mesh check's: fabric.py's to judge
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
        sweep = self.store.summaries.sweep(plan["nodes"], plan["ranks_per_node"])
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
            candidates = [n for n in self.store.summaries.behind(sweep.max_step) if n in index] or [
                n for n in self.store.summaries.outside_collectives(limit=HANG_CANDIDATES + 1)
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
        stacks = self.store.reports.stacks(gen) if job.hang_since is not None else {}
        resumed = self.checkpoints.report(plan) if job.resumed_gen != gen else None
        compute = None
        if time.monotonic() - self._compute_read >= STRAGGLER_CHECK_S:
            self._compute_read = time.monotonic()
            compute = self.store.summaries.compute_scores()
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
        unreachable = self._unreachable(plan, agent_beats, now)
        mesh, mesh_refused = self._mesh_reports(plan)
        spare_count = (None if compute is None else
                       len(self._eligible - set(plan["nodes"])))  # for watching.stragglers
        overdue = self._overdue(plan, now, sweep.agent_beats)
        # Replicas that carry on: a replica to let go, relaunch or let back in is judged on the
        # nodes' own views (its nodes' launch and standbys, the spares, the ports offered):
        # read only then, as between generations (an operator's exclusion takes one out).
        quorum = plan.get("quorum") if self.s.carry_on else None
        silent = any(now - b > self.s.agent_silence_s for b in agent_beats.values())
        nodes = self._node_views(now, excluded) if quorum and (
            len(quorum["members"]) < self.s.replicas or overdue or silent or stalled_job
            or any(e.failed or e.ok for e in exits)  # ok: the end, or a late member
            or operator["requests"] or any(n in excluded for n in plan["nodes"])) else {}
        return Observed(now=now, job=job, plan=plan, nodes=nodes, exits=exits,
                        overdue=overdue,
                        latest_step=latest,
                        agent_beats=agent_beats, unreachable=unreachable,
                        addresses=self._owners, mesh=mesh, mesh_refused=mesh_refused,
                        progress=sweep.max_step,
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
        refused = self._isolated(info)
        self._eligible = frozenset(
            n for n, i in info.items() if n not in excluded and i.get("health") == "ok"
            and n not in refused
            and n in beats and now - self._excused(beats[n]) <= self.s.agent_timeout_s)
        return {n: i["snapshot_addr"] for n, i in sorted(info.items())
                if isinstance(i.get("snapshot_addr"), str) and i["snapshot_addr"]
                and (n in in_plan or n in self._eligible)}

    def _isolated(self, info: dict[str, dict]) -> dict[str, str]:
        """The registered nodes no other host can reach (controller/common/reach.py), kept in
        `self.isolated` for the controller to say."""
        found = {n: why for n, i in info.items() if (why := isolated(n, i, info))}
        self.isolated = found
        return found

    def _unreachable(self, plan: dict, agent_beats: dict[str, float],
                     now: float) -> dict[str, str]:
        """Plan nodes whose agents are silent and whose hosts take no connection to them
        (probe.py). The registered nodes' addresses (the plan's and the spares': a spare may
        replace a node) are read when the plan or the registrations change, and reached once
        in the background."""
        key = (plan["generation"], self._agents_seen)
        if key != self._watched:
            self._watched = key
            infos = self.store.nodes()
            self._addresses = {n: i.get("snapshot_addr") for n, i in infos.items()}
            self._owners = fabric.owners(infos)  # whose address a rank could not reach
            self.prober.watch(self._addresses)
        return self.prober.unreachable({n: self._addresses.get(n) for n, b in agent_beats.items()
                                        if now - b > self.s.agent_silence_s})

    def _mesh_reports(self, plan: dict) -> tuple[dict[str, tuple[str, ...]], frozenset[str]]:
        """The ring's agents' mesh reports of this generation (controller/node/mesh.py, checked
        by fabric.mesh_report): node -> the neighbours it cannot reach, and the plan's nodes
        that refused to launch on it. Read every MESH_CHECK_S, one field per ring member (as
        the refusals are), and kept between reads."""
        gen = plan["generation"]
        if self._mesh[0] != gen:
            self._mesh, self._mesh_read = (gen, {}, frozenset()), 0.0
        if time.monotonic() - self._mesh_read >= MESH_CHECK_S:
            self._mesh_read = time.monotonic()
            ring = fabric.Ring.of(plan)
            said = {n: r for n, raw in self.store.agent_field(list(ring.members),
                                                             fabric.MESH).items()
                    if (r := fabric.mesh_report(raw, n, ring, gen)) is not None}
            self._mesh = (gen, {n: peers for n, (peers, _) in said.items() if peers},
                          frozenset(n for n, (_, refused) in said.items() if refused))
        return self._mesh[1], self._mesh[2]

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
