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
- `memory_point`, `buddies`: the newest in-memory snapshot a next generation can resume from
  (every shard and its replica committed, and still held by a live node), and who holds each
  node's copy (controller/snapshots.py keeps them on the agents). The plan takes it over the
  disk checkpoint when it is at least as new and the layout stays the same.
"""

from __future__ import annotations

from controller.detect import Evidence
from controller.view import Decision, JobView, Observed
from optimus.checkpoint.snapshot_files import parse_point


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
    what = (("the memory snapshot" if report.get("source") == "memory" else "the checkpoint")
            + f" of step {step}") if step is not None else "scratch"
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
           source=report.get("source", "disk"),
           quarantined=[q["step"] for q in aside])


# --- in-memory snapshots ---------------------------------------------------------------------

SPARE_LOAD = 2  # nodes whose copies one spare holds at most (each is a node's snapshot in RAM)


def buddies(chosen: list[str], spares: list[str], addrs: dict[str, str]) -> dict[str, dict]:
    """Who holds each node's snapshot copy: {node: {"node", "addr"}}. A spare when there is
    room on one (a spare that replaces the node then already holds its shards), else the next
    node of the generation, so that no single lost node takes both copies. A lone node with no
    spare has no buddy: its snapshots never become usable (the disk checkpoint stays the
    recovery point)."""
    spares = [s for s in spares if addrs.get(s)]
    out = {}
    for i, node in enumerate(chosen):
        if i < SPARE_LOAD * len(spares):
            buddy = spares[i % len(spares)]
        elif len(chosen) > 1:
            buddy = chosen[(i + 1) % len(chosen)]
        else:
            continue
        if addrs.get(buddy):
            out[node] = {"node": buddy, "addr": addrs[buddy]}
    return out


def memory_point(plan: dict | None, reports: dict[str, dict], alive: set[str],
                 disk_step: int | None) -> tuple[dict | None, str | None]:
    """The newest in-memory snapshot of `plan`'s generation layout that is usable, or None and
    why not (None, None: there is nothing to say, e.g. no snapshot newer than the disk).

    Usable means committed — every rank's shard has a replica on another node, which that node
    checked against the shard's sha256 on receipt (and a node pushes only complete shards), as
    the agents' reports say — and still there: each node slot's shards held whole, as its own
    or as a replica, by a node that is alive. (Nodes keep their own copy of a point until
    newer ones are confirmed, so the newest committed point usually has both.) The result:
    {"step", "generation", "slots": [the alive nodes holding slot i's shards, for each node
    slot i of the plan]}.
    """
    if not plan or not reports:
        return None, None
    nodes, rpn = plan["nodes"], plan["ranks_per_node"]
    found: set[str] = set()
    newest = None
    for report in reports.values():
        found |= set(report.get("own", {}))
    for name in sorted((n for n in found if parse_point(n)), key=parse_point, reverse=True):
        step, generation = parse_point(name)
        if disk_step is not None and step < disk_step:
            break  # the disk checkpoint is newer
        own = {n: set(r.get("own", {}).get(name, ())) for n, r in reports.items()}
        held = {n: set(r.get("held", {}).get(name, ())) for n, r in reports.items()}
        slots, lost = [], None
        committed = True
        for i, node in enumerate(nodes):
            ranks = set(range(i * rpn, (i + 1) * rpn))
            owners = {n for n, have in own.items() if ranks <= have}
            copies = {n for n, have in held.items() if ranks <= have} - {node}
            if not copies:
                committed = False
                break
            holders = sorted((owners | copies) & alive)
            if not holders and lost is None:
                lost = (f"the memory snapshot of step {step} is lost: node {node} and the node "
                        f"holding its copy ({', '.join(sorted(copies))}) are both gone")
            slots.append(holders)
        if not committed:
            newest = newest or step
            continue  # being written or replicated: an older point may be complete
        if lost:
            return None, lost
        return {"step": step, "generation": generation, "slots": slots}, None
    if newest is not None:
        return None, (f"no snapshot newer than the disk checkpoint is complete on every rank "
                      f"and replicated (the newest taken: step {newest})")
    return None, None
