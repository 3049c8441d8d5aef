"""The controller's decisions: pure functions from what it observes to what it does.

`decide(observed, settings)` reads one snapshot (the job record, the plan, every node's agent,
this generation's rank exits, overdue heartbeats, the latest committed checkpoint) and returns a
`Decision`: fields of the job record to write, a new plan, nodes to exclude, events to record.
Nothing here touches Redis, a clock or a process, so every rule is unit-tested on its own
(tests/test_decide.py); `controller/controller.py` observes and applies.

Job states: PENDING -> RUNNING -> (RESTARTING -> RUNNING)* -> COMPLETED | FAILED | STOPPED, with
WAITING while too few healthy nodes are left for the layout and STOPPING while an operator's
stop drains the ranks. A plan's `action` tells agents what to do with its generation: "run",
"stop" (terminate the ranks) or "end" (terminate them and exit: the job is over).

Attribution. When a rank dies, its peers soon fail too (their collectives lose a partner), so
the first exit is not always the culprit. Evidence is primary when it names its own node: a
rank exit that is not a peer-connection error (a signal, a crash, an error of its own), an
overdue heartbeat (a frozen process), an agent gone silent (a lost node). Exits whose last
lines are peer-connection errors are collateral. Primary evidence is acted on at once, earliest
first; collateral alone waits `settle_s` (long enough for a lost node's agent to be declared
silent) and then restarts without excluding anyone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

RUNNING, RESTARTING, PENDING, WAITING, STOPPING = (
    "RUNNING", "RESTARTING", "PENDING", "WAITING", "STOPPING")
COMPLETED, FAILED, STOPPED = "COMPLETED", "FAILED", "STOPPED"
TERMINAL = (COMPLETED, FAILED, STOPPED)

# Last lines of a rank that failed because a peer did: its collective or the rendezvous store
# lost a partner. Gloo, NCCL, XCCL and the TCPStore word these differently.
_PEER_FAILURE = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|ECONNRESET|ECONNREFUSED|Connection refused|"
    r"Socket Timeout|timed out|Timeout|DistNetworkError|DistStoreError|gloo::IoException|"
    r"NCCL (error|communicator)|ProcessGroup.*(abort|error)|peer .*(died|exited|closed)|"
    r"Read error|Write error",
    re.IGNORECASE)


@dataclass(frozen=True)
class Settings:
    nodes: int
    ranks_per_node: int
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 30.0
    startup_timeout_s: float = 300.0
    agent_timeout_s: float = 30.0
    max_restarts: int = 10
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    failure_grace_s: float = 3.0  # SIGTERM -> SIGKILL when a generation failed
    stop_grace_s: float = 60.0  # ... when an operator stops the job (a checkpoint is saved)
    launch: dict = field(default_factory=dict)  # job file, overrides, log dir: into each plan

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def agent_silence_s(self) -> float:
        """An agent this late (several missed beats) is suspect."""
        return 3 * self.heartbeat_interval_s

    @property
    def settle_s(self) -> float:
        """How long collateral-only evidence waits for a culprit to show."""
        return self.agent_timeout_s + 1.0

    def backoff(self, restarts: int) -> float:
        return min(self.backoff_s * 2 ** max(restarts - 1, 0), self.backoff_max_s)


@dataclass(frozen=True)
class JobView:
    state: str = PENDING
    reason: str = ""
    generation: int = -1  # the latest planned generation; -1: none yet
    restarts: int = 0
    desired: str | None = None  # "stop" when an operator asked
    desired_by: str = ""
    failure_since: float | None = None
    next_plan_at: float | None = None


@dataclass(frozen=True)
class NodeView:
    name: str
    host: str
    alive: bool  # its agent beat within agent_timeout_s
    healthy: bool
    health: str = "ok"
    excluded: str | None = None  # the reason, when excluded
    generation: int | None = None  # the generation its agent runs or last ran
    live_ranks: int = 0
    last_beat: float = 0.0


@dataclass(frozen=True)
class Exit:
    node: str
    rank: int
    generation: int
    code: int | None  # None when a signal ended it
    signal: int | None = None
    by_agent: bool = False  # the agent terminated it (a stop), not a fault
    tail: str = ""
    time: float = 0.0

    @property
    def ok(self) -> bool:
        return self.code == 0 and not self.by_agent

    @property
    def failed(self) -> bool:
        return not self.by_agent and (self.code != 0 or self.signal is not None)

    def describe(self) -> str:
        how = f"signal {self.signal}" if self.signal is not None else f"exit code {self.code}"
        last = self.tail.strip().splitlines()[-1][:200] if self.tail.strip() else ""
        return f"rank {self.rank} on {self.node} ended with {how}" + (f": {last}" if last else "")


@dataclass(frozen=True)
class Overdue:
    node: str
    rank: int
    detail: str  # e.g. "no heartbeat for 4.1 s (step 12, phase backward)"
    since: float = 0.0


@dataclass(frozen=True)
class Observed:
    now: float
    job: JobView
    plan: dict | None
    nodes: dict[str, NodeView]
    exits: list[Exit] = field(default_factory=list)  # of the plan's generation
    overdue: list[Overdue] = field(default_factory=list)
    latest_step: int | None = None  # the newest committed checkpoint


@dataclass
class Decision:
    job: dict[str, Any] = field(default_factory=dict)  # fields to write; None deletes
    plan: dict | None = None  # the new plan, when it changes
    exclude: list[tuple[str, str]] = field(default_factory=list)  # (node, reason)
    events: list[tuple[str, str]] = field(default_factory=list)  # (kind, message)

    def note(self, kind: str, message: str) -> None:
        self.events.append((kind, message))


@dataclass(frozen=True)
class _Evidence:
    node: str
    what: str
    primary: bool
    time: float


def decide(obs: Observed, s: Settings) -> Decision:
    job, plan, d = obs.job, obs.plan, Decision()
    if job.state in TERMINAL:
        if plan is None or plan["action"] != "end":
            d.plan = _with_action(plan, "end", s.failure_grace_s, job.reason, obs.now)
        return d
    if job.desired == "stop" and job.state != STOPPING:
        who = job.desired_by or "an operator"
        if plan is not None and plan["action"] == "run" and _live(obs, plan):
            d.plan = _with_action(plan, "stop", s.stop_grace_s, f"stop asked by {who}", obs.now)
            d.job = {"state": STOPPING, "reason": f"stop asked by {who}: ranks save and exit"}
            d.note("stopping", f"stop asked by {who}: generation {plan['generation']} saves a "
                   "checkpoint and exits")
        else:
            _finish(d, obs, s, STOPPED, f"stopped by {who} before any rank ran")
        return d
    if job.state == STOPPING:
        if plan is None or not _live(obs, plan):
            at = f" at step {obs.latest_step}" if obs.latest_step is not None else ""
            _finish(d, obs, s, STOPPED, f"stopped by {job.desired_by or 'an operator'}; latest "
                    f"committed checkpoint{at}")
        return d
    if job.state == RUNNING and plan is not None and plan["action"] == "run":
        _watch(obs, s, d)
        return d
    _plan_next(obs, s, d)
    return d


def _watch(obs: Observed, s: Settings, d: Decision) -> None:
    """RUNNING: complete, fail over, or carry on."""
    job, plan = obs.job, obs.plan
    assert plan is not None
    gen = plan["generation"]
    finished = {e.rank for e in obs.exits if e.ok}
    if len(finished) >= plan["world_size"]:
        at = f" at step {obs.latest_step}" if obs.latest_step is not None else ""
        _finish(d, obs, s, COMPLETED, f"all {plan['world_size']} ranks of generation {gen} "
                f"finished{at}")
        return

    evidence = [_Evidence(e.node, e.describe(), not _collateral(e), e.time)
                for e in obs.exits if e.failed]
    # A node is lost when its agent is silent past agent_timeout_s, or sooner when one of its
    # ranks is overdue and its agent has missed beats too (a healthy agent beats every interval
    # whatever its ranks do): a dead node is then named at the speed of a frozen rank.
    late_nodes = {o.node for o in obs.overdue}
    lost = [n for n in plan["nodes"]
            if (v := obs.nodes.get(n)) is None or not v.alive
            or (n in late_nodes and obs.now - v.last_beat > s.agent_silence_s)]
    for name in lost:
        node = obs.nodes.get(name)
        silent = f"{obs.now - node.last_beat:.1f} s" if node and node.last_beat else "ever"
        evidence.append(_Evidence(name, f"node {name} lost: its agent has been silent for "
                                  f"{silent}", True, node.last_beat if node else 0.0))
    # A lost node's ranks fall silent with it: their heartbeats say nothing more.
    evidence += [_Evidence(o.node, f"rank {o.rank} on {o.node}: {o.detail}", True, o.since)
                 for o in obs.overdue if o.node in plan["nodes"] and o.node not in lost]
    if not evidence:
        if job.failure_since is not None:
            d.job = {"failure_since": None}
        return

    first_seen = job.failure_since if job.failure_since is not None else obs.now
    primary = sorted((e for e in evidence if e.primary), key=lambda e: e.time)
    if not primary and obs.now - first_seen < s.settle_s:
        if job.failure_since is None:
            d.job = {"failure_since": obs.now}
            d.note("suspect", f"generation {gen}: {evidence[0].what}; waiting up to "
                   f"{s.settle_s:g} s for the cause")
        return

    culprit = primary[0] if primary else None
    if culprit:
        reason = culprit.what
        d.exclude.append((culprit.node, reason))
    else:
        nodes = sorted({e.node for e in evidence})
        reason = (f"ranks on {', '.join(nodes)} lost their peers and no culprit showed within "
                  f"{s.settle_s:g} s ({evidence[0].what})")
    restarts = job.restarts + 1
    d.note("failure", f"generation {gen} failed: {reason}"
           + (f"; node {culprit.node} excluded" if culprit else "; nobody excluded"))
    if restarts > s.max_restarts:
        _finish(d, obs, s, FAILED, f"{restarts - 1} restarts used up (max_restarts="
                f"{s.max_restarts}); last failure: {reason}", restarts=restarts)
        return
    wait = s.backoff(restarts)
    d.plan = _with_action(plan, "stop", s.failure_grace_s, reason, obs.now)
    d.job = {"state": RESTARTING, "reason": reason, "restarts": restarts,
             "failure_since": None, "next_plan_at": obs.now + wait}
    d.note("restarting", f"restart {restarts} of at most {s.max_restarts}: generation "
           f"{gen + 1} after {wait:g} s, from the latest committed checkpoint")


def _plan_next(obs: Observed, s: Settings, d: Decision) -> None:
    """PENDING, WAITING, RESTARTING: drain the last generation, back off, then plan the next."""
    job, plan = obs.job, obs.plan
    if plan is not None and _live(obs, plan):
        if plan["action"] == "run":  # e.g. a state written before its plan: stop it first
            d.plan = _with_action(plan, "stop", s.failure_grace_s, job.reason, obs.now)
        return
    if job.next_plan_at is not None and obs.now < job.next_plan_at:
        return

    previous = plan["nodes"] if plan else []
    usable = {n for n, v in obs.nodes.items() if v.alive and v.healthy and not v.excluded}
    chosen = [n for n in previous if n in usable]
    chosen += sorted(usable - set(chosen))  # then spares, in name order
    if len(chosen) < s.nodes:
        reason = _shortage(obs, s, usable)
        if job.state != WAITING or job.reason != reason:
            d.job = {"state": WAITING, "reason": reason}
            d.note("waiting", reason)
        return

    chosen = chosen[:s.nodes]
    gen = max(job.generation, plan["generation"] if plan else -1) + 1
    spares = [n for n in chosen if n not in previous]
    start = (f"from the checkpoint of step {obs.latest_step}" if obs.latest_step is not None
             else "from scratch")
    reason = f"generation {gen} on {', '.join(chosen)} {start}"
    if previous and spares:
        reason += f" (spares brought in: {', '.join(spares)})"
    d.plan = {
        **s.launch,
        "generation": gen, "action": "run", "nodes": chosen,
        "ranks_per_node": s.ranks_per_node, "world_size": s.world_size,
        "master_addr": obs.nodes[chosen[0]].host, "master_port": 0,  # node 0's agent picks it
        "resume_step": obs.latest_step, "grace_s": s.failure_grace_s,
        "heartbeat_timeout_s": s.heartbeat_timeout_s, "startup_timeout_s": s.startup_timeout_s,
        "reason": reason, "issued": obs.now,
    }
    d.job = {"state": RUNNING, "generation": gen, "reason": reason, "failure_since": None,
             "next_plan_at": None}
    d.note("generation", reason)


def _finish(d: Decision, obs: Observed, s: Settings, state: str, reason: str,
            **fields: Any) -> None:
    d.job = {"state": state, "reason": reason, "failure_since": None, "next_plan_at": None,
             **fields}
    d.plan = _with_action(obs.plan, "end", s.failure_grace_s, reason, obs.now)
    d.note(state.lower(), reason)


def _with_action(plan: dict | None, action: str, grace_s: float, reason: str,
                 now: float) -> dict:
    base = plan or {"generation": -1, "nodes": [], "world_size": 0}
    return {**base, "action": action, "grace_s": grace_s, "reason": reason, "issued": now}


def _live(obs: Observed, plan: dict) -> bool:
    """Whether any rank of `plan`'s generation still runs (on a node whose agent is alive:
    a lost agent's ranks die with it)."""
    return any((n := obs.nodes.get(name)) is not None and n.alive
               and n.generation == plan["generation"] and n.live_ranks > 0
               for name in plan["nodes"])


def _collateral(e: Exit) -> bool:
    return bool(e.tail) and _PEER_FAILURE.search(e.tail) is not None


def _shortage(obs: Observed, s: Settings, usable: set[str]) -> str:
    why = []
    for name, node in sorted(obs.nodes.items()):
        if name in usable:
            continue
        if node.excluded:
            why.append(f"{name} excluded ({node.excluded})")
        elif not node.alive:
            why.append(f"{name} silent")
        elif not node.healthy:
            why.append(f"{name} unhealthy ({node.health})")
    return (f"waiting for nodes: the layout needs {s.nodes} x {s.ranks_per_node} ranks, "
            f"{len(usable)} healthy node(s) available"
            + (f"; {'; '.join(why)}" if why else ""))
