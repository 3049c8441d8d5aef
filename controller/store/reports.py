"""What nodes report beside their beats: in-memory snapshots held and hung ranks' stacks
(part of `Store`).
"""

from __future__ import annotations

import json
import re

from controller.store import decode


class Reports:
    """The snapshot and stack records of `Store` (mixed into it: uses its `r`, `k`, `call` and
    `names`)."""

    def put_stacks(self, generation: int, stacks: dict[int, str]) -> None:
        def write():
            pipe = self.r.pipeline()
            pipe.hset(self.k(f"stacks:{generation}"),
                      mapping={str(r): text for r, text in stacks.items()})
            pipe.expire(self.k(f"stacks:{generation}"), 86_400)
            pipe.execute()
        self.call(write)

    def stacks(self, generation: int) -> dict[int, str]:
        raw = self.call(lambda: self.r.hgetall(self.k(f"stacks:{generation}")))
        return {int(r): t for r, t in raw.items()}

    def set_snapshots(self, node: str, report: dict, first: bool = False) -> None:
        """What in-memory snapshots the node holds (controller/node/snapshots.py: its address,
        its own ranks' complete points, the replicas it holds, which points its buddy confirmed).
        Written when it changes; a lost node's last report stays, as the record of what was
        replicated before it went. The `first` report of a new incarnation of the node (its
        agent restarted) moves the earlier one's to `<node>@<incarnation>`, where it still
        proves what was replicated to it until the controller has a newer point
        (`drop_snapshots`)."""
        key = self.k("snapshots")

        def write():
            pipe = self.r.pipeline()
            if first:
                old = self.r.hget(key, node)
                was = _incarnation(old)
                if old and was != report.get("incarnation"):
                    pipe.hset(key, f"{node}@{was}", old)
            pipe.hset(key, node, json.dumps(report))
            pipe.execute()
        self.call(write)

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
        """Forget earlier incarnations' reports the controller no longer needs."""
        if keys:
            self.call(lambda: self.r.hdel(self.k("snapshots"), *keys))


def _incarnation(raw: str | None) -> str:
    """The incarnation a stored snapshots report names ("earlier": none, or unreadable)."""
    try:
        was = json.loads(raw).get("incarnation") if raw else None
    except (ValueError, AttributeError):
        was = None
    return was if isinstance(was, str) and re.fullmatch(r"[\w.-]{1,64}", was) else "earlier"
