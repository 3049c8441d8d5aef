"""The test session's warm server: it imports the trainer once and forks every agent's warm
process (optimus/supervision/warm.py) from itself, instead of each agent starting a fresh one.

Every agent the suite starts (control plane, operator, Slurm, PBS, `optimus run` tests) starts a
warm process, which imports torch and the trainer: ~5 s of CPU each, several times a test, on
a two-core machine. tests/conftest.py starts this server once per test process and sets
OPTIMUS_WARM_COMMAND (controller/node/spawn.py) to `python tests/warm_client.py`, which hands
the agent's pipes to this server and stays as the agent's handle on the warm process. What the
warm process then does is optimus/supervision/warm.py's own `serve`, unchanged: only how it
got past its imports differs. Whatever the server cannot give exactly what a fresh warm
process would be (another interpreter, another PYTHONPATH, another thread count or device
setting: anything read at import), the client starts the real
`python -m optimus.supervision.warm` instead.

    python tests/warm_zygote.py SOCKET_PATH

Protocol: a client connects, sends one JSON line {"env", "cwd"} with its stdin and stdout as
SCM_RIGHTS; the server answers {"pid"} of the warm process it forked (which serves on those
two descriptors), or {"refused": why}.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
from collections.abc import Callable
from pathlib import Path

# What is read at import (by Python, torch, OpenMP or a device runtime): a client whose value
# differs from this server's gets a fresh warm process, never this server's imports.
AT_IMPORT = ("PYTHON", "OMP_", "MKL_", "KMP_", "TORCH", "PYTORCH", "CUDA", "LD_", "XPU",
             "ZE_", "ONEAPI")
REQUEST_LIMIT = 1 << 20  # bytes of one request (an environment)


BEFORE = dict(os.environ)  # this server's environment before its imports (which set some)


def added_paths(env: dict[str, str]) -> list[str]:
    """The client's PYTHONPATH entries, which `python -m optimus.supervision.warm` would put on
    sys.path."""
    return [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]


def _same_modules(env: dict[str, str]) -> bool:
    """A PYTHONPATH whose every entry this server has on sys.path already (the Slurm and PBS
    tests name the repository, which the editable install puts there) finds the same modules:
    the imports done here are what a fresh warm process would have done."""
    here = {os.path.realpath(p) for p in sys.path if p}
    return all(os.path.realpath(entry) in here for entry in added_paths(env))


def _unread(key: str) -> bool:
    """A device runtime's variable where this server's torch is built without that runtime:
    nothing reads it (the PBS script sets Level Zero's ZE_FLAT_DEVICE_HIERARCHY for Aurora)."""
    import torch

    if key.startswith(("ZE_", "XPU", "ONEAPI")):
        return not torch.xpu._is_compiled()
    if key.startswith("CUDA"):
        return not torch.backends.cuda.is_built()
    return False


def differs(env: dict[str, str]) -> list[str]:
    """What in the client's environment would make a fresh warm process differ from this
    server's forks. A value this server's own imports set is no difference: a fresh warm
    process's imports set the same (importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR to
    its default, and a pytest worker that imported it hands that on to every agent after)."""
    made = imports_set()
    keys = {k for k in (*env, *BEFORE) if k.startswith(AT_IMPORT)}
    return sorted(k for k in keys if env.get(k) != BEFORE.get(k) and not _unread(k)
                  and not (k in made and env.get(k) == made[k])
                  and not (k == "PYTHONPATH" and _same_modules(env)))


def imports_set() -> dict[str, str]:
    """What the imports put into the environment, as a fresh warm process's would too."""
    return {k: v for k, v in os.environ.items() if BEFORE.get(k) != v}


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, REQUEST_LIMIT, 2)
    while not data.endswith(b"\n") and len(data) < REQUEST_LIMIT:
        more = conn.recv(REQUEST_LIMIT - len(data))
        if not more:
            break
        data += more
    return json.loads(data), fds


def _become_warm(request: dict, fds: list[int], optimus_main) -> None:
    """In the forked child: the warm process of the client's agent (never returns)."""
    from optimus.supervision import warm

    code = 1
    try:
        os.setsid()  # as the agent's Popen(start_new_session=True) would
        os.dup2(fds[0], 0)
        os.dup2(fds[1], 1)
        for fd in fds:
            os.close(fd)
        os.chdir(request["cwd"])
        added = imports_set()
        os.environ.clear()
        os.environ.update({**request["env"], **added})
        # As `python -m optimus.supervision.warm` started there has it: its directory, then
        # PYTHONPATH.
        sys.path[:1] = [request["cwd"], *added_paths(request["env"])]
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        warm.serve(optimus_main)
        code = 0
    finally:
        os._exit(code)


def main() -> None:
    serve(sys.argv[1])


def serve(path: str, joins: Callable[[socket.socket], list[int]] | None = None,
          join: Callable[[list[int]], None] | None = None) -> None:
    """Serve warm processes at `path`. `joins(conn)`, where given, opens descriptors of the
    asking client's (tests/hosts_warm.py: its namespaces), which `join(fds)` enters in the forked
    child before it becomes a warm process; the server closes them after the fork."""
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not tests/
    import optimus.train  # noqa: F401  (what the warm process would import, done once)
    from optimus.cli import main as optimus_main
    from optimus.supervision import warm

    warm._first_use_imports()  # as the warm process does before it serves

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    server.settimeout(0.5)
    while True:
        for _ in warm._reaped():  # warm processes that ended (their agents are gone)
            pass
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        fds: list[int] = []
        theirs: list[int] = []
        with conn:
            conn.settimeout(10)
            try:
                request, fds = _receive(conn)
                theirs = joins(conn) if joins else []
                env = request["env"]
                why = ("two descriptors" if len(fds) != 2 else
                       f"{', '.join(differs(env))} differ" if differs(env) else None)
            except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
                why = f"an unreadable request ({e})"
            if why is not None:
                answer = {"refused": why}
                print(f"refused: {why}", flush=True)  # the session's count (tests/conftest.py)
            else:
                pid = os.fork()
                if pid == 0:
                    server.close()
                    if join:
                        join(theirs)
                    _become_warm(request, fds, optimus_main)
                answer = {"pid": pid}
            for fd in [*fds, *theirs]:
                os.close(fd)
            with contextlib.suppress(OSError):  # the client is gone: its warm process too
                conn.sendall((json.dumps(answer) + "\n").encode())


if __name__ == "__main__":
    main()
