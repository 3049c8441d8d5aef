"""Replicas that carry on (`supervision.on_replica_loss: continue`): the controller's rules, pure
like the rest of decide.py, which calls them.

Each data-parallel replica is a torch world of its own on consecutive nodes of the plan
(`ReplicaWorlds`: where its rank 0 listens, how often it was launched in this generation). The
controller is the quorum's authority: the plan names the replicas that train together now
(`Quorum`: an id that only grows, its members, the store their groups meet at: a member's
own world store, which stays where it is while that member does), and the agents hand it to
the ranks in a file (optimus/parallel/replicas.py does the rest: the exchange, the let-go, the
heal).

- `worlds`: a new generation's replicas and its first quorum, every replica a member.
- `current`: what the rules judge of a running generation: exits of a replica's earlier
  launch are over (its ranks were killed for the relaunch), and a replica out of the quorum
  holds nobody up (its heartbeats are no hang's evidence; its standbys are not behind).
- `leave`: a failure whose culprit is in replica r: r leaves the quorum (a new id without it,
  which lets the others' exchange go) and is relaunched within the generation, on a spare
  for a node that is excluded or gone (none free: it waits out of the quorum for one); the
  other replicas' ranks are not touched. Why not (too few replicas left for `min_replicas`,
  no culprit), for the restart that happens instead.
- `refill`: a replica waiting to start again gets a spare in place of a lost node once one is
  free, and its first node's fresh port once offered.
- `rejoin`: every rank of a relaunched replica waits to be let in (phase standby): a new
  quorum with it, whose members heal it from a peer at their next step boundary.
- `finished`: the job is done when the members' ranks all finished (a replica still out
  waits for nothing).
"""

from __future__ import annotations

from dataclasses import replace

from controller.control.detect import HARD, Evidence
from controller.control.recovery import replica_nodes
from controller.control.shortage import names
from controller.control.view import Decision, Observed, Settings


def active(plan: dict | None) -> bool:
    return bool(plan and plan.get("replicas") and plan.get("quorum"))


def _replica(plan: dict, node: str) -> int | None:
    return plan["nodes"].index(node) // replica_nodes(plan) if node in plan["nodes"] else None


def _nodes_of(plan: dict, replica: int) -> list[str]:
    per = replica_nodes(plan)
    return plan["nodes"][replica * per:(replica + 1) * per]


def _offered(obs: Observed, node: str, taken: set[int]) -> int:
    """The port `node`'s agent offers for a replica's store, unless a plan took it already
    (its status not yet renewed: that store may still listen there); 0 when none."""
    view = obs.nodes.get(node)
    port = view.next_port if view is not None else 0
    return 0 if port in taken else port


def _taken(plan: dict | None) -> set[int]:
    if not plan:
        return set()
    return {plan.get("master_port") or 0, *((plan.get("replicas") or {}).get("ports", []))}


def _quorum(qid: int, members: list[int], worlds: dict, before: dict | None = None) -> dict:
    """A quorum record. Its store is a member's own world store: the one the quorum `before`
    met at while its replica stays a member (a replica just relaunched may die again while
    the others connect to it; the others' store has served them all along), else the lowest
    member's."""
    host = None
    if before is not None:
        at = (before["store_addr"], before["store_port"])
        host = next((r for r in before["members"] if r in members
                     and (worlds["addrs"][r], worlds["ports"][r]) == at), None)
    host = min(members) if host is None else host
    return {"version": 1, "id": qid, "members": sorted(members),
            "store_addr": worlds["addrs"][host], "store_port": worlds["ports"][host]}


def worlds(obs: Observed, s: Settings, chosen: list[str]) -> tuple[dict, str | None]:
    """A new generation's plan fields (`replicas`, `quorum`), or why it waits: a replica's
    first node offers no port yet (its agent renews its offer within a tick)."""
    if not s.carry_on:
        return {}, None
    per = len(chosen) // s.replicas
    firsts = chosen[::per]
    taken = _taken(obs.plan)
    ports = [_offered(obs, n, taken) for n in firsts]
    if not all(ports):
        waiting = [n for n, p in zip(firsts, ports, strict=True) if not p]
        return {}, f"waiting for {names(waiting)} to offer its replica's port"
    qid = ((obs.plan or {}).get("quorum") or {}).get("id", 0) + 1
    made = {"addrs": [obs.nodes[n].host for n in firsts], "ports": ports,
            "launches": [0] * s.replicas, "after": [qid - 1] * s.replicas}
    return {"replicas": made, "quorum": _quorum(qid, list(range(s.replicas)), made)}, None


def current(obs: Observed, s: Settings) -> Observed:
    """The running generation as the rules judge it under replicas that carry on."""
    plan = obs.plan
    if not s.carry_on or not active(plan):
        return obs
    launches = plan["replicas"]["launches"]
    members = set(plan["quorum"]["members"])

    # A node no longer in the plan was replaced by a spare: what its ranks did is over.
    def now(node: str, launch: int) -> bool:  # of its replica's current launch
        r = _replica(plan, node)
        return r is not None and launch == launches[r]

    # A replica out of the quorum whose new launch runs: a heartbeat older than the plan
    # that relaunched it (or a deadline set before it) is its last launch's, not yet reset.
    def fresh(o) -> bool:
        return _replica(plan, o.node) in members or o.since >= plan.get("issued", 0.0)

    return replace(obs, exits=[e for e in obs.exits if now(e.node, e.launch)],
                   overdue=[o for o in obs.overdue if judged(obs, o.node) and fresh(o)],
                   suspects={n: b for n, b in obs.suspects.items()
                             if _replica(plan, n) in members})


def judged(obs: Observed, node: str) -> bool:
    """Whether what befalls `node` is judged: its replica is in the quorum, or its new launch
    runs there. A replica out of the quorum and not started again (it waits for a spare, or
    its launch has not begun) has nothing there to lose: its node is not lost again each tick."""
    plan = obs.plan
    r, view = _replica(plan, node), obs.nodes.get(node)
    return r is not None and (r in plan["quorum"]["members"] or (
        view is not None and view.launch == plan["replicas"]["launches"][r]))


def relevant(obs: Observed, s: Settings, found: list) -> list:
    """Of the evidence `found` (detect.py), what counts under replicas that carry on: none
    about a node excluded already whose replica is out and not running there (`judged`): it
    waits for a spare, and is not lost again at every tick."""
    if not s.carry_on or not active(obs.plan):
        return found
    return [e for e in found if e.node not in obs.excluded or _replica(obs.plan, e.node) is None
            or judged(obs, e.node)]


def finished(obs: Observed) -> bool:
    """Every rank of the quorum's members finished: those of a replica out wait for nothing
    (the job's end stops them), nor do those of a member let in too late to train, all of
    whose ranks still wait in phase standby (the others ended without meeting it)."""
    plan = obs.plan
    rpn, per = plan["ranks_per_node"], replica_nodes(plan)
    late = {r for r in plan["quorum"]["members"] if all(
        (v := obs.nodes.get(n)) is not None and v.standby >= rpn for n in _nodes_of(plan, r))}
    trained = [r for r in plan["quorum"]["members"] if r not in late]
    wanted = {r * per * rpn + i for r in trained for i in range(per * rpn)}
    return bool(trained) and wanted <= {e.rank for e in obs.exits if e.ok}


def leave(obs: Observed, s: Settings, d: Decision, culprit: Evidence | None,
          reason: str) -> str | None:
    """The culprit's replica leaves the quorum and is relaunched, on a spare in place of a node
    excluded or gone, or waits out of the quorum for one (None: done, the plan is `d.plan`);
    or why the job restarts instead."""
    plan = obs.plan
    if not active(plan):
        return "the generation runs without replicas"
    r = _replica(plan, culprit.node) if culprit is not None else None
    if r is None:
        return "no replica is to blame: no rank or node of the generation was named"
    quorum = plan["quorum"]
    members = [m for m in quorum["members"] if m != r]
    if len(members) < s.min_replicas:
        return (f"replica {r} lost, and replicas {members or 'none'} would be fewer than "
                f"supervision.min_replicas={s.min_replicas}")
    gone = {n for n, _ in d.exclude} | set(obs.excluded)
    nodes, swapped, missing = _place(obs, plan, r, gone, known=False)
    made = {k: list(v) for k, v in plan["replicas"].items()}
    qid = quorum["id"] + (r in quorum["members"])  # a replica already out: the same quorum
    made["launches"][r] += 1
    made["after"][r] = qid
    _address(obs, plan, made, r, nodes, missing)
    # The culprit, for its agent to kill at once: the replica's other ranks may go on in
    # process, as its next launch's (controller/node/replica_worlds.py `Survivors`).
    d.plan = {**plan, "nodes": nodes, "replicas": made, "issued": obs.now,
              "quorum": _quorum(qid, members, made, quorum),
              "reason": f"replica {r} lost: {reason}",
              "culprit": {"node": culprit.node, "rank": culprit.rank}}
    then = (f"waits out of the quorum for a spare node in place of {names(missing)} (none is "
            "free)" if missing else f"starts again (launch {made['launches'][r]}"
            + (f", on spare {names(swapped)}" if swapped else "") + ")")
    d.note("replica_lost", f"generation {plan['generation']}: replica {r} leaves the quorum "
           f"({reason}); quorum {qid} trains on with replicas {members}; replica {r} {then} "
           "and rejoins healed from a peer", generation=plan["generation"], replica=r,
           quorum=qid, members=members, launch=made["launches"][r], spares=swapped,
           waiting=missing)
    return None


def excluded(obs: Observed, s: Settings, d: Decision, node: str) -> str | None:
    """An operator excluded `node` while its replica is in the quorum: that replica alone
    leaves, as after a failure (a spare takes the node's slot, or it waits out of the quorum
    for one), but nothing failed: no restart is counted. None when done; else why the
    generation stops instead (too few replicas would be left)."""
    if not s.carry_on or not active(obs.plan):
        return "the generation runs without replicas"
    why = f"node {node} excluded by an operator ({obs.excluded[node]})"
    return leave(obs, s, d, Evidence(node, why, HARD, obs.now, "operator"), why)


def _place(obs: Observed, plan: dict, r: int, gone: set[str],
           known: bool) -> tuple[list[str], list[str], list[str]]:
    """Replica r's nodes with a spare in place of each one excluded or gone (`known`: a node
    with no view is gone too; else the views may not have been read): the plan's nodes so
    placed, the spares taken, the nodes still to replace."""
    nodes = list(plan["nodes"])
    spares = sorted(n for n, v in obs.nodes.items() if v.alive and v.healthy and not v.silent
                    and not v.excluded and n not in gone and n not in nodes)
    per, swapped, missing = replica_nodes(plan), [], []
    for i in range(r * per, (r + 1) * per):
        view = obs.nodes.get(nodes[i])
        if nodes[i] in gone or (view is None and known) or (view is not None and not view.alive):
            if spares:
                nodes[i] = spares.pop(0)
                swapped.append(nodes[i])
            else:
                missing.append(nodes[i])
    return nodes, swapped, missing


def _address(obs: Observed, plan: dict, made: dict, r: int, nodes: list[str],
             missing: list[str]) -> None:
    """Replica r's rank 0 address and port, from its first node: a port of 0 while it waits
    for a spare, or for its first node's fresh offer (`refill`)."""
    first = nodes[r * replica_nodes(plan)]
    made["addrs"][r] = obs.nodes[first].host if first in obs.nodes else made["addrs"][r]
    made["ports"][r] = 0 if missing else _offered(obs, first, _taken(plan))


def refill(obs: Observed, d: Decision) -> bool:
    """A replica waiting to start again (a port of 0): on a spare now free in place of a lost
    node, and with its first node's fresh port, once offered."""
    plan = obs.plan
    made = {k: list(v) for k, v in plan["replicas"].items()}
    nodes, taken = list(plan["nodes"]), set(obs.excluded)
    spared = []
    for r, port in enumerate(made["ports"]):
        if port:
            continue
        placed, swapped, missing = _place(obs, {**plan, "nodes": nodes}, r, taken, known=True)
        if missing:
            continue  # no spare yet
        nodes = placed
        spared += swapped
        _address(obs, {**plan, "nodes": nodes}, made, r, nodes, missing)
    if made == plan["replicas"] and nodes == plan["nodes"]:
        return False
    d.plan = {**plan, "nodes": nodes, "replicas": made, "issued": obs.now}
    if spared:
        d.note("replica_spare", f"generation {plan['generation']}: spare {names(spared)} takes "
               "the place of a lost node; its replica starts again there",
               generation=plan["generation"], spares=spared)
    return True


def out(plan: dict, node: str) -> bool:
    """Whether `node`'s replica is out of the quorum (an exclusion of it stops nothing)."""
    r = _replica(plan, node) if active(plan) else None
    return r is not None and r not in plan["quorum"]["members"]


def rejoin(obs: Observed, s: Settings, d: Decision) -> bool:
    """Replicas out of the quorum whose every rank of their current launch waits to be let in:
    a new quorum with them."""
    plan = obs.plan
    quorum, made = plan["quorum"], plan["replicas"]
    gen, rpn = plan["generation"], plan["ranks_per_node"]
    ready = []
    for r in range(len(made["launches"])):
        if r in quorum["members"] or not made["ports"][r]:
            continue
        views = [obs.nodes.get(n) for n in _nodes_of(plan, r)]
        if all(v is not None and v.alive and v.generation == gen
               and v.launch == made["launches"][r] and v.standby >= rpn for v in views):
            ready.append(r)
    if not ready:
        return False
    members = sorted({*quorum["members"], *ready})
    qid = quorum["id"] + 1
    d.plan = {**plan, "quorum": _quorum(qid, members, made, quorum), "issued": obs.now,
              "reason": f"replica(s) {ready} rejoin"}
    d.note("replica_rejoined", f"generation {gen}: replica(s) {ready} wait to be let in; "
           f"quorum {qid} trains with replicas {members}, and heals them from a peer at its "
           "next step boundary", generation=gen, replicas=ready, quorum=qid, members=members)
    return True
