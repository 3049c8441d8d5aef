"""manifest.py's rules at their limits: the exact bytes it writes, each check just inside and just
outside its bound, and the messages that name what is wrong (what `make mutate` holds it to)."""

from __future__ import annotations

import hashlib
import json
import os
import types
import warnings
from pathlib import Path

import pytest

import optimus.checkpoint.manifest as m
from optimus.checkpoint.manifest import (
    COMMIT_MARKER,
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
    write_note,
)

SHARDS = {".metadata": b"meta", "__0_0.distcp": b"shard zero", "__1_0.distcp": b"shard one!",
          "extra/rank_1.json": b'{"rng": 1}'}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _save(root: Path, step: int, files: dict[str, bytes] = SHARDS) -> Path:
    path = step_dir(root, step)
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    commit(path, {"step": step})
    return path


def _recommit(path: Path, manifest) -> None:
    """Replace the manifest with `manifest` and a marker that matches it (a well-formed commit
    of a manifest this optimus did not write)."""
    data = json.dumps(manifest).encode()
    (path / MANIFEST).write_bytes(data)
    (path / COMMIT_MARKER).write_text(_sha(data) + "\n")


# --- names -------------------------------------------------------------------------------------

def test_step_dir_takes_zero_and_refuses_what_is_not_a_non_negative_int():
    assert step_dir("/ck", 0) == Path("/ck/step_000000000")
    assert step_dir("/ck", 1_000_000_000) == Path("/ck/step_1000000000")  # past 9 digits
    for bad in (-1, True, False, 1.0, "3", None):
        with pytest.raises(ValueError, match=f"a checkpoint step is a non-negative int, not "
                                             f"{bad!r}"):
            step_dir("/ck", bad)


def test_step_of_reads_exactly_the_names_step_dir_writes():
    assert m.step_of("/ck/step_000000000") == 0
    assert m.step_of(Path("step_000000123")) == 123
    assert m.step_of("step_1000000000") == 1_000_000_000
    for other in ("step_00000012", "step_0000000123", "step_000000012x", "xstep_000000012",
                  "step_", "quarantine", "step_000000012.2024"):
        assert m.step_of(other) is None, other


# --- what a commit writes, byte for byte -------------------------------------------------------

def test_the_manifest_and_marker_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(m, "time", types.SimpleNamespace(time=lambda: 1700000000.5))
    path = step_dir(tmp_path, 7)
    (path / "sub").mkdir(parents=True)
    (path / "a.bin").write_bytes(b"abc")
    (path / "sub" / "b.bin").write_bytes(b"")
    returned = commit(path, {"step": 7, "tokens": 28672})
    expected = (
        '{\n "format": 1,\n "step": 7,\n "tokens": 28672,\n "files": {\n'
        f'  "a.bin": {{\n   "size": 3,\n   "sha256": "{_sha(b"abc")}"\n  }},\n'
        f'  "sub/b.bin": {{\n   "size": 0,\n   "sha256": "{_sha(b"")}"\n  }}\n'
        ' },\n "committed_at": 1700000000.5\n}\n')
    assert (path / MANIFEST).read_text() == expected
    assert (path / COMMIT_MARKER).read_text() == _sha(expected.encode()) + "\n"
    assert returned == json.loads(expected) == read_manifest(path)
    assert sorted(p.name for p in path.iterdir()) == [COMMIT_MARKER, "a.bin", MANIFEST, "sub"]


def test_a_note_is_one_space_indented_json_and_a_newline(tmp_path):
    write_note(tmp_path / "NOTE.json", {"step": 3, "why": "a test"})
    assert (tmp_path / "NOTE.json").read_text() == '{\n "step": 3,\n "why": "a test"\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["NOTE.json"]  # its temp file renamed


def test_format_1_is_read_and_any_other_is_refused_by_number(tmp_path):
    path = _save(tmp_path, 10)
    manifest = read_manifest(path)
    assert manifest["format"] == 1  # the on-disk format: checkpoints written today say 1
    for other in (0, 2, None, "1"):
        _recommit(path, {**manifest, "format": other})
        with pytest.raises(CheckpointError, match=rf"has format {other!r}; this optimus reads "
                                                  r"format 1: load it with the optimus version"):
            read_manifest(path)
    _recommit(path, manifest)
    assert read_manifest(path) == manifest and verify(path) == []


def test_commit_refuses_a_step_that_is_not_an_int_before_anything_else(tmp_path):
    path = step_dir(tmp_path, 1)
    path.mkdir()
    (path / "a.bin").write_bytes(b"a")
    for bad in (True, "1", 1.0, None):
        with pytest.raises(ValueError, match=rf"commit needs meta\['step'\] as an int, got "
                                             rf"{bad!r}$"):
            commit(path, {"step": bad})
    with pytest.raises(ValueError, match=r"meta\['step'\]=2 does not match the directory "
                                         r"step_000000001"):
        commit(path, {"step": 2})
    with pytest.raises(ValueError, match=r"meta may not set \['format', 'committed_at'\]"):
        commit(path, {"step": 1, "committed_at": 0, "format": 1})
    missing = step_dir(tmp_path, 2)
    with pytest.raises(CheckpointError, match="step_000000002 does not exist: the save wrote "
                                              "nothing to commit"):
        commit(missing, {"step": 2})
    assert not (path / MANIFEST).exists() and not (path / COMMIT_MARKER).exists()
    assert commit(path, {"step": 1})["step"] == 1  # the same dir, once the meta is right


def test_commit_fsyncs_what_it_vouches_for_and_reading_fsyncs_nothing(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        real(fd)

    path = step_dir(tmp_path, 5)
    path.mkdir()
    for name in ("x.bin", "y.bin"):
        (path / name).write_bytes(name.encode())
    monkeypatch.setattr(m.os, "fsync", fsync)
    file_digests(path)
    assert synced == []  # hashing to read costs no fsync
    commit(path, {"step": 5})
    assert {"x.bin", "y.bin"} <= set(synced)
    marker = next(i for i, name in enumerate(synced) if COMMIT_MARKER in name)
    assert synced.index("x.bin") < marker and synced.index("y.bin") < marker
    synced.clear()
    assert verify(path) == [] and synced == []


def test_hashing_warns_about_nothing(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"a" * 100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert file_digests(tmp_path) == {"a.bin": {"size": 100, "sha256": _sha(b"a" * 100)}}


# --- what a manifest must hold -----------------------------------------------------------------

@pytest.mark.parametrize("files", [
    [],
    None,
    {"a.bin": "not a table"},
    {"a.bin": {"size": "3", "sha256": "ab"}},
    {"a.bin": {"size": 3}},
    {"a.bin": {"sha256": "ab"}},
    {"a.bin": {"size": 3, "sha256": 5}},
    {"a.bin": {"size": 3, "sha256": "ab"}, "b.bin": {"size": 3}},
])
def test_a_files_table_that_is_not_size_and_sha256_per_file_is_refused(tmp_path, files):
    path = _save(tmp_path, 10)
    _recommit(path, {**read_manifest(path), "files": files})
    with pytest.raises(CheckpointError, match=r"optimus\.json has no valid `files` table; the "
                                              r"checkpoint is damaged"):
        read_manifest(path)


def test_a_manifest_that_is_not_an_object_is_refused(tmp_path):
    path = _save(tmp_path, 10)
    _recommit(path, [1, 2])
    with pytest.raises(CheckpointError, match="has no valid `files` table"):
        read_manifest(path)


def test_the_smallest_valid_files_table_is_read(tmp_path):
    path = _save(tmp_path, 10)
    manifest = {**read_manifest(path), "files": {"a.bin": {"size": 0, "sha256": ""}}}
    _recommit(path, manifest)
    assert read_manifest(path) == manifest


# --- verify and latest_loadable ----------------------------------------------------------------

def test_every_problem_is_reported_not_just_the_first(tmp_path):
    path = _save(tmp_path, 10)
    (path / ".metadata").unlink()  # the first listed file
    (path / "__0_0.distcp").write_bytes(b"shard")  # 5 bytes of 10
    (path / "__1_0.distcp").write_bytes(b"shard one? longer")
    assert verify(path, deep=False) == [
        "missing: step_000000010/.metadata is listed in the manifest but absent",
        "truncated: step_000000010/__0_0.distcp is 5 bytes, the manifest says 10",
        "size mismatch: step_000000010/__1_0.distcp is 17 bytes, the manifest says 10"]


def test_a_checksum_mismatch_shows_twelve_hex_digits_of_each(tmp_path):
    path = _save(tmp_path, 10)
    (path / "__1_0.distcp").write_bytes(b"shard one?")  # same size
    got, want = _sha(b"shard one?"), _sha(SHARDS["__1_0.distcp"])
    assert verify(path) == [f"checksum mismatch: step_000000010/__1_0.distcp has sha256 "
                            f"{got[:12]}…, the manifest says {want[:12]}…"]


def _corrupt(root: Path, step: int, problems: int) -> Path:
    """A committed checkpoint with `problems` unexpected files."""
    path = _save(root, step)
    for i in range(problems):
        (path / f"stray_{i}").write_bytes(b"x")
    return path


@pytest.mark.parametrize("problems, shown", [
    (3, "unexpected file: step_000000020/stray_0 is not in the manifest; "
        "unexpected file: step_000000020/stray_1 is not in the manifest; "
        "unexpected file: step_000000020/stray_2 is not in the manifest"),
    (4, "unexpected file: step_000000020/stray_0 is not in the manifest; "
        "unexpected file: step_000000020/stray_1 is not in the manifest; "
        "unexpected file: step_000000020/stray_2 is not in the manifest; and 1 more"),
    (6, "unexpected file: step_000000020/stray_0 is not in the manifest; "
        "unexpected file: step_000000020/stray_1 is not in the manifest; "
        "unexpected file: step_000000020/stray_2 is not in the manifest; and 3 more"),
])
def test_a_skipped_checkpoint_shows_three_problems_and_counts_the_rest(tmp_path, problems, shown):
    good = _save(tmp_path, 10)
    _corrupt(tmp_path, 20, problems)
    assert latest_loadable(tmp_path) == (good, [f"step_000000020 is corrupt ({shown})"])


# --- clean_partial and retention ---------------------------------------------------------------

def test_clean_partial_of_a_missing_root_is_an_empty_list(tmp_path):
    assert clean_partial(tmp_path / "none") == []
    assert clean_partial(tmp_path) == []  # an empty root: nothing to remove either


@pytest.mark.parametrize("keep_last, keep_every", [(-1, 0), (0, -1), (-1, -1)])
def test_retention_refuses_a_negative_count(keep_last, keep_every):
    with pytest.raises(ValueError, match=f"keep_last={keep_last} and keep_every={keep_every} "
                                         "must be >= 0"):
        retention([10, 20], keep_last, keep_every)


def test_retention_at_zero_keeps_only_what_the_other_rule_asks_for():
    assert retention([10, 20, 30], keep_last=0, keep_every=0) == set()
    assert retention([10, 20, 30], keep_last=0, keep_every=20) == {20}
    assert retention([10, 20, 30], keep_last=1, keep_every=0) == {30}
    assert retention([0, 7, 14, 15], keep_last=1, keep_every=7) == {0, 7, 14, 15}


def test_retention_keeps_all_when_keep_last_reaches_the_count():
    assert retention([30, 10, 20], keep_last=3, keep_every=0) == {10, 20, 30}
    assert retention([30, 10, 20], keep_last=4, keep_every=0) == {10, 20, 30}
    assert retention([30, 10, 20], keep_last=2, keep_every=0) == {20, 30}


def test_apply_retention_needs_keep_last_of_at_least_one(tmp_path):
    for step in (10, 20, 30):
        _save(tmp_path, step)
    with pytest.raises(ValueError, match=r"^keep_last=0 would delete the newest committed "
                                         r"checkpoint; keep at least 1$"):
        apply_retention(tmp_path, keep_last=0, keep_every=20)
    assert committed_steps(tmp_path) == [10, 20, 30]
    assert apply_retention(tmp_path, keep_last=1, keep_every=20) == [10]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000020", "step_000000030"]
    assert apply_retention(tmp_path, keep_last=1, keep_every=0) == [20]
    assert committed_steps(tmp_path) == [30]


# --- what a manifest covers --------------------------------------------------------------------

def test_a_manifest_covers_files_but_not_its_own_temps_marker_notes_or_links(tmp_path):
    for rel in ("a.bin", "sub/b.bin", "sub/optimus.json", ".tmp.a.bin.1", "sub/.tmpdir/c",
                MANIFEST, COMMIT_MARKER, "QUARANTINED.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "link.bin").symlink_to(tmp_path / "a.bin")
    assert file_digests(tmp_path) == {rel: {"size": 1, "sha256": _sha(b"x")}
                                      for rel in ("a.bin", "sub/b.bin", "sub/optimus.json")}


def test_an_empty_save_commits_an_empty_files_table(tmp_path):
    path = step_dir(tmp_path, 3)
    path.mkdir()
    assert commit(path, {"step": 3})["files"] == {}
    assert verify(path) == [] and is_committed(path)


def test_a_second_commit_of_a_step_is_refused(tmp_path):
    path = _save(tmp_path, 4)
    before = (path / MANIFEST).read_bytes()
    with pytest.raises(CheckpointError, match=r"step_000000004 is already committed; save step "
                                              r"4 only once$"):
        commit(path, {"step": 4})
    assert (path / MANIFEST).read_bytes() == before


# --- reading a committed checkpoint ------------------------------------------------------------

def test_reading_an_uncommitted_checkpoint_says_its_save_never_finished(tmp_path):
    path = step_dir(tmp_path, 6)
    path.mkdir()
    message = (f"{path} is not a committed checkpoint (no COMMITTED marker): its save never "
               "finished; resume from a committed one")
    with pytest.raises(CheckpointError) as e:
        read_manifest(path)
    assert str(e.value) == message
    assert verify(path) == [message] and not is_committed(path)


def test_a_committed_checkpoint_without_its_manifest_cannot_be_read(tmp_path):
    path = _save(tmp_path, 6)
    (path / MANIFEST).unlink()
    with pytest.raises(CheckpointError) as e:
        read_manifest(path)
    assert str(e.value) == (f"cannot read {path / MANIFEST}: No such file or directory; the "
                            "checkpoint is damaged; resume from an earlier committed one")


def test_a_manifest_changed_after_commit_is_refused(tmp_path):
    path = _save(tmp_path, 6)
    data = (path / MANIFEST).read_bytes()
    (path / MANIFEST).write_bytes(data.replace(b'"step": 6', b'"step": 7'))
    with pytest.raises(CheckpointError) as e:
        read_manifest(path)
    assert str(e.value) == (f"{path / MANIFEST} does not match the sha256 recorded in "
                            f"{path / COMMIT_MARKER}: the manifest or the marker changed after "
                            "commit; the checkpoint is damaged; resume from an earlier committed "
                            "one")
    (path / MANIFEST).write_bytes(data)
    assert read_manifest(path)["step"] == 6  # the marker's newline is not part of the hash


@pytest.mark.parametrize("data", [b"{", b"\xff\xfe"])
def test_a_manifest_that_is_not_json_is_refused(tmp_path, data):
    path = _save(tmp_path, 6)
    (path / MANIFEST).write_bytes(data)
    (path / COMMIT_MARKER).write_text(_sha(data))
    with pytest.raises(CheckpointError, match=r"optimus\.json is not valid JSON \(.+\); the "
                                              r"checkpoint is damaged"):
        read_manifest(path)


# --- which checkpoints exist -------------------------------------------------------------------

def test_committed_steps_are_the_committed_step_dirs_ascending(tmp_path):
    assert committed_steps(tmp_path / "none") == [] and latest_committed(tmp_path) is None
    for step in (10, 2):
        _save(tmp_path, step)
    step_dir(tmp_path, 5).mkdir()  # uncommitted
    (tmp_path / "step_000000007").write_text("a file")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / COMMIT_MARKER).write_text("x")  # committed, but not a step
    assert committed_steps(tmp_path) == [2, 10]
    assert latest_committed(tmp_path) == step_dir(tmp_path, 10)


def test_latest_loadable_with_none_whole_names_every_skip(tmp_path):
    assert latest_loadable(tmp_path) == (None, [])
    for step in (1, 2):
        path = _save(tmp_path, step)
        (path / "__0_0.distcp").write_bytes(b"shard zerO")  # same size: only deep sees it
    assert latest_loadable(tmp_path, deep=False) == (step_dir(tmp_path, 2), [])
    skipped = [f"step_00000000{s} is corrupt (checksum mismatch: step_00000000{s}/__0_0.distcp "
               f"has sha256 {_sha(b'shard zerO')[:12]}…, the manifest says "
               f"{_sha(b'shard zero')[:12]}…)" for s in (2, 1)]
    assert latest_loadable(tmp_path) == (None, skipped)


def test_verify_lists_problems_by_file_then_unexpected_files(tmp_path):
    path = _save(tmp_path, 8)
    (path / ".metadata").unlink()
    (path / "__0_0.distcp").write_bytes(b"shard zerO")
    (path / "zz").write_bytes(b"new")
    (path / ".tmp.half").write_bytes(b"temp")  # a temp file is no problem
    assert verify(path) == [
        "missing: step_000000008/.metadata is listed in the manifest but absent",
        "checksum mismatch: step_000000008/__0_0.distcp has sha256 "
        f"{_sha(b'shard zerO')[:12]}…, the manifest says {_sha(b'shard zero')[:12]}…",
        "unexpected file: step_000000008/zz is not in the manifest"]


# --- cleaning ----------------------------------------------------------------------------------

def test_clean_partial_removes_temps_and_uncommitted_steps_but_those_kept(tmp_path):
    committed = _save(tmp_path, 3)
    (committed / ".tmp.optimus.json.9").write_bytes(b"half")
    (tmp_path / ".tmp.x").write_bytes(b"t")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / ".tmplink").symlink_to(target)
    for step in (1, 2):
        step_dir(tmp_path, step).mkdir()
    (tmp_path / "step_000000004").write_text("a file, not a save")
    (tmp_path / "notes").mkdir()
    assert clean_partial(tmp_path, keep=[2]) == [
        tmp_path / ".tmp.x", tmp_path / ".tmplink", step_dir(tmp_path, 1),
        committed / ".tmp.optimus.json.9"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "elsewhere", "notes", "step_000000002", "step_000000003", "step_000000004"]
    assert verify(committed) == []
