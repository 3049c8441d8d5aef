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

import json
from dataclasses import dataclass, field
from typing import Any

from controller import detect
from controller.detect import COLLATERAL, HARD, Evidence

RUNNING, RESTARTING, PENDING, WAITING, STOPPING = (
    "RUNNING", "RESTARTING", "PENDING", "WAITING", "STOPPING")
COMPLETED, FAILED, STOPPED = "COMPLETED", "FAILED", "STOPPED"
TERMINAL = (COMPLETED, FAILED, STOPPED)

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
    hang_timeout_s: float = 600.0
    hang_step_factor: float = 10.0
    straggler_factor: float = 2.0
    straggler_window: int = 20
    straggler_action: str = "report"
    flaky_failures: int = 1
    flaky_window_s: float = 3600.0
    stack_wait_s: float = 3.0  # for the agents' stack dumps of a hang, before deciding
    launch: dict = field(default_factory=dict)  # job file, overrides, log dir: into each plan

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def agent_silence_s(self) -> float:
        """An agent this late (several missed beats) is suspect."""
        return 2 * self.heartbeat_interval_s

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
    # Progress of the running generation: the furthest step, when it was reached, and the
    # time per step of recent advances (for the hang threshold).
    progress_gen: int | None = None
    progress_step: int = -1
    progress_at: float | None = None
    progress_moves: int = 0
    step_times: tuple[float, ...] = ()
    hang_since: float | None = None  # a hang was noticed and stacks asked for
    failures: dict = field(default_factory=dict)  # node -> times of its soft failures
    stragglers: tuple[str, ...] = ()  # nodes reported as stragglers now


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
    local_rank: int = -1

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
    confirmed: bool = True  # the node's agent beat after the deadline, relaying the old beat


@dataclass(frozen=True)
class Observed:
    now: float
    job: JobView
    plan: dict | None
    nodes: dict[str, NodeView]
    exits: list[Exit] = field(default_factory=list)  # of the plan's generation
    overdue: list[Overdue] = field(default_factory=list)
    latest_step: int | None = None  # the newest committed checkpoint
    # The running generation's sweep (see Store.sweep):
    agent_beats: dict[str, float | None] = field(default_factory=dict)  # plan node -> beat
    progress: int | None = None  # the furthest step any rank is at
    unhealthy: dict[str, str] = field(default_factory=dict)  # node -> "<node>/<tile>: why"
    nonfinite: frozenset[str] = frozenset()  # nodes with a rank reporting NaN/Inf of its own
    suspects: dict[str, dict[int, dict]] = field(default_factory=dict)  # node -> heartbeats
    waiting_in_collective: int = 0  # plan nodes whose ranks all wait in a collective
    stacks: dict[int, str] = field(default_factory=dict)  # rank -> stack dump (a hang)
    compute: dict[str, float] | None = None  # node -> compute score, when read this tick
    excluded: dict[str, str] = field(default_factory=dict)  # node -> reason


@dataclass
class Decision:
    job: dict[str, Any] = field(default_factory=dict)  # fields to write; None deletes
    plan: dict | None = None  # the new plan, when it changes
    exclude: list[tuple[str, str]] = field(default_factory=list)  # (node, reason)
    events: list[tuple[str, str, dict]] = field(default_factory=list)  # (kind, message, more)
    commands: list[tuple[str, dict]] = field(default_factory=list)  # (node, agent command)

    def note(self, kind: str, message: str, **fields: Any) -> None:
        self.events.append((kind, message, fields))


def decide(obs: Observed, s: Settings) -> Decision:
    job, plan, d = obs.job, obs.plan, Decision()
    for node, why in sorted(obs.unhealthy.items()):  # a failed health check, in any state
        if node not in obs.excluded:
            d.exclude.append((node, f"bad tile {why}"))
    if job.state in TERMINAL:
        if plan is None or plan["action"] != "end":
            d.plan = _with_action(plan, "end", s.failure_grace_s, job.reason, obs.now)
        return d
    if job.desired == "stop" and job.state != STOPPING:
        who = job.desired_by or "an operator"
        # A running generation is observed without the per-node view (`nodes` is empty).
        if plan is not None and plan["action"] == "run" and (
                job.state == RUNNING or _live(obs, plan)):
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
    _track_progress(obs, s, d)
    found = detect.evidence(obs, s)
    slow = _stragglers(obs, s, d) if obs.compute is not None else {}
    if s.straggler_action == "exclude":
        found += [Evidence(n, why, HARD, obs.now) for n, why in sorted(slow.items())]
    hang_fields: dict = {}
    moved = obs.progress is not None and obs.progress > job.progress_step
    if not found and not moved and _stalled(obs, s):
        found, hang_fields = _hang(obs, s, d)
        if not found:
            return  # the agents are dumping stacks
    if not found:
        if job.failure_since is not None:
            d.job["failure_since"] = None
        return

    first_seen = job.failure_since if job.failure_since is not None else obs.now
    blamed = sorted((e for e in found if e.kind != COLLATERAL), key=lambda e: e.time)
    if not blamed and not hang_fields and obs.now - first_seen < s.settle_s:
        if job.failure_since is None:
            d.job["failure_since"] = obs.now
            d.note("suspect", f"generation {gen}: {found[0].what}; waiting up to "
                   f"{s.settle_s:g} s for the cause")
        return

    culprit = blamed[0] if blamed else None
    failures = dict(job.failures)
    if culprit is None:
        nodes = sorted({e.node for e in found if e.node})
        reason = (f"{found[0].what}; no culprit" if hang_fields else
                  f"ranks on {names(nodes)} lost their peers and no culprit showed within "
                  f"{s.settle_s:g} s ({found[0].what})")
        verdict = "nobody excluded"
    else:
        reason = culprit.what
        exclude = culprit.kind == HARD
        if not exclude:
            exclude, failures[culprit.node] = detect.flaky(failures, culprit.node, obs.now, s)
        if exclude:
            d.exclude.append((culprit.node, reason))
            failures.pop(culprit.node, None)
            verdict = f"node {culprit.node} excluded"
        else:
            verdict = (f"node {culprit.node} kept: failure {len(failures[culprit.node])} of "
                       f"{s.flaky_failures} within {s.flaky_window_s:g} s before exclusion")
    restarts = job.restarts + 1
    d.note("failure", f"generation {gen} failed: {reason}; {verdict}", **hang_fields)
    if restarts > s.max_restarts:
        _finish(d, obs, s, FAILED, f"{restarts - 1} restarts used up (max_restarts="
                f"{s.max_restarts}); last failure: {reason}", restarts=restarts)
        return
    wait = s.backoff(restarts)
    d.plan = _with_action(plan, "stop", s.failure_grace_s, reason, obs.now)
    d.job.update({"state": RESTARTING, "reason": reason, "restarts": restarts,
                  "failure_since": None, "next_plan_at": obs.now + wait, "hang_since": None,
                  "failures": failures})
    d.note("restarting", f"restart {restarts} of at most {s.max_restarts}: generation "
           f"{gen + 1} after {wait:g} s, from the latest committed checkpoint")


def _track_progress(obs: Observed, s: Settings, d: Decision) -> None:
    """Keep the furthest step and when it was reached; sample the time per step."""
    job, plan = obs.job, obs.plan
    if job.progress_gen != plan["generation"]:  # a new generation: its clock starts now
        d.job.update({"progress_gen": plan["generation"], "progress_step": -1,
                      "progress_at": obs.now, "progress_moves": 0, "hang_since": None})
        return
    if obs.progress is None or obs.progress <= job.progress_step:
        return
    moves = job.progress_moves + 1
    # The first two moves of a generation are its resume and its first step, not step times.
    if moves > 2:
        per_step = (obs.now - job.progress_at) / (obs.progress - job.progress_step)
        d.job["step_times"] = [*job.step_times, per_step][-32:]
    d.job.update({"progress_step": obs.progress, "progress_at": obs.now,
                  "progress_moves": moves, "hang_since": None})


def _stalled(obs: Observed, s: Settings) -> bool:
    job = obs.job
    if job.progress_at is None or job.progress_gen != obs.plan["generation"]:
        return False
    limit = detect.stall_threshold(job, s)
    if job.progress_moves < 2:  # not past the first step yet: startup takes its time
        limit = max(limit, s.startup_timeout_s)
    return obs.now - job.progress_at > limit


def _hang(obs: Observed, s: Settings, d: Decision) -> tuple[list[Evidence], dict]:
    """Progress stalled while every heartbeat is fresh. First ask the agents for the stacks of
    the culprits and of a sample of the others; decide once they are in (or after
    stack_wait_s). Returns the evidence and the failure event's extra fields (none: wait)."""
    job, plan = obs.job, obs.plan
    culprits = detect.hang_culprits(obs)
    stalled_for = obs.now - job.progress_at
    threshold = detect.stall_threshold(job, s)
    named = "; ".join(detect.describe_rank(n, lr, b, obs.now) for n, lr, b in culprits)
    if job.hang_since is None:
        by_node: dict[str, list[int]] = {}
        for node, lr, _ in culprits:
            by_node.setdefault(node, []).append(lr)
        sample = [n for n in plan["nodes"] if n not in by_node][:2]
        for node in [*by_node, *sample]:
            d.commands.append((node, {"kind": "dump_stacks", "generation": plan["generation"],
                                      "local_ranks": by_node.get(node, [0])}))
        d.job["hang_since"] = obs.now
        d.note("suspect", f"generation {plan['generation']}: no step past "
               f"{job.progress_step} for {stalled_for:.1f} s (threshold {threshold:.1f} s) "
               f"while heartbeats are fresh; "
               + (f"holding the others up: {named}" if culprits else "no rank stands out")
               + "; collecting stacks")
        return [], {}
    rpn = plan["ranks_per_node"]
    culprit_nodes = {n for n, *_ in culprits}
    sample = [n for n in plan["nodes"] if n not in culprit_nodes][:2]
    wanted = {b.get("rank") for *_, b in culprits} | {
        plan["nodes"].index(n) * rpn for n in sample}  # their local rank 0
    if obs.now - job.hang_since < s.stack_wait_s and not wanted <= set(obs.stacks):
        return [], {}
    fields = {"stacks": json.dumps({str(r): t[-4000:] for r, t in sorted(obs.stacks.items())})}
    what = (f"hung: no step past {job.progress_step} for {stalled_for:.1f} s (threshold "
            f"{threshold:.1f} s)")
    if not culprits:
        return [Evidence("", f"{what}, every rank waiting", COLLATERAL, obs.now)], fields
    node, _, _ = culprits[0]
    return [Evidence(node, f"{what}: {named}, while the others wait in a collective", "soft",
                     obs.now)], fields


def _stragglers(obs: Observed, s: Settings, d: Decision) -> dict[str, str]:
    """Report nodes that turned slow (an event each); keep the list in the job record."""
    slow = detect.straggling(obs, s)
    for node in sorted(set(slow) - set(obs.job.stragglers)):
        d.note("straggler", slow[node] + (f"; straggler_action={s.straggler_action}"),
               node=node)
    if set(slow) != set(obs.job.stragglers):
        d.job["stragglers"] = sorted(slow)
    return slow


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
    reason = f"generation {gen} on {names(chosen)} {start}"
    if previous and spares:
        reason += f" (spares brought in: {names(spares)})"
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


def names(nodes: list[str], shown: int = 8) -> str:
    """Node names for a message: all of a few, the first few of many (messages stay small at
    10,000 nodes: they go into every plan and the job record)."""
    if len(nodes) <= shown:
        return ", ".join(nodes)
    return f"{', '.join(nodes[:shown])} and {len(nodes) - shown} more"


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
