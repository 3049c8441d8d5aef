"""The whole Redis schema of a job, in one package (documented in docs/redis-schema.md): the
`Store` here, and the parts it is made of, each beside it.
Every node name read back from Redis passes the one rule of names.py: what is no node name (an
agent's credentials can write any) is dropped where it is read, and noted (`Store.names`); the
plan and every exit record are the contract's typed records (optimus/contract/records.py),
written through their types and checked where they are read: one with a missing or mistyped
field is dropped, and noted in one line that names the field (`Store.records`).

Every key lives under `optimus:{<job>}:` (the braces are a Redis Cluster hash tag: one job, one
slot). Redis is the only state the control plane shares; the controller keeps none of its own.

Every call has a socket timeout and is retried with tenacity on connection errors and timeouts
(a Redis restart, a failover); after the retries a `StoreUnavailable` is raised, which agents
and the controller ride out (ranks never talk to Redis: an outage never stops training). A
command or credentials Redis refuses (NOPERM, WRONGPASS, NOAUTH) raise `Denied` at once
(controller/store/connect.py): no retry mends them.
The agent's per-tick traffic is one pipelined round trip per node (`OwnRecords.agent_tick`).

Clocks: heartbeat deadlines and agent beats are wall-clock times (time.time()) written by
agents and compared by the controller; hosts are assumed NTP-synchronised (skew well under the
timeouts, which are seconds).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from controller.store import decode, wake
from controller.store.connect import connect, denial, is_sentinel, safe_url
from controller.store.fence import Batch, Fence
from controller.store.mirror import EVENTS_MAXLEN, Mirror
from controller.store.names import Refused, own
from controller.store.own import OwnRecords, as_text
from controller.store.reports import Reports
from controller.store.summaries import Summaries
from optimus.contract.records import VERSION, ExitRecord, Plan

T = TypeVar("T")

EVENT_WAIT_MS = 500  # behind Sentinel: how long an event write waits for a replica's copy
ALONE_S = 30.0  # how long a primary found without a replica is not waited on again
UNSENT_MAX = 10_000  # events kept in a process while Redis is unreachable (the oldest go)
REQUESTS_MAXLEN = 1_000
TRANSIENT = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)

class StoreUnavailable(Exception):
    """Redis did not answer within the retry budget."""


def redis_url(explicit: str | None = None) -> str:
    """`explicit`, else $REDIS_URL, else the local default (redis://, rediss:// or
    redis+sentinel://, with user:password@ for ACLs: controller/store/connect.py)."""
    return explicit or os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"


def prefix(job: str) -> str:
    return f"optimus:{{{job}}}:"


class Store:
    """One job's keys. All methods raise `StoreUnavailable` once retries are spent. The Store
    holds the connection (`r`, `k`, `call`), the job-wide records and the events; its parts
    each read and write through that connection and own what they keep: `fence` (fence.py: the
    leader lease, and a decision's writes, now or in its batch), `own` (own.py: what an agent
    writes under its node's own keys), `mirror` (mirror.py: the leading controller's relay of
    them), `summaries` (summaries.py: the nodes' summary rows) and `reports` (reports.py: their
    snapshot and stack reports). A write a decision makes takes `batch`: it then lands with the
    rest of the decision (`commit`)."""

    def __init__(self, url: str, job: str, *, timeout_s: float = 2.0, retry_s: float = 5.0):
        self.url, self.job, self.p = url, job, prefix(job)
        self.retry_s = retry_s
        try:
            self.r = connect(url, timeout_s)
        except ValueError as e:  # a malformed URL
            raise StoreUnavailable(f"REDIS_URL {safe_url(url)!r} is not a Redis URL: "
                                   f"{e}") from None
        # Behind Sentinel, an event counts as written once a replica has it too (WAIT): the
        # primary may die before it replicates. A lone server has no replica to wait for.
        self.replicas = 1 if is_sentinel(url) else 0
        self.unsent: deque[dict[str, str]] = deque(maxlen=UNSENT_MAX)
        self._sending = threading.Lock()
        self.trouble_at = 0.0  # wall time of the last call that found Redis unreachable
        self._alone_until = 0.0  # monotonic time until which events wait for no replica
        self.names = Refused()  # node names read here and dropped: the controller says them
        self.records = decode.Notes()  # records read here and refused, each in one line
        # The last plan text checked and its record (None: refused); the exit records read
        # last, by id (None: refused). A plan is checked once, not at every tick that reads it;
        # an exit record (a stream entry never changes) once while it is read.
        self._plan_checked: tuple[str, Plan | None] | None = None
        self._exits_checked: dict[str, dict | None] = {}
        self.fence = Fence(self.r, self.k, self.call)
        self.own = OwnRecords(self.r, self.k, self.call)
        self.mirror = Mirror(self.r, self.k, self.call, self.fence)
        self.summaries = Summaries(self.r, self.k, self.call, self.names, self.fence.write)
        self.reports = Reports(self.r, self.k, self.call, self.names)

    def k(self, name: str) -> str:
        return self.p + name

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` with retries on transient errors (exponential backoff, `retry_s` in all)."""
        try:
            for attempt in Retrying(retry=retry_if_exception(self._transient),
                                    stop=stop_after_delay(self.retry_s),
                                    wait=wait_exponential(multiplier=0.05, max=1.0),
                                    reraise=False):
                with attempt:
                    return fn()
        except RetryError as e:
            self.trouble_at = time.time()
            cause = e.last_attempt.exception()
            raise StoreUnavailable(f"Redis at {safe_url(self.url)} did not answer for "
                                   f"{self.retry_s:g} s: {cause}") from None
        except (redis.AuthenticationError, redis.ResponseError) as e:
            refused = denial(e, self.url)  # NOPERM, WRONGPASS, NOAUTH: no outage, no retry
            if refused is None:
                raise
            raise refused from None
        raise AssertionError("unreachable")

    def _transient(self, e: BaseException) -> bool:
        """Worth a retry; and noted, so that the controller judges no silence that fell
        while Redis did not answer (see `trouble_at`)."""
        if _transient(e):
            self.trouble_at = time.time()
            return True
        # A fenced EXEC that ran nothing (fence.py): tried again, the lease read anew.
        return isinstance(e, redis.WatchError)

    def ping(self) -> None:
        self.call(self.r.ping)

    def reset(self) -> int:
        """Forget this job's state (a fresh submission); the events stream stays as history.
        How many keys went."""
        def wipe():
            keys = [k for k in self.r.scan_iter(match=self.p.replace("{", "\\{")
                                                .replace("}", "\\}") + "*", count=1000)
                    if k != self.k("events")]
            if keys:
                self.r.delete(*keys)
            return len(keys)
        return self.call(wipe)

    # --- the job record and the plan -----------------------------------------------------------

    def job_record(self) -> dict[str, str]:
        return self.call(lambda: self.r.hgetall(self.k("job")))

    def update_job(self, fields: dict[str, Any], delete: tuple[str, ...] = (), *,
                   batch: Batch | None = None) -> None:
        values = {k: as_text(v) for k, v in fields.items() if v is not None}
        gone = [k for k, v in fields.items() if v is None] + list(delete)

        def queue(pipe):
            if values:
                pipe.hset(self.k("job"), mapping=values)
            if gone:
                pipe.hdel(self.k("job"), *gone)
        self.fence.write(queue, batch)

    def plan(self) -> dict | None:
        """The plan's fields as written (checked: a plan that is no `Plan` reads as none, and
        is noted in `records`)."""
        raw = self._plan_text()
        return json.loads(raw) if raw and self._checked_plan(raw) is not None else None

    def plan_record(self) -> Plan | None:
        """The plan as its typed record (what an agent follows), checked as `plan` is."""
        raw = self._plan_text()
        return self._checked_plan(raw) if raw else None

    def _plan_text(self) -> str | None:
        return self.call(lambda: self.r.get(self.k("plan")))

    def _checked_plan(self, raw: str) -> Plan | None:
        """`raw` as a `Plan`, checked once per text, not at every tick that reads it."""
        if self._plan_checked is None or self._plan_checked[0] != raw:
            self._plan_checked = (raw, decode.checked(Plan, raw, self.records))
        return self._plan_checked[1]

    def set_plan(self, plan: Plan | dict, *, batch: Batch | None = None) -> None:
        """The plan (a dict passes through the type: a RecordError names what is wrong with
        it), and its stamp: agents read the (large) plan only when the stamp changes; woken,
        they read it now, not at their next tick."""
        plan = plan if isinstance(plan, Plan) else Plan.parse({"version": VERSION, **plan})
        stamp = f"{plan.generation}:{plan.action}:{plan.issued}"
        text = json.dumps(plan.record())

        def queue(pipe):
            pipe.set(self.k("plan"), text)
            pipe.set(self.k("plan:stamp"), stamp)
        self.fence.write(queue, batch, wake.AGENTS)

    def master_port(self, generation: int) -> int | None:
        raw = self.call(lambda: self.r.get(self.k(f"gen:{generation}:master_port")))
        return int(raw) if raw else None

    def set_snapshot_align(self, generation: int, push: str | None, keep: str | None) -> None:
        """The in-memory snapshot point every node of `generation` pushes next (None: their
        own choice) and the usable one every node keeps; agents read them with their tick
        (controller/control/snapshot_watch.py)."""
        key = self.k(f"gen:{generation}:align")
        value = f"{push or '-'} {keep or '-'}"
        self.call(lambda: self.r.set(key, value, ex=86_400) if push or keep
                  else self.r.delete(key))

    # --- operators' requests and the ranks' control word ---------------------------------------

    def request(self, action: str, actor: str, host: str, reason: str = "",
                **fields: Any) -> str:
        """An operator's request (controller/control/operator.py), for the leading controller
        to take; its stream id, which the controller's answering event carries."""
        entry = {"action": action, "actor": actor, "host": host, "reason": reason,
                 "time": f"{time.time():.3f}", **{k: as_text(v) for k, v in fields.items()}}
        return self.call(lambda: self.r.xadd(self.k("requests"), entry,
                                             maxlen=REQUESTS_MAXLEN, approximate=True))

    def operator_view(self, after: str) -> tuple[dict[str, dict], list[tuple[str, dict]], dict]:
        """What the controller reads each tick for operators, in one round trip: exclusions,
        requests newer than `after`, the control word."""
        def read():
            pipe = self.r.pipeline(transaction=False)
            pipe.hgetall(self.k("excluded"))
            pipe.xrange(self.k("requests"), min="-" if after in ("0", "") else f"({after}",
                        count=100)
            pipe.get(self.k("control"))
            return pipe.execute()
        excluded, requests, control = self.call(read)
        return ({n: json.loads(v) for n, v in excluded.items() if self.names.keep(n)}, requests,
                json.loads(control) if control else {})

    def control(self) -> dict:
        raw = self.call(lambda: self.r.get(self.k("control")))
        return json.loads(raw) if raw else {}

    def set_control(self, control: dict, *, batch: Batch | None = None) -> None:
        text = json.dumps(control, sort_keys=True)
        self.fence.write(lambda pipe: pipe.set(self.k("control"), text), batch, wake.AGENTS)

    # --- nodes, agents, heartbeats -------------------------------------------------------------

    def agent_field(self, nodes: list[str], name: str) -> dict[str, str]:
        """One field of several agents' status, in one round trip."""
        def read():
            pipe = self.r.pipeline(transaction=False)
            for n in nodes:
                pipe.hget(self.k(own(n, "status")), name)
            return pipe.execute()
        return {n: v for n, v in zip(nodes, self.call(read), strict=True) if v is not None}

    def nodes(self) -> dict[str, dict]:
        raw = self.call(lambda: self.r.hgetall(self.k("nodes")))
        return {n: r for n, v in raw.items()
                if self.names.keep(n) and (r := decode.record(v)) is not None}

    def node_info(self, nodes: list[str]) -> dict[str, dict]:
        if not nodes:
            return {}
        raw = self.call(lambda: self.r.hmget(self.k("nodes"), nodes))
        return {n: r for n, v in zip(nodes, raw, strict=True)
                if v and self.names.keep(n) and (r := decode.record(v)) is not None}

    def registrations(self) -> int:
        """How many times agents registered (a new node, one back under its own name, or one
        registering again after Redis lost its record): the controller re-reads spares when it
        changes."""
        raw = self.call(lambda: self.r.get(self.k("registrations")))
        return int(raw) if isinstance(raw, str) and raw.isdigit() else 0

    def agent_beats(self) -> dict[str, float]:
        return self.names.named(self.call(lambda: self.r.zrange(self.k("agents"), 0, -1,
                                                           withscores=True)))

    def agent_status(self, nodes: list[str]) -> dict[str, dict]:
        def read():
            pipe = self.r.pipeline(transaction=False)
            for n in nodes:
                pipe.hgetall(self.k(own(n, "status")))
            return pipe.execute()
        return {n: s for n, s in zip(nodes, self.call(read), strict=True) if s}

    def overdue(self, now: float) -> dict[str, float]:
        """Nodes with a rank whose heartbeat deadline has passed, and that deadline:
        O(overdue), not O(nodes)."""
        return self.names.named(self.call(lambda: self.r.zrangebyscore(self.k("beats"), "-inf", now,
                                                                  withscores=True)))

    def rank_beats_of(self, nodes: list[str]) -> dict[str, dict[int, dict]]:
        """Each node's ranks' latest heartbeats (local rank -> beat), in one round trip."""
        if not nodes:
            return {}

        def read():
            pipe = self.r.pipeline(transaction=False)
            for n in nodes:
                pipe.hgetall(self.k(own(n, "ranks")))
            return pipe.execute()
        return {n: {lr: b for f, v in raw.items() if (lr := decode.local_rank(f)) is not None
                    and (b := decode.record(v)) is not None}
                for n, raw in zip(nodes, self.call(read), strict=True)}

    def rank_beats(self, node: str) -> dict[int, dict]:
        return self.rank_beats_of([node])[node]

    def rank_beat_stored(self, node: str, local_rank: int) -> bool:
        """Whether a heartbeat is stored for the rank, readable or not (skipped by the reads)."""
        return bool(self.call(lambda: self.r.hexists(self.k(own(node, "ranks")),
                                                        str(local_rank))))

    # --- exits, exclusions, events, chaos ------------------------------------------------------

    def exits(self, after: str = "0") -> list[tuple[str, dict]]:
        """Exit records with stream ids greater than `after`, oldest first, as written (checked:
        one that is no `ExitRecord` is left out and noted in `records`, as is one of a node
        with no node name in `names`)."""
        start = after if after == "0" else f"({after}"
        raw = self.call(lambda: self.r.xrange(self.k("exits"), min=start))
        seen, self._exits_checked = self._exits_checked, {}
        for i, fields in raw:
            if i not in seen:
                record = decode.checked(ExitRecord, fields.get("json"), self.records, f" {i}")
                seen[i] = (record.record() if record is not None and self.names.keep(record.node)
                           else None)
            self._exits_checked[i] = seen[i]
        return [(i, dict(r)) for i, r in self._exits_checked.items() if r is not None]

    def last_exit_id(self) -> str:
        raw = self.call(lambda: self.r.xrevrange(self.k("exits"), count=1))
        return raw[0][0] if raw else "0"

    def exclude(self, node: str, reason: str, by: str, *, batch: Batch | None = None,
                **record: Any) -> None:
        """Keep `node` out of generations: `mode` "exclude" (the default) or "drain"."""
        text = json.dumps({"reason": reason, "by": by, "time": time.time(), "mode": "exclude",
                           **record})
        self.fence.write(lambda pipe: pipe.hset(self.k("excluded"), node, text), batch)

    def include(self, node: str, *, batch: Batch | None = None) -> bool:
        """Whether `node` was excluded (False when batched: not known before the commit)."""
        replies = self.fence.write(lambda pipe: pipe.hdel(self.k("excluded"), node), batch)
        return bool(replies and replies[0])

    def excluded(self) -> dict[str, dict]:
        raw = self.call(lambda: self.r.hgetall(self.k("excluded")))
        return {n: json.loads(v) for n, v in raw.items() if self.names.keep(n)}

    def event(self, actor: str, kind: str, message: str, **fields: Any) -> None:
        """Record an event (see `queue_event`) and send every unsent one."""
        self.queue_event(actor, kind, message, **fields)
        self.flush_events()

    def queue_event(self, actor: str, kind: str, message: str, *, batch: Batch | None = None,
                    **fields: Any) -> None:
        """An event for the next `flush_events` (or, a decision's, for its `batch`). Events
        wait in this process until Redis has taken them: an outage or a failover delays them
        (their `time` is when they happened) rather than losing them."""
        (self.unsent if batch is None else batch.events).append(
            {"time": f"{time.time():.3f}", "actor": actor, "kind": kind, "message": message,
             **{k: as_text(v) for k, v in fields.items()}})

    def flush_events(self) -> None:
        """Send the unsent events, oldest first, in one round trip; behind Sentinel, wait (up
        to EVENT_WAIT_MS) for a replica to have them. At least once: a connection lost
        mid-write sends them again, so a failover may leave a duplicate, never a gap."""
        with self._sending:  # one sender at a time (an agent's stacks thread sends too)
            batch = list(self.unsent)
            if not batch:
                return
            wait = self._waits()

            def write():
                pipe = self.r.pipeline(transaction=False)  # WAIT blocks only outside MULTI
                self._add_events(pipe, batch)
                if wait:
                    pipe.wait(self.replicas, EVENT_WAIT_MS)
                return pipe.execute()
            replies = self.call(write)
            if wait:
                self._replicated(replies[-1])
            for _ in batch:  # what was queued meanwhile stays
                self.unsent.popleft()

    def _add_events(self, pipe, entries: list[dict[str, str]]) -> None:
        """Queue the XADD of each entry on `pipe`: to the job's stream, or, an agent's, to its
        node's own stream, for the controller to relay (own.py)."""
        if not self.own.add_events(pipe, entries):
            for entry in entries:
                pipe.xadd(self.k("events"), entry, maxlen=EVENTS_MAXLEN, approximate=True)

    def commit(self, batch: Batch, holder: str) -> bool:
        """A decision's writes and events (`batch`) in one MULTI/EXEC, only while `holder`
        holds the leader lease (fence.py). False: refused, nothing written. Behind Sentinel a
        replica's copy of the events is waited for after the EXEC; the wakes are published once
        it has landed."""
        if not batch.writes and not batch.events:
            return True
        waits = bool(batch.events) and self._waits()
        events = [lambda pipe: self._add_events(pipe, batch.events)] if batch.events else []
        if not self.fence.fenced([*batch.writes, *events], holder):
            return False
        if waits:
            self._wait_replica()
        for channel in sorted(batch.wakes):
            wake.publish(self, channel)
        return True

    def _waits(self) -> bool:
        """Whether events written now wait for a replica's copy (behind Sentinel)."""
        return bool(self.replicas) and time.monotonic() >= self._alone_until

    def _replicated(self, replicas: int) -> None:
        if replicas < self.replicas:
            # No replica took them (a primary left alone after a failover): stop waiting for
            # one for a while, rather than slow every event by EVENT_WAIT_MS.
            self._alone_until = time.monotonic() + ALONE_S

    def _wait_replica(self) -> None:
        """WAIT for a replica to have what this connection wrote last: after a commit's EXEC
        (WAIT blocks only outside MULTI), on the connection the EXEC gave back to the pool,
        which hands out the last one returned (one thread writes the controller's store)."""
        try:
            self._replicated(self.r.wait(self.replicas, EVENT_WAIT_MS))
        except TRANSIENT:
            self._replicated(0)

    def events(self, count: int = 100, after: str = "-") -> list[tuple[str, dict]]:
        start = after if after in ("-", "0") else f"({after}"
        return self.call(lambda: self.r.xrange(self.k("events"), min=start, count=count))

    def events_tail(self, count: int) -> list[tuple[str, dict]]:
        """The last `count` events, oldest first."""
        return list(reversed(self.call(lambda: self.r.xrevrange(self.k("events"),
                                                                count=count))))

    def read_events(self, after: str, block_ms: int) -> list[tuple[str, dict]]:
        """Events after id `after`, waiting up to `block_ms` for one (XREAD BLOCK); keep
        block_ms under the socket timeout."""
        raw = self.call(lambda: self.r.xread({self.k("events"): after}, count=500,
                                             block=block_ms))
        return raw[0][1] if raw else []

    def push_command(self, node: str, command: dict, *, batch: Batch | None = None) -> None:
        """A command for one agent (chaos, dump_stacks, health_check), taken in its next tick."""
        text = json.dumps(command)
        self.fence.write(lambda pipe: pipe.rpush(self.k(f"commands:{node}"), text), batch)


def _transient(e: BaseException) -> bool:
    # redis-py's AuthenticationError is a ConnectionError; no retry fixes a wrong password.
    return isinstance(e, TRANSIENT) and not isinstance(e, redis.AuthenticationError)
