"""Documents out of the files corpora ship as: text, JSON lines (plain, gzip, zstd), parquet.

One `DocumentReader` per input file yields its documents' text in file order and counts the
bytes of the file consumed so far (compressed bytes for compressed files), for a progress
display. Every mistake in a file is a DataError naming the file, and the line or row.

Dolma-style corpora (OLMoE-mix, Dolma) name their JSON-lines shards `*.json.gz` and
`*.json.zst`; those are read as JSON lines too. A plain `.json` is not: it may be one array.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from optimus.data.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst")
SUFFIXES = (".txt", ".parquet", *JSONL_SUFFIXES)
EXTRA = "pip install 'optimus[data]'"
PARQUET_BATCH_ROWS = 1024  # rows turned into Python strings at a time: never the whole file


def input_format(path: Path) -> str | None:
    """The suffix of `path` that says how to read it (".jsonl.gz", ...), or None."""
    name = path.name.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def unknown_format(path: Path) -> DataError:
    return DataError(
        f"input file {path} has extension {path.suffix!r}, which optimus does not read; use "
        ".txt (one document per file), .jsonl / .jsonl.gz / .jsonl.zst / .json.gz / .json.zst "
        "(one JSON object per line) or .parquet (one document per row)")


class DocumentReader:
    """The documents of one input file, in order; `bytes_read` of the file so far."""

    def __init__(self, path: Path, text_key: str = "text"):
        self.path, self.text_key = Path(path), text_key
        self.format = input_format(self.path)
        if self.format is None:
            raise unknown_format(self.path)
        self.bytes_read = 0

    def __iter__(self) -> Iterator[str]:
        if self.format == ".parquet":
            yield from self._parquet()
            return
        with self.path.open("rb") as raw:
            try:
                if self.format == ".txt":
                    text = raw.read().decode("utf-8")
                    self.bytes_read = raw.tell()
                    yield text
                else:
                    yield from self._json_lines(raw)
            except UnicodeDecodeError as e:
                raise DataError(f"{self.path} is not UTF-8 text ({e.reason} at byte {e.start} "
                                "of the decompressed text); convert it to UTF-8") from e

    def _json_lines(self, raw: BinaryIO) -> Iterator[str]:
        stream, errors = self._decompressed(raw)
        lineno = 0
        try:
            with io.TextIOWrapper(stream, encoding="utf-8") as lines:
                for lineno, line in enumerate(lines, 1):  # noqa: B007 (lineno: for errors)
                    self.bytes_read = raw.tell()
                    if line.strip():
                        yield self._text(self._parse(line, lineno), lineno)
        except errors as e:
            where = f"after line {lineno}" if lineno else "from its start"
            raise DataError(f"{self.path}: the {self.format} stream is corrupt {where} ({e}); "
                            "download or copy the file again") from e
        self.bytes_read = self.path.stat().st_size

    def _decompressed(self, raw: BinaryIO) -> tuple[BinaryIO, tuple]:
        """The decompressed stream and the exceptions that mean it is corrupt."""
        if self.format.endswith(".gz"):
            return gzip.GzipFile(fileobj=raw, mode="rb"), (OSError, EOFError, zlib.error)
        if self.format.endswith(".zst"):
            try:
                import zstandard
            except ImportError as e:
                raise DataError(f"reading {self.path} needs the zstandard package; "
                                f"run: {EXTRA}") from e
            stream = io.BufferedReader(_ZstdFrames(raw, zstandard), buffer_size=1 << 20)
            return stream, (zstandard.ZstdError, OSError, EOFError)
        return raw, ()

    def _parse(self, line: str, lineno: int):
        try:
            return json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{self.path}:{lineno}: not valid JSON ({e.msg}); fix or drop "
                            "that line") from e

    def _text(self, row, lineno: int) -> str:
        key = self.text_key
        if not isinstance(row, dict) or key not in row:
            raise DataError(f"{self.path}:{lineno}: no {key!r} field; pass --text-key "
                            "(text_key=) naming the field that holds the text")
        if not isinstance(row[key], str):
            raise DataError(f"{self.path}:{lineno}: field {key!r} is "
                            f"{type(row[key]).__name__}, not a string; fix or drop that line")
        return row[key]

    def _parquet(self) -> Iterator[str]:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DataError(f"reading {self.path} needs the pyarrow package; run: {EXTRA}") from e
        try:
            pf = pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{self.path} is not a readable parquet file ({e}); download or "
                            "copy it again") from e
        key, schema = self.text_key, pf.schema_arrow
        if key not in schema.names:
            raise DataError(f"{self.path} has no column {key!r} (its columns: "
                            f"{', '.join(schema.names)}); pass --text-key naming the text column")
        kind = schema.field(key).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(f"{self.path}: column {key!r} holds {kind}, not text; pass "
                            "--text-key naming the text column")
        size, rows = self.path.stat().st_size, max(1, pf.metadata.num_rows)
        row = 0
        try:
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[key]):
                for text in batch.column(0).to_pylist():
                    row += 1
                    if text is None:
                        raise DataError(f"{self.path}: row {row} has no text (null in column "
                                        f"{key!r}); drop such rows")
                    yield text
                self.bytes_read = size * row // rows
        except pa.ArrowException as e:
            raise DataError(f"{self.path}: cannot read row group data after row {row} ({e}); "
                            "download or copy the file again") from e



class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every zstd frame of `raw` in turn (parallel compressors write
    many). zstandard's own stream reader ends quietly inside a truncated frame; this raises."""

    def __init__(self, raw: BinaryIO, zstandard):
        self._raw, self._dctx = raw, zstandard.ZstdDecompressor()
        self._frame, self._in_frame = self._dctx.decompressobj(), False
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._pos == len(self._out):
            chunk = self._raw.read(1 << 20)
            if not chunk:
                if self._in_frame:
                    raise EOFError("the file ends inside a zstd frame: it is truncated")
                return 0
            self._out, self._pos = self._decompress(chunk), 0
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = self._out[self._pos : self._pos + n]
        self._pos += n
        return n

    def _decompress(self, chunk: bytes) -> bytes:
        parts = []
        while chunk:
            self._in_frame = True
            parts.append(self._frame.decompress(chunk))
            chunk = b""
            if self._frame.eof:  # the rest of the chunk starts the next frame
                chunk = self._frame.unused_data
                self._frame, self._in_frame = self._dctx.decompressobj(), False
        return b"".join(parts)
