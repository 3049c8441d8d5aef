"""Simulated hosts for multi-host tests: each its own Linux network namespace (its own
addresses, hostname and /etc/hosts), two networks between them, Redis and the controller on a
host of their own, and links that a test cuts and heals. Needs root, iproute2 (`ip`) and
redis-server (no `unshare` binary: the hostname is set by ENTER, below); a test using it skips,
saying why, where one is missing or a network namespace cannot be made.

    def test_x(hosts, tmp_path):
        h = hosts("node0", "node1", "node2")        # + a "control" host, always
        h.start_redis()                             # on control, bound to its management address
        h.start_agent("node0")                      # advertises node0's data address (--host)
        h.start_controller(job, nodes=2)            # on control
        h.cut("node1", "both"); ...; h.heal("node1", "both")
        store = h.store("e2e")                      # the test's own view of Redis (see below)

The network (`Hosts`): a "switch" namespace holds two bridges, `brmgmt` (management: Redis, the
controller, the agents' Redis traffic) and `brdata` (data: the ranks' collectives, the agents'
snapshot links, the controller's probes of those). Every host, the control host included, has
one veth on each, `mgmt0` and `data0` on its side (so a node's ranks get GLOO_SOCKET_IFNAME=data0),
`m<i>` and `d<i>` on the switch's. Addresses: 10.<100+slot>.<2c>.0/24 (management) and
10.<100+slot>.<2c+1>.0/24 (data), the control host .2, hosts .10, .11, ... in the order given;
<slot> is this test process's (below), <c> a counter of its fixtures, so no two tests on two
pytest-xdist workers (or two pytest sessions on one machine) share a subnet or a name. The root
namespace gets nothing: no interface, no address, no route. The test process reaches Redis
through its Unix socket (a file: reachable from any namespace), which no cut touches: the
observer never shares the fault it observes.

Names: every host's /etc/netns/<ns>/hosts (which `ip netns exec` binds over /etc/hosts) maps
every host's name to its management address, as a cluster's DNS would; a host named in
`own_name_loopback` maps its own name to 127.0.1.1 instead, as Debian's installer does. Each
process started in a host gets a UTS namespace of its own with the host's name
(`socket.gethostname()`), through a two-line Python wrapper (ENTER) between `ip netns exec` and
the command. Agents and controllers reach Redis by the name of its host (`control:6379`, or
another host's that `start_redis` is given), resolved in their own host.

A cut (`cut(host, "mgmt" | "data" | "both")`, undone by `heal`) sets the switch's side of the
host's veth down: a silent cut, frames are dropped, nothing is refused. The host's own side
shows NO-CARRIER; its addresses and routes stay. Measured here (tests/test_multihost.py relies
on no more than this):
- a new TCP connect across the cut never gets a refusal: while the peer's ARP entry is still
  valid (REACHABLE/STALE: ~30 s after the last traffic) its SYNs are dropped and the connect
  runs to its timeout; once the entry has to be resolved again, ARP fails after 3 s and the
  connect fails with EHOSTUNREACH ("No route to host", errno 113), on both sides of the cut;
- an established connection is not told anything: send() succeeds (into the socket buffer),
  recv() waits, TCP retransmits with exponential backoff (tcp_retries2=15: ~15 min before it
  gives up); after the heal the next retransmission delivers, and the connection goes on as if
  nothing happened: the first bytes arrive up to one backoff interval late (seconds, after a cut
  of ten). Only an application timeout (Redis clients' socket_timeout, gloo's) ends it sooner;
- a connection its client gives up during the cut (a timeout, then close) is not discarded: the
  kernel keeps retransmitting what was sent, and the server receives it after the heal and
  acts on it, after what the client sent since on a new connection (a 9 s cut: ~13 s after it
  was sent, the sum of the backoff intervals). tests/test_multihost.py measures what that does
  to the agents' beats;
- a process local to the cut host still reaches that host's own addresses (local delivery):
  cutting the control host's management link cuts Redis off from the agents, not from the
  controller beside it.

Processes (`start`, `start_agent`, `start_controller`, `start_redis`): `ip netns exec <ns>`, then
ENTER, then the command; each in its own session, its output in `<tmp_path>/hosts/<name>.log`,
killed with its parent (PR_SET_PDEATHSIG) should the test process die. Agents get REDIS_URL,
the snapshot secret (as tests/cluster.py `Processes`), GLOO_SOCKET_IFNAME=data0, and the warm
server below.

The warm server. tests/conftest.py's session warm server forks every agent's warm process from
one process past its imports, over a Unix socket. A Unix socket at a path is a file: a client in
another network namespace reaches it (only abstract sockets are per namespace). But the warm
process it forks, and every rank that process forks, would then live in the server's namespaces
(the root's: no data0, no 10.x address, the root's hostname and /etc/hosts): ranks in the wrong
host, their GLOO_SOCKET_IFNAME naming no interface. So this module runs a warm server of its own
(tests/hosts_warm.py, one per test process, started with the first `hosts` fixture),
the same as tests/warm_zygote.py (its code, imported) except that each warm process, before it
becomes one, joins the network, UTS and mount namespaces of the client that asked (its peer on
the socket: SO_PEERCRED), which are its agent's: a rank forked from it is in the agent's host,
with its name and its /etc/hosts. tests/test_multihost.py asserts that of every rank it runs.
Saved: the trainer's imports in every agent's warm process (~5 s of CPU each, 3-4 agents a test).

Teardown (the `hosts` fixture's finalizer, and `Hosts.close` on any failure while setting up;
a test that fails, and a Ctrl-C, run it): every process started, then every process still in a
namespace of the fixture (ranks, warm processes: `ip netns pids`), is SIGKILLed; the namespaces
(their veths with them), the /etc/netns/<ns> folders and the Redis socket are removed. A test
process killed outright (SIGKILL, SIGTERM) takes every process with it (PR_SET_PDEATHSIG) but
leaves the names behind: the next test process to take its slot sweeps them. A slot is a
number (0..63, the pytest-xdist worker's number first) held by an flock on
/run/optimus-hosts/slot<N>.lock for the test process's life: names of a slot nobody holds are
leftovers, and names of a held one belong to a live process, never swept by another. Names:
namespaces omh<slot>-<c>-<host> and omh<slot>-<c>-sw, /run/optimus-hosts/omh<slot>-<c>-redis.sock
and the warm server's omh<slot>-warm.sock.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = Path("/run/optimus-hosts")  # slot locks and Redis sockets (tmpfs: gone at reboot)
PREFIX = "omh"
SLOTS = 64
MGMT_IF, DATA_IF = "mgmt0", "data0"  # each host's side of its two links
REDIS_PORT = 6379
# What a warm process joins of its agent's: network, hostname, mounts (/etc/hosts).
NAMESPACES = (("net", 0x40000000), ("uts", 0x04000000), ("mnt", 0x00020000))  # CLONE_NEW*
# Between `ip netns exec` and the command: a UTS namespace of its own, named as the host.
ENTER = ("import ctypes,os,socket,sys\n"
         "if ctypes.CDLL(None, use_errno=True).unshare(0x04000000): sys.exit('unshare failed')\n"
         "socket.sethostname(sys.argv[1]); os.execvp(sys.argv[2], sys.argv[2:])")
# The command an agent starts its warm process with (tests/warm_client.py), and where that
# finds its server: this module's (below), not tests/conftest.py's.
WARM_COMMAND, WARM_SERVER = "OPTIMUS_WARM_COMMAND", "OPTIMUS_TEST_WARM_SERVER"


_unavailable: list[str | None] = []  # the answer, once found


def unavailable() -> str | None:
    """Why simulated hosts cannot run here, or None: not root, no `ip` or redis-server, or a
    network namespace that cannot be made (a container without CAP_SYS_ADMIN)."""
    if not _unavailable:
        why = None
        if os.geteuid() != 0:
            why = "simulated hosts need root (network namespaces, veths, bridges)"
        for tool in ("ip", "redis-server"):
            if why is None and shutil.which(tool) is None:
                why = f"simulated hosts need `{tool}`, which is not installed"
        if why is None:
            probe = f"{PREFIX}probe{os.getpid()}"
            made = _ip("netns", "add", probe, check=False)
            _ip("netns", "delete", probe, check=False)
            if made.returncode != 0:
                why = f"cannot make a network namespace here: {made.stderr.strip()}"
        _unavailable.append(why)
    return _unavailable[0]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


# --- slots: which names and subnets are this test process's ------------------------------------

_slot: tuple[int, object] | None = None  # (number, its open lock file)
_counter = itertools.count()


def _worker_number() -> int:
    digits = re.sub(r"\D", "", os.environ.get("PYTEST_XDIST_WORKER", ""))
    return int(digits) % SLOTS if digits else 0


def slot() -> int:
    """This test process's slot, taken at first use (leftovers of its last holder swept)."""
    global _slot
    if _slot is None:
        RUN.mkdir(mode=0o700, exist_ok=True)
        first = _worker_number()
        for n in [first, *(i for i in range(SLOTS) if i != first)]:
            lock = open(RUN / f"slot{n}.lock", "a")  # noqa: SIM115 (held for the process's life)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            os.set_inheritable(lock.fileno(), False)
            _slot = (n, lock)
            sweep(f"{PREFIX}{n}-")
            break
        else:
            raise RuntimeError(f"all {SLOTS} slots of simulated hosts are held ({RUN})")
    return _slot[0]


def _kill_in(ns: str) -> None:
    """SIGKILL every process in network namespace `ns`, and wait (a few seconds) until none is
    left: a namespace is deleted only once nothing runs in it."""
    deadline = time.monotonic() + 10
    while True:
        out = _ip("netns", "pids", ns, check=False)
        pids = [int(p) for p in out.stdout.split()] if out.returncode == 0 else []
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def sweep(prefix: str) -> None:
    """Remove every namespace, /etc/netns folder and socket whose name starts with `prefix`
    (their processes killed first; a namespace's veths go with it)."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    names = {line.split()[0] for line in listed if line.strip()}
    etc = Path("/etc/netns")
    if etc.is_dir():
        names |= {p.name for p in etc.iterdir()}
    for ns in sorted(n for n in names if n.startswith(prefix)):
        _kill_in(ns)
        _ip("netns", "delete", ns, check=False)
        shutil.rmtree(etc / ns, ignore_errors=True)
    if RUN.is_dir():
        for path in RUN.glob(f"{prefix}*"):
            path.unlink(missing_ok=True)


@dataclass(frozen=True)
class WarmServer:
    """A running warm server of tests/hosts_warm.py."""

    path: str  # its socket, bound once it is past its imports (warm_client.py waits for it)
    pid: int  # the parent of every warm process it forks


# --- hosts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Host:
    name: str  # its hostname, and its name in every host's /etc/hosts
    ns: str  # its network namespace
    index: int  # its veths on the switch: m<index>, d<index>
    mgmt: str  # its management address
    data: str  # its data address


class Hosts:
    """A control host and `names` hosts, wired as the module docstring says; `close` removes
    everything (also called on a failure while setting up)."""

    def __init__(self, logdir: Path, names: list[str], *, control: str = "control",
                 own_name_loopback: tuple[str, ...] = (),
                 warm_server: WarmServer | None = None):
        if len(set([control, *names])) != len(names) + 1:
            raise ValueError(f"host names must be unique: {[control, *names]}")
        self.logdir = logdir
        logdir.mkdir(parents=True, exist_ok=True)
        n, c = slot(), next(_counter)
        self.prefix = f"{PREFIX}{n}-{c}-"
        third = (c % 127) * 2
        self.mgmt_net = ipaddress.ip_network(f"10.{100 + n}.{third}.0/24")
        self.data_net = ipaddress.ip_network(f"10.{100 + n}.{third + 1}.0/24")
        self.switch = f"{self.prefix}sw"
        self.hosts: dict[str, Host] = {}
        for i, name in enumerate([control, *names]):
            last = 2 if i == 0 else 9 + i
            self.hosts[name] = Host(name, f"{self.prefix}{name}", i,
                                    str(self.mgmt_net.network_address + last),
                                    str(self.data_net.network_address + last))
        self.control = self.hosts[control]
        self.own_name_loopback = set(own_name_loopback)
        self.warm_server = warm_server
        self.procs: dict[str, subprocess.Popen] = {}
        self.snapshot_secret = os.urandom(32).hex()
        self.redis_password = secrets.token_hex(16)
        self.redis_socket = RUN / f"{self.prefix}redis.sock"
        self.redis_host: Host | None = None
        try:
            sweep(self.prefix)
            self._wire()
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # --- the network -----------------------------------------------------------------------

    def _wire(self) -> None:
        _ip("netns", "add", self.switch)
        for bridge in ("brmgmt", "brdata"):
            _ip("-n", self.switch, "link", "add", "name", bridge, "type", "bridge")
            _ip("-n", self.switch, "link", "set", "dev", bridge, "up")
        for host in self.hosts.values():
            _ip("netns", "add", host.ns)
            _ip("-n", host.ns, "link", "set", "dev", "lo", "up")
            for side, ifname, addr, bridge, net in (
                    ("m", MGMT_IF, host.mgmt, "brmgmt", self.mgmt_net),
                    ("d", DATA_IF, host.data, "brdata", self.data_net)):
                port = f"{side}{host.index}"
                # Made in place: neither end ever exists in the root namespace.
                _ip("link", "add", "name", ifname, "netns", host.ns, "type", "veth", "peer",
                    "name", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", "dev", port, "master", bridge, "up")
                _ip("-n", host.ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", ifname)
                _ip("-n", host.ns, "link", "set", "dev", ifname, "up")
            folder = Path("/etc/netns") / host.ns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(self.hosts_file(host))

    def hosts_file(self, host: Host) -> str:
        """`host`'s /etc/hosts: every host's name at its management address; its own at
        127.0.1.1 where the test says so (Debian's way)."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        if host.name in self.own_name_loopback:
            lines.append(f"127.0.1.1\t{host.name}")
        lines += [f"{h.mgmt}\t{h.name}" for h in self.hosts.values()
                  if not (h is host and host.name in self.own_name_loopback)]
        return "\n".join(lines) + "\n"

    def _links(self, name: str, net: str) -> list[str]:
        sides = {"mgmt": ["m"], "data": ["d"], "both": ["m", "d"]}
        if net not in sides:
            raise ValueError(f"net must be mgmt, data or both, not {net!r}")
        return [f"{side}{self.hosts[name].index}" for side in sides[net]]

    def cut(self, name: str, net: str = "both") -> None:
        """Host `name` silently off network `net` (mgmt, data or both): the switch's side of
        its veth down (what that does to TCP: the module docstring)."""
        for port in self._links(name, net):
            _ip("-n", self.switch, "link", "set", "dev", port, "down")

    def heal(self, name: str, net: str = "both") -> None:
        for port in self._links(name, net):
            _ip("-n", self.switch, "link", "set", "dev", port, "up")

    # --- processes -------------------------------------------------------------------------

    def start(self, name: str, host: str, argv: list[str], env: dict | None = None,
              stdin: bytes | None = None) -> subprocess.Popen:
        """`argv` in host `host`, as process `name` (log: `<logdir>/<name>.log`, appended to:
        a restarted process keeps its log), with this environment and `env`."""
        from optimus.contract.process import die_with_parent

        h = self.hosts[host]
        with open(self.logdir / f"{name}.log", "ab") as out:
            p = subprocess.Popen(
                ["ip", "netns", "exec", h.ns, sys.executable, "-c", ENTER, h.name, *argv],
                cwd=ROOT, env={**os.environ, **(env or {})},
                stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent)
        if stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                p.stdin.write(stdin)
            p.stdin.close()
        self.procs[name] = p
        return p

    def start_redis(self, host: str | None = None) -> None:
        """redis-server on `host` (the control host), bound to its management address and to
        a Unix socket for the test, with a password; no persistence."""
        self.redis_host = self.hosts[host] if host else self.control
        config = "".join(f"{line}\n" for line in (
            f"port {REDIS_PORT}", f"bind {self.redis_host.mgmt}", 'save ""', "appendonly no",
            f"dir {self.logdir}", f"unixsocket {self.redis_socket}", "unixsocketperm 700",
            f"requirepass {self.redis_password}"))
        self.start("redis", self.redis_host.name, ["redis-server", "-"], stdin=config.encode())
        deadline = time.monotonic() + 20
        while not self._redis_answers():
            if time.monotonic() > deadline or self.procs["redis"].poll() is not None:
                raise RuntimeError(f"redis-server did not start: {self.log('redis')[-2000:]}")
            time.sleep(0.05)

    def _redis_answers(self) -> bool:
        import redis

        with contextlib.suppress(redis.RedisError, OSError), redis.Redis.from_url(
                self.observer_url, socket_timeout=1) as r:
            return bool(r.ping())
        return False

    @property
    def redis_url(self) -> str:
        """Redis as every host reaches it: by the Redis host's name, over the management
        network."""
        return f"redis://default:{self.redis_password}@{self.redis_host.name}:{REDIS_PORT}/0"

    @property
    def observer_url(self) -> str:
        """Redis as the test process reaches it: its Unix socket, which no cut touches."""
        return f"unix://default:{self.redis_password}@{self.redis_socket}?db=0"

    def store(self, job: str):
        from controller.store.store import Store

        return Store(self.observer_url, job)

    def start_agent(self, host: str, node: str | None = None, *, job: str = "e2e",
                    interval_s: float = 0.25, advertise: str | None = "data",
                    env: dict | None = None, name: str | None = None) -> subprocess.Popen:
        """The agent of node `node` (default: the host's name) in host `host`, advertising
        its data address (`advertise="data"`), another (`advertise=ADDR`) or none (None: its
        hostname, the agent's default). Its ranks use data0 (GLOO_SOCKET_IFNAME)."""
        node = node or host
        addr = self.hosts[host].data if advertise == "data" else advertise
        argv = [sys.executable, "-m", "controller", "agent", "--job", job, "--node", node,
                "--interval", str(interval_s), *(["--host", addr] if addr else [])]
        agent_env = {"REDIS_URL": self.redis_url,
                     "OPTIMUS_SNAPSHOT_SECRET": self.snapshot_secret,
                     "GLOO_SOCKET_IFNAME": DATA_IF}
        if self.warm_server:
            agent_env.update({WARM_COMMAND: json.dumps(
                [sys.executable, str(Path(__file__).with_name("warm_client.py"))]),
                WARM_SERVER: self.warm_server.path})
        return self.start(name or f"agent-{node}", host, argv, {**agent_env, **(env or {})})

    def start_controller(self, job_file: Path, nodes: int, ranks_per_node: int = 1, *,
                         host: str | None = None, name: str = "controller",
                         args: tuple[str, ...] = ("--exit-when-done",),
                         env: dict | None = None) -> subprocess.Popen:
        argv = [sys.executable, "-m", "controller", "controller", str(job_file), "--nodes",
                str(nodes), "--ranks-per-node", str(ranks_per_node), "--id", name, *args]
        return self.start(name, host or self.control.name, argv,
                          {"REDIS_URL": self.redis_url, **(env or {})})

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal process `name` alone (not its session: an agent's ranks die of their own
        accord when it does, as on a real node)."""
        with contextlib.suppress(ProcessLookupError):
            self.procs[name].send_signal(sig)

    def log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        sweep(self.prefix)


@contextlib.contextmanager
def simulated_hosts(logdir: Path, names: list[str], **kwargs):
    """`Hosts` for a `with` block (a module-scoped fixture's): skipped where they cannot run,
    removed at the end whatever happened."""
    why = unavailable()
    if why:
        pytest.skip(why)
    h = Hosts(logdir, names, **kwargs)
    try:
        yield h
    finally:
        h.close()


def same_host(pid: int, other: int) -> bool:
    """Whether processes `pid` and `other` share their network, UTS and mount namespaces."""
    return all(os.readlink(f"/proc/{pid}/ns/{k}") == os.readlink(f"/proc/{other}/ns/{k}")
               for k, _ in NAMESPACES)


# --- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def host_warm_server(request, tmp_path_factory):
    """This module's warm server for the session's simulated hosts (None in --fast, and where
    simulated hosts cannot run)."""
    if request.config.getoption("fast", default=False) or unavailable():
        yield None
        return
    from hosts_warm import start_warm_server

    proc, server = start_warm_server(tmp_path_factory.mktemp("hosts-warm"))
    try:
        yield server
    finally:
        proc.kill()
        proc.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(server.path)


@pytest.fixture
def hosts(tmp_path, host_warm_server):
    """`hosts(*names, own_name_loopback=(), control="control")` -> `Hosts`: simulated hosts
    (module docstring), all removed after the test, whatever its outcome."""
    why = unavailable()
    if why:
        pytest.skip(why)
    made: list[Hosts] = []

    def make(*names: str, **kwargs) -> Hosts:
        made.append(Hosts(tmp_path / "hosts", list(names), warm_server=host_warm_server,
                          **kwargs))
        return made[-1]
    try:
        yield make
    finally:
        for h in made:
            h.close()
