"""Operators' requests, taken by the controller: pure functions, like the rest of the rules.

The CLI (`optimus job ...`, `optimus node ...`) appends a request to the job's `requests` stream
(who, from which host, why, when); the leading controller takes the new ones at its next tick,
in order, and answers each with an event that carries the request's id, its actor, host and
reason: the audit trail, and what the CLI waits for. `refusal` is the one place that says when a
request cannot be carried out; the CLI asks it first (to fail fast with a reason), the
controller asks again (the job may have moved on since).

What each request does:
- pause: every rank stops after one same step (the control word's "pause", agreed by all ranks
  at a step boundary), after a checkpoint of that step when asked; the job is PAUSING until
  every node reports its ranks paused, then PAUSED. It lasts across restarts until resumed.
- resume: the control word's "pause" goes; the ranks go on with the next step.
- stop: the ranks save a checkpoint and exit; the job ends STOPPED.
- checkpoint: the control word's "checkpoint" number grows; every rank saves the next step.
- exclude: the node is out until included. If it runs ranks now, the generation stops with a
  checkpoint and the next one runs without it (on a spare, or on fewer nodes when the job may
  shrink).
- drain: the node takes no part in future generations; the running one is left alone.
- include: an excluded or draining node is usable again.
- rewind: the running generation stops without saving, and the next resumes from the newest
  point at or before step `to`, skipping the batches of the steps asked
  (controller/control/rewind.py; decide.py applies it). Its event carries the request's id.
"""

from __future__ import annotations

import time
from dataclasses import replace

from controller.control.view import (
    ACTIVE,
    PAUSED,
    PAUSING,
    RUNNING,
    STOPPING,
    TERMINAL,
    Decision,
    Observed,
)

ACTIONS = ("pause", "resume", "stop", "checkpoint", "exclude", "drain", "include", "rewind")
NODE_ACTIONS = ("exclude", "drain", "include")


def refusal(action: str, state: str, desired: str | None, *, node: str = "",
            known_nodes: set[str] | frozenset[str] = frozenset(),
            excluded: dict[str, str] | None = None,
            draining: set[str] | frozenset[str] = frozenset(), to: int | None = None,
            skip: tuple[int, int] | None = None) -> str | None:
    """Why `action` cannot be done to a job in `state` (None: it can)."""
    excluded = excluded or {}
    if action not in ACTIONS:
        return f"unknown action {action!r}; one of {', '.join(ACTIONS)}"
    if state in TERMINAL:
        return f"the job has ended ({state})"
    if action in NODE_ACTIONS:
        if node not in known_nodes:
            return (f"no node {node!r} in this job; known: "
                    + (", ".join(sorted(known_nodes)) or "none registered"))
        if action == "include" and node not in excluded:
            return f"node {node} is not excluded"
        if action == "exclude" and node in excluded and node not in draining:
            return f"node {node} is already excluded ({excluded[node]})"
        if action == "drain" and node in excluded:
            return f"node {node} is already {'draining' if node in draining else 'excluded'}"
        return None
    if desired == "stop" or state == STOPPING:
        return "the job is stopping"
    if action == "pause" and desired == "pause":
        return f"the job is already {'paused' if state == PAUSED else 'pausing'}"
    if action == "resume" and desired != "pause":
        return f"the job is not paused ({state})"
    if action == "checkpoint" and state not in ACTIVE:
        return f"no generation is running to checkpoint ({state})"
    if action == "rewind" and to is None:
        return "a rewind needs the step to go back to (--to STEP)"
    if action == "rewind" and skip is not None and skip[0] <= to:
        return (f"the skipped steps {skip[0]}..{skip[1]} must come after the step rewound to "
                f"({to}): the batches of steps up to {to} are in its state already")
    return None


def take_requests(obs: Observed, d: Decision) -> Observed:
    """Apply `obs.requests` to the decision; the snapshot as the rules should now see it."""
    job, control, rewind = obs.job, dict(obs.control), obs.rewind_asked
    excluded, draining = dict(obs.excluded), set(obs.draining)
    known = (obs.known_nodes | frozenset(obs.nodes) | frozenset(excluded)
             | frozenset((obs.plan or {}).get("nodes", [])))
    for r in obs.requests:
        said = {"request": r.id, "actor": r.actor, "host": r.host, "reason": r.reason,
                **({"node": r.node} if r.node else {})}
        why = refusal(r.action, job.state, job.desired, node=r.node, known_nodes=known,
                      excluded=excluded, draining=draining, to=r.to, skip=r.skip)
        if why is not None:
            d.note("refused", f"{r.action} by {r.who} refused: {why}", **said)
            continue
        because = f": {r.reason}" if r.reason else ""
        if r.action == "pause":
            job = replace(job, desired="pause", desired_by=r.who, desired_reason=r.reason)
            control["pause"] = True
            if r.checkpoint:
                control["checkpoint"] = int(control.get("checkpoint", 0)) + 1
            d.note("pause", f"pause asked by {r.who}"
                   + (", after a checkpoint" if r.checkpoint else "") + because, **said)
        elif r.action == "resume":
            job = replace(job, desired=None, desired_by=r.who, desired_reason=r.reason)
            control["pause"] = False
            d.note("resume", f"resume asked by {r.who}{because}", **said)
        elif r.action == "stop":
            # A paused job stays paused: its ranks take the stop (SIGTERM) at the paused step.
            job = replace(job, desired="stop", desired_by=r.who, desired_reason=r.reason)
            d.note("stop", f"stop asked by {r.who}{because}", **said)
        elif r.action == "checkpoint":
            control["checkpoint"] = int(control.get("checkpoint", 0)) + 1
            d.note("checkpoint", f"checkpoint asked by {r.who}{because}: every rank saves "
                   "after its next step", **said)
        elif r.action in ("exclude", "drain"):
            record = {"reason": r.reason, "by": r.who, "host": r.host,
                      "time": r.time or time.time(), "mode": r.action}
            d.operator_exclude.append((r.node, record))
            excluded[r.node] = r.reason
            draining.discard(r.node)
            if r.action == "drain":
                draining.add(r.node)
            d.note(r.action, f"node {r.node} {'excluded' if r.action == 'exclude' else 'drains'}"
                   f" by {r.who}{because}", **said)
        elif r.action == "rewind":  # decide.py applies it
            if rewind is not None:
                d.note("refused", f"rewind by {r.who} refused: another rewind was asked in the "
                       "same moment; ask again once it is planned", **said)
                continue
            rewind = {"to": r.to, "skip": r.skip, "samples": r.samples, "by": r.who,
                      "reason": r.reason, "said": said}
        elif r.action == "include":
            d.include.append(r.node)
            excluded.pop(r.node, None)
            draining.discard(r.node)
            d.note("include", f"node {r.node} included again by {r.who}{because}", **said)
    d.job.update({"desired": job.desired, "desired_by": job.desired_by,
                  "desired_reason": job.desired_reason, "requests_seen": obs.requests[-1].id})
    if control != obs.control:
        d.control = control
    return replace(obs, job=job, excluded=excluded, draining=frozenset(draining),
                   rewind_asked=rewind)


def pause_transition(obs: Observed, d: Decision) -> None:
    """RUNNING -> PAUSING -> PAUSED while a pause is wanted; back to RUNNING once it is not."""
    job, plan = obs.job, obs.plan
    if job.desired == "pause":
        if job.state not in (PAUSING, PAUSED):
            d.job.update({"state": PAUSING, "reason": f"pausing: asked by {job.desired_by}; "
                          "every rank stops after the same step"})
        elif job.state == PAUSING and obs.paused_nodes >= len(plan["nodes"]):
            at = f" at step {obs.progress}" if obs.progress is not None else ""
            d.job.update({"state": PAUSED, "reason": f"paused{at} by {job.desired_by}"
                          + (f": {job.desired_reason}" if job.desired_reason else "")})
            d.note("paused", f"generation {plan['generation']}: every rank paused{at}")
    elif job.state in (PAUSING, PAUSED):
        # The stall clock starts again: a pause is not a hang.
        d.job.update({"state": RUNNING, "reason": f"resumed by "
                      f"{job.desired_by}", "progress_at": obs.now, "hang_since": None})
        d.note("resumed", f"generation {plan['generation']} resumes after step "
               f"{obs.progress}")
