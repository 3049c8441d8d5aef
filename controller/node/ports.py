"""The rendezvous port a node offers before it is asked: held, advertised, taken by a plan.

Rank 0's store listens on a port its node's agent chooses. Chosen when the plan arrives, every
other node waits for it: node 0's agent writes it, the controller relays it, the others read it
(a round trip of the store and two wakes on a recovery's path). Instead each agent holds one
free port from its start and says which in its status (`next_port`); the controller puts node
0's into the plan, and every node launches at once. The relay stays for a plan without one.

Held means a socket bound to it (SO_REUSEADDR, never listening): the kernel gives a bound port
to no other bind(0) or outgoing connection, so the port offered minutes ago is still free when
rank 0 listens on it (with SO_REUSEADDR too, as torch's store does: Linux lets a listening
socket share a port with bound ones that do not listen). A port a plan took stays held until
the next one is taken, so no other process gets it while that generation's store lives.
"""

from __future__ import annotations

import contextlib
import socket

from optimus.supervision.ports import unclaimed_port


def _held_socket() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    return sock


class PortOffer:
    """One port offered for the next generation, and the one the current generation took."""

    def __init__(self) -> None:
        self._offered: socket.socket | None = None
        self._taken: socket.socket | None = None
        self._renew()

    @property
    def port(self) -> int:
        """The port offered now (0 when none could be held: the plan then carries none)."""
        return self._offered.getsockname()[1] if self._offered else 0

    def take(self, port: int = 0) -> int:
        """A generation's rank 0 listens on `port` (the plan's), or on the offered one (0):
        an offered port taken is held until the next is, and another is offered."""
        if port and port != self.port:
            return port  # an older offer (this agent restarted since): the plan's all the same
        port = self.port
        if self._taken:
            self._taken.close()
        self._taken, self._offered = self._offered, None
        self._renew()
        return port or unclaimed_port()

    def close(self) -> None:
        for sock in (self._offered, self._taken):
            if sock:
                sock.close()
        self._offered = self._taken = None

    def _renew(self) -> None:
        with contextlib.suppress(OSError):  # no port to hold: the plan then carries none
            self._offered = _held_socket()
