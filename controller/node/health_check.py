"""The node's deterministic health check, as the agent runs it: every tile must reproduce a
fixed-seed matmul (`check_tiles` in optimus/supervision/warm.py).

The agent runs it when it registers, before every generation its node takes part in, and on
demand (`optimus health-check`). A tile that fails names itself `<node>/<index>`, and the
controller excludes the node ("bad tile ..."). A check that passes says when (`ok_at`): the
agent keeps that time through later failures, and the controller trusts no checkpoint committed
after it once the node is found computing wrong.

The agent never imports torch (seconds of CPU and ~200 MB per agent): the check runs in a child
of its warm process, which imported torch once (controller/node/spawn.py); without one (cold
starts, or one that failed), in a fresh process:

    python -m controller.node.health_check NODE [TILE...]     its result as one JSON line

(TILE: a tile made to compute wrong, fault injection.) Either way the result crosses a process
boundary: it is read bounded in size and time and kept only in its known shape. A check that
overruns CHECK_TIMEOUT_S (a hung driver), dies, or answers nonsense is a bad result that says
so (`<node>/?: why`): the node's fault, never a crashed agent.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import subprocess
import sys
import time

from controller.node.spawn import Spawner, rank_environment
from optimus.contract.process import die_with_parent
from optimus.supervision.warm import DETAIL_LIMIT, RESULT_LIMIT, bad_result, check_tiles

CHECK_TIMEOUT_S = 120.0  # a tile's runtime takes seconds to start; a cold check imports torch
_FIELDS = {"ok": {"devices", "device_kind", "health", "health_detail", "ok_at"},
           "bad": {"devices", "health", "health_detail"}}


def health_check(node: str, corrupt: set[int] = frozenset(), spawner: Spawner | None = None,
                 timeout_s: float = CHECK_TIMEOUT_S) -> dict:
    """Devices and the check's result (`check_tiles`): in a child of the spawner's warm process
    when it has one, else in a fresh process. `corrupt`: tiles made to compute wrong."""
    if spawner is not None:
        try:
            answer = spawner.health_check(node, corrupt, timeout_s)
        except TimeoutError as e:
            return bad_result(node, str(e))
        if answer is not None:
            return valid_result(node, answer, "the warm process")
    return _fresh(node, corrupt, timeout_s)


def valid_result(node: str, answer, source: str) -> dict:
    """`answer`, read from another process, if it has the shape of a check's result, else a
    bad result that says where it came from."""
    health = answer.get("health") if isinstance(answer, dict) else None
    if health in _FIELDS and set(answer) == _FIELDS[health]:
        devices, detail = answer["devices"], answer["health_detail"]
        shaped = (isinstance(devices, int) and not isinstance(devices, bool) and devices >= 0
                  and isinstance(detail, str))
        if health == "ok":
            shaped = (shaped and detail == "" and answer["device_kind"] in ("cpu", "cuda", "xpu")
                      and isinstance(answer["ok_at"], float) and math.isfinite(answer["ok_at"]))
        if shaped:
            return {**answer, "health_detail": detail[:DETAIL_LIMIT]}
    return bad_result(node, f"{source} gave no health check result")


def _fresh(node: str, corrupt: set[int], timeout_s: float) -> dict:
    """The check in a fresh `python -m controller.node.health_check`, killed past `timeout_s`."""
    argv = [sys.executable, "-m", "controller.node.health_check", node,
            *(str(t) for t in sorted(corrupt))]
    try:
        proc = subprocess.Popen(argv, env=rank_environment(os.environ),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=die_with_parent)
    except OSError as e:
        return bad_result(node, f"the check's process did not start: {e}")
    with proc:
        output, why = _output(proc, timeout_s)
        if why is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: what it started too
            proc.wait()
            return bad_result(node, why)
    if proc.returncode < 0:
        return bad_result(node, f"the check's process died of signal {-proc.returncode}")
    try:  # the last line: a library may have printed before it
        answer = json.loads(output.strip().rsplit(b"\n", 1)[-1])
    except ValueError:
        answer = None
    if proc.returncode != 0 or answer is None:
        return bad_result(node, f"the check's process exited {proc.returncode} without a result")
    return valid_result(node, answer, "the check's process")


def _output(proc: subprocess.Popen, timeout_s: float) -> tuple[bytes, str | None]:
    """The process's whole output once it has exited, or why not (too late, too long)."""
    deadline, fd, output = time.monotonic() + timeout_s, proc.stdout.fileno(), b""
    late = f"the check did not finish within {timeout_s:g} s"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return output, late
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            output += chunk
            if len(output) > RESULT_LIMIT:
                return output, f"the check's process wrote over {RESULT_LIMIT} bytes"
    try:  # its output closed: it is exiting
        proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        return output, late
    return output, None


def main(argv: list[str]) -> None:
    """`python -m controller.node.health_check NODE [TILE...]`: the result on stdout."""
    node, corrupt = argv[0], {int(tile) for tile in argv[1:]}
    print(json.dumps(check_tiles(node, corrupt)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
