"""Read the token shards written by `optimus.data.prepare`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from optimus.data.errors import DataError
from optimus.data.prepare import DTYPES, FORMAT, FORMAT_VERSION, INDEX_NAME


class TokenShards:
    """All shards of one prepared folder, seen as one array of tokens."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index_path = self.path / INDEX_NAME
        if not index_path.is_file():
            raise DataError(
                f"{self.path} holds no prepared data ({INDEX_NAME} missing); "
                "run prepare on your text files first"
            )
        try:
            index = json.loads(index_path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{index_path} is not valid JSON ({e.msg}); prepare again") from e
        ours = isinstance(index, dict) and index.get("format") == FORMAT
        if not ours or index.get("version") != FORMAT_VERSION:
            raise DataError(
                f"{index_path} is not a {FORMAT} index of version {FORMAT_VERSION}; "
                "prepare the data again with this version of optimus"
            )
        self.index = index
        try:
            self.dtype = DTYPES[index["dtype"]]
            self.vocab_size = int(index["vocab_size"])
            self.eos_id = int(index["eos_id"])
            self.tokenizer = index["tokenizer"]
            self.files = [self.path / s["file"] for s in index["shards"]]
            counts = [s["num_tokens"] for s in index["shards"]]
            total = index["total_tokens"]
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{index_path} is malformed ({e!r}); prepare the data again") from e
        self.counts = np.array(counts, dtype=np.int64)
        self.ends = np.cumsum(self.counts)
        self.num_tokens = int(self.ends[-1]) if len(self.ends) else 0
        if self.num_tokens != total:
            raise DataError(f"{index_path} is inconsistent: shard sizes do not add up")
        for f, n in zip(self.files, self.counts, strict=True):
            want = int(n) * self.dtype.itemsize
            if not f.is_file():
                raise DataError(f"shard {f} listed in {index_path} is missing; prepare again")
            have = f.stat().st_size
            if have < want:
                raise DataError(
                    f"shard {f} is truncated: {have} bytes, index says {want}; prepare again"
                )
            if have != want:
                raise DataError(f"shard {f} has {have} bytes, index says {want}; prepare again")
        self._maps: list[np.memmap | None] | None = None

    def __getstate__(self) -> dict:
        # Worker processes reopen the files; never pickle mapped data.
        return {**self.__dict__, "_maps": None}

    def _open(self) -> list[np.memmap | None]:
        if self._maps is None:
            self._maps = [
                np.memmap(f, dtype=self.dtype, mode="r") if n else None
                for f, n in zip(self.files, self.counts, strict=True)
            ]
        return self._maps

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64, across shard boundaries."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(
                f"read({start}, {length}) is outside the {self.num_tokens} tokens of {self.path}"
            )
        maps = self._open()
        out = np.empty(length, dtype=np.int64)
        i = int(np.searchsorted(self.ends, start, side="right"))
        pos, filled = start, 0
        while filled < length:
            if self.counts[i] == 0:
                i += 1
                continue
            off = pos - int(self.ends[i] - self.counts[i])
            take = min(length - filled, int(self.counts[i]) - off)
            out[filled : filled + take] = maps[i][off : off + take]
            filled += take
            pos += take
            i += 1
        return out

    def verify(self) -> None:
        """Check every shard against its sha256 in the index (reads all data)."""
        for f, shard in zip(self.files, self.index["shards"], strict=True):
            h = hashlib.sha256()
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 24):
                    h.update(chunk)
            if h.hexdigest() != shard["sha256"]:
                raise DataError(f"shard {f} does not match its checksum; prepare again")
