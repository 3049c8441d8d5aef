"""Real control-plane parts for tests and benchmarks: a private redis-server that can be killed
and restarted on its port, controller and agent processes, and readers of what a run left."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The test session's warm server (tests/conftest.py, tests/warm_zygote.py): the command every
# agent starts its warm process with, and where that command finds the server.
WARM_COMMAND, WARM_SERVER = "OPTIMUS_WARM_COMMAND", "OPTIMUS_TEST_WARM_SERVER"

class RedisServer:
    """redis-server on a free loopback port, no persistence: a restart comes back empty."""

    def __init__(self, workdir: Path, *args: str):
        self.workdir, self.port, self.args = workdir, free_port(), list(args)
        workdir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port),
                                                                        timeout=0.2):
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.kill()


class Processes:
    """Control-plane processes started by a test; all killed (with their ranks) at the end."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.snapshot_secret = os.urandom(32).hex()  # the agents' link key, as `optimus run`'s

    def start(self, name: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        out = open(self.logdir / f"{name}.log", "ab")  # noqa: SIM115 (closed with the process)
        p = subprocess.Popen([sys.executable, "-m", "controller", *args], cwd=ROOT,
                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "OPTIMUS_SNAPSHOT_SECRET": self.snapshot_secret,
                                  **(env or {})})
        out.close()
        self.procs[name] = p
        return p

    def log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def write_job(path: Path, run_dir: Path, *, name: str = "e2e", steps: int = 30,
              faults: list[dict] | None = None, async_mode: str = "thread",
              moe: dict | None = None, ep: int = 1, memory_every: int | str = 0,
              batch_size: int = 8, **supervision) -> Path:
    """A tiny job that trains in ~0.2 s a step on two ranks, checkpoints every 10 steps and
    keeps them all (a test compares against any of them); `moe` makes it a mixture of
    experts, `ep` shards them. In-memory snapshots are off unless `memory_every` says (the
    tests of disk recovery stay about disk)."""
    job = {
        "name": name, "seed": 1234, "run_dir": str(run_dir),
        "model": {"vocab_size": 264, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "max_seq_len": 64, **({"moe": moe} if moe else {})},
        "parallel": {"ep": ep},
        "optim": {"steps": steps, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 5},
        "data": {"source": "synthetic", "seq_len": 64, "batch_size": batch_size,
                 "microbatches": 1},
        "checkpoint": {"interval": 10, "keep_last": 100, "async_mode": async_mode,
                       "memory_every": memory_every},
        # A silent rank or agent is declared lost after 8 s: a loaded test machine (two
        # workers on two cores, other work beside) has starved a heartbeat for 3 s and named
        # a false culprit; tests assert who was blamed, and the longer wait only slows the
        # few that freeze a rank or kill a node.
        "supervision": {"log_every": 1, "heartbeat_interval_s": 0.25,
                        "heartbeat_timeout_s": 8.0, "restart_backoff_s": 0.2,
                        "failure_grace_s": 1.0, "stop_grace_s": 30.0,
                        # a test that loses a node with no spare waits for it unless it says
                        # how far the job may shrink (the default, shrink, is tested by name)
                        "when_no_spare": "shrink" if "min_nodes" in supervision else "wait",
                        **supervision},
        "fault_injection": {"faults": faults or []},
        "monitoring": {"metrics_port": 0},  # tests that scrape /metrics pick a free port
    }
    path.write_text(yaml.safe_dump(job))
    return path


def maps_torch(pid: int) -> bool:
    """Whether process `pid` has torch's library mapped: it imported torch."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def metrics_so_far(run_dir: Path) -> list[dict]:
    """What rank 0 has logged so far (nothing yet, or a line half written, is fine)."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return rows


def final_loss(run_dir: Path, step: int) -> float:
    """The loss logged for `step`, from the last generation that logged it."""
    losses = [m["loss"] for m in metrics(run_dir) if m.get("step") == step and "loss" in m]
    assert losses, f"no loss logged for step {step} in {run_dir}/metrics.jsonl"
    return losses[-1]


_spawner = None  # the tests' warm process (optimus/supervision/warm.py), started at first use


def _rank_spawner():
    """One warm process for the test process's plain runs: each rank is then a fork of a
    process past its imports (the agent's own way, controller/node/spawn.py), not a cold
    `python -m optimus train` paying ~5 s of CPU for torch and the trainer."""
    global _spawner
    if _spawner is None:
        from controller.node.spawn import Spawner

        _spawner = Spawner(mode="fork")
    return _spawner


def train_ranks(job: Path, world: int, *, timeout: float = 120, env: dict | None = None,
                until_step: int | None = None) -> None:
    """A plain run of `job` on `world` local ranks (the agent's environment, no agent); with
    `until_step`, stopped (SIGTERM, so all ranks agree) once rank 0 has logged that step.
    `timeout` bounds a failure only: it is stretched by TIMEOUT_SLACK, as `wait_for` is."""
    port = free_port()
    run = Path(yaml.safe_load(job.read_text())["run_dir"])
    logs = run.parent / f"{run.name}-ranks"
    logs.mkdir(parents=True, exist_ok=True)
    spawner, procs = _rank_spawner(), []
    wait_for(lambda: not spawner.warming(), 60, "the warm process's imports")
    for rank in range(world):
        rank_env = {**os.environ, **(env or {}), "OPTIMUS_RANK": str(rank),
                    "OPTIMUS_WORLD_SIZE": str(world), "OPTIMUS_LOCAL_RANK": str(rank),
                    "OPTIMUS_LOCAL_WORLD_SIZE": str(world), "OPTIMUS_MASTER_ADDR": "127.0.0.1",
                    "OPTIMUS_MASTER_PORT": str(port)}
        procs.append(spawner.start(["optimus", "train", str(job)], rank_env,
                                   logs / f"rank{rank}.log"))
    try:
        if until_step is not None:
            def logged() -> bool:
                return any(m.get("step", 0) >= until_step for m in metrics_so_far(run))
            wait_for(logged, timeout, f"step {until_step} in {run}", interval=0.05)
            os.kill(procs[0].pid, signal.SIGTERM)
        wait_for(lambda: all(p.poll() is not None for p in procs), timeout,
                 f"the ranks of {job} to exit", interval=0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
    for rank, p in enumerate(procs):
        log = (logs / f"rank{rank}.log").read_text(errors="replace")
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log[-3000:]}"


# Deadlines in tests bound a failure, never decide a pass: on a loaded machine (other work
# beside the suite, two test workers on two cores) what takes 20 s idle can take 60.
TIMEOUT_SLACK = 3.0


def relay(store, plan: dict | None = None) -> list[tuple[str, str]]:
    """One pass of the leading controller's relay (controller/control/relay.py): what agents
    wrote under their nodes' own keys, into the job-wide records the readers read. The
    refusals it said, as (kind, message)."""
    from controller.control.relay import Relay

    said: list[tuple[str, str]] = []
    Relay(store, lambda kind, message, **fields: said.append((kind, message))).run(
        plan if plan is not None else store.plan())
    return said


@contextlib.contextmanager
def relaying(url: str, job: str, interval_s: float = 0.1):
    """The leading controller's relay alone, every `interval_s` on a thread, for a test whose
    agents run with no controller: their records, events and exits reach the job-wide keys
    the store reads (controller/control/relay.py)."""
    import threading

    from controller.control.relay import Relay
    from controller.store.store import Store, StoreUnavailable

    store, done = Store(url, job), threading.Event()
    passes = Relay(store, lambda kind, message, **fields: None)

    def loop():
        while not done.wait(interval_s):
            with contextlib.suppress(StoreUnavailable):
                passes.run(store.plan())
    thread = threading.Thread(target=loop, name="relay", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll `predicate` until it returns something true (returned), for at most `timeout` x
    TIMEOUT_SLACK seconds."""
    timeout *= TIMEOUT_SLACK
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class SentinelCluster:
    """A primary, one replica and three redis-sentinel processes on loopback, watching service
    `optimus` (a quorum of 2, the primary judged down after `down_after_ms`)."""

    SERVICE = "optimus"

    def __init__(self, workdir: Path, down_after_ms: int = 1000):
        self.workdir = workdir
        self.primary = RedisServer(workdir / "primary")
        self.replica = RedisServer(workdir / "replica", "--replicaof", "127.0.0.1",
                                   str(self.primary.port))
        self.sentinels: list[subprocess.Popen] = []
        self.sentinel_ports = [free_port() for _ in range(3)]
        try:
            for i, port in enumerate(self.sentinel_ports):
                self.sentinels.append(self._sentinel(i, port, down_after_ms))
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.SERVICE}/0"

    def _sentinel(self, i: int, port: int, down_after_ms: int) -> subprocess.Popen:
        conf = self.workdir / f"sentinel{i}.conf"  # sentinels rewrite their own file
        conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {self.workdir}\n"
                        f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.primary.port} 2\n"
                        f"sentinel down-after-milliseconds {self.SERVICE} {down_after_ms}\n"
                        f"sentinel failover-timeout {self.SERVICE} 10000\n")
        log = open(self.workdir / f"sentinel{i}.log", "ab")  # noqa: SIM115
        p = subprocess.Popen(["redis-sentinel", str(conf)], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return p

    def _ask(self, port: int, *command: str):
        import redis
        with redis.Redis(port=port, socket_timeout=1, decode_responses=True) as r:
            return r.execute_command(*command)

    def _wait_ready(self) -> None:
        """Until every sentinel knows the replica and the two other sentinels: only then can
        they agree on a failover."""
        def ready() -> bool:
            with contextlib.suppress(Exception):
                for port in self.sentinel_ports:
                    info = self._ask(port, "SENTINEL", "MASTER", self.SERVICE)  # a dict
                    if int(info["num-other-sentinels"]) < 2 or int(info["num-slaves"]) < 1:
                        return False
                role = self._ask(self.replica.port, "ROLE")
                return role[0] == "slave" and role[3] == "connected"
            return False
        wait_for(ready, 30, "three sentinels that know the replica and each other", 0.2)

    def primary_port(self) -> int:
        """The primary the sentinels name now."""
        return int(self._ask(self.sentinel_ports[0], "SENTINEL", "GET-MASTER-ADDR-BY-NAME",
                             self.SERVICE)[1])

    def stop(self) -> None:
        for p in self.sentinels:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.primary.stop()
        self.replica.stop()
