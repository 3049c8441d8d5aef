"""A rank that dies takes what it started with it.

A rank runs in a session of its own, and starts processes there: DCP's checkpoint writer in
`checkpoint.async_mode: process` (a spawned interpreter that lives as long as the run), data
workers. When the rank dies of a signal (a crash, the OOM killer, `kill_rank`), those outlive
it unless the agent ends its process group (controller/node/lifecycle.py `Ranks.reap`): before,
every rank a restart benchmark killed left its writer running, ~270 MB each, ten minutes on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cluster import ROOT, wait_for, write_job


def _started_for(marker: str) -> list[int]:
    """Processes whose environment names `marker` (the run's folder: every rank's and its
    children's OPTIMUS_STACKS_FILE is under it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if marker.encode() in environ and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def test_a_killed_ranks_checkpoint_writer_goes_with_it(tmp_path):
    run = tmp_path / "run"
    # Rank 1 kills itself at step 15, after the save of step 10 started its writer process.
    job = write_job(tmp_path / "job.yaml", run, steps=20, async_mode="process",
                    faults=[{"kind": "kill_rank", "rank": 1, "step": 15}])
    out = subprocess.run([sys.executable, "-m", "controller", "run", str(job), "--nodes", "2",
                          "--ranks-per-node", "1", "--spares", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "ended with SIGKILL" in out.stdout, out.stdout[-4000:]
    # The run is over and its agents gone: nothing it started may be left.
    try:
        wait_for(lambda: not _started_for(str(run)), 10, "the run's processes to be gone",
                 interval=0.5)
    except AssertionError:
        left = [Path(f"/proc/{p}/cmdline").read_bytes()[:160] for p in _started_for(str(run))]
        raise AssertionError(f"left running after the run: {left}") from None
