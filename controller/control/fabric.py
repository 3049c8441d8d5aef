"""Faults of the ranks' network, named: who could not reach whom, and the one node every such
failure points at. Pure functions, like detect.py, which turns `cut` into evidence; the agents'
half of the mesh check is controller/node/mesh.py, the ring both use
controller/common/ring.py.

A failing pair is two nodes, one of which could not reach the other. Pairs come from:

- a failed rank's last lines (its exit record's `tail`): a connection that found no route to its
  peer, with the peer's address, as torch 2.13 words it (tests/test_fabric.py keeps real ones):
  gloo `timed out connecting: SO_ERROR: No route to host, remote=[10.231.1.11]:4431$1`, the
  TCPStore `failed to connect to any network address of (10.231.0.10, 29500). ... (errno: 113 -
  No route to host)`, NCCL `Connect to 10.231.1.11<43215> failed : No route to host`. The
  address is mapped to the node that registered it (`owners`). Not evidence: a refused
  connection (the peer's host answered; its process is gone, which is how every rank sees a
  peer that died), a TCPStore "timed out ... trying to connect" (a rendezvous whose server is not
  up yet says the same), gloo's "Connect timeout [none]" and a collective's "Timed out waiting"
  (they name nobody).
- the agents' mesh check: each agent connects to its ring neighbours' snapshot servers, every
  couple of seconds while a generation runs and before it launches one (then node 0's too);
  two failures in a row make a neighbour unreachable, said in the agent's status (`mesh`),
  validated here (`mesh_report`): only this generation's, only the reporter's own neighbours.

The culprit is the one node in every failing pair. That takes two pairs with distinct other
nodes: with two nodes only, "A could not reach B" is as much A's fault as B's; two separate
faults name nobody. And its own word: its ranks' or its agent's failures to reach the others.
A node whose peers cannot reach it and that says nothing (a host down, its agent gone) is left
to the rule that names a lost node (detect.py), whose exclusion may be lifted when it returns;
a node cut off from the ranks' network alone still reports through its management link. An
agent can name nobody but its own ring neighbours, so a lying agent alone makes only itself
the culprit.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from controller.common.probe import parse_address
from controller.common.ring import PEERS, REPORT_PEERS, Ring, ring  # noqa: F401 (the rules')
from controller.control.shortage import names

MESH = "mesh"  # the agent's status field that holds its mesh check's report
MAX_ADDRESSES = 32  # addresses of one node's record that are read (addresses.MAX_ADDRESSES)
REPORT_CHARS = 4096  # of one agent's mesh report
TAIL_CHARS = 16_384  # of a rank's tail that is searched (its agent sends its last 20 lines)
LINE_CHARS = 4096
TAIL_ADDRESSES = 8  # unreached addresses taken from one tail
EXITS_READ = 4096  # failed exits of a generation whose tails are read (the earliest)
SHOWN = 4  # addresses in a message

# errno texts that say a peer's host did not answer, or cannot be reached at all
# (EHOSTUNREACH, ENETUNREACH, EHOSTDOWN, ETIMEDOUT from the kernel's own SYN retries).
NO_PATH = re.compile(r"No route to host|Network is unreachable|Host is down|"
                     r"Connection timed out")
_IP = r"([0-9A-Fa-f.:]{2,45})(?:%[\w.-]{1,16})?"
# Where each names the peer, and whether by a host name too (the TCPStore: the plan's address).
PEER_ADDRESS = ((re.compile(rf"remote=\[{_IP}\]"), False),  # gloo
                (re.compile(r"network address of \(([\w.:-]{1,253}), \d{1,5}\)"), True),
                (re.compile(rf"Connect to {_IP}<\d{{1,5}}> failed"), False))  # NCCL
LOCAL_ADDRESS = re.compile(rf"local=\[{_IP}\]")  # gloo: the rank's own
HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?:\.(?!-)[A-Za-z0-9-]{1,63})*")


def address(text: str, by_name: bool = True) -> str:
    """An address as the rules compare them: an IP's compressed form, a host name (`by_name`)
    in lower case; "" for anything else, loopback, or unspecified (they name no node). An
    IPv6 scope (`%eth0`) is no part of it: messages print it or not."""
    try:
        ip = ipaddress.ip_address(text.partition("%")[0])
    except ValueError:
        name = text.lower()
        return name if (by_name and HOST_NAME.fullmatch(name) and name != "localhost"
                        and not name.replace(".", "").isdigit()) else ""
    return "" if ip.is_loopback or ip.is_unspecified or ip.is_multicast else ip.compressed


# --- what ranks said -------------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def unreached(tail: str) -> tuple[tuple[str, str], ...]:
    """(peer address, the rank's own address or "") for each connection a rank's last lines say
    found no route or no answer: each peer once, at most TAIL_ADDRESSES, from the last
    TAIL_CHARS characters (lines cut at LINE_CHARS). A refusal is no such line."""
    text = tail[-TAIL_CHARS:]
    if not NO_PATH.search(text):
        return ()
    found: dict[str, str] = {}
    for line in text.splitlines():
        line = line[:LINE_CHARS]
        if not NO_PATH.search(line):
            continue
        local = LOCAL_ADDRESS.search(line)
        mine = address(local.group(1), by_name=False) if local else ""
        for pattern, names_too in PEER_ADDRESS:
            for m in pattern.finditer(line):
                peer = address(m.group(1), names_too)
                if peer and peer != mine:
                    found.setdefault(peer, mine)
                if len(found) >= TAIL_ADDRESSES:
                    return tuple(found.items())
    return tuple(found.items())


def addresses_of(info: Mapping) -> list[str]:
    """The addresses a node's record (its own word) says it holds: its `addresses` (the first
    MAX_ADDRESSES) and its advertised host, each valid and not loopback."""
    raw = info.get("addresses")
    said = raw[:MAX_ADDRESSES] if isinstance(raw, list) else []
    host = info.get("host")
    said = [*said, host] if isinstance(host, str) else said
    return [a for a in (address(x) for x in said if isinstance(x, str) and len(x) <= 253) if a]


def owners(infos: Mapping[str, Mapping]) -> dict[str, str]:
    """Address -> the node whose record holds it. An address two nodes claim (a container
    bridge every host has; a record that lies) belongs to neither: it names nobody."""
    claimed: dict[str, str | None] = {}
    for node, info in infos.items():
        if not isinstance(info, Mapping):
            continue
        for a in set(addresses_of(info)):
            claimed[a] = node if a not in claimed else None
    return {a: n for a, n in claimed.items() if n is not None}


# --- what agents said ------------------------------------------------------------------------

def mesh_report(raw: object, node: str, ring_: Ring, generation: int,
                ) -> tuple[tuple[str, ...], bool] | None:
    """An agent's mesh report (its status field `mesh`, its own word): the neighbours it cannot
    reach, and whether it refused to launch the generation for it; None unless it is about
    `generation` and well formed. Names that are not its neighbours (or node 0) are dropped."""
    if not isinstance(raw, str) or not raw or len(raw) > REPORT_CHARS:
        return None
    try:
        said = json.loads(raw)
    except ValueError:
        return None
    if (not isinstance(said, dict) or type(said.get("generation")) is not int
            or said["generation"] != generation or not isinstance(said.get("unreachable"), list)):
        return None
    allowed = ring_.peers(node, launch=True)
    peers = {p for p in said["unreachable"][:REPORT_PEERS] if isinstance(p, str) and p in allowed}
    return tuple(sorted(peers)), said.get("refused") is True


# --- the rule --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Failure:
    """One failure to connect: `reporter` could not reach `peer` (at `address`), as `how`
    says ("rank 5": its exit's last lines; "mesh": its agent's mesh check)."""

    reporter: str
    peer: str
    address: str
    how: str


def culprit(pairs: Iterable[frozenset[str]]) -> str | None:
    """The one node in every failing pair, or None (no pair, two nodes only, two faults)."""
    common: set[str] | None = None
    for pair in pairs:
        common = set(pair) if common is None else common & pair
        if not common:
            return None
    return next(iter(common)) if common is not None and len(common) == 1 else None


def failures(obs) -> list[Failure]:
    """Every failure to connect the snapshot shows: the running generation's failed ranks'
    tails (their nodes' addresses as `obs.addresses` maps them) and the mesh reports."""
    found = []
    failed = [e for e in obs.exits if e.failed and e.tail][:EXITS_READ]
    for e in failed:
        for addr, mine in unreached(e.tail):
            if mine and obs.addresses.get(mine, e.node) != e.node:
                continue  # it says it ran elsewhere: not this node's word
            peer = obs.addresses.get(addr)
            if peer is not None and peer != e.node:
                found.append(Failure(e.node, peer, addr, f"rank {e.rank}"))
    if obs.mesh:
        ring_ = Ring.of(obs.plan)
        for node, peers in sorted(obs.mesh.items()):
            for peer in peers:
                host = parse_address(ring_.addrs.get(peer))
                found.append(Failure(node, peer, host[0] if host else "?", MESH))
    return found


@dataclass(frozen=True)
class Cut:
    """What the failures to connect say: the culprit and why, or (node None) nobody, with the
    plan's nodes that refused to launch on their mesh check (`refused`)."""

    node: str | None
    what: str
    refused: tuple[str, ...] = ()


def cut(obs) -> Cut | None:
    """The running generation's network verdict, or None when nothing failed to connect."""
    found = failures(obs)
    refused = tuple(sorted(obs.mesh_refused))
    if not found and not refused:
        return None
    node = culprit({frozenset((f.reporter, f.peer)) for f in found})
    if node is not None and any(f.reporter == node for f in found):
        return Cut(node, describe(node, found), refused)
    reporters = sorted({f.reporter for f in found} | set(refused))
    pairs = sorted({f"{f.reporter} -> {f.peer}" for f in found})
    return Cut(None, f"{names(reporters)} could not reach "
               f"{names(pairs) if pairs else 'their peers'} on the ranks' network; no single "
               "node is in every failing pair", refused)


def describe(node: str, found: list[Failure]) -> str:
    """The culprit's evidence: who could not reach it, at which address, and whom it could
    not reach."""
    into = [f for f in found if f.peer == node]
    out = [f for f in found if f.reporter == node]
    said = []
    if into:
        at = sorted({f.address for f in into})
        said.append(f"{names(sorted({f.reporter for f in into}))} could not reach it at "
                    f"{', '.join(at[:SHOWN])}")
    if out:
        at = sorted({f.address for f in out})
        said.append(f"it could not reach {names(sorted({f.peer for f in out}))} at "
                    f"{', '.join(at[:SHOWN])}")
    how = " and ".join(w for w, k in (("the ranks' connections", False), ("mesh checks", True))
                       if any((f.how == MESH) == k for f in found))
    return (f"node {node} is cut off from its peers on the ranks' network: "
            f"{'; '.join(said)} (by {how})")


def spare_cut(obs) -> list[tuple[str, str]]:
    """A spare of the ring that the rule names (no rank of it runs): (node, why), to exclude
    it without a restart; [] otherwise."""
    verdict = cut(obs)
    if (verdict is None or verdict.node is None or verdict.node in obs.excluded
            or verdict.node in obs.plan["nodes"]):
        return []
    return [(verdict.node, verdict.what)]


def ring_for(obs, chosen: list[str], usable: set[str]) -> list[list[str]]:
    """The ring of a new plan on `chosen`: the other usable nodes are its spares."""
    return ring(chosen, sorted(usable - set(chosen)),
                {n: v.snapshot_addr for n, v in obs.nodes.items()})
