"""One input file -> its own token shards: the unit of work, of parallelism and of resume.

Input number i (in sorted input order) becomes `shard_<i>_<j>.bin` (j = 0, 1, ... every
`shard_tokens` tokens) in the output folder, and its held-out documents the same names under
`holdout/`. The shards are written as `.tmp` files, fsynced, renamed into place, and only then
is the input recorded as done in `done/<i>.json` (atomically). An input without a done record
is redone from its start by the next prepare; one with a record is never touched again.
The bytes depend only on the input and the settings, so any worker count writes the same.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from optimus.data.readers import DocumentReader
from optimus.data.tokenizer import load_tokenizer
from optimus.files import fsync_path, write_atomic

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
HOLDOUT_DIR = "holdout"
DONE_DIR = "done"
BATCH_DOCS, BATCH_CHARS = 1024, 1 << 22  # documents tokenized together (encode_batch)
_HOLDOUT_SALT = b"optimus-holdout"

Report = Callable[[int, int, int], None]  # (documents, tokens, bytes read) since last call


@dataclass(frozen=True)
class Settings:
    """What decides the bytes written: a resumed prepare must be given the same."""

    tokenizer: str
    dtype: str
    shard_tokens: int
    text_key: str
    holdout: float  # fraction of documents set aside, chosen by a hash of their text


def shard_name(i: int, j: int) -> str:
    return f"shard_{i:05d}_{j:04d}.bin"


def done_path(out_dir: Path, i: int) -> Path:
    return out_dir / DONE_DIR / f"{i:05d}.json"


def held_out(text: bytes, fraction: float) -> bool:
    """Whether a document is set aside: a keyed hash of its bytes below `fraction`. Hashing
    the text (not its position) keeps exact duplicates on one side and needs no count."""
    if fraction <= 0:
        return False
    h = hashlib.blake2b(text, digest_size=8, person=_HOLDOUT_SALT).digest()
    return int.from_bytes(h, "little") < fraction * 2**64


class ShardWriter:
    """Appends tokens to `<prefix>_<j>.bin.tmp` files of at most `shard_tokens` tokens each."""

    def __init__(self, out_dir: Path, i: int, dtype: np.dtype, shard_tokens: int):
        self.out_dir, self.i, self.dtype, self.shard_tokens = out_dir, i, dtype, shard_tokens
        self.shards: list[dict] = []
        self._f = None

    def _close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        self.shards.append({"file": shard_name(self.i, len(self.shards)),
                            "num_tokens": self._count, "sha256": self._hash.hexdigest()})

    def write(self, tokens: np.ndarray) -> None:
        pos = 0
        while pos < len(tokens):
            if self._f is None:
                tmp = self.out_dir / (shard_name(self.i, len(self.shards)) + ".tmp")
                self._f, self._hash, self._count = tmp.open("wb"), hashlib.sha256(), 0
            take = min(len(tokens) - pos, self.shard_tokens - self._count)
            chunk = tokens[pos : pos + take]
            chunk.tofile(self._f)
            self._hash.update(chunk.tobytes())
            self._count += take
            pos += take
            if self._count == self.shard_tokens:
                self._close()

    def commit(self) -> list[dict]:
        """Close the last shard and rename every shard into place."""
        if self._f is not None:
            self._close()
        for shard in self.shards:
            name = shard["file"]
            os.replace(self.out_dir / (name + ".tmp"), self.out_dir / name)
        if self.shards:
            fsync_path(self.out_dir)
        return self.shards

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
        for j in range(len(self.shards) + 1):
            (self.out_dir / (shard_name(self.i, j) + ".tmp")).unlink(missing_ok=True)


_tokenizers: dict[str, object] = {}  # one per worker process, loaded on its first input


def prepare_file(i: int, path: Path, out_dir: Path, settings: Settings,
                 report: Report | None = None) -> dict:
    """Tokenize input `i` into its shards, record it as done, return the record."""
    tok = _tokenizers.get(settings.tokenizer)
    if tok is None:
        tok = _tokenizers[settings.tokenizer] = load_tokenizer(settings.tokenizer)
    dtype = DTYPES[settings.dtype]
    writers = [ShardWriter(out_dir, i, dtype, settings.shard_tokens)]
    if settings.holdout > 0:
        writers.append(ShardWriter(out_dir / HOLDOUT_DIR, i, dtype, settings.shard_tokens))
    reader = DocumentReader(path, settings.text_key)
    counts = [0, 0]  # documents written by each writer
    reported = 0
    try:
        batch: list[str] = []
        chars = 0
        for text in reader:
            batch.append(text)
            chars += len(text)
            if len(batch) >= BATCH_DOCS or chars >= BATCH_CHARS:
                docs, tokens = _write_batch(tok, batch, writers, counts, settings.holdout, dtype)
                if report:
                    report(docs, tokens, reader.bytes_read - reported)
                    reported = reader.bytes_read
                batch, chars = [], 0
        docs, tokens = _write_batch(tok, batch, writers, counts, settings.holdout, dtype)
        if report:
            report(docs, tokens, reader.bytes_read - reported)
        shards = [w.commit() for w in writers]
    except BaseException:
        for w in writers:
            w.abort()
        raise
    record = {"input": str(path), "size": path.stat().st_size, "settings": asdict(settings),
              "documents": counts[0], "shards": shards[0]}
    if settings.holdout > 0:
        record.update(holdout_documents=counts[1], holdout_shards=shards[1])
    done = done_path(out_dir, i)
    write_atomic(done, json.dumps(record, indent=1).encode(), done.with_suffix(".tmp"))
    fsync_path(done.parent)
    return record


def _write_batch(tok, texts: list[str], writers: list[ShardWriter], counts: list[int],
                 holdout: float, dtype: np.dtype) -> tuple[int, int]:
    """Encode `texts`, eos after each, and append them to the training or holdout shards."""
    if not texts:
        return 0, 0
    encoded = tok.encode_batch(texts)
    side = ([held_out(t.encode("utf-8"), holdout) for t in texts] if holdout > 0
            else [False] * len(texts))
    tokens = 0
    for dest, writer in enumerate(writers):
        docs = [ids for ids, s in zip(encoded, side, strict=True) if s == bool(dest)]
        if not docs:
            continue
        lengths = np.array([len(d) + 1 for d in docs])
        out = np.empty(int(lengths.sum()), dtype=dtype)
        pos = 0
        for ids, n in zip(docs, lengths, strict=True):
            out[pos : pos + n - 1] = ids
            pos += n
            out[pos - 1] = tok.eos_id
        writer.write(out)
        counts[dest] += len(docs)
        tokens += len(out)
    return len(texts), tokens
