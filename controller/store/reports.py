"""What nodes report beside their beats: in-memory snapshots held and hung ranks' stacks
(`Store.reports`), as the leading controller relays them from each node's own keys (own.py).
"""

from __future__ import annotations

from collections.abc import Callable

import redis

from controller.store import decode
from controller.store.names import Refused, is_node_name, own


class Reports:
    """The snapshot and stack records, through the Store's client `r`, key naming `k` and
    retrying `call`; a name that is no node name is noted in its `names`."""

    def __init__(self, r: redis.Redis, k: Callable[[str], str], call: Callable,
                 names: Refused):
        self.r, self.k, self.call, self.names = r, k, call, names

    def stacks(self, generation: int) -> dict[int, str]:
        raw = self.call(lambda: self.r.hgetall(self.k(f"stacks:{generation}")))
        return {int(r): t for r, t in raw.items()}

    def snapshots(self) -> dict[str, dict]:
        """Node (or `<node>@<incarnation>`, an earlier one) -> its report; an unreadable
        report, or one under no node name, counts as none."""
        raw = self.call(lambda: self.r.hgetall(self.k("snapshots")))
        out = {}
        for n, v in raw.items():
            if not self.names.keep(n.partition("@")[0]):
                continue
            report = decode.record(v)
            if report is not None:
                out[n] = report
        return out

    def drop_snapshots(self, keys: list[str]) -> None:
        """Forget earlier incarnations' reports (`<node>@<incarnation>`) the controller no
        longer needs, here and where their node keeps them (or the relay would bring them
        back)."""
        if not keys:
            return

        def write():
            pipe = self.r.pipeline()
            pipe.hdel(self.k("snapshots"), *keys)
            for key in keys:
                node, at, was = key.partition("@")
                if at and is_node_name(node):
                    pipe.hdel(self.k(own(node, "snapshots")), f"@{was}")
            pipe.execute()
        self.call(write)
