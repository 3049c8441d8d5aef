"""How the parts of a node agent speak: events in the node's name, and whether Redis answers.

An event Redis does not take is not lost (the store keeps it until the next flush); the
outage it met is said once, and the agent rides it out: its ranks never talk to Redis.
"""

from __future__ import annotations

import logging

from controller.store.store import Store, StoreUnavailable

log = logging.getLogger("optimus.agent")


class Voice:
    """The agent's events (`agent:<node>`) and its view of Redis: `down` from the first call
    that found it unreachable until the next that went through (`answered`)."""

    def __init__(self, store: Store, node: str):
        self.store, self.node = store, node
        self.down = False

    def event(self, kind: str, message: str, **fields) -> None:
        log.info(message)
        try:
            self.store.event(f"agent:{self.node}", kind, message, node=self.node, **fields)
        except StoreUnavailable as e:
            self.outage(e)

    def outage(self, e: Exception) -> None:
        if not self.down:
            log.warning("Redis unreachable; the ranks keep running: %s", e)
        self.down = True

    def answered(self) -> None:
        if self.down:
            self.down = False
            log.warning("Redis answers again")
