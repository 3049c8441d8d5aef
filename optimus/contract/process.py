"""Process lifetime between the agent, its warm process and the ranks."""

from __future__ import annotations

import contextlib
import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """This process is SIGKILLed when its parent dies (Linux's PR_SET_PDEATHSIG; elsewhere,
    nothing): a lost agent takes its ranks with it, as a lost node does. A `preexec_fn` for
    subprocess.Popen, or called first thing in a forked child."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
