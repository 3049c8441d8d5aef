"""Whether a silent agent is gone, asked of its host's kernel.

An agent beats every heartbeat_interval_s whatever its ranks do. One that has missed a few
beats is either slow (a loaded host, a pause, a long GC) or gone (its processes killed, its
host down or cut off). Waiting out agent_timeout_s (30 s by default) tells the two apart at the
cost of half a minute for every lost node; a TCP connection to the agent's snapshot server
tells them apart in about a second:

- a host's kernel completes the handshake for a listening socket however busy, slow or even
  stopped the process behind it is: such an agent is *reachable*, and left to agent_timeout_s;
- a host whose agent process is gone answers with a reset (the port is closed): *refused*;
- a host that is down, or cut off, answers nothing: the connect times out.

A failure counts only for an address this controller has reached before (`reached`): a network
policy or firewall that keeps the controller from the agents (dropping the connection, or
rejecting it) looks the same as a dead host, and would otherwise make every slow agent a lost
node. So a few plan nodes a tick that have not answered yet are probed in the background
(BASELINE_PER_TICK, each at most every BASELINE_EVERY_S), and a node that dies later is known
to have been reachable.

The controller connects and closes: nothing is sent, so no key is needed, and nothing is learnt
but that. A refusal from an address that answered before is the host's own word that nothing
listens there any more: the node is unreachable at once. Otherwise two failures in a row, both
begun after the agent fell silent, make it so (one lost SYN is not a lost node). Probes run on a
small pool of threads, never on the controller's tick; a silent node is probed at most every
PROBE_EVERY_S. Written here rather than taken from a library: it is one connect with a timeout,
and what each outcome says about a node is the point.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

PROBE_TIMEOUT_S = 1.0
PROBE_EVERY_S = 0.5  # between two probes of one silent node
FAILS_NEEDED = 2  # probes in a row unanswered (or unroutable) that make a node unreachable
BASELINE_PER_TICK = 8  # plan nodes not reached yet, probed per tick
BASELINE_EVERY_S = 30.0  # between two baseline probes of one address that did not answer
WORKERS = 4
REFUSED, NO_ANSWER, NO_ROUTE = "refused", "no answer", "no route"


def parse_address(addr: object) -> tuple[str, int] | None:
    """(host, port) of a "host:port" an agent registered, or None for anything else (a
    node's record is its own word: a malformed address is not probed)."""
    if not isinstance(addr, str) or not 3 <= len(addr) <= 300:
        return None
    host, sep, port = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if any(c.isspace() or c in "/@?#" for c in host):
        return None
    return host, int(port)


def probe(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when (host, port) accepted a TCP connection within timeout_s; else REFUSED,
    NO_ANSWER or NO_ROUTE."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except ConnectionRefusedError:
        return REFUSED
    except TimeoutError:
        return NO_ANSWER
    except OSError:  # no route, unreachable network, a name that does not resolve
        return NO_ROUTE


def describe(outcome: str, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    return {REFUSED: "its host refused a connection to it (the agent is gone)",
            NO_ANSWER: f"its host did not answer a connection within {timeout_s:g} s",
            NO_ROUTE: "its host cannot be reached"}[outcome]


@dataclass
class _Node:
    addr: tuple[str, int]
    fails: int = 0
    last: str | None = None  # the last failed probe's outcome
    future: Future | None = None
    started: float = float("-inf")  # monotonic
    silent: bool = False  # probed because its agent is silent (not for the baseline)


@dataclass
class Prober:
    """Probes silent agents' snapshot servers; `unreachable` each tick says which are gone.
    `watch` gives it the plan's nodes (their registered addresses) to reach in the background,
    when they change."""

    timeout_s: float = PROBE_TIMEOUT_S
    connect: object = probe  # (host, port, timeout_s) -> outcome; a test may count calls
    reached: set = field(default_factory=set)  # (host, port) that answered a probe once
    _nodes: dict = field(default_factory=dict)  # node -> _Node, silent ones and baselines
    _pending: dict = field(default_factory=dict)  # plan node -> address not reached yet
    _pool: ThreadPoolExecutor | None = None

    def watch(self, plan: dict[str, object]) -> None:
        """The registered nodes (the plan's and the spares'), node -> address: those not
        reached yet are probed in the background, BASELINE_PER_TICK a tick."""
        self._pending = {n: a for n, raw in plan.items()
                         if (a := parse_address(raw)) is not None and a not in self.reached}
        for node in [n for n, st in self._nodes.items() if not st.silent and n not in plan]:
            del self._nodes[node]

    def unreachable(self, silent: dict[str, object]) -> dict[str, str]:
        """`silent`: node -> its agent's registered address, for the plan's nodes whose agents
        have missed beats now. Collects finished probes, starts those due, and returns
        node -> why for the silent nodes found unreachable: refused once, or unanswered
        FAILS_NEEDED times in a row (only addresses that answered before count)."""
        now = time.monotonic()
        for node in [n for n, st in self._nodes.items() if st.silent and n not in silent]:
            del self._nodes[node]  # it beat again: its count starts afresh next time
        out = {}
        for node, raw in silent.items():
            addr = parse_address(raw)
            st = self._collect(node, addr, silent=True)
            if st is None:
                continue
            if addr in self.reached and (st.last == REFUSED or st.fails >= FAILS_NEEDED):
                out[node] = describe(st.last, self.timeout_s)
            elif st.future is None and now - st.started >= PROBE_EVERY_S:
                self._start(st, now)
        # Baselines: collect those in flight (a few), then start up to BASELINE_PER_TICK more.
        for node, st in [(n, st) for n, st in self._nodes.items() if not st.silent]:
            self._collect(node, st.addr, silent=False)
            if st.addr in self.reached:
                del self._nodes[node]
                self._pending.pop(node, None)
        started = 0
        for node, addr in self._pending.items():
            if started >= BASELINE_PER_TICK:
                break
            st = self._nodes.get(node)
            if node in silent or addr in self.reached or (st is not None and (
                    st.future is not None or now - st.started < BASELINE_EVERY_S)):
                continue
            if st is None:
                st = self._nodes[node] = _Node(addr)
            self._start(st, now)
            started += 1
        return out

    def _collect(self, node: str, addr: tuple[str, int] | None, silent: bool) -> _Node | None:
        if addr is None:
            self._nodes.pop(node, None)
            return None
        st = self._nodes.get(node)
        if st is None or st.addr != addr or (silent and not st.silent):
            # A node's silence starts its count afresh: a failed baseline is not one of it.
            st = self._nodes[node] = _Node(addr, silent=silent)
        if st.future is not None and st.future.done():
            outcome = st.future.result()
            st.future = None
            if outcome is None:
                self.reached.add(addr)
                st.fails, st.last = 0, None
            else:
                st.fails, st.last = st.fails + 1, outcome
        return st

    def _start(self, st: _Node, now: float) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="agent-probe")
        st.started = now
        st.future = self._pool.submit(self._safe, *st.addr)

    def _safe(self, host: str, port: int) -> str | None:
        try:
            return self.connect(host, port, self.timeout_s)
        except Exception:  # noqa: BLE001 - a probe that cannot run says nothing of the node
            return NO_ROUTE

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
