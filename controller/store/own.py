"""What an agent writes: its own node's records, every one under `node:<node>:` (`Store.own`).

One agent's credentials reach its own node's keys and nothing else an agent could write
(docs/security.md: a per-node ACL user, `controller/store/acl.py`): its record (`info`: devices,
health, snapshot address), its status and its ranks' heartbeats, one `row` per tick (its beat,
its ranks' deadline and summary, and a token per stream or record below that changed), its exits
and events (streams), its snapshot and stack reports and the rendezvous port it picked. Its
commands stay at `commands:<node>`, outside that prefix, where it may only pop them. The
leading controller relays these into the job-wide records every reader reads
(controller/store/mirror.py, controller/control/relay.py), taking each node's word about itself
only: an exit for a rank the plan puts elsewhere, a port for a generation whose rank 0 runs
elsewhere, an event in another's name, are not relayed.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from controller.store import decode, wake
from controller.store.names import check, own
from controller.store.summaries import NodeSummary
from optimus.contract.records import ExitRecord

OWN_EXITS_MAXLEN = 10_000  # a node's own exit records not yet relayed are far fewer
OWN_EVENTS_MAXLEN = 1_000

# The row: one string of space-separated fields, in this order ("-": none). Compact because the
# controller reads every node's row every tick (one MGET) and a JSON decode per row would cost
# ~10 us: 100 ms a tick at 10,923 nodes.
# `seq` is the writer's monotonic clock at the write: a row that reaches Redis after a newer
# one of the same incarnation (a write a network cut held in the kernel's send buffer, delivered
# after the heal) is known late and not relayed (controller/control/relay.py).
ROW_VERSION = "r2"
ROW_FIELDS = ("beat", "deadline", "max_step", "min_step", "outside", "nonfinite", "compute_s",
              "paused", "oldest", "peak_allocated", "peak_reserved",
              "info", "exits", "events", "snapshots", "stacks", "port", "seq")
INCARNATION = re.compile(r"[\w.-]{1,64}")  # how an agent names its incarnation
TOKENS = ("info", "exits", "events", "snapshots", "stacks", "port")


@dataclass
class AgentTick:
    """What one agent tick read back: the plan's stamp, commands, whether to re-register."""

    plan_stamp: str | None  # changes with every new plan; read the plan itself only then
    commands: list[dict]
    registered: bool
    control: dict | None = None  # what the ranks are asked: {"pause": bool, "checkpoint": n}
    align: str | None = None  # the snapshot point to push next, named by the controller
    keep: str | None = None  # the usable snapshot point to keep, named by the controller


def as_text(value: Any) -> str:
    """A value as a Redis hash field holds it."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value)


def row_text(fields: dict[str, Any]) -> str:
    words = [ROW_VERSION]
    for name in ROW_FIELDS:
        value = fields.get(name)
        words.append("-" if value is None or value == "" else
                     ("1" if value else "0") if isinstance(value, bool) else
                     repr(value) if isinstance(value, float) else str(value))
    return " ".join(words)


class OwnRecords:
    """An agent's writes, under its node's own keys, through the Store's client `r`, key naming
    `k` and retrying `call`. An agent's store `speak_as` its node first: its events then go to
    the node's own stream (`add_events`), and the writes that name no node are its node's. Each
    node's row keeps the latest value of each field, so a write between ticks (an exit, an
    event, a snapshot report) re-sends the row with its new token."""

    def __init__(self, r: redis.Redis, k: Callable[[str], str], call: Callable):
        self.r, self.k, self.call = r, k, call
        self.node: str | None = None  # the node this store writes for (`speak_as`)
        self._rows: dict[str, dict[str, Any]] = {}  # node -> its row's fields

    def speak_as(self, node: str) -> None:
        """This store writes for `node` only: its events go to the node's own stream."""
        self.node = check(node)

    def _own(self, name: str, node: str | None = None) -> str:
        return self.k(own(node or self.node, name))

    def put_row(self, pipe, node: str | None = None, **fields: Any) -> None:
        """Queue on `pipe` the node's row, `fields` changed (the rest as last written)."""
        node = node or self.node
        row = self._rows.setdefault(node, {})
        row.update(fields, seq=time.monotonic())
        pipe.set(self._own("row", node), row_text(row))

    def add_events(self, pipe, entries: list[dict[str, str]]) -> bool:
        """Queue on `pipe` the XADD of each event to the node's own stream, for the controller
        to relay, and its row with their token. False, nothing queued, when this store writes
        for no node (its events are the job's: `Store.flush_events`)."""
        if self.node is None:
            return False
        for entry in entries:
            pipe.xadd(self._own("events"), entry, maxlen=OWN_EVENTS_MAXLEN, approximate=True)
        if entries:
            self.put_row(pipe, events=time.time_ns())
        return True

    def register_node(self, node: str, info: dict) -> None:
        """The node's record; the controller finds it within a second (`Mirror.discover`)."""
        check(node)  # ValueError: the agent's --node was checked; this is a bug, not an input
        self.set_health(node, info, beat=time.time())

    def set_health(self, node: str, info: dict, **row: Any) -> None:
        """The node's record (devices, health, snapshot address), as its agent knows it."""
        def write():
            pipe = self.r.pipeline()
            pipe.set(self._own("info", node), json.dumps(info))
            self.put_row(pipe, node, info=time.time_ns(), **row)
            pipe.execute()
        self.call(write)

    def agent_tick(self, node: str, status: dict, rank_beats: dict[int, dict],
                   deadline: float | None, reset_ranks: bool,
                   summary: NodeSummary | None = None) -> AgentTick:
        """An agent's whole periodic traffic in one round trip: its status, its ranks' latest
        heartbeats, its row (beat, deadline, summary: None when no rank of a generation runs
        here), and back the plan's stamp, its commands, whether its record is still there, the
        control word and the snapshot point to push next (snapshot_watch.py)."""
        s = summary
        fields = dict(beat=time.time(), deadline=deadline,
                      max_step=s and s.max_step, min_step=s and s.min_step,
                      outside=s and s.outside, nonfinite=s and s.nonfinite,
                      compute_s=s and s.compute_s, paused=s and s.paused,
                      oldest=s and s.oldest_beat, peak_allocated=s and s.peak_allocated,
                      peak_reserved=s and s.peak_reserved)
        generation = status.get("generation", -1)

        def tick():
            pipe = self.r.pipeline(transaction=False)
            pipe.hset(self._own("status", node),
                      mapping={k: as_text(v) for k, v in status.items()})
            if reset_ranks:
                pipe.delete(self._own("ranks", node))
            if rank_beats:
                pipe.hset(self._own("ranks", node),
                          mapping={str(lr): json.dumps(b) for lr, b in rank_beats.items()})
            self.put_row(pipe, node, **fields)
            pipe.get(self.k("plan:stamp"))
            pipe.lpop(self.k(f"commands:{node}"), 100)
            pipe.exists(self._own("info", node))
            pipe.get(self.k("control"))
            pipe.get(self.k(f"gen:{generation}:align"))
            return pipe.execute()[-5:]
        stamp, commands, registered, control, align = self.call(tick)
        return AgentTick(stamp, [c for c in map(decode.record, commands or []) if c],
                         bool(registered), decode.record(control) if control else None,
                         *decode.points(align, 2))

    def leave(self, node: str) -> None:
        """An agent going away cleanly: no beat, no deadline (its record stays, marked)."""
        def write():
            pipe = self.r.pipeline()
            pipe.hset(self._own("status", node), "state", "gone")
            self.put_row(pipe, node, beat=None, deadline=None)
            pipe.execute()
        self.call(write)

    def report_exit(self, record: ExitRecord) -> str:
        """A rank's exit, under its node's (`record.node`) own stream."""
        node = check(record.node)
        text = json.dumps(record.record())

        def write():
            pipe = self.r.pipeline()
            pipe.xadd(self._own("exits", node), {"json": text},
                      maxlen=OWN_EXITS_MAXLEN, approximate=True)
            self.put_row(pipe, node, exits=time.time_ns())
            return pipe.execute()[0]
        entry = self.call(write)
        wake.publish(self, wake.CONTROLLER)  # the controller judges the generation now
        return entry

    def set_master_port(self, generation: int, port: int) -> None:
        """The rendezvous port of `generation`, which the plan's first node picks; the
        controller relays it to the others only from that node."""
        def write():
            pipe = self.r.pipeline()
            pipe.set(self._own(f"port:{generation}"), int(port), ex=86_400)
            self.put_row(pipe, port=f"{generation}:{int(port)}")
            pipe.execute()
        self.call(write)
        wake.publish(self, wake.CONTROLLER)  # it relays the port to the other nodes

    def put_stacks(self, generation: int, stacks: dict[int, str]) -> None:
        """Hung ranks' stacks (rank -> text); relayed for the ranks the plan puts here."""
        key = self._own(f"stacks:{generation}")

        def write():
            pipe = self.r.pipeline()
            pipe.hset(key, mapping={str(r): text for r, text in stacks.items()})
            pipe.expire(key, 86_400)
            self.put_row(pipe, stacks=f"{generation}:{time.time_ns()}")
            pipe.execute()
        self.call(write)

    def set_snapshots(self, node: str, report: dict, first: bool = False) -> None:
        """What in-memory snapshots the node holds (controller/node/snapshots.py: its address,
        its own ranks' complete points, the replicas it holds, which points its buddy confirmed).
        Written when it changes; a lost node's last report stays, as the record of what was
        replicated before it went. The `first` report of a new incarnation of the node (its
        agent restarted) keeps the earlier one's as `@<incarnation>`, relayed as
        `<node>@<incarnation>`, where it still proves what was replicated to it until the
        controller has a newer point (`drop_snapshots`)."""
        key = self._own("snapshots", node)

        def write():
            pipe = self.r.pipeline()
            if first:
                old = self.r.hget(key, "now")
                was = incarnation(old)
                if old and was != report.get("incarnation"):
                    pipe.hset(key, f"@{was}", old)
            pipe.hset(key, "now", json.dumps(report))
            self.put_row(pipe, node, snapshots=time.time_ns())
            pipe.execute()
        self.call(write)


def incarnation(raw: str | None) -> str:
    """The incarnation a stored snapshots report names ("earlier": none, or unreadable)."""
    try:
        was = json.loads(raw).get("incarnation") if raw else None
    except (ValueError, AttributeError):
        was = None
    return was if isinstance(was, str) and INCARNATION.fullmatch(was) else "earlier"
