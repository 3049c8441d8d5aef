"""A clean finish ends every rank with exit status 0 and a quiet log, every time.

Real ranks train a tiny job with DCP's asynchronous writer process (PROCESS mode) and in-memory
snapshots, started cold (`python -m optimus train`) and forked from a warm process (whose ranks
leave through os._exit, skipping Python's exit handlers). Each rank's whole output is checked:
no traceback, no C++ `terminate called`, no EOFError from the writer process, none of its INFO
chatter nor its warnings about DeviceMesh; and no writer process outlives its rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import yaml
from cluster import ROOT, metrics, wait_for, write_job
from multiproc import free_port

from controller.node.spawn import Spawner
from optimus.checkpoint.manifest import committed_steps

# These tests look at warm processes themselves (parents, command lines, maps): the real
# `python -m optimus.supervision.warm`, not one forked by the test session's warm server
# (conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_warm")

STEPS = 8
FORBIDDEN = ("Traceback", "terminate called", "EOFError", "Waiting for checkpoint save request",
             "DeviceMesh")


def _job(tmp_path: Path) -> Path:
    """Disk checkpoints every 3 steps through DCP's writer process, snapshots every 2."""
    path = write_job(tmp_path / "job.yaml", tmp_path / "run", steps=STEPS, async_mode="process")
    job = yaml.safe_load(path.read_text())
    job["checkpoint"].update({"interval": 3, "memory_every": 2})
    path.write_text(yaml.safe_dump(job))
    return path


def _envs(tmp_path: Path, world: int, token: str) -> list[dict[str, str]]:
    port = free_port()
    return [{**os.environ, "OPTIMUS_RANK": str(rank), "OPTIMUS_WORLD_SIZE": str(world),
             "OPTIMUS_LOCAL_RANK": str(rank), "OPTIMUS_LOCAL_WORLD_SIZE": str(world),
             "OPTIMUS_MASTER_ADDR": "127.0.0.1", "OPTIMUS_MASTER_PORT": str(port),
             "OPTIMUS_SNAPSHOT_DIR": str(tmp_path / "shm" / "own"),
             "OPTIMUS_TEST_RUN": token} for rank in range(world)]


def _survivors(token: str) -> list[str]:
    """Processes still alive that inherited this run's environment (a writer process does)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile, or not ours
            continue
        if f"OPTIMUS_TEST_RUN={token}".encode() in environ.split(b"\0"):
            found.append(f"{entry.name}: {cmdline}")
    return found


def _check(tmp_path: Path, codes: list[int], logs: list[str], token: str) -> None:
    for rank, (code, text) in enumerate(zip(codes, logs, strict=True)):
        assert code == 0, f"rank {rank} exited {code}:\n{text[-3000:]}"
        for word in FORBIDDEN:
            assert word not in text, f"rank {rank}'s log has {word!r}:\n{text[-3000:]}"
    run = tmp_path / "run"
    assert {3, STEPS} <= set(committed_steps(run / "checkpoints"))  # 6: unless skipped
    assert [m["step"] for m in metrics(run) if "loss" in m] == list(range(1, STEPS + 1))
    notes = [m["message"] for m in metrics(run) if m.get("event") == "checkpoint"]
    assert not [n for n in notes if "process" in n], notes  # no fallback from PROCESS mode
    assert sorted(p.name for p in (tmp_path / "shm" / "own").iterdir())  # snapshots were taken
    # A writer process exits with its rank: none is left once the ranks are reaped.
    wait_for(lambda: not _survivors(token), 30, "the writer processes to exit", interval=0.2)


@pytest.mark.parametrize("world", [1, 2])
def test_cold_ranks_exit_zero_with_quiet_logs(tmp_path, world):
    job, token = _job(tmp_path), uuid.uuid4().hex
    procs = [subprocess.Popen([sys.executable, "-m", "optimus", "train", str(job)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for env in _envs(tmp_path, world, token)]
    logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    _check(tmp_path, [p.returncode for p in procs], logs, token)


def test_warm_forked_ranks_exit_zero_with_quiet_logs(tmp_path):
    """A forked rank leaves through os._exit: what the exit handlers would have stopped must
    be stopped before it, by the trainer itself."""
    job, token = _job(tmp_path), uuid.uuid4().hex
    spawner = Spawner(warm=True)
    try:
        wait_for(lambda: not spawner.warming(), 120, "the warm process's imports")
        ranks = [spawner.start(["optimus", "train", str(job)], env, tmp_path / f"rank{i}.log")
                 for i, env in enumerate(_envs(tmp_path, 2, token))]
        for rank in ranks:
            wait_for(lambda r=rank: r.poll() is not None, 300, f"rank {rank.pid} to end")
        logs = [(tmp_path / f"rank{i}.log").read_text() for i in range(2)]
        _check(tmp_path, [r.returncode for r in ranks], logs, token)
    finally:
        spawner.close()


def test_gloo_threads_are_joined_before_the_interpreter_finalizes(tmp_path):
    """The process groups outlive train() in a reference cycle (the device mesh's); collected
    only during finalization, gloo's threads could not take the GIL there and the rank would
    abort. Python's exit handlers run while the interpreter is whole: by the last of them
    (the one registered first), gloo's threads are gone."""
    job, token = _job(tmp_path), uuid.uuid4().hex
    seen = tmp_path / "threads.txt"
    code = textwrap.dedent(f"""
        import atexit, os
        from optimus.config import load_job
        from optimus.train import train
        def names():
            return [open(f"/proc/self/task/{{t}}/comm").read().strip()
                    for t in os.listdir("/proc/self/task")]
        atexit.register(lambda: open({str(seen)!r}, "w").write(" ".join(names())))
        train(load_job({str(job)!r}, []), quiet=True)
        """)
    (env,) = _envs(tmp_path, 1, token)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    threads = seen.read_text().split()
    assert threads and not [t for t in threads if "gloo" in t], threads
