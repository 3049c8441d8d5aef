"""A controller's part for replicas of `optimus train` (tests/test_replica_train.py,
bench/recovery.py's replica mode): the ranks' processes, one world per replica, the store the
quorum groups meet at, and the quorum file, written whole as the controller writes it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

from optimus.contract.env import CONTROL_FILE, QUORUM_AFTER, QUORUM_FILE, REPLICA, REPLICA_LAUNCH
from optimus.contract.records import Quorum

ROOT = Path(__file__).resolve().parent.parent
JOB = ["--set", "optim.warmup_steps=2", "--set", "data.batch_size=6",
       "--set", "data.microbatches=1", "--set", "eval.every=0", "--set", "supervision.log_every=1",
       "--set", "checkpoint.keep_last=10", "--set", "supervision.hang_floor_s=60"]


class Replicas:
    """Replicas of tiny-gpt, each a world of `shard` ranks, and their quorum file."""

    def __init__(self, tmp: Path, steps: int, replicas: int = 3, shard: int = 1,
                 batch: int = 6, extra: tuple[str, ...] = (),
                 job: Path = ROOT / "jobs" / "tiny-gpt.yaml"):
        self.tmp, self.steps, self.replicas, self.shard = tmp, steps, replicas, shard
        self.batch, self.extra, self.job = batch, extra, str(job)
        self.may_fail: set[int] = set()  # the processes that may end with an error
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.file, self.id = tmp / "quorum.json", 0
        self.procs: list[subprocess.Popen] = []

    def quorum(self, members: list[int]) -> int:
        self.id += 1
        record = Quorum(id=self.id, members=members, store_addr="127.0.0.1",
                        store_port=self.store.port).record()
        (self.tmp / "q.tmp").write_text(json.dumps(record))
        os.replace(self.tmp / "q.tmp", self.file)
        return self.id

    def start(self, replica: int, after: int = 0) -> subprocess.Popen:
        """Replica `replica`'s rank (the first of its world's `shard`; all are in `procs`),
        joining the first quorum after id `after` (> 0: a relaunch, as an agent's launch 1)."""
        world = {}
        if self.shard > 1:  # its own world: a rendezvous of its ranks alone
            world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                     "WORLD_SIZE": str(self.shard), "LOCAL_WORLD_SIZE": str(self.shard)}
        started = []
        for position in range(self.shard):
            env = {**os.environ, CONTROL_FILE: str(self.tmp / f"control{replica}.json"),
                   QUORUM_FILE: str(self.file), REPLICA: str(replica),
                   QUORUM_AFTER: str(after), REPLICA_LAUNCH: str(int(after > 0)),
                   "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                   **world, **({"RANK": str(position), "LOCAL_RANK": str(position)}
                               if world else {})}
            with open(self.tmp / f"r{replica}.{len(self.procs)}.out", "wb") as out:
                started.append(subprocess.Popen(
                    [sys.executable, "-m", "optimus", "train",
                     self.job, *JOB,
                     "--set", f"parallel.replicas={self.replicas}",
                     "--set", f"optim.steps={self.steps}",
                     "--set", f"data.batch_size={self.batch}",
                     "--set", f"run_dir={self.tmp / 'run'}", *self.extra],
                    env=env, cwd=self.tmp, stdout=out, stderr=subprocess.STDOUT))
            self.procs.append(started[-1])
        return started[0]

    def control(self, replica: int, **word) -> None:
        """Replica `replica`'s control word (pause, checkpoint), as its agent writes it."""
        path = self.tmp / f"control{replica}.json"
        path.with_suffix(".tmp").write_text(json.dumps(word))
        os.replace(path.with_suffix(".tmp"), path)

    def ready(self, proc: subprocess.Popen) -> bool:
        """Whether rank process `proc` waits for its quorum (its log says so)."""
        index = self.procs.index(proc)
        log = next(self.tmp.glob(f"r*.{index}.out"), None)
        return log is not None and "waiting for a quorum after id" in log.read_text()

    def rows(self) -> list[dict]:
        path = self.tmp / "run" / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def steps_logged(self) -> list[int]:
        return [r["step"] for r in self.rows() if "loss" in r and "event" not in r]

    def events(self, kind: str) -> list[dict]:
        return [r for r in self.rows() if r.get("event") == kind]

    def wait(self, what, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not what():
            for i, p in enumerate(self.procs):
                if p.poll() not in (None, 0, -signal.SIGKILL) and i not in self.may_fail:
                    out = next(self.tmp.glob(f"r*.{i}.out")).read_text()[-3000:]
                    raise AssertionError(f"rank process {i} exited {p.returncode}:\n{out}")
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.05)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
