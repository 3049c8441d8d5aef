"""The node agent: one per node, it owns the ranks there.

    optimus agent --job NAME --node NODE        (REDIS_URL, with its password, in the environment)

It registers the node (host, devices, health check), then loops:
- every `interval` s, one pipelined round trip (`OwnRecords.agent_tick`): its own beat and status,
  its ranks' latest heartbeats and the node's heartbeat deadline; back come the plan and any
  chaos commands; then the in-memory snapshots' retention and report (snapshots.py);
- every 50 ms, and at once when one of its ranks ends (a pidfd), `waitpid` on its ranks (an
  exit is reported at once, with its code, signal and the last lines of its own output), a
  drain of the ranks' heartbeat datagrams, and the push of a new complete snapshot point to the
  buddy.

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

The agent is made of parts that each own their state, beside this module: its ranks
(lifecycle.py `Ranks`: launches, stops, exits, heartbeats, in-process restarts), its node's
checks (checks.py `Checks`: health, the job, the mesh), the commands it takes (commands.py
`Commands`: stacks, faults), the files its ranks read (rank_files.py `RankFiles`) and its voice
(voice.py `Voice`: events, and whether Redis answers). This module holds the loop and the tick,
which read the plan (the contract's typed `Plan`) and hand it to the parts; ranks.py sums up
the ranks for the tick.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import tempfile
import time
from pathlib import Path

from controller.common import reach
from controller.node.addresses import node_addresses
from controller.node.checks import Checks
from controller.node.commands import Commands
from controller.node.folders import private_folder
from controller.node.lifecycle import Ranks
from controller.node.mesh import MeshCheck
from controller.node.rank_files import RankFiles
from controller.node.ranks import ExitWatch, deadline, rank_states, summary
from controller.node.snapshots import SnapshotKeeper, default_root, job_secret, node_folder
from controller.node.spawn import Spawner, launcher_variables, start_mode
from controller.node.voice import Voice
from controller.store import wake
from controller.store.connect import Denied
from controller.store.store import Store, StoreUnavailable
from controller.store.wake import Waker
from optimus.config import ConfigError
from optimus.contract.phases import STANDBY
from optimus.contract.records import Plan

log = logging.getLogger("optimus.agent")

POLL_S = 0.05


class Agent:
    """One node's agent: the loop and the tick, over parts that own their state (`ranks`,
    `checks`, `commands`, `files`, `voice`). What the tick reads (the plan, its stamp, whether
    Redis still holds the ranks' heartbeats of this generation) is the agent's own."""

    def __init__(self, store: Store, node: str, *, interval_s: float = 1.0,
                 host: str | None = None, socket_dir: str | None = None,
                 snapshot_root: Path | None = None):
        self.store, self.node, self.interval_s = store, node, interval_s
        store.own.speak_as(node)  # every write under this node's own keys (controller/store/own.py)
        self.host = host or socket.gethostname()
        self.voice = Voice(store, node)
        self.reset_ranks = True  # Redis's heartbeats of this node's ranks are another's
        self.plan_stamp: str | None = None  # of the last plan read
        self.latest_plan: Plan | None = None
        self.waker = Waker(store, wake.AGENTS)  # controller/store/wake.py
        self.exits = ExitWatch()  # a rank's exit ends the loop's wait
        self.told: tuple | None = None  # the state the controller last heard (`_told`)
        # Private folders under guessable names (folders.py): checked before anything is in them.
        sock_dir = private_folder(Path(socket_dir or tempfile.gettempdir())
                                  / f"optimus-{os.getuid()}")
        snapshot_root = snapshot_root or private_folder(default_root())
        # In-memory snapshots: this node's ranks' and the replicas it holds for its peers.
        self.snapshots = SnapshotKeeper(node_folder(snapshot_root, store.job, node),
                                        node, job_secret(), self.host)
        self.snapshots.on_pulled = self.waker.poke  # a pulled point: launch now (lifecycle.py)
        self._snapshots_stored = False  # this incarnation has reported once
        # The warm process first: the health check runs in a child of it (checks.py); standby
        # mode once that check has found GPUs or XPUs (controller/node/spawn.py).
        self.spawner = Spawner(mode=start_mode(None))
        # Where it runs and whether its address is loopback: the controller refuses a node
        # other hosts cannot reach (reach.py).
        facts = {"host": self.host, "pid": os.getpid(), "machine": reach.machine(),
                 "loopback": reach.loopback(self.host),
                 "addresses": node_addresses(),  # what its ranks' peers name (addresses.py)
                 "snapshot_addr": self.snapshots.address}
        self.checks = Checks(store, node, self.host, self.spawner,
                             MeshCheck(node, on_done=self.waker.poke), self.voice, facts)
        self.checks.first()
        self.spawner.mode = start_mode(self.checks.info.get("device_kind"))
        tag = hashlib.sha1(f"{store.job}/{node}/{os.getpid()}".encode()).hexdigest()[:12]
        self.files = RankFiles(sock_dir, tag, self.voice)
        self.ranks = Ranks(store, node, self.voice, checks=self.checks, files=self.files,
                           spawner=self.spawner, snapshots=self.snapshots,
                           socket_path=str(sock_dir / f"agent-{tag}.sock"),  # AF_UNIX: <= 107
                           poke=self.waker.poke)
        self.commands = Commands(store, node, self.voice, self.ranks, self.checks, self.files)

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        dropped = launcher_variables(os.environ)
        if dropped:  # once: a batch template's exports, which would outrank the plan
            log.warning("this node's ranks do not inherit %s from the agent's environment: "
                        "under an agent the controller's plan says where each rank sits and "
                        "where rank 0 listens", ", ".join(dropped))
        self._register()
        next_tick, woken = 0.0, False
        ranks = self.ranks
        try:
            while not (ranks.ended and not ranks.procs):
                self.spawner.collect()  # the warm process's reports: its pipe read empty
                ranks.reap()
                ranks.drain_heartbeats()
                now = time.monotonic()
                tick = now >= next_tick or woken
                if tick:  # a fixed cadence: late ticks do not push the next; a wake restarts it
                    next_tick = (now + self.interval_s if woken else
                                 max(next_tick + self.interval_s, now - self.interval_s / 2))
                    self._tick()
                ranks.escalate(self.latest_plan)
                # A new point goes to the buddy at once, and is reported once it is there;
                # retention and the report run with the tick.
                if not self.voice.down:
                    self._report_snapshots(full=tick)
                # A new plan, control word or port: tick now; a rank's exit (its pidfd, or
                # the warm process's report of it): reap it now.
                fds = self.exits.fds(ranks.procs.values())
                if (reports := self.spawner.report_fd()) is not None:
                    fds.append(reports)
                woken = self.waker.wait(POLL_S, fds)
            ranks.flush_exits()
            with contextlib.suppress(StoreUnavailable):
                self.store.own.leave(self.node)
                self.store.event(f"agent:{self.node}", "agent", f"agent of {self.node} exits: "
                                 "the job ended")
            return 0
        finally:
            self.waker.close()
            self.exits.close()
            self.checks.mesh.close()
            self.spawner.close()
            self.snapshots.close()
            ranks.close()
            self.files.remove()

    def stop_all_now(self) -> None:
        """On the agent's own SIGTERM/SIGINT: terminate the ranks, then go (they die with us)."""
        self.ranks.stop_all_now()

    def _register(self) -> None:
        while True:
            info = self.checks.info
            try:
                self.store.own.register_node(self.node, info)
                self._refuse_if_isolated()
                self.store.event(f"agent:{self.node}", "register", f"node {self.node} "
                                 f"registered (host {self.host}, {info['devices']} "
                                 f"device(s), health {info['health']})",
                                 node=self.node)
                return
            except StoreUnavailable as e:
                self.voice.outage(e)
                time.sleep(self.interval_s)

    def _refuse_if_isolated(self) -> None:
        """A node that advertises loopback while another of the job runs on another host
        leaves at once, with the one line that says how to fix it (reach.py): its ranks would
        hang every generation. The controller refuses it too, should it register first."""
        try:
            others = self.store.nodes()
        except Denied:  # an agent's ACL reads no other node's record: the controller judges
            return
        why = reach.isolated(self.node, self.checks.info, others)
        if why is None:
            return
        self.store.event(f"agent:{self.node}", "node_refused", why, node=self.node)
        self.store.own.leave(self.node)
        raise ConfigError(f"optimus agent --node {self.node}", why)

    def _status(self) -> dict:
        ranks = self.ranks
        live = [p for p in ranks.procs.values() if p.running]
        state = ("stopping" if any(p.stop_sent for p in live) else "running" if live
                 else "starting" if ranks.waiting_port else "idle")
        return {"generation": -1 if ranks.generation is None else ranks.generation,
                "state": state, "live_ranks": len(live), "host": self.host,
                "pids": [p.popen.pid for p in live], "rank_states": rank_states(live, ranks.beats),
                "failed_saves": ranks.failed_saves, "refused": self.checks.refusal or "",
                "waiting_ranks": len(ranks.waiting()), "restarts": ranks.restarts,
                "next_port": ranks.ports.port, "mesh": self.checks.mesh.report() or "",
                # replicas that carry on: the launch its ranks are of, and how many of them
                # wait to be let into a quorum
                "replica_launch": -1 if ranks.launched is None else ranks.launched,
                "standby": sum(ranks.beats.get(p.local_rank, {}).get("phase") == STANDBY
                               for p in live)}

    @staticmethod
    def _told(status: dict) -> tuple:
        """What the controller plans on: a change of it wakes the controller."""
        return tuple(status[k] for k in ("generation", "state", "live_ranks", "waiting_ranks",
                                         "refused", "mesh", "replica_launch", "standby"))

    def _tick(self) -> None:
        ranks = self.ranks
        status = self._status()
        live = [p for p in ranks.procs.values() if p.running]
        try:
            ranks.flush_exits()
            tick = self.store.own.agent_tick(self.node, status, dict(ranks.beats),
                                         deadline(live, ranks.beats, ranks.plan),
                                         self.reset_ranks, summary(live, ranks.beats))
        except StoreUnavailable as e:
            self.voice.outage(e)
            return
        self.voice.answered()
        self.reset_ranks = False
        self.snapshots.align, self.snapshots.keep = tick.align, tick.keep
        if self.store.unsent:  # events an outage held back
            try:
                self.store.flush_events()
            except StoreUnavailable as e:
                self.voice.outage(e)
        if not tick.registered:  # Redis lost our record: restarted empty, or flushed
            self._register()
            self.reset_ranks = True
        for command in tick.commands:
            self.commands.take(command)
        if tick.control is not None and tick.control != self.files.control:
            self.files.tell(tick.control)
        elif self.files.failing:  # the disk refused the last word: again
            self.files.tell(self.files.control)
        if tick.plan_stamp is not None and tick.plan_stamp != self.plan_stamp:
            try:  # a plan refused (decode.checked) leaves the last one standing, said once
                self.latest_plan = self.store.plan_record() or self.latest_plan
            except StoreUnavailable as e:
                self.voice.outage(e)
                return
            self.plan_stamp = tick.plan_stamp
            for line in self.store.records.take():
                self.voice.event("record_refused", f"agent of {self.node} ignores a record in "
                                 f"Redis: {line}")
        told = self._told(status)
        if told != self.told:  # the controller looks now, not at its next tick
            wake.publish(self.store, wake.CONTROLLER)
            self.told = told
        if self.latest_plan is not None:
            launched = (ranks.generation, ranks.launched)
            ranks.follow(self.latest_plan)
            if (ranks.generation, ranks.launched) != launched:  # Redis's heartbeats are the
                # last generation's (or its replica's last launch's)
                self.reset_ranks = True
            self._keep_standbys()
        self.commands.check_node_faults()
        self.checks.check_mesh(self.latest_plan)  # the ring's neighbours, while a plan runs
        if self._told(self._status()) != told:  # launched, stopped: say so at the next turn
            self.waker.poke()
        # Between generations: the next plan's check, before it comes (checks.py).
        self.checks.check_ahead(ranks.generation, live=ranks.live(), job_ended=ranks.ended,
                                plan=self.latest_plan)

    def _keep_standbys(self) -> None:
        """Standby mode: a ready process per local rank of the job's layout for the next
        generation, on spares and on nodes whose ranks run. A used one is replaced only once
        every rank here has taken a step: its imports would slow this generation's start."""
        rpn = self.latest_plan.ranks_per_node
        live = [p for p in self.ranks.procs.values() if p.running]
        if rpn and all(self.ranks.beats.get(p.local_rank, {}).get("step", 0) >= 1
                       for p in live):
            self.spawner.keep_ready(rpn)

    def _report_snapshots(self, full: bool) -> None:
        lineage = self.latest_plan.lineage if self.latest_plan is not None else None
        report = self.snapshots.poll(self.ranks.plan, self.ranks.generation, lineage, full=full)
        if report is None:
            return
        try:
            self.store.own.set_snapshots(self.node, report, first=not self._snapshots_stored)
            self._snapshots_stored = True
        except StoreUnavailable as e:
            self.snapshots.unreported()
            self.voice.outage(e)
