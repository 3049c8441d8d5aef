"""Which checkpoint a generation starts from, and what evidence of wrong arithmetic takes away:
pure rules, like decide.py, which calls them.

- `window`: hard evidence that a tile computed wrong (detect.Evidence.wrong_arithmetic) opens
  a window at the moment its node last passed its health check; the job record keeps it
  (`suspect`) until the checkpoints committed inside it are set aside.
- `set_aside`: once no rank of the failing generation runs, those checkpoints (the controller
  found which: `Observed.suspect_steps`) go to quarantine, before the next plan names one.
- `loaded`: rank 0's report of what its generation really loaded (it verifies every sha256 and
  sets aside what is corrupt; the plan only predicted, from sizes), into the job record and a
  `loaded` event.
"""

from __future__ import annotations

from controller.detect import Evidence
from controller.view import Decision, JobView, Observed


def window(job: JobView, plan: dict, wrong: list[Evidence]) -> dict:
    """The job record's `suspect`: the nodes that computed wrong (with any window not acted on
    yet), and the step the failing generation resumed from (when no passing check is on
    record, everything after it is suspect)."""
    gen = plan["generation"]
    earlier = (job.suspect or {}).get("nodes", [])
    return {"nodes": sorted({e.node for e in wrong} | set(earlier)), "generation": gen,
            "evidence": wrong[0].what,
            "resumed_step": job.resumed_step if job.resumed_gen == gen
            else plan.get("resume_step")}


def distrust(wrong: list[Evidence]) -> str:
    nodes = ", ".join(sorted({e.node for e in wrong}))
    return (f"{nodes} computed wrong, so nothing since {nodes} last passed the health check is "
            "trusted; the checkpoints committed after that are set aside")


def set_aside(obs: Observed, d: Decision) -> None:
    """No rank of the generation that saw wrong arithmetic runs any more: set aside the
    checkpoints it makes suspect (the controller computed which: `obs.suspect_steps`)."""
    suspect = obs.job.suspect or {}
    d.set_aside = sorted((obs.suspect_steps or {}).items())
    d.job["suspect"] = None
    if d.set_aside:
        steps = [step for step, _ in d.set_aside]
        d.note("quarantine", f"checkpoint(s) of step {', '.join(map(str, steps))} set aside "
               f"as suspect: {d.set_aside[-1][1]} (evidence: {suspect.get('evidence', '?')})",
               steps=steps, nodes=suspect.get("nodes", []))


def loaded(obs: Observed, d: Decision) -> None:
    """Rank 0's report of what the running generation loaded: into the job record, and an
    event, which says so when it is not the checkpoint the plan named."""
    job, plan, report = obs.job, obs.plan, obs.resumed
    gen = plan["generation"]
    if report is None or job.resumed_gen == gen:
        return
    step, planned = report.get("step"), plan.get("resume_step")
    d.job.update({"resumed_gen": gen, "resumed_step": step})
    what = f"the checkpoint of step {step}" if step is not None else "scratch"
    message = f"generation {gen} resumed from {what}"
    aside = report.get("quarantined", [])
    if step != planned:
        message += (f", not from {'step ' + str(planned) if planned is not None else 'scratch'}"
                    " as planned")
    if aside:
        message += ": rank 0 set aside " + "; ".join(
            f"step {q['step']} ({q.get('reason') or 'corrupt'})" for q in aside)
    d.note("loaded", message, generation=gen, step="" if step is None else step,
           planned_step="" if planned is None else planned,
           quarantined=[q["step"] for q in aside])
