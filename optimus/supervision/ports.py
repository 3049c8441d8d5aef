"""A TCP port for a server that binds it later: one the kernel will not hand out meanwhile.

Picking a port by binding port 0 and closing it leaves a window until the server binds it:
a store a spawned process opens seconds later (imports; far longer on a loaded node), a Redis
started a moment later. The kernel takes the local ports of outgoing connections (a Redis
client, a gloo pair, an agent's beat) from the same ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range), so it may give that very port to one of them in
between, and the server's bind or its peers' rendezvous fails. A port below that range is
never handed out by the kernel by itself: only another explicit bind can take it.

Standard library only: the controller, the trainer and the tests' harness all use it.
"""

from __future__ import annotations

import random
import socket
from collections import deque
from pathlib import Path

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000  # below it: the well-known services' ports (Redis 6379, Prometheus 9090, ...)
_TRIES = 64
# The ports this process handed out lately: two servers that bind later (a store and a Redis
# started together) never get the same one, free as it still is when the second asks.
_recent: deque[int] = deque(maxlen=256)


def unclaimed_port(host: str = "") -> int:
    """A port free on `host` now, below the kernel's ephemeral range; where the range leaves
    no room below it (fewer than 1,000 ports above 20000), one the kernel picks."""
    try:
        first = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768  # Linux's default range starts there
    if first - _LOWEST >= 1000:
        choose = random.SystemRandom()  # not the seeded global generator a trainer sets
        for _ in range(_TRIES):
            port = choose.randrange(_LOWEST, first)
            if port in _recent:
                continue
            with socket.socket() as probe:
                try:
                    probe.bind((host, port))
                except OSError:
                    continue  # in use: try another
            _recent.append(port)
            return port
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
