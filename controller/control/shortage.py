"""How the rules name nodes to people: a list of them, and why too few are usable. Pure
functions of the observed state (decide.py's vocabulary), apart from decide.py to keep it short."""

from __future__ import annotations

from controller.control.view import Observed, Settings


def names(nodes: list[str], shown: int = 8) -> str:
    """Node names for a message: all of a few, the first few of many (messages stay small at
    10,000 nodes: they go into every plan and the job record)."""
    if len(nodes) <= shown:
        return ", ".join(nodes)
    return f"{', '.join(nodes[:shown])} and {len(nodes) - shown} more"


def shortage(obs: Observed, s: Settings, usable: set[str]) -> str:
    """Why the job waits: how many nodes the layout needs, and what keeps the others out."""
    why = []
    for name, node in sorted(obs.nodes.items()):
        if name in usable:
            continue
        if node.excluded:
            why.append(f"{name} excluded ({node.excluded})")
        elif not node.alive:
            why.append(f"{name} silent")
        elif not node.healthy:
            why.append(f"{name} unhealthy ({node.health})")
    need = (f"{s.nodes}" if s.allowed_nodes == (s.nodes,)
            else f"{min(s.allowed_nodes)} to {s.nodes}")
    return (f"waiting for nodes: the layout needs {need} x {s.ranks_per_node} ranks, "
            f"{len(usable)} healthy node(s) available"
            + (f"; {'; '.join(why)}" if why else ""))
