"""Turn corpora into token shards: raw little-endian arrays plus an index.json.

Layout of `out_dir`:
    prepare.json               the settings and the sorted input list, written first
    shard_<i>_<j>.bin          tokens of input i (sorted order), documents each followed by eos
    done/<i>.json              input i is finished: its shards, sizes and checksums
    holdout/                   with a holdout: the documents set aside, the same format
    index.json                 written last; a folder without it holds no usable data

Inputs are spread over worker processes one file at a time (`prepare_file.py`). A prepare
that dies is run again with the same arguments: it keeps every input already done and redoes
the others. The result does not depend on the number of workers.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from optimus.data.errors import DataError
from optimus.data.prepare_file import (
    DONE_DIR,
    DTYPES,
    HOLDOUT_DIR,
    Settings,
    done_path,
    prepare_file,
)
from optimus.data.progress import PrepareProgress
from optimus.data.readers import SUFFIXES, input_format, unknown_format
from optimus.data.tokenizer import load_tokenizer
from optimus.files import fsync_path, write_atomic

__all__ = ["DTYPES", "FORMAT", "FORMAT_VERSION", "INDEX_NAME", "expand_inputs", "prepare"]

FORMAT = "optimus-tokens"
FORMAT_VERSION = 1  # index.json; readers ignore keys they do not know
INDEX_NAME = "index.json"
PLAN_NAME = "prepare.json"
LOCK_NAME = ".prepare.lock"
LOCK_WAIT_S = 10.0  # a killed prepare's workers are gone within this


def expand_inputs(inputs: list[Path | str]) -> list[Path]:
    """Files, folders (every readable file below, recursively) and glob patterns -> the sorted
    list of input files, each once."""
    files: set[Path] = set()
    for spec in map(str, inputs):
        path = Path(spec)
        if path.is_dir():
            found = [p for p in path.rglob("*") if p.is_file() and input_format(p)
                     and not p.name.startswith(".")]
            if not found:
                raise DataError(f"folder {path} holds no file optimus reads "
                                f"({', '.join(SUFFIXES)})")
        elif path.is_file():
            if not input_format(path):
                raise unknown_format(path)
            found = [path]
        elif glob.has_magic(spec):
            found = [Path(p) for p in glob.glob(spec, recursive=True)
                     if Path(p).is_file() and input_format(Path(p))]
            if not found:
                raise DataError(f"pattern {spec!r} matches no file optimus reads")
        else:
            raise DataError(f"input file {path} does not exist")
        files.update(p.resolve() for p in found)
    if not files:
        raise DataError("no input files given; name files, folders or glob patterns")
    return sorted(files, key=str)


def prepare(
    inputs: list[Path | str],
    out_dir: Path | str,
    tokenizer: str = "byte",
    dtype: str = "auto",
    shard_tokens: int = 2**26,
    text_key: str = "text",
    overwrite: bool = False,
    workers: int | None = 1,
    holdout: float = 0.0,
    progress: bool = False,
) -> dict:
    """Tokenize `inputs` into shards under `out_dir`; returns the index written.

    `workers`: processes (None: one per CPU), never more than the inputs. `holdout`: the
    fraction of documents set aside in `out_dir/holdout/`. `progress`: draw on stderr."""
    out_dir = Path(out_dir)
    files = expand_inputs(inputs)
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be at least 1, got {shard_tokens}")
    if not 0 <= holdout < 1:
        raise DataError(f"holdout is the fraction of documents set aside, in [0, 1); got "
                        f"{holdout}")
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
    settings = Settings(str(tokenizer), dtype, shard_tokens, text_key, float(holdout))
    plan = {"format": "optimus-prepare", "version": 1, **settings.__dict__,
            "tokenizer_fingerprint": tok.fingerprint, "inputs": [str(f) for f in files]}
    out_dir.mkdir(parents=True, exist_ok=True)
    with _locked(out_dir):
        finished = _start(out_dir, plan, overwrite)
        if finished is not None:
            return finished
        records = _run(files, out_dir, settings, workers, progress)
        return _write_indexes(out_dir, plan, records, tok)


@contextlib.contextmanager
def _locked(out_dir: Path) -> Iterator[None]:
    """One prepare per folder. The workers hold the lock too (shared), so a rerun also waits
    for the workers of a killed prepare to be gone."""
    with (out_dir / LOCK_NAME).open("a+") as f:
        if not _acquire(f, out_dir):  # a file system without locks (Lustre without flock)
            yield
            return
        fcntl.flock(f, fcntl.LOCK_SH)  # let our own workers share it
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _acquire(f, out_dir: Path) -> bool:
    """Take the lock alone, waiting a while; False where the file system has no locks."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise DataError(f"another `optimus data prepare` is writing to {out_dir}; "
                                "wait for it to finish, or stop it and run again") from None
            time.sleep(0.1)
        except OSError:
            return False


def _start(out_dir: Path, plan: dict, overwrite: bool) -> dict | None:
    """Refuse a folder prepared (or being prepared) otherwise; clean it on `overwrite`; write
    the plan. Returns the index when the folder already holds exactly this result."""
    plan_path, index_path = out_dir / PLAN_NAME, out_dir / INDEX_NAME
    old = _read_json(plan_path) if plan_path.is_file() else None
    nothing_done = not index_path.exists() and not any((out_dir / DONE_DIR).glob("*.json"))
    if overwrite or (old is not None and nothing_done):  # nothing to keep: start afresh
        _clear(out_dir)
        old = None
    elif old is None and index_path.exists():
        raise DataError(f"{out_dir} already holds prepared data ({INDEX_NAME}) from an earlier "
                        "prepare; choose another folder or pass --overwrite (overwrite=True)")
    elif old is not None and old != plan:
        what = _differences(old, plan)
        state = "already holds prepared data" if index_path.exists() else "was being prepared"
        raise DataError(f"{out_dir} {state} with other arguments ({what}); run again with "
                        "the same arguments to continue, or pass --overwrite (overwrite=True) "
                        "to start over")
    elif old is not None and index_path.exists():
        return _read_json(index_path)
    if old is None:
        write_atomic(plan_path, json.dumps(plan, indent=1).encode(), out_dir / "prepare.tmp")
    return None


def _differences(old: dict, new: dict) -> str:
    keys = [k for k in new if k != "inputs" and old.get(k) != new[k]]
    if "tokenizer" in keys:  # its fingerprint differs too; the name says enough
        keys.remove("tokenizer_fingerprint")
    parts = [f"{k} {old.get(k)!r} then, {new[k]!r} now" for k in keys]
    before, now = set(old.get("inputs", [])), set(new["inputs"])
    added, gone = sorted(now - before), sorted(before - now)
    changes = []
    if added:
        changes.append(f"{len(added)} new, e.g. {added[0]}")
    if gone:
        changes.append(f"{len(gone)} no longer given, e.g. {gone[0]}")
    if changes:
        parts.append("inputs: " + ", ".join(changes))
    return "; ".join(parts)


def _clear(out_dir: Path) -> None:
    """Delete what a prepare wrote into `out_dir` (and nothing else), the index first."""
    for d in (out_dir, out_dir / HOLDOUT_DIR):
        (d / INDEX_NAME).unlink(missing_ok=True)
    for d in (out_dir, out_dir / HOLDOUT_DIR):
        if d.is_dir():
            for p in d.glob("shard_*.bin*"):
                p.unlink()
    shutil.rmtree(out_dir / DONE_DIR, ignore_errors=True)
    (out_dir / PLAN_NAME).unlink(missing_ok=True)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is unreadable ({e}); pass --overwrite to prepare again") from e


def _kept_records(files: list[Path], out_dir: Path, settings: Settings) -> dict[int, dict]:
    """The done records still good: same input, same size, shards all there. Every shard file
    not in one of them is left over from an interrupted input and is deleted."""
    item = DTYPES[settings.dtype].itemsize
    kept, keep_files = {}, set()
    for i, path in enumerate(files):
        done = done_path(out_dir, i)
        if not done.is_file():
            continue
        rec = _read_json(done)
        where = [(out_dir, rec.get("shards", []))]
        if settings.holdout > 0:
            where.append((out_dir / HOLDOUT_DIR, rec.get("holdout_shards", [])))
        good = (rec.get("input") == str(path) and rec.get("size") == path.stat().st_size
                and rec.get("settings") == settings.__dict__
                and all((d / s["file"]).is_file()
                        and (d / s["file"]).stat().st_size == s["num_tokens"] * item
                        for d, shards in where for s in shards))
        if good:
            kept[i] = rec
            keep_files.update(d / s["file"] for d, shards in where for s in shards)
        else:
            done.unlink()
    for d in (out_dir, out_dir / HOLDOUT_DIR):
        if d.is_dir():
            for p in d.glob("shard_*.bin*"):
                if p not in keep_files:
                    p.unlink()
    return kept


def _run(files: list[Path], out_dir: Path, settings: Settings, workers: int | None,
         show: bool) -> list[dict]:
    """Prepare every input not done yet; the records of all of them, in input order."""
    (out_dir / DONE_DIR).mkdir(exist_ok=True)
    if settings.holdout > 0:
        (out_dir / HOLDOUT_DIR).mkdir(exist_ok=True)
    records = _kept_records(files, out_dir, settings)
    sizes = [f.stat().st_size for f in files]
    display = PrepareProgress(len(files), sum(sizes), show)
    try:
        if records:
            display.note(f"resuming: {len(records)} of {len(files)} input files already done")
        for i, rec in records.items():
            display.file_done(i, sizes[i], rec["documents"] + rec.get("holdout_documents", 0),
                              _tokens(rec))
        todo = [i for i in range(len(files)) if i not in records]
        n = min(workers or os.cpu_count() or 1, len(todo))
        if n <= 1:
            for i in todo:
                records[i] = prepare_file(i, files[i], out_dir, settings,
                                          lambda d, t, b, i=i: display.add(i, d, t, b))
                display.file_done(i, sizes[i])
        else:
            from optimus.data.prepare_pool import run_pool

            records.update(run_pool(todo, files, out_dir, settings, n, display, sizes,
                                    out_dir / LOCK_NAME))
    finally:
        display.close()
    return [records[i] for i in range(len(files))]


def _tokens(record: dict) -> int:
    shards = record["shards"] + record.get("holdout_shards", [])
    return sum(s["num_tokens"] for s in shards)


def _write_indexes(out_dir: Path, plan: dict, records: list[dict], tok) -> dict:
    """The holdout's index, then the training index: the commit of the whole prepare."""
    common = {"format": FORMAT, "version": FORMAT_VERSION, "dtype": plan["dtype"],
              "vocab_size": tok.vocab_size, "tokenizer": plan["tokenizer"],
              "tokenizer_fingerprint": plan["tokenizer_fingerprint"], "eos_id": tok.eos_id,
              "inputs": len(records)}
    index = {**common, **_totals(records, "documents", "shards")}
    if plan["holdout"] > 0:
        held = {**common, **_totals(records, "holdout_documents", "holdout_shards"),
                "holdout": {"fraction": plan["holdout"], "of": ".."}}
        index["holdout"] = {"fraction": plan["holdout"], "folder": HOLDOUT_DIR,
                            "num_documents": held["num_documents"]}
        _write_index(out_dir / HOLDOUT_DIR, held)
    _write_index(out_dir, index)
    return index


def _totals(records: list[dict], docs_key: str, shards_key: str) -> dict:
    shards = [s for r in records for s in r[shards_key]]
    return {"num_documents": sum(r[docs_key] for r in records),
            "total_tokens": sum(s["num_tokens"] for s in shards), "shards": shards}


def _write_index(folder: Path, index: dict) -> None:
    write_atomic(folder / INDEX_NAME, json.dumps(index, indent=1).encode(),
                 folder / (INDEX_NAME + ".tmp"))
    fsync_path(folder)
