"""Inputs spread over worker processes, each reporting its progress back as it goes.

Workers are spawned, not forked: the parent may hold a Rust tokenizer's threads, which do not
survive a fork. Each worker dies with its parent (Linux: PR_SET_PDEATHSIG) and holds the
output folder's lock shared, so a rerun after a kill never races a leftover worker.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import multiprocessing
import os
import queue as queues
import signal
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

from optimus.data.prepare_file import Settings, prepare_file
from optimus.data.progress import PrepareProgress

_PR_SET_PDEATHSIG = 1
_reports = None  # this worker's queue to the parent
_lock = None  # this worker's shared hold on the output folder's lock


def run_pool(todo: list[int], files: list[Path], out_dir: Path, settings: Settings,
             workers: int, display: PrepareProgress, sizes: list[int],
             lock_path: Path) -> dict[int, dict]:
    """Prepare inputs `todo` on `workers` processes; their records by input number. On the
    first failure the inputs not started are dropped, the ones running finish (their work is
    kept for the next run), and the failure is raised."""
    ctx = multiprocessing.get_context("spawn")
    reports = ctx.Queue()
    records: dict[int, dict] = {}
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start_worker,
                               initargs=(str(lock_path), reports, os.getpid()))
    try:
        futures = {pool.submit(_work, i, files[i], out_dir, settings): i for i in todo}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(reports, display)
            for future in finished:
                i = futures[future]
                records[i] = future.result()
                display.file_done(i, sizes[i])
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        reports.close()
    return records


def _drain(reports, display: PrepareProgress) -> None:
    while True:
        try:
            display.add(*reports.get_nowait())
        except queues.Empty:
            return


def _start_worker(lock_path: str, reports, parent: int) -> None:
    global _reports, _lock
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before we could ask to follow it
        os._exit(1)
    _lock = open(lock_path, "a+")  # noqa: SIM115 (held for the worker's life)
    with contextlib.suppress(OSError):  # no locks on this file system: PDEATHSIG must do
        fcntl.flock(_lock, fcntl.LOCK_SH)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: N workers, N cores
    _reports = reports


def _work(i: int, path: Path, out_dir: Path, settings: Settings) -> dict:
    return prepare_file(i, path, out_dir, settings,
                        lambda docs, tokens, nbytes: _reports.put((i, docs, tokens, nbytes)))

