"""A rank's Python stacks for its agent: SIGUSR1 dumps every thread's stack to a file, and the
agent may read the rank's memory from outside (py-spy) when it cannot answer the signal
(controller/node/stacks.py reads both)."""

from __future__ import annotations

import contextlib
import os
import signal

from optimus.contract.env import AGENT_PID, STACKS_FILE


def register_stack_dumps() -> None:
    """SIGUSR1 dumps every thread's Python stack to $OPTIMUS_STACKS_FILE, from C, even while
    the main thread is blocked in a collective or a device call: the agent's view of a hang.
    And the agent may read this rank's memory from outside (py-spy), for a rank that cannot
    answer the signal."""
    path = os.environ.get(STACKS_FILE)
    if not path:
        return
    import faulthandler  # a C signal handler: it runs with the interpreter stuck

    faulthandler.register(signal.SIGUSR1, file=open(path, "a"), all_threads=True)  # noqa: SIM115
    allow_parent_to_read()


PR_SET_PTRACER = 0x59616D61


def allow_parent_to_read() -> None:
    """Under Yama (kernel.yama.ptrace_scope 1, Ubuntu's default) only a process's ancestors may
    read its memory, and py-spy, started by the agent, is no ancestor of this rank: name the
    agent (OPTIMUS_AGENT_PID; else the parent) this process's ptracer, which covers the agent's
    children. A rank forked by the agent's warm process is the agent's grandchild, so the
    parent would not do. Elsewhere a no-op."""
    import ctypes

    agent = int(os.environ.get(AGENT_PID) or os.getppid())
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, agent, 0, 0, 0)
