"""Fencing: a decision of the leading controller lands whole, and only while that controller
holds the leader lease (`Store.fence`, a `Fence`; `Store.commit` adds the decision's events).

The lease's value (`leader`: the holding controller's ident) is the fencing token. A commit
(`Store.commit`, through `Fence.fenced`) WATCHes it, reads it, and only if it names the
committer sends the decision's writes between MULTI and EXEC; the lease expiring, taken by
another or released after that read makes Redis run nothing at EXEC (from Redis 7.0 the expiry
of a watched key counts as a change). A lost connection or an EXEC that ran nothing is tried
again by `Store.call` from the WATCH, the lease read anew each time: a decision carried across
a network cut lands only if its controller still holds the lease when it arrives, and the bytes
of an earlier try that TCP delivers after the heal meet a changed lease and an EXEC that runs
nothing. A decision refused so is dropped whole by its controller, its events with it
(controller/control/controller.py `apply`).

Fenced, each decision in one transaction: the exclusions, includes and operators' exclusions,
the control word, the agents' commands, the plan and its stamp, the summary rows a new plan
prunes, the job record's changes and the decision's events. The relay's writes are fenced on
the same token, in their own transaction with its cursors (mirror.py `Mirror.write`).

Not fenced, and why:
- the lease itself: its scripts check the holder (`_LEASE`, `_RELEASE` below);
- events said outside a decision (a controller took the lease, a name refused, the relay's
  notes): they report what happened, and it happened; sent at least once
  (`Store.flush_events`);
- the snapshot watch's writes (controller/control/snapshot_watch.py): the point to align on and
  the reports let go are derived from the nodes' reports anew by whoever leads, and a stale one
  is rewritten within one check;
- a rebuild after Redis came back empty (`Controller._rebuild`): it restores the journal's
  state into an empty store, before any decision;
- the operators' CLI (their requests, `--resubmit`, chaos commands) and the agents' writes under
  their nodes' own keys (own.py): not a controller's decision.
The checkpoints a decision sets aside are set aside on disk before its transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from controller.store import wake

Queue = Callable[[redis.client.Pipeline], object]  # queues its commands on a pipeline

# Renew the lease only if we still hold it; take it if it is free. 1: held, 0: someone else.
_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass
class Batch:
    """One decision's writes, gathered to be committed together (`Store.commit`): each a
    function that queues its commands on the transaction's pipeline, the decision's events, and
    the channels to wake once they have landed."""

    writes: list[Queue] = field(default_factory=list)
    events: list[dict[str, str]] = field(default_factory=list)
    wakes: set[str] = field(default_factory=set)


class Fence:
    """The leader lease, writes now or in a batch, and the fenced transaction, through the
    Store's client `r`, key naming `k` and retrying `call`."""

    def __init__(self, r: redis.Redis, k: Callable[[str], str], call: Callable):
        self.r, self.k, self.call = r, k, call
        self._lease = r.register_script(_LEASE)
        self._release = r.register_script(_RELEASE)

    def hold_lease(self, holder: str, lease_s: float) -> bool:
        """Take the leader lease or renew it; False while another controller holds it."""
        return bool(self.call(lambda: self._lease(keys=[self.k("leader")],
                                                  args=[holder, int(lease_s * 1000)])))

    def release_lease(self, holder: str) -> None:
        self.call(lambda: self._release(keys=[self.k("leader")], args=[holder]))

    def leader(self) -> str | None:
        return self.call(lambda: self.r.get(self.k("leader")))

    def write(self, queue: Queue, batch: Batch | None, *wakes: str) -> list | None:
        """`queue`'s commands: into `batch`, to land with the rest of its decision (None), or
        now (their replies), in one MULTI/EXEC when there are several (a single command needs
        none: an operator's credentials have no MULTI), retried; then wake `wakes`."""
        if batch is not None:
            batch.writes.append(queue)
            batch.wakes.update(wakes)
            return None

        def write():
            pipe = self.r.pipeline(transaction=False)
            queue(pipe)
            pipe.transaction = len(pipe) > 1
            return pipe.execute()
        replies = self.call(write)
        for channel in wakes:
            wake.publish(self, channel)
        return replies

    def watched(self, pipe: redis.client.Pipeline, holder: str) -> bool:
        """Begin on `pipe` a transaction whose EXEC runs only while `holder` holds the leader
        lease: WATCH the lease, read it, MULTI. False, nothing begun, when another holds it or
        none does."""
        lease = self.k("leader")
        pipe.watch(lease)
        if pipe.get(lease) != holder:
            return False
        pipe.multi()
        return True

    def fenced(self, queues: list[Queue], holder: str) -> bool:
        """`queues` in one MULTI/EXEC, only while `holder` holds the leader lease. False:
        refused (another controller holds the lease, or none does), nothing written. A lost
        connection or an EXEC that ran nothing (WatchError) is tried again, the lease read
        again (`Store.call`)."""
        def write():
            with self.r.pipeline(transaction=True) as pipe:
                if not self.watched(pipe, holder):
                    return False
                for queue in queues:
                    queue(pipe)
                pipe.execute()
                return True
        return self.call(write)
