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
warm process that imported the trainer once (controller/node/spawn.py, optimus/warm.py), so a
generation starts without seconds of imports per rank.

The heartbeat protocol (rank -> agent) is one JSON datagram per interval on a Unix datagram
socket (OPTIMUS_AGENT_SOCKET); see optimus/health.py. Datagrams, not a stream: a rank never
blocks on a slow or absent agent, and the agent never waits on a rank. The other way, the
agent relays the job's control word (operators' pause and checkpoint-now, from the `control`
key it reads every tick) into a small file the ranks stat at every step boundary
(OPTIMUS_CONTROL_FILE), rewritten atomically when the word changes (a plan that stops a
generation with `"save": false`, on evidence of wrong arithmetic, adds `"save": false` to it
before the SIGTERM: the ranks then stop without a checkpoint); and an operator's
`chaos hang-rank|stall-rank|nan-rank` into another (OPTIMUS_CHAOS_FILE, see optimus/faults.py).

Beside this module: the commands it takes (commands.py: stacks, faults), its node's checks
(checks.py) and what it sums up of its ranks (ranks.py).
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
from collections import deque
from pathlib import Path

from controller.disk import Rewritten
from controller.node.checks import Checks
from controller.node.commands import Commands, signal_group
from controller.node.folders import private_folder
from controller.node.ranks import (
    RankProcess,
    deadline,
    log_age,
    rank_states,
    sample_compute,
    summary,
    tail,
)
from controller.node.snapshots import SnapshotKeeper, default_root, job_secret, node_folder
from controller.node.spawn import Spawner, start_mode
from controller.store.store import Store, StoreUnavailable

log = logging.getLogger("optimus.agent")

POLL_S = 0.05


class Agent(Commands, Checks):
    def __init__(self, store: Store, node: str, *, interval_s: float = 1.0,
                 host: str | None = None, socket_dir: str | None = None,
                 snapshot_root: Path | None = None):
        self.store, self.node, self.interval_s = store, node, interval_s
        store.speak_as(node)  # every write under this node's own keys (controller/store/own.py)
        self.host = host or socket.gethostname()
        self.procs: dict[int, RankProcess] = {}
        self.ran_since_ok = False  # ranks ran here since the last passing health check
        self.beats: dict[int, dict] = {}
        self.generation: int | None = None  # the generation launched here, if any
        self.plan: dict | None = None  # its plan
        self.waiting_port: dict | None = None  # a run plan waiting for node 0's master port
        self.unreported: list[dict] = []  # exits Redis has not taken yet
        self.reset_ranks = True
        self.plan_stamp: str | None = None  # of the last plan read
        self.latest_plan: dict | None = None
        self.ended = False
        self.redis_down = False
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
        self._snapshots_stored = False  # this incarnation has reported once
        self.failed_saves = 0  # checkpoint saves failed in a row, as this node's ranks last said
        # The warm process first: the health check runs in a child of it (checks.py); standby
        # mode once that check has found GPUs or XPUs (controller/node/spawn.py).
        self.spawner = Spawner(mode=start_mode(None))
        self.info = {"host": self.host, "pid": os.getpid(),
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
        self._register()
        next_tick = 0.0
        try:
            while not (self.ended and not self.procs):
                self._reap()
                self._drain_heartbeats()
                now = time.monotonic()
                tick = now >= next_tick
                if tick:  # a fixed cadence: late ticks do not push the next
                    next_tick = max(next_tick + self.interval_s, now - self.interval_s / 2)
                    self._tick()
                self._escalate()
                # A new point goes to the buddy at once, and is reported once it is there;
                # retention and the report run with the tick.
                if not self.redis_down:
                    self._report_snapshots(full=tick)
                time.sleep(POLL_S)
            self._flush_exits()
            with contextlib.suppress(StoreUnavailable):
                self.store.leave(self.node)
                self.store.event(f"agent:{self.node}", "agent", f"agent of {self.node} exits: "
                                 "the job ended")
            return 0
        finally:
            self.spawner.close()
            self.snapshots.close()
            self.sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
            for path in (self.control_path, self.chaos_path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def stop_all_now(self) -> None:
        """On the agent's own SIGTERM/SIGINT: terminate the ranks, then go (they die with us)."""
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.popen.pid, signal.SIGTERM)

    def _register(self) -> None:
        while True:
            try:
                self.store.register_node(self.node, self.info)
                self.store.event(f"agent:{self.node}", "register", f"node {self.node} "
                                 f"registered (host {self.host}, {self.info['devices']} "
                                 f"device(s), health {self.info['health']})",
                                 node=self.node)
                return
            except StoreUnavailable as e:
                self._note_outage(e)
                time.sleep(self.interval_s)

    def _tick(self) -> None:
        live = [p for p in self.procs.values() if p.popen.returncode is None]
        state = ("stopping" if any(p.stop_sent for p in live) else "running" if live
                 else "starting" if self.waiting_port else "idle")
        status = {"generation": -1 if self.generation is None else self.generation,
                  "state": state, "live_ranks": len(live), "host": self.host,
                  "pids": [p.popen.pid for p in live], "rank_states": rank_states(live, self.beats),
                  "failed_saves": self.failed_saves, "refused": self.refusal or ""}
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
            try:
                self.latest_plan = self.store.plan()
            except StoreUnavailable as e:
                self._note_outage(e)
                return
            self.plan_stamp = tick.plan_stamp
        if self.latest_plan is not None:
            self._follow(self.latest_plan)
            self._keep_standbys()
        self._check_node_faults()

    def _keep_standbys(self) -> None:
        """Standby mode: a ready process per local rank of the job's layout for the next
        generation, on spares and on nodes whose ranks run. A used one is replaced only once
        every rank here has taken a step: its imports would slow this generation's start."""
        rpn = self.latest_plan.get("ranks_per_node")
        live = [p for p in self.procs.values() if p.popen.returncode is None]
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

    # --- plans ---------------------------------------------------------------------------------

    def _follow(self, plan: dict) -> None:
        gen, action = plan["generation"], plan["action"]
        mine = self.node in plan.get("nodes", [])
        save = plan.get("save", True) or gen != self.generation  # about its own generation
        if action == "end":
            self._stop(plan.get("grace_s", 3.0), plan.get("reason", "the job ended"), save)
            self.ended = True
            return
        if self.generation is not None and (gen != self.generation or action == "stop"):
            self._stop(plan.get("grace_s", 3.0), plan.get("reason", ""), save)
        if action == "run" and mine and gen == self.generation:
            self.plan = plan  # the same generation, re-issued: new buddies (a spare arrived)
        if action == "run" and mine and gen != self.generation and not self._live():
            if self.checked_for != gen:
                self.checked_for = gen
                self.fit_for = self._healthy_for(gen) and self._can_run(plan)
            if not self.fit_for:
                return  # the node record or the stop request says why
            if self.spawner.warming():
                return  # its imports are nearly done: ranks then start in milliseconds
            if self.snapshots.resume_dir(plan)[0] == "waiting":
                return  # a lost node's shards are on their way from the node that holds them
            self._launch(plan)

    def _live(self) -> bool:
        return any(p.popen.returncode is None for p in self.procs.values())

    def _launch(self, plan: dict) -> None:
        gen = plan["generation"]
        node_rank = plan["nodes"].index(self.node)
        port = plan.get("master_port") or 0
        if not port:
            if node_rank == 0:
                port = _free_port()
                try:
                    self.store.set_master_port(gen, port)
                except StoreUnavailable as e:
                    self._note_outage(e)
                    return
            else:
                try:
                    port = self.store.master_port(gen) or 0
                except StoreUnavailable as e:
                    self._note_outage(e)
                    return
                if not port:
                    self.waiting_port = plan  # node 0 has not picked it yet: next tick
                    return
        self.waiting_port = None
        if self.no_save:  # that was the last generation's
            self.no_save = False
            self._write_control(self.control)
        self.generation, self.plan = gen, plan
        carried = plan.get("failed_saves")
        self.failed_saves = carried if isinstance(carried, int) and carried > 0 else 0
        self.ran_since_ok = True
        self.procs.clear()
        self.beats.clear()
        self.reset_ranks = True
        self._write_chaos([])  # an operator's faults were for the last generation
        rpn = plan["ranks_per_node"]
        log_dir = Path(plan["log_dir"]) / f"gen_{gen:04d}"
        log_dir.mkdir(parents=True, exist_ok=True)
        command = ["optimus", "train", plan["job_file"]]
        for override in plan.get("overrides", []):
            command += ["--set", override]
        snapshot_env = self._snapshot_env(plan)
        for local_rank in range(rpn):
            rank = node_rank * rpn + local_rank
            env = {**os.environ,
                   "OPTIMUS_RANK": str(rank), "OPTIMUS_WORLD_SIZE": str(plan["world_size"]),
                   "OPTIMUS_LOCAL_RANK": str(local_rank), "OPTIMUS_LOCAL_WORLD_SIZE": str(rpn),
                   "OPTIMUS_NODE_RANK": str(node_rank),
                   "OPTIMUS_NUM_NODES": str(len(plan["nodes"])),
                   "OPTIMUS_JOB_ID": self.store.job, "OPTIMUS_GENERATION": str(gen),
                   "OPTIMUS_MASTER_ADDR": plan["master_addr"], "OPTIMUS_MASTER_PORT": str(port),
                   "OPTIMUS_AGENT_SOCKET": self.socket_path,
                   "OPTIMUS_CONTROL_FILE": str(self.control_path),
                   "OPTIMUS_CHAOS_FILE": str(self.chaos_path),
                   "OPTIMUS_AGENT_PID": str(os.getpid()), "PYTHONUNBUFFERED": "1",
                   "OPTIMUS_FAILED_SAVES": str(self.failed_saves),
                   **snapshot_env}
            path = log_dir / f"rank_{rank:05d}.log"
            env["OPTIMUS_STACKS_FILE"] = str(log_dir / f"rank_{rank:05d}.stacks")
            popen = self.spawner.start(command, env, path)
            self.procs[local_rank] = RankProcess(
                rank, local_rank, popen, path, time.time(),
                stacks_path=log_dir / f"rank_{rank:05d}.stacks",
                compute=deque(maxlen=plan.get("straggler_window", 20)))
        self._event("launch", f"generation {gen}: ranks {node_rank * rpn}-"
                    f"{node_rank * rpn + rpn - 1} started on {self.node}")

    def _snapshot_env(self, plan: dict) -> dict[str, str]:
        """Where this generation's ranks write snapshots, and the point they resume from when
        the plan names one (every rank gets it; a rank whose shard is missing says so, and all
        then resume from disk)."""
        env = {"OPTIMUS_SNAPSHOT_DIR": str(self.snapshots.own)}
        _, folder = self.snapshots.resume_dir(plan)
        memory = plan.get("memory")
        if folder is None or not memory:
            return env
        env["OPTIMUS_SNAPSHOT_RESUME"] = json.dumps(
            {"step": memory["step"], "generation": memory["generation"], "dir": str(folder)})
        holder = memory.get("holders", {}).get(self.node)
        if holder is not None:
            problem = self.snapshots.fetch_error()
            self._event("snapshot", f"generation {plan['generation']}: {self.node} "
                        + (f"could not fetch the shards of step {memory['step']} from "
                           f"{holder['node']}: {problem}" if problem else
                           f"fetched the shards of step {memory['step']} from {holder['node']}"),
                        step=memory["step"], holder=holder["node"], ok=problem is None)
        return env

    def _stop(self, grace_s: float, reason: str, save: bool = True) -> None:
        if not save and not self.no_save and self._live():
            self.no_save = True  # in the control file before the SIGTERM: see optimus/health.py
            self._write_control(self.control)
        # A rank learns "do not save" from the control file only: while the disk refuses that
        # word, a SIGTERM would let it save the very state this stop drops. Killed instead;
        # the next generation resumes from the last good point either way.
        unsaid = not save and self.control_writes.failing is not None
        now = time.monotonic()
        for p in self.procs.values():
            if p.popen.returncode is None and p.stop_sent is None and unsaid:
                p.stop_sent, p.kill_sent = now, True
                signal_group(p.popen, signal.SIGKILL)
                self._event("stop", f"rank {p.rank} on {self.node} killed, not stopped: the "
                            "word not to save could not be written (disk)", rank=p.rank)
            elif p.popen.returncode is None and p.stop_sent is None:
                p.stop_sent = now + grace_s  # the time to escalate to SIGKILL
                # The rank alone: its helpers (DCP's writer process, DataLoader workers) die on
                # a SIGTERM their parent did not send, and the rank's clean stop needs them.
                # SIGKILL, later, goes to the whole group.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.popen.pid, signal.SIGTERM)
                    os.killpg(p.popen.pid, signal.SIGCONT)  # a frozen rank, to take the TERM

    def _escalate(self) -> None:
        now = time.monotonic()
        for p in self.procs.values():
            if (p.popen.returncode is None and p.stop_sent is not None and not p.kill_sent
                    and now >= p.stop_sent):
                p.kill_sent = True
                signal_group(p.popen, signal.SIGKILL)

    # --- ranks ---------------------------------------------------------------------------------

    def _reap(self) -> None:
        for p in list(self.procs.values()):
            if p.popen.returncode is not None or p.popen.poll() is None:
                continue
            code = p.popen.returncode
            record = {"node": self.node, "rank": p.rank, "local_rank": p.local_rank,
                      "generation": self.generation, "pid": p.popen.pid,
                      "code": code if code >= 0 else None,
                      "signal": -code if code < 0 else None,
                      "by_agent": p.stop_sent is not None, "time": time.time(),
                      "tail": tail(p.log_path), "tail_age": log_age(p.log_path)}
            self.unreported.append(record)
            self.beats.pop(p.local_rank, None)
        if self.unreported:
            try:
                self._flush_exits()
            except StoreUnavailable as e:
                self._note_outage(e)
        # Forget the finished ones once none is left running (their records are sent).
        if self.procs and not self._live() and not self.unreported:
            self.procs.clear()

    def _flush_exits(self) -> None:
        while self.unreported:
            self.store.report_exit(self.unreported[0])
            self.unreported.pop(0)

    def _drain_heartbeats(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            try:
                beat = json.loads(data)
                local_rank = int(beat["local_rank"])
            except (ValueError, KeyError, TypeError):
                continue  # not a heartbeat: ignore it
            p = self.procs.get(local_rank)
            if p is None or beat.get("pid") != p.popen.pid or p.popen.returncode is not None:
                continue  # from a rank of an older generation
            beat["received"] = time.time()
            self.beats[local_rank] = beat
            if isinstance(beat.get("failed_saves"), int):  # agreed: every rank says the same
                self.failed_saves = beat["failed_saves"]
            sample_compute(p, beat)

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
