"""The controller's decisions: pure functions from what it observes to what it does.

`decide(observed, settings)` reads one snapshot (the job record, the plan, every node's agent,
this generation's rank exits, overdue heartbeats, the latest committed checkpoint) and returns a
`Decision`: fields of the job record to write, a new plan, nodes to exclude, events to record.
Nothing here touches Redis, a clock or a process, so every rule is unit-tested on its own
(tests/test_decide.py); `controller/control/controller.py` observes and applies.

Job states: PENDING -> RUNNING <-> PAUSING -> PAUSED, (RESTARTING -> RUNNING)*, then COMPLETED |
FAILED | STOPPED, with WAITING while too few healthy nodes are left for the layout and STOPPING
while an operator's stop drains the ranks. Operators' requests (controller/control/operator.py) are
taken first, each tick. A plan's `action` tells agents what to do with its generation: "run",
"stop" (terminate the ranks) or "end" (terminate them and exit: the job is over); a stop or end
with `"save": false` tells the ranks to save nothing.

Wrong arithmetic. Hard evidence that a tile computes wrong (a bad tile found by its health check,
NaN/Inf from a rank's own values) makes everything computed since that node last passed its
health check suspect: the generation stops without a checkpoint, and once none of its ranks
runs, the checkpoints committed after that check are set aside (quarantine), so the next
generation resumes from the newest one before it.

Attribution. When a rank dies, its peers soon fail too (their collectives lose a partner), so
the first exit is not always the culprit. Evidence is primary when it names its own node: a
rank exit that is not a peer-connection error (a signal, a crash, an error of its own), an
overdue heartbeat (a frozen process), an agent gone silent (a lost node). Exits whose last
lines are peer-connection errors are collateral. Primary evidence is acted on at once, earliest
first; collateral alone waits `settle_s` (long enough for a lost node's agent to be declared
silent) and then restarts without excluding anyone.
"""

from __future__ import annotations

from typing import Any

from controller.control import (
    detect,
    fabric,
    forgive,
    operator,
    recovery,
    replica_loss,
    rewind,
    watching,
)
from controller.control.actions import counted, live, restarted, with_action
from controller.control.detect import COLLATERAL, HARD, Evidence
from controller.control.shortage import names, resized, shortage
from controller.control.view import (  # noqa: F401 (re-exported: the rules' vocabulary)
    ACTIVE,
    COMPLETED,
    FAILED,
    PAUSED,
    PAUSING,
    PENDING,
    RESTARTING,
    RUNNING,
    STOPPED,
    STOPPING,
    TERMINAL,
    WAITING,
    Decision,
    Exit,
    JobView,
    NodeView,
    Observed,
    Overdue,
    Request,
    Settings,
)
from optimus.checkpoint.snapshot_files import extend_lineage
from optimus.contract.exits import EXIT_CHECKPOINT_FAILED, EXIT_USER_ERROR
from optimus.contract.records import Plan


def decide(obs: Observed, s: Settings) -> Decision:
    d = Decision()
    if obs.requests:
        obs = operator.take_requests(obs, d)
    job, plan = obs.job, obs.plan
    for node, why in sorted(obs.unhealthy.items()):  # a failed health check, in any state
        if node not in obs.excluded:
            d.exclude.append((node, f"bad tile {why}"))
            d.causes[node] = "bad_tile"
    forgive.forgive(obs, s, d)  # nodes excluded as lost, back and well: spares again
    window = job.suspect or {}
    if (obs.suspect_steps is not None and not window.get("set_aside")
            and (plan is None or not live(obs, plan))):
        recovery.set_aside(obs, d)
    if obs.rewind_asked is not None:  # an operator's (operator.take_requests checked it)
        rewind.by_operator(obs, s, d)
        return d
    if job.state in TERMINAL:
        if plan is None or plan["action"] != "end":
            d.plan = with_action(plan, "end", s.failure_grace_s, job.reason, obs.now)
        return d
    if job.desired == "stop" and job.state != STOPPING:
        who = job.desired_by or "an operator"
        who += f" ({job.desired_reason})" if job.desired_reason else ""
        # A running generation is observed without the per-node view (`nodes` is empty).
        if plan is not None and plan["action"] == "run" and (
                job.state in ACTIVE or live(obs, plan)):
            d.plan = with_action(plan, "stop", s.stop_grace_s, f"stop asked by {who}", obs.now)
            d.job.update({"state": STOPPING,
                          "reason": f"stop asked by {who}: ranks save and exit"})
            d.note("stopping", f"stop asked by {who}: generation {plan['generation']} saves a "
                   "checkpoint and exits")
        elif plan is not None and live(obs, plan):  # a failed generation still draining
            _finish(d, obs, s, STOPPED, f"stopped by {who} while generation "
                    f"{plan['generation']} was stopping")
        else:
            _finish(d, obs, s, STOPPED, f"stopped by {who} before any rank ran")
        return d
    if job.state == STOPPING:
        if plan is None or not live(obs, plan):
            at = f" at step {obs.latest_step}" if obs.latest_step is not None else ""
            _finish(d, obs, s, STOPPED, f"stopped by {job.desired_by or 'an operator'}; latest "
                    f"committed checkpoint{at}")
        return d
    if job.state in ACTIVE and plan is not None and plan["action"] == "run":
        _watch(obs, s, d)
        return d
    _plan_next(obs, s, d)
    return d


def _watch(obs: Observed, s: Settings, d: Decision) -> None:
    """RUNNING: complete, fail over, or carry on."""
    obs = replica_loss.current(obs, s)  # a replica's relaunch ended its earlier ranks
    job, plan = obs.job, obs.plan
    assert plan is not None
    gen, carry_on = plan["generation"], s.carry_on and replica_loss.active(plan)
    finished = {e.rank for e in obs.exits if e.ok}
    if (replica_loss.finished(obs) if carry_on else len(finished) >= plan["world_size"]):
        _complete(obs, s, d)
        return
    if (_checkpoints_failed(obs, s, d) or _input_refused(obs, s, d)
            or rewind.by_ranks(obs, s, d)):
        return
    watching.track_progress(obs, s, d)
    recovery.loaded(obs, d)
    operator.pause_transition(obs, d)
    if _leave(obs, s, d) or _grow(obs, s, d) or carry_on and (
            replica_loss.refill(obs, d) or replica_loss.rejoin(obs, s, d)):
        return
    recovery.rebuddy(obs, d)
    for node, why in fabric.spare_cut(obs):  # a spare its ring cannot reach: out, no restart
        d.exclude.append((node, why))
        d.causes[node] = "network"
    found = replica_loss.relevant(obs, s, detect.evidence(obs, s))
    training = job.state == RUNNING and job.desired != "pause"  # no stall or straggler paused
    slow = watching.stragglers(obs, s, d) if obs.compute is not None and training else {}
    if s.straggler_action == "exclude" and watching.replaceable(obs, s, slow):
        found += [Evidence(n, why, HARD, obs.now, "straggler") for n, why in sorted(slow.items())]
    hang_fields: dict = {}
    moved = obs.progress is not None and obs.progress > job.progress_step
    if not found and not moved and training and watching.stalled(obs, s):
        found, hang_fields = watching.hang(obs, s, d)
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
    cause = culprit.cause if culprit else "hang" if hang_fields else "unattributed"
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
            d.causes[culprit.node] = culprit.cause
            failures.pop(culprit.node, None)
            verdict = f"node {culprit.node} excluded"
        else:
            verdict = (f"node {culprit.node} kept: failure {len(failures[culprit.node])} of "
                       f"{s.flaky_failures} within {s.flaky_window_s:g} s before exclusion")
    restarts = job.restarts + 1
    wrong = [e for e in found if e.wrong_arithmetic]
    failure = {"generation": gen, **(culprit.fields() if culprit else {
        "node": "", "rank": "", "tile": "", "cause": cause, "evidence": ""}),
               "excluded": culprit is not None and verdict.endswith("excluded"),
               "saves": not wrong}
    d.job["last_failure"] = {**failure, "time": obs.now}
    d.note("failure", f"generation {gen} failed: {reason}; {verdict}"
           + (f"; it stops without a checkpoint: {recovery.distrust(wrong)}" if wrong else ""),
           **failure, **hang_fields)
    if wrong:  # remembered until the checkpoints it makes suspect are set aside
        d.job["suspect"] = recovery.window(job, plan, wrong)
    if restarts > s.max_restarts:
        _finish(d, obs, s, FAILED, f"{restarts - 1} restarts used up (max_restarts="
                f"{s.max_restarts}); last failure: {reason}", save=not wrong,
                restarts=restarts)
        return
    why = replica_loss.leave(obs, s, d, culprit, reason) if carry_on and not wrong else None
    if carry_on and not wrong and why is None:  # its replica alone restarts
        d.job.update({"restarts": restarts, "failures": failures, "failure_since": None,
                      "hang_since": None, "restart_causes": counted(job, cause)})
        return
    wait = s.backoff(restarts)
    d.plan = with_action(plan, "stop", s.failure_grace_s, reason, obs.now, save=not wrong)
    # Who failed: its agent kills it at the grace; the others may take longer to leave in
    # process (controller/node/lifecycle.py).
    d.plan["culprit"] = {"node": culprit.node, "rank": culprit.rank} if culprit else None
    d.job.update({"state": RESTARTING, "reason": reason, "restarts": restarts,
                  "failure_since": None, "next_plan_at": obs.now + wait, "hang_since": None,
                  "failures": failures, **restarted(job, cause, obs.now)})
    d.note("restarting", f"restart {restarts} of at most {s.max_restarts}: generation "
           f"{gen + 1} after {wait:g} s, from the "
           + ("newest checkpoint committed before the bad tile's last passing health check"
              if wrong else "latest committed checkpoint")
           + (f" (replicas do not carry on: {why})" if why else ""))


def _complete(obs: Observed, s: Settings, d: Decision) -> None:
    """Every rank finished. COMPLETED means, with checkpointing on, that the final step is
    committed (a rank whose final save failed exits with EXIT_CHECKPOINT_FAILED instead; this
    holds the line whatever made the ranks leave early)."""
    plan, latest = obs.plan, obs.latest_step
    ranks = f"all {plan['world_size']} ranks of generation {plan['generation']}"
    if s.final_step is not None and (latest is None or latest < s.final_step):
        newest = f"step {latest}" if latest is not None else "none"
        _finish(d, obs, s, FAILED, f"{ranks} exited, but the final step {s.final_step} has no "
                f"committed checkpoint (the newest committed: {newest}); resubmit "
                "(--resubmit) to continue from it")
        return
    _finish(d, obs, s, COMPLETED, f"{ranks} finished"
            + (f" at step {latest}" if latest is not None else ""))


def _checkpoints_failed(obs: Observed, s: Settings, d: Decision) -> bool:
    """Ranks that exited with EXIT_CHECKPOINT_FAILED: the final step's save failed, or
    max_failed_saves saves in a row did. All ranks leave so after the same step. A new
    generation would fail the same way, so the job ends FAILED with their reason (rank 0's,
    which alone knows why a commit failed: its exit is awaited up to settle_s); a resubmission
    tries again from the newest committed checkpoint."""
    failed = sorted((e for e in obs.exits if e.code == EXIT_CHECKPOINT_FAILED),
                    key=lambda e: e.rank)
    if not failed:
        return False
    if (failed[0].rank != 0 and len({e.rank for e in obs.exits}) < obs.plan["world_size"]
            and obs.now - failed[0].time < s.settle_s):
        return True  # the others' exits are on their way
    _finish(d, obs, s, FAILED, f"{_said(failed[0])}; not restarted (a new generation would "
            "fail the same way): fix the checkpoint storage, then resubmit (--resubmit) to "
            "continue from the newest committed checkpoint")
    return True


def _input_refused(obs: Observed, s: Settings, d: Decision) -> bool:
    """Every rank exited with EXIT_USER_ERROR: each refused the job's own input alike (a
    checkpoint this run did not write, a setting, the data), which no other node changes: the
    job ends FAILED with rank 0's line, no restart spent, no node blamed. From some ranks only
    it may be their node's own (a mount, an environment): held settle_s for the others' exits,
    then judged by the usual rules."""
    refused = sorted((e for e in obs.exits if e.code == EXIT_USER_ERROR),
                     key=lambda e: e.rank)
    if not refused:
        return False
    if len({e.rank for e in refused}) < obs.plan["world_size"]:
        return obs.now - min(e.time for e in refused) < s.settle_s
    _finish(d, obs, s, FAILED, f"{_said(refused[0])}; not restarted (every rank refused it "
            "alike: a new generation would too): fix it, then resubmit (--resubmit)")
    return True


def _said(e: Exit) -> str:
    """The last `error: ` line a rank printed (what it refused, in its own words), or how it
    ended."""
    said = [line.strip().removeprefix("error: ") for line in e.tail.splitlines()
            if line.startswith("error: ")]
    return said[-1] if said else e.describe()


def _leave(obs: Observed, s: Settings, d: Decision) -> bool:
    """Nodes of this generation excluded while it runs (by an operator): the ranks save a
    checkpoint and exit, and the next generation runs without them; under replicas that carry
    on, the node's replica alone leaves (replica_loss.excluded). Not a failure: it uses no
    restart of max_restarts."""
    plan = obs.plan
    leaving = [n for n in plan["nodes"] if n in obs.excluded and n not in obs.draining
               and not replica_loss.out(plan, n)]  # a replica out waits for a spare
    if not leaving:
        return False
    # Replicas that carry on: only the node's replica leaves (one a tick), unless too few
    # would be left.
    alone = replica_loss.excluded(obs, s, d, leaving[0]) if s.carry_on else "restart mode"
    if alone is None:
        return True
    gen = plan["generation"]
    reason = (f"{names(leaving)} excluded ({obs.excluded[leaving[0]]}): generation {gen} "
              "saves a checkpoint and stops, the next runs without "
              + ("it" if len(leaving) == 1 else "them")
              + (f" (not its replica alone: {alone})" if s.carry_on else ""))
    d.plan = with_action(plan, "stop", s.stop_grace_s, reason, obs.now)
    d.job.update({"state": RESTARTING, "reason": reason, "failure_since": None,
                  "next_plan_at": obs.now, "hang_since": None,
                  **restarted(obs.job, "operator", obs.now)})
    d.note("restarting", reason)
    return True


def _grow(obs: Observed, s: Settings, d: Decision) -> bool:
    """A generation on fewer nodes than the job asks for (it shrank: no spare was left) grows
    back once nodes are free again (a node included, a new agent) and a checkpoint of its own
    is committed (the layout changes, so the next generation reshards from disk): its ranks
    save a checkpoint and stop, and the next runs on as many nodes as fit: all of them
    whenever they are free, a size between only when the planner predicts more tokens/s there
    (Settings.layouts). Not a failure."""
    job, plan = obs.job, obs.plan
    have = len(plan["nodes"])
    if (obs.spare_count is None or job.state != RUNNING or job.desired is not None
            or obs.latest_step is None or obs.latest_step <= (plan.get("resume_step") or 0)):
        return False
    bigger = [c for c in s.allowed_nodes if have < c <= have + obs.spare_count]
    if not bigger or (max(bigger) < s.nodes and not _gains(s, have, max(bigger))):
        return False  # back on all its nodes it always goes: the size the job asked for
    gen = plan["generation"]
    reason = (f"{obs.spare_count} node(s) free again: generation {gen} saves a checkpoint and "
              f"stops, the next runs on {max(bigger)} of {s.nodes} nodes instead of {have} (the "
              "data-parallel degree grows with them)")
    d.plan = with_action(plan, "stop", s.stop_grace_s, reason, obs.now)
    d.job.update({"state": RESTARTING, "reason": reason, "failure_since": None,
                  "next_plan_at": obs.now, "hang_since": None,
                  **restarted(job, "resize", obs.now)})
    d.note("grow", reason, generation=gen, nodes=have, to=max(bigger))
    return True


def _gains(s: Settings, have: int, to: int) -> bool:
    """Whether the planner predicts more tokens/s on `to` nodes than on `have` (unknown: yes)."""
    now, then = s.layouts.get(have), s.layouts.get(to)
    return not (now and then) or then["tokens_per_s"] > now["tokens_per_s"]


def _plan_next(obs: Observed, s: Settings, d: Decision) -> None:
    """PENDING, WAITING, RESTARTING: drain the last generation, back off, then plan the next."""
    job, plan = obs.job, obs.plan
    if plan is not None and live(obs, plan):
        if plan["action"] == "run" and plan["generation"] > job.generation:
            _adopt(obs, d)
        elif plan["action"] == "run":  # e.g. a state written before its plan: stop it first
            d.plan = with_action(plan, "stop", s.failure_grace_s, job.reason, obs.now)
        return
    first = plan is None
    if not first and job.next_plan_at is not None and obs.now < job.next_plan_at:
        return  # a backoff

    previous = plan["nodes"] if plan else []
    usable = {n for n, v in obs.nodes.items() if v.alive and v.healthy and not v.excluded}
    chosen = [n for n in previous if n in usable]
    chosen += sorted(usable - set(chosen))  # then spares, in name order
    fits = [c for c in s.allowed_nodes if c <= len(chosen) and (c == s.nodes or not first
                                                                or s.start_short)]
    if not fits:
        reason = shortage(obs, s, usable, whole=first and not s.start_short)
        if job.state != WAITING or job.reason != reason:
            d.job.update({"state": WAITING, "reason": reason})
            d.note("waiting", reason)
        return
    if first and fits[0] < s.nodes and (job.next_plan_at is None or obs.now < job.next_plan_at):
        # A job that may shrink does not start short only because an agent registered a
        # moment late (it would not grow back until a restart): the first generation waits
        # for every node up to agent_timeout_s, then starts on what it has.
        if job.next_plan_at is None:
            reason = (f"waiting up to {s.agent_timeout_s:g} s for {s.nodes} nodes before "
                      f"starting on {fits[0]}: {len(usable)} healthy node(s) so far")
            d.job.update({"state": WAITING, "reason": reason,
                          "next_plan_at": obs.now + s.agent_timeout_s})
            d.note("waiting", reason)
        return

    chosen = chosen[:fits[0]]
    memory, not_used = recovery.memory_resume(obs, chosen, usable)
    if memory is not None:
        chosen = memory.pop("nodes")
    held = [n for n in chosen if n not in previous and obs.nodes[n].silent]
    if held:
        # A spare whose agent missed beats is not launched on, nor trusted with the copy it
        # holds, until it beats again or is found gone (its host probed, or agent_timeout_s):
        # a spare killed a moment before the node it was to replace was chosen, with its copy.
        reason = (f"next generation held: spare {names(held)} missed its agent's beats; "
                  f"launching once it beats again or is found gone (at most "
                  f"{s.agent_timeout_s:g} s)")
        if job.reason != reason:
            d.job["reason"] = reason
            d.note("held", reason, nodes=held)
        return
    worlds, held = replica_loss.worlds(obs, s, chosen)  # replicas that carry on: a world each
    if held:
        if job.reason != held:
            d.job["reason"] = held
            d.note("held", held)
        return
    gen = max(job.generation, plan["generation"] if plan else -1) + 1
    spares = [n for n in chosen if n not in previous]
    resume_step = memory["step"] if memory else obs.latest_step
    start = (f"from the memory snapshot of step {memory['step']}" if memory else
             f"from the checkpoint of step {obs.latest_step}" if obs.latest_step is not None
             else "from scratch")
    reason = f"generation {gen} on {names(chosen)} {start}"
    if not_used:
        reason += f" (memory snapshot not used: {not_used})"
    if d.set_aside:
        reason += (f" (set aside as suspect: step "
                   f"{', '.join(str(step) for step, _ in d.set_aside)})")
    if obs.skipped:
        reason += f" (newer ones fail their size check: {'; '.join(obs.skipped[:3])})"
    if previous and spares:
        reason += f" (spares brought in: {names(spares)})"
    layout = s.layouts.get(len(chosen)) if len(chosen) < s.nodes else None
    if len(chosen) < s.nodes:
        reason += f" (shrunk to {len(chosen)} of {s.nodes} nodes: {resized(s, len(chosen))})"
    launch = {**s.launch, **({"overrides": [*s.launch.get("overrides", []), *layout["overrides"]],
                              "layout": layout["layout"]}
                             if layout and layout["overrides"] else {})}
    d.plan = Plan(  # the contract's record: a field of the wrong type fails here, not at agents
        **launch, generation=gen, action="run", nodes=chosen,
        ranks_per_node=s.ranks_per_node, world_size=len(chosen) * s.ranks_per_node,
        master_addr=obs.nodes[chosen[0]].host, **worlds, master_port=(
            worlds["replicas"]["ports"][0] if worlds else _offered(obs, chosen[0])),
        resume_step=resume_step, grace_s=s.failure_grace_s,
        buddies=recovery.buddies(chosen, sorted(usable - set(chosen)),
                                 {n: v.snapshot_addr for n, v in obs.nodes.items()}),
        peers=fabric.ring_for(obs, chosen, usable),  # the mesh check's ring
        **({"memory": memory} if memory else {}),
        **({"skips": [list(w) for w in job.skips]} if job.skips else {}),
        heartbeat_timeout_s=s.heartbeat_timeout_s, startup_timeout_s=s.startup_timeout_s,
        reason=reason, issued=obs.now,
        lineage=extend_lineage(recovery.lineage(obs), gen, resume_step),
        failed_saves=recovery.failed_saves(obs),
    ).record()
    if (rewinds := rewind.resumed(job, resume_step)) is not None:  # the rewind carried out
        d.job["rewinds"] = rewinds
    d.job.update({"state": PAUSING if job.desired == "pause" else RUNNING, "generation": gen,
                  "reason": reason, "failure_since": None, "next_plan_at": None,
                  "suspect": None})  # the window is acted on: set aside, or judged above
    d.note("generation", reason, **({"nodes": len(chosen), "layout": layout["layout"],
                                      "tokens_per_s": layout["tokens_per_s"],
                                      "full_layout": s.layouts[s.nodes]["layout"],
                                      "full_tokens_per_s": s.layouts[s.nodes]["tokens_per_s"]}
                                     if layout and s.nodes in s.layouts else {}))


def _adopt(obs: Observed, d: Decision) -> None:
    """A "run" plan newer than the job record, its ranks running: a plan in flight whose
    record never landed (a leader cut off between two writes of one decision, where decisions
    are not one fenced transaction: controller/store/fence.py). Its generation runs on,
    recorded as its plan says, rather than stopped for one more restart."""
    job, plan = obs.job, obs.plan
    gen, reason = plan["generation"], plan.get("reason") or f"generation {plan['generation']}"
    d.job.update({"state": PAUSING if job.desired == "pause" else RUNNING, "generation": gen,
                  "reason": reason, "failure_since": None, "next_plan_at": None,
                  "suspect": None})
    d.note("adopted", f"generation {gen} runs on {names(plan['nodes'])} but the job record "
           f"said {job.state}, generation {job.generation}: its plan was written and its "
           f"record not; recorded as it runs, not stopped ({reason})", generation=gen)


def _offered(obs: Observed, node: str) -> int:
    """The rendezvous port node 0's agent holds for the next plan (controller/node/ports.py):
    with it in the plan every node launches at once. 0 (its agent picks one when the plan
    arrives, relayed to the others) when it offers none, or still the one the last plan took
    (its status not yet renewed: that generation's store may still listen there)."""
    port = obs.nodes[node].next_port
    return port if port and port != (obs.plan or {}).get("master_port") else 0


def _finish(d: Decision, obs: Observed, s: Settings, state: str, reason: str,
            save: bool = True, **fields: Any) -> None:
    d.job.update({"state": state, "reason": reason, "failure_since": None,
                  "next_plan_at": None, **fields})
    d.plan = with_action(obs.plan, "end", s.failure_grace_s, reason, obs.now, save=save)
    d.note(state.lower(), reason)
