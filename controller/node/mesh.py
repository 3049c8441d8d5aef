"""The mesh check: whether this node reaches its peers on the network the ranks use.

Each agent probes its neighbours in the plan's ring (`peers`: the plan's nodes, then the
spares; controller/control/fabric.py): a TCP connect to their snapshot servers, closed at once
(controller/common/probe.py's `probe`; the server takes it). A server listens on every
interface of a host that advertises a non-loopback address, so the probe crosses the ranks'
network when the agents advertise their addresses on it (`optimus agent --host`). Two probes per
node, however large the job: a node cut off is seen by both its neighbours, and sees neither.

- Before a launch (checks.py, with the health check): its neighbours and node 0 (the
  rendezvous), each probed again at once if it did not answer (one lost SYN is not a cut). A
  node of the plan still out of reach: the agent refuses the generation. A spare out of reach
  is only reported.
- While a run plan stands: its neighbours every EVERY_S; FAILS_NEEDED failures in a row make one
  unreachable, one answer clears it.

Out of reach means no answer or no route. A refused connection is an answer: the host is there
and its agent is gone, which the controller's own probe of a silent agent names (a lost node).
A peer with no snapshot server (no job secret: its address is "") is not probed; the agent says
so once in its log.

What the agent reports (its status field `mesh`, read by controller/control/observe.py):
{"generation": g, "unreachable": [node, ...], "refused": bool}, or nothing when all answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from controller.common.probe import (
    FAILS_NEEDED,
    NO_ANSWER,
    NO_ROUTE,
    PROBE_TIMEOUT_S,
    parse_address,
    probe,
)
from controller.common.ring import REPORT_PEERS, Ring
from optimus.contract.records import Plan

log = logging.getLogger("optimus.agent")

EVERY_S = 2.0  # between two probes of one neighbour while a generation runs
QUICK_S = 0.25  # a launch waits this long for its check in line (a LAN answers in a millisecond)
OUT_OF_REACH = (NO_ANSWER, NO_ROUTE)
SAID_MAX = 256  # peers without a server said once each, at most this many


@dataclass
class _Peer:
    addr: tuple[str, int]
    fails: int = 0  # failed probes in a row
    future: Future | None = None
    started: float = float("-inf")  # monotonic


class MeshCheck:
    """One agent's mesh check. `connect(host, port, timeout_s)` says how a probe went (probe.py's
    outcomes; a test may answer for it); `on_done` is called when the probes of a launch end
    after the launch stopped waiting for them (the agent then ticks at once)."""

    def __init__(self, node: str, connect: Callable = probe,
                 timeout_s: float = PROBE_TIMEOUT_S, on_done: Callable[[], None] | None = None):
        self.node, self.connect, self.timeout_s, self.on_done = node, connect, timeout_s, on_done
        self.generation: int | None = None  # of the run plan the probes are for
        self.peers: dict[str, _Peer] = {}  # neighbour -> its probes while the plan stands
        self.launch: dict[str, Future] = {}  # peer -> its probes before this generation's launch
        self.found: list[str] | None = None  # the peers they found out of reach, once all ended
        self.blocked: list[str] = []  # the plan's nodes out of reach before the launch
        self.refused = False  # the launch of `generation` was refused for them
        self.addrs: dict[str, str] = {}  # peer -> the address it was probed at
        self.said: set[str] = set()  # peers without a server, said once
        self._told: set[str] = set()  # neighbours out of reach at the last `news`
        self._ring: tuple = (None, None)  # ((generation, issued), the plan's Ring)
        self._pool: ThreadPoolExecutor | None = None

    # --- before a launch -----------------------------------------------------------------------

    def before_launch(self, plan: Plan) -> bool | None:
        """Whether to launch `plan`'s generation: True, False (a node of the plan is out of
        reach: `blocked`), or None while the probes run (`on_done` says when they end)."""
        self._renew(plan.generation)
        if not self.launch:
            self.launch = {peer: self._submit(self._twice, addr)
                           for peer, addr in self._targets(plan, launch=True).items()}
            _, pending = wait(self.launch.values(), timeout=QUICK_S)
            for future in pending:
                if self.on_done is not None:
                    future.add_done_callback(lambda _: self.on_done())
        if self.found is None:
            if not all(f.done() for f in self.launch.values()):
                return None
            self.found = sorted(p for p, f in self.launch.items() if f.result() in OUT_OF_REACH)
            for peer, st in self.peers.items():  # what the running probes go on from
                if peer in self.launch:
                    st.fails = FAILS_NEEDED if peer in self.found else 0
            in_plan = set(plan.nodes)
            self.blocked = [p for p in self.found if p in in_plan]
            self.refused = bool(self.blocked)
        return not self.refused

    def _twice(self, addr: tuple[str, int]) -> str | None:
        """A probe, and another at once if it found no answer or no route."""
        outcome = self._probe(addr)
        return self._probe(addr) if outcome in OUT_OF_REACH else outcome

    # --- while a generation runs ---------------------------------------------------------------

    def poll(self, plan: Plan | None) -> None:
        """Each agent tick: while a run plan puts this node in its ring, collect the probes of
        its neighbours that finished and start those due (never on the tick itself)."""
        if plan is None or plan.action != "run":
            self._renew(None)
            return
        self._renew(plan.generation)
        targets = self._targets(plan, launch=False)
        for gone in set(self.peers) - set(targets):
            del self.peers[gone]  # the ring changed (a spare came or went)
        now = time.monotonic()
        for peer, addr in targets.items():
            st = self.peers.get(peer)
            if st is None or st.addr != addr:
                st = self.peers[peer] = _Peer(addr)
                if peer in self.launch and self.launch[peer].done():  # checked before launch
                    st.fails = FAILS_NEEDED * (self.launch[peer].result() in OUT_OF_REACH)
                    st.started = now
            if st.future is not None and st.future.done():
                outcome, st.future = st.future.result(), None
                st.fails = st.fails + 1 if outcome in OUT_OF_REACH else 0
            if st.future is None and now - st.started >= EVERY_S:
                st.started, st.future = now, self._submit(self._probe, addr)

    def news(self) -> tuple[list[str], list[str]]:
        """The neighbours out of reach that were not at the last call, and those that answer
        again (for the agent's events)."""
        out = {p for p, st in self.peers.items() if st.fails >= FAILS_NEEDED}
        lost, back = sorted(out - self._told), sorted(p for p in self._told - out
                                                      if p in self.peers)
        self._told = out
        return lost, back

    def where(self, peers: list[str]) -> str:
        """Peers with the addresses they were probed at, for a message."""
        return ", ".join(f"{p} ({self.addrs[p]})" if p in self.addrs else p for p in peers)

    def report(self) -> dict | None:
        """The agent's `mesh` status: the peers out of reach now (and those the launch was
        refused for, for the rest of that generation), or None when there is nothing to say."""
        out = {p for p, st in self.peers.items() if st.fails >= FAILS_NEEDED}
        if self.refused:
            out |= set(self.blocked)
        if not out and not self.refused:
            return None
        return {"generation": self.generation, "unreachable": sorted(out)[:REPORT_PEERS],
                "refused": self.refused}

    # --- the probes ----------------------------------------------------------------------------

    def _renew(self, generation: int | None) -> None:
        """A new generation (or none): its probes start afresh."""
        if generation != self.generation:
            self.generation, self.peers, self.launch, self.found = generation, {}, {}, None
            self.blocked, self.refused, self.addrs = [], False, {}

    def _targets(self, plan: Plan, launch: bool) -> dict[str, tuple[str, int]]:
        """The peers to probe (fabric.Ring.peers) that have a snapshot server: -> (host, port)."""
        key = (plan.generation, plan.issued)
        if self._ring[0] != key:  # indexed once per plan, not per tick (10,000 nodes: ms)
            self._ring = (key, Ring.build(plan.nodes, plan.peers))
        out = {}
        for peer, raw in self._ring[1].peers(self.node, launch).items():
            addr = parse_address(raw)
            if addr is not None:
                out[peer], self.addrs[peer] = addr, raw
            elif peer not in self.said and len(self.said) < SAID_MAX:
                self.said.add(peer)
                log.info("mesh check: %s is not probed from %s: it has no snapshot server (no "
                         "job secret, or its server could not listen)", peer, self.node)
        return out

    def _probe(self, addr: tuple[str, int]) -> str | None:
        try:
            return self.connect(addr[0], addr[1], self.timeout_s)
        except Exception:  # noqa: BLE001 - a probe that cannot run says nothing of the peer
            return None

    def _submit(self, fn: Callable, addr: tuple[str, int]) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(4, thread_name_prefix="mesh-probe")
        return self._pool.submit(fn, addr)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
