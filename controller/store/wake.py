"""Wakes: a word on a Redis channel that something changed, so that a loop that polls every
interval looks now instead of at its next turn.

    optimus:{<job>}:wake:agents       the controller publishes: a new plan, a control word, a
                                      generation's rendezvous port relayed
    optimus:{<job>}:wake:controller   an agent publishes: a rank exited or left its generation,
                                      its node's state changed, its rendezvous port picked

A wake carries nothing that is read: it only makes the listener's next poll come now, and the
poll reads what it always reads (the plan stamp, the agents' records). So a lost wake (Redis
failed over, the channel is not in an older deployment's ACL) costs one interval, never
correctness, and a forged one (a node's credentials may publish on wake:controller only, never
on wake:agents: controller/store/acl.py) costs at most one controller tick every MIN_GAP_S, and
never more than half the controller's time (a woken look waits as long as the last one took).
Without wakes, a failure's recovery waited one controller tick for the stop, one agent tick to
see the plan, a controller tick to relay the port and an agent tick to read it: ~0.5 s each on
the bench's cadence, the larger part of the time after the decision (docs/benchmarks.md).

Pub/sub, not a blocking pop or a faster poll: one PUBLISH reaches every agent, however many,
and an idle agent costs Redis nothing between wakes.

A wait may also end on the listener's own file descriptors (`wait(fds=...)`): the agent's
ranks' pidfds, so that a rank's exit is reaped and reported the moment it happens rather than
at the agent's next turn (a replica's loss waits on it: docs/replicas.md).
"""

from __future__ import annotations

import contextlib
import logging
import select
import time
from collections.abc import Sequence

import redis

log = logging.getLogger("optimus.wake")

AGENTS, CONTROLLER = "wake:agents", "wake:controller"
MIN_GAP_S = 0.01  # the soonest a wake makes a listener look again after its last look
FD_GAP_S = 0.002  # the soonest one of the listener's own descriptors does (one left readable)
SUBSCRIBE_S = 2.0  # the longest a subscription waits for Redis to confirm it
RETRY_S = 30.0  # a subscription that failed (an outage) is tried again this much later
DRAIN_MAX = 1000  # wakes read and dropped per look: a flood of them cannot hold a loop


class Waker:
    """Sleeps like time.sleep, but returns early (True) when a wake arrives on `channel` of
    `store`'s job. Falls back to plain sleeping when the channel cannot be had."""

    def __init__(self, store, channel: str, *, min_gap_s: float = MIN_GAP_S,
                 paced: bool = False):
        self.store, self.channel, self.min_gap_s = store, store.k(channel), min_gap_s
        self.paced = paced  # a woken look waits as long as the last took (the controller's)
        self._sub = None
        self._retry_at = 0.0
        self._refused = False  # NOPERM: the deployment's ACL lacks the channel; poll only
        self._poked = False
        self._last = time.monotonic()

    def poke(self) -> None:
        """Look again soon (MIN_GAP_S) without waiting for a wake: this loop just changed
        something whose answer comes back without one."""
        self._poked = True

    def wait(self, timeout_s: float, fds: Sequence[int] = ()) -> bool:
        """Sleep at most `timeout_s`; True if cut short by a wake (or a poke), or by one of
        `fds` becoming readable. A wake makes the next look come no sooner than `min_gap_s`
        after the last, and when `paced`, no sooner than the last look took (a flood of them
        costs the listener at most half its time); a descriptor, FD_GAP_S."""
        start = time.monotonic()
        deadline = start + max(timeout_s, 0.0)
        busy = start - self._last if self.paced else 0.0  # the look since the last wait
        soonest = min(max(self._last + self.min_gap_s, start + busy), deadline)
        woken, ready = self._poked, False
        self._poked = False
        try:
            sub = self._subscription()
            while not woken and not ready and time.monotonic() < deadline:
                left = max(deadline - time.monotonic(), 0.0)
                if fds:
                    ready, heard = _select(sub, fds, left)
                    if not heard:
                        continue
                    left = 0.0
                elif sub is None:
                    break
                message = sub.get_message(timeout=left)
                woken = message is not None and message.get("type") == "message"
            if woken:  # one look answers every wake that came meanwhile (a flood: DRAIN_MAX)
                for _ in range(DRAIN_MAX):
                    if self._sub is None or self._sub.get_message(timeout=0) is None:
                        break
        except (redis.RedisError, OSError) as e:
            self._drop(e)
        if ready and not woken:
            soonest = min(self._last + FD_GAP_S, deadline)
        rest = (soonest if woken or ready else deadline) - time.monotonic()
        if rest > 0:
            time.sleep(rest)
        self._last = time.monotonic()
        return woken or ready

    def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                self._sub.close()
            self._sub = None

    def _subscription(self):
        """The subscription, made (and confirmed: a wake published after this returns is
        heard) if there is none; None while the channel cannot be had."""
        if self._sub is None and not self._refused and time.monotonic() >= self._retry_at:
            sub = self.store.r.pubsub()
            try:
                sub.subscribe(self.channel)
                said = sub.get_message(timeout=SUBSCRIBE_S)
                if not said or said.get("type") != "subscribe":
                    raise redis.ConnectionError(f"no confirmation in {SUBSCRIBE_S:g} s")
                self._sub = sub
            except redis.ResponseError as e:  # NOPERM: an ACL from before wakes
                sub.close()
                self._give_up(f"cannot subscribe to {self.channel} ({e}); polling every "
                              "interval only (add the channel to this user's ACL: "
                              "docs/security.md)")
            except (redis.RedisError, OSError) as e:
                sub.close()
                self._drop(e)
        return self._sub

    def _drop(self, e: BaseException) -> None:
        log.debug("wake channel %s lost (%s); polling until it is back", self.channel, e)
        self.close()
        self._retry_at = time.monotonic() + RETRY_S

    def _give_up(self, message: str) -> None:
        log.warning(message)
        self.close()
        self._refused = True


def _select(sub, fds: Sequence[int], timeout: float) -> tuple[bool, bool]:
    """Wait up to `timeout` for one of `fds` or the subscription's socket: (an fd is readable,
    the subscription has something). Without a subscription, the fds alone."""
    conn = None if sub is None else sub.connection
    sock = None if conn is None else getattr(conn, "_sock", None)  # redis-py has no public fd
    if conn is not None and (sock is None or conn.can_read(timeout=0)):
        return bool(select.select(fds, [], [], 0)[0]), True  # buffered already, or no socket
    watched = [*fds, sock] if sock is not None else list(fds)
    readable = select.select(watched, [], [], timeout)[0]
    return any(f in readable for f in fds), sock is not None and sock in readable


def publish(store, channel: str) -> None:
    """Wake whoever listens on `channel` of `store`'s job (`store`: the Store or one of its
    parts, through their client `r` and key naming `k`). A hint: never retried, never an error
    (the listeners poll anyway)."""
    try:
        store.r.publish(store.k(channel), b"")
    except (redis.RedisError, OSError) as e:
        log.debug("no wake on %s: %s", channel, e)
