"""A plan's and a job record's small transformations, shared by the rules (decide.py and the
modules it applies: rewind.py)."""

from __future__ import annotations

from controller.control.view import JobView, Observed


def with_action(plan: dict | None, action: str, grace_s: float, reason: str,
                 now: float, save: bool = True) -> dict:
    """The plan with a new action; `save` False: the ranks it stops save nothing. A generation
    once told not to save (wrong arithmetic) is never told to save again: an operator's stop
    or the job's end while its ranks drain must not commit the suspect state."""
    base = plan or {"generation": -1, "nodes": [], "world_size": 0}
    save = save and base.get("save") is not False
    return {**base, "action": action, "grace_s": grace_s, "reason": reason, "issued": now,
            "save": save}


def live(obs: Observed, plan: dict) -> bool:
    """Whether any rank of `plan`'s generation still runs (on a node whose agent is alive:
    a lost agent's ranks die with it)."""
    return any((n := obs.nodes.get(name)) is not None and n.alive
               and n.generation == plan["generation"] and n.live_ranks > 0
               for name in plan["nodes"])


def counted(job: JobView, cause: str) -> dict:
    return {**job.restart_causes, cause: job.restart_causes.get(cause, 0) + 1}


def restarted(job: JobView, cause: str, now: float) -> dict:
    """The job record's fields for a restart of `cause`: its count, and where the job was when
    it was decided (the furthest step and when it was reached: `behind`), which the time lost
    is counted from once a later generation passes that step (watching.track_progress). A
    restart before the job got back there keeps the first one's: the time is lost to it."""
    behind = job.behind or {"generation": job.progress_gen, "step": job.progress_step,
                            "at": now if job.progress_at is None else job.progress_at,
                            "cause": cause}
    return {"restart_causes": counted(job, cause), "behind": behind}
