"""Which checkpoint a generation starts from, and what evidence of wrong arithmetic takes away:
pure rules, like decide.py, which calls them.

- `window`: hard evidence that a tile computed wrong (detect.Evidence.wrong_arithmetic) opens
  a window at the moment its node last passed its health check; the job record keeps it
  (`suspect`) until the next generation is planned. One rule for disk and memory: no state
  taken inside it is resumed from (`memory_point`'s `distrust`).
- `set_aside`: once no rank of the failing generation runs, those checkpoints (the controller
  found which: `Observed.suspect_steps`) go to quarantine, before the next plan names one.
- `loaded`: rank 0's report of what its generation really loaded (it verifies every sha256 and
  sets aside what is corrupt; the plan only predicted, from sizes), into the job record and a
  `loaded` event.
- `memory_point`, `buddies`: the newest in-memory snapshot a next generation can resume from
  (every shard and its replica committed, and still held by a live node), and who holds each
  node's copy (controller/node/snapshots.py keeps them on the agents). The plan takes it over the
  disk checkpoint when it is at least as new and the layout stays the same; `memory_resume`
  maps the point onto the next generation's nodes (survivors keep their slots, a replacement
  takes a lost node's, preferring the one holding its copy).
- `lineage`, `failed_saves`: what the next plan carries on from the last one (which snapshot
  points a rollback voided; the streak of failed checkpoint saves).
"""

from __future__ import annotations

import time

from controller.control import fabric
from controller.control.detect import Evidence
from controller.control.view import Decision, JobView, Observed
from optimus.checkpoint.snapshot_files import extend_lineage, parse_point, void


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
    d.job["suspect"] = {**suspect, "set_aside": True}  # memory points are judged until the plan
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


def rebuddy(obs: Observed, d: Decision) -> None:
    """A spare that registered after the plan (the first spare of a job often does) takes the
    snapshot copies it would have been given: the same generation, re-issued with new buddies
    (each node's next point goes there) and the mesh check's ring with the spares as they are
    (controller/control/fabric.py)."""
    plan = obs.plan
    if obs.spares is None:
        return
    spares = sorted(set(obs.spares) - set(plan["nodes"]))
    given = buddies(plan["nodes"], spares, obs.spares)
    peers = fabric.ring(plan["nodes"], spares, obs.spares)  # the mesh check's ring, spares too
    if given == plan.get("buddies", {}) and peers == plan.get(fabric.PEERS, peers):
        return
    before = plan.get("buddies", {})
    moved = sorted(n for n in plan["nodes"]
                   if before.get(n, {}).get("node") != given.get(n, {}).get("node"))
    d.plan = {**plan, "buddies": given, fabric.PEERS: peers, "issued": obs.now}
    if moved:
        d.note("buddies", f"generation {plan['generation']}: the spares changed; snapshot "
               "copies now go " + "; ".join(
                   f"{n} -> {given[n]['node'] if n in given else 'nowhere'}"
                   for n in moved[:8]), generation=plan["generation"])


def memory_point(plan: dict | None, reports: dict[str, dict], alive: set[str],
                 disk_step: int | None, distrust: dict | None = None,
                 ) -> tuple[dict | None, str | None]:
    """The newest in-memory snapshot of `plan`'s generation layout that is usable, or None and
    why not (None, None: there is nothing to say, e.g. no snapshot newer than the disk).

    Points are tried newest first; usable means:
    - on the plan's line of generations: not void (snapshot_files.void: a later generation
      resumed from before it);
    - committed: every rank's shard (`slot_shards`) has a replica on another node, which that
      node checked against the shard's sha256 on receipt (and a node pushes only complete
      shards), as the agents' reports say — a node's earlier incarnation's report
      (`<node>@<incarnation>`) still proves what it received, though what it held is gone;
    - trusted: not taken after a tile that computed wrong last passed its health check
      (`distrust`: {"nodes", "since": that time or None, "after_step": with no passing check
      on record, the step the failing generation resumed from});
    - still there: each node slot's shards held whole, as its own or as a replica, by a node
      that is alive. (Nodes keep their own copy of a point until newer ones are confirmed, so
      the newest committed point usually has both.)
    The result: {"step", "generation", "slots": [the alive nodes holding slot i's shards, for
    each node slot i of the plan]}, with why the newest point newer than it was refused (lost or
    not trusted; None when none was); or None and why (the newest refused point's reason).
    """
    if not plan or not reports:
        return None, None
    nodes, shards = plan["nodes"], slot_shards(plan)
    lineage = plan.get("lineage", [])
    found: set[str] = set()
    taken: dict[str, float] = {}  # point -> the earliest time a shard of it was written
    for report in reports.values():
        found |= set(report.get("own", {})) | set(report.get("held", {}))
        for name, at in (report.get("taken") or {}).items():
            if isinstance(at, int | float):
                taken[name] = min(at, taken.get(name, at))
    why, incomplete = None, None
    for name in sorted((n for n in found if parse_point(n)), key=parse_point, reverse=True):
        step, generation = parse_point(name)
        if void(step, generation, lineage):
            continue  # an abandoned line: a later generation resumed from before it
        if disk_step is not None and step < disk_step:
            break  # the disk checkpoint is newer
        own = {n: set(r.get("own", {}).get(name, ())) for n, r in reports.items()}
        held = {n: set(r.get("held", {}).get(name, ())) for n, r in reports.items()}
        slots, lost = [], None
        for node, ranks in zip(nodes, shards, strict=True):
            owners = {n for n, have in own.items() if ranks <= have}
            # a copy is on another node than the shards': under replicas, than their writer's
            copies = {n for n, have in held.items() if ranks <= have} - (
                owners if plan.get("replicas") else {node})
            if not copies:
                slots = None
                break
            holders = sorted((owners | copies) & alive)
            if not holders and lost is None:
                gone = sorted({c.partition("@")[0] for c in copies})
                lost = (f"the memory snapshot of step {step} is lost: node {node} and the node "
                        f"holding its copy ({', '.join(gone)}) are both gone")
            slots.append(holders)
        if slots is None:
            incomplete = incomplete or step
            continue  # being written or replicated: an older point may be complete
        problem = lost or _distrusted(step, taken.get(name), distrust)
        if problem:
            why = why or problem
            continue  # an older point may be whole and trusted
        return {"step": step, "generation": generation, "slots": slots}, why
    if why:
        return None, why
    if incomplete is not None:
        return None, (f"no snapshot newer than the disk checkpoint is complete on every rank "
                      f"and replicated (the newest taken: step {incomplete})")
    return None, None


def slot_shards(plan: dict) -> list[set[int]]:
    """For each node slot of `plan`, the shards its ranks write and load: their ranks; under
    replicas that carry on, their ranks in their replica's world (only the writer replica takes
    snapshots, and every replica loads them at a restart: one copy of each position's shards,
    written by whichever replica wrote that point, serves the whole job)."""
    rpn, per = plan["ranks_per_node"], replica_nodes(plan)
    return [set(range(i % per * rpn, (i % per + 1) * rpn)) for i in range(len(plan["nodes"]))]


def replica_nodes(plan: dict) -> int:
    """The nodes of one replica in `plan` (replicas: consecutive nodes); every node without
    them (optimus/contract/records.py `Plan.replica_nodes`, for a plan as a dict)."""
    replicas = plan.get("replicas")
    return len(plan["nodes"]) // (len(replicas["launches"]) if replicas else 1)


def _distrusted(step: int, taken: float | None, distrust: dict | None) -> str | None:
    """Why a point computed while a bad tile's window was open is not resumed from."""
    if not distrust:
        return None
    if distrust.get("rewind"):
        floor = distrust.get("after_step") or 0
        return None if step <= floor else (
            f"the memory snapshot of step {step} is of the line a rewind abandons (it goes back "
            f"to step {floor}: {distrust['rewind']})")
    nodes = ", ".join(distrust.get("nodes", [])) or "a node"
    since = distrust.get("since")
    if since is not None:
        if taken is not None and taken <= since:
            return None
        return (f"the memory snapshot of step {step} was taken after {nodes} last passed its "
                f"health check ({clock(since)}): not trusted")
    floor = distrust.get("after_step")
    if floor is not None and step <= floor:
        return None
    return (f"the memory snapshot of step {step} was computed on {nodes}, which has no passing "
            "health check on record: not trusted")


def clock(t: float | None) -> str:
    return "an unknown time" if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def outlived(reports: dict[str, dict], step: int) -> list[str]:
    """Earlier incarnations' reports (`<node>@<incarnation>`) that prove nothing a recovery
    could still want: every point they name is older than `step`, a usable point of the running
    generation."""
    return sorted(key for key, report in reports.items() if "@" in key and all(
        (parse_point(name) or (0, 0))[0] < step
        for name in [*report.get("own", {}), *report.get("held", {})]))


def memory_resume(obs: Observed, chosen: list[str],
                  usable: set[str]) -> tuple[dict | None, str | None]:
    """The plan's `memory` entry when the next generation resumes from an in-memory snapshot
    (memory_point), with the nodes it runs on ("nodes": survivors keep their slots, a
    replacement takes a lost node's slot, preferring the node that holds its copy); or None and
    why not, when a snapshot newer than the disk checkpoint exists but cannot be used."""
    plan = obs.plan
    alive = {n for n, v in obs.nodes.items() if v.alive}
    window = obs.job.suspect
    distrust = obs.distrust or (window and {"nodes": window.get("nodes", []), "since": None,
                                            "after_step": window.get("resumed_step"),
                                            "rewind": window.get("rewind")})
    point, why = memory_point(plan and {**plan, "lineage": lineage(obs)},
                              obs.snapshots, alive, obs.latest_step, distrust)
    if point is None:
        return None, why
    previous = plan["nodes"]  # from here `why` says which newer point was refused, if one was
    if len(chosen) != len(previous):
        return None, (f"the next generation runs on {len(chosen)} nodes, not {len(previous)}: "
                      "a snapshot is only loaded by the layout that took it")
    free = sorted(usable - set(previous))  # every spare, not only those `chosen` took
    nodes, holders = [], {}
    for old, slot in zip(previous, point["slots"], strict=True):
        if old in usable:
            new = old
        else:
            new = next((n for n in slot if n in free), free[0])
            free.remove(new)
        nodes.append(new)
        if new not in slot:  # its shards come from a node that holds them
            # One still usable first: an excluded node may be alive but cut off from its peers.
            source = next((n for n in slot if n in usable), slot[0])
            holders[new] = {"node": source, "addr": obs.nodes[source].snapshot_addr}
    return {"step": point["step"], "generation": point["generation"], "holders": holders,
            "nodes": nodes}, why


def lineage(obs: Observed) -> list:
    """The running plan's lineage (snapshot_files.void), its last entry corrected by what rank
    0 reported loading when that is older than the plan predicted (a corrupt checkpoint)."""
    plan, job = obs.plan, obs.job
    if plan is None:
        return []
    line = list(plan.get("lineage", []))
    if (job.resumed_gen == plan["generation"] and job.resumed_step is not None and line
            and line[-1][0] == plan["generation"] and job.resumed_step < line[-1][1]):
        line = extend_lineage(line[:-1], plan["generation"], job.resumed_step)
    return line


def failed_saves(obs: Observed) -> int:
    """Checkpoint saves failed in a row so far, for the next generation to go on counting
    (checkpoint.max_failed_saves counts across the generations of a job): as the last
    generation's nodes last said, else as its plan carried it."""
    plan = obs.plan
    if plan is None:
        return 0
    said = [v.failed_saves for n in plan["nodes"] if (v := obs.nodes.get(n)) is not None
            and v.generation == plan["generation"] and v.failed_saves is not None]
    carried = plan.get("failed_saves")
    return max(said) if said else carried if isinstance(carried, int) and carried > 0 else 0
