"""`optimus run`: the whole control plane on one machine, nodes simulated by agents.

    optimus run jobs/tiny-gpt.yaml --nodes 2 --ranks-per-node 2 --spares 1

Starts a private redis-server on a free port (unless REDIS_URL is set), a controller and
N + S agents (`node0`, `node1`, ...), each a process of its own in its own session, with logs in
`<run_dir>/control/`. Even on loopback the private Redis wants a password, generated per run
(another user of a shared login node could otherwise rewrite the plan): redis-server reads it
from its configuration on stdin, the controller and the agents get the URL in $REDIS_URL, the
agents a snapshot secret, also generated per run, in $OPTIMUS_SNAPSHOT_SECRET, and each
agent a Redis user of its own node (controller/store/acl.py); no secret is
on a command line or on screen (the URL is shown masked). `<run_dir>/control/redis.env` (mode
600) holds the URL for an operator's commands: `. <run_dir>/control/redis.env`.
Then it follows the job (controller/cli/console.py): events, validation losses and checkpoint
commits as they happen, and the step rank 0 is at.
Ctrl-C asks for a stop (the ranks agree on a step, save a checkpoint and exit; the controller
marks the job STOPPED); a second Ctrl-C kills everything at once. Exit status: 0 when the job
COMPLETED or was STOPPED, 1 when it FAILED or the control plane broke.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from rich.console import Console

from controller.cli.console import Follow
from controller.control.decide import FAILED, TERMINAL
from controller.store.acl import create_node_users, node_user
from controller.store.connect import safe_url
from controller.store.store import Store, StoreUnavailable
from optimus.checkpoint.manifest import committed_steps
from optimus.config import ConfigError, JobConfig
from optimus.contract.env import JOB, SNAPSHOT_SECRET
from optimus.contract.process import die_with_parent
from optimus.data.errors import DataError
from optimus.supervision.ports import unclaimed_port

POLL_S = 0.25


class LocalCluster:
    """The processes of one `optimus run`; `stop_all` leaves none behind."""

    def __init__(self, control_dir: Path):
        self.control_dir = control_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, command: list[str], env: dict[str, str] | None = None,
              stdin: bytes | None = None) -> subprocess.Popen:
        """`command`, logging to `<name>.log`, with `env` added to this environment (secrets
        go there, never into `command`), and `stdin` written to its input when given."""
        with open(self.control_dir / f"{name}.log", "ab") as out:
            # Own sessions (a Ctrl-C is ours to handle), but gone if `optimus run` is killed.
            popen = subprocess.Popen(command, env={**os.environ, **(env or {})},
                                     stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                                     stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=die_with_parent)
        self.procs[name] = popen
        if stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                popen.stdin.write(stdin)
            popen.stdin.close()
        return popen

    def stop_all(self, grace_s: float = 5.0) -> None:
        for p in self.procs.values():
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        for p in self.procs.values():
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)
                p.wait()


def start_redis(cluster: LocalCluster) -> str:
    """A private redis-server on a free loopback port (below the ephemeral range: no client's
    connection takes it before the server binds it, optimus/supervision/ports.py), no
    persistence, with a password of its own (in its configuration, which it reads from stdin:
    on no command line, in no file); its URL."""
    port, password = unclaimed_port("127.0.0.1"), secrets.token_hex(24)
    config = "".join(f"{line}\n" for line in (
        f"port {port}", "bind 127.0.0.1", 'save ""', "appendonly no",
        f"dir {_quoted(str(cluster.control_dir))}", f"requirepass {password}"))
    try:
        cluster.start("redis", ["redis-server", "-"], stdin=config.encode())
    except FileNotFoundError:
        raise ConfigError("redis-server is not installed: install it (apt install "
                          "redis-server), or point REDIS_URL at a running Redis") from None
    url = f"redis://default:{password}@127.0.0.1:{port}/0"
    store = Store(url, "probe", retry_s=0.2)
    deadline = time.monotonic() + 10
    while True:
        try:
            store.ping()
            return url
        except StoreUnavailable:
            if time.monotonic() > deadline or cluster.procs["redis"].poll() is not None:
                raise ConfigError(f"redis-server did not start on port {port}; see "
                                  f"{cluster.control_dir / 'redis.log'}") from None
            time.sleep(0.05)


def _node_urls(store: Store, names: list[str]) -> dict[str, str]:
    """A user per node in the private Redis, each with a password of its own; their URLs."""
    passwords = {name: secrets.token_hex(24) for name in names}
    create_node_users(store.r, store.job, passwords)
    parts = urlsplit(store.url)
    return {name: urlunsplit(parts._replace(
        netloc=f"{node_user(name)}:{passwords[name]}@{parts.hostname}:{parts.port}"))
        for name in names}


def run_local(job: JobConfig, job_file: str, overrides: list[str], *, nodes: int,
              ranks_per_node: int, spares: int, redis_url: str | None = None,
              lease_s: float = 5.0) -> int:
    console = Console(highlight=False, markup=False, soft_wrap=True)
    run_dir = Path(job.resolved_run_dir)
    control_dir = run_dir / "control"
    control_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "controller.json").unlink(missing_ok=True)  # a fresh submission
    (control_dir / "redis.env").unlink(missing_ok=True)  # an earlier run's Redis
    cluster = LocalCluster(control_dir)
    interrupted = []

    def on_sigint(signum, frame):
        interrupted.append(time.monotonic())
        if len(interrupted) > 1:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        url = redis_url or os.environ.get("REDIS_URL")
        operators, private = "", not url
        if private:  # a private Redis: its URL, for an operator's commands, in a mode-600 file
            url = start_redis(cluster)
            env_file = control_dir / "redis.env"
            _write_private(env_file, f"export REDIS_URL={url}\nexport {JOB}={job.name}\n")
            operators = f" (for `optimus job ...`: . {_shown(env_file)})"
        store = Store(url, job.name)
        store.ping()
        _refuse_a_live_job(store, url)
        store.reset()
        follow = Follow(console, store, job)  # before any rank appends to the metrics file
        py = [sys.executable, "-m", "controller"]
        sets = [a for o in overrides for a in ("--set", o)]
        # Secrets by environment only: the URL's password, and the agents' snapshot secret.
        cluster.start("controller", [*py, "controller", job_file, "--nodes", str(nodes),
                                     "--ranks-per-node", str(ranks_per_node),
                                     "--lease", str(lease_s), "--exit-when-done",
                                     "--linger", "0", *sets], env={"REDIS_URL": url})
        names = [f"node{i}" for i in range(nodes + spares)]
        # Each agent of the private Redis its own user (controller/store/acl.py): one node's
        # password reaches its own keys only. A Redis of the site's: its URL, as given.
        agent_urls = _node_urls(store, names) if private else dict.fromkeys(names, url)
        snapshot_secret = secrets.token_hex(32)
        for name in names:
            cluster.start(f"agent-{name}", [*py, "agent", "--job", job.name, "--node", name,
                                            "--interval",
                                            str(job.supervision.heartbeat_interval_s)],
                          env={"REDIS_URL": agent_urls[name],
                               SNAPSHOT_SECRET: snapshot_secret})
        console.print(f"optimus run: job {job.name}, {nodes} node(s) x {ranks_per_node} "
                      f"rank(s) + {spares} spare(s); Redis {safe_url(url)}{operators}; logs in "
                      f"{control_dir} and {run_dir / 'logs'}"
                      + (f"; metrics on port {job.monitoring.metrics_port}"
                         if job.monitoring.metrics_port else ""))
        state = _follow(follow, cluster, job, interrupted)
    except KeyboardInterrupt:
        console.print("second Ctrl-C: killing every process now")
        state = None
    finally:
        signal.signal(signal.SIGINT, previous)
        cluster.stop_all()
    steps = committed_steps(job.resolved_checkpoint_dir)
    console.print(f"latest committed checkpoint: "
                  f"{f'step {steps[-1]}' if steps else 'none'} in {job.resolved_checkpoint_dir}")
    _report(console, run_dir)
    return 0 if state in TERMINAL and state != FAILED else 1


def _report(console: Console, run_dir: Path) -> None:
    """The run's report (optimus/report/), and where it is; a run that logged no step, or a
    machine without matplotlib, gets a line that says so instead."""
    from optimus.report import build_report

    try:
        page = build_report(run_dir)
    except (ConfigError, DataError) as e:
        console.print(f"report: not rendered: {e}")
        return
    except KeyboardInterrupt:  # the processes are gone already: only the page is given up
        console.print(f"report: interrupted; `optimus report {_shown(run_dir)}` renders it")
        return
    console.print(f"report: {_shown(page)}")


def _shown(path: Path) -> str:
    """Relative to the working directory when it is below it (runs/tiny-gpt/report/...)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _follow(follow: Follow, cluster: LocalCluster, job: JobConfig,
            interrupted: list) -> str | None:
    """Say what happens until the job ends (controller/cli/console.py); its final state."""
    asked_stop = False
    controller = cluster.procs["controller"]
    while True:
        if interrupted and not asked_stop:
            asked_stop = True
            follow.console.print("Ctrl-C: stopping; the ranks save a checkpoint first (Ctrl-C "
                                 "again to kill everything)")
            follow.store.request("stop", "optimus run (Ctrl-C)", socket.gethostname(),
                                 "interrupted")
        record = follow.poll()
        if controller.poll() is not None:
            record = follow.poll(progress=False) or record  # what it wrote before it exited
            state = record.get("state")
            if state in TERMINAL:
                _wait_agents(cluster, job.supervision.stop_grace_s)
                follow.drain()
                follow.console.print(f"job {state}: {record.get('reason', '')}")
                return state
            follow.drain()
            follow.console.print(f"the controller exited ({controller.returncode}) with the "
                                 f"job {state}; see {cluster.control_dir / 'controller.log'}")
            return None
        time.sleep(POLL_S)


def _refuse_a_live_job(store: Store, url: str) -> None:
    """A shared Redis (REDIS_URL) may hold this job running elsewhere: never wipe that."""
    state = store.job_record().get("state")
    beats = store.agent_beats()
    recent = [n for n, t in beats.items() if time.time() - t < 30]
    if state and state not in TERMINAL and recent:
        raise ConfigError(f"job {store.job} is {state} in Redis at {safe_url(url)} with agents "
                          f"beating ({', '.join(sorted(recent))}); fix: stop it first, or give "
                          "this run another `name`")


def _wait_agents(cluster: LocalCluster, grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for name, p in cluster.procs.items():
        if name.startswith("agent-"):
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


def _quoted(text: str) -> str:
    """A value for redis.conf: quoted, with backslashes and quotes escaped."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _write_private(path: Path, text: str) -> None:
    """`text` into `path`, readable by this user only (mode 600 from its creation)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


