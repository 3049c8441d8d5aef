"""`optimus data prepare` on corpora as users have them: every format, folders and globs,
worker processes, the holdout split, refusals, and a real kill followed by a resume."""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from optimus.data import DataError, TokenShards
from optimus.data.prepare import prepare

EOS = 256
REPO = Path(__file__).resolve().parents[1]
TEXTS = ["first ✓ document", "", "third\nwith a newline", "fourth"]


def _tokens(texts: list[str]) -> list[int]:
    return [t for s in texts for t in [*s.encode("utf-8"), EOS]]


def _documents(folder: Path) -> list[str]:
    """The documents of a prepared folder, split at eos and decoded."""
    shards = TokenShards(folder)
    ids = shards.read(0, shards.num_tokens)
    ends = np.flatnonzero(ids == EOS)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [bytes(ids[a:b].astype(np.uint8)).decode() for a, b in zip(starts, ends, strict=True)]


def _jsonl(texts: list[str], key: str = "text") -> bytes:
    return "".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()


def _parquet(path: Path, texts: list, row_group_size: int = 2, kind=None,
             column: str = "text") -> None:
    table = pa.table({"id": list(range(len(texts))), column: pa.array(texts, type=kind)})
    pq.write_table(table, path, row_group_size=row_group_size)


def _write_every_format(folder: Path, texts: list[str]) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = {s: folder / f"docs{s}" for s in
             (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".parquet")}
    files[".jsonl"].write_bytes(_jsonl(texts))
    files[".jsonl.gz"].write_bytes(gzip.compress(_jsonl(texts)))
    files[".json.gz"].write_bytes(gzip.compress(_jsonl(texts)))
    # two zstd frames, as parallel compressors write them: both must be read
    half = len(texts) // 2
    cctx = zstandard.ZstdCompressor()
    for s in (".jsonl.zst", ".json.zst"):
        files[s].write_bytes(cctx.compress(_jsonl(texts[:half]))
                             + cctx.compress(_jsonl(texts[half:])))
    _parquet(files[".parquet"], texts, column="body")  # several row groups
    return files


def test_every_format_gives_the_same_tokens(tmp_path):
    files = _write_every_format(tmp_path / "in", TEXTS)
    for suffix, path in files.items():
        key = "body" if suffix == ".parquet" else "text"
        index = prepare([path], tmp_path / suffix.strip("."), text_key=key)
        assert index["num_documents"] == 4, suffix
        got = TokenShards(tmp_path / suffix.strip(".")).read(0, index["total_tokens"])
        assert got.tolist() == _tokens(TEXTS), suffix
    (tmp_path / "in" / "whole.txt").write_text("a text file is one document")
    index = prepare([tmp_path / "in" / "whole.txt"], tmp_path / "txt")
    assert _documents(tmp_path / "txt") == ["a text file is one document"]


def test_folders_and_globs_are_expanded_and_sorted(tmp_path):
    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    (src / "b" / "2.jsonl").write_bytes(_jsonl(["two"]))
    (src / "1.jsonl.gz").write_bytes(gzip.compress(_jsonl(["one"])))
    (src / "README.md").write_text("not data: skipped in a folder")
    (src / ".hidden.jsonl").write_bytes(_jsonl(["hidden"]))
    index = prepare([src / "b" / "2.jsonl", src], tmp_path / "a")  # named twice: read once
    assert index["inputs"] == 2 and _documents(tmp_path / "a") == ["one", "two"]
    prepare([str(src / "**" / "*.jsonl")], tmp_path / "g")
    assert _documents(tmp_path / "g") == ["two"]


def _hf_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = sorted({w for i in range(50) for w in _doc(i).split()})
    tok = Tokenizer(WordLevel(vocab={w: i for i, w in enumerate(["<unk>", "</s>", *words])},
                              unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["</s>"])
    tok.save(str(path))


def _doc(i: int) -> str:
    return f"document {i} says " + " ".join([f"word{i * 7 % 13}", f"word{i % 5}"] * 3)


def test_worker_processes_write_byte_identical_output(tmp_path):
    texts = [_doc(i) for i in range(50)]
    src = tmp_path / "src"
    for i in range(5):  # five inputs of four formats, ten documents each
        part = texts[i * 10 : (i + 1) * 10]
        if i == 4:
            _parquet(src / "e.parquet", part, row_group_size=3)
        else:
            src.mkdir(exist_ok=True)
            data = _jsonl(part)
            name, data = [("a.jsonl", data), ("b.jsonl.gz", gzip.compress(data)),
                          ("c.json.zst", zstandard.ZstdCompressor().compress(data)),
                          ("d.jsonl", data)][i]
            (src / name).write_bytes(data)
    tok = tmp_path / "tokenizer.json"
    _hf_tokenizer(tok)
    outs = {}
    for workers in (1, 3):
        out = outs[workers] = tmp_path / f"w{workers}"
        prepare([src], out, tokenizer=str(tok), shard_tokens=16, workers=workers,
                holdout=0.3)
    for rel in ["index.json", "holdout/index.json",
                *(p.relative_to(outs[1]) for p in outs[1].rglob("shard_*.bin"))]:
        assert (outs[1] / rel).read_bytes() == (outs[3] / rel).read_bytes(), rel
    index = json.loads((outs[3] / "index.json").read_text())
    held = json.loads((outs[3] / "holdout" / "index.json").read_text())
    assert index["num_documents"] + held["num_documents"] == 50 and held["num_documents"] > 0
    assert len(index["shards"]) > 5  # every input, several shards each
    TokenShards(outs[3]).verify()
    TokenShards(outs[3] / "holdout").verify()


def test_bad_input_is_named_with_its_line_or_row(tmp_path, monkeypatch):
    def refused(name: str, data: bytes | None, match: str, **kw) -> None:
        path = tmp_path / name
        if data is not None:
            path.write_bytes(data)
        with pytest.raises(DataError, match=match):
            prepare([path], tmp_path / "out", **kw)

    good = _jsonl(["a", "b", "c"] * 200)
    refused("cut.jsonl.gz", gzip.compress(good)[:-12], r"cut\.jsonl\.gz: the \.jsonl\.gz "
            r"stream is corrupt after line \d+ \(Compressed file ended")
    refused("junk.jsonl.gz", b"\x1f\x8bjunk" * 9, r"junk\.jsonl\.gz: .* corrupt from its start")
    refused("cut.json.zst", zstandard.ZstdCompressor().compress(good)[:-5],
            r"cut\.json\.zst: .* ends inside a zstd frame: it is truncated")
    refused("num.jsonl", b'{"text": "ok"}\n{"text": 5}\n',
            r"num\.jsonl:2: field 'text' is int, not a string")
    refused("other.jsonl", b'{"body": "ok"}\n', r"other\.jsonl:1: no 'text' field; pass "
            "--text-key")
    refused("data.csv", b"a,b\n", r"data\.csv has extension '\.csv', which optimus does not "
            "read; use .txt")
    _parquet(tmp_path / "t.parquet", ["x", "y"])
    refused("t.parquet", None, r"t\.parquet has no column 'body' \(its columns: id, text\); "
            "pass --text-key", text_key="body")
    refused("t.parquet", None, r"t\.parquet: column 'id' holds int64, not text", text_key="id")
    _parquet(tmp_path / "n.parquet", ["x", None, "z"])
    refused("n.parquet", None, r"n\.parquet: row 2 has no text \(null in column 'text'\)")
    refused("fake.parquet", b"not parquet", r"fake\.parquet is not a readable parquet file")
    refused("empty_dir", None, "matches no file|does not exist")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.md").write_text("x")
    refused("docs", None, r"folder .*docs holds no file optimus reads")
    refused("*.nothing", None, r"pattern .*\*\.nothing' matches no file")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if the extra were not installed
    refused("t.parquet", None, r"reading .*t\.parquet needs the pyarrow package; run: pip "
            r"install 'optimus\[data\]'")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    refused("cut.json.zst", None, r"needs the zstandard package; run: pip install")


def test_changed_arguments_are_refused_unless_overwrite(tmp_path, monkeypatch):
    a, b, bad = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    a.write_bytes(_jsonl(["one"]))
    b.write_bytes(_jsonl(["two"]))
    bad.write_bytes(b"{oops\n")
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"c\.jsonl:1: not valid JSON"):
        prepare([a, b, bad], out, workers=2)  # a and b are done and kept
    assert sorted(p.name for p in (out / "done").iterdir()) == ["00000.json", "00001.json"]
    with pytest.raises(DataError, match=r"was being prepared with other arguments \(inputs: 1 "
                       r"no longer given, e\.g\. .*c\.jsonl\); run again with the same "
                       "arguments to continue, or pass --overwrite"):
        prepare([a, b], out)
    bad.write_bytes(_jsonl(["three"]))
    done_a = (out / "shard_00000_0000.bin").stat()
    prepare([a, b, bad], out)
    assert _documents(out) == ["one", "two", "three"]
    assert (out / "shard_00000_0000.bin").stat().st_mtime_ns == done_a.st_mtime_ns
    with pytest.raises(DataError, match=r"already holds prepared data with other arguments "
                       r"\(dtype 'uint16' then, 'uint32' now\)"):
        prepare([a, b, bad], out, dtype="uint32")
    again = prepare([a, b, bad], out)  # the same arguments: the finished result, untouched
    assert again == json.loads((out / "index.json").read_text())
    assert (out / "shard_00000_0000.bin").stat().st_mtime_ns == done_a.st_mtime_ns
    index = prepare([a], out, dtype="uint32", overwrite=True)
    assert index["dtype"] == "uint32" and _documents(out) == ["one"]
    assert not (out / "shard_00001_0000.bin").exists()
    with (out / ".prepare.lock").open() as lock:  # another prepare is writing there
        fcntl.flock(lock, fcntl.LOCK_SH)
        monkeypatch.setattr(sys.modules["optimus.data.prepare"], "LOCK_WAIT_S", 0.2)
        with pytest.raises(DataError, match=r"another `optimus data prepare` is writing to "
                           ".*out; wait for it to finish"):
            prepare([a], out, dtype="uint32")


def test_holdout_is_disjoint_deterministic_and_readable(tmp_path):
    texts = [f"document number {i}" for i in range(400)]
    src = tmp_path / "src.jsonl"
    src.write_bytes(_jsonl(texts + texts[:50]))  # exact duplicates land on the same side
    index = prepare([src], tmp_path / "out", holdout=0.25)
    train, held = _documents(tmp_path / "out"), _documents(tmp_path / "out" / "holdout")
    assert not set(train) & set(held)
    assert sorted(set(train) | set(held)) == sorted(texts)
    assert 60 < len(set(held)) < 140  # about a quarter of 400
    assert index["holdout"] == {"fraction": 0.25, "folder": "holdout",
                                "num_documents": len(held)}
    assert index["num_documents"] == len(train) and len(train) + len(held) == 450
    assert prepare([src], tmp_path / "again", holdout=0.25)["shards"] == index["shards"]
    assert "holdout" not in prepare([src], tmp_path / "none")  # 0: no holdout folder
    assert not (tmp_path / "none" / "holdout").exists()


def test_a_killed_prepare_continues_and_never_rewrites_a_finished_shard(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rows = [f"row {i} " + "lorem ipsum dolor sit amet " * 40 for i in range(3000)]
    for i in range(10):  # four small inputs first, then six of ~3.4 MB
        (src / f"part_{i:02d}.jsonl").write_bytes(_jsonl(rows[:30] if i < 4 else rows))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "optimus", "data", "prepare", str(src), "--out", str(out),
           "--workers", "2", "--shard-tokens", "1000000", "--holdout", "0.1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not list((out / "done").glob("*.json")) and proc.poll() is None:
        assert time.monotonic() < deadline, "no input finished within 60 s"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    with (out / ".prepare.lock").open() as lock:  # the workers are gone once it is free
        fcntl.flock(lock, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_UN)
    done = sorted((out / "done").glob("*.json"))
    assert 1 <= len(done) < 10, f"the kill came too late to test anything: {len(done)} done"
    assert not (out / "index.json").exists()
    finished = {}
    for record in map(json.loads, (p.read_text() for p in done)):
        for folder, key in ((out, "shards"), (out / "holdout", "holdout_shards")):
            for shard in record[key]:
                st = (folder / shard["file"]).stat()
                finished[folder / shard["file"]] = (st.st_ino, st.st_mtime_ns)

    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert f"resuming: {len(done)} of 10 input files already done" in rerun.stderr
    assert "held out" in rerun.stdout
    for path, (ino, mtime) in finished.items():
        st = path.stat()
        assert (st.st_ino, st.st_mtime_ns) == (ino, mtime), f"{path} was rewritten"
    whole = tmp_path / "whole"
    prepare([src], whole, shard_tokens=1_000_000, holdout=0.1)
    for rel in ("index.json", "holdout/index.json"):
        assert (out / rel).read_bytes() == (whole / rel).read_bytes()
    TokenShards(out).verify()  # every shard matches the checksums of the uninterrupted run
    TokenShards(out / "holdout").verify()
    assert not list(out.rglob("*.tmp"))
