"""The warm server of the simulated hosts (tests/hosts.py, which says why it is needed): the
same as tests/warm_zygote.py (its code, imported), except that each warm process, before it
becomes one, joins the network, UTS and mount namespaces of the client that asked (its peer on
the socket: SO_PEERCRED), which are its agent's: a rank forked from it runs in its agent's host.

    python tests/hosts_warm.py SOCKET_PATH
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

from hosts import NAMESPACES, PREFIX, ROOT, RUN, WarmServer, slot


def start_warm_server(logdir: Path) -> tuple[subprocess.Popen, WarmServer]:
    """This module's warm server (module docstring)."""
    from optimus.contract.process import die_with_parent

    path = str(RUN / f"{PREFIX}{slot()}-warm.sock")  # swept with the slot's other names
    with open(logdir / "hosts-warm-server.log", "ab") as out:
        p = subprocess.Popen([sys.executable, __file__, path], cwd=ROOT,
                             stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True, preexec_fn=die_with_parent)
    return p, WarmServer(path, p.pid)


def _namespaces(conn: socket.socket) -> list[int]:
    """The asking client's network, UTS and mount namespaces (its peer on the socket:
    SO_PEERCRED), which are its agent's host's, opened in NAMESPACES' order."""
    peer = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    return [os.open(f"/proc/{peer}/ns/{kind}", os.O_RDONLY) for kind, _ in NAMESPACES]


def _join(fds: list[int]) -> None:
    """In the forked child: enter the namespaces `_namespaces` opened, before it becomes a warm
    process."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for fd, (_, flag) in zip(fds, NAMESPACES, strict=True):
        if libc.setns(fd, flag) != 0:
            print(f"setns {flag:#x}: errno {ctypes.get_errno()}", flush=True)
            os._exit(1)
        os.close(fd)


if __name__ == "__main__":
    if len(sys.argv) == 2:
        import warm_zygote

        warm_zygote.serve(sys.argv[1], joins=_namespaces, join=_join)
    else:
        sys.exit("usage: python tests/hosts_warm.py SOCKET_PATH")
