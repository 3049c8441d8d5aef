"""Run a function on N real processes joined by a gloo process group.

`run_ranks(fn, world_size, *args, timeout=...)` starts one process per rank, each of which
builds its LaunchEnv from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, calls init_distributed
with gloo on cpu, runs `fn(rank, world_size, *args)` and sends back its result. `fn` must be
a module-level function and its arguments and result picklable. Processes come from a
forkserver that has imported torch and the trainer once, so starting a rank costs a fork, not
seconds of imports.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from optimus.supervision.ports import unclaimed_port

# Launcher variables a child must not inherit: they would outrank or contradict RANK/WORLD_SIZE.
_INHERITED = ("OPTIMUS_", "SLURM_", "PALS_", "PMIX_", "PMI_", "OMPI_", "TORCHELASTIC_", "GROUP_")
_GRACE_S = 2.0  # after the first failure, how long to collect the others before killing


class RanksFailed(AssertionError):
    """One or more ranks raised, died or hung."""


class RanksTimedOut(RanksFailed):
    """Some ranks had not finished when the timeout ran out; they were killed."""


def free_port() -> int:
    """A TCP port free a moment ago, below the kernel's ephemeral range: no connection the
    machine opens meanwhile takes it before the server meant for it (rank 0's store after a
    fork, a Redis, an agent) binds it, however loaded the machine (optimus/supervision/ports.py)."""
    return unclaimed_port("127.0.0.1")


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range, read here (not from
    optimus/supervision/ports.py, whose choice the tests check against it)."""
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    # Everything a rank imports (torch, its distributed stack, the trainer): a rank then starts
    # as a fork, without seconds of imports of its own. The trainer itself leaves dynamo out
    # (a rank that neither compiles nor pipelines never pays for it), but the suite's many
    # pipelined and compiled ranks would each import it again: ~0.6 s of CPU a rank.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "optimus.runtime",
                                "optimus.train"])
    return ctx


def _last_words(port: int, rank: int, parent: int | None = None) -> Path:
    """Where rank `rank` of the run on `port` started by process `parent` (this one) writes its
    stacks if it dies of a signal."""
    parent = os.getpid() if parent is None else parent
    return Path(tempfile.gettempdir()) / f"optimus-ranks-{parent}-{port}-{rank}.stacks"


def _child(fn: Callable, rank: int, world_size: int, args: tuple, port: int, results,
           parent: int) -> None:
    # A rank killed by SIGABRT, SIGSEGV, SIGBUS or SIGFPE (a native crash) leaves its Python
    # stacks here, and the parent adds them to the failure: "exited with code -6" alone says
    # nothing about where.
    faulthandler.enable(file=open(_last_words(port, rank, parent), "w"),  # noqa: SIM115
                        all_threads=True)
    for name in [n for n in os.environ if n.startswith(_INHERITED)]:
        del os.environ[name]
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    try:
        import torch

        from optimus.runtime import destroy_distributed, init_distributed, launch_env

        torch.set_num_threads(1)
        init_distributed(launch_env(), "gloo", torch.device("cpu"), timeout_s=120)
        # Every rank's gloo mesh is whole before any rank goes on: a rank whose `fn` returns at
        # once would otherwise tear its connections down while a slower peer (a loaded
        # machine) is still connecting to it ("Connection closed by peer" in connectFullMesh).
        torch.distributed.barrier()
        payload = pickle.dumps(fn(rank, world_size, *args))  # an unpicklable result fails here
        destroy_distributed()
        results.put((rank, True, payload, time.time()))
    except BaseException:
        # The time orders failures: the first one usually caused the others.
        results.put((rank, False, traceback.format_exc(), time.time()))


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 60.0) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; results indexed by rank.

    Raises RanksFailed with the full traceback of every rank that raised (or the exit code
    of one that died), and RanksTimedOut naming the ranks still running at the timeout.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, rank, world_size, args, port, results, os.getpid()),
                    daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    board = _Board()
    deadline = time.monotonic() + timeout
    give_up_at = float("inf")  # once a rank failed: a short grace to collect the others
    try:
        while len(board.done) + len(board.errors) < world_size:
            now = time.monotonic()
            if now > give_up_at:
                break
            if now > deadline:
                running = [r for r in range(world_size) if not board.has(r)]
                raise RanksTimedOut(
                    f"ranks {running} of {world_size} did not finish within {timeout:g} s "
                    f"and were killed (finished: {sorted(board.done)})" + board.describe()
                )
            board.read(results, timeout=0.05)
            for rank, proc in enumerate(procs):
                if not board.has(rank) and proc.exitcode is not None:
                    board.read(results, timeout=0.5, until=rank)  # its message may be in flight
                    if not board.has(rank):
                        board.fail(rank, f"rank {rank} exited with code {proc.exitcode}"
                                   + _read_words(_last_words(port, rank)))
            if board.errors:
                give_up_at = min(give_up_at, now + _GRACE_S)
        if board.errors:
            raise RanksFailed(
                f"{len(board.errors)} of {world_size} ranks failed" + board.describe()
            )
        return [pickle.loads(board.done[rank]) for rank in range(world_size)]
    finally:
        _stop(procs, grace_s=0.0 if board.errors or len(board.done) < world_size else _GRACE_S)
        results.close()
        for rank in range(world_size):
            _last_words(port, rank).unlink(missing_ok=True)


def _read_words(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")[-20_000:]
    except OSError:
        return ""
    return f"; its last stacks (faulthandler):\n{text}" if text.strip() else ""


class _Board:
    """What the ranks have reported: pickled results, and failures with their times."""

    def __init__(self) -> None:
        self.done: dict[int, bytes] = {}
        self.errors: dict[int, tuple[float, str]] = {}

    def has(self, rank: int) -> bool:
        return rank in self.done or rank in self.errors

    def fail(self, rank: int, text: str, when: float | None = None) -> None:
        self.errors[rank] = (time.time() if when is None else when, text)

    def read(self, results, timeout: float, until: int | None = None) -> None:
        end = time.monotonic() + timeout
        while True:
            try:
                rank, ok, value, when = results.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                return
            if ok:
                self.done[rank] = value
            else:
                self.fail(rank, value, when)
            if until is None or rank == until:
                return

    def describe(self) -> str:
        """Failures in the order they happened: the first usually caused the others."""
        ordered = sorted(self.errors.items(), key=lambda item: item[1][0])
        return "".join(f"\n\n--- rank {rank} ---\n{text}" for rank, (_, text) in ordered)


def _stop(procs: list, grace_s: float) -> None:
    end = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
    for proc in procs:
        proc.join()
