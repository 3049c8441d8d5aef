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


def shortage(obs: Observed, s: Settings, usable: set[str], whole: bool = False) -> str:
    """Why the job waits: how many nodes the layout needs (all of them with `whole`: a first
    generation that may not start short), and what keeps the others out."""
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
    need = (f"{s.nodes}" if whole or s.allowed_nodes == (s.nodes,)
            else f"{min(s.allowed_nodes)} to {s.nodes}")
    refused = s.refusals.get(len(usable))  # the planner's reason the nodes left cannot run it
    return (f"waiting for nodes: the layout needs {need} x {s.ranks_per_node} ranks, "
            f"{len(usable)} healthy node(s) available"
            + (f" (on {len(usable)}: {refused})" if refused else "")
            + (f"; {'; '.join(why)}" if why else ""))


def resized(s: Settings, count: int) -> str:
    """How a generation on `count` of the job's nodes is laid out, and what the planner
    predicts of it against the full size (Settings.layouts)."""
    layout, full = s.layouts.get(count), s.layouts.get(s.nodes)
    if not layout or not layout["overrides"]:
        text = "the data-parallel degree shrinks with it"
        if layout and full:
            text += (f": {layout['layout']}, predicted {layout['tokens_per_s']:,.0f} tokens/s "
                     f"against {full['tokens_per_s']:,.0f} on {s.nodes}")
        return text
    text = f"the planner's layout {layout['layout']}"
    if full:
        text += (f" instead of {full['layout']}, predicted {layout['tokens_per_s']:,.0f} "
                 f"tokens/s against {full['tokens_per_s']:,.0f} on {s.nodes}")
    return text + "; the checkpoint is resharded to it"
