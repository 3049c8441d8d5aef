"""A node's ranks as part of one data-parallel replica (`supervision.on_replica_loss:
continue`): the plan names each replica's world (`ReplicaWorlds`: consecutive nodes, where its
rank 0 listens, how often it was launched) and the quorum training now. A rank's torch world is
its replica's alone (optimus/parallel/replica_mode.py): its rank, world size and node rank are
counted inside the replica, and its launch names the quorum file and the newest quorum id it
must not join. A replica whose launch count grows is relaunched within the generation (the
ranks of it that the fault did not touch go on in process: `Survivors`); the others' ranks are
not touched."""

from __future__ import annotations

import time
from pathlib import Path

from optimus.contract import env
from optimus.contract.records import Plan


def replica_of(plan: Plan, node: str) -> int | None:
    """The replica `node`'s ranks are part of; None outside replica mode (or the plan)."""
    if plan.replicas is None or node not in plan.nodes:
        return None
    return plan.replica_of(plan.nodes.index(node))


def leads(plan: Plan, node: str) -> bool:
    """Whether `node` is its replica's first, whose rank 0 hosts the replica's store."""
    node_rank = plan.nodes.index(node)
    return node_rank % plan.replica_nodes == 0


def world(plan: Plan, node: str, local_rank: int, quorum_file: Path) -> dict[str, str]:
    """The launch variables that place a rank of `node` in its replica's world."""
    worlds = plan.replicas
    per = plan.replica_nodes
    node_rank = plan.nodes.index(node)
    replica = node_rank // per
    rpn = plan.ranks_per_node
    return {env.RANK: str(own_rank(plan, node, node_rank * rpn + local_rank, local_rank)),
            env.WORLD_SIZE: str(per * rpn), env.NODE_RANK: str(node_rank % per),
            env.NUM_NODES: str(per), env.MASTER_ADDR: worlds.addrs[replica],
            env.MASTER_PORT: str(worlds.ports[replica]), env.QUORUM_FILE: str(quorum_file),
            env.REPLICA: str(replica), env.QUORUM_AFTER: str(worlds.after[replica]),
            env.REPLICA_LAUNCH: str(worlds.launches[replica])}


def own_rank(plan: Plan | None, node: str, rank: int, local_rank: int) -> int:
    """The rank a job rank knows itself as: its replica world's under replicas, else `rank`."""
    if plan is None or replica_of(plan, node) is None:
        return rank
    return (plan.nodes.index(node) % plan.replica_nodes) * plan.ranks_per_node + local_rank


def relaunch_due(plan: Plan, node: str, launched: int | None) -> bool:
    """Whether the plan relaunches `node`'s replica: its launch count moved past this node's."""
    replica = replica_of(plan, node)
    return replica is not None and launched is not None and \
        plan.replicas.launches[replica] != launched


# A relaunch's survivors: the ranks of the relaunched replica that the fault did not touch get
# this long to leave their launch in process (a collective with the lost peer fails at once
# when it died; one with a peer gone silent on another node waits out its timeout) before
# they are killed and started again as new processes.
LEAVE_LAUNCH_S = 10.0


class Survivors:
    """Who of a relaunched replica's ranks on this node go on in process. On a relaunch the
    culprit the plan names is SIGKILLed at once; the others, still running, get LEAVE_LAUNCH_S
    to leave the launch on their own (optimus/supervision/inprocess.py: a peer's loss), after
    which they are killed too. Ranks that left wait in process and become ranks of the next
    launch (Ranks.launch), beside new processes in the places of those that died: no imports,
    no device context again."""

    def __init__(self) -> None:
        self.by: tuple[int, float] | None = None  # (the launch, when its wait ends)

    def gone(self, procs, plan: Plan, node: str, kill) -> bool:
        """Whether every rank in `procs` has left its replica's last launch (dead, or waiting
        in process); `kill(p)` SIGKILLs one."""
        launch = plan.replicas.launches[replica_of(plan, node)]
        now = time.monotonic()
        if self.by is None or self.by[0] != launch:
            self.by = (launch, now + LEAVE_LAUNCH_S)
        named = plan.culprit
        running = [p for p in procs if p.running and not p.kill_sent]
        for p in running:
            if named is not None and named.node == node and named.rank in (None, p.rank):
                kill(p)
        return not [p for p in running if not p.kill_sent] or now >= self.by[1]
