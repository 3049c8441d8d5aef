"""The warm server of the simulated hosts (tests/hosts.py, which says why it is needed): the
same as tests/warm_zygote.py (its code, imported), except that each warm process, before it
becomes one, joins the network, UTS and mount namespaces of the client that asked (its peer on
the socket: SO_PEERCRED), which are its agent's: a rank forked from it runs in its agent's host.

    python tests/hosts_warm.py SOCKET_PATH
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

from hosts import NAMESPACES, PREFIX, ROOT, RUN, WarmServer, slot


def start_warm_server(logdir: Path) -> tuple[subprocess.Popen, WarmServer]:
    """This module's warm server (module docstring)."""
    from controller.node.spawn import die_with_parent

    path = str(RUN / f"{PREFIX}{slot()}-warm.sock")  # swept with the slot's other names
    with open(logdir / "hosts-warm-server.log", "ab") as out:
        p = subprocess.Popen([sys.executable, __file__, path], cwd=ROOT,
                             stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True, preexec_fn=die_with_parent)
    return p, WarmServer(path, p.pid)


def _serve_warm(path: str) -> None:
    """tests/warm_zygote.py's server, each warm process forked into its client's host."""
    import ctypes

    import warm_zygote as zygote

    sys.path[0] = str(ROOT)  # as warm_zygote.main: the repository, not tests/
    import optimus.train  # noqa: F401
    from optimus import warm
    from optimus.cli import main as optimus_main

    warm._first_use_imports()
    libc = ctypes.CDLL(None, use_errno=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    server.settimeout(0.5)
    while True:
        for _ in warm._reaped():
            pass
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        fds, spaces = [], []
        with conn:
            conn.settimeout(10)
            try:
                request, fds = zygote._receive(conn)
                peer = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                           12))[0]
                for kind, flag in NAMESPACES:  # the client's: its agent's host
                    spaces.append((os.open(f"/proc/{peer}/ns/{kind}", os.O_RDONLY), flag))
                differs = zygote.differs(request["env"])
                why = ("two descriptors" if len(fds) != 2 else
                       f"{', '.join(differs)} differ" if differs else None)
            except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
                why = f"an unreadable request ({e})"
            if why is not None:
                answer = {"refused": why}
                print(f"refused: {why}", flush=True)
            else:
                pid = os.fork()
                if pid == 0:
                    server.close()
                    for fd, flag in spaces:
                        if libc.setns(fd, flag) != 0:
                            print(f"setns {flag:#x}: errno {ctypes.get_errno()}", flush=True)
                            os._exit(1)
                        os.close(fd)
                    zygote._become_warm(request, fds, optimus_main)
                answer = {"pid": pid}
            for fd in [*fds, *(fd for fd, _ in spaces)]:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall((json.dumps(answer) + "\n").encode())


if __name__ == "__main__":
    if len(sys.argv) == 2:
        _serve_warm(sys.argv[1])
    else:
        sys.exit("usage: python tests/hosts_warm.py SOCKET_PATH")
