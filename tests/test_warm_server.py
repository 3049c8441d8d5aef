"""OPTIMUS_WARM_COMMAND, and the test session's warm server that uses it (tests/warm_zygote.py):
an agent's warm process forked from a process past its imports serves the agent as a fresh one
would, and anything read at import that differs gets a fresh one instead."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch
from cluster import WARM_COMMAND, WARM_SERVER, metrics, wait_for, write_job
from multiproc import free_port
from warm_zygote import BEFORE, differs

from controller.node.spawn import Spawner, WarmRank, warm_command


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_the_warm_command_is_a_json_list_of_words_or_the_default(monkeypatch, caplog):
    monkeypatch.setenv(WARM_COMMAND, json.dumps(["taskset", "-c", "0-3", "python3", "-m",
                                                 "optimus.supervision.warm"]))
    assert warm_command() == ["taskset", "-c", "0-3", "python3", "-m", "optimus.supervision.warm"]
    for bad in ("taskset -c 0-3", "[]", '["a", 3]', '["a", ""]', '{"a": 1}'):
        monkeypatch.setenv(WARM_COMMAND, bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="optimus.agent"):
            assert warm_command()[1:] == ["-m", "optimus.supervision.warm"], bad
        assert "OPTIMUS_WARM_COMMAND is not a JSON list of words" in caplog.text, bad
    monkeypatch.delenv(WARM_COMMAND)
    assert warm_command()[1:] == ["-m", "optimus.supervision.warm"]


@pytest.fixture
def server():
    if not os.environ.get(WARM_SERVER):
        pytest.skip("no warm server in this session (--fast)")
    path = os.environ[WARM_SERVER]
    wait_for(lambda: os.path.exists(path), 120, "the warm server's imports")
    time.sleep(0.5)  # bound, then listening
    return path


def _children(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if _ppid(int(entry)) == pid:
                    found.add(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def test_a_warm_process_from_the_server_forks_ranks_and_checks_tiles(server, warm_server,
                                                                     tmp_path):
    before = _children(warm_server.pid)
    spawner = Spawner(mode="fork")
    try:
        wait_for(lambda: not spawner.warming(), 60, "the warm process")
        client = spawner._proc.pid
        assert b"warm_client.py" in Path(f"/proc/{client}/cmdline").read_bytes()  # not fresh
        (warm,) = _children(warm_server.pid) - before  # the server forked it
        # Lines that are no request are skipped, and the next request is answered.
        spawner._proc.stdin.write(b"not json\n[1]\n")
        spawner._proc.stdin.flush()
        health = spawner.health_check("n0", {0}, 60)
        assert health["health"] == "bad" and health["health_detail"].startswith("n0/0: "), health
        assert spawner.health_check("n0", set(), 60)["health"] == "ok"
        job = write_job(tmp_path / "job.yaml", tmp_path / "run", steps=6)
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port())}
        rank = spawner.start(["optimus", "train", str(job)], env, tmp_path / "rank.log")
        assert isinstance(rank, WarmRank) and _ppid(rank.pid) == warm  # its settled fork
        wait_for(lambda: rank.poll() is not None, 120, "the rank to end")
        assert rank.returncode == 0, (tmp_path / "rank.log").read_text()[-3000:]
        assert max(m.get("step", 0) for m in metrics(tmp_path / "run")) == 6
    finally:
        spawner.close()
    wait_for(lambda: not Path(f"/proc/{warm}").exists()
             or "Z" in Path(f"/proc/{warm}/stat").read_text().split()[2], 30,
             "the warm process to end with its agent's pipes")


def test_what_is_read_at_import_differing_gets_a_fresh_warm_process(server, monkeypatch,
                                                                     tmp_path):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # torch fixes its thread count at import
    spawner = Spawner(mode="fork")
    try:
        wait_for(lambda: not spawner.warming(), 120, "the fresh warm process's imports")
        cmdline = Path(f"/proc/{spawner._proc.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[1:3] == [b"-m", b"optimus.supervision.warm"], cmdline  # the client became it
        assert spawner.health_check("n0", set(), 60)["health"] == "ok"
    finally:
        spawner.close()


def test_a_pythonpath_of_directories_the_server_imports_from_is_no_difference(tmp_path):
    """The Slurm and PBS tests set PYTHONPATH to the repository, which the server's sys.path
    holds already: their agents' warm processes fork from the server. A directory it does not
    hold could shadow a module it imported: that one gets a fresh warm process."""
    root = str(Path(__file__).resolve().parents[1])
    same = {**BEFORE, "PYTHONPATH": f"{root}{os.pathsep}{root}/tests/.."}
    assert differs(same) == []
    assert differs({**BEFORE, "PYTHONPATH": f"{root}{os.pathsep}{tmp_path}"}) == ["PYTHONPATH"]
    assert differs({**BEFORE, "OMP_NUM_THREADS": "7"}) == ["OMP_NUM_THREADS"]


def test_what_the_servers_own_imports_set_is_no_difference(monkeypatch):
    """Importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR (to its default) in the importing
    process: a pytest worker that did so once handed it on to every later agent, whose warm
    processes the server then refused (all of a worker's later control-plane tests paid a
    cold warm process per agent). The same value is what a fresh warm process sets itself."""
    import warm_zygote

    key = "TORCHINDUCTOR_CACHE_DIR"
    monkeypatch.setattr(warm_zygote, "BEFORE", {k: v for k, v in BEFORE.items() if k != key})
    monkeypatch.setenv(key, "/tmp/torchinductor_default")  # as the server's imports left it
    client = dict(warm_zygote.BEFORE)
    assert differs({**client, key: "/tmp/torchinductor_default"}) == []
    assert differs(client) == []  # unset: a fresh one sets it too
    assert differs({**client, key: "/elsewhere"}) == [key]  # another cache: a fresh one


def test_a_device_runtimes_variable_differs_only_where_torch_has_that_runtime():
    """The PBS script sets Level Zero's ZE_FLAT_DEVICE_HIERARCHY (Aurora's tiles): a CPU build
    of torch reads no Level Zero variable, a build with XPU would."""
    aurora = {**BEFORE, "ZE_FLAT_DEVICE_HIERARCHY": "FLAT", "CUDA_VISIBLE_DEVICES": "3"}
    assert differs(aurora) == sorted(
        [k for k, built in (("ZE_FLAT_DEVICE_HIERARCHY", torch.xpu._is_compiled()),
                            ("CUDA_VISIBLE_DEVICES", torch.backends.cuda.is_built())) if built])
