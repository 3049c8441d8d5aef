"""What the controller watches for in a running generation, one tick at a time: its progress
(the furthest step, and the time per step that the adaptive hang bound is made of), a stall
(hang: no step past the bound while every heartbeat is fresh, judged on the stacks it asks the
agents for) and stragglers. Pure functions of the snapshot, like the rest of decide.py, which
calls them from its watch of a running generation.
"""

from __future__ import annotations

import json

from controller.control import detect
from controller.control.detect import COLLATERAL, Evidence
from controller.control.view import Decision, Observed, Settings


def track_progress(obs: Observed, s: Settings, d: Decision) -> None:
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
    _recovered(obs, d)


def _recovered(obs: Observed, d: Decision) -> None:
    """A generation after a restart passed the step the job was at when the restart was
    decided: the time lost is the wall time since the job was last there, less the steps in
    between at the usual step time (the time they would have taken anyway). Detection, the
    restart, the load and the steps trained again are all in it."""
    job, gen, behind = obs.job, obs.plan["generation"], obs.job.behind
    if not behind or behind.get("generation") == gen or obs.progress <= behind["step"]:
        return
    steps = obs.progress - max(behind["step"], 0)
    usual = sorted(job.step_times)[len(job.step_times) // 2] if job.step_times else 0.0
    lost = max(0.0, obs.now - behind["at"] - steps * usual)
    cause = behind["cause"]
    d.job.update({"behind": None,
                  "lost_s": {**job.lost_s, cause: round(job.lost_s.get(cause, 0.0) + lost, 3)},
                  "last_recovery": {"generation": gen, "cause": cause, "seconds": round(lost, 3),
                                    "step": obs.progress, "time": obs.now}})
    d.note("recovered", f"generation {gen} passed step {behind['step']}, where the {cause} "
           f"restart found the job: {lost:.1f} s lost", generation=gen, cause=cause,
           seconds=round(lost, 3), step=behind["step"])


def stalled(obs: Observed, s: Settings) -> bool:
    job = obs.job
    if job.progress_at is None or job.progress_gen != obs.plan["generation"]:
        return False
    limit = detect.stall_threshold(job, s, obs.long_phase)
    if job.progress_moves < 2:  # not past the first step yet: startup takes its time
        limit = max(limit, s.startup_timeout_s)
    return obs.now - job.progress_at > limit


def hang(obs: Observed, s: Settings, d: Decision) -> tuple[list[Evidence], dict]:
    """Progress stalled while every heartbeat is fresh. First ask the agents for the stacks of
    the culprits and of a sample of the others; decide once they are in (or after
    stack_wait_s). Returns the evidence and the failure event's extra fields (none: wait)."""
    job, plan = obs.job, obs.plan
    culprits = detect.hang_culprits(obs)
    stalled_for = obs.now - job.progress_at
    threshold = detect.stall_threshold(job, s, obs.long_phase)
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
        return [Evidence("", f"{what}, every rank waiting", COLLATERAL, obs.now, "hang")], fields
    node, _, beat = culprits[0]
    return [Evidence(node, f"{what}: {named}, while the others wait in a collective", "soft",
                     obs.now, "hang", beat.get("rank"))], fields


def stragglers(obs: Observed, s: Settings, d: Decision) -> dict[str, str]:
    """Report nodes that turned slow (an event each); keep the list in the job record."""
    slow = detect.straggling(obs, s)
    kept = "" if s.straggler_action != "exclude" or replaceable(obs, s, slow) else (
        f", but nothing could take its place ({obs.spare_count} spare(s)): it stays in the job "
        "until a node can")
    for node in sorted(set(slow) - set(obs.job.stragglers)):
        d.note("straggler", slow[node] + f"; straggler_action={s.straggler_action}" + kept,
               node=node)
    if set(slow) != set(obs.job.stragglers):
        d.job["stragglers"] = sorted(slow)
    return slow


def replaceable(obs: Observed, s: Settings, slow: dict[str, str]) -> bool:
    """Whether a generation could run without the slow nodes: on the plan's other nodes and
    the spares, at a node count the job allows. A slow job is better than one that waits for
    nodes (unknown spares, as in a hand-made Observed: assumed replaceable)."""
    if not slow or obs.spare_count is None:
        return True
    left = len(obs.plan["nodes"]) - len(slow) + obs.spare_count
    return any(c <= left for c in s.allowed_nodes)
