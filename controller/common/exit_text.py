"""How a rank's exit reads in events and exclusions: its status, and its last words.

A rank's log holds more than the rank's own output. With `checkpoint.async_mode: process`,
DCP's checkpoint writer is a child process writing to the same file: its logger's lines
(`[0] 2026-01-02 03:04:05,678 - root - INFO - ...`) and, once the rank is gone, the traceback
of its broken pipe (`Process SpawnProcess-1:`, `Traceback ...`, ending in `BrokenPipeError`
or `EOFError`). `own_lines` drops both; the agent keeps the tail of what is left.

A rank ended by a signal raised nothing: a traceback, an exception line or a peer's connection
error at the end of its log is someone else's (or the collateral of its death), so its last
words are the last line it printed itself (a step, a checkpoint, a fault injection), or none.
A rank that exited with a code said why on its last line: its own exception, or `error: ...`;
a status only Optimus's ranks give (optimus/contract/exits.py) says what it means beside it.
"""

from __future__ import annotations

import re
import signal

from optimus.contract.exits import OWN, meaning

# DCP's checkpoint writer's logger (torch/distributed/checkpoint/logger.py), in its own process.
_WRITER_LOG = re.compile(r"^\[\d+\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ - ")
# multiprocessing writes this line before the traceback of a child that raised.
_CHILD_HEADER = re.compile(r"^Process [\w.-]+:$")
_CHAINED = re.compile(r"^(During handling of the above exception|The above exception was the "
                      r"direct cause)")
_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.:]*(Error|Exception|Interrupt|Exit)\b")
# Lines that are no trainer's print even in the rank's own output: peers' connection errors,
# C++ logs (glog-style `[W1123 20:18:56.12 ...]`), C++ aborts, faulthandler, Python warnings.
_NOISE = re.compile(
    r"Connection (closed|reset|refused)|by peer|Broken pipe|ECONNRESET|gloo::|"
    r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d|^terminate called|^Fatal Python error|"
    r"^(Current thread|Thread) 0x|^Stack \(most recent call first\)|^Extension modules:|"
    r"^\S+\.py:\d+: \w*Warning:")
MAX_CHARS = 200
RECENT_S = 10.0  # a signal's victim's last line is quoted only if it wrote it this recently


def own_lines(lines: list[str]) -> list[str]:
    """`lines` of a rank's log without those of its checkpoint writer process: the writer's
    log lines, and a child's traceback from its `Process NAME:` header to its last exception
    line (chained exceptions included)."""
    out: list[str] = []
    in_child = False
    traceback_next = False  # a child's `Traceback` line is expected after its header or a chain
    for line in lines:
        if _WRITER_LOG.match(line):
            continue
        if _CHILD_HEADER.match(line):
            in_child, traceback_next = True, True
            continue
        if in_child:
            if not line.strip() or line[:1].isspace() or _EXCEPTION.match(line):
                continue
            if _CHAINED.match(line):
                traceback_next = True
                continue
            if _TRACEBACK.match(line) and traceback_next:
                traceback_next = False
                continue
            in_child = False  # the child's traceback is over: this line is the rank's again
        out.append(line)
    return out


def _printed(line: str) -> bool:
    """A line the trainer printed, not part of a traceback or a peer's error."""
    return bool(line.strip()) and not (
        line[:1].isspace() or _TRACEBACK.match(line) or _CHAINED.match(line)
        or _EXCEPTION.match(line) or _NOISE.search(line))


def last_words(tail: str, by_signal: bool) -> str:
    """The line of a rank's log tail that says how it ended; "" when none does."""
    lines = own_lines(tail.splitlines())
    said = [s for s in lines if _printed(s)] if by_signal else [s for s in lines if s.strip()]
    return said[-1].strip()[:MAX_CHARS] if said else ""


def signal_name(number: int) -> str:
    """`SIGKILL (9)`; `signal 99` for a number Python has no name for."""
    try:
        return f"{signal.Signals(number).name} ({number})"
    except ValueError:
        return f"signal {number}"


def describe_exit(rank: int, node: str, code: int | None, sig: int | None, tail: str,
                  tail_age: float | None = None) -> str:
    """`rank 1 on node3 ended with SIGKILL (9): step 12 | loss ...`, or with `exit code 1:
    ValueError: ...`, or `exit code 89 (its checkpoint saves failed ...): ...`. A rank killed by
    a signal said nothing about it: its last line is quoted only when it wrote it within
    RECENT_S of its end (`tail_age`), as where it was; an older one (a save that failed minutes
    before) would read as the cause."""
    how = (signal_name(sig) if sig is not None else f"exit code {code} ({meaning(code)})"
           if code in OWN else f"exit code {code}")
    stale = sig is not None and tail_age is not None and tail_age > RECENT_S
    last = "" if stale else last_words(tail, by_signal=sig is not None)
    return f"rank {rank} on {node} ended with {how}" + (f": {last}" if last else "")
