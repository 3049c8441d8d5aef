"""A node's ranks as part of one data-parallel replica (`supervision.on_replica_loss:
continue`): the plan names each replica's world (`ReplicaWorlds`: consecutive nodes, where its
rank 0 listens, how often it was launched) and the quorum training now. A rank's torch world is
its replica's alone (optimus/parallel/replica_mode.py): its rank, world size and node rank are
counted inside the replica, and its launch names the quorum file and the newest quorum id it
must not join. A replica whose launch count grows is relaunched within the generation; the
others' ranks are not touched."""

from __future__ import annotations

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
    return node_rank % (len(plan.nodes) // len(plan.replicas.launches)) == 0


def world(plan: Plan, node: str, local_rank: int, quorum_file: Path) -> dict[str, str]:
    """The launch variables that place a rank of `node` in its replica's world."""
    worlds = plan.replicas
    per = len(plan.nodes) // len(worlds.launches)
    node_rank = plan.nodes.index(node)
    replica = node_rank // per
    rpn = plan.ranks_per_node
    return {env.RANK: str(own_rank(plan, node, node_rank * rpn + local_rank, local_rank)),
            env.WORLD_SIZE: str(per * rpn), env.NODE_RANK: str(node_rank % per),
            env.NUM_NODES: str(per), env.MASTER_ADDR: worlds.addrs[replica],
            env.MASTER_PORT: str(worlds.ports[replica]), env.QUORUM_FILE: str(quorum_file),
            env.REPLICA: str(replica), env.QUORUM_AFTER: str(worlds.after[replica])}


def own_rank(plan: Plan | None, node: str, rank: int, local_rank: int) -> int:
    """The rank a job rank knows itself as: its replica world's under replicas, else `rank`."""
    if plan is None or replica_of(plan, node) is None:
        return rank
    per = len(plan.nodes) // len(plan.replicas.launches)
    return (plan.nodes.index(node) % per) * plan.ranks_per_node + local_rank


def relaunch_due(plan: Plan, node: str, launched: int | None) -> bool:
    """Whether the plan relaunches `node`'s replica: its launch count moved past this node's."""
    replica = replica_of(plan, node)
    return replica is not None and launched is not None and \
        plan.replicas.launches[replica] != launched
