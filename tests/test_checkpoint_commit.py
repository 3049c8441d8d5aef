"""The checkpoint commit protocol on real gloo ranks: saves in flight, failures, retention."""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from multiproc import ephemeral_start
from test_checkpoint_saver import Trainer, _assert_bitwise, _load_elsewhere

from optimus.checkpoint.manifest import committed_steps, is_committed, latest_committed, step_dir
from optimus.checkpoint.saver import Checkpointer
from optimus.checkpoint.storage import TensorFileWriter


class GatedWriter(TensorFileWriter):
    """Writes only once `gate` exists (or after `delay_s`): a rank whose write is slow."""

    def __init__(self, path, gate: str | None = None, delay_s: float = 0.0):
        super().__init__(path, overwrite=False)
        self.gate, self.delay_s = gate, delay_s

    def write_data(self, plan, planner):
        time.sleep(self.delay_s)
        deadline = time.monotonic() + 60
        while self.gate and not os.path.exists(self.gate):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.gate} never appeared")
            time.sleep(0.02)
        return super().write_data(plan, planner)


class FileSizeLimitedWriter(TensorFileWriter):
    """Writes with RLIMIT_FSIZE at 512 bytes: the kernel refuses the write (EFBIG), for real.

    Python ignores SIGXFSZ, so the write raises OSError instead of killing the process.
    """

    def write_data(self, plan, planner):
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (512, hard))
        try:
            return super().write_data(plan, planner)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _overlap_in_process_mode(rank: int, world: int, root: str) -> dict:
    # The harness starts ranks as daemonic processes, which multiprocessing forbids to have
    # children; a rank under torchrun or the agent is not one. Lift that for DCP's writer process.
    multiprocessing.current_process()._config["daemon"] = False
    gate = os.path.join(root, "release")

    def writer(path: Path):
        slow = rank == 1 and path.name == step_dir(root, 1).name
        return GatedWriter(path, gate=gate if slow else None)

    run = Trainer(rank, world, {})  # dp2
    ckpt = Checkpointer(root, rank=rank, world_size=world, keep_last=3, mode="process",
                        writer=writer)
    assert ckpt.mode == "process", ckpt.mode_note
    run.train(1)
    at_save = run.local_state()
    assert ckpt.save(1, run.state, run.meta()) == "started"
    blocked = ckpt.stats.last_blocked_s
    run.train(1)  # training goes on while step 1 is written: the save holds a snapshot
    assert ckpt.save(2, run.state, run.meta()) == "skipped"
    no_marker = []
    for _ in range(5):
        assert ckpt.poll() is None
        no_marker.append(not is_committed(step_dir(root, 1)))
        time.sleep(0.05)
    dist.barrier()
    if rank == 1:
        Path(gate).touch()
    assert ckpt.wait() == "committed"
    committed = committed_steps(root)

    fresh = Trainer(rank, world, {})
    ckpt.load_latest(fresh.state)
    _assert_bitwise(fresh.local_state(), at_save)
    ckpt.close()
    return {"no_marker": no_marker, "committed": committed, "stats": ckpt.stats.as_dict(),
            "blocked": blocked}


def test_one_save_in_flight_and_commit_waits_for_the_slowest_rank(run_ranks, tmp_path):
    results = run_ranks(_overlap_in_process_mode, 2, str(tmp_path), timeout=120)
    for result in results:
        assert all(result["no_marker"])  # rank 1 had not written: nothing committed
        assert result["committed"] == [1]
        stats = result["stats"]
        assert (stats["saves_started"], stats["saves_skipped"], stats["saves_committed"],
                stats["saves_failed"]) == (1, 1, 1, 0)
        assert stats["last_commit_step"] == 1
        assert 0 < result["blocked"] < stats["last_write_s"]


def _failure_and_retention(rank: int, world: int, root: str) -> dict:
    def writer(path: Path):
        if rank == 1 and path.name == step_dir(root, 2).name:
            return FileSizeLimitedWriter(path, overwrite=False)
        if rank == 1 and path.name == step_dir(root, 3).name:
            return GatedWriter(path, delay_s=1.0)
        return TensorFileWriter(path, overwrite=False)

    run = Trainer(rank, world, {"tp": 2})
    ckpt = Checkpointer(root, rank=rank, world_size=world, keep_last=1, keep_every=3,
                        mode="thread", on_overlap="wait", writer=writer)
    events = {}
    run.train(1)
    events[1] = (ckpt.save(1, run.state, run.meta()), ckpt.wait())
    run.train(1)
    events[2] = (ckpt.save(2, run.state, run.meta()), ckpt.wait())
    after_failure = {"latest": str(latest_committed(root)), "step2_dir": step_dir(root, 2).exists(),
                     "error": ckpt.last_error, "failed": ckpt.stats.saves_failed,
                     "in_a_row": ckpt.stats.failed_in_a_row}
    run.train(1)  # training goes on
    events[3] = (ckpt.save(3, run.state, run.meta()),)
    run.train(1)
    events[4] = (ckpt.save(4, run.state, run.meta()), ckpt.wait())  # waits for step 3 first
    ckpt.close()
    return {"events": events, "after_failure": after_failure, "stats": ckpt.stats.as_dict(),
            "committed": committed_steps(root)}


def test_failed_write_keeps_the_previous_checkpoint(run_ranks, tmp_path):
    results = run_ranks(_failure_and_retention, 2, str(tmp_path), timeout=120)
    for result in results:
        assert result["events"] == {1: ("started", "committed"), 2: ("started", "failed"),
                                    3: ("started",), 4: ("waited", "committed")}
        failure = result["after_failure"]
        assert failure["latest"] == str(step_dir(tmp_path, 1))
        assert not failure["step2_dir"]  # the partial save was removed
        assert failure["failed"] == failure["in_a_row"] == 1
        assert "File too large" in failure["error"] and "rank(s) [1]" in failure["error"]
        assert "\n" not in failure["error"]
        stats = result["stats"]
        assert (stats["saves_started"], stats["saves_committed"], stats["saves_failed"],
                stats["saves_skipped"]) == (4, 3, 1, 0)
        assert stats["failed_in_a_row"] == 0  # the commits after it ended the streak
        # keep_last=1 keeps 4, keep_every=3 keeps 3; step 1 is gone
        assert result["committed"] == [3, 4]


def _every_failure_is_told(rank: int, world: int, root: str, mode: str) -> list[dict]:
    """Every save fails; each save waits for the one before it, so that one ends inside the
    next save (or, in sync mode, each ends inside its own)."""
    from optimus.checkpoint.policy import RunCheckpoints
    from optimus.metrics import MetricsLog

    run = Trainer(rank, world, {})
    ckpt = Checkpointer(root, rank=rank, world_size=world, keep_last=1, mode=mode,
                        on_overlap="wait",
                        writer=lambda path: FileSizeLimitedWriter(path, overwrite=False))
    job = run.job.model_copy(update={"checkpoint": run.job.checkpoint.model_copy(
        update={"interval": 1, "max_failed_saves": 0})})
    metrics = Path(root) / "metrics.jsonl"
    log = MetricsLog(metrics, 10, 1, None, world)
    saves = RunCheckpoints(ckpt, log, job, run.layout, run.state, run.progress)
    for step in (1, 2, 3, 4):
        run.train(1)
        saves.after_step(step)
    saves.finish(4, final=False)  # the last one lands and is told here
    log.close()
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.mark.parametrize("mode", ["thread", "sync"])
def test_every_failed_save_is_told_once_with_its_place_in_the_streak(run_ranks, tmp_path, mode):
    (lines,) = run_ranks(_every_failure_is_told, 1, str(tmp_path), mode, timeout=120)
    told = [(m["failed_in_a_row"], m["message"]) for m in lines if m.get("event") == "checkpoint"]
    assert [in_a_row for in_a_row, _ in told] == [1, 2, 3, 4], told
    for (_, message), step in zip(told, (1, 2, 3, 4), strict=True):
        assert message.startswith(f"checkpoint of step {step}: write failed"), message
        assert "File too large" in message


def _sync_and_exists(rank: int, world: int, root: str) -> dict:
    run = Trainer(rank, world, {})
    ckpt = Checkpointer(root, rank=rank, world_size=world, keep_last=3, mode="sync")
    run.train(1)
    first = ckpt.save(1, run.state, run.meta())
    again = ckpt.save(1, run.state, run.meta())
    ckpt.close()
    return {"first": first, "again": again, "stats": ckpt.stats.as_dict(),
            "full": run.full_state()}


def test_sync_mode_commits_before_returning_and_loads_on_more_ranks(run_ranks, tmp_path):
    (result,) = run_ranks(_sync_and_exists, 1, str(tmp_path), timeout=60)
    assert result["first"] == "committed" and result["again"] == "exists"
    assert result["stats"]["saves_committed"] == 1 and committed_steps(tmp_path) == [1]
    # Two ranks: rank 1 has no RNG entry in a one-rank checkpoint; that alone may be missing.
    loaded = run_ranks(_load_elsewhere, 2, str(tmp_path), {"tp": 2}, timeout=60)
    merged: dict[str, torch.Tensor] = {}
    for one in loaded:
        assert one["step"] == 1 and "RNG states" in one["notes"][0]
        merged.update(one["full"])
    _assert_bitwise(merged, result["full"])


def test_no_checkpoint_loads_none(tmp_path):
    ckpt = Checkpointer(tmp_path, rank=0, world_size=1, keep_last=1, mode="thread")
    assert ckpt.load_latest({}) is None
    ckpt.close()


# --- the collectives are marked, for hang attribution ----------------------------------------

def _collectives_marked(rank: int, world: int, root: str) -> dict:
    """Every collective the checkpointer runs on this thread, inside `collective()`; its
    staging outside it."""
    import contextlib
    import threading

    inside, calling = [False], [False]
    calls: list[tuple[str, bool]] = []

    @contextlib.contextmanager
    def collective():
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False

    def spy(owner, name: str) -> None:
        real = getattr(owner, name)

        def call(*args, **kwargs):
            if calling[0] and threading.current_thread() is threading.main_thread():
                calls.append((name, inside[0]))
            return real(*args, **kwargs)
        setattr(owner, name, call)

    import torch.distributed.checkpoint as dcp

    for name in ("all_reduce", "broadcast_object_list", "new_group", "barrier", "all_gather",
                 "all_gather_object", "broadcast", "scatter_object_list", "gather_object"):
        spy(dist, name)
    spy(dcp, "load")

    @contextlib.contextmanager
    def checkpointer():  # count only what the checkpointer calls
        calling[0] = True
        try:
            yield
        finally:
            calling[0] = False

    run = Trainer(rank, world, {})
    with checkpointer():
        ckpt = Checkpointer(root, rank=rank, world_size=world, keep_last=3, mode="thread",
                            collective=collective)
    real_start = ckpt._start
    ckpt._start = lambda *a: (calls.append(("stage", inside[0])), real_start(*a))[1]
    run.train(1)
    with checkpointer():
        assert ckpt.save(1, run.state, run.meta()) == "started"
        while ckpt.poll() != "committed":
            time.sleep(0.02)
        assert ckpt.load_latest(Trainer(rank, world, {}).state)["step"] == 1
        ckpt.close()
    return {"calls": calls}


def test_the_checkpointers_collectives_run_inside_its_collective_hook(run_ranks, tmp_path):
    for result in run_ranks(_collectives_marked, 2, str(tmp_path), timeout=120):
        calls = result["calls"]
        names = [name for name, _ in calls]
        assert names.count("new_group") == 1 and names.count("stage") == 1
        assert names.count("all_reduce") >= 3  # the save's agreements: exists, written, commit
        assert "broadcast_object_list" in names and "load" in names
        assert [c for c in calls if c[0] != "stage" and not c[1]] == []  # all marked
        assert ("stage", False) in calls  # staging is the rank's own work


def _abandon_in_flight(rank: int, world: int, root: str) -> dict:
    def writer(path: Path):  # rank 1 writes slowly: the save is in flight when training stops
        if rank == 1:
            return GatedWriter(path, delay_s=0.5)
        return TensorFileWriter(path, overwrite=False)

    run = Trainer(rank, world, {})
    ckpt = Checkpointer(root, rank=rank, world_size=world, keep_last=3, mode="thread",
                        writer=writer)
    run.train(1)
    started = ckpt.save(1, run.state, run.meta())
    ckpt.abandon()  # the stop without saving: agreed by all ranks at one step boundary
    ckpt.close()
    return {"started": started, "committed": committed_steps(root),
            "stats": ckpt.stats.as_dict()}


def test_an_abandoned_save_in_flight_is_never_committed(run_ranks, tmp_path):
    results = run_ranks(_abandon_in_flight, 2, str(tmp_path), timeout=120)
    for result in results:
        assert result["started"] == "started" and result["committed"] == []
        assert result["stats"]["saves_committed"] == 0
    assert step_dir(tmp_path, 1).is_dir() and not is_committed(step_dir(tmp_path, 1))
    # A replica relaunched within its generation: another world's save may be in flight there
    Checkpointer(tmp_path, rank=0, world_size=1, mode="thread", clean=False).close()
    assert step_dir(tmp_path, 1).is_dir()
    Checkpointer(tmp_path, rank=0, world_size=1, mode="thread").close()  # the next job's start
    assert not step_dir(tmp_path, 1).exists()  # removed as partial


def test_a_rank_whose_peer_dies_while_its_writer_process_starts_exits_at_once(tmp_path):
    """DCP's writer process (async_mode: process) starts at a generation's first save and
    joins a rendezvous of its own. A peer lost just then (its node gone, writer and all) leaves
    that rendezvous waiting; the surviving rank fails in its next collective and must exit
    then, not wait at exit for its writer: silent meanwhile, it would be taken for frozen and
    its healthy node excluded (seen in bench/recovery.py)."""
    import signal
    import subprocess
    import sys

    from cluster import ROOT, free_port, metrics_so_far, wait_for, write_job

    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", run, steps=200, async_mode="process")
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "OPTIMUS_RANK": str(rank), "OPTIMUS_WORLD_SIZE": "2",
               "OPTIMUS_LOCAL_RANK": str(rank), "OPTIMUS_LOCAL_WORLD_SIZE": "2",
               "OPTIMUS_MASTER_ADDR": "127.0.0.1", "OPTIMUS_MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "optimus", "train", str(job)],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    try:
        # The save of step 10 starts the writer processes (seconds: a Python with torch each).
        wait_for(lambda: any(m.get("step", 0) >= 11 for m in metrics_so_far(run)), 120,
                 "step 11")
        os.killpg(procs[1].pid, signal.SIGKILL)  # rank 1 and its writer: a lost node
        killed = time.monotonic()
        out, _ = procs[0].communicate(timeout=60)
        assert time.monotonic() - killed < 20, "rank 0 waited for its writer process"
        assert procs[0].returncode == 1
        assert b"Connection closed by peer" in out or b"Connection reset" in out, out[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_dcp_gives_its_writers_that_port(monkeypatch):
    """What DCP's rank 0 sends its writers (and every rank's writer binds or dials) once the
    saver installed its writer: a port below the ephemeral range (optimus/supervision/ports.py;
    DCP's own
    pick, bind 0 and close, left it to any outgoing connection until the spawned writers bound
    it seconds later: a process-mode run's first save lost under a CPU hog)."""
    import torch.distributed.checkpoint._async_process_executor as executor

    from optimus.checkpoint import writer_process
    from optimus.supervision import ports

    monkeypatch.setattr(executor, "_AsyncCheckpointProcess", executor._AsyncCheckpointProcess)
    monkeypatch.setattr(executor, "get_free_port", executor.get_free_port)
    writer_process.install()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        info = executor._ProcessGroupInitInfo()
    finally:
        dist.destroy_process_group()
    assert ports._LOWEST <= info.tcp_store_master_port < ephemeral_start()
