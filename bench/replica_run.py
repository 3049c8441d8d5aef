"""A controller's part, for tests/test_replicas.py and bench/replicas.py: the replicas'
processes (bench/replica_rank.py), the store their quorum groups meet at, the quorum file,
written as the controller writes it (a `Quorum` record, replaced whole)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from optimus.contract.records import Quorum

ROOT = Path(__file__).resolve().parent.parent


class Run:
    """The replicas' processes, their quorum file and store, as a controller would hold them."""

    def __init__(self, tmp: Path, steps: int, step_s: float = 0.0, timeout_s: float = 60.0,
                 shard: int = 1, args: tuple[str, ...] = ()):
        self.args = args  # for every rank (bench/replica_rank.py's options)
        self.tmp, self.steps, self.step_s, self.timeout_s, self.shard = \
            tmp, steps, step_s, timeout_s, shard
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.file = tmp / "quorum.json"
        self.procs: dict[tuple[int, ...], subprocess.Popen] = {}
        self.quorum_id = 0

    def quorum(self, members: list[int]) -> None:
        self.quorum_id += 1
        record = Quorum(id=self.quorum_id, members=members, store_addr="127.0.0.1",
                        store_port=self.store.port).record()
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.file)

    def start(self, replica: int, after: int = 0, *flags: str) -> list[subprocess.Popen]:
        """The ranks of `replica` (one per position), joining the first quorum after id
        `after` that holds it (a standby: a later one than those written so far). The newest
        started for a (replica, position) is `procs[replica, position]`."""
        port = _free_port() if self.shard > 1 else 0
        started = []
        for position in range(self.shard):
            if (replica, position) in self.procs:  # the one it replaces is kept, as spare
                self.procs[replica, position, len(self.procs)] = self.procs[replica, position]
            out = self.tmp / f"r{replica}p{position}.out"
            with open(out, "ab") as log:  # the child holds its own descriptor
                self.procs[replica, position] = subprocess.Popen(
                    [sys.executable, str(ROOT / "bench" / "replica_rank.py"),
                     "--replica", str(replica), "--position", str(position),
                     "--shard", str(self.shard), "--world-port", str(port),
                     "--quorum-file", str(self.file), "--out", str(self.tmp),
                     "--steps", str(self.steps), "--step-s", str(self.step_s),
                     "--timeout-s", str(self.timeout_s), "--after", str(after), *self.args, *flags],
                    cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                    stdout=log, stderr=subprocess.STDOUT)
            started.append(self.procs[replica, position])
        return started

    def lines(self, replica: int, position: int = 0, kind: str = "step") -> list[dict]:
        path = self.tmp / f"r{replica}p{position}.jsonl"
        if not path.exists():
            return []
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r for r in rows if r["event"] == kind]

    def last_step(self, replica: int, position: int = 0) -> int:
        steps = self.lines(replica, position)
        return steps[-1]["step"] if steps else 0

    def ready(self, replica: int, count: int) -> bool:
        """Whether `count` processes at each of `replica`'s positions are waiting or past it."""
        return all(len(self.lines(replica, p, kind="waiting")) >= count
                   for p in range(self.shard))

    def wait(self, what, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not what():
            for key, proc in self.procs.items():
                if proc.poll() not in (None, 0, 3, 4, 5, -9):  # 3, 4, 5: replica_rank's --die-*
                    out = (self.tmp / f"r{key[0]}p{key[1]}.out").read_text()[-3000:]
                    raise AssertionError(f"replica {key} exited {proc.returncode}:\n{out}")
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.02)

    def finish(self, procs: list[subprocess.Popen]) -> None:
        """Wait for `procs` to end, each with status 0."""
        self.wait(lambda: all(p.poll() is not None for p in procs))
        for p in procs:
            key = next(k for k, v in self.procs.items() if v is p)
            assert p.returncode == 0, \
                (self.tmp / f"r{key[0]}p{key[1]}.out").read_text()[-3000:]

    def state(self, replica: int, position: int = 0) -> list[torch.Tensor]:
        saved = torch.load(self.tmp / f"r{replica}p{position}.pt", weights_only=True)
        return [saved[i] for i in range(len(saved))]

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
