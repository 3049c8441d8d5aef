"""The node agent: one per node, it owns the ranks there.

    optimus agent --job NAME --node NODE        (REDIS_URL, with its password, in the environment)

It registers the node (host, devices, health check), then loops:
- every `interval` s, one pipelined round trip (`Store.agent_tick`): its own beat and status,
  its ranks' latest heartbeats and the node's heartbeat deadline; back come the plan and any
  chaos commands; then the in-memory snapshots' retention and report (snapshots.py);
- every 50 ms, `waitpid` on its ranks (an exit is reported at once, with its code, signal and
  the last lines of its own output), a drain of the ranks' heartbeat datagrams, and the push of
  a new complete snapshot point to the buddy.

Plans are desired state: the agent runs the ranks of a "run" plan that names its node, stops
(SIGTERM, then SIGKILL after the plan's grace) ranks of a generation that is over or told to
"stop", and exits after "end". No plan (Redis restarted empty, an outage) changes nothing: the
ranks keep training and the agent re-registers when Redis is back.

Ranks run `optimus train JOB` in their own session, with the normalised environment
(OPTIMUS_*), output to `<log_dir>/gen_<g>/rank_<r>.log`, and PR_SET_PDEATHSIG so they die with
the agent (a lost node takes its ranks with it, as a real one does). They are forked from a
warm process that imported the trainer once (controller/node/spawn.py,
optimus/supervision/warm.py), so a generation starts without seconds of imports per rank.

The heartbeat protocol (rank -> agent) is one JSON datagram per interval on a Unix datagram
socket (OPTIMUS_AGENT_SOCKET); see optimus/supervision/heartbeat.py. Datagrams, not a stream:
a rank never blocks on a slow or absent agent, and the agent never waits on a rank. The other
way, the agent relays the job's control word (operators' pause and checkpoint-now, from the
`control` key it reads every tick) into a small file the ranks stat at every step boundary
(OPTIMUS_CONTROL_FILE), rewritten atomically when the word changes (a plan that stops a
generation with `"save": false`, on evidence of wrong arithmetic, adds `"save": false` to it
before the SIGTERM: the ranks then stop without a checkpoint); and an operator's
`chaos hang-rank|stall-rank|nan-rank` into another (OPTIMUS_CHAOS_FILE, see
optimus/supervision/faults.py). What the three share (phases, exit statuses, fault kinds,
environment names, the plan and exit records) is optimus/contract/.

Beside this module: how it follows plans and runs its ranks (lifecycle.py: launches, stops,
exits, heartbeats, in-process restarts), the commands it takes (commands.py: stacks, faults),
its node's checks (checks.py) and what it sums up of its ranks (ranks.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

from controller.common import reach
from controller.disk import Rewritten
from controller.node.addresses import node_addresses
from controller.node.checks import Checks
from controller.node.commands import Commands
from controller.node.folders import private_folder
from controller.node.lifecycle import Lifecycle
from controller.node.ports import PortOffer
from controller.node.ranks import (
    RankProcess,
    deadline,
    rank_states,
    summary,
)
from controller.node.snapshots import SnapshotKeeper, default_root, job_secret, node_folder
from controller.node.spawn import Spawner, launcher_variables, start_mode
from controller.store import wake
from controller.store.connect import Denied
from controller.store.store import Store, StoreUnavailable
from controller.store.wake import Waker
from optimus.config import ConfigError
from optimus.contract.records import ExitRecord

log = logging.getLogger("optimus.agent")

POLL_S = 0.05


class Agent(Lifecycle, Commands, Checks):
    def __init__(self, store: Store, node: str, *, interval_s: float = 1.0,
                 host: str | None = None, socket_dir: str | None = None,
                 snapshot_root: Path | None = None):
        self.store, self.node, self.interval_s = store, node, interval_s
        store.speak_as(node)  # every write under this node's own keys (controller/store/own.py)
        self.host = host or socket.gethostname()
        self.procs: dict[int, RankProcess] = {}
        self.leaving: list[RankProcess] = []  # told to exit, no longer of any generation
        self.next_files: set[Path] = set()  # words to ranks waiting in process (lifecycle.py)
        self.restarts = {"in_process": 0, "process": 0}  # ranks of generations after the first
        self.ran_since_ok = False  # ranks ran here since the last passing health check
        self.beats: dict[int, dict] = {}
        self.generation: int | None = None  # the generation launched here, if any
        self.plan: dict | None = None  # its plan
        self.waiting_port: dict | None = None  # a run plan waiting for node 0's master port
        self.ports = PortOffer()  # the rendezvous port offered for the next plan (ports.py)
        self.unreported: list[ExitRecord] = []  # exits Redis has not taken yet
        self.reset_ranks = True
        self.plan_stamp: str | None = None  # of the last plan read
        self.latest_plan: dict | None = None
        self.ended = False
        # Set while no plan but an ended one was seen (lifecycle.FRESH_END_S): when it came.
        self.end_seen: float | None = time.monotonic()
        self.redis_down = False
        self.waker = Waker(store, wake.AGENTS, min_gap_s=POLL_S)  # controller/store/wake.py
        self.told: tuple | None = None  # the state the controller last heard (`_told`)
        self.corrupt_tiles: set[int] = set()  # fault injection: tiles whose checks go wrong
        self.checked_for: int | None = None  # the generation the last pre-launch check was for
        self.fit_for = True
        self.refusal: dict | None = None  # the generation this node cannot run, and why
        # Private folders under guessable names (folders.py): checked before anything is in them.
        sock_dir = private_folder(Path(socket_dir or tempfile.gettempdir())
                                  / f"optimus-{os.getuid()}")
        snapshot_root = snapshot_root or private_folder(default_root())
        # In-memory snapshots: this node's ranks' and the replicas it holds for its peers.
        self.snapshots = SnapshotKeeper(node_folder(snapshot_root, store.job, node),
                                        node, job_secret(), self.host)
        self.snapshots.on_pulled = self.waker.poke  # a pulled point: launch now (lifecycle.py)
        self._snapshots_stored = False  # this incarnation has reported once
        self.failed_saves = 0  # checkpoint saves failed in a row, as this node's ranks last said
        # The warm process first: the health check runs in a child of it (checks.py); standby
        # mode once that check has found GPUs or XPUs (controller/node/spawn.py).
        self.spawner = Spawner(mode=start_mode(None))
        # Where it runs and whether its address is loopback: the controller refuses a node
        # other hosts cannot reach (reach.py).
        self.info = {"host": self.host, "pid": os.getpid(), "machine": reach.machine(),
                     "loopback": reach.loopback(self.host),
                     "addresses": node_addresses(),  # what its ranks' peers name (addresses.py)
                     "snapshot_addr": self.snapshots.address, **self._check_health()}
        self.spawner.mode = start_mode(self.info.get("device_kind"))
        tag = hashlib.sha1(f"{store.job}/{node}/{os.getpid()}".encode()).hexdigest()[:12]
        self.socket_path = str(sock_dir / f"agent-{tag}.sock")  # short: AF_UNIX paths <= 107
        self.control_path = sock_dir / f"agent-{tag}.control"
        self.control_writes = Rewritten(self.control_path, "its ranks' control file")
        self.control: dict = {}
        self.no_save = False  # this generation's ranks are to stop without a checkpoint
        self._write_control({})
        self.chaos_path = sock_dir / f"agent-{tag}.chaos"
        self.chaos_writes = Rewritten(self.chaos_path, "its ranks' chaos file")
        self.chaos: list[dict] = []  # operators' rank faults for this generation's ranks
        self._write_chaos([])
        self._stacks_lock = threading.Lock()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.socket_path)
        self.sock.setblocking(False)

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        dropped = launcher_variables(os.environ)
        if dropped:  # once: a batch template's exports, which would outrank the plan
            log.warning("this node's ranks do not inherit %s from the agent's environment: "
                        "under an agent the controller's plan says where each rank sits and "
                        "where rank 0 listens", ", ".join(dropped))
        self._register()
        next_tick, woken = 0.0, False
        try:
            while not (self.ended and not self.procs):
                self._reap()
                self._drain_heartbeats()
                now = time.monotonic()
                tick = now >= next_tick or woken
                if tick:  # a fixed cadence: late ticks do not push the next; a wake restarts it
                    next_tick = (now + self.interval_s if woken else
                                 max(next_tick + self.interval_s, now - self.interval_s / 2))
                    self._tick()
                self._escalate()
                # A new point goes to the buddy at once, and is reported once it is there;
                # retention and the report run with the tick.
                if not self.redis_down:
                    self._report_snapshots(full=tick)
                woken = self.waker.wait(POLL_S)  # a new plan, control word or port: tick now
            self._flush_exits()
            with contextlib.suppress(StoreUnavailable):
                self.store.leave(self.node)
                self.store.event(f"agent:{self.node}", "agent", f"agent of {self.node} exits: "
                                 "the job ended")
            return 0
        finally:
            self.waker.close()
            self.ports.close()
            self.mesh.close()
            self.spawner.close()
            self.snapshots.close()
            self.sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
            for path in (self.control_path, self.chaos_path, *self.next_files):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def stop_all_now(self) -> None:
        """On the agent's own SIGTERM/SIGINT: terminate the ranks, then go (they die with us)."""
        for p in [*self.procs.values(), *self.leaving]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.popen.pid, signal.SIGTERM)

    def _register(self) -> None:
        while True:
            try:
                self.store.register_node(self.node, self.info)
                self._refuse_if_isolated()
                self.store.event(f"agent:{self.node}", "register", f"node {self.node} "
                                 f"registered (host {self.host}, {self.info['devices']} "
                                 f"device(s), health {self.info['health']})",
                                 node=self.node)
                return
            except StoreUnavailable as e:
                self._note_outage(e)
                time.sleep(self.interval_s)

    def _refuse_if_isolated(self) -> None:
        """A node that advertises loopback while another of the job runs on another host
        leaves at once, with the one line that says how to fix it (reach.py): its ranks would
        hang every generation. The controller refuses it too, should it register first."""
        try:
            others = self.store.nodes()
        except Denied:  # an agent's ACL reads no other node's record: the controller judges
            return
        why = reach.isolated(self.node, self.info, others)
        if why is None:
            return
        self.store.event(f"agent:{self.node}", "node_refused", why, node=self.node)
        self.store.leave(self.node)
        raise ConfigError(f"optimus agent --node {self.node}", why)

    def _status(self) -> dict:
        live = [p for p in self.procs.values() if p.running]
        state = ("stopping" if any(p.stop_sent for p in live) else "running" if live
                 else "starting" if self.waiting_port else "idle")
        return {"generation": -1 if self.generation is None else self.generation,
                "state": state, "live_ranks": len(live), "host": self.host,
                "pids": [p.popen.pid for p in live], "rank_states": rank_states(live, self.beats),
                "failed_saves": self.failed_saves, "refused": self.refusal or "",
                "waiting_ranks": len(self._waiting()), "restarts": self.restarts,
                "next_port": self.ports.port, "mesh": self.mesh.report() or ""}

    @staticmethod
    def _told(status: dict) -> tuple:
        """What the controller plans on: a change of it wakes the controller."""
        return tuple(status[k] for k in ("generation", "state", "live_ranks", "waiting_ranks",
                                         "refused", "mesh"))

    def _tick(self) -> None:
        status = self._status()
        live = [p for p in self.procs.values() if p.running]
        try:
            self._flush_exits()
            tick = self.store.agent_tick(self.node, status, dict(self.beats),
                                         deadline(live, self.beats, self.plan),
                                         self.reset_ranks, summary(live, self.beats))
        except StoreUnavailable as e:
            self._note_outage(e)
            return
        if self.redis_down:
            self.redis_down = False
            log.warning("Redis answers again")
        self.reset_ranks = False
        self.snapshots.align, self.snapshots.keep = tick.align, tick.keep
        if self.store.unsent:  # events an outage held back
            try:
                self.store.flush_events()
            except StoreUnavailable as e:
                self._note_outage(e)
        if not tick.registered:  # Redis lost our record: restarted empty, or flushed
            self._register()
            self.reset_ranks = True
        for command in tick.commands:
            self._command(command)
        if tick.control is not None and tick.control != self.control:
            self._write_control(tick.control)
        elif self.control_writes.failing:  # the disk refused the last word: again
            self._write_control(self.control)
        if tick.plan_stamp is not None and tick.plan_stamp != self.plan_stamp:
            try:  # a plan refused (decode.checked) leaves the last one standing, said once
                self.latest_plan = self.store.plan() or self.latest_plan
            except StoreUnavailable as e:
                self._note_outage(e)
                return
            self.plan_stamp = tick.plan_stamp
            for line in self.store.records.take():
                self._event("record_refused", f"agent of {self.node} ignores a record in "
                            f"Redis: {line}")
        told = self._told(status)
        if told != self.told:  # the controller looks now, not at its next tick
            wake.publish(self.store, wake.CONTROLLER)
            self.told = told
        if self.latest_plan is not None:
            self._follow(self.latest_plan)
            self._keep_standbys()
        self._check_node_faults()
        self._check_mesh()  # the ring's neighbours, while a run plan stands (checks.py)
        if self._told(self._status()) != told:  # launched, stopped: say so at the next turn
            self.waker.poke()
        self._check_ahead()  # between generations: the next plan's check, before it comes

    def _keep_standbys(self) -> None:
        """Standby mode: a ready process per local rank of the job's layout for the next
        generation, on spares and on nodes whose ranks run. A used one is replaced only once
        every rank here has taken a step: its imports would slow this generation's start."""
        rpn = self.latest_plan.get("ranks_per_node")
        live = [p for p in self.procs.values() if p.running]
        if rpn and all(self.beats.get(p.local_rank, {}).get("step", 0) >= 1 for p in live):
            self.spawner.keep_ready(rpn)

    def _report_snapshots(self, full: bool) -> None:
        report = self.snapshots.poll(self.plan, self.generation,
                                     (self.latest_plan or {}).get("lineage"), full=full)
        if report is None:
            return
        try:
            self.store.set_snapshots(self.node, report, first=not self._snapshots_stored)
            self._snapshots_stored = True
        except StoreUnavailable as e:
            self.snapshots.unreported()
            self._note_outage(e)

    def _note_outage(self, e: Exception) -> None:
        if not self.redis_down:
            log.warning("Redis unreachable; the ranks keep running: %s", e)
        self.redis_down = True

    def _write_control(self, control: dict) -> None:
        """The control word for this node's ranks, replaced atomically (they stat it), with
        "save": false while this generation stops without a checkpoint. A write the disk
        refuses is said once and tried again every tick (controller/disk.py); the ranks act
        on the last word they read meanwhile."""
        self.control = dict(control)
        word = {**control, "save": False} if self.no_save else control
        turn = self.control_writes.write(json.dumps(word).encode())
        if turn is not None:
            self._event("disk", f"agent of {self.node} {turn.text}" + (
                "" if turn.ok else "; the ranks keep the last word they read, and the agent "
                "tries again every tick"), ok=turn.ok, path=str(self.control_path))

    def _event(self, kind: str, message: str, **fields) -> None:
        log.info(message)
        try:
            self.store.event(f"agent:{self.node}", kind, message, node=self.node, **fields)
        except StoreUnavailable as e:
            self._note_outage(e)

