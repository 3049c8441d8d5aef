"""How the node agent follows plans and runs its ranks: launches a generation's ranks, stops
them, escalates to SIGKILL, reaps their exits, drains their heartbeats, and hands ranks that
wait between generations the next one (in-process restart, optimus/supervision/inprocess.py).
Each exit it reports is an exit record of the contract (optimus/contract/records.py). `Ranks`
owns the node's rank processes and what is known of them; the agent (agent.py) drives it from
its loop and tick.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from controller.node.checks import Checks
from controller.node.commands import signal_group
from controller.node.ports import PortOffer
from controller.node.rank_files import RankFiles
from controller.node.ranks import RankProcess, log_age, sample_compute, skip_steps, tail
from controller.node.replica_worlds import (
    Survivors,
    leads,
    own_rank,
    relaunch_due,
    replica_of,
    world,
)
from controller.node.snapshots import SnapshotKeeper
from controller.node.spawn import Spawner, rank_environment
from controller.node.voice import Voice
from controller.store.store import Store, StoreUnavailable
from optimus.contract import env
from optimus.contract.phases import READY
from optimus.contract.records import ExitRecord, Plan

DISMISS_S = 10.0  # a waiting rank told to exit is killed if it has not within this
LEAVE_S = 10.0  # at least this more, past a failed generation's grace, for the ranks the fault
# did not touch to leave it in process (their way out: a failed collective, a traceback, the
# release of the generation's memory; seconds on a loaded machine)


# A new agent that has seen no plan but an ended one leaves on it only once it has been up
# this long: the ended plan may be a finished submission's that a controller starting beside
# it (--resubmit, --allocation) is about to reset. Without the wait such an agent left at once
# and the new submission waited for a node forever (seen under load in test_control_plane's
# resubmission). An agent that saw the job run (its ranks, or as a spare) leaves at once.
FRESH_END_S = 20.0


class Ranks:
    """One node's rank processes, of its generation and waiting in process or leaving, and what
    is known of them: their heartbeats, the exits not yet reported, the generation and plan
    they run. It asks `checks` before each launch, speaks to the ranks through `files` and
    hears their heartbeats on its own socket (`socket_path`); `poke` wakes the agent's loop."""

    def __init__(self, store: Store, node: str, voice: Voice, *, checks: Checks,
                 files: RankFiles, spawner: Spawner, snapshots: SnapshotKeeper,
                 socket_path: str, poke: Callable[[], None]):
        self.store, self.node, self.voice = store, node, voice
        self.checks, self.files, self.spawner, self.snapshots = checks, files, spawner, snapshots
        self.poke = poke
        self.procs: dict[int, RankProcess] = {}
        self.leaving: list[RankProcess] = []  # told to exit, no longer of any generation
        self.restarts = {"in_process": 0, "process": 0}  # ranks of generations after the first
        self.beats: dict[int, dict] = {}
        self.generation: int | None = None  # the generation launched here, if any
        self.launched: int | None = None  # its replica's launch count, in replica mode
        self.survivors = Survivors()  # a relaunch's ranks that go on in process
        self.plan: Plan | None = None  # its plan
        self.waiting_port: Plan | None = None  # a run plan waiting for node 0's master port
        self.ports = PortOffer()  # the rendezvous port offered for the next plan (ports.py)
        self.unreported: list[ExitRecord] = []  # exits Redis has not taken yet
        self.failed_saves = 0  # checkpoint saves failed in a row, as this node's ranks last said
        self.checked_for: int | None = None  # the generation the last pre-launch check was for
        self.fit_for = True
        self.ended = False
        # Set while no plan but an ended one was seen (FRESH_END_S): when it came.
        self.end_seen: float | None = time.monotonic()
        self.socket_path = socket_path  # the ranks' heartbeats (optimus/supervision/heartbeat.py)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(socket_path)
        self.sock.setblocking(False)

    def close(self) -> None:
        self.ports.close()
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    # --- plans ---------------------------------------------------------------------------------

    def follow(self, plan: Plan) -> None:
        gen, action = plan.generation, plan.action
        mine = self.node in plan.nodes
        save = plan.save or gen != self.generation  # about its own generation
        if action != "end":
            self.end_seen = None  # it has seen this submission run (its ranks, or a spare)
        elif self.end_seen is not None and time.monotonic() - self.end_seen < FRESH_END_S:
            return  # a new agent whose first plan is an ended one: maybe a stale one
        if action == "end":
            self.stop(plan.grace_s, save)
            self.ended = True
            self.dismiss()
            return
        if self.generation is not None and (gen != self.generation or action == "stop"):
            self.stop(plan.grace_s, save)
        if action == "run" and mine and gen == self.generation:
            self.plan = plan  # the same generation, re-issued: new buddies (a spare arrived)
            if plan.quorum is not None:
                self.files.set_quorum(plan.quorum.record())  # a replica left, or came back
            if relaunch_due(plan, self.node, self.launched):
                self.relaunch(plan)
            return
        if action == "run" and gen == self.generation and not mine and self.live():
            # Its replica goes on without this node (a spare took its slot): killed, as in a
            # relaunch. A stop's SIGTERM would be a command its replica tells the others in
            # the step's exchange, and they would stop with it.
            self.kill_all()
        if action == "run" and mine and gen != self.generation and not self.live():
            if self.checked_for != gen:
                self.checked_for = gen
                self.fit_for = self.checks.healthy_for(gen) and self.checks.can_run(plan)
            if not self.fit_for:
                return  # the node record or the stop request says why
            if not self.checks.meshed(plan):
                return  # its mesh check (checks.py): probes out, or a node of the plan unreached
            if self.spawner.warming():
                return  # its imports are nearly done: ranks then start in milliseconds
            if self.snapshots.resume_dir(plan)[0] == "waiting":
                return  # a lost node's shards are on their way from the node that holds them
            self.launch(plan)
        elif action == "run" and gen != self.generation and not mine:
            self.dismiss()  # ranks waiting in process here: no next generation for them

    def relaunch(self, plan: Plan) -> None:
        """This node's replica left the quorum and starts again within the generation, let in
        and healed once all its ranks wait. The ranks the fault did not touch are its next
        launch's ranks, in process (`Survivors`); the others start as new processes."""
        if not self.survivors.gone(self.procs.values(), plan, self.node, self._kill):
            return  # a later turn: they are on their way out of the launch
        self.kill_all(keep_waiting=True)
        self.launch(plan)  # once its first node's port is in the plan

    def kill_all(self, keep_waiting: bool = False) -> None:
        """SIGKILL this node's ranks of a replica the quorum goes on without (but those waiting
        in process, when `keep_waiting`): nothing of theirs is saved (a peer holds the state),
        and they say nothing to the others (a SIGTERM would be a stop their replica tells)."""
        for p in self.procs.values():
            if p.popen.returncode is None and not p.kill_sent and not (keep_waiting and p.ready):
                self._kill(p)

    @staticmethod
    def _kill(p: RankProcess) -> None:
        p.kill_sent = True
        signal_group(p.popen, signal.SIGKILL)

    def own_rank(self, p: RankProcess) -> int:
        """The rank `p` knows itself as (its replica world's, under replicas)."""
        return own_rank(self.plan, self.node, p.rank, p.local_rank)

    def live(self) -> bool:
        """Whether a rank of this node's generation still runs (waiting ones do not)."""
        return any(p.running for p in self.procs.values())

    def waiting(self) -> dict[int, RankProcess]:
        """Ranks that left their generation and wait in process for the next (local rank ->)."""
        return {lr: p for lr, p in self.procs.items()
                if p.ready and p.popen.returncode is None}

    def dismiss(self, ranks: list[RankProcess] | None = None) -> None:
        """Tell waiting ranks (all of them by default) that no generation comes for them: the
        word {"exit": true, "generation": <the one it left>} in their file, and SIGKILL if they
        have not exited 10 s later (a SIGTERM would not do: one meant for the generation they
        left may reach a rank that already waits, which must not take it for this). Reaped,
        with nothing more reported: their leaving the generation was."""
        for p in list(self.waiting().values()) if ranks is None else ranks:
            if p.stop_sent is None:
                p.stop_sent = time.monotonic() + DISMISS_S  # then SIGKILL (escalate)
                if not self._write_next(p, {"exit": True, "generation": p.left,
                                            "launch": p.left_launch}):
                    p.stop_sent = time.monotonic()

    def _hand_over(self, p: RankProcess, gen: int, launch: dict[str, str],
                   log_path: Path) -> bool:
        """Give a waiting rank the next generation (optimus/supervision/inprocess.py): its launch
        environment (the OPTIMUS_* variables, less what only the agent holds) and its log."""
        word = {"generation": gen, "launch": self.launched or 0, "log": str(log_path),
                "env": {k: v for k, v in rank_environment(launch).items()
                        if k.startswith(env.PREFIX)}}
        if self._write_next(p, word):
            return True
        self.dismiss([p])
        self.leaving.append(p)
        return False

    def _write_next(self, p: RankProcess, word: dict) -> bool:
        """A waiting rank's word; False if the disk refused it (said in an event: the rank
        then restarts as a new process)."""
        try:
            self.files.write_next(p.local_rank, word)
        except OSError as e:
            self.voice.event("restart", f"rank {p.rank} on {self.node} could not be told its "
                             f"next generation in process ({e}): it restarts as a new process",
                             rank=p.rank, restart="process")
            return False
        return True

    def launch(self, plan: Plan) -> None:
        gen = plan.generation
        node_rank = plan.nodes.index(self.node)
        port = plan.master_port or 0  # node 0's offered port (ports.py), or none yet
        replica = replica_of(plan, self.node)
        if replica is not None:  # its replica's world: the port its first node offered
            port = plan.replicas.ports[replica]
            if not port:
                return  # not offered yet: the controller puts it in the plan
            if leads(plan, self.node):
                self.ports.take(port)
            if not self.files.set_quorum(plan.quorum.record()):
                return  # the ranks would not find their quorum: next tick
        elif node_rank == 0:
            taken = self.ports.take(port)
            if not port:  # a plan without it: the others hear it by the controller's relay
                port = taken
                try:
                    self.store.own.set_master_port(gen, port)
                except StoreUnavailable as e:
                    self.voice.outage(e)
                    return
        elif not port:
            try:
                port = self.store.master_port(gen) or 0
            except StoreUnavailable as e:
                self.voice.outage(e)
                return
            if not port:
                self.waiting_port = plan  # node 0 has not picked it yet: next tick
                return
        self.waiting_port = None
        self.files.save_again()  # a "save": false was the last generation's
        # A rank waiting in process holds the last generation's job file and overrides: a plan
        # that changes them (a shrink's re-planned layout) starts new processes instead.
        same_job = self.plan is not None and (self.plan.job_file, self.plan.overrides) == (
            plan.job_file, plan.overrides)
        # A replica's ranks go on in process only into its next launch (settings.py `restart`)
        relaunched = replica is not None and gen == self.generation
        self.generation, self.plan = gen, plan
        self.launched = None if replica is None else plan.replicas.launches[replica]
        carried = plan.failed_saves
        self.failed_saves = carried if carried is not None and carried > 0 else 0
        self.checks.ranks_started()
        rpn = plan.ranks_per_node
        in_process = plan.restart == "in_process"
        waiting = {lr: p for lr, p in self.waiting().items()
                   if (in_process or relaunched) and lr < rpn and same_job}
        # Ranks that wait in process but cannot take this plan: the launch event says why.
        refused = ("the plan changes the job file or its overrides (a re-planned layout), "
                   "which a rank waiting in process cannot take" if self.waiting()
                   and not same_job and in_process else None)
        self.dismiss([p for lr, p in self.waiting().items() if lr not in waiting])
        self.leaving += [p for p in self.procs.values() if p.popen.returncode is None
                         and all(p is not w for w in waiting.values())]
        self.procs.clear()
        self.beats.clear()
        self.files.set_faults([])  # an operator's faults were for the last generation
        log_dir = Path(plan.log_dir) / f"gen_{gen:04d}"
        log_dir.mkdir(parents=True, exist_ok=True)
        command = ["optimus", "train", plan.job_file]
        for override in plan.overrides:
            command += ["--set", override]
        snapshot_env = self._snapshot_env(plan)
        reused = 0
        again = f".launch{self.launched}" if self.launched else ""  # a replica relaunched
        for local_rank in range(rpn):
            rank = node_rank * rpn + local_rank
            launch = {**os.environ,
                      env.RANK: str(rank), env.WORLD_SIZE: str(plan.world_size),
                      env.LOCAL_RANK: str(local_rank), env.LOCAL_WORLD_SIZE: str(rpn),
                      env.NODE_RANK: str(node_rank), env.NUM_NODES: str(len(plan.nodes)),
                      env.JOB_ID: self.store.job, env.GENERATION: str(gen),
                      env.MASTER_ADDR: plan.master_addr, env.MASTER_PORT: str(port),
                      env.AGENT_SOCKET: self.socket_path,
                      env.CONTROL_FILE: str(self.files.control_path),
                      env.CHAOS_FILE: str(self.files.chaos_path),
                      env.AGENT_PID: str(os.getpid()), "PYTHONUNBUFFERED": "1",
                      env.FAILED_SAVES: str(self.failed_saves),
                      env.SKIP_STEPS: skip_steps(plan.skips),
                      **snapshot_env}
            if replica is not None:
                launch.update(world(plan, self.node, local_rank, self.files.quorum_path))
            path = log_dir / f"rank_{rank:05d}{again}.log"
            launch[env.STACKS_FILE] = str(log_dir / f"rank_{rank:05d}{again}.stacks")
            if in_process or replica is not None:
                launch[env.NEXT_FILE] = str(self.files.next_path(local_rank))
            waits = waiting.pop(local_rank, None)
            if waits is not None and self._hand_over(waits, gen, launch, path):
                popen, reused = waits.popen, reused + 1
            else:
                popen = self.spawner.start(command, launch, path)
            self.procs[local_rank] = RankProcess(
                rank, local_rank, popen, path, time.time(),
                stacks_path=log_dir / f"rank_{rank:05d}{again}.stacks",
                compute=deque(maxlen=plan.straggler_window))
        if gen > 0:  # a rank of a later generation is a restart, of one kind or the other
            self.restarts["in_process"] += reused
            self.restarts["process"] += rpn - reused
        kept = (f" ({reused} of them in process)" if reused else
                f" (restart: process: {refused})" if refused else "")
        if replica is not None:
            kept += f" (replica {replica}" + (f", launch {self.launched})" if self.launched
                                              else ")")
        self.voice.event("launch", f"generation {gen}: ranks {node_rank * rpn}-"
                         f"{node_rank * rpn + rpn - 1} started on {self.node}{kept}",
                         in_process=reused, pids=",".join(str(self.procs[lr].popen.pid)
                                                          for lr in sorted(self.procs)),
                         **({"restart": "process"} if refused else {}))

    def _snapshot_env(self, plan: Plan) -> dict[str, str]:
        """Where this generation's ranks write snapshots, and the point they resume from when
        the plan names one (every rank gets it; a rank whose shard is missing says so, and all
        then resume from disk)."""
        where = {env.SNAPSHOT_DIR: str(self.snapshots.own)}
        _, folder = self.snapshots.resume_dir(plan)
        memory = plan.memory
        if folder is None or memory is None:
            return where
        where[env.SNAPSHOT_RESUME] = json.dumps(
            {"step": memory.step, "generation": memory.generation, "dir": str(folder)})
        holder = memory.holders.get(self.node)
        if holder is not None:
            problem = self.snapshots.fetch_error()
            self.voice.event("snapshot", f"generation {plan.generation}: {self.node} "
                             + (f"could not fetch the shards of step {memory.step} from "
                                f"{holder.node}: {problem}" if problem else
                                f"fetched the shards of step {memory.step} from {holder.node}"),
                             step=memory.step, holder=holder.node, ok=problem is None)
        return where

    def stop(self, grace_s: float, save: bool = True) -> None:
        if not save and self.live():
            self.files.stop_saving()  # in the control file before the SIGTERM
        # A rank learns "do not save" from the control file only: while the disk refuses that
        # word, a SIGTERM would let it save the very state this stop drops. Killed instead;
        # the next generation resumes from the last good point either way.
        unsaid = not save and self.files.failing is not None
        now = time.monotonic()
        for p in self.procs.values():
            if not p.running:
                continue  # exited, or waits in process for the next generation
            if p.stop_sent is None and unsaid:
                p.stop_sent, p.kill_sent = now, True
                signal_group(p.popen, signal.SIGKILL)
                self.voice.event("stop", f"rank {p.rank} on {self.node} killed, not stopped: "
                                 "the word not to save could not be written (disk)",
                                 rank=p.rank)
            elif p.stop_sent is None:
                p.stop_sent = now + grace_s  # the time to escalate to SIGKILL
                p.grace_s = grace_s
                # The rank alone: its helpers (DCP's writer process, DataLoader workers) die on
                # a SIGTERM their parent did not send, and the rank's clean stop needs them.
                # SIGKILL, later, goes to the whole group.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.popen.pid, signal.SIGTERM)
                    os.killpg(p.popen.pid, signal.SIGCONT)  # a frozen rank, to take the TERM

    def stop_all_now(self) -> None:
        """Terminate every rank at once (the agent's own SIGTERM: they die with it anyway)."""
        for p in [*self.procs.values(), *self.leaving]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.popen.pid, signal.SIGTERM)

    def escalate(self, latest: Plan | None) -> None:
        """SIGKILL the ranks whose stop's grace is over; `latest`, the latest plan read, may
        name the culprit of a failure, which goes at its grace while the others may take
        longer to leave in process."""
        now = time.monotonic()
        in_process = self.plan is not None and self.plan.restart == "in_process"
        for p in [*self.procs.values(), *self.leaving]:
            if (p.popen.returncode is None and p.stop_sent is not None and not p.kill_sent
                    and now >= p.stop_sent):
                if in_process and p.running and not p.spared and not self._culprit(p, latest):
                    # A rank the fault did not touch may be blocked in a collective with the
                    # culprit (gloo cannot be interrupted), or still on its way out after its
                    # collective failed: the culprit is killed at its grace, which frees it.
                    p.spared, p.stop_sent = True, now + max(p.grace_s, LEAVE_S)
                    continue
                p.kill_sent = True
                signal_group(p.popen, signal.SIGKILL)
                if in_process and p.running and not self._culprit(p, latest):
                    phase = self.beats.get(p.local_rank, {}).get("phase")
                    self.voice.event("restart", f"rank {p.rank} on {self.node} did not leave "
                                     f"its generation in process within its stop's grace "
                                     f"(phase {phase}): killed, it restarts as a new process",
                                     rank=p.rank, restart="process")

    def _culprit(self, p: RankProcess, latest: Plan | None) -> bool:
        """Whether the plan's stop names this rank (or its node, for a node's fault)."""
        named = latest.culprit if latest is not None else None
        return (named is not None and named.node == self.node
                and named.rank in (None, p.rank))

    # --- ranks ---------------------------------------------------------------------------------

    def reap(self) -> None:
        for p in self.leaving:
            if p.popen.poll() is not None:
                signal_group(p.popen, signal.SIGKILL)  # what it left behind (below)
        self.leaving = [p for p in self.leaving if p.popen.returncode is None]
        for p in list(self.procs.values()):
            if p.popen.returncode is not None or p.popen.poll() is None:
                continue
            # A rank runs in a session of its own; what it started there (DCP's checkpoint
            # writer in async_mode process, ~270 MB; data workers) outlives it when it dies
            # of a signal or a crash (seen: one writer left for every rank a restart
            # benchmark killed, still running ten minutes later). Its process group goes with
            # it, at once: its pid stays that group's while one member lives, so no other
            # process can hold it meanwhile.
            signal_group(p.popen, signal.SIGKILL)
            if p.ready:  # its leaving the generation was reported; its exit adds nothing
                continue
            code = p.popen.returncode
            self.unreported.append(ExitRecord(
                node=self.node, rank=p.rank, local_rank=p.local_rank, generation=self.generation,
                pid=p.popen.pid, code=code if code >= 0 else None,
                signal=-code if code < 0 else None, by_agent=p.stop_sent is not None,
                time=time.time(), tail=tail(p.log_path), tail_age=log_age(p.log_path),
                launch=self.launched or 0))
            self.beats.pop(p.local_rank, None)
        if self.unreported:
            try:
                self.flush_exits()
            except StoreUnavailable as e:
                self.voice.outage(e)
        # Forget the finished ones once none is left running (their records are sent); ranks
        # waiting in process stay, for the next generation or their dismissal.
        if self.procs and not self.live() and not self.unreported:
            self.procs = {lr: p for lr, p in self.procs.items() if p.popen.returncode is None}

    def flush_exits(self) -> None:
        if self.unreported:  # the node's state changed: the next turn ticks and says so
            self.poke()
        while self.unreported:
            self.store.own.report_exit(self.unreported[0])
            self.unreported.pop(0)

    def drain_heartbeats(self) -> None:
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
            if (p is None or beat.get("pid") != p.popen.pid or p.popen.returncode is not None
                    or p.ready or beat.get("generation") != self.generation
                    or beat.get("launch", 0) != (self.launched or 0)):
                continue  # from a rank of an older generation (or launch), or between them
            if beat.get("phase") == READY:
                self.left(p, beat)
                continue
            beat["received"] = time.time()
            beat["rank"] = p.rank  # the job's rank: a replica's rank counts in its own world
            self.beats[local_rank] = beat
            if isinstance(beat.get("failed_saves"), int):  # agreed: every rank says the same
                self.failed_saves = beat["failed_saves"]
            sample_compute(p, beat)

    def left(self, p: RankProcess, beat: dict) -> None:
        """A rank left its generation and waits in process for the next: reported as its exit
        would have been (with the status it would have had, and its log's last lines, which
        say why), so the controller judges it alike; then it is no longer one of the
        generation's ranks."""
        p.left, p.left_launch = self.generation, self.launched or 0
        code = beat.get("exit_code")
        code = code if isinstance(code, int) and not isinstance(code, bool) and \
            0 <= code < 256 else 1
        self.beats.pop(p.local_rank, None)
        self.unreported.append(ExitRecord(
            node=self.node, rank=p.rank, local_rank=p.local_rank, generation=self.generation,
            pid=p.popen.pid, code=code, signal=None, by_agent=p.stop_sent is not None,
            time=time.time(), in_process=True, tail=tail(p.log_path),
            tail_age=log_age(p.log_path), launch=self.launched or 0))
        p.stop_sent, p.spared = None, False  # a stop it was sent is done: no SIGKILL for it
        self.poke()  # reported now, and a relaunch waiting for it goes on
        if self.ended:
            self.dismiss([p])

