"""Warm starts: rank processes that are past their imports before the agent needs them.

    python -m optimus.supervision.warm                one per node: forks every rank (requests
                                                      on stdin)
    python -m optimus.supervision.warm --standby N    one per device: becomes one rank (its
                                                      request on stdin), with device N's
                                                      runtime already started

A rank that starts as `python -m optimus train JOB` first imports torch, its distributed stack
and the trainer: ~3 s of CPU on a small test machine, far more from a cold parallel file system
at scale, on every start and every restart. This process pays that once per node; each rank is
then a fork of it, already past its imports, so a generation (and a restart) starts in
milliseconds. Python's multiprocessing forkserver forks ready processes the same way, but for a
Python function whose parent keeps a handle; a rank must become a whole `optimus train` process
with its own session, environment, log file and parent-death signal, and the agent must learn
how it ended, so the protocol is written here.

Protocol, JSON lines. This process says {"ready": true} once its imports are done. The agent
writes {"id", "argv", "env", "log"}; this process answers {"id", "pid"} once the rank is
forked (or {"id", "error"}), and {"pid", "code"} or
{"pid", "signal"} when a rank exits: it is the ranks' parent, so it reaps them. It dies with the
agent (parent-death signal, and end of input), and the ranks die with it.

The fork is refused (an error reply: the agent then starts the rank cold) once an accelerator
runtime is initialised here, since CUDA and XPU state does not survive a fork; importing the
trainer initialises none.

Health checks. The agent never imports torch (~2.5 s of CPU and ~200 MB per agent), so it asks
this process, which has, for its node's health check: {"id", "health": {"node", "corrupt":
[tile, ...], "timeout_s"}}. A forked child runs the check (`check_tiles`) and writes its result
into a pipe; once the child has ended (it is reaped here, never reported as a rank) this process
answers {"id", "health": {result}}, a bad result when the child died or ran past timeout_s
(killed then: a hung driver). A child, because the check starts every tile's runtime, which
this process must never do (above); the child holds none of this process's pipes, so the next
rank forks as before. Refused as a rank fork is, with {"id", "error"}: the agent then runs the
check in a fresh process.

Standby (`--standby N`): a fork cannot carry a CUDA or XPU context, and creating one costs a
rank seconds on every start. So on a node with accelerators the agent keeps one standby process
per device instead (controller/node/spawn.py): a fresh interpreter that imports the trainer, makes
device N current and creates its runtime context, then waits. The next generation adopts it:
the agent writes the rank's request ({"argv", "env", "log"}) as one line on its stdin and the
process becomes that rank, as a fork does (its own session from the start, its output to the
log, the environment replaced, `optimus <argv>` run, its exit code its own). The agent starts a
new standby once the generation is under way. Building the model on the meta device is left to
the rank: it takes 0.075 s for GPT-175B on this machine's CPU (75 ms against the seconds above),
and the rank's layout is known only from its request.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import sys
import time
import traceback

from optimus.contract.process import die_with_parent

_POLL_S = 0.05
# The fixed-seed matmul's checksum, computed once on the CPU in float64: every tile must
# reproduce it (to 1e-6 relative: devices sum in other orders) and agree with itself bit for bit.
_CHECK_SEED, _CHECK_SIZE = 1234, 256
_CHECK_TIMEOUT_S = 60.0  # when a request names none
DETAIL_LIMIT = 2000  # characters of a bad result's detail: the result must fit in its pipe
RESULT_LIMIT = 1 << 16  # bytes read of a check's result (a child wrote it: still bounded)


def main() -> None:
    if sys.argv[1:2] == ["--standby"]:
        standby(int(sys.argv[2]))
        return
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the agent's to handle
    import optimus.train  # noqa: F401  (the point: every import a rank would do, done once)
    from optimus.cli import main as optimus_main

    _first_use_imports()
    serve(optimus_main)


def serve(optimus_main) -> None:
    """Answer the agent's requests on stdin (replies on stdout) until its end of input: the
    warm process past its imports. A line that is no JSON object is skipped."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stray prints must not corrupt the replies
    _reply(replies, {"ready": True})
    checks: dict[int, _Check] = {}  # pid -> a health check running in a child
    # A child's exit ends the wait below at once (its SIGCHLD writes a byte to `reaping`), so
    # the agent hears of a rank's death in a millisecond, not at this loop's next turn.
    reaping, reaping_w = os.pipe()
    for fd in (reaping, reaping_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(reaping_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pending = b""
    while True:
        ready, _, _ = select.select([0, reaping], [], [], _POLL_S)
        if reaping in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(reaping, 4096)
        if 0 in ready:
            data = os.read(0, 1 << 16)
            if not data:
                return  # the agent is gone (the checks' children die with this process)
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    request = json.loads(line)
                except ValueError:
                    request = None
                if not isinstance(request, dict):
                    continue  # the agent writes only objects: nothing to answer
                # What a child must not keep: the agent's end-of-file on the replies means
                # that this process has ended, and another check's pipe is not its business.
                inherited = [replies.fileno(), reaping, reaping_w,
                             *(c.fd for c in checks.values())]
                reply = (_start_check(request, checks, inherited) if "health" in request
                         else _spawn(request, optimus_main, inherited))
                if reply is not None:
                    _reply(replies, reply)
        for pid, status in _reaped():
            check = checks.pop(pid, None)
            if check is not None:
                _reply(replies, check.answer(status))
                continue
            ended = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
                     else {"code": os.waitstatus_to_exitcode(status)})
            _reply(replies, {"pid": pid, **ended})
        for check in checks.values():
            check.enforce_deadline()


def _reply(stream, message: dict) -> None:
    stream.write(json.dumps(message) + "\n")


def _reaped():
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status


def _fork_with_pipe(request_id, child) -> tuple[int, int] | dict:
    """Fork; the child runs `child(write end of a pipe to this process)`, which never returns.
    (pid, read end), or the error reply: an accelerator runtime initialised here (a fork would
    not inherit it), or a fork that failed."""
    if _accelerator_initialised():
        return {"id": request_id, "error": "an accelerator runtime is initialised in the "
                "warm process; a fork would not inherit it"}
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
    except OSError as e:
        os.close(read_end)
        os.close(write_end)
        return {"id": request_id, "error": f"fork failed: {e}"}
    if pid == 0:
        os.close(read_end)
        child(write_end)  # never returns
    os.close(write_end)
    return pid, read_end


def _spawn(request: dict, optimus_main, inherited: list[int]) -> dict:
    # The child says through the pipe when it leads its own session.
    forked = _fork_with_pipe(request["id"], lambda settled: _become_rank(
        request, optimus_main, inherited, settled))
    if isinstance(forked, dict):
        return forked
    pid, settled = forked
    os.read(settled, 1)  # so that the agent may signal its process group at once
    os.close(settled)
    return {"id": request["id"], "pid": pid}


def standby(device_index: int) -> None:
    """One device's standby rank (see the top of this module): ready, then adopted."""
    die_with_parent()  # the agent started it in a session of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the agent's to handle
    import optimus.train  # noqa: F401  (the point: every import a rank would do, done now)
    from optimus.cli import main as optimus_main

    _first_use_imports()
    _start_device(device_index)
    line = sys.stdin.buffer.readline()
    if not line:
        return  # the agent is gone, or let this standby go
    _run_as_rank(json.loads(line), optimus_main)  # never returns


def _first_use_imports() -> None:
    """What a rank imports on its first use of torch rather than at its own imports: building
    the model on the meta device (torch's meta kernels are Python references that import
    dynamo on first call) and DTensor's first sharding decision both import torch._dynamo,
    ~0.5 s of CPU that every forked rank paid again, on a restart's critical path (a new
    rank's peers wait for it in the resume's agreement). Here it is paid once per node;
    `optimus.train` does not import it at import (a cold rank pays it at its first model
    build either way; what imports the trainer without training does not)."""
    import torch._dynamo  # noqa: F401


def _start_device(index: int) -> None:
    """Make device `index` current and create its runtime context (a CUDA/XPU context takes
    seconds; on a CPU-only machine there is nothing to start)."""
    import torch

    if not torch.accelerator.is_available():
        return
    if index < torch.accelerator.device_count():
        torch.accelerator.set_device_index(index)
        kind = torch.accelerator.current_accelerator().type
        torch.empty(1, device=torch.device(kind, index))


def _become_rank(request: dict, optimus_main, inherited: list[int], settled_fd: int) -> None:
    """In the forked child: become `optimus <argv...>` as a fresh process would, then exit."""
    try:
        signal.set_wakeup_fd(-1)  # the warm process's: closed below
        os.setsid()
        os.write(settled_fd, b"x")
        os.close(settled_fd)
        die_with_parent()
        for fd in inherited:
            os.close(fd)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    _run_as_rank(request, optimus_main)


def _run_as_rank(request: dict, optimus_main) -> None:
    """Become `optimus <argv...>` with the request's environment and log, then exit."""
    code = 1
    try:
        # What a fresh Python starts with (it ignores SIGPIPE itself, as this process does).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdout.reconfigure(line_buffering=True, write_through=True)  # as PYTHONUNBUFFERED
        sys.stderr.reconfigure(line_buffering=True, write_through=True)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        try:
            optimus_main(prog_name="optimus")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        # Not a return into the warm process's loop: this process must end here. Exit handlers
        # and finalization do not run, so nothing is left for them: the trainer stopped what
        # it started, in its exit order (the end of optimus/train.py's train()).
        os._exit(code)


# --- the node's health check ------------------------------------------------------------------

def check_tiles(node: str, corrupt: set[int] = frozenset()) -> dict:
    """Devices, and the deterministic compute check on every tile (tile ids: `<node>/<index>`;
    a CPU node is one tile, index 0). `corrupt`: tiles made to compute wrong (fault injection).
    It starts the tiles' runtimes: run it in a child of the warm process, or a fresh process."""
    try:
        import torch

        devices, kind = 0, "cpu"
        if torch.cuda.is_available():
            devices, kind = torch.cuda.device_count(), "cuda"
        elif hasattr(torch, "xpu") and torch.xpu.is_available():
            devices, kind = torch.xpu.device_count(), "xpu"
        g = torch.Generator().manual_seed(_CHECK_SEED)
        a = torch.randn(_CHECK_SIZE, _CHECK_SIZE, generator=g, dtype=torch.float64)
        reference = (a @ a).sum().item()
        for index in range(max(devices, 1)):
            device = torch.device(kind, index) if devices else torch.device("cpu")
            x = a.to(device)
            if index in corrupt:
                x = x + 1e-3  # a tile whose arithmetic has gone wrong
            first, second = (x @ x).sum().item(), (x @ x).sum().item()
            if first != second or abs(first - reference) > 1e-6 * abs(reference):
                return {"devices": devices, "health": "bad",
                        "health_detail": f"{node}/{index}: fixed-seed matmul gave {first!r} "
                                         f"then {second!r}, reference {reference!r}"}
        return {"devices": devices or os.cpu_count(), "device_kind": kind, "health": "ok",
                "health_detail": "", "ok_at": time.time()}
    except Exception as e:  # a broken driver is a bad node, not a crashed agent
        return bad_result(node, f"{type(e).__name__}: {e}")


def bad_result(node: str, why: str) -> dict:
    """A failed check that names no tile (`<node>/?`): the check itself could not run."""
    return {"devices": 0, "health": "bad", "health_detail": f"{node}/?: {why}"}


class _Check:
    """A health check running in a child of this process, answered once the child has ended."""

    def __init__(self, request_id, node: str, pid: int, fd: int, timeout_s: float):
        self.id, self.node, self.pid, self.fd, self.timeout_s = (request_id, node, pid, fd,
                                                                 timeout_s)
        self.deadline = time.monotonic() + timeout_s
        self.overran = False

    def enforce_deadline(self) -> None:
        """Past its deadline (a hung driver), the child is killed: reaped next, answered bad."""
        if not self.overran and time.monotonic() > self.deadline:
            self.overran = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def answer(self, status: int) -> dict:
        data = _drain(self.fd)
        os.close(self.fd)
        if self.overran:
            return {"id": self.id, "health": bad_result(
                self.node, f"the check did not finish within {self.timeout_s:g} s")}
        if os.WIFSIGNALED(status):
            return {"id": self.id, "health": bad_result(
                self.node, f"the check's process died of signal {os.WTERMSIG(status)}")}
        try:
            result = json.loads(data)
        except ValueError:
            result = None
        code = os.waitstatus_to_exitcode(status)
        if code != 0 or not isinstance(result, dict):
            result = bad_result(self.node, f"the check's process exited {code} without a "
                                "result")
        return {"id": self.id, "health": result}


def _start_check(request: dict, checks: dict[int, _Check], inherited: list[int]) -> dict | None:
    """Fork the child that runs a health check: None once it runs (the answer comes when it
    ends, from the main loop), or an error reply."""
    try:
        node, corrupt, timeout_s = _check_request(request["health"])
    except (KeyError, TypeError, ValueError) as e:
        return {"id": request.get("id"), "error": f"a health check request: {e}"}
    forked = _fork_with_pipe(request["id"], lambda result: _run_check(  # its result: the pipe
        node, corrupt, result, inherited))
    if isinstance(forked, dict):
        return forked
    pid, result = forked
    checks[pid] = _Check(request["id"], node, pid, result, timeout_s)
    return None


def _check_request(health: dict) -> tuple[str, set[int], float]:
    node, corrupt = health["node"], health.get("corrupt", [])
    timeout_s = float(health.get("timeout_s", _CHECK_TIMEOUT_S))
    if not isinstance(node, str) or not isinstance(corrupt, list):
        raise TypeError("node is a string, corrupt a list of tiles")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in corrupt):
        raise TypeError("corrupt is a list of tile indices")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s {timeout_s!r}")
    return node, set(corrupt), timeout_s


def _run_check(node: str, corrupt: set[int], result_fd: int, inherited: list[int]) -> None:
    """In the forked child: the check, its result into `result_fd`, then exit."""
    code = 1
    try:
        die_with_parent()
        signal.set_wakeup_fd(-1)  # the warm process's: closed below
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)  # the agent's requests are this process's
        os.dup2(null, 0)
        os.close(null)
        result = check_tiles(node, corrupt)
        result["health_detail"] = result["health_detail"][:DETAIL_LIMIT]
        os.write(result_fd, json.dumps(result).encode())  # a few KB: the pipe takes it whole
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        # Never back into the warm process's loop, nor through its exit handlers.
        os._exit(code)


def _drain(fd: int) -> bytes:
    """What an ended child left in its pipe, at most RESULT_LIMIT bytes, without waiting."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while len(data) <= RESULT_LIMIT:
            chunk = os.read(fd, RESULT_LIMIT + 1 - len(data))
            if not chunk:
                break
            data += chunk
    return data[:RESULT_LIMIT]


def _accelerator_initialised() -> bool:
    import torch

    for kind in ("cuda", "xpu"):
        module = getattr(torch, kind, None)
        if module is not None and getattr(module, "is_initialized", lambda: False)():
            return True
    return False


if __name__ == "__main__":
    main()
