"""`make test-fast`: a test skips at the moment it would start a process; the rest run."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_fast_tier_skips_what_starts_a_process_and_runs_the_rest():
    tests = ["tests/test_bench_fleet.py",  # no process: runs
             "tests/test_train.py::test_torchrun_with_two_processes_trains",  # a subprocess
             # a process-mode save starts DCP's writer in a thread that turns the refusal into
             # a failed save: still a skip
             "tests/test_train.py::test_a_checkpoint_holds_tensors_and_plain_values_only"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "--fast", "-p",
                           "no:cacheprovider", "-rs", *tests], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "1 passed, 2 skipped" in done.stdout, done.stdout[-3000:]
    assert done.stdout.count("starts a process: the full suite (make test) runs it") == 2
