"""The mesh check's ring: the plan's nodes in order, then the spares, each probing its two
neighbours on the ranks' network (the controller plans it: controller/control/fabric.py; each
agent probes: controller/node/mesh.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PEERS = "peers"  # the plan's field that holds the ring
REPORT_PEERS = 8  # names in one agent's report (an agent probes 2, 3 before a launch)


def ring(nodes: list[str], spares: list[str], addrs: Mapping[str, str]) -> list[list[str]]:
    """The plan's `peers`: the mesh check's ring, [[node, its snapshot server's address or ""],
    ...]: the plan's nodes in their order (node 0, the rendezvous, first), then the spares that
    have a server. O(nodes) in the plan; each agent probes its two neighbours."""
    taken = set(nodes)
    return ([[n, addrs.get(n) or ""] for n in nodes]
            + [[n, addrs[n]] for n in spares if n not in taken and addrs.get(n)])


@dataclass(frozen=True)
class Ring:
    """A plan's ring, indexed: whom each member probes."""

    members: tuple[str, ...]
    addrs: dict[str, str]
    index: dict[str, int]
    first: str | None  # the plan's node 0

    @classmethod
    def of(cls, plan: Mapping | None) -> Ring:
        """The ring of a plan as the controller reads it (its fields as written)."""
        return cls.build((plan or {}).get("nodes") or [], (plan or {}).get(PEERS))

    @classmethod
    def build(cls, nodes: list[str], entries: object) -> Ring:
        """The ring of `entries` (a plan's `peers`), whose node 0 is the first of `nodes`."""
        entries = [e for e in entries if isinstance(e, list) and len(e) == 2
                   and all(isinstance(x, str) for x in e)] if isinstance(entries, list) else []
        members = tuple(e[0] for e in entries)
        return cls(members, {n: a for n, a in entries}, {n: i for i, n in enumerate(members)},
                   nodes[0] if nodes and nodes[0] in members else None)

    def peers(self, node: str, launch: bool = False) -> dict[str, str]:
        """Whom `node` probes, -> their addresses ("" where no server runs): its neighbours,
        and node 0 before a launch (its rendezvous)."""
        i = self.index.get(node)
        if i is None:
            return {}
        n = len(self.members)
        out = {p: self.addrs[p] for p in (self.members[(i - 1) % n], self.members[(i + 1) % n])
               if p != node}
        if launch and self.first is not None and self.first != node:
            out.setdefault(self.first, self.addrs[self.first])
        return out
