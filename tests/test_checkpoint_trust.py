"""No checkpoint runs code, whoever wrote it; and a run loads only what it wrote, or what its
operator trusts (optimus/checkpoint/trust.py, safe_pickle.py).

Checkpoints come from the project's saver (`Checkpointer.save`, `optimus train`); what an
attacker who can write the checkpoint folder would do is done to them afterwards: plant a
pickle that creates a marker file when unpickled, recompute every checksum of the manifest
(anyone can), copy in another run's checkpoint.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import pickle
import shutil
import stat
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from optimus.checkpoint.manifest import (
    COMMIT_MARKER,
    MANIFEST,
    CheckpointError,
    commit,
    read_manifest,
    step_dir,
)
from optimus.checkpoint.saver import Checkpointer
from optimus.checkpoint.storage import TensorFileReader
from optimus.cli import main

MAC = "optimus.json.hmac"


class _Plant:
    """Unpickled, it creates `marker`: what a checkpoint must never do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def _state(scale: float = 1.0) -> dict:
    """Tensors, and non-tensor entries of the kinds training saves (a string, a tuple)."""
    return {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale,
                      "b": torch.full((4,), scale)},
            "extra": {"layout": f"cpu:dp1.scale{scale}", "betas": (0.9, 0.95)}}


def _blank() -> dict:
    return {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(4)},
            "extra": {"layout": "", "betas": (0.0, 0.0)}}


def _save(root: Path, step: int, scale: float = 1.0) -> Path:
    """One committed checkpoint of `_state(scale)`, by the project's saver."""
    ckpt = Checkpointer(root, rank=0, world_size=1, mode="sync")
    assert ckpt.save(step, _state(scale), {"tokens": step}) == "committed"
    ckpt.close()
    return step_dir(root, step)


def _load(root: Path, trust=None) -> tuple[dict, dict | None]:
    kwargs = {} if trust is None else {"trust": trust}
    ckpt = Checkpointer(root, rank=0, world_size=1, mode="sync", **kwargs)
    state = _blank()
    try:
        return state, ckpt.load_latest(state)
    finally:
        ckpt.close()


def _recommit(path: Path) -> None:
    """What anyone who can write the folder can do: a manifest with every sha256 recomputed
    (an old MAC, if left, no longer matches; without one it is unsigned, as before signing)."""
    meta = {k: v for k, v in read_manifest(path).items()
            if k not in ("format", "files", "committed_at")}
    (path / COMMIT_MARKER).unlink()
    (path / MANIFEST).unlink()
    commit(path, meta)


def _plant_metadata(path: Path, marker: Path) -> None:
    (path / ".metadata").write_bytes(pickle.dumps(_Plant(marker)))
    (path / MAC).unlink(missing_ok=True)
    _recommit(path)


def _plant_bytes_entry(path: Path, marker: Path, name: str = "extra.layout") -> None:
    """Point the non-tensor entry `name` at a torch.save'd plant appended to its shard."""
    metadata = pickle.loads((path / ".metadata").read_bytes())  # our own, genuine file
    assert isinstance(metadata.state_dict_metadata[name], BytesStorageMetadata)
    index = next(i for i in metadata.storage_data if i.fqn == name)
    info = metadata.storage_data[index]
    buffer = io.BytesIO()
    torch.save(_Plant(marker), buffer)
    shard = path / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buffer.getvalue())
    info.offset, info.length = offset, len(buffer.getvalue())
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    (path / MAC).unlink(missing_ok=True)
    _recommit(path)


def _one_line(text: str) -> str:
    assert len(text.strip().splitlines()) == 1 and "Traceback" not in text, text
    return text.strip()


def test_the_key_is_made_once_with_mode_600_outside_the_checkpoint_folder(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    first = _save(root, 1)
    key_file = tmp_path / "run" / "secrets" / "checkpoint.key"
    key = key_file.read_bytes()
    assert len(key) == 32
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    second = _save(root, 2, scale=2.0)
    assert key_file.read_bytes() == key  # made once: every commit of the run signs with it
    for path in (first, second):
        mac = hmac.new(key, (path / MANIFEST).read_bytes(), hashlib.sha256).hexdigest()
        assert (path / MAC).read_text().strip() == mac
        assert key.hex() not in "".join(p.read_text(errors="replace")
                                        for p in path.iterdir() if p.is_file())
    state, manifest = _load(root)  # this run's own: accepted
    assert manifest["step"] == 2 and manifest["untrusted"] is None
    assert torch.equal(state["model"]["w"], _state(2.0)["model"]["w"])


def test_a_planted_metadata_pickle_runs_nothing(tmp_path):
    root, marker = tmp_path / "run" / "checkpoints", tmp_path / "ran"
    path = _save(root, 2)
    _plant_metadata(path, marker)

    with pytest.raises(CheckpointError) as refused:  # unsigned now: refused before any read
        _load(root)
    line = _one_line(str(refused.value))
    assert line.startswith(f"{path} was not written by this run: it has no {MAC}")
    assert "--trust-checkpoint" in line

    from optimus.checkpoint.trust import Trust, key_file_for

    with pytest.raises(CheckpointError) as refused:  # trusted: the reader still runs nothing
        _load(root, Trust(key_file_for(root), any=True))
    line = _one_line(str(refused.value))
    assert f"{path}/.metadata names builtins.exec" in line and "nothing in it was run" in line
    with pytest.raises(CheckpointError, match="names builtins.exec"):
        TensorFileReader(path).read_metadata()  # whatever loads through the project's reader
    assert not marker.exists()


def test_a_planted_bytes_entry_runs_nothing(tmp_path):
    root, marker = tmp_path / "run" / "checkpoints", tmp_path / "ran"
    path = _save(root, 2)
    _plant_bytes_entry(path, marker)

    with pytest.raises(CheckpointError, match=f"it has no {MAC}"):
        _load(root)
    from optimus.checkpoint.trust import Trust, key_file_for

    with pytest.raises(CheckpointError) as refused:
        _load(root, Trust(key_file_for(root), any=True))
    line = _one_line(str(refused.value))
    assert "__0_" in line and "extra.layout is refused by torch's weights_only unpickler" in line
    # DCP's own planner reads bytes entries with torch.load(weights_only=False): the project's
    # reader hands it only what the restricted unpickler accepted
    with pytest.raises(BaseException, match="weights_only"):
        dcp.load(_blank(), storage_reader=TensorFileReader(path), no_dist=True)
    assert not marker.exists()


def test_another_runs_checkpoint_is_refused_in_one_line_unless_trusted(tmp_path):
    theirs = _save(tmp_path / "a" / "checkpoints", 2, scale=3.0)
    root = tmp_path / "b" / "checkpoints"
    _save(root, 1)
    copied = step_dir(root, 2)
    shutil.copytree(theirs, copied)

    with pytest.raises(CheckpointError) as refused:  # not skipped for this run's step 1 either
        _load(root)
    line = _one_line(str(refused.value))
    assert line == (f"{copied} was not written by this run: its {MAC} does not match this "
                    "run's key (another run wrote it, or its manifest was rewritten); if you "
                    "trust whoever wrote it, pass --trust-checkpoint")

    from optimus.checkpoint.trust import Trust, key_file_for

    for trust in (Trust(key_file_for(root), any=True), Trust(key_file_for(root), step=2)):
        state, manifest = _load(root, trust)
        assert manifest["step"] == 2 and "does not match this run's key" in manifest["untrusted"]
        assert torch.equal(state["model"]["w"], _state(3.0)["model"]["w"])
        assert state["extra"]["betas"] == (0.9, 0.95)
    with pytest.raises(CheckpointError, match="pass --trust-checkpoint"):
        _load(root, Trust(key_file_for(root), step=1))  # trusting another step is not this one

    cli = CliRunner()
    verified = cli.invoke(main, ["checkpoint", "verify", "--dir", str(root)])
    assert verified.exit_code == 2
    ok, untrusted = verified.stdout.splitlines()
    assert ok.startswith("ok: step_000000001 (") and untrusted == f"untrusted: {line}"
    inspected = cli.invoke(main, ["checkpoint", "inspect", "--dir", str(root)])
    assert inspected.exit_code == 2 and _one_line(inspected.output) == f"error: {line}"
    trusted = cli.invoke(main, ["checkpoint", "inspect", "--dir", str(root),
                                "--trust-checkpoint"])
    assert trusted.exit_code == 0 and "step:        2" in trusted.stdout
    assert f"note: {copied} was not written by this run" in trusted.stderr
    assert cli.invoke(main, ["checkpoint", "verify", "--dir", str(root),
                             "--trust-checkpoint"]).exit_code == 0


def test_a_rewritten_manifest_is_refused(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    path = _save(root, 2)
    metadata = pickle.loads((path / ".metadata").read_bytes())
    info = next(v for i, v in metadata.storage_data.items() if i.fqn == "model.w")
    shard = path / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + 3] ^= 0x40  # other weights, the same size
    shard.write_bytes(bytes(data))
    _recommit(path)  # every sha256 right again; the MAC of the old manifest stays
    with pytest.raises(CheckpointError, match="does not match this run's key"):
        _load(root)
    verified = CliRunner().invoke(main, ["checkpoint", "verify", "--dir", str(root)])
    assert verified.exit_code == 2 and verified.stdout.startswith(f"untrusted: {path} was not")

    # this run's own checkpoint of step 2, put in the folder of step 3, is not step 3
    shutil.rmtree(path)
    shutil.copytree(_save(root, 2), step_dir(root, 3))
    with pytest.raises(CheckpointError, match="the checkpoint of step 2, put in the folder of "
                                              "step 3"):
        _load(root)


def test_a_key_others_can_read_is_not_used(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    _save(root, 1)
    key_file = tmp_path / "run" / "secrets" / "checkpoint.key"
    key_file.chmod(0o644)
    with pytest.raises(CheckpointError) as refused:
        _load(root)
    assert f"chmod 600 {key_file}" in _one_line(str(refused.value))
    ckpt = Checkpointer(root, rank=0, world_size=1, mode="sync")
    assert ckpt.save(2, _state(), {}) == "failed"  # nor does it sign
    assert f"chmod 600 {key_file}" in ckpt.last_error
    ckpt.close()
    key_file.chmod(0o600)
    assert _load(root)[1]["step"] == 1


def _save_and_load_on_ranks(rank: int, world: int, mine: str, theirs: str) -> list:
    """Rank r saves its own checkpoint and loads it back; then each rank meets another run's."""
    from optimus.checkpoint.trust import Trust, key_file_for

    root = Path(mine)
    ckpt = Checkpointer(root, rank=rank, world_size=world, mode="sync")
    assert ckpt.save(1, _state(), {}) == "committed"
    state = _blank()
    assert ckpt.load_latest(state)["step"] == 1  # this run's own: every rank takes it
    ckpt.close()
    if rank == 0:
        shutil.copytree(step_dir(theirs, 4), step_dir(root, 4))
    torch.distributed.barrier()
    ckpt = Checkpointer(root, rank=rank, world_size=world, mode="sync")
    try:
        ckpt.load_latest(_blank())
        refused = None
    except CheckpointError as e:
        refused = str(e)
    trusted = Checkpointer(root, rank=rank, world_size=world, mode="sync",
                           trust=Trust(key_file_for(root), step=4))
    state = _blank()
    step = trusted.load_latest(state)["step"]
    ckpt.close()
    trusted.close()
    return [refused, step, state["model"]["b"].tolist()]


def test_every_rank_refuses_another_runs_checkpoint_alike(run_ranks, tmp_path):
    _save(tmp_path / "a" / "checkpoints", 4, scale=5.0)
    results = run_ranks(_save_and_load_on_ranks, 2, str(tmp_path / "b" / "checkpoints"),
                        str(tmp_path / "a" / "checkpoints"), timeout=120)
    (refused, _, _), (other, _, _) = results
    assert refused == other and "step_000000004 was not written by this run" in refused
    _one_line(refused)
    assert [r[1:] for r in results] == [[4, [5.0] * 4]] * 2


def test_training_resumes_another_runs_checkpoint_only_when_trusted(tmp_path, monkeypatch):
    from test_train import tiny

    from optimus.config import validate_job
    from optimus.train import train

    def job(run: str, steps: int, **checkpoint) -> dict:
        return validate_job(tiny(str(tmp_path / run), optim={"steps": steps}, checkpoint={
            "interval": 2, "async_mode": "sync", **checkpoint}), world=1)

    train(job("a", 2), quiet=True)
    shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints")
    with pytest.raises(CheckpointError) as refused:
        train(job("b", 4), quiet=True)
    line = _one_line(str(refused.value))
    assert line.startswith(f"{tmp_path}/b/checkpoints/step_000000002 was not written by this "
                           "run: this run has no key at")
    assert line.endswith("pass --trust-checkpoint to `optimus train`, or set "
                         "checkpoint.trust_step to its step")

    result = train(job("b", 4, trust_step=2))
    assert len(result.losses) == 2  # steps 3 and 4, from step 2
    events = [json.loads(s) for s in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    trusted = [e for e in events if e.get("trusted")]
    assert len(trusted) == 1 and "loaded because the operator trusts it" in trusted[0]["message"]
    assert [e["step"] for e in events if e.get("event") == "resume"] == [2]
    key = (tmp_path / "b" / "secrets" / "checkpoint.key").read_bytes()
    assert key.hex() not in (tmp_path / "b" / "metrics.jsonl").read_text()
    # the run's own step 4 is signed by its own key: the next resume needs no trust
    assert read_manifest(step_dir(tmp_path / "b" / "checkpoints", 4), key)["step"] == 4

    seen = {}
    monkeypatch.setattr("optimus.train.train", lambda config, **kw: seen.update(kw))
    job_file = tmp_path / "job.yaml"
    job_file.write_text(json.dumps({"name": "x", "parallel": {"device": "cpu"}}))
    done = CliRunner().invoke(main, ["train", str(job_file), "--trust-checkpoint"])
    assert done.exit_code == 0, done.output
    assert seen == {"trust_checkpoint": True}
