"""Each node's ranks in a few numbers, in job-wide sorted sets (`Store.summaries`).

An agent writes its node's row with every tick (`NodeSummary`, in `OwnRecords.agent_tick`'s round
trip, under its own keys: own.py); the leading controller relays the plan's nodes' rows into
these sets (controller/control/relay.py) and reads them whole, so that one sweep costs one round
trip whatever the number of nodes, and the exporter reads the same rows (steps, compute times,
peak memory).
A member that is no node name (controller/store/names.py) is left out of what is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import redis

from controller.store.fence import Batch
from controller.store.names import Refused, own

PEAK_MEMORY = ("peak_allocated", "peak_reserved")  # sorted sets: node -> bytes
SUMMARY_SETS = ("steps", "minsteps", "outside", "compute", "paused", "oldest", *PEAK_MEMORY)


@dataclass
class NodeSummary:
    """One node's ranks in a few numbers, for the job-wide sorted sets."""

    max_step: int
    min_step: int
    outside: int  # ranks not in a collective phase
    nonfinite: bool  # a rank reported NaN/Inf of its own
    compute_s: float | None  # the slowest rank's median compute time over the window
    paused: int = 0  # ranks waiting paused
    oldest_beat: float | None = None  # time of the oldest rank heartbeat (None: none yet)
    # The largest peak memory of its ranks' last logged steps, bytes (None: none logged yet)
    peak_allocated: int | None = None
    peak_reserved: int | None = None


@dataclass
class Sweep:
    agent_beats: dict[str, float | None]  # plan node -> its agent's last beat (None: never)
    max_step: int | None  # the furthest step any rank is at
    min_step: int | None
    nonfinite: list[str]
    unhealthy: list[str]
    paused_nodes: int = 0  # nodes with at least `ranks_per_node` ranks paused


class Summaries:
    """The summary rows, read through the Store's client `r`, key naming `k` and retrying
    `call`; a name that is no node name is noted in its `names`. A new plan's pruning is
    written with `write` (`Fence.write`: now, or with the plan's decision)."""

    def __init__(self, r: redis.Redis, k: Callable[[str], str], call: Callable,
                 names: Refused, write: Callable[..., list | None]):
        self.r, self.k, self.call, self.names, self.write = r, k, call, names, write

    def keep_rows(self, plan_nodes: list[str], *, batch: Batch | None = None) -> None:
        """Remove the summary rows of nodes outside a new plan (a lost agent leaves its rows,
        a rank's beats of a generation it no longer runs): a rule reading the job-wide sets
        sees only the plan's members. Once per generation, O(nodes with rows); with `batch`
        (fence.py), the rows are read now and removed with the plan's decision."""
        keep = set(plan_nodes)

        def read():
            pipe = self.r.pipeline(transaction=False)
            for key in SUMMARY_SETS:
                pipe.zrange(self.k(key), 0, -1)
            pipe.smembers(self.k("nonfinite"))
            return pipe.execute()
        gone = {key: [m for m in members if m not in keep] for key, members
                in zip([*SUMMARY_SETS, "nonfinite"], self.call(read), strict=True)}
        outside = sorted({m for members in gone.values() for m in members})
        if not outside:
            return

        def queue(pipe):
            for key, members in gone.items():
                if members:
                    (pipe.srem if key == "nonfinite" else pipe.zrem)(self.k(key), *members)
            # each node's rank heartbeats once, not once per set it was in
            pipe.delete(*[self.k(own(m, "ranks")) for m in outside])
        self.write(queue, batch)

    def sweep(self, plan_nodes: list[str], ranks_per_node: int = 1) -> Sweep:
        """The controller's per-tick view of a running generation, in one round trip, whatever
        the number of nodes: O(plan nodes) only for the agents' beat times (ZMSCORE)."""
        def read():
            pipe = self.r.pipeline(transaction=False)
            pipe.zmscore(self.k("agents"), plan_nodes) if plan_nodes else pipe.echo("")
            pipe.zrevrange(self.k("steps"), 0, 0, withscores=True)
            pipe.zrange(self.k("minsteps"), 0, 0, withscores=True)
            pipe.smembers(self.k("nonfinite"))
            pipe.smembers(self.k("unhealthy"))
            pipe.zcount(self.k("paused"), ranks_per_node, "+inf")
            return pipe.execute()
        beats, top, bottom, nonfinite, unhealthy, paused = self.call(read)
        return Sweep(
            agent_beats=dict(zip(plan_nodes, beats or [], strict=False)),
            max_step=int(top[0][1]) if top else None,
            min_step=int(bottom[0][1]) if bottom else None,
            nonfinite=self.names.only(nonfinite), unhealthy=self.names.only(unhealthy),
            paused_nodes=paused)

    def behind(self, below_step: int) -> list[str]:
        """Nodes with a rank at a step below `below_step`."""
        return self.names.only(self.call(lambda: self.r.zrangebyscore(self.k("minsteps"), "-inf",
                                                                  f"({below_step}")))

    def outside_collectives(self, limit: int) -> list[str]:
        """Up to `limit` nodes with a rank outside the collective phase."""
        return self.names.only(self.call(lambda: self.r.zrangebyscore(self.k("outside"), 1, "+inf",
                                                                  start=0, num=limit)))

    def oldest_beats(self) -> dict[str, float]:
        """Node -> the time of its oldest rank heartbeat, for nodes running ranks."""
        return self.names.named(self.call(lambda: self.r.zrange(self.k("oldest"), 0, -1,
                                                           withscores=True)))

    def node_steps(self) -> dict[str, float]:
        """Node -> the furthest step of its ranks, for nodes running ranks."""
        return self.names.named(self.call(lambda: self.r.zrange(self.k("steps"), 0, -1,
                                                           withscores=True)))

    def peak_memory(self) -> dict | None:
        """The largest peak allocated and reserved memory of any running rank (its last logged
        step), and the node it runs on: {"allocated_bytes", "allocated_node", "reserved_bytes",
        "reserved_node"}; None before a rank has logged a step. One round trip."""
        def read():
            pipe = self.r.pipeline(transaction=False)
            for key in PEAK_MEMORY:
                pipe.zrevrange(self.k(key), 0, 0, withscores=True)
            return pipe.execute()
        tops = self.call(read)
        if not all(tops):
            return None
        (allocated_node, allocated), (reserved_node, reserved) = (top[0] for top in tops)
        return {"allocated_bytes": int(allocated), "allocated_node": allocated_node,
                "reserved_bytes": int(reserved), "reserved_node": reserved_node}

    def furthest_step(self) -> int | None:
        top = self.call(lambda: self.r.zrevrange(self.k("steps"), 0, 0, withscores=True))
        return int(top[0][1]) if top else None

    def compute_scores(self) -> dict[str, float]:
        return self.names.named(self.call(lambda: self.r.zrange(self.k("compute"), 0, -1,
                                                           withscores=True)))
