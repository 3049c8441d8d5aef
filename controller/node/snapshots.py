"""A node's in-memory snapshots, kept by its agent: the folder its ranks write into, the push of
each complete point to the node's buddy, the replicas it holds for other nodes, and the pull a
replacement node makes before its ranks start.

    /dev/shm/optimus-<uid>/<job>/<node>.<agent pid>/own/...    this node's ranks' shards
                                                   held/...   replicas of other nodes' shards

(optimus/checkpoint/snapshot_files.py names what lies inside.) The folder is shared memory that
belongs to the agent, not to a rank: a crashed rank or a restarted generation loses nothing. A
new agent process is a rebooted node: it empties the folder, since nothing from before is
vouched for. The controller learns what each node holds from a small report the agent writes
to Redis when it changes (`OwnRecords.set_snapshots`); the bytes never go through Redis.

Transport, agent to agent, one TCP connection per transfer (snapshot_link.py: the key, the
wire format, TLS, and what bounds a stranger's connection): files streamed straight to and from
shared memory, every one checked against its marker's sha256 on receipt; a replica lands in
`held/` only when all of its files check (renamed in, markers last). Only agents given the
job's snapshot secret (OPTIMUS_SNAPSHOT_SECRET or OPTIMUS_SNAPSHOT_SECRET_FILE) push or pull.
An agent without one starts no server and sends nothing: its address is "", so the controller
names it no one's buddy or holder; its ranks' snapshots stay on the node, a pull it would make
fails at once (its ranks then resume from disk), and the job runs on.

Concurrency. Transfers run on the server's threads and the keeper's pool while the agent's tick
runs retention, and one point may arrive twice at once (a retried push, two pushers). Each
receive streams into a private folder; its install into `held/`, retention, and the opening of
a point's files to serve it take the keeper's `lock`, so retention never sees a point half
installed. Files are opened before they are sent: what retention removes meanwhile is still read.

- push (`{"op": "push", "point", "files": [marker, ...]}` + the files' bytes): the buddy stores
  them under held/<point>/ and answers {"ok": true}; the pusher reports the point replicated.
- pull (`{"op": "pull", "point", "ranks"}`): the holder answers with the markers, then the
  bytes, from own/ or held/.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from controller.node.snapshot_link import (
    PORT_ENV,
    LinkTLS,
    bind_address,
    link_tls,
    listen_port,
    pull,
    push,
    secret_problem,
)
from controller.node.snapshot_link import job_secret as job_secret  # the agent's import
from controller.node.snapshot_server import LinkServer
from optimus.checkpoint.snapshot_files import (
    HELD,
    OWN,
    complete_shards,
    parse_point,
    point_name,
    points,
    remove_point,
    void,
)
from optimus.contract.records import Plan

log = logging.getLogger("optimus.agent")

# A point folder, as a poll reads it: (step, generation, path, its complete shards: rank -> marker)
Point = tuple[int, int, Path, dict[int, dict]]

KEEP = 2  # complete points kept per folder (and the one the running generation resumed from)
# ... and while the controller names no usable point of the generation to keep (its first
# seconds, a controller that lags or is away): the nodes' pushes may not meet, and the newest
# point every node confirmed can then be older than a node's two newest confirmed ones.
UNNAMED_KEEP = 4


def default_root() -> Path:
    """Shared memory when the machine has it (Linux /dev/shm), else the temporary folder."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"optimus-{os.getuid()}"


def node_folder(root: Path, job: str, node: str) -> Path:
    """This agent's folder, `<root>/<job>/<node>.<agent pid>`: its own, even where several
    agents share a machine (tests, `optimus run`); the folders of agents of the node that are
    gone (killed: no chance to clean up) are removed now, as a rebooted node's memory is."""
    parent = Path(root) / job
    for old in parent.glob(f"{glob.escape(node)}.*"):
        pid = old.name.rpartition(".")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return parent / f"{node}.{os.getpid()}"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SnapshotKeeper:
    def __init__(self, root: Path, node: str, secret: bytes | None, host: str):
        """`secret`: the job's snapshot key (snapshot_link.job_secret), None where there is
        none: then no server starts, nothing is sent, and one line says why."""
        self.root, self.node, self.secret = Path(root), node, secret
        self.incarnation = f"{os.getpid()}.{secrets.token_hex(3)}"
        shutil.rmtree(self.root, ignore_errors=True)  # a new agent: nothing before it counts
        self.own, self.held = self.root / OWN, self.root / HELD
        self.own.mkdir(parents=True, mode=0o700)
        self.held.mkdir(mode=0o700)
        self.lock = threading.Lock()  # the folder's layout: see "Concurrency" at the top
        self.tls: LinkTLS | None = None
        self.off: str | None = None  # why this node neither serves nor sends snapshots
        if secret is None:
            self.off = f"no snapshot secret: {secret_problem()}"
        else:
            try:
                self.tls = link_tls()
            except ValueError as e:
                self.off = str(e)
        self._server: LinkServer | None = None
        self.address = ""  # host:port of the server; "" where none runs
        if self.off is None:
            try:
                port = listen_port()
                self._server = LinkServer(self, bind_address(host), self.tls and self.tls.server,
                                          port)
                self.address = f"{host}:{self._server.port}"
            except ValueError as e:
                self.off = str(e)
            except OSError as e:
                self.off = (f"cannot listen on {bind_address(host)}:{port} "
                            f"({e.strerror or e}): free the port or set another in {PORT_ENV}")
        if self.off is not None:
            log.warning("%s serves no snapshots (no server on %s): %s. Its memory snapshots "
                        "stay on the node, neither replicated nor served; a restart resumes "
                        "from the disk checkpoint", node, bind_address(host), self.off)
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="snapshot-link")
        self._push: Future | None = None
        self._pushing: str | None = None
        self.replicated: dict[str, str] = {}  # point -> the buddy that confirmed it
        self.failed: dict[str, str] = {}  # point -> why its push failed
        self._fetch: Future | None = None
        self._fetch_key: tuple | None = None
        # Called (from the pull's thread) once a pull for a plan ends: the agent looks at its
        # plan again then, not at its next tick (a heartbeat interval later).
        self.on_pulled: Callable[[], None] | None = None
        self._reported: str | None = None
        # The point the controller names for every node to push next, and to keep meanwhile
        # (controller/control/snapshot_watch.py: where the nodes' own choices do not meet),
        # and the usable point it names for every node to keep until a newer one is usable.
        self.align: str | None = None
        self.keep: str | None = None

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self.root, ignore_errors=True)

    # --- the agent's tick ----------------------------------------------------------------------

    def poll(self, plan: Plan | None, generation: int | None, lineage: list | None = None,
             *, full: bool = True) -> dict | None:
        """Every 50 ms: push the newest complete point of the running generation to the buddy
        when it is not there yet. With `full` (the agent's tick), and at once when a push has
        ended, also drop void and old points (`lineage`: the latest plan's, see
        snapshot_files.void) and return the report when it changed since the last. A poll reads
        each shard marker at most once; one that is not full, only those of unsent points."""
        running = (plan is not None and generation is not None
                   and plan.generation == generation and self.node in plan.nodes)
        full = (running and self._push_ended(plan)) or full
        own = held = None
        if full:
            keep = {self.align, self.keep, _resume_point(plan) if plan is not None and
                    plan.generation == generation else None} - {None}
            with self.lock:
                own, held = _scan(self.own), _scan(self.held)
                confirmed = set(self.replicated)
                keep |= {_shared(own, held, confirmed, lineage or [])} - {None}
                # (a lone node, sending and holding no copies, is out of step with no one)
                depth = UNNAMED_KEEP if not self.keep and (confirmed or held) else KEEP
                own = _retain_own(own, confirmed, keep, lineage or [], depth)
                held = _retain_held(held, keep, lineage or [], depth)
        if running:
            self._replicate(plan, own)
        if not full:
            return None
        report = self._report(own, held)
        text = json.dumps(report, sort_keys=True)
        if text == self._reported:
            return None
        self._reported = text
        return report

    def unreported(self) -> None:
        """The last report did not reach the store: send it again next time."""
        self._reported = None

    def _report(self, own_points: list[Point], held_points: list[Point]) -> dict:
        """What the controller plans with: `own` and `held` (point -> the ranks whose shards are
        complete), `taken` (point -> when its earliest shard here was written), `replicated`,
        and the `incarnation` of this agent (a node that comes back under its name is a new
        one: OwnRecords.set_snapshots keeps the old one's report apart)."""
        own, held, taken = {}, {}, {}
        for found, out in ((own_points, own), (held_points, held)):
            for _, _, path, shards in found:
                out[path.name] = sorted(shards)
                times = [m["time"] for m in shards.values()
                         if isinstance(m.get("time"), int | float)]
                if times:
                    taken[path.name] = min([*times, taken.get(path.name, min(times))])
        return {"addr": self.address, "incarnation": self.incarnation, "own": own,
                "held": held, "taken": taken,
                "replicated": {p: b for p, b in self.replicated.items()
                               if (self.own / p).is_dir()}}

    def _push_ended(self, plan: Plan) -> bool:
        """Whether the running push has ended (its outcome is then noted)."""
        if self._push is None or not self._push.done():
            return False
        holder = plan.buddies.get(self.node)
        point, buddy = self._pushing, holder and holder.node
        try:
            self._push.result()
            self.replicated[point] = buddy
            self.failed.pop(point, None)
        except (OSError, ValueError) as e:
            self.failed[point] = str(e)
            log.warning("snapshot %s not replicated to %s: %s", point, buddy, e)
        self._push = self._pushing = None
        return True

    def _replicate(self, plan: Plan, scanned: list[Point] | None) -> None:
        """Push the point the controller named (`align`) if it is here whole and has not
        gone, else the newest complete point of the plan's generation unless it went already;
        `scanned`: this poll's own points with their shards, else markers are read here."""
        buddy = plan.buddies.get(self.node)
        if self._push is not None or buddy is None or self.off:
            return
        mine = set(_node_ranks(plan, self.node))
        found = scanned if scanned is not None else [(*p, None) for p in points(self.own)]

        def whole(path: Path, shards: dict | None) -> bool:
            return mine <= set(complete_shards(path) if shards is None else shards)

        def start(path: Path) -> None:
            self._pushing = path.name
            self._push = self._pool.submit(push, buddy.addr, self.secret, path, sorted(mine),
                                           self._client_tls)
        gone = set(self.replicated) | set(self.failed)
        for _, gen, path, shards in found:
            if path.name == self.align and path.name not in gone:
                if gen == plan.generation and whole(path, shards):
                    return start(path)
                break
        for _, gen, path, shards in reversed(found):
            if gen != plan.generation:
                continue
            if path.name in gone:
                return  # the newest complete point went already (only complete ones go)
            if path.name != self.align and whole(path, shards):  # (the named one is not whole)
                return start(path)  # only the newest complete point is worth sending

    # --- a generation's start ------------------------------------------------------------------

    def resume_dir(self, plan: Plan) -> tuple[str, Path | None]:
        """Where this node's ranks load the plan's memory point from: ("ready", folder),
        ("waiting", None) while a pull from the holder runs, ("none", None) when the plan names
        none. A pull that failed leaves ("ready", the empty folder): the ranks then find their
        shards missing and all resume from disk, saying so."""
        memory = plan.memory
        if memory is None:
            return "none", None
        name = point_name(memory.step, memory.generation)
        mine = set(_node_ranks(plan, self.node))
        for folder in (self.own / name, self.held / name):
            if mine <= set(complete_shards(folder)):
                return "ready", folder
        holder = memory.holders.get(self.node)
        key = (plan.generation, name)
        if holder is None:
            return "ready", self.held / name
        if self._fetch_key != key:
            self._fetch_key = key
            if self.off:
                self._fetch = Future()
                self._fetch.set_exception(ValueError(f"this node fetches no snapshots: "
                                                     f"{self.off}"))
            else:
                self._fetch = self._pool.submit(pull, holder.addr, self.secret,
                                                self.held / name, sorted(mine), self.lock,
                                                self._client_tls)
            self._fetch.add_done_callback(lambda _: self.on_pulled and self.on_pulled())
        if not self._fetch.done():
            return "waiting", None
        with contextlib.suppress(Exception):
            self._fetch.result()
        return "ready", self.held / name

    @property
    def _client_tls(self):
        return self.tls and self.tls.client

    def fetch_error(self) -> str | None:
        if self._fetch is None or not self._fetch.done():
            return None
        exc = self._fetch.exception()
        return None if exc is None else str(exc)


def _node_ranks(plan: Plan, node: str) -> range:
    """The ranks whose shards this node's ranks write and load. Under replicas that carry on,
    a rank's shard is named by its rank in its replica's world (only the writer replica takes
    snapshots; every replica loads them: docs/replicas.md)."""
    rpn = plan.ranks_per_node
    i = plan.nodes.index(node) % plan.replica_nodes
    return range(i * rpn, (i + 1) * rpn)


def _resume_point(plan: Plan) -> str | None:
    memory = plan.memory
    return point_name(memory.step, memory.generation) if memory is not None else None


def _scan(folder: Path) -> list[Point]:
    """The points in `folder`, oldest step first, each with its complete shards (rank ->
    marker): every marker read once."""
    return [(step, gen, path, complete_shards(path)) for step, gen, path in points(folder)]


def _current(found: list[Point], lineage: list) -> list[Point]:
    """The points on the plan's line of generations; void ones are removed (a rollback
    abandoned them: newer by step, they would otherwise pass for the newest)."""
    kept = []
    for point in found:
        if void(point[0], point[1], lineage):
            remove_point(point[2])
        else:
            kept.append(point)
    return kept


def _shared(own: list[Point], held: list[Point], replicated: set[str],
            lineage: list) -> str | None:
    """The newest point this node and the nodes that push to it have surely both replicated:
    its own shards whole and confirmed by its buddy, and, for every rank whose shards come
    here, that rank's shard held here whole. Should this node's buddy or a pusher be lost, it is
    the point their slots can resume from, however far this node's own pushes ran ahead of
    theirs (one point, kept whatever the depth and whether or not the controller named one).
    None when some rank held here shares no point with it."""
    mine = {path.name for step, gen, path, _ in own
            if path.name in replicated and not void(step, gen, lineage)}
    newest: dict[int, tuple[int, int]] = {}  # rank held here -> its newest shared point
    ranks: set[int] = set()
    for step, gen, path, shards in held:  # oldest first
        ranks |= set(shards)
        if path.name in mine:
            for rank in shards:
                newest[rank] = max(newest.get(rank, (step, gen)), (step, gen))
    if not newest or set(newest) != ranks:
        return None
    return point_name(*min(newest.values()))


def _retain_own(found: list[Point], replicated: set[str], keep_also: set[str],
                lineage: list, depth: int = KEEP) -> list[Point]:
    """This node's points: keep the newest KEEP its buddy confirmed and every newer one (being
    written or replicated), the point the running generation resumed from and the one the
    controller names (`keep_also`); before any is confirmed, the newest KEEP. The newest point
    committed for the whole job (every node's shards replicated) may be one behind this node's
    newest confirmed one: keeping both lets a surviving node load its own copy instead of
    fetching it. While the controller names no usable point (`depth` UNNAMED_KEEP), the newest
    `depth` stay too, confirmed or not: a node whose pushes ran ahead of its buddy's would
    otherwise drop its only copy of the one point they both confirmed. Returns those kept."""
    found = _current(found, lineage)
    confirmed = [path for _, _, path, _ in found if path.name in replicated]
    floor = (confirmed[-KEEP:][0] if confirmed else
             found[-KEEP][2] if len(found) >= KEEP else None)
    if floor is not None and depth > KEEP:
        wider = found[-depth][2] if len(found) >= depth else None
        floor = wider and min(floor, wider, key=lambda path: parse_point(path.name))
    if floor is None:
        return found
    kept = []
    for point in found:
        path = point[2]
        if parse_point(path.name) < parse_point(floor.name) and path.name not in keep_also:
            remove_point(path)
        else:
            kept.append(point)
    return kept


def _retain_held(found: list[Point], keep_also: set[str], lineage: list,
                 depth: int = KEEP) -> list[Point]:
    """Replicas: for every rank, the newest `depth` points that hold its shard (pushers are not
    in step: one node's newest may be another's older), the resumed-from point and the one the
    controller names (`keep_also`). Returns the points kept."""
    found = _current(found, lineage)
    keep, seen = set(keep_also), {}
    for _, _, path, shards in reversed(found):
        for rank in shards:
            if seen.get(rank, 0) < depth:
                seen[rank] = seen.get(rank, 0) + 1
                keep.add(path.name)
    for _, _, path, _ in found:
        if path.name not in keep:
            remove_point(path)
    return [point for point in found if point[2].name in keep]
