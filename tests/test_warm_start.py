"""Warm starts: the agent's ranks are forks of one process that imported the trainer once.

Real processes throughout: the warm process (`python -m optimus.supervision.warm`), real
`optimus train` ranks forked from it, real signals, a real heartbeat socket.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import metrics, wait_for, write_job
from multiproc import free_port

from controller.node.spawn import Spawner, WarmRank

# These tests look at warm processes themselves (parents, command lines, maps): the real
# `python -m optimus.supervision.warm`, not one forked by the test session's warm server
# (conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_warm")


@pytest.fixture
def spawner():
    s = Spawner(warm=True)
    wait_for(lambda: not s.warming(), 120, "the warm process's imports")
    yield s
    s.close()


def _env() -> dict[str, str]:
    return {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _wait(rank, timeout: float = 120.0) -> int:
    wait_for(lambda: rank.poll() is not None, timeout, f"rank {rank.pid} to end")
    return rank.returncode


def test_a_warm_rank_is_a_whole_optimus_train_process(spawner, tmp_path):
    """Forked from the warm process, in a session of its own, with the environment it was
    given (it heartbeats to the socket named there), its output in its log, its exit code."""
    job = write_job(tmp_path / "job.yaml", tmp_path / "run", steps=6)
    sock_path = str(tmp_path / "agent.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(60)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OPTIMUS_AGENT_SOCKET": sock_path}
    log = tmp_path / "rank.log"
    rank = spawner.start(["optimus", "train", str(job)], env, log)
    assert isinstance(rank, WarmRank)
    assert _ppid(rank.pid) == spawner._proc.pid  # a fork of the warm process, not an exec
    # Its own session (the agent signals its group) before its pid is even known.
    assert os.getsid(rank.pid) == rank.pid
    beat = json.loads(sock.recv(65536))  # the environment reached it
    assert beat["pid"] == rank.pid and beat["rank"] == 0
    assert _wait(rank) == 0
    steps = [m["step"] for m in metrics(tmp_path / "run") if "loss" in m]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert "step      6 | loss" in log.read_text()


def test_its_exits_read_as_those_of_a_fresh_process(spawner, tmp_path):
    job = write_job(tmp_path / "job.yaml", tmp_path / "run", steps=10_000)
    env = _env()
    bad = spawner.start(["optimus", "train", str(tmp_path / "missing.yaml")], env,
                        tmp_path / "bad.log")
    assert _wait(bad) == 2  # a user's error: one line, status 2
    assert "error:" in (tmp_path / "bad.log").read_text()
    assert "Traceback" not in (tmp_path / "bad.log").read_text()

    running = spawner.start(["optimus", "train", str(job)], env, tmp_path / "run.log")
    wait_for(lambda: any("loss" in m for m in _rows(tmp_path / "run")), 120, "a step")
    os.kill(running.pid, signal.SIGKILL)
    assert _wait(running) == -signal.SIGKILL  # as Popen reports a signal

    # A run of its own: its SIGTERM must come once it trains (its handler is installed).
    job = write_job(tmp_path / "stop.yaml", tmp_path / "stop", steps=10_000)
    stopped = spawner.start(["optimus", "train", str(job)], env, tmp_path / "stop.log")
    wait_for(lambda: len([m for m in _rows(tmp_path / "stop") if "loss" in m]) > 3, 120,
             "its steps")
    os.kill(stopped.pid, signal.SIGTERM)  # the trainer's own handler: stop after a step
    assert _wait(stopped) == 0
    assert any(m.get("event") == "stopped" for m in _rows(tmp_path / "stop"))


def _rows(run: Path) -> list[dict]:
    try:
        return metrics(run)
    except (FileNotFoundError, ValueError):
        return []


def test_ranks_die_with_the_warm_process_and_the_next_starts_warm_again(spawner, tmp_path):
    job = write_job(tmp_path / "job.yaml", tmp_path / "run", steps=10_000)
    env = _env()
    rank = spawner.start(["optimus", "train", str(job)], env, tmp_path / "a.log")
    first = spawner._proc.pid
    os.kill(first, signal.SIGKILL)  # the warm process dies: its ranks with it
    assert _wait(rank, 30) == -signal.SIGKILL
    wait_for(lambda: not Path(f"/proc/{rank.pid}").exists()
             or "Z" in Path(f"/proc/{rank.pid}/stat").read_text().split()[2], 30,
             "the rank to die")
    again = spawner.start(["optimus", "train", str(tmp_path / "missing.yaml")], env,
                          tmp_path / "b.log")
    assert isinstance(again, WarmRank) and spawner._proc.pid != first
    assert _wait(again) == 2


def test_with_warm_starts_off_ranks_start_cold(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMUS_WARM_START", "0")
    s = Spawner()
    assert not s.warming()
    rank = s.start(["optimus", "train", str(tmp_path / "missing.yaml")], dict(os.environ),
                   tmp_path / "cold.log")
    assert isinstance(rank, subprocess.Popen)
    assert rank.wait(timeout=120) == 2
    assert "no such job file" in (tmp_path / "cold.log").read_text()
    s.close()  # nothing warm to stop
    assert not s.warming()


def test_one_ranks_poll_never_reaps_another(spawner, tmp_path):
    """Regression: the agent reaps a rank once its returncode is set and skips it after; two
    ranks ending together must each be reaped by their own poll() (as with Popen), or the
    second's exit is never reported and the job waits forever."""
    env = _env()
    ranks = [spawner.start(["optimus", "train", str(tmp_path / "missing.yaml")], env,
                           tmp_path / f"{i}.log") for i in range(2)]
    wait_for(lambda: all((tmp_path / f"{i}.log").is_file()
                         and (tmp_path / f"{i}.log").read_text() for i in range(2)), 60,
             "both ranks' last words")
    time.sleep(1.0)  # both reaped by the warm process, both reports in the pipe
    assert _wait(ranks[0]) == 2
    assert ranks[1].returncode is None  # not until its own poll()
    assert _wait(ranks[1]) == 2  # reported all the same


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_standby_process_becomes_the_rank_it_is_handed(tmp_path):
    """Standby mode (a node with GPUs or XPUs): one process per device waits, imports done and
    device context made; the next rank of that local rank is that very process."""
    s = Spawner(mode="standby")
    try:
        s.keep_ready(2)
        waiting = s.standbys()
        assert sorted(waiting) == [0, 1]
        s.keep_ready(2)
        assert s.standbys() == waiting  # ready ones are kept, not restarted
        job = write_job(tmp_path / "job.yaml", tmp_path / "run", steps=6)
        log = tmp_path / "rank.log"
        rank = s.start(["optimus", "train", str(job)], {**_env(), "LOCAL_RANK": "0"}, log)
        assert rank.pid == waiting[0]  # adopted: no process started for it
        assert os.getpgid(rank.pid) == rank.pid  # its own session, for the agent's signals
        assert _wait(rank) == 0, log.read_text()[-3000:]
        assert [m["step"] for m in metrics(tmp_path / "run") if "loss" in m] == [1, 2, 3, 4, 5, 6]
        assert s.standbys() == {1: waiting[1]}  # the other still waits for its rank
        s.keep_ready(2)
        replaced = s.standbys()
        assert replaced[1] == waiting[1] and replaced[0] not in (waiting[0], waiting[1])
    finally:
        s.close()
    assert not any(_alive(pid) for pid in (*waiting.values(), *replaced.values()))


FIRST_STEPS = """
import json, os, sys
import optimus.train
from optimus.cli import main
before = set(sys.modules)
try:
    main(["train", sys.argv[1]], standalone_mode=False)
finally:
    print(json.dumps(sorted(set(sys.modules) - before)))
"""


def _imported_dynamo(text: str) -> list[str]:
    """The torch._dynamo modules `-X importtime` says were imported, in a process's output."""
    return [line.rsplit("|", 1)[1].strip() for line in text.splitlines()
            if line.startswith("import time:") and "| " in line
            and line.rsplit("|", 1)[1].strip().startswith("torch._dynamo")]


def test_the_warm_process_is_past_what_a_ranks_first_steps_import(tmp_path, monkeypatch, capfd):
    """The real warm process (`python -m optimus.supervision.warm`) imports what a rank forked
    from it
    would import in its first steps (its model built on meta, a step, DTensor's first
    decisions: dynamo, ~0.5 s of CPU, on a restart's critical path, where the resume's
    agreement waits for the new rank) before it serves: its rank imports none of dynamo."""
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")  # the warm process, and its forks
    job = write_job(tmp_path / "job.yaml", tmp_path / "run", steps=5, memory_every=0)
    log = tmp_path / "rank.log"
    s = Spawner(warm=True)
    try:
        wait_for(lambda: not s.warming(), 120, "the warm process's imports")
        rank = s.start(["optimus", "train", str(job)], _env(), log)
        assert isinstance(rank, WarmRank) and _wait(rank) == 0, log.read_text()[-3000:]
    finally:
        s.close()
    assert "torch._dynamo" in _imported_dynamo(capfd.readouterr().err)  # before it served
    assert _imported_dynamo(log.read_text()) == []  # and nothing of it in the rank
    assert [m["step"] for m in metrics(tmp_path / "run") if "loss" in m] == [1, 2, 3, 4, 5]


def test_without_that_a_rank_imports_dynamo_in_its_first_steps(tmp_path):
    """The cause, in a plain process past the trainer's imports (what the warm process was
    before it imported dynamo itself): its first steps import dynamo and its friends."""
    job = write_job(tmp_path / "job.yaml", tmp_path / "run", steps=5, memory_every=0)
    env = {**_env(), "OPTIMUS_WARM_START": "0"}
    out = subprocess.run([sys.executable, "-c", FIRST_STEPS, str(job)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert "torch._dynamo" in imported, len(imported)
