"""The leading controller's side of the nodes' own records (`Store.mirror`): find the nodes,
read their rows and what changed under `node:<node>:`, and write the job-wide records from them
in one transaction with the relay's cursors (controller/control/relay.py decides what passes).

Every job-wide record a node's word used to land in directly (`agents`, `beats`, the summary
sets, `nodes`, `unhealthy`, `registrations`, `exits`, `events`, `snapshots`, `stacks:<g>`,
`gen:<g>:master_port`) is now written by the controller only; their readers are unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from controller.store import wake
from controller.store.fence import Fence
from controller.store.names import is_node_name, own

EXITS_MAXLEN = 200_000  # > one generation's ranks at 131k ranks
EVENTS_MAXLEN = 10_000  # approximate (MAXLEN ~): Redis trims whole nodes of the stream
READ_COUNT = 500  # entries of one node's stream relayed per pass


@dataclass
class Writes:
    """One relay pass's writes to the job-wide records."""

    zadd: dict[str, dict[str, float]] = field(default_factory=dict)  # set -> member -> score
    zrem: dict[str, set[str]] = field(default_factory=dict)
    sadd: dict[str, set[str]] = field(default_factory=dict)
    srem: dict[str, set[str]] = field(default_factory=dict)
    nodes: dict[str, str] = field(default_factory=dict)  # node -> its record (JSON text)
    registrations: int = 0
    exits: list[str] = field(default_factory=list)  # JSON texts, in order
    events: list[dict[str, str]] = field(default_factory=list)
    snapshots: dict[str, str] = field(default_factory=dict)
    stacks: dict[int, dict[str, str]] = field(default_factory=dict)  # generation -> rank -> text
    ports: dict[int, int] = field(default_factory=dict)
    cursors: dict[str, str] = field(default_factory=dict)  # node -> JSON of its cursors

    def put(self, key: str, member: str, score: float | None) -> None:
        """`member` at `score` in sorted set `key`, or out of it (None)."""
        if score is None:
            self.zrem.setdefault(key, set()).add(member)
            self.zadd.get(key, {}).pop(member, None)
        else:
            self.zadd.setdefault(key, {})[member] = score
            self.zrem.get(key, set()).discard(member)

    def member(self, key: str, node: str, inside: bool) -> None:
        (self.sadd if inside else self.srem).setdefault(key, set()).add(node)

    def __bool__(self) -> bool:
        return any((self.zadd, self.zrem, self.sadd, self.srem, self.nodes, self.registrations,
                    self.exits, self.events, self.snapshots, self.stacks, self.ports,
                    self.cursors))


class Mirror:
    """The relay's reads and writes, through the Store's client `r`, key naming `k` and
    retrying `call`; a pass is fenced with the Store's `fence`."""

    def __init__(self, r: redis.Redis, k: Callable[[str], str], call: Callable, fence: Fence):
        self.r, self.k, self.call, self.fence = r, k, call, fence

    def discover(self) -> list[str]:
        """Every node that wrote a row (`node:<node>:row`: every write of an agent does), by
        SCAN: no job-wide set an agent could write names into. Names that are no node name
        are skipped."""
        head = self.k("node:").replace("{", "\\{").replace("}", "\\}")
        start = len(self.k("node:"))

        def scan():
            return [key[start:-len(":row")]
                    for key in self.r.scan_iter(match=head + "*:row", count=10_000)]
        return sorted(n for n in self.call(scan) if is_node_name(n))

    def rows(self, nodes: list[str]) -> list[str | None]:
        """The nodes' rows, in their order (None: none written), in one MGET."""
        if not nodes:
            return []
        return self.call(lambda: self.r.mget([self.k(own(n, "row")) for n in nodes]))

    def own_reads(self, asks: list[tuple[str, str, object]]) -> list:
        """Several reads of nodes' own keys in one round trip, each ("info", node, None),
        ("exits" or "events", node, after id), ("snapshots", node, None), ("stacks", node,
        generation) or ("port", node, generation)."""
        if not asks:
            return []

        def read():
            pipe = self.r.pipeline(transaction=False)
            for kind, node, arg in asks:
                if kind == "info":
                    pipe.get(self.k(own(node, "info")))
                elif kind in ("exits", "events"):
                    pipe.xrange(self.k(own(node, kind)), min=f"({arg}" if arg else "-",
                                count=READ_COUNT)
                elif kind == "snapshots":
                    pipe.hgetall(self.k(own(node, "snapshots")))
                elif kind == "stacks":
                    pipe.hgetall(self.k(own(node, f"stacks:{arg}")))
                else:
                    pipe.get(self.k(own(node, f"port:{arg}")))
            return pipe.execute()
        return self.call(read)

    def relay_cursors(self) -> dict[str, str]:
        """Node -> how far the relay got (JSON), as the last leader left it."""
        return self.call(lambda: self.r.hgetall(self.k("relayed")))

    def write(self, w: Writes, holder: str | None = None) -> bool:
        """The pass's writes and cursors, all or none (MULTI/EXEC), and only while `holder`
        holds the leader lease (WATCH: a controller that took it over meanwhile fails the
        transaction): a relayed exit or event is never written twice, by a leader that took
        over or by one that lost the lease mid-tick, nor skipped. False: not written."""
        if not w:
            return True

        def write():
            with self.r.pipeline(transaction=True) as pipe:
                if holder is not None and not self.fence.watched(pipe, holder):
                    return False
                try:
                    self._writes(pipe, w)
                    pipe.execute()
                except redis.WatchError:
                    return False
                return True
        written = self.call(write)
        if written and w.ports:  # the other nodes wait for it to start their ranks
            wake.publish(self, wake.AGENTS)
        return written

    def _writes(self, pipe, w: Writes) -> None:
        for key, members in w.zadd.items():
            if members:
                pipe.zadd(self.k(key), members)
        for key, members in w.zrem.items():
            if members:
                pipe.zrem(self.k(key), *members)
        for key, members in w.sadd.items():
            pipe.sadd(self.k(key), *members)
        for key, members in w.srem.items():
            pipe.srem(self.k(key), *members)
        if w.nodes:
            pipe.hset(self.k("nodes"), mapping=w.nodes)
        if w.registrations:
            pipe.incrby(self.k("registrations"), w.registrations)
        for text in w.exits:
            pipe.xadd(self.k("exits"), {"json": text}, maxlen=EXITS_MAXLEN,
                      approximate=True)
        for entry in w.events:
            pipe.xadd(self.k("events"), entry, maxlen=EVENTS_MAXLEN, approximate=True)
        if w.snapshots:
            pipe.hset(self.k("snapshots"), mapping=w.snapshots)
        for generation, stacks in w.stacks.items():
            pipe.hset(self.k(f"stacks:{generation}"), mapping=stacks)
            pipe.expire(self.k(f"stacks:{generation}"), 86_400)
        for generation, port in w.ports.items():
            pipe.set(self.k(f"gen:{generation}:master_port"), port, ex=86_400)
        if w.cursors:
            pipe.hset(self.k("relayed"), mapping=w.cursors)


def cursors(raw: str | None) -> dict:
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        value = {}
    return value if isinstance(value, dict) else {}
