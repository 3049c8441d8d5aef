"""Asynchronous sharded checkpoints that commit only once every rank has written.

The trainer, on every rank, in step order:

    ckpt = Checkpointer(root, rank=..., world_size=..., keep_last=..., keep_every=...)  # all ranks
    manifest = ckpt.load_latest(state)       # all ranks; None: start from scratch
    for step in ...:
        ...train one step...
        ckpt.poll()                          # all ranks, every step boundary
        if step % interval == 0:
            ckpt.save(step, state, meta)     # all ranks, same steps
    ckpt.wait(); ckpt.close()                # all ranks

`save` takes references to the state and returns: its copy into host memory runs in a
background thread behind the next step's forward and backward (staging.py), and the next
update waits for that copy (`fence`, which the trainer calls before every update; on an
accelerator only the device's update waits). The files are written in the
background too. `poll` agrees, with one tiny all-reduce while a save is in flight (none
otherwise), whether every rank's write finished; then rank 0 commits in a background thread
(hashes every file, writes the manifest, renames the marker in), applies retention and removes
partial directories. The next save starts only after that. Every decision is agreed by all
ranks, so the saver's state is the same everywhere. The loads are in loading.py.

Every collective the checkpointer runs on the caller's thread (the agreements, the load's
broadcast and DCP's collective load, a synchronous save, its process group's creation) runs
inside `collective()`, a context manager the caller supplies: the trainer marks them as the
heartbeat phase "checkpoint_sync", so that a rank hung elsewhere while its peers wait in one is
named the culprit (optimus/supervision/heartbeat.py). The staging of an asynchronous save is
this rank's own work and is not marked. (The first PROCESS-mode save also broadcasts the writer
processes' rendezvous inside `dcp.async_save`, after staging: that one is not marked.)

Where PyTorch (2.13) falls short, and what is done here:
- `dcp.async_save` returns a Future per rank and nothing else: no commit point that says every
  rank finished, no rule against overlapping saves, no cleanup of a failed one. That protocol is
  this module, on top of `manifest.commit`.
- AsyncCheckpointerType.PROCESS works on CPU with gloo (and is the default here): the writes run
  in a separate process per rank, off this process's GIL. Its limits, worked around:
  * it spawns a daemon child, which a daemonic process may not have (multiprocessing forbids
    it): ranks started as daemons, like the test harness's, fall back to THREAD (`mode_note`);
  * the child logs every request at INFO, and warns once per DTensor that its mesh's process
    groups do not exist there (thousands of lines per save); torch offers no way to stop the
    child, which then dies with a traceback when its rank exits: writer_process.py quiets it,
    and `close()` stops it (the rank's exit order is in optimus/train.py);
  * the first save also pays for the child's start (seconds: a Python with torch per rank).
- THREAD mode runs DCP's collectives on a background thread. On the default group they would
  interleave with the training loop's collectives in a different order on each rank (deadlock),
  so checkpoint I/O gets its own gloo group, as torchtitan does. The same group serves PROCESS
  mode (whose default group may also lack a CPU backend, which async_save requires) and loads.
- DCP's asynchronous staging (DefaultStager, `use_async_staging`) copies on a side stream that
  does not wait for the training stream, whose last updates may still be running, and leaves
  the fence before the next update to the caller; a stager built without it (the default)
  copies on the caller's thread into new memory every save. staging.py's `Stager` does both.
- DCP's CheckpointException derives from BaseException, not Exception; it is caught by name.
- DCP unpickles what a checkpoint holds, which can run code: TensorFileReader reads it with
  restricted unpicklers instead (safe_pickle.py), and DCP's CheckpointException around a
  refusal is unwrapped into its one line.
- DefaultLoadPlanner refuses a checkpoint that lacks any requested key. Per-rank state (RNG)
  saved by another world size lacks this rank's entry: `_Planner` skips such keys, and only those.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, StorageWriter
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from optimus.checkpoint import writer_process
from optimus.checkpoint.loading import Loading
from optimus.checkpoint.manifest import (
    apply_retention,
    clean_partial,
    commit,
    is_committed,
    step_dir,
)
from optimus.checkpoint.staging import Stager
from optimus.checkpoint.storage import TensorFileWriter
from optimus.checkpoint.trust import Trust, key_file_for

log = logging.getLogger(__name__)

Mode = Literal["process", "thread", "sync"]
_FAILURES = (Exception, CheckpointException)

# Rank 0's report on the commit (or cleanup) it runs after the writes: the MAX of all ranks'.
_BUSY, _COMMITTED, _FAILED = 1, 2, 3


WRITER_THREADS = 2


@dataclass
class CheckpointStats:
    """Counters for metrics; the same on every rank but for the two timings (this rank's)."""

    saves_started: int = 0
    saves_committed: int = 0
    saves_skipped: int = 0  # asked for while another was in flight
    saves_failed: int = 0
    last_blocked_s: float = 0.0  # how long the save held up the loop: save(), the copy's fence
    last_write_s: float = 0.0  # from save() to this rank's files written
    last_commit_step: int | None = None
    failed_in_a_row: int = 0  # failed saves since the last commit (checkpoint.max_failed_saves)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Save:
    step: int
    path: Path
    meta: dict
    started: float
    future: Future  # this rank's write
    written: float | None = None
    ok: bool | None = None  # None while writing; then whether every rank wrote
    finishing: Future | None = None  # rank 0: commit or cleanup
    error: str | None = None
    events: list[str] = field(default_factory=list)


class Checkpointer(Loading):
    """Saves `training_state` dicts under `root/step_<n>` and loads the newest good one.

    Every method but `stats`/`last_error` is collective: call it on all ranks at the same point.
    `writer(path)` may supply the DCP StorageWriter (default FileSystemWriter); `collective()`
    is entered around each collective call (see the top of this module). `trust` holds the
    run's key, which signs every commit, and what a load accepts besides what it authenticates
    (trust.py; default: the key beside `root`, and nothing else).
    """

    def __init__(self, root: str | Path, *, rank: int, world_size: int, keep_last: int = 3,
                 keep_every: int = 0, mode: Mode = "process",
                 on_overlap: Literal["skip", "wait"] = "skip",
                 writer: Callable[[Path], StorageWriter] | None = None,
                 collective: Callable[[], AbstractContextManager] = contextlib.nullcontext,
                 trust: Trust | None = None, clean: bool = True):
        if mode not in ("process", "thread", "sync"):
            raise ValueError(f"mode must be 'process', 'thread' or 'sync', not {mode!r}")
        if keep_last < 1 or keep_every < 0:
            raise ValueError(f"keep_last={keep_last} must be >= 1 and keep_every={keep_every} "
                             ">= 0 (0: none): a commit must not delete the checkpoint it made")
        if on_overlap not in ("skip", "wait"):
            raise ValueError(f"on_overlap must be 'skip' or 'wait', not {on_overlap!r}")
        self.root = Path(root)
        self.rank, self.world_size = rank, world_size
        self.keep_last, self.keep_every = keep_last, keep_every
        self.on_overlap = on_overlap
        self.collective = collective
        self.trust = trust or Trust(key_file_for(self.root))
        self._key: bytes | None = None  # rank 0's, read at its first commit
        self.stats = CheckpointStats()
        self.last_error: str | None = None
        self._failures: list[dict[str, Any]] = []  # not yet taken: see take_failures
        self.skipped: list[str] = []  # corrupt checkpoints the last load_latest passed over
        self.quarantined: list[dict] = []  # ... and set aside (quarantine.py): step, path, reason
        # Two writer threads: one file per thread, so the write and the commit's hashing
        # (per file) are not held to one core.
        self._writer = writer or (lambda path: TensorFileWriter(path, overwrite=False,
                                                                thread_count=WRITER_THREADS))
        self._stager: Stager | None = None  # the asynchronous modes' copy into host memory
        self._inflight: _Save | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-commit")

        distributed = dist.is_available() and dist.is_initialized()
        if distributed and dist.get_world_size() != world_size:
            raise ValueError(f"world_size={world_size} but the process group has "
                             f"{dist.get_world_size()} ranks")
        self._collective = distributed and world_size > 1
        self._io_group = None
        if distributed:
            with collective():
                self._io_group = dist.new_group(backend="gloo")
        self._device = _collective_device() if self._collective else torch.device("cpu")

        self.mode, self.mode_note = mode, None
        if mode == "process" and not distributed:
            self.mode, self.mode_note = "thread", "no process group: PROCESS mode needs one"
        elif mode == "process" and multiprocessing.current_process().daemon:
            self.mode, self.mode_note = "thread", (
                "this rank is a daemonic process, which may not start DCP's writer process")
        if self.mode == "process":
            writer_process.install()
        if self.mode != "sync":  # into shared memory for the writer process, which reads it there
            self._stager = Stager(shared=self.mode == "process")
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if clean:  # not where another world may be saving now (a replica rejoining)
                clean_partial(self.root)  # saves a crashed generation never finished

    # --- saving --------------------------------------------------------------------------------

    def save(self, step: int, state: dict, meta: dict) -> str:
        """Start saving `state` as step `step`: "started", "waited" (for the previous save,
        then started), "skipped" (one is in flight), "exists" (already committed) or, in sync
        mode, "committed" / "failed". `meta` (JSON) goes into the manifest."""
        began = time.perf_counter()
        outcome = "started"
        self.poll()
        if self._inflight is not None:
            if self.on_overlap == "skip":
                self.stats.saves_skipped += 1
                log.info("checkpoint of step %d skipped: step %d is still being saved",
                         step, self._inflight.step)
                return "skipped"
            self.wait()
            outcome = "waited"
        path = step_dir(self.root, step)
        exists = 0
        if self.rank == 0:
            if is_committed(path):
                exists = 1
            elif path.exists():
                shutil.rmtree(path)  # a save of this step that never finished
        if self._agree([exists])[0]:
            return "exists"

        future = self._start(path, state)
        save = _Save(step, path, {**meta, "step": step}, began, future)
        future.add_done_callback(lambda _: setattr(save, "written", time.perf_counter()))
        self._inflight = save
        self.stats.saves_started += 1
        if self.mode == "sync":
            outcome = self.wait() or outcome
        self.stats.last_blocked_s = time.perf_counter() - began
        return outcome

    def _start(self, path: Path, state: dict) -> Future:
        future: Future = Future()
        try:
            writer = self._writer(path)
            if self.mode == "sync":
                with self.collective():
                    dcp.save(state, storage_writer=writer, process_group=self._io_group)
                future.set_result(None)
                return future
            kind = (AsyncCheckpointerType.PROCESS if self.mode == "process"
                    else AsyncCheckpointerType.THREAD)
            response = dcp.async_save(state, storage_writer=writer, process_group=self._io_group,
                                      async_checkpointer_type=kind, async_stager=self._stager)
            return getattr(response, "upload_completion", response)
        except _FAILURES as e:  # staging failed: the save fails like a failed write
            future.set_exception(e)
            return future

    def fence(self) -> None:
        """Before the saved state changes: the copy the last save took of it is done (on an
        accelerator: the device's next work waits for it, the host only for it to be queued).
        The trainer calls it before every update (optimus/boundary.py `before_update`), and so
        must anything else that changes the state in place between a save and the next update.
        This rank's own; its wait counts in `stats.last_blocked_s`; free when no copy is
        pending."""
        if self._stager is not None:
            self.stats.last_blocked_s += self._stager.fence()

    def poll(self) -> str | None:
        """Advance the save in flight without waiting: "committed", "failed" or None.

        Collective while a save is in flight (one all-reduce of three integers); free when none.
        """
        save = self._inflight
        if save is None:
            return None
        if save.ok is None:
            done = save.future.done()
            failed = done and save.future.exception() is not None
            pending, failed_anywhere, _ = self._agree([int(not done), int(failed), 0])
            if pending:
                return None
            save.ok = not failed_anywhere
            if not save.ok:
                save.error = self._write_error(save)
            if self.rank == 0:
                save.finishing = self._pool.submit(self._finish, save)
            return None
        (_, _, report) = self._agree([0, 0, self._finish_report(save)])
        if report == _BUSY:
            return None
        return self._conclude(save, report == _COMMITTED)

    def wait(self) -> str | None:
        """Block until the save in flight is committed or failed; what became of it."""
        self.fence()
        event = None
        while self._inflight is not None:
            save = self._inflight
            if save.ok is None:
                concurrent.futures.wait([save.future])
            elif save.finishing is not None:
                concurrent.futures.wait([save.finishing])
            event = self.poll() or event
        return event

    def abandon(self) -> None:
        """Stop without committing the save in flight: training stops on evidence that its
        state may be wrong. Every rank calls it at the same point, like every method here.
        Each waits for its own write (its collectives need every rank), and nothing is
        committed: the folder stays uncommitted, removed as partial when the next job starts.
        A commit already running on rank 0 (every rank had written) still lands."""
        self.fence()
        save, self._inflight = self._inflight, None
        if save is not None and save.ok is None:
            concurrent.futures.wait([save.future])
            log.warning("checkpoint of step %d abandoned, not committed", save.step)

    def drop(self) -> None:
        """The generation ended under it (a peer died; the rank goes on in process): stop
        without waiting for anything that needs the peers. The save in flight is left
        uncommitted (the next generation's rank 0 removes it as partial), a commit not yet
        begun is cancelled, and DCP's writer process stops."""
        save, self._inflight = self._inflight, None
        if save is not None:
            log.warning("checkpoint of step %d dropped with its generation", save.step)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.mode == "process":
            writer_process.stop(kill=True)
        self._release_stager()

    def close(self) -> None:
        """Finish the save in flight, then stop, in this order, the commit thread and DCP's
        writer process (PROCESS mode: the rank's one, whichever checkpointer started it), and
        free the host buffers the saves were staged into. Nothing of the checkpointer runs
        after it; call it before the process group is destroyed."""
        self.wait()
        self._pool.shutdown(wait=True)
        if self.mode == "process":
            writer_process.stop()
        self._release_stager()

    def _release_stager(self) -> None:
        """Free the host buffers (the copy in flight, this rank's own work, finishes first)."""
        if self._stager is not None:
            self.fence()
            self._stager.release()
            self._stager = None

    def _agree(self, values: list[int]) -> list[int]:
        """Element-wise MAX over all ranks."""
        if not self._collective:
            return values
        tensor = torch.tensor(values, dtype=torch.int64, device=self._device)
        with self.collective():
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            return tensor.tolist()

    def _finish_report(self, save: _Save) -> int:
        if self.rank != 0:
            return 0
        if save.finishing is None or not save.finishing.done():
            return _BUSY
        return _COMMITTED if save.finishing.result() else _FAILED

    def _finish(self, save: _Save) -> bool:
        """Rank 0, in the background: commit a complete save, or remove a failed one."""
        if not save.ok:
            shutil.rmtree(save.path, ignore_errors=True)
            return False
        try:
            if self._key is None:
                self._key = self.trust.signing_key()
            commit(save.path, save.meta, key=self._key)
        except (OSError, ValueError) as e:
            save.error = f"commit of step {save.step} failed: {_one_line(e)}"
            shutil.rmtree(save.path, ignore_errors=True)
            return False
        try:
            apply_retention(self.root, self.keep_last, self.keep_every)
            clean_partial(self.root)
        except OSError as e:  # the new checkpoint is committed all the same
            save.events.append(f"retention after step {save.step} failed: {_one_line(e)}")
        return True

    def _conclude(self, save: _Save, committed: bool) -> str:
        self._inflight = None
        if save.future.done():  # its done-callback may not have run yet when wait() woke
            written = save.written if save.written is not None else time.perf_counter()
            self.stats.last_write_s = written - save.started
        for note in save.events:
            log.warning(note)
        if committed:
            self.stats.saves_committed += 1
            self.stats.last_commit_step = save.step
            self.stats.failed_in_a_row = 0
            return "committed"
        self.stats.saves_failed += 1
        self.stats.failed_in_a_row += 1
        self.last_error = save.error or (
            f"checkpoint of step {save.step} was not committed (rank 0 has the reason)")
        log.warning("%s; the latest committed checkpoint is unchanged", self.last_error)
        self._failures.append({"message": self.last_error, **self.stats.as_dict()})
        return "failed"

    def take_failures(self) -> list[dict[str, Any]]:
        """The saves that failed since the last call, oldest first: their error ("message")
        and the stats as they were when each failed (failed_in_a_row: its place in the
        streak). Each once. A save may end inside another call (the next save's poll or wait),
        whose return value speaks of the new save: this is how its failure is still told."""
        failures, self._failures = self._failures, []
        return failures

    @staticmethod
    def _write_error(save: _Save) -> str:
        if not save.future.done() or save.future.exception() is None:
            return f"checkpoint of step {save.step}: another rank's write failed"
        exc = save.future.exception()
        if isinstance(exc, CheckpointException) and exc.failures:
            ranks = sorted(exc.failures)
            first, _ = exc.failures[ranks[0]]
            return (f"checkpoint of step {save.step}: write failed on rank(s) {ranks}: "
                    f"{_one_line(first)}")
        return f"checkpoint of step {save.step}: write failed: {_one_line(exc)}"


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text.splitlines()[0] if text else type(exc).__name__


def _collective_device() -> torch.device:
    """Where the default group reduces: the accelerator when it has one, else the CPU."""
    backend = str(dist.get_backend())
    if backend == "gloo" or not torch.accelerator.is_available():
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, torch.accelerator.current_device_index())
