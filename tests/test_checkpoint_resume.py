"""Checkpoints through the trainer: exact resume, resume on other layouts, and faults.

Real processes throughout: ranks under `run_ranks` (gloo), a rank killed with SIGKILL by the
fault injector, bytes flipped and cut in real shard files, a real full filesystem.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from multiproc import RanksFailed

from optimus.checkpoint import committed_steps, read_manifest, step_dir, verify
from optimus.checkpoint.quarantine import quarantined
from optimus.config import resolve_layout, validate_job
from optimus.data.audit import audit_run
from optimus.train import train

REPO = Path(__file__).resolve().parents[1]
STEPS = 8


def job(run_dir: Path, **sections) -> dict:
    raw = {"name": "ckpt", "run_dir": str(run_dir),
           "model": {"vocab_size": 256, "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
                     "ffn_dim": 128, "max_seq_len": 32},
           "optim": {"steps": STEPS, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2},
           "data": {"seq_len": 32, "batch_size": 8, "microbatches": 2},
           "parallel": {"device": "cpu"},
           "checkpoint": {"interval": 4, "keep_last": 5, "async_mode": "thread"}}
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def _train(rank: int, world_size: int, raw: dict, generation: int = 0) -> dict:
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(generation)
    job = validate_job(raw, world=world_size)
    result = train(job, keep_sample_ids=True, quiet=rank != 0)
    coords = resolve_layout(job, world_size).coords(rank)
    steps = [m.step for m in result.metrics]
    return {"losses": result.losses, "steps": steps, "samples": result.sample_ids,
            "reads_for_replica": coords["tp"] == 0 and coords["pp"] == 0}


def _events(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if "event" in e]


def _keep_only(ckpt_dir: Path, step: int) -> None:
    for other in committed_steps(ckpt_dir):
        if other != step:
            shutil.rmtree(step_dir(ckpt_dir, other))


def test_same_layout_resume_is_bitwise_identical(run_ranks, tmp_path):
    raw = job(tmp_path)
    whole = run_ranks(_train, 2, raw, timeout=180)
    assert committed_steps(tmp_path / "checkpoints") == [4, 8]
    _keep_only(tmp_path / "checkpoints", 4)
    resumed = run_ranks(_train, 2, raw, timeout=180)
    for before, after in zip(whole, resumed, strict=True):
        assert after["steps"] == [5, 6, 7, 8]
        assert after["losses"] == before["losses"][4:]  # exactly, not approximately
        assert after["samples"] == before["samples"][4:]


def _per_step_samples(results: list[dict]) -> list[list[int]]:
    """The samples each step read across data-parallel replicas (one rank per replica)."""
    readers = [r["samples"] for r in results if r["reads_for_replica"]]
    out = []
    for step in range(len(readers[0])):
        ids = [s for reader in readers for s in reader[step]]
        assert len(ids) == len(set(ids)), f"a sample was read twice in step {step}"
        out.append(sorted(ids))
    return out


def test_resume_on_other_layouts_continues_the_same_run(run_ranks, tmp_path):
    saved = tmp_path / "saved"
    raw = job(saved, parallel={"tp": 2, "pp": 2})
    original = run_ranks(_train, 8, raw, timeout=300)  # TP2 x PP2 x DP2
    _keep_only(saved / "checkpoints", 4)
    reference_samples = _per_step_samples(original)
    for name, world, parallel in (("pp2xdp4", 8, {"pp": 2}), ("one-rank", 1, {})):
        run_dir = tmp_path / name
        shutil.copytree(saved / "checkpoints", run_dir / "checkpoints")
        shutil.copytree(saved / "secrets", run_dir / "secrets")  # the run moves, with its key
        resumed = run_ranks(_train, world, job(run_dir, parallel=parallel), timeout=300)
        for result in resumed:
            assert result["steps"] == [5, 6, 7, 8]
            assert result["losses"] == pytest.approx(original[0]["losses"][4:], rel=1e-6)
        # the data picks up at the very next sample: none skipped, none read twice
        assert _per_step_samples(resumed) == reference_samples[4:]
        resumes = [e for e in _events(run_dir) if e["event"] == "resume"]
        assert [e["step"] for e in resumes] == [4]


def test_a_rank_killed_during_a_save_leaves_the_last_commit_loadable(run_ranks, tmp_path):
    # on_overlap=wait: step 4's save waits for step 2's commit, so at the kill step 2 is
    # committed and step 4 is being written
    raw = job(tmp_path, checkpoint={"interval": 2, "on_overlap": "wait"},
              fault_injection={"faults": [{"kind": "kill_rank", "rank": 1, "step": 5}]})
    with pytest.raises(RanksFailed, match=f"rank 1 exited with code -{signal.SIGKILL}"):
        run_ranks(_train, 2, raw, timeout=120)  # SIGKILL at step 5, step 4's save in flight
    ckpt_dir = tmp_path / "checkpoints"
    committed = committed_steps(ckpt_dir)
    assert committed == [2]
    assert (ckpt_dir / "step_000000004").is_dir()  # step 4's save had begun: left uncommitted
    assert verify(step_dir(ckpt_dir, max(committed))) == []
    # the next generation (no fault) resumes from it and ends where an unfaulted run ends
    resumed = run_ranks(_train, 2, raw, 1, timeout=120)
    clean = run_ranks(_train, 2, job(tmp_path / "clean", checkpoint={"interval": 0}),
                      timeout=120)
    start = max(committed)
    assert resumed[0]["steps"] == list(range(start + 1, STEPS + 1))
    assert resumed[0]["losses"] == clean[0]["losses"][start:]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_shard_is_named_and_resume_falls_back(run_ranks, tmp_path, damage):
    raw = job(tmp_path)
    whole = run_ranks(_train, 1, raw, timeout=120)
    ckpt_dir = tmp_path / "checkpoints"
    shard = sorted((step_dir(ckpt_dir, 8)).glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    shard.write_bytes(bytes(data))
    problems = verify(step_dir(ckpt_dir, 8))
    assert len(problems) == 1 and shard.name in problems[0]
    assert ("checksum mismatch" if damage == "flip" else "truncated") in problems[0]
    cli = subprocess.run([sys.executable, "-m", "optimus", "checkpoint", "verify",
                          str(step_dir(ckpt_dir, 8))], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert cli.returncode == 2 and shard.name in cli.stdout + cli.stderr
    # resume skips the damaged step 8, says so, and redoes steps 5..8 from step 4
    resumed = run_ranks(_train, 1, raw, timeout=120)
    assert resumed[0]["steps"] == [5, 6, 7, 8]
    assert resumed[0]["losses"] == whole[0]["losses"][4:]
    messages = [e["message"] for e in _events(tmp_path)]
    assert any("step_000000008 is corrupt" in m and shard.name in m for m in messages)


def _flip_bytes(path: Path) -> None:
    """Corrupt `path` in place: a run of bytes in its middle inverted, its size unchanged."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, min(middle + 16, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("interval", "committed"), [(2, [4, 6, 8]), (4, [4, 8])],
                         ids=["three-committed", "two-committed"])
def test_retention_leaves_a_fallback_for_a_corrupt_newest(run_ranks, tmp_path, interval,
                                                          committed):
    # keep_last 3: with three or more commits the newest three stay; with two (fewer than
    # keep_last, issue 14) both stay. Either way a corrupt newest has an older one behind it.
    raw = job(tmp_path, checkpoint={"interval": interval, "keep_last": 3, "on_overlap": "wait"})
    whole = run_ranks(_train, 1, raw, timeout=120)
    assert whole[0]["steps"] == list(range(1, STEPS + 1))
    ckpt_dir = tmp_path / "checkpoints"
    assert committed_steps(ckpt_dir) == committed
    newest, fallback = step_dir(ckpt_dir, committed[-1]), committed[-2]

    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    _flip_bytes(shard)
    assert shard.stat().st_size == size
    assert verify(newest, deep=False) == []  # only the checksum can tell
    assert [p.split(" has ")[0] for p in verify(newest)] == [
        f"checksum mismatch: {newest.name}/{shard.name}"]

    resumed = run_ranks(_train, 1, raw, timeout=120)
    assert resumed[0]["steps"] == list(range(fallback + 1, STEPS + 1))
    assert resumed[0]["losses"] == pytest.approx(whole[0]["losses"][fallback:], rel=1e-5)
    events = _events(tmp_path)
    skipped = [e["message"] for e in events if e["event"] == "checkpoint"
               and f"{newest.name} is corrupt" in e["message"]]
    assert len(skipped) == 1
    assert f"checksum mismatch: {newest.name}/{shard.name}" in skipped[0]
    assert skipped[0].endswith("falling back to an older checkpoint")
    assert [e["step"] for e in events if e["event"] == "resume"] == [fallback]
    assert verify(step_dir(ckpt_dir, fallback)) == []  # the checkpoint it fell back to survives

    # The corrupt one was set aside, with its reason, out of the committed steps; passing its
    # step again, training saved it afresh: every committed checkpoint verifies.
    (aside,) = quarantined(ckpt_dir)
    assert aside["step"] == committed[-1] and aside["kind"] == "corrupt"
    assert aside["reason"].startswith(f"checksum mismatch: {newest.name}/{shard.name}")
    assert Path(aside["path"]).parent == ckpt_dir / "quarantine"
    (moved,) = [e for e in events if e["event"] == "quarantine"]
    assert (moved["step"], moved["path"]) == (committed[-1], aside["path"])
    assert committed_steps(ckpt_dir) == committed
    assert all(verify(step_dir(ckpt_dir, s)) == [] for s in committed)
    assert read_manifest(newest)["committed_at"] > aside["quarantined_at"]
    # Every sample read once in the steps that count, across the restart.
    audit = audit_run(tmp_path)
    assert audit.ok, audit.problems
    assert (audit.steps, audit.end, audit.generations) == (STEPS, STEPS * 8, 2)
    assert audit.repeated == STEPS - fallback


def _small_filesystem(path: Path, size: str = "1m") -> bool:
    """A real tmpfs of `size` at `path` when this machine lets us mount one (root)."""
    path.mkdir(parents=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True)
    return proc.returncode == 0


def _limit_file_size() -> None:
    # Where no tmpfs can be mounted: the kernel refuses writes past 1 MiB (EFBIG).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def _run_train(raw: dict, tmp_path: Path, **popen) -> subprocess.CompletedProcess:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return subprocess.run([sys.executable, "-m", "optimus", "train", str(path)],
                          capture_output=True, text=True, cwd=REPO, timeout=240, **popen)


def test_a_full_disk_fails_every_save_and_the_run_exits_89_naming_the_final_step(tmp_path):
    disk = tmp_path / "disk"
    mounted = _small_filesystem(disk)
    try:
        # on_overlap wait: a loaded machine still writing step 4's save at step 8 would skip
        # that one, and the count of failed saves below would be 1.
        raw = job(tmp_path / "run", checkpoint={"dir": str(disk / "ckpt"), "interval": 4,
                                                "async_mode": "process", "on_overlap": "wait"})
        raw["model"].update(dim=128, ffn_dim=256)  # ~0.6M parameters: ~7 MiB of state
        proc = _run_train(raw, tmp_path, preexec_fn=None if mounted else _limit_file_size)
        lines = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text()
                 .splitlines()]
        steps = [m["step"] for m in lines if "step" in m and "event" not in m]
        assert steps == list(range(1, STEPS + 1))  # training went on to the end
        failures = [e for e in lines if e.get("event") == "checkpoint"
                    and "failed" in e["message"]]
        assert failures, proc.stderr[-2000:]
        assert failures[-1]["saves_failed"] == 2  # steps 4 and 8
        # ... but its final state is not saved: no quiet exit 0, one line that says so
        assert proc.returncode == 89, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: the final checkpoint (step {STEPS}) failed, none is "
                               "committed: write failed"), last
        assert ("No space left on device" if mounted else "File too large") in last
        assert committed_steps(disk / "ckpt") == []
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=False)


def test_failed_saves_in_a_row_stop_training_and_keep_the_last_commit(tmp_path):
    disk = tmp_path / "disk"
    if not _small_filesystem(disk, "4m"):  # one checkpoint (2.9 MB) fits, a second does not
        pytest.skip("mounting a tmpfs needs root")
    try:
        raw = job(tmp_path / "run", optim={"steps": 40},
                  checkpoint={"dir": str(disk / "ckpt"), "interval": 2, "keep_last": 1,
                              "max_failed_saves": 2})
        proc = _run_train(raw, tmp_path)
        assert proc.returncode == 89, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        stopped = re.fullmatch(
            r"error: ([23]) checkpoint saves failed in a row \(checkpoint.max_failed_saves=2\)"
            r": stopped after step (\d+), the newest committed is step 2; the last: checkpoint "
            r"of step (\d+): write failed .*No space left on device", last)
        assert stopped, last
        # The saves after step 2 failed in a row: 4 and 6 (and 8 when it had started before
        # the second failure showed); a save skipped while the one before it still wrote (a
        # loaded machine) is no failure and not counted.
        failed, at, last_failed = map(int, stopped.groups())
        rows = [json.loads(line) for line in
                (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        skipped = {int(m.group(1)) for r in rows if r.get("event") == "checkpoint"
                   and (m := re.match(r"save of step (\d+) skipped", r["message"]))}
        tried = [s for s in range(4, at + 1, 2) if s not in skipped]
        assert last_failed == tried[failed - 1] and last_failed <= at
        steps = [m["step"] for m in rows if "event" not in m]
        assert steps == list(range(1, at + 1))  # not one step more
        assert committed_steps(disk / "ckpt") == [2]  # nothing committed was lost
        assert verify(step_dir(disk / "ckpt", 2)) == []
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_streak_of_failed_saves_carried_from_an_earlier_generation_counts(tmp_path):
    """Under the controller a restart hands the streak on (OPTIMUS_FAILED_SAVES, from the plan):
    one failure carried plus the first failure here reach max_failed_saves=2 at once."""
    disk = tmp_path / "disk"
    if not _small_filesystem(disk, "1m"):  # no checkpoint (2.9 MB) fits
        pytest.skip("mounting a tmpfs needs root")
    try:
        raw = job(tmp_path / "run", optim={"steps": 40},
                  checkpoint={"dir": str(disk / "ckpt"), "interval": 2, "keep_last": 1,
                              "max_failed_saves": 2})
        proc = _run_train(raw, tmp_path, env={**os.environ, "OPTIMUS_FAILED_SAVES": "1"})
        assert proc.returncode == 89, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        stopped = re.fullmatch(
            r"error: (\d) checkpoint saves failed in a row \(checkpoint.max_failed_saves=2\)"
            r": stopped after step (\d+), none is committed; the last: checkpoint of step "
            r"(\d+): write failed .*No space left on device", last)
        assert stopped, last
        count, at, last_failed = map(int, stopped.groups())
        assert last_failed <= at < 8, last
        lines = list(map(json.loads,
                         (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()))
        carried = [m for m in lines if m.get("event") == "checkpoint"
                   and m.get("failed_in_a_row") == 1 and "earlier" in m["message"]]
        assert carried, "no event says that the streak was carried"
        # The carried one counts: this run's first failure is the second in a row. (How many
        # fail before the stop lands depends on the machine: a save still being written when
        # the limit is reached is waited for, and one due meanwhile may be skipped.)
        failures = [m["failed_in_a_row"] for m in lines if m.get("event") == "checkpoint"
                    and m["message"].startswith("checkpoint of step")
                    and "write failed" in m["message"]]
        assert failures == list(range(2, count + 1)), (failures, last)
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_the_last_step_is_committed_when_steps_is_not_a_multiple_of_interval(run_ranks,
                                                                           tmp_path):
    raw = job(tmp_path, optim={"steps": 7}, checkpoint={"interval": 3, "on_overlap": "wait"})
    (result,) = run_ranks(_train, 1, raw, timeout=120)
    assert result["steps"] == list(range(1, 8))
    assert committed_steps(tmp_path / "checkpoints") == [3, 6, 7]
    assert verify(step_dir(tmp_path / "checkpoints", 7)) == []
