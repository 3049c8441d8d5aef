"""Turn text files into token shards: raw little-endian arrays plus an index.json.

Layout of `out_dir`:
    shard_00000.bin ...   tokens, documents each followed by eos, dtype from the index
    index.json            written last; a folder without it holds no usable data
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from optimus.data.errors import DataError
from optimus.data.tokenizer import load_tokenizer
from optimus.files import fsync_dir, write_atomic

FORMAT = "optimus-tokens"
FORMAT_VERSION = 1
INDEX_NAME = "index.json"
SHARD_RE = re.compile(r"^shard_\d{5,}\.bin$")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def shard_name(i: int) -> str:
    return f"shard_{i:05d}.bin"


def _documents(path: Path, text_key: str) -> Iterator[str]:
    """Yield the documents of one .txt (whole file) or .jsonl (one per line) file."""
    try:
        if path.suffix == ".txt":
            yield path.read_text(encoding="utf-8")
            return
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
                if not isinstance(row, dict) or text_key not in row:
                    raise DataError(
                        f"{path}:{lineno}: no {text_key!r} field; "
                        "pass text_key=... naming the field that holds the text"
                    )
                if not isinstance(row[text_key], str):
                    raise DataError(f"{path}:{lineno}: field {text_key!r} is not a string")
                yield row[text_key]
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from e


class _ShardWriter:
    """Appends tokens to temp shard files of `shard_tokens` tokens each."""

    def __init__(self, out_dir: Path, dtype: np.dtype, shard_tokens: int):
        self.out_dir, self.dtype, self.shard_tokens = out_dir, dtype, shard_tokens
        self.shards: list[dict] = []
        self.temps: list[Path] = []
        self._f = None

    def _open(self) -> None:
        tmp = self.out_dir / (shard_name(len(self.shards)) + ".tmp")
        self.temps.append(tmp)
        self._f = tmp.open("wb")
        self._hash = hashlib.sha256()
        self._count = 0

    def _close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        self.shards.append(
            {
                "file": shard_name(len(self.shards)),
                "num_tokens": self._count,
                "sha256": self._hash.hexdigest(),
            }
        )

    def write(self, tokens: np.ndarray) -> None:
        pos = 0
        while pos < len(tokens):
            if self._f is None:
                self._open()
            take = min(len(tokens) - pos, self.shard_tokens - self._count)
            chunk = tokens[pos : pos + take]
            chunk.tofile(self._f)
            self._hash.update(chunk.tobytes())
            self._count += take
            pos += take
            if self._count == self.shard_tokens:
                self._close()

    def finish(self) -> None:
        if self._f is not None:
            self._close()

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
        for tmp in self.temps:
            tmp.unlink(missing_ok=True)


def prepare(
    inputs: list[Path],
    out_dir: Path,
    tokenizer: str = "byte",
    dtype: str = "auto",
    shard_tokens: int = 2**26,
    text_key: str = "text",
    overwrite: bool = False,
) -> dict:
    """Tokenize .txt/.jsonl files into shards under `out_dir`; returns the index written."""
    inputs = [Path(p) for p in inputs]
    out_dir = Path(out_dir)
    if not inputs:
        raise DataError("no input files given; name at least one .txt or .jsonl file")
    for p in inputs:
        if not p.is_file():
            raise DataError(f"input file {p} does not exist")
        if p.suffix not in (".txt", ".jsonl"):
            raise DataError(
                f"input file {p} has extension {p.suffix!r}; "
                "use .txt (one document per file) or .jsonl (one document per line)"
            )
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be at least 1, got {shard_tokens}")
    tok = load_tokenizer(tokenizer)
    if dtype == "auto":
        dtype = "uint16" if tok.vocab_size <= 2**16 else "uint32"
    if dtype not in DTYPES:
        raise DataError(f"unknown dtype {dtype!r}; use 'auto', 'uint16' or 'uint32'")
    if dtype == "uint16" and tok.vocab_size > 2**16:
        raise DataError(
            f"dtype uint16 cannot hold the {tok.vocab_size} token ids of tokenizer "
            f"{tokenizer!r}; use dtype 'uint32' or 'auto'"
        )
    index_path = out_dir / INDEX_NAME
    if index_path.exists() and not overwrite:
        raise DataError(
            f"{out_dir} already holds prepared data ({INDEX_NAME}); "
            "choose another folder or pass overwrite=True"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*out_dir.glob("shard_*.bin.tmp"), out_dir / (INDEX_NAME + ".tmp")]:
        stale.unlink(missing_ok=True)  # left by an interrupted prepare

    np_dtype = DTYPES[dtype]
    writer = _ShardWriter(out_dir, np_dtype, shard_tokens)
    num_docs = 0
    try:
        for p in inputs:
            for text in _documents(p, text_key):
                ids = tok.encode(text)
                ids.append(tok.eos_id)
                writer.write(np.asarray(ids, dtype=np_dtype))
                num_docs += 1
        writer.finish()
    except BaseException:
        writer.abort()
        raise

    # Commit: drop the old index first, so no index ever points at a shard being replaced.
    index_path.unlink(missing_ok=True)
    names = set()
    for tmp, shard in zip(writer.temps, writer.shards, strict=True):
        tmp.replace(out_dir / shard["file"])
        names.add(shard["file"])
    for old in out_dir.iterdir():
        if SHARD_RE.match(old.name) and old.name not in names:
            old.unlink()
    index = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "dtype": dtype,
        "vocab_size": tok.vocab_size,
        "tokenizer": str(tokenizer),
        "eos_id": tok.eos_id,
        "num_documents": num_docs,
        "total_tokens": sum(s["num_tokens"] for s in writer.shards),
        "shards": writer.shards,
    }
    write_atomic(index_path, json.dumps(index, indent=1).encode(),
                 out_dir / (INDEX_NAME + ".tmp"))
    fsync_dir(out_dir)
    return index
