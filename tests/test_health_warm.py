"""The node's health check runs outside the agent, which never imports torch: in a child that
its warm process forks (optimus/supervision/warm.py), or in a fresh process without one (cold
starts).

Real processes throughout: agents against a private redis-server, the warm process, the
check's children, a rank forked after the checks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cluster import metrics, wait_for, write_job
from multiproc import free_port

from controller.node.health_check import health_check, valid_result
from controller.node.spawn import Spawner, WarmRank
from controller.store.store import Store
from optimus.supervision.warm import check_tiles

# These tests look at warm processes themselves (parents, command lines, maps): the real
# `python -m optimus.supervision.warm`, not one forked by the test session's warm server
# (conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_warm")

OK_FIELDS = {"devices", "device_kind", "health", "health_detail", "ok_at"}
BAD_FIELDS = {"devices", "health", "health_detail"}


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and _ppid(int(entry.name)) == pid:
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile
    return found


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _torch_mapped(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _messages(store: Store, kind: str) -> list[str]:
    return [e["message"] for _, e in store.events(count=10_000) if e["kind"] == kind]


@pytest.mark.parametrize("mode", ["fork", "cold"])
def test_the_agent_checks_its_tiles_without_ever_mapping_torch(mode, redis_server, procs,
                                                               relayed):
    """Registration, a check on demand and a bad tile's check: the same results as ever, and
    no libtorch in the agent's memory; with a warm process, torch is mapped there instead."""
    relayed("hw")
    agent = procs.start("agent", "agent", "--job", "hw", "--node", "node0", "--redis",
                        redis_server.url, "--interval", "0.25", env={"OPTIMUS_WARM_START": mode})
    store = Store(redis_server.url, "hw")
    record = wait_for(lambda: store.nodes().get("node0"), 120, "the agent to register")
    assert record["health"] == "ok" and record["health_detail"] == ""
    assert (record["devices"], record["device_kind"]) == (os.cpu_count(), "cpu")

    store.push_command("node0", {"kind": "health_check"})
    wait_for(lambda: "health check on demand: node0 ok" in _messages(store, "health"), 120,
             "the check on demand")
    ok_at = store.nodes()["node0"]["ok_at"]
    assert ok_at > record["ok_at"]  # a new pass, from a new check
    store.push_command("node0", {"kind": "bad_tile", "tile": 0})
    store.push_command("node0", {"kind": "health_check"})
    bad = wait_for(lambda: [m for m in _messages(store, "health")
                            if "bad tile" in m and "on demand" in m], 120,
                   "the bad tile's check")  # (an idle re-check in between may say it first)
    assert bad[0].startswith("health check on demand: node0 bad tile node0/0: fixed-seed "
                             "matmul gave "), bad
    record = store.nodes()["node0"]
    assert record["health"] == "bad" and record["ok_at"] == ok_at  # the last pass is kept
    assert record["health_detail"].startswith("node0/0: fixed-seed matmul gave ")

    assert agent.poll() is None, procs.log("agent")
    assert not _torch_mapped(agent.pid)
    warm = [pid for pid in _children(agent.pid)
            if b"optimus.supervision.warm" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    if mode == "fork":
        assert len(warm) == 1 and _torch_mapped(warm[0])  # where the checks' children came from
    else:
        assert warm == []


def test_checks_through_the_warm_process_read_as_in_a_fresh_one_and_it_forks_ranks_after(
        tmp_path):
    spawner = Spawner(mode="fork")
    try:
        wait_for(lambda: not spawner.warming(), 120, "the warm process's imports")
        warm = spawner._proc.pid
        fds = sorted(os.listdir(f"/proc/{warm}/fd"))
        for corrupt in (set(), {0}):
            reference = check_tiles("n0", corrupt)  # in this process, as the agent once did
            for result in (health_check("n0", corrupt, spawner), health_check("n0", corrupt)):
                assert set(result) == (OK_FIELDS if not corrupt else BAD_FIELDS)
                assert ({k: v for k, v in result.items() if k != "ok_at"}
                        == {k: v for k, v in reference.items() if k != "ok_at"})
        assert reference["health_detail"].startswith("n0/0: fixed-seed matmul gave ")

        # A check that overruns (a hung driver) is the node's fault, said as such: its child
        # is killed at once (past a microsecond), and a fresh process is killed too.
        assert health_check("n0", set(), spawner, timeout_s=1e-6) == {
            "devices": 0, "health": "bad",
            "health_detail": "n0/?: the check did not finish within 1e-06 s"}
        assert health_check("n0", set(), timeout_s=0.5) == {
            "devices": 0, "health": "bad",
            "health_detail": "n0/?: the check did not finish within 0.5 s"}

        # The checks left nothing behind in the warm process: no child, no pipe end...
        assert spawner._proc.pid == warm
        assert _children(warm) == []
        assert sorted(os.listdir(f"/proc/{warm}/fd")) == fds
        # ...and it forks a rank that trains, as before.
        job = write_job(tmp_path / "job.yaml", tmp_path / "run", steps=6)
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port())}
        rank = spawner.start(["optimus", "train", str(job)], env, tmp_path / "rank.log")
        assert isinstance(rank, WarmRank) and _ppid(rank.pid) == warm
        wait_for(lambda: rank.poll() is not None, 120, "the rank to end")
        assert rank.returncode == 0, (tmp_path / "rank.log").read_text()[-3000:]
        assert [m["step"] for m in metrics(tmp_path / "run") if "loss" in m] == [1, 2, 3, 4, 5, 6]
    finally:
        spawner.close()


def test_a_result_from_another_process_is_kept_only_in_its_known_shape():
    ok = {"devices": 2, "device_kind": "cpu", "health": "ok", "health_detail": "",
          "ok_at": 1.7e9}
    bad = {"devices": 0, "health": "bad", "health_detail": "n0/1: fixed-seed matmul gave 1.0"}
    assert valid_result("n0", ok, "x") == ok and valid_result("n0", bad, "x") == bad
    refused = {"devices": 0, "health": "bad", "health_detail": "n0/?: x gave no health check "
               "result"}
    for answer in (None, [], "ok", {**ok, "extra": 1}, {**ok, "devices": True},
                   {**ok, "devices": -1}, {**ok, "ok_at": "now"}, {**ok, "health": "fine"},
                   {**ok, "health_detail": "n0/0: but ok"}, {**bad, "ok_at": 1.7e9},
                   {**bad, "health_detail": None}, {k: ok[k] for k in BAD_FIELDS}):
        assert valid_result("n0", answer, "x") == refused, answer
    long = valid_result("n0", {**bad, "health_detail": "n0/?: " + "x" * 10_000}, "x")
    assert len(long["health_detail"]) == 2000
