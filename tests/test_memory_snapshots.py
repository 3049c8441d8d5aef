"""In-memory snapshots, rank side: real gloo ranks take them into a folder as an agent would give
them, and a next run resumes from one exactly where the first run was, or (a shard corrupt, the
layout changed) every rank falls back to disk together, saying why.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from cluster import metrics, train_ranks, write_job

from optimus.checkpoint.snapshot_files import complete_shards, point_name, points, shard_files

STEPS = 12


def _job(tmp_path: Path, name: str, **checkpoint) -> Path:
    run = tmp_path / name
    path = write_job(tmp_path / f"{name}.yaml", run, steps=STEPS)
    job = yaml.safe_load(path.read_text())
    job["checkpoint"].update({"interval": 0, **checkpoint})
    path.write_text(yaml.safe_dump(job))
    return path


def _losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(run) if "loss" in m}


def _samples(run: Path) -> dict[int, str]:
    return {m["step"]: json.dumps(m["data"]) for m in metrics(run) if m.get("data")}


def _events(run: Path, kind: str) -> list[dict]:
    return [m for m in metrics(run) if m.get("event") == kind]


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> Path:
    """One two-rank run of 12 steps, snapshots every 3 steps into `shm/own` (as its agent would
    have them) and a disk checkpoint every 4; the tests copy what they change."""
    tmp = tmp_path_factory.mktemp("first")
    job = _job(tmp, "first", memory_every=3, interval=4, keep_last=10)
    train_ranks(job, 2, env={"OPTIMUS_SNAPSHOT_DIR": str(tmp / "shm" / "own"),
                             "OPTIMUS_GENERATION": "0"})
    return tmp


def test_a_run_resumed_from_a_snapshot_continues_exactly(first, tmp_path):
    own = first / "shm" / "own"
    taken = [(step, gen) for step, gen, _ in points(own)]
    assert taken == [(3, 0), (6, 0), (9, 0)]  # every 3 steps, not the last (disk has it)
    shards = complete_shards(own / point_name(9, 0))
    assert sorted(shards) == [0, 1]
    assert shards[1]["step"] == 9 and shards[1]["data_index"] == 9 * 8  # batch 8

    # A second generation, told by its agent to load step 9, trains 10..12 as the first did.
    second = _job(tmp_path, "second", memory_every=0)
    request = {"step": 9, "generation": 0, "dir": str(own / point_name(9, 0))}
    train_ranks(second, 2, env={"OPTIMUS_SNAPSHOT_RESUME": json.dumps(request),
                                "OPTIMUS_GENERATION": "1"})
    (resume,) = _events(tmp_path / "second", "resume")
    assert resume["source"] == "memory" and resume["step"] == 9 and resume["data_index"] == 72
    expected, got = _losses(first / "first"), _losses(tmp_path / "second")
    assert sorted(got) == [10, 11, 12]
    for step in got:
        assert abs(got[step] - expected[step]) < 1e-6, (step, got[step], expected[step])
    # Exactly once: steps 10..12 read the samples the first run read there, none other.
    assert {s: v for s, v in _samples(first / "first").items() if s > 9} == \
        _samples(tmp_path / "second")


def test_a_corrupt_shard_sends_every_rank_to_disk_with_the_reason(first, tmp_path):
    own = tmp_path / "own"
    shutil.copytree(first / "shm" / "own", own)
    data, _ = shard_files(own / point_name(6, 0), 1)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    # A copy of the first run's folder: its disk checkpoints (steps 4, 8, 12) are what the
    # ranks fall back to; two more steps to train from there.
    shutil.copytree(first / "first", tmp_path / "first")
    job = yaml.safe_load((first / "first.yaml").read_text())
    job["run_dir"] = str(tmp_path / "first")
    job["optim"]["steps"] = 14
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    request = {"step": 6, "generation": 0, "dir": str(own / point_name(6, 0))}
    train_ranks(tmp_path / "job.yaml", 2, env={"OPTIMUS_SNAPSHOT_RESUME": json.dumps(request),
                                                "OPTIMUS_GENERATION": "1"})
    notes = [m["message"] for m in _events(tmp_path / "first", "checkpoint")
             if "memory snapshot" in m["message"]]
    assert len(notes) == 1 and "rank 1: " in notes[0], notes
    assert "rank_00001.pt fails its sha256 check" in notes[0], notes
    resume = _events(tmp_path / "first", "resume")[-1]
    assert resume["source"] == "disk" and resume["step"] == 12


def test_a_snapshot_of_another_layout_is_refused(first, tmp_path):
    second = _job(tmp_path, "second", memory_every=0)
    request = {"step": 9, "generation": 0, "dir": str(first / "shm" / "own" / point_name(9, 0))}
    train_ranks(second, 1, env={"OPTIMUS_SNAPSHOT_RESUME": json.dumps(request)})
    (note,) = [m["message"] for m in _events(tmp_path / "second", "checkpoint")
               if "memory snapshot" in m["message"]]
    assert "taken under layout cpu:dp2" in note and "this run is cpu:dp1" in note, note
    assert not _events(tmp_path / "second", "resume")  # nothing on disk either: from scratch
    assert sorted(_losses(tmp_path / "second"))[0] == 1


def test_a_snapshot_that_cannot_be_written_is_said_and_training_goes_on(tmp_path):
    blocked = tmp_path / "shm"
    blocked.write_text("a file where the agent's folder should be")  # mkdir fails under it
    job = _job(tmp_path, "first", memory_every=3)
    train_ranks(job, 1, env={"OPTIMUS_SNAPSHOT_DIR": str(blocked / "own")})
    failed = [m["message"] for m in _events(tmp_path / "first", "snapshot")]
    assert failed and failed[0].startswith("memory snapshot of step 3 failed on rank 0: "
                                           "NotADirectoryError"), failed
    assert sorted(_losses(tmp_path / "first"))[-1] == STEPS  # training went on to the end


class _Held:
    """A state entry as the trainer's (a state_dict() of live tensors)."""

    def __init__(self, state_dict):
        self.state_dict = state_dict


def test_a_snapshot_holds_its_steps_state_though_the_next_update_is_ready_before_its_copy(
        tmp_path, monkeypatch):
    """The copy runs in the snapshot thread behind the next step; the optimizer's step waits for
    it (`fence`). Here the copy is held back 0.5 s: without the fence the next update would land
    first and the snapshot of step 1 would hold step 2's weights and moments."""
    import threading
    import time

    import torch

    from optimus.checkpoint import snapshot
    from optimus.checkpoint.state import Progress

    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    progress = Progress(8)
    state = {"model": _Held(model.state_dict), "progress": progress,
             "optim": _Held(lambda: {"exp_avg": optimizer.state[model.weight]["exp_avg"]})}
    copying = threading.Event()
    real_copy = snapshot.copy_out

    def slow_copy(*args):
        copying.set()
        time.sleep(0.5)
        return real_copy(*args)
    monkeypatch.setattr(snapshot, "copy_out", slow_copy)
    snaps = snapshot.Snapshots(tmp_path, rank=0, generation=0, every=1, layout="l",
                               agree_device=torch.device("cpu"))

    def step() -> None:
        model(torch.randn(8, 32)).square().mean().backward()
        snaps.fence()
        optimizer.step()
        optimizer.zero_grad()
        progress.advance(8 * 32)

    step()
    weights = model.weight.detach().clone()
    moment = optimizer.state[model.weight]["exp_avg"].clone()
    snaps.after_step(1, 0.1, state)
    assert copying.wait(10)  # the copy has begun, in the thread, and sleeps
    step()  # its update waits for the copy
    snaps.close()
    saved = torch.load(shard_files(tmp_path / point_name(1, 0), 0)[0], weights_only=True)
    assert torch.equal(saved["model"]["weight"], weights)
    assert torch.equal(saved["optim"]["exp_avg"], moment)
    assert not torch.equal(model.weight, weights)  # the second update did happen, after it
    assert saved["progress"]["step"] == 1 and progress.step == 2
