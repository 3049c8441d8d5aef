"""A hung rank's Python stacks, collected by its agent: first by asking the rank, then from
outside it, then by asking again.

1. SIGUSR1. The rank's faulthandler (optimus/runtime/stacks.py, `register_stack_dumps`) writes every
   thread's stack to its stacks file from C, even while the main thread is blocked in a
   collective or a device call. A rank answers within milliseconds, or not at all: one stuck
   in the kernel (a driver call, a dead filesystem) runs no signal handler, and a library may
   have taken SIGUSR1 over.
2. py-spy. A rank silent for `answer_s` is read with `py-spy dump --nonblocking --pid N`,
   which reads the interpreter's memory from outside (process_vm_readv) without stopping the
   rank and without its help. It needs ptrace rights over the rank, which its agent (its
   parent, same user) has unless a container takes them away. py-spy is looked for next to
   this Python, then on PATH; $OPTIMUS_PY_SPY names it (empty: do not use it).
3. SIGUSR1 again, for a rank still silent (no py-spy, or it failed), and `answer_s` more: a
   late answer to the first request counts too.

Each stack not given at once ends with a line saying how it was had; a rank with none gets a
text saying why (no answer, and what became of py-spy), so the hang's failure event says so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from optimus.contract.env import PY_SPY as PY_SPY_ENV

ANSWER_S = 1.0  # how long a rank has to answer SIGUSR1, each time
PY_SPY_TIMEOUT_S = 3.0
_POLL_S = 0.05


@dataclass(frozen=True)
class Target:
    rank: int
    pid: int
    path: Path  # where its faulthandler writes


def find_py_spy() -> str | None:
    """The py-spy to use, or None: $OPTIMUS_PY_SPY, next to this Python, or on PATH."""
    if PY_SPY_ENV in os.environ:
        return os.environ[PY_SPY_ENV] or None
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def collect(targets: list[Target], *, answer_s: float = ANSWER_S,
            py_spy: str | None = None, py_spy_timeout_s: float = PY_SPY_TIMEOUT_S,
            ) -> tuple[dict[int, str], dict[int, str]]:
    """Every target's stack (rank -> text), and for the ranks that did not answer the first
    SIGUSR1 in time, how theirs was had or why there is none (rank -> note)."""
    for t in targets:
        with contextlib.suppress(OSError):
            t.path.write_text("")  # the rank appends: keep this dump only
        _signal(t)
    stacks = _answers(targets, answer_s)
    notes: dict[int, str] = {}
    silent = [t for t in targets if t.rank not in stacks]
    no_answer = f"no answer to SIGUSR1 within {answer_s:g} s"
    spy_failed: dict[int, str] = {}
    for t in silent:
        if py_spy is None:
            spy_failed[t.rank] = ("py-spy is not installed (pip install py-spy; or set "
                                  f"${PY_SPY_ENV})" if PY_SPY_ENV not in os.environ
                                  else f"py-spy is off (${PY_SPY_ENV} is empty)")
            continue
        text, why = _py_spy(py_spy, t.pid, py_spy_timeout_s)
        if text:
            notes[t.rank] = f"read by py-spy dump --nonblocking: {no_answer}"
            stacks[t.rank] = f"{text}\n({notes[t.rank]})\n"
        else:
            spy_failed[t.rank] = why
    silent = [t for t in silent if t.rank not in stacks]
    for t in silent:
        _signal(t)
    for rank, text in _answers(silent, answer_s).items():
        notes[rank] = (f"answered a second SIGUSR1 ({no_answer} the first time; "
                       f"{spy_failed[rank]})")
        stacks[rank] = f"{text}\n({notes[rank]})\n"
    for t in silent:
        if t.rank not in stacks:
            notes[t.rank] = (f"no stack: no answer to SIGUSR1, twice, within {answer_s:g} s "
                             f"each; {spy_failed[t.rank]}")
            stacks[t.rank] = f"({notes[t.rank]})\n"
    return stacks, notes


def _signal(t: Target) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(t.pid, signal.SIGUSR1)


def _answers(targets: list[Target], within_s: float) -> dict[int, str]:
    """The stacks files that filled within `within_s`: non-empty and the same size at two
    polls in a row (faulthandler writes a dump in many small writes)."""
    deadline = time.monotonic() + within_s
    sizes: dict[int, int] = {}
    done: dict[int, str] = {}
    while targets and len(done) < len(targets):
        for t in targets:
            if t.rank in done:
                continue
            with contextlib.suppress(OSError):
                text = t.path.read_text(errors="replace")
                if text.strip() and sizes.get(t.rank) == len(text):
                    done[t.rank] = text
                sizes[t.rank] = len(text)
        if time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    return done


def _py_spy(py_spy: str, pid: int, timeout_s: float) -> tuple[str | None, str]:
    """(the stack py-spy read, ""), or (None, why it could not)."""
    try:
        out = subprocess.run([py_spy, "dump", "--nonblocking", "--pid", str(pid)],
                             capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        return None, f"py-spy not found at {py_spy}"
    except subprocess.TimeoutExpired:
        return None, f"py-spy did not finish within {timeout_s:g} s"
    except OSError as e:
        return None, f"py-spy could not run: {e}"
    if out.returncode != 0 or "Thread " not in out.stdout:
        said = (out.stderr.strip() or out.stdout.strip()).splitlines()
        return None, f"py-spy failed (exit {out.returncode}): {said[-1] if said else '?'}"
    return _main_thread_last(out.stdout, pid), ""


def _main_thread_last(dump: str, pid: int) -> str:
    """py-spy's threads without its header, the main thread last, as faulthandler orders them
    (a long dump is cut from its start: the main thread's stack is the one that matters)."""
    blocks: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith("Thread "):
            blocks.append([line])
        elif blocks and line.strip():
            blocks[-1].append(line)
    main = [b for b in blocks if b[0].startswith(f"Thread {pid} ")]
    rest = [b for b in blocks if not b[0].startswith(f"Thread {pid} ")]
    return "\n".join(line for b in rest + main for line in b)
