"""How the node agent starts its ranks: adopted from a standby, forked from a warm process, or
as a fresh one.

`Spawner.start(argv, env, log)` returns a handle with `pid`, `returncode` and `poll()`, as a
`subprocess.Popen` has. OPTIMUS_WARM_START picks how (optimus/supervision/warm.py explains
both warm kinds):
- `fork` (the default on a CPU-only node; also `1`): ranks are forked by one
  `python -m optimus.supervision.warm` process per agent, which imported the trainer once: a
  rank starts in milliseconds instead of seconds of imports;
- `standby` (the default on a node with GPUs or XPUs, whose runtime context a fork cannot
  carry): one `python -m optimus.supervision.warm --standby N` per device, past its imports
  with device N's
  context created, waits for a rank to become; the agent keeps as many as a generation has
  ranks per node (`keep_ready`), and a used one is replaced once the generation runs;
- `0`: every rank starts cold, as `python -m optimus ...` (subprocess.Popen).
The agent never imports torch itself: warm processes are children it talks to over pipes. When
one cannot start, refuses a fork or dies, the rank starts cold, exactly as before: a warm start
is only ever faster, never required. The node's health check runs in a child of the warm
process too (`health_check`; without one, in a fresh process: controller/node/health_check.py).

Either way a rank runs in its own session, with the given environment, its output appended to
its log, and dies with the agent (the warm process dies with the agent, its ranks with it).

Ranks never talk to Redis, nor to other agents: the agent's credentials (REDIS_URL and every
REDIS_* variable, the snapshot secret) are left out of their environment (`rank_environment`),
and out of the warm and standby processes they are forked from or become, whose environment is
what /proc/<rank>/environ shows of a forked rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from optimus.contract.env import (
    LOCAL_RANK,
    SNAPSHOT_SECRET,
    SNAPSHOT_SECRET_FILE,
    WARM_COMMAND,
    WARM_START,
)
from optimus.contract.process import die_with_parent

log = logging.getLogger("optimus.agent")

WARM_ENV = WARM_START  # bench/recovery.py's name for it
WARM_MODULE = "optimus.supervision.warm"
AGENT_ONLY = (SNAPSHOT_SECRET, SNAPSHOT_SECRET_FILE)  # and REDIS_*
# Another launcher's words for where a rank sits and where rank 0 is: a site's batch template
# often exports them into the agent's environment, but under an agent the controller's plan
# says both (OPTIMUS_*); a rank that inherited MASTER_ADDR would wait on that host forever once
# rank 0 moved. Its ranks never see them (`rank_environment`); the agent says so once.
LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "NODE_RANK")
LAUNCHER_PREFIXES = ("TORCHELASTIC_",)
MODES = ("fork", "standby", "cold")
_POLL_S = 0.05
WARMING_S = 60.0  # how long a launch waits for the warm process's imports, then starts cold
_FORK_TIMEOUT_S = 10.0
_LINE_LIMIT = 1 << 20  # bytes of one message from the warm process (a reply is a few hundred)


class WarmRank:
    """A rank forked by the warm process: Popen's `pid`, `returncode` and `poll()`. As with
    Popen, `returncode` is set by this rank's own `poll()`, never by another's: the agent reaps
    a rank once its `returncode` is no longer None, and reading the warm process's reports for
    one rank must not make another look reaped already."""

    def __init__(self, pid: int, spawner: Spawner):
        self.pid, self.returncode, self._spawner = pid, None, spawner
        self.reported: int | None = None  # the exit status the warm process reported

    def poll(self) -> int | None:
        if self.returncode is None:
            if self.reported is None:
                self._spawner.collect()
            self.returncode = self.reported
        return self.returncode


def rank_environment(env) -> dict[str, str]:
    """`env` without what only the agent may hold (REDIS_URL and every REDIS_* variable: the
    password; the snapshot secret and its file) and without another launcher's rendezvous
    variables (`launcher_variables`)."""
    return {k: v for k, v in env.items() if not k.startswith("REDIS_") and k not in AGENT_ONLY
            and not _from_a_launcher(k)}


def launcher_variables(env) -> list[str]:
    """The names in `env` its ranks do not inherit because another launcher set them."""
    return sorted(k for k in env if _from_a_launcher(k))


def _from_a_launcher(name: str) -> bool:
    return name in LAUNCHER_VARS or name.startswith(LAUNCHER_PREFIXES)


def warm_command() -> list[str]:
    """The command that starts the warm process: `python -m optimus.supervision.warm`, or the
    words of OPTIMUS_WARM_COMMAND (a JSON list), which must end up serving
    optimus/supervision/warm.py's protocol on
    its stdin and stdout: a wrapper that pins it to the cores the ranks should use (`numactl`,
    `taskset`), or the test suite's, which forks it from one process per test session that has
    imported the trainer already (tests/warm_zygote.py). A value that is no such list is said
    and the default used."""
    default = [sys.executable, "-m", WARM_MODULE]
    raw = os.environ.get(WARM_COMMAND, "").strip()
    if not raw:
        return default
    try:
        words = json.loads(raw)
    except ValueError:
        words = None
    if not (isinstance(words, list) and words and all(isinstance(w, str) and w for w in words)):
        log.warning("%s is not a JSON list of words; the warm process starts as %s",
                    WARM_COMMAND, " ".join(default[1:]))
        return default
    return words


def start_mode(device_kind: str | None) -> str:
    """fork, standby or cold, from OPTIMUS_WARM_START and the node's device kind."""
    value = os.environ.get(WARM_START, "").strip().lower()
    if value in ("0", "cold", "off", "false"):
        return "cold"
    if value in ("fork", "standby"):
        return value
    return "standby" if device_kind in ("cuda", "xpu") else "fork"


class Spawner:
    def __init__(self, warm: bool | None = None, mode: str | None = None):
        if mode is None:
            mode = ("fork" if warm else "cold") if warm is not None else start_mode(None)
        if mode not in MODES:
            raise ValueError(f"start mode {mode!r}: one of {', '.join(MODES)}")
        self.mode = mode
        # The forking warm process: in standby mode too, for ranks no standby is ready for
        # (the first generation, before a plan said how many ranks a node runs).
        self.warm = mode != "cold"
        self._standby: dict[int, subprocess.Popen] = {}  # local rank -> its standby
        self._proc: subprocess.Popen | None = None
        self._pending = b""
        self._inbox: list[dict] = []  # messages read, not yet handled
        self._ranks: dict[int, WarmRank] = {}
        self._next_id = 0
        self._failures = 0  # of the warm process: after two, ranks start cold
        self._ready = False
        self._started = 0.0
        if self.warm:
            self._start_warm()

    def start(self, argv: list[str], env: dict[str, str], log_path: Path):
        """Start `optimus <argv...>` (argv[0] is the program name) as one rank, with `env`
        less the agent's credentials (`rank_environment`)."""
        env = rank_environment(env)
        if self.mode == "standby":
            local_rank = int(env.get(LOCAL_RANK, env.get("LOCAL_RANK", "0")))
            adopted = self._adopt(local_rank, argv, env, log_path)
            if adopted is not None:
                return adopted
        if self.warm and self._proc is None:
            self._start_warm()
        if self._proc is not None:
            try:
                return self._fork(argv, env, log_path)
            except (OSError, ValueError, RuntimeError) as e:
                self._lost(f"warm start failed ({e}); this rank starts cold")
        with open(log_path, "ab") as out:
            return subprocess.Popen([sys.executable, "-m", "optimus", *argv[1:]], env=env,
                                    stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=die_with_parent)

    def keep_ready(self, count: int) -> None:
        """Standby mode: have a standby process for each of local ranks 0..count-1 (started
        now for those missing; their imports run while the agent waits for a plan)."""
        if self.mode != "standby":
            return
        for local_rank in range(count):
            proc = self._standby.get(local_rank)
            if proc is not None and proc.poll() is None:
                continue
            try:
                self._standby[local_rank] = subprocess.Popen(
                    [sys.executable, "-m", WARM_MODULE, "--standby", str(local_rank)],
                    env=rank_environment(os.environ), stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, start_new_session=True,
                    preexec_fn=die_with_parent)
            except OSError as e:
                log.warning("no standby for local rank %d (%s); it starts cold", local_rank, e)
                return

    def standbys(self) -> dict[int, int]:
        """Local rank -> pid of its waiting standby (for status and tests)."""
        return {r: p.pid for r, p in self._standby.items() if p.poll() is None}

    def _adopt(self, local_rank: int, argv: list[str], env: dict[str, str],
               log_path: Path) -> subprocess.Popen | None:
        """Hand the rank to local rank's standby: it becomes the rank (still importing, it
        becomes it once done: never later than a cold start would)."""
        proc = self._standby.pop(local_rank, None)
        if proc is None or proc.poll() is not None:
            return None
        request = {"argv": list(argv), "env": dict(env), "log": str(log_path)}
        try:
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.close()
        except OSError as e:  # it died meanwhile
            log.warning("standby of local rank %d is gone (%s); the rank starts cold",
                        local_rank, e)
            return None
        return proc

    def health_check(self, node: str, corrupt: set[int], timeout_s: float):
        """The node's health check, run in a child of the warm process (optimus/supervision/
        warm.py): the
        `health` of its reply, as read (the caller validates it), or None where no warm
        process can run it: cold starts, or one that failed, died, refused, or is still
        importing after WARMING_S. TimeoutError when no answer comes within `timeout_s` (the
        check's own limit there) and a margin."""
        if self.warm and self._proc is None:
            self._start_warm()
        while self.warming():
            time.sleep(_POLL_S)
        if self._proc is None or not self._ready:
            return None
        self._next_id += 1
        request = {"id": self._next_id, "health": {"node": node, "corrupt": sorted(corrupt),
                                                   "timeout_s": timeout_s}}
        try:
            reply = self._ask(request, timeout_s + _FORK_TIMEOUT_S)
        except (OSError, ValueError, RuntimeError) as e:
            self._lost(f"the warm process failed a health check ({e}); it runs cold")
            return None
        if reply is None:
            raise TimeoutError(f"no answer from the warm process within "
                               f"{timeout_s + _FORK_TIMEOUT_S:g} s")
        if "health" not in reply:
            log.warning("the warm process refused a health check (%s); it runs cold",
                        reply.get("error"))
            return None
        return reply["health"]

    @property
    def checks_cheaply(self) -> bool:
        """Whether a health check now runs in a child of the warm process, past its imports (on
        CPU ~0.1 s in all; a GPU's runtime still starts in the child), not in a fresh
        interpreter that imports torch first (seconds of CPU)."""
        return self._proc is not None and self._ready

    def warming(self) -> bool:
        """Whether the warm process is still importing (for up to WARMING_S): a launch should
        wait for it, a tick or a few, rather than start ranks cold meanwhile."""
        self.collect()
        return (self._proc is not None and not self._ready
                and time.monotonic() - self._started < WARMING_S)

    def report_fd(self) -> int | None:
        """The warm process's replies, readable when it reports a forked rank's exit: the
        agent's wait ends on it, and its turn `collect`s what came."""
        return self._proc.stdout.fileno() if self._proc is not None else None

    def collect(self) -> None:
        """Read what the warm process reported (ranks' exits) without waiting."""
        self._read(timeout=0.0)
        while self._inbox:
            self._ended(self._inbox.pop(0))

    def close(self) -> None:
        """Stop the warm process (its ranks die with it; they are reported killed) and the
        standbys."""
        self.warm = False
        self._stop_warm()
        for proc in self._standby.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        self._standby.clear()

    def _lost(self, why: str) -> None:
        """The warm process failed or died: its ranks died with it. Start another when the
        next rank is due, but after a second failure start ranks cold."""
        log.warning(why)
        self._failures += 1
        self.warm = self.warm and self._failures < 2
        self._stop_warm()

    def _stop_warm(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        self._orphans()

    # --- the warm process ----------------------------------------------------------------------

    def _start_warm(self) -> None:
        try:
            self._proc = subprocess.Popen(
                warm_command(), env=rank_environment(os.environ),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                preexec_fn=die_with_parent)
        except OSError as e:
            log.warning("no warm start (%s); ranks start cold", e)
            self._proc, self.warm = None, False
        self._pending = b""
        self._inbox.clear()
        self._ready, self._started = False, time.monotonic()

    def _fork(self, argv: list[str], env: dict[str, str], log_path: Path) -> WarmRank:
        self._next_id += 1
        request = {"id": self._next_id, "argv": list(argv), "env": dict(env),
                   "log": str(log_path)}
        # A request written while the warm process still imports is read once it is done:
        # its answer may take what is left of WARMING_S (a loaded machine: tens of seconds).
        self.collect()
        if self._proc is None:
            raise RuntimeError("the warm process exited")
        importing = 0.0 if self._ready else max(0.0, WARMING_S - (time.monotonic() -
                                                                 self._started))
        reply = self._ask(request, _FORK_TIMEOUT_S + importing)
        if reply is None:
            raise RuntimeError(f"no answer from the warm process within "
                               f"{_FORK_TIMEOUT_S + importing:g} s")
        if "pid" not in reply:
            raise RuntimeError(reply.get("error", "no pid in the reply"))
        rank = WarmRank(int(reply["pid"]), self)
        self._ranks[rank.pid] = rank
        return rank

    def _ask(self, request: dict, timeout_s: float) -> dict | None:
        """Write `request` to the warm process: its reply (the message with the request's id),
        or None after `timeout_s`. Ranks' exits read meanwhile are handled; what follows the
        reply stays for collect()."""
        self._proc.stdin.write((json.dumps(request) + "\n").encode())
        self._proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._inbox:
                self._read(timeout=0.5)
            while self._inbox:
                message = self._inbox.pop(0)
                if message.get("id") == request["id"]:
                    return message
                self._ended(message)
        return None

    def _read(self, timeout: float) -> None:
        """Append what the warm process has written, as messages, to the inbox."""
        proc = self._proc
        if proc is None:
            return
        fd = proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return
        data = os.read(fd, 1 << 16)
        if not data:  # the warm process is gone, and its ranks with it
            if timeout > 0:
                raise RuntimeError(f"the warm process exited ({proc.wait()})")
            self._lost(f"the warm process exited ({proc.wait()}); its ranks died with it")
            return
        self._pending += data
        while b"\n" in self._pending:
            line, self._pending = self._pending.split(b"\n", 1)
            try:
                message = json.loads(line)
            except ValueError:
                message = None
            if isinstance(message, dict):
                self._inbox.append(message)
            else:
                log.warning("the warm process wrote what is not a JSON object: %r", line[:200])
        if len(self._pending) > _LINE_LIMIT:
            why = f"the warm process wrote over {_LINE_LIMIT} bytes without a line end"
            if timeout > 0:
                raise RuntimeError(why)
            self._lost(why)

    def _ended(self, message: dict) -> None:
        if message.get("ready"):
            self._ready = True
            return
        rank = self._ranks.pop(int(message.get("pid", -1)), None)
        if rank is not None:
            rank.reported = (-int(message["signal"]) if "signal" in message
                             else int(message.get("code", 1)))

    def _orphans(self) -> None:
        """Ranks of a warm process that died: the parent-death signal killed them."""
        for rank in self._ranks.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank.pid, signal.SIGKILL)
            rank.reported = -signal.SIGKILL
        self._ranks.clear()
