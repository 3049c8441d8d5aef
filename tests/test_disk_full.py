"""A disk that refuses a write does not stop supervision (docs/security.md#a-full-disk).

The controller rewrites its journal (`<run_dir>/controller.json`) and an agent its ranks'
control file whenever what they hold changes. A full disk made either write raise out of the
tick: the leader died, then the standby that took over died the same way, and the agent with
its ranks. Here a real Controller and a real Agent tick against a real redis-server while the
folder they write to is full, and both must go on, say so once in an event, and write the file
once the disk takes it again.

Two ways to fill a disk, each test run with both:
- `tmpfs`: a 64 KiB tmpfs mounted for the test and filled with a file (ENOSPC). Needs root (or
  CAP_SYS_ADMIN); skipped where `mount` is refused.
- `fsize`: RLIMIT_FSIZE 0 in this process, SIGXFSZ ignored (EFBIG on every write that would
  grow a file): runs anywhere, the same code path for the writer (an OSError from a write).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from cluster import relay, write_job
from records import run_plan

from controller.control.controller import Controller
from controller.control.journal import read_journal
from controller.control.settings import settings_for
from controller.store.store import Store
from optimus.config import validate_job
from optimus.contract.records import Plan


class Disk:
    def __init__(self, root: Path, kind: str):
        self.root, self.kind = root, kind
        self.error = "ENOSPC" if kind == "tmpfs" else "EFBIG"
        self._limit: tuple[int, int] | None = None
        self._handler = None

    def fill(self) -> None:
        if self.kind == "fsize":
            self._limit = resource.getrlimit(resource.RLIMIT_FSIZE)
            self._handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, self._limit[1]))
            return
        fd = os.open(self.root / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)
        with pytest.raises(OSError, match="No space left"):  # full: not one byte more
            (self.root / "probe").write_bytes(b"x")

    def free(self) -> None:
        if self.kind == "fsize":
            if self._limit is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, self._limit)
                signal.signal(signal.SIGXFSZ, self._handler)
                self._limit = None
            return
        for name in ("filler", "probe"):
            (self.root / name).unlink(missing_ok=True)


@pytest.fixture
def short_dir():
    """A folder of its own, not under tmp_path: an agent binds its socket in it, and an AF_UNIX
    path holds at most 107 bytes (pytest-xdist's tmp_path alone takes ~70)."""
    root = Path(tempfile.mkdtemp(prefix="optimus-disk-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["tmpfs", "fsize"])
def disk(request, short_dir):
    if request.param == "fsize":
        d = Disk(short_dir, "fsize")
        yield d
        d.free()
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs",
                           str(short_dir)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield Disk(short_dir, "tmpfs")
    finally:
        subprocess.run(["umount", str(short_dir)], check=True)


def disk_events(store: Store) -> list[dict]:
    relay(store)  # an agent's events, from its node's own stream: the controller's part
    return [e for _, e in store.events(count=1000) if e.get("kind") == "disk"]


def leftovers(folder: Path, keep: set[str]) -> list[str]:
    """What a failed write left in `folder` besides the files that belong there."""
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


def _controller(redis_server, tmp_path, run_dir: Path) -> tuple[Controller, Store]:
    raw = yaml.safe_load(write_job(tmp_path / "job.yaml", run_dir, name="j").read_text())
    config = validate_job(raw, world=2)
    settings = settings_for(config, str(tmp_path / "job.yaml"), [], 2, 1)
    store = Store(redis_server.url, "j")
    for name in ("n0", "n1"):
        store.own.register_node(name, {"host": name, "health": "ok", "snapshot_addr": ""})
    return Controller(store, config, settings, ident="c"), store


def test_the_controller_supervises_on_while_its_journal_cannot_be_written(
        disk, redis_server, tmp_path):
    run_dir = disk.root / "run"
    run_dir.mkdir()
    ctl, store = _controller(redis_server, tmp_path, run_dir)
    journal = run_dir / "controller.json"
    disk.fill()
    try:
        for _ in range(4):  # the first plans generation 0: a change the journal must hold
            ctl.tick()
        plan = store.plan()
        assert plan is not None and plan["nodes"] == ["n0", "n1"]  # it went on, from Redis
        assert store.job_record()["state"] == "RUNNING"
        assert not journal.exists()
        assert leftovers(run_dir, {"events.jsonl"}) == []  # no temporary file left behind
        (failing,) = disk_events(store)  # said once, not once a tick
        assert failing["ok"] == "0" and failing["path"] == str(journal)
        assert disk.error in failing["message"] and str(journal) in failing["message"]
    finally:
        disk.free()
    ctl.tick()  # nothing changed in Redis: the write is tried again all the same
    assert read_journal(journal)["plan"] == store.plan()
    assert read_journal(journal)["job"]["state"] == "RUNNING"
    failing, recovered = disk_events(store)
    assert recovered["ok"] == "1" and "again" in recovered["message"]
    ctl.tick()
    assert len(disk_events(store)) == 2


def test_a_journal_is_never_written_through_a_temporary_name_another_writer_holds(
        redis_server, tmp_path):
    """Two controllers (a leader and a standby that just lost the lease) share a run dir: a
    fixed temporary name is one's file renamed over by the other, or (here) in the way."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ctl, store = _controller(redis_server, tmp_path, run_dir)
    (run_dir / "controller.json.tmp").mkdir()  # what the other writer holds there
    ctl.tick()
    assert read_journal(run_dir / "controller.json")["plan"] == store.plan()
    assert disk_events(store) == []


def _agent(redis_server, tmp_path, socket_dir: Path, monkeypatch):
    from controller.node.agent import Agent

    monkeypatch.setenv("OPTIMUS_WARM_START", "0")  # no warm process: ranks never start here
    store = Store(redis_server.url, "j")
    agent = Agent(store, "n0", socket_dir=str(socket_dir), snapshot_root=tmp_path / "snap")
    return agent, store


@contextlib.contextmanager
def closing(agent):
    try:
        yield agent
    finally:
        agent.spawner.close()
        agent.snapshots.close()
        agent.ranks.close()


def test_the_agent_supervises_on_while_its_ranks_control_file_cannot_be_written(
        disk, redis_server, tmp_path, monkeypatch):
    agent, store = _agent(redis_server, tmp_path, disk.root, monkeypatch)
    with closing(agent):
        control = agent.files.control_path
        folder = control.parent
        files = {Path(agent.ranks.socket_path).name, control.name, agent.files.chaos_path.name}
        agent._tick()  # registers
        assert json.loads(control.read_text()) == {}
        plan = run_plan(0, ["n1"], issued=1.0)
        disk.fill()
        try:
            store.set_control({"pause": True})
            store.set_plan(plan)
            for _ in range(3):
                agent._tick()
            assert agent.latest_plan == Plan.parse(plan)  # the tick went on past the write
            assert json.loads(control.read_text()) == {}  # the last word, whole
            assert leftovers(folder, files) == []
            (failing,) = disk_events(store)
            assert failing["ok"] == "0" and failing["node"] == "n0"
            assert failing["path"] == str(control) and disk.error in failing["message"]
        finally:
            disk.free()
        agent._tick()  # the word has not changed since: written all the same
        assert json.loads(control.read_text()) == {"pause": True}
        failing, recovered = disk_events(store)
        assert recovered["ok"] == "1" and "again" in recovered["message"]
        agent._tick()
        assert len(disk_events(store)) == 2


def test_a_control_file_is_never_written_through_a_fixed_temporary_name(
        redis_server, tmp_path, short_dir, monkeypatch):
    agent, store = _agent(redis_server, tmp_path, short_dir, monkeypatch)
    with closing(agent):
        agent.files.control_path.with_suffix(".tmp").mkdir()
        store.set_control({"checkpoint": 3})
        agent._tick()
        assert json.loads(agent.files.control_path.read_text()) == {"checkpoint": 3}
        assert disk_events(store) == []


def test_a_chaos_file_the_disk_refuses_is_said_once_and_the_agent_goes_on(
        disk, redis_server, tmp_path, monkeypatch):
    agent, store = _agent(redis_server, tmp_path, disk.root, monkeypatch)
    with closing(agent):
        chaos = agent.files.chaos_path
        files = {Path(agent.ranks.socket_path).name, agent.files.control_path.name, chaos.name}
        fault = {"id": 1, "kind": "stall_rank", "rank": 0, "generation": 0, "seconds": 1.0}
        disk.fill()
        try:
            agent.files.set_faults([fault])  # raised OSError before (and left "<name>.chaos-tmp")
            agent.files.set_faults([fault, {**fault, "id": 2}])
            assert json.loads(chaos.read_text()) == {"faults": []}  # the last file, whole
            assert leftovers(chaos.parent, files) == []
            (failing,) = disk_events(store)
            assert failing["ok"] == "0" and failing["path"] == str(chaos)
        finally:
            disk.free()
        agent.files.set_faults([fault])
        assert json.loads(chaos.read_text()) == {"faults": [fault]}
        assert [e["ok"] for e in disk_events(store)] == ["0", "1"]


def test_ranks_told_not_to_save_are_killed_while_the_disk_refuses_that_word(
        disk, redis_server, tmp_path, monkeypatch):
    """A stop without a save (a node computing wrong, NaN) tells the ranks "save": false in
    their control file, then sends SIGTERM; a rank that never read the word would save the
    state the stop drops (optimus/supervision/commands.py). With the word unwritten, no
    SIGTERM: SIGKILL."""
    from controller.node.ranks import RankProcess

    agent, store = _agent(redis_server, tmp_path, disk.root, monkeypatch)
    saved = tmp_path / "saved"
    rank = subprocess.Popen(  # what a rank does on SIGTERM: save, then exit
        [sys.executable, "-c", "import signal, sys, time\n"
         f"signal.signal(signal.SIGTERM, lambda *a: (open({str(saved)!r}, 'w').close(), "
         "sys.exit(0)))\nprint('ready', flush=True)\ntime.sleep(120)"],
        stdout=subprocess.PIPE, start_new_session=True)
    assert rank.stdout.readline() == b"ready\n"
    with closing(agent):
        agent.ranks.procs[0] = RankProcess(rank=0, local_rank=0, popen=rank,
                                           log_path=tmp_path / "l", started=0.0)
        disk.fill()
        try:
            agent.ranks.stop(30.0, save=False)  # a bad tile
            assert rank.wait(timeout=30) == -signal.SIGKILL
        finally:
            disk.free()
    assert not saved.exists()
    relay(store)
    (stop,) = [e for _, e in store.events(count=100) if e.get("kind") == "stop"]
    assert stop["message"] == ("rank 0 on n0 killed, not stopped: the word not to save could "
                               "not be written (disk)")
