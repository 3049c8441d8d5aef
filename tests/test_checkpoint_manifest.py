"""The committed-checkpoint layout: commit, verify, fall back, clean, retain, and the CLI."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from optimus.checkpoint import (
    COMMIT_MARKER,
    FORMAT,
    MANIFEST,
    CheckpointError,
    apply_retention,
    clean_partial,
    commit,
    committed_steps,
    file_digests,
    is_committed,
    latest_committed,
    latest_loadable,
    read_manifest,
    retention,
    step_dir,
    verify,
)
from optimus.checkpoint.quarantine import pick_loadable, quarantine, quarantined
from optimus.commands.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = {"dp": 2, "tp": 1, "pp": 1}


def _shards(path: Path, step: int) -> dict[str, bytes]:
    """Fake DCP output for `step`: two shards, .metadata and a per-rank file in a subfolder."""
    files = {"__0_0.distcp": bytes(range(256)) * 16 + bytes([step % 256]),
             "__1_0.distcp": b"\x07" * 3000 + str(step).encode(),
             ".metadata": b"meta" * 10,
             "extra/rank_1.json": b'{"rng": 1}'}
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    return files


def _save(root: Path, step: int, **meta) -> Path:
    path = step_dir(root, step)
    path.mkdir(parents=True)
    _shards(path, step)
    commit(path, {"step": step, "tokens": step * 4096, "layout": LAYOUT, **meta})
    return path


def test_step_dir_name():
    assert step_dir("/ck", 123) == Path("/ck/step_000000123")
    with pytest.raises(ValueError):
        step_dir("/ck", -1)


def test_commit_then_read_and_verify_clean(tmp_path):
    path = step_dir(tmp_path, 10)
    path.mkdir()
    files = _shards(path, 10)
    (path / ".tmp.leftover").write_bytes(b"x")  # temp files are not part of a checkpoint
    assert not is_committed(path)

    manifest = commit(path, {"step": 10, "tokens": 40960, "layout": LAYOUT,
                             "config_hash": "abc123", "data_state": {"sample": 640}})
    assert is_committed(path)
    assert read_manifest(path) == manifest
    assert manifest["format"] == FORMAT and manifest["step"] == 10
    assert manifest["config_hash"] == "abc123" and manifest["data_state"] == {"sample": 640}
    assert manifest["files"] == {
        rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for rel, data in files.items()}
    assert file_digests(path) == manifest["files"]
    marker = (path / COMMIT_MARKER).read_text().strip()
    assert marker == hashlib.sha256((path / MANIFEST).read_bytes()).hexdigest()
    assert verify(path) == [] and verify(path, deep=False) == []
    assert committed_steps(tmp_path) == [10] and latest_committed(tmp_path) == path
    assert not list(path.glob(".tmp.*COMMITTED*")) and not list(path.glob(".tmp.optimus*"))


def test_digests_span_chunk_boundaries(tmp_path):
    data = os.urandom(1 << 16) * 145 + b"end"  # 9.06 MiB: two 8 MiB reads
    (tmp_path / "big.distcp").write_bytes(data)
    (tmp_path / "small.distcp").write_bytes(b"s")
    assert file_digests(tmp_path) == {
        "big.distcp": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()},
        "small.distcp": {"size": 1, "sha256": hashlib.sha256(b"s").hexdigest()}}


def test_commit_refuses_a_second_commit_and_a_wrong_step(tmp_path):
    path = _save(tmp_path, 10)
    with pytest.raises(CheckpointError, match="already committed"):
        commit(path, {"step": 10})
    other = step_dir(tmp_path, 20)
    other.mkdir()
    with pytest.raises(ValueError, match="does not match"):
        commit(other, {"step": 30})
    with pytest.raises(ValueError, match="files"):
        commit(other, {"step": 20, "files": {}})


def test_truncated_file_is_named(tmp_path):
    path = _save(tmp_path, 10)
    shard = path / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:1024])
    expected = f"truncated: step_000000010/__0_0.distcp is 1024 bytes, the manifest says {size}"
    assert verify(path) == [expected]
    assert verify(path, deep=False) == [expected]


def test_flipped_byte_is_a_checksum_mismatch_only_deep(tmp_path):
    path = _save(tmp_path, 10)
    shard = path / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    problems = verify(path)
    assert len(problems) == 1
    assert problems[0].startswith("checksum mismatch: step_000000010/__1_0.distcp has sha256 ")
    assert verify(path, deep=False) == []  # same size: only the checksum sees it


def test_missing_and_extra_files_are_named(tmp_path):
    path = _save(tmp_path, 10)
    (path / "extra" / "rank_1.json").unlink()
    (path / "__9_0.distcp").write_bytes(b"stray")
    assert verify(path) == [
        "missing: step_000000010/extra/rank_1.json is listed in the manifest but absent",
        "unexpected file: step_000000010/__9_0.distcp is not in the manifest"]


def test_uncommitted_dirs_are_invisible_and_cleaned_unless_kept(tmp_path):
    good = _save(tmp_path, 10)
    no_marker = step_dir(tmp_path, 20)
    no_marker.mkdir()
    _shards(no_marker, 20)
    in_flight = step_dir(tmp_path, 30)
    in_flight.mkdir()
    _shards(in_flight, 30)
    (tmp_path / ".tmp.stray").write_bytes(b"x")
    (good / ".tmp.COMMITTED.123").write_bytes(b"x")
    (tmp_path / "notes").mkdir()  # not ours: never touched

    assert committed_steps(tmp_path) == [10]
    assert latest_committed(tmp_path) == good
    assert latest_loadable(tmp_path) == (good, [])
    removed = clean_partial(tmp_path, keep=[30])
    assert sorted(removed) == sorted([no_marker, tmp_path / ".tmp.stray",
                                      good / ".tmp.COMMITTED.123"])
    assert not no_marker.exists() and in_flight.is_dir() and (tmp_path / "notes").is_dir()
    assert verify(good) == []
    assert clean_partial(tmp_path) == [in_flight] and not in_flight.exists()


def test_a_manifest_without_its_marker_is_not_committed(tmp_path):
    path = _save(tmp_path, 10)
    (path / COMMIT_MARKER).unlink()
    assert not is_committed(path) and committed_steps(tmp_path) == []
    with pytest.raises(CheckpointError, match="step_000000010 is not a committed checkpoint"):
        read_manifest(path)
    assert latest_loadable(tmp_path) == (None, [])


def test_a_marker_that_does_not_match_the_manifest_is_refused(tmp_path):
    path = _save(tmp_path, 10)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["tokens"] = 1
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"optimus\.json does not match the sha256 recorded"):
        read_manifest(path)
    assert "does not match the sha256" in verify(path)[0]


def test_missing_or_unparsable_manifest_is_named(tmp_path):
    path = _save(tmp_path, 10)
    (path / MANIFEST).write_bytes(b"{not json")
    (path / COMMIT_MARKER).write_text(hashlib.sha256(b"{not json").hexdigest())
    with pytest.raises(CheckpointError, match=r"optimus\.json is not valid JSON"):
        read_manifest(path)
    (path / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"cannot read .*step_000000010/optimus\.json"):
        read_manifest(path)


def test_latest_loadable_falls_back_past_a_corrupt_newest(tmp_path):
    _save(tmp_path, 10)
    good = _save(tmp_path, 20)
    bad = _save(tmp_path, 30)
    (bad / "__0_0.distcp").write_bytes(b"short")
    path, skipped = latest_loadable(tmp_path)
    assert path == good
    assert skipped == ["step_000000030 is corrupt (truncated: step_000000030/__0_0.distcp is "
                       "5 bytes, the manifest says 4097)"]
    assert latest_loadable(tmp_path / "none") == (None, [])


def _kept(steps: list[int], keep_last: int, keep_every: int) -> set[int]:
    """Retention by its definition: the newest `keep_last` of `steps`, and every multiple."""
    newest = sorted(steps, reverse=True)[:keep_last]
    multiples = [s for s in steps if keep_every and s % keep_every == 0]
    return set(newest) | set(multiples)


def _retention_cases() -> list[tuple[list[int], int, int]]:
    """Distinct steps in random order, from none to 9, against keep_last 0..11 and keep_every
    from 0 (none) to beyond every step."""
    rng = random.Random(14)
    cases = []
    for n, keep_last, keep_every in itertools.product(range(10), range(12), (0, 1, 3, 10, 1000)):
        steps = rng.sample(range(0, 200, rng.choice((1, 5))), n)
        cases.append((steps, keep_last, keep_every))
    return cases


def test_retention_is_the_newest_keep_last_plus_the_multiples():
    cases = _retention_cases()
    # the regime issue 14 was about, and the edges, are all in the sample
    assert sum(0 < len(steps) < keep_last for steps, keep_last, _ in cases) > 100
    assert any(steps != sorted(steps) for steps, _, _ in cases)
    assert any(not steps for steps, _, _ in cases)
    for steps, keep_last, keep_every in cases:
        kept = retention(steps, keep_last, keep_every)
        assert kept == _kept(steps, keep_last, keep_every), (steps, keep_last, keep_every)
        if steps and keep_last:
            assert max(steps) in kept  # the newest is never a candidate for deletion
        if len(steps) <= keep_last:
            assert kept == set(steps)


def test_retention_keeps_every_checkpoint_when_there_are_fewer_than_keep_last():
    assert retention([50, 100], keep_last=3, keep_every=0) == {50, 100}
    assert retention([100, 50, 150, 200], keep_last=7, keep_every=0) == {50, 100, 150, 200}
    assert retention([30, 10, 20], keep_last=2, keep_every=0) == {20, 30}
    assert retention([30, 10, 20], keep_last=0, keep_every=0) == set()
    assert retention([30, 10, 20], keep_last=1, keep_every=1000) == {30}
    assert retention([], keep_last=3, keep_every=5) == set()
    with pytest.raises(ValueError, match="must be >= 0"):
        retention([10], keep_last=-1, keep_every=0)


def test_apply_retention_deletes_nothing_below_keep_last(tmp_path):
    for step in (50, 100):
        _save(tmp_path, step)
    assert apply_retention(tmp_path, keep_last=3, keep_every=0) == []
    assert committed_steps(tmp_path) == [50, 100]
    assert all(verify(step_dir(tmp_path, step)) == [] for step in (50, 100))
    with pytest.raises(ValueError, match="would delete the newest committed checkpoint"):
        apply_retention(tmp_path, keep_last=0, keep_every=0)
    assert committed_steps(tmp_path) == [50, 100]


def test_apply_retention_removes_exactly_the_others(tmp_path):
    for step in range(10, 101, 10):
        _save(tmp_path, step)
    partial = step_dir(tmp_path, 110)
    partial.mkdir()  # a save in flight: not retention's business
    deleted = apply_retention(tmp_path, keep_last=3, keep_every=50)
    assert deleted == [10, 20, 30, 40, 60, 70]
    assert committed_steps(tmp_path) == [50, 80, 90, 100]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000000050", "step_000000080", "step_000000090", "step_000000100", "step_000000110"]


CRASH_IN_COMMIT = """
import os, sys
from pathlib import Path
from optimus.checkpoint import manifest

real = os.replace
def replace(src, dst):
    if Path(dst).name == manifest.COMMIT_MARKER:
        os._exit(9)  # the process dies just before the marker lands
    real(src, dst)
manifest.os.replace = replace
manifest.commit(Path(sys.argv[1]), {"step": 20, "tokens": 1})
"""


def test_a_crash_before_the_marker_rename_leaves_the_save_invisible(tmp_path):
    good = _save(tmp_path, 10)
    path = step_dir(tmp_path, 20)
    path.mkdir()
    _shards(path, 20)
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(CRASH_IN_COMMIT), str(path)],
                           cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert child.returncode == 9
    assert (path / MANIFEST).is_file() and not (path / COMMIT_MARKER).exists()
    assert list(path.glob(".tmp.COMMITTED.*"))  # the marker was written but never renamed
    assert committed_steps(tmp_path) == [10]
    assert latest_loadable(tmp_path) == (good, [])
    assert clean_partial(tmp_path) == [path]
    assert committed_steps(tmp_path) == [10] and verify(good) == []


def test_a_crash_mid_delete_leaves_an_uncommitted_dir(tmp_path, monkeypatch):
    import optimus.checkpoint.manifest as m

    for step in (10, 20):
        _save(tmp_path, step)

    def crash(path):
        raise OSError("crash mid-delete")

    monkeypatch.setattr(m.shutil, "rmtree", crash)
    with pytest.raises(OSError):
        apply_retention(tmp_path, keep_last=1, keep_every=0)
    assert step_dir(tmp_path, 10).is_dir() and committed_steps(tmp_path) == [20]


# --- the CLI -----------------------------------------------------------------------------------

def _cli(*args: str):
    return CliRunner().invoke(checkpoint, list(args))


def test_cli_list(tmp_path):
    _save(tmp_path, 10)
    _save(tmp_path, 20)
    step_dir(tmp_path, 30).mkdir()
    table = _cli("list", str(tmp_path))
    assert table.exit_code == 0, table.output
    lines = {line.split("│")[1].strip(): line for line in table.output.splitlines()
             if line.count("│") > 2 and line.split("│")[1].strip().isdigit()}
    assert set(lines) == {"10", "20", "30"}
    assert all(v in lines["20"] for v in ("committed", "81,920", "dp=2 tp=1 pp=1"))
    assert "partial" in lines["30"] and "0 B" in lines["30"]

    rows = json.loads(_cli("list", str(tmp_path), "-o", "json").output)
    assert [(r["step"], r["state"], r["tokens"]) for r in rows] == [
        (10, "committed", 40960), (20, "committed", 81920), (30, "partial", None)]
    assert rows[0]["layout"] == LAYOUT
    assert rows[0]["bytes"] == sum(p.stat().st_size for p in step_dir(tmp_path, 10).rglob("*")
                                   if p.is_file())


def test_cli_inspect(tmp_path):
    _save(tmp_path, 10)  # committed by hand, without a run's key: trusted to be looked at
    path = _save(tmp_path, 20, config_hash="c0ffee", data_state={"sample": 1280})
    out = _cli("inspect", str(tmp_path), "--trust-checkpoint")  # a root: its latest
    assert out.exit_code == 0, out.output
    total = sum(f["size"] for f in read_manifest(path)["files"].values())
    for expected in ("step:        20", "tokens:      81,920", "layout:      dp=2 tp=1 pp=1",
                     "config hash: c0ffee", 'data state:  {"sample": 1280}',
                     f"files:       4, {total:,} bytes"):
        assert expected in out.output
    full = json.loads(_cli("inspect", str(step_dir(tmp_path, 10)), "-o", "json",
                           "--trust-checkpoint").stdout)
    assert full == read_manifest(step_dir(tmp_path, 10))


def test_cli_verify(tmp_path):
    _save(tmp_path, 10)  # committed by hand, without a run's key: trusted to be checked
    bad = _save(tmp_path, 20)
    ok = _cli("verify", str(step_dir(tmp_path, 10)), "--trust-checkpoint")
    assert ok.exit_code == 0 and "ok: step_000000010 (4 files" in ok.output
    data = bytearray((bad / "__0_0.distcp").read_bytes())
    data[0] ^= 1
    (bad / "__0_0.distcp").write_bytes(bytes(data))
    out = _cli("verify", str(tmp_path), "--trust-checkpoint")
    assert out.exit_code == 2
    assert "ok: step_000000010" in out.output
    assert "checksum mismatch: step_000000020/__0_0.distcp" in out.output
    assert _cli("verify", str(tmp_path), "--sizes-only", "--trust-checkpoint").exit_code == 0


def test_cli_missing_path_is_a_checkpoint_error(tmp_path):
    for command in ("list", "inspect", "verify"):
        result = _cli(command, str(tmp_path / "nope"))
        assert isinstance(result.exception, CheckpointError)
        assert "nope does not exist" in str(result.exception)
    empty = _cli("inspect", str(tmp_path))
    assert isinstance(empty.exception, CheckpointError)
    assert "no committed checkpoint" in str(empty.exception)


def test_a_corrupt_newest_is_set_aside_out_of_the_step_namespace_with_its_reason(tmp_path):
    _save(tmp_path, 10)
    good = _save(tmp_path, 20)
    bad = _save(tmp_path, 30)
    data = bytearray((bad / "__1_0.distcp").read_bytes())
    data[5] ^= 0xFF  # same size: only the checksum can tell
    (bad / "__1_0.distcp").write_bytes(bytes(data))
    path, skipped, aside = pick_loadable(tmp_path, by="a test")
    assert path == good and skipped[0].startswith("step_000000030 is corrupt (checksum mismatch")
    (moved,) = aside
    target = Path(moved["path"])
    assert moved["step"] == 30 and target.parent == tmp_path / "quarantine"
    assert target.name.startswith("step_000000030.") and not bad.exists()
    # Neither committed nor partial: nothing loads it, retention and cleanup leave it alone.
    assert committed_steps(tmp_path) == [10, 20]
    assert clean_partial(tmp_path) == [] and apply_retention(tmp_path, 1, 0) == [10]
    assert target.is_dir() and (target / "__1_0.distcp").read_bytes() == bytes(data)
    note = json.loads((target / "QUARANTINED.json").read_text())
    assert (note["step"], note["kind"], note["by"], note["was"]) == (
        30, "corrupt", "a test", "step_000000030")
    assert note["reason"].startswith("checksum mismatch: step_000000030/__1_0.distcp")
    assert verify(target)[0].startswith("checksum mismatch")  # its note is not "unexpected"
    # A later save of step 30 is a fresh one; setting that aside too keeps both, apart.
    _save(tmp_path, 30)
    second = quarantine(tmp_path, 30, "suspect: a bad tile", kind="suspect")
    assert second != target and second.name.startswith("step_000000030.")
    assert [(q["step"], q["kind"]) for q in quarantined(tmp_path)] == [
        (30, "corrupt"), (30, "suspect")]


def test_a_checkpoint_whose_manifest_cannot_be_read_is_skipped_but_not_set_aside(tmp_path):
    good = _save(tmp_path, 10)
    unreadable = _save(tmp_path, 20)
    (unreadable / MANIFEST).rename(unreadable / "saved")
    (unreadable / MANIFEST).mkdir()  # reading it fails with an OSError, as on a flaky mount
    path, skipped, aside = pick_loadable(tmp_path)
    assert path == good and "cannot read" in skipped[0] and aside == []
    assert committed_steps(tmp_path) == [10, 20]  # an I/O error may pass: it stays


def test_cli_list_and_verify_show_quarantined_checkpoints(tmp_path):
    _save(tmp_path, 10)
    _save(tmp_path, 20)
    quarantine(tmp_path, 20, "truncated: step_000000020/__0_0.distcp is 5 bytes")
    rows = json.loads(_cli("list", str(tmp_path), "-o", "json").output)
    assert [(r["step"], r["state"]) for r in rows] == [(10, "committed"), (20, "quarantined")]
    assert rows[1]["reason"].startswith("truncated") and rows[1]["kind"] == "corrupt"
    table = _cli("list", str(tmp_path))
    assert "quarantined: step 20 as " in table.output and "(corrupt): truncated" in table.output
    out = _cli("verify", str(tmp_path), "--trust-checkpoint")  # committed by hand, unsigned
    assert out.exit_code == 0, out.output  # set aside is not damage in use
    assert "ok: step_000000010" in out.output and "quarantined: step 20" in out.output
