"""A hung rank's stack, collected by its agent (controller/node/stacks.py) from real processes with
real signals: asked with SIGUSR1; read from outside with py-spy when the rank does not answer;
asked again when py-spy is absent or fails; and, when nothing works, a text that says why."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from controller.node.stacks import Target, collect, find_py_spy

# A rank blocked in C (a lock that is never released, as in a device sync that never returns).
# "answers": faulthandler on SIGUSR1, as optimus/runtime/stacks.py registers it. "deaf":
# SIGUSR1 ignored, as by a rank stuck in the kernel. "second": the first SIGUSR1 is lost (a
# handler that only installs faulthandler), the second is answered.
RANK = """
import ctypes, faulthandler, os, signal, sys, threading
mode, path = sys.argv[1], sys.argv[2]
ctypes.CDLL(None).prctl(0x59616D61, os.getppid(), 0, 0, 0)  # as optimus/runtime/stacks.py does

def answer(*_):
    faulthandler.register(signal.SIGUSR1, file=open(path, "a"), all_threads=True)

if mode == "answers":
    answer()
elif mode == "second":
    signal.signal(signal.SIGUSR1, answer)
else:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
threading.Thread(target=threading.Event().wait, name="optimus-heartbeat", daemon=True).start()

def blocked_in_a_device_sync():
    print("ready", flush=True)  # from inside: a signal after "ready" finds this frame
    threading.Event().wait()

blocked_in_a_device_sync()
"""


@pytest.fixture
def rank(tmp_path):
    started: list[subprocess.Popen] = []

    def start(mode: str, rank: int = 1) -> Target:
        path = tmp_path / f"rank_{rank}.stacks"
        p = subprocess.Popen([sys.executable, "-c", RANK, mode, str(path)],
                             stdout=subprocess.PIPE, text=True)
        started.append(p)
        assert p.stdout.readline().strip() == "ready"
        return Target(rank, p.pid, path)
    yield start
    for p in started:
        p.kill()
        p.wait()


def test_a_rank_that_answers_gives_its_stack_at_once(rank):
    began = time.monotonic()
    stacks, notes = collect([rank("answers", 1), rank("answers", 2)], answer_s=120,
                            py_spy=None)
    # Both answered (no note), and collect returned on their answers, not at its deadline.
    assert notes == {} and time.monotonic() - began < 120
    for text in stacks.values():
        assert "Current thread" in text and "blocked_in_a_device_sync" in text


def test_a_deaf_rank_is_read_from_outside_by_py_spy(rank):
    py_spy = find_py_spy()
    assert py_spy, "py-spy is a dev dependency: pip install -e '.[dev]'"
    deaf = rank("deaf", 3)
    stacks, notes = collect([deaf, rank("answers", 4)], answer_s=0.5, py_spy=py_spy)
    assert notes == {3: "read by py-spy dump --nonblocking: no answer to SIGUSR1 within 0.5 s"}
    assert "Current thread" in stacks[4]  # the other answered as usual
    text = stacks[3]
    assert deaf.path.read_text() == ""  # it never wrote a thing
    lines = text.splitlines()
    # Its threads, by name, the main thread last (a long dump loses its start, not this).
    assert lines[0].startswith("Thread ") and '"optimus-heartbeat"' in lines[0]
    main = next(i for i, line in enumerate(lines) if line.startswith(f"Thread {deaf.pid} "))
    assert '"MainThread"' in lines[main]
    assert "blocked_in_a_device_sync (<string>:" in "\n".join(lines[main:])
    assert lines[-1] == f"({notes[3]})"


def test_without_py_spy_the_request_is_retried(rank):
    stacks, notes = collect([rank("second", 5)], answer_s=0.5, py_spy=None)
    assert notes[5].startswith("answered a second SIGUSR1 (no answer to SIGUSR1 within 0.5 s "
                               "the first time; py-spy is not installed (pip install py-spy")
    assert "blocked_in_a_device_sync" in stacks[5]


def test_when_py_spy_fails_the_request_is_retried_and_a_silent_rank_is_said_so(rank):
    stacks, notes = collect([rank("second", 6), rank("deaf", 7)], answer_s=0.3,
                            py_spy="/bin/false")
    assert "blocked_in_a_device_sync" in stacks[6]
    assert "py-spy failed (exit 1)" in notes[6]
    assert notes[7] == ("no stack: no answer to SIGUSR1, twice, within 0.3 s each; py-spy "
                        "failed (exit 1): ?")
    assert stacks[7] == f"({notes[7]})\n"
    stacks, notes = collect([rank("deaf", 8)], answer_s=0.3, py_spy=str(Path("/nonexistent")))
    assert notes[8].endswith("py-spy not found at /nonexistent")
