"""How a rank's exit reads: the signal by name, and the rank's own last words, never the
checkpoint writer's traceback or a peer's connection error."""

from __future__ import annotations

import pytest

from controller.common.exit_text import describe_exit, last_words, own_lines, signal_name
from controller.control.detect import SOFT, exit_evidence
from controller.control.view import Exit
from controller.node.ranks import tail

STEPS = """\
step     47 | loss 0.8745 | gnorm 0.606 | 32,722 tok/s | 16 ms
step     48 | loss 0.8132 | gnorm 0.794 | 27,690 tok/s | 18 ms
step     49 | loss 0.8140 | gnorm 0.612 | 33,763 tok/s | 15 ms"""
LAST_STEP = "step     49 | loss 0.8140 | gnorm 0.612 | 33,763 tok/s | 15 ms"
LIB = "/usr/lib/python3.11/multiprocessing"
DCP = "/venv/lib/python3.11/site-packages/torch/distributed/checkpoint"

# The checkpoint writer (async_mode: process) waiting for a request when its rank was killed.
WRITER_EOF = f"""\
[0] 2026-11-23 20:18:56,108 - root - INFO - Waiting for checkpoint save request...
[0] 2026-11-23 20:18:57,202 - root - INFO - Checkpoint background process is shutting down...
Process SpawnProcess-1:
Traceback (most recent call last):
  File "{LIB}/process.py", line 314, in _bootstrap
    self.run()
  File "{LIB}/process.py", line 108, in run
    self._target(*self._args, **self._kwargs)
  File "{DCP}/_async_process_executor.py", line 290, in _checkpointing_subprocess
    obj = parent_conn.recv()
          ^^^^^^^^^^^^^^^^^^
  File "{LIB}/connection.py", line 430, in _recv_bytes
    buf = self._recv(4)
          ^^^^^^^^^^^^^
  File "{LIB}/connection.py", line 399, in _recv
    raise EOFError
EOFError"""

# The writer answering a save when its rank was killed (as captured from a real run).
WRITER_BROKEN_PIPE = f"""\
[0] 2026-11-23 20:18:56,108 - root - INFO - Received async checkpoint request with id=None
[0] 2026-11-23 20:18:56,202 - root - ERROR - Checkpoint save failed for checkpoint_id=None: \
[Errno 32] Broken pipe
[0] 2026-11-23 20:18:56,202 - root - INFO - Checkpoint background process is shutting down...
Process SpawnProcess-1:
Traceback (most recent call last):
  File "{DCP}/_async_process_executor.py", line 314, in _checkpointing_subprocess
    parent_conn.send(response)
  File "{LIB}/connection.py", line 384, in _send
    n = write(self._handle, buf)
        ^^^^^^^^^^^^^^^^^^^^^^^^
BrokenPipeError: [Errno 32] Broken pipe

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "{LIB}/process.py", line 314, in _bootstrap
    self.run()
  File "{DCP}/_async_process_executor.py", line 344, in _checkpointing_subprocess
    parent_conn.send(e)
  File "{LIB}/connection.py", line 384, in _send
    n = write(self._handle, buf)
        ^^^^^^^^^^^^^^^^^^^^^^^^
BrokenPipeError: [Errno 32] Broken pipe"""

OWN_VALUE_ERROR = """\
Traceback (most recent call last):
  File "/work/main/optimus/train.py", line 120, in train
    batch = next(loader)
            ^^^^^^^^^^^^
  File "/work/main/optimus/data/loader.py", line 88, in __next__
    raise ValueError(f"shard {path} is truncated")
ValueError: shard /data/shard_00003.bin is truncated"""

GLOO_ABORT = """\
terminate called after throwing an instance of 'gloo::IoException'
  what():  [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer \
[127.0.0.1]:40113"""

FAULTHANDLER_SEGV = """\
Fatal Python error: Segmentation fault

Thread 0x00007f3a1c9ff640 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait

Current thread 0x00007f3a2e4b7740 (most recent call first):
  File "/work/main/optimus/train.py", line 141 in train

Extension modules: numpy.core._multiarray_umath, torch._C (total: 2)"""


@pytest.mark.parametrize("code,sig,tail,expect", [
    (None, 9, f"{STEPS}\n{WRITER_EOF}", f"SIGKILL (9): {LAST_STEP}"),
    (None, 9, f"{STEPS}\n{WRITER_BROKEN_PIPE}", f"SIGKILL (9): {LAST_STEP}"),
    (None, 9, "step     14 | loss 2.6 | gnorm 1.6\nfault injection: rank 1 kills itself at "
     "step 15", "SIGKILL (9): fault injection: rank 1 kills itself at step 15"),
    (None, 9, f"{STEPS}\n[E1123 20:18:56.123456 ProcessGroupGloo.cpp:143] Read error "
     "[127.0.0.1]:3456: Connection reset by peer\nRuntimeError: Connection reset by peer",
     f"SIGKILL (9): {LAST_STEP}"),
    (None, 9, WRITER_EOF, "SIGKILL (9)"),  # nothing of its own in the tail: nothing said
    (None, 15, f"{STEPS}\ncheckpoint: save of step 50 skipped: the previous one is still "
     "being written", "SIGTERM (15): checkpoint: save of step 50 skipped: the previous one "
     "is still being written"),
    (None, 11, f"{STEPS}\n{FAULTHANDLER_SEGV}", f"SIGSEGV (11): {LAST_STEP}"),
    (None, 6, f"{STEPS}\n{GLOO_ABORT}", f"SIGABRT (6): {LAST_STEP}"),
    (1, None, f"{STEPS}\n{OWN_VALUE_ERROR}",
     "exit code 1: ValueError: shard /data/shard_00003.bin is truncated"),
    # Its own error, then the writer's traceback once the rank had gone: still its own error.
    (1, None, f"{STEPS}\n{OWN_VALUE_ERROR}\n{WRITER_EOF}",
     "exit code 1: ValueError: shard /data/shard_00003.bin is truncated"),
    (1, None, "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
     "closed by peer [127.0.0.1]:40113", "exit code 1: RuntimeError: [../third_party/gloo/"
     "gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40113"),
    (2, None, "error: job.yaml: optim.lr: 0 is not above 0", "exit code 2: error: job.yaml: "
     "optim.lr: 0 is not above 0"),
], ids=["sigkill-writer-eof", "sigkill-writer-broken-pipe", "sigkill-clean",
        "sigkill-peer-error", "sigkill-nothing-own", "sigterm", "sigsegv-faulthandler",
        "sigabrt-gloo", "exit-1-own-error", "exit-1-then-writer", "exit-1-peer", "exit-2"])
def test_an_exit_reads_as_its_status_and_its_own_last_words(code, sig, tail, expect):
    text = describe_exit(1, "n0", code, sig, tail)
    assert text == f"rank 1 on n0 ended with {expect}"
    if sig is not None:
        assert "Error" not in text and "Traceback" not in text


def test_own_lines_drop_only_the_writers_output():
    lines = own_lines(f"{STEPS}\n{WRITER_BROKEN_PIPE}\nresume: from step 40".splitlines())
    assert lines == [*STEPS.splitlines(), "resume: from step 40"]
    # The rank's own traceback is kept, even right after the writer's.
    lines = own_lines(f"{WRITER_EOF}\n{OWN_VALUE_ERROR}".splitlines())
    assert lines == OWN_VALUE_ERROR.splitlines()


def test_signal_names_and_long_lines():
    assert signal_name(9) == "SIGKILL (9)" and signal_name(15) == "SIGTERM (15)"
    assert signal_name(40) == "signal 40"  # a real-time signal Python does not name
    assert last_words("x" * 500, by_signal=True) == "x" * 200
    assert last_words("", by_signal=True) == last_words("\n\n", by_signal=False) == ""


def test_a_killed_rank_whose_writer_broke_its_pipe_is_no_collateral(tmp_path):
    """The agent's tail leaves out the writer's `Broken pipe`: the killed rank is blamed, not
    taken for a rank that lost its peers."""
    log = tmp_path / "rank_00001.log"
    log.write_text(f"{STEPS}\n{WRITER_BROKEN_PIPE}\n")
    kept = tail(log)
    assert kept == STEPS
    killed = Exit("n0", 1, 0, code=None, signal=9, tail=kept, local_rank=1)
    evidence = exit_evidence(killed)
    assert evidence.kind == SOFT and evidence.what == f"rank 1 on n0 ended with SIGKILL (9): " \
        f"{LAST_STEP}"
