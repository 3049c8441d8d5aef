"""In-process restart (optimus/supervision/inprocess.py): what a rank between generations reads
and does, and twenty generations of the same two rank processes under a minimal agent of the
test's own (the real agent's side is tested in the control-plane scenarios)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from cluster import _rank_spawner, free_port, metrics, train_ranks, wait_for, write_job

from optimus.supervision import inprocess

GLOO_LOST = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
             "[127.0.0.1]:14546: Connection reset by peer. This is typically caused by a remote "
             "worker hanging")


def test_a_lost_peer_is_told_from_a_rank_s_own_failure():
    assert inprocess.peer_failure(RuntimeError(GLOO_LOST))
    assert inprocess.peer_failure(RuntimeError("Connection closed by peer [127.0.0.1]:1"))
    try:  # raised from a peer's loss, inside another error: still the peers' fault
        try:
            raise RuntimeError(GLOO_LOST)
        except RuntimeError as e:
            raise ValueError("while reducing the loss") from e
    except ValueError as e:
        assert inprocess.peer_failure(e)
    # Its replica taken out of the quorum: it leaves as on a lost peer, whatever the words.
    from optimus.parallel.quorum_file import QuorumError, ReplicaOut
    assert inprocess.peer_failure(ReplicaOut("replica 1 left"))
    assert not inprocess.peer_failure(QuorumError("the quorum file went back from id 3"))
    # This rank's own faults: it exits, and is replaced by a new process.
    assert not inprocess.peer_failure(ValueError("shape mismatch (2, 3) vs (3, 2)"))
    assert not inprocess.peer_failure(RuntimeError("CUDA error: an illegal memory access"))
    assert not inprocess.peer_failure(KeyError("Connection reset by peer"))  # not a comm error


def test_a_word_is_read_only_when_whole_newer_and_well_formed(tmp_path):
    path = tmp_path / "next"
    assert inprocess.read_word(path, (0, 0)) is None  # none yet
    good = {"generation": 2, "env": {"OPTIMUS_RANK": "3"}, "log": "/x/rank.log"}
    path.write_text(json.dumps(good))
    word = inprocess.read_word(path, (1, 0))
    assert (word.generation, word.env, word.log, word.launch) == (
        2, {"OPTIMUS_RANK": "3"}, "/x/rank.log", 0)
    assert inprocess.read_word(path, (2, 0)) is None  # not after the generation it left
    assert inprocess.read_word(path, (1, 3)).generation == 2  # a later generation: any launch
    bad_words = ['{"generation": 2, "env": {"OPTIMUS_', "[1, 2]",
                 json.dumps({**good, "generation": True}),
                 json.dumps({**good, "launch": -1}),
                 json.dumps({**good, "launch": "1"}),
                 json.dumps({**good, "env": {"LD_PRELOAD": "/evil.so"}}),
                 json.dumps({**good, "env": {"OPTIMUS_RANK": 3}}),
                 json.dumps({**good, "log": None})]
    for bad in bad_words:
        path.write_text(bad)
        assert inprocess.read_word(path, (1, 0)) is None, bad
    path.write_text(json.dumps({**good, "pad": "x" * (1 << 20)}))  # past the bound
    assert inprocess.read_word(path, (1, 0)) is None
    path.write_text('{"exit": true, "generation": 7}')
    assert inprocess.read_word(path, (7, 0)).generation == -1
    # A rank dismissed from this slot before: its exit is not for the rank there now.
    assert inprocess.read_word(path, (9, 0)) is None
    assert inprocess.read_word(path, (7, 1)) is None  # nor one of another launch
    path.write_text('{"exit": true}')
    assert inprocess.read_word(path, (7, 0)) is None


def test_a_replicas_next_launch_is_a_word_within_the_generation(tmp_path):
    """A survivor of a lost replica's rank waits in process for its replica's next launch:
    the same generation, a higher launch; never the launch it left, nor an older one."""
    path = tmp_path / "next"
    path.write_text(json.dumps({"generation": 4, "launch": 2, "log": "/x/rank.launch2.log",
                                "env": {"OPTIMUS_REPLICA_LAUNCH": "2"}}))
    assert inprocess.read_word(path, (4, 1)).launch == 2
    assert inprocess.read_word(path, (4, 2)) is None
    assert inprocess.read_word(path, (4, 3)) is None
    assert inprocess.read_word(path, (5, 0)) is None
    path.write_text('{"exit": true, "generation": 4, "launch": 2}')
    assert inprocess.read_word(path, (4, 2)).generation == -1
    assert inprocess.read_word(path, (4, 1)) is None
    assert inprocess.launch_count({"OPTIMUS_REPLICA_LAUNCH": "3"}) == 3
    assert inprocess.launch_count({"OPTIMUS_REPLICA_LAUNCH": "-3"}) == 0
    assert inprocess.launch_count({}) == 0


def test_entering_a_generation_takes_its_environment_and_log(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMUS_SNAPSHOT_RESUME", '{"step": 5}')
    monkeypatch.setenv("OPTIMUS_RANK", "0")
    log = tmp_path / "gen_0001.log"
    saved = os.dup(1), os.dup(2)
    try:
        inprocess.enter(inprocess.Word(1, {"OPTIMUS_RANK": "4", "OPTIMUS_GENERATION": "1"},
                                       str(log)))
        os.write(1, b"to the new log\n")
        os.write(2, b"errors too\n")
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
    assert os.environ["OPTIMUS_RANK"] == "4" and os.environ["OPTIMUS_GENERATION"] == "1"
    assert "OPTIMUS_SNAPSHOT_RESUME" not in os.environ  # a resume point is a launch's own
    assert log.read_text() == "to the new log\nerrors too\n"


class _MiniAgent:
    """The agent's side of the protocol, and nothing else: a heartbeat socket, and a word per
    rank in its file."""

    def __init__(self, folder: Path, world: int):
        self.folder, self.world = folder, world
        self.sock_path = str(folder / "agent.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.sock_path)
        self.sock.setblocking(False)
        self.beats: dict[int, dict] = {}

    def drain(self) -> None:
        while True:
            try:
                beat = json.loads(self.sock.recv(65536))
            except BlockingIOError:
                return
            self.beats[beat["rank"]] = beat

    def env(self, slot: int, rank: int, generation: int, port: int) -> dict[str, str]:
        """Process `slot`'s launch as `rank` of `generation`."""
        return {"OPTIMUS_RANK": str(rank), "OPTIMUS_WORLD_SIZE": str(self.world),
                "OPTIMUS_LOCAL_RANK": str(rank), "OPTIMUS_LOCAL_WORLD_SIZE": str(self.world),
                "OPTIMUS_GENERATION": str(generation), "OPTIMUS_MASTER_ADDR": "127.0.0.1",
                "OPTIMUS_MASTER_PORT": str(port), "OPTIMUS_AGENT_SOCKET": self.sock_path,
                "OPTIMUS_NEXT_FILE": str(self.folder / f"next{slot}")}

    def tell(self, slot: int, word: dict) -> None:
        tmp = self.folder / f"next{slot}.tmp"
        tmp.write_text(json.dumps(word))
        os.replace(tmp, self.folder / f"next{slot}")

    def until(self, what: str, predicate, timeout: float = 120) -> None:
        def seen() -> bool:
            self.drain()
            return len(self.beats) == self.world and all(map(predicate, self.beats.values()))
        wait_for(seen, timeout, what, interval=0.02)


def _wide(job: Path) -> Path:
    """The job with a model wide enough (1.6 M parameters: 6 MiB of weights, 25 MiB with
    gradients and AdamW's state) that one generation's state left behind shows in memory."""
    spec = yaml.safe_load(job.read_text())
    spec["model"].update(dim=256, n_heads=4, n_kv_heads=2)
    job.write_text(yaml.safe_dump(spec))
    return job


def _use(pid: int) -> tuple[int, int, int]:
    """A process's threads, open file descriptors and resident memory (KiB)."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if ":" in line)
    return (int(status["Threads"]), len(os.listdir(f"/proc/{pid}/fd")),
            int(status["VmRSS"].split()[0]))


@pytest.mark.timeout(600)
def test_twenty_generations_in_the_same_processes_leak_nothing_and_train_exactly(tmp_path):
    """Two ranks, stopped (SIGTERM: both stop after one same step and save) and handed a new
    generation twenty times, each process the other's rank each time (a new rank, a new
    rendezvous, the other shard of the sharded model): the same two processes throughout;
    their threads, descriptors and memory do not grow; the losses are those of a plain run."""
    world, restarts = 2, 20
    run = tmp_path / "run"
    job = _wide(write_job(tmp_path / "job.yaml", run, steps=200, async_mode="sync"))
    folder = Path(tempfile.mkdtemp(prefix="inp-"))  # an AF_UNIX path is short
    agent = _MiniAgent(folder, world)
    logs = tmp_path / "logs"
    logs.mkdir()
    spawner = _rank_spawner()
    wait_for(lambda: not spawner.warming(), 60, "the warm process's imports")
    port = free_port()
    procs = [spawner.start(["optimus", "train", str(job)],
                           {**os.environ, **agent.env(rank, rank, 0, port)},
                           logs / f"gen0_rank{rank}.log") for rank in range(world)]
    pids = [p.pid for p in procs]
    use: list[list[tuple[int, int, int]]] = []
    try:
        for gen in range(restarts + 1):
            if gen:
                port = free_port()
                for slot in range(world):
                    rank = (slot + gen) % world
                    agent.tell(slot, {"generation": gen, "env": agent.env(slot, rank, gen, port),
                                      "log": str(logs / f"gen{gen}_rank{rank}.log")})
            agent.until(f"generation {gen} training", lambda b, g=gen: b["generation"] == g
                        and b["phase"] != "ready" and b["step"] >= 2 + 3 * g)
            os.kill(pids[0], signal.SIGTERM)  # both stop after one same step: agreed
            # Measured once both have freed the generation they left (after their first
            # "ready" beat, while the next is planned).
            agent.until(f"generation {gen} waiting", lambda b, g=gen: b["generation"] == g
                        and b["phase"] == "ready" and b["freed"])
            assert [b["exit_code"] for _, b in sorted(agent.beats.items())] == [0, 0]
            assert [b["pid"] for _, b in sorted(agent.beats.items())] == [
                pids[(rank - gen) % world] for rank in range(world)]  # the same two, swapped
            use.append([_use(pid) for pid in pids])
        for slot in range(world):
            agent.tell(slot, {"exit": True, "generation": restarts})  # the one they left
        wait_for(lambda: all(p.poll() is not None for p in procs), 60, "the ranks to exit")
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        agent.sock.close()
    assert [p.returncode for p in procs] == [0, 0], [
        (logs / f).read_text()[-3000:] for f in sorted(os.listdir(logs))][-2:]
    print("threads, fds, RSS KiB per generation:", use, file=sys.stderr)
    for rank in range(world):
        threads, fds, rss = zip(*(u[rank] for u in use), strict=True)
        # After the second generation (the first ones start what a rank keeps: DCP's pools,
        # the gloo threads of the groups it makes) no thread or descriptor is added; memory
        # grows fast over the first few (the allocator's pools fill), then creeps: the last
        # ten generations added 14-18 MiB, quiet (the heap's fragments; not a generation's
        # objects). A generation's model, gradients and optimizer state left behind would add
        # ~25 MiB each here: 250 MiB over ten; the bound is 96. A sample may catch a moment's
        # descriptor or thread (a beat's socket being opened, a save's file: CI saw 35 -> 36 -> 35
        # once); a leak stays, so most of the last ten samples are at the second generation's
        # count and none is more than two above it.
        for counts in (threads, fds):
            assert sum(c <= counts[2] for c in counts[-10:]) > 5, counts
            assert max(counts[2:]) <= counts[2] + 2, counts
        assert rss[-1] - rss[-11] < 96 * 1024, rss

    # Exact: the steps of the twenty-one generations are those of one plain run.
    steps = [m for m in metrics(run) if "loss" in m]
    resumes = [m for m in metrics(run) if m.get("event") == "resume"]
    assert len(resumes) == restarts
    last = steps[-1]["step"]
    assert [m["step"] for m in steps] == list(range(1, last + 1))
    ref = tmp_path / "ref"
    train_ranks(_wide(write_job(tmp_path / "ref.yaml", ref, steps=200, async_mode="sync")),
                world, until_step=last)
    reference = {m["step"]: m["loss"] for m in metrics(ref) if "loss" in m}
    assert [m["loss"] for m in steps] == [reference[m["step"]] for m in steps]


def test_a_failed_generation_s_groups_are_aborted_then_gone(monkeypatch):
    """The teardown after a failed collective (the accelerator's path: aborting NCCL or XCCL
    communicators that a dead peer would hold), run on gloo on the CPU."""
    import torch.distributed as dist

    from optimus.runtime.dist import destroy_distributed

    aborted = []
    real = dist.distributed_c10d._abort_process_group
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group",
                        lambda *a: aborted.append(True) or real(*a))
    for abort in (True, False):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        dist.new_group(backend="gloo")
        destroy_distributed(abort=abort)
        assert not dist.is_initialized()
    assert aborted == [True]  # only when asked


def test_forgetting_the_meshes_empties_dtensor_s_cached_decisions():
    """What a rank that changed rank must not find again (the twenty-generation test shows
    the harm: the old rank's shard): after forget_meshes, nothing of the last mesh is cached."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from optimus.runtime.dist import destroy_distributed, forget_meshes

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        x = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
        (x * 2 + x).sum()
        stats = torch._C._get_DTensor_sharding_propagator_cache_stats  # torch 2.13, here
        assert stats() != (0, 0)  # the C++ fast path's cache, where the decisions went
        forget_meshes()
        assert stats() == (0, 0)
    finally:
        destroy_distributed()


def test_stale_groups_are_looked_for_only_when_a_mesh_outlived_its_generation(monkeypatch):
    """drop_stale_groups walks every object of the process (~0.1-0.3 s between generations) only
    when a mesh the rank built is still alive after the collection (a cache of torch's holding
    it, as 2.11's did): then it still finds it and empties its registry of groups."""
    import gc

    import torch.distributed as dist

    from optimus.runtime import mesh as meshes
    from optimus.runtime.dims import ParallelDims
    from optimus.runtime.dist import destroy_distributed, drop_stale_groups
    from optimus.runtime.mesh import meshes_alive

    walks = []
    real = gc.get_objects
    monkeypatch.setattr(gc, "get_objects", lambda *a: walks.append(1) or real(*a))
    monkeypatch.setattr(meshes, "_BUILT", [])  # whatever meshes this test process built before
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = ParallelDims().build_mesh("cpu")
        held_by_a_cache = [mesh.mesh("shard")]  # a submesh: it holds its root
        del mesh
        gc.collect()
        assert meshes_alive()
        mesh_of_submesh = held_by_a_cache[0]._get_root_mesh()
        mesh_of_submesh._pg_registry["stale"] = object()  # as 2.11 kept its groups
        assert drop_stale_groups() >= 1 and walks == [1]
        assert mesh_of_submesh._pg_registry == {}
        del held_by_a_cache, mesh_of_submesh
        gc.collect()
        assert not meshes_alive() and meshes._BUILT == []
        assert drop_stale_groups() == 0 and walks == [1]  # no second walk
    finally:
        destroy_distributed()
