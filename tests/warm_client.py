"""An agent's warm process, forked by the test session's warm server (tests/warm_zygote.py).

The agent starts this as its warm process (OPTIMUS_WARM_COMMAND, set by tests/conftest.py):
it hands its stdin and stdout (the agent's pipes) to the server, which forks a warm process
serving on them, then stays until that process ends, as the agent's handle on it (its pid,
its exit, its parent-death signal). Where no server answers, or it refuses, this process
becomes the real `python -m optimus.supervision.warm`, so an agent never goes without a warm
process.
"""

import json
import os
import select
import socket
import sys
import time

ZYGOTE_ENV = "OPTIMUS_TEST_WARM_SERVER"


def fresh() -> None:
    os.execv(sys.executable, [sys.executable, "-m", "optimus.supervision.warm"])


def main() -> None:
    path = os.environ.get(ZYGOTE_ENV)
    if not path:
        fresh()
    # The server binds its socket once it has imported the trainer (seconds after the test
    # session starts): an agent of the session's first test waits for it rather than paying
    # those imports again in a fresh warm process.
    deadline = time.monotonic() + 15.0
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30)
            conn.connect(path)
            request = json.dumps({"env": dict(os.environ), "cwd": os.getcwd()}) + "\n"
            socket.send_fds(conn, [request.encode()], [0, 1])
            answer = b""
            while not answer.endswith(b"\n") and len(answer) < 4096:
                more = conn.recv(4096)
                if not more:
                    break
                answer += more
        pid = int(json.loads(answer)["pid"])
        watch = os.pidfd_open(pid)
    except (OSError, ValueError, KeyError, TypeError):
        fresh()
        return
    # Only the warm process holds the agent's pipes now: its end of input is the agent's end.
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    select.select([watch], [], [])  # until the warm process ends
    sys.exit(0)


if __name__ == "__main__":
    main()
