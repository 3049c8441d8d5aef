"""Warm starts: rank processes that are past their imports before the agent needs them.

    python -m optimus.warm                  one per node: forks every rank (requests on stdin)
    python -m optimus.warm --standby N      one per device: becomes one rank (its request on
                                            stdin), with device N's runtime already started

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
import ctypes
import json
import os
import select
import signal
import sys
import traceback

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.05


def main() -> None:
    if sys.argv[1:2] == ["--standby"]:
        standby(int(sys.argv[2]))
        return
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the agent's to handle
    import optimus.train  # noqa: F401  (the point: every import a rank would do, done once)
    from optimus.cli import main as optimus_main

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stray prints must not corrupt the replies
    _reply(replies, {"ready": True})
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], _POLL_S)
        if ready:
            data = os.read(0, 1 << 16)
            if not data:
                return  # the agent is gone
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                _reply(replies, _spawn(json.loads(line), optimus_main, replies.fileno()))
        for pid, status in _reaped():
            ended = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
                     else {"code": os.waitstatus_to_exitcode(status)})
            _reply(replies, {"pid": pid, **ended})


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


def _spawn(request: dict, optimus_main, replies_fd: int) -> dict:
    if _accelerator_initialised():
        return {"id": request["id"], "error": "an accelerator runtime is initialised in the "
                "warm process; a fork would not inherit it"}
    settled_r, settled_w = os.pipe()  # the child says when it leads its own session
    try:
        pid = os.fork()
    except OSError as e:
        os.close(settled_r)
        os.close(settled_w)
        return {"id": request["id"], "error": f"fork failed: {e}"}
    if pid == 0:
        os.close(settled_r)
        _become_rank(request, optimus_main, replies_fd, settled_w)  # never returns
    os.close(settled_w)
    os.read(settled_r, 1)  # so that the agent may signal its process group at once
    os.close(settled_r)
    return {"id": request["id"], "pid": pid}


def standby(device_index: int) -> None:
    """One device's standby rank (see the top of this module): ready, then adopted."""
    _die_with_parent()  # the agent started it in a session of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the agent's to handle
    import optimus.train  # noqa: F401  (the point: every import a rank would do, done now)
    from optimus.cli import main as optimus_main

    _start_device(device_index)
    line = sys.stdin.buffer.readline()
    if not line:
        return  # the agent is gone, or let this standby go
    _run_as_rank(json.loads(line), optimus_main)  # never returns


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


def _become_rank(request: dict, optimus_main, replies_fd: int, settled_fd: int) -> None:
    """In the forked child: become `optimus <argv...>` as a fresh process would, then exit."""
    try:
        os.setsid()
        os.write(settled_fd, b"x")
        os.close(settled_fd)
        _die_with_parent()
        os.close(replies_fd)
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


def _accelerator_initialised() -> bool:
    import torch

    for kind in ("cuda", "xpu"):
        module = getattr(torch, kind, None)
        if module is not None and getattr(module, "is_initialized", lambda: False)():
            return True
    return False


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


if __name__ == "__main__":
    main()
