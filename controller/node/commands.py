"""The commands an agent takes from its tick (`Store.push_command`): a hang's stacks, a health
check on demand, the controller's refusal of a node other hosts cannot reach, and operators'
and tests' faults (`optimus chaos`, the plan's node faults: their kinds are the contract's,
optimus/contract/chaos.py).

A hang's stacks (the controller's `dump_stacks` command) are collected on a thread of their own,
so the agent goes on reaping and relaying meanwhile: SIGUSR1, then py-spy from outside for a
rank that does not answer, then SIGUSR1 again (controller/node/stacks.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

from controller.common import reach
from controller.node.checks import Checks
from controller.node.rank_files import RankFiles
from controller.node.stacks import Target, collect, find_py_spy
from controller.node.voice import Voice
from controller.store.store import Store, StoreUnavailable
from optimus.config import ConfigError
from optimus.contract import chaos

if TYPE_CHECKING:
    from controller.node.lifecycle import Ranks


class Commands:
    """The commands one agent takes: it reads its ranks (`ranks`), has its node checked
    (`checks`) and writes its ranks' faults (`files`); it owns only the lock that keeps one
    stacks collection at a time."""

    def __init__(self, store: Store, node: str, voice: Voice, ranks: Ranks, checks: Checks,
                 files: RankFiles):
        self.store, self.node, self.voice = store, node, voice
        self.ranks, self.checks, self.files = ranks, checks, files
        self._stacks_lock = threading.Lock()

    def take(self, command: dict) -> None:
        kind = command.get("kind")
        if kind == "dump_stacks":
            self._dump_stacks(command)
        elif kind == "health_check":
            self.checks.say_health(self.checks.check_health(live=self.ranks.live()),
                                   "on demand")
        elif kind == "refused":
            self._refused(command)
        elif kind == "bad_tile":
            tile = command.get("tile", 0)
            if not isinstance(tile, int) or isinstance(tile, bool) or not 0 <= tile < 4096:
                self.voice.event("chaos", f"a bad_tile command for {self.node} ignored: tile "
                                 f"{str(tile)[:32]!r} is no tile index", fault="bad_tile")
                return
            self.checks.spoil(tile)
            self.voice.event("chaos", f"chaos on {self.node}: tile {tile} now "
                             "computes wrong results (seen by the next health check)",
                             fault="bad_tile")
        else:
            self._chaos(command)

    def _refused(self, command: dict) -> None:
        """The controller found this node unreachable from the others (controller/node/
        reach.py). Acted on only when this agent's own address is loopback (its own fact;
        the command says only why): it leaves with the controller's line."""
        if not self.checks.info.get("loopback"):
            return
        why = str(command.get("why", ""))[:2000] or (
            f"node {self.node} advertises a loopback address while other nodes run elsewhere; "
            f"{reach.FIX}")
        self.store.own.leave(self.node)
        raise ConfigError(f"optimus agent --node {self.node}", why)

    def _dump_stacks(self, command: dict) -> None:
        """The asked ranks' stacks, gathered on a thread (a rank that does not answer SIGUSR1
        takes seconds: the agent goes on meanwhile), then put in the store."""
        targets = [Target(p.rank, p.popen.pid, p.stacks_path) for p in self.ranks.procs.values()
                   if p.local_rank in command.get("local_ranks", [])
                   and p.popen.returncode is None and p.stacks_path is not None]
        generation = command.get("generation", self.ranks.generation or 0)
        if targets:
            threading.Thread(target=self._collect_stacks, args=(targets, generation),
                             name="stacks", daemon=True).start()

    def _collect_stacks(self, targets: list[Target], generation: int) -> None:
        with self._stacks_lock:  # one collection at a time: they share the stacks files
            stacks, notes = collect(targets, py_spy=find_py_spy())
        for rank, note in sorted(notes.items()):
            self.voice.event("stacks", f"stack of rank {rank} on {self.node}: {note}", rank=rank)
        with contextlib.suppress(StoreUnavailable):
            self.store.own.put_stacks(generation, stacks)

    def _chaos(self, command: dict) -> None:
        kind = command.get("kind")
        by = command.get("by", "")
        why = f" (by {by}" + (f": {command['reason']}" if command.get("reason") else "") + ")"
        self.voice.event("chaos", f"chaos on {self.node}: {kind} "
                         f"{command.get('rank', '') if kind != chaos.KILL_NODE else ''}".rstrip()
                         + (why if by else ""),
                         fault=kind, rank=command.get("rank", ""), sent=command.get("time", ""),
                         by=by, reason=command.get("reason", ""))
        if kind == chaos.KILL_NODE:
            self._die()
        procs, generation = self.ranks.procs.values(), self.ranks.generation
        if kind == chaos.SPIKE and isinstance(command.get("step"), int):  # every rank here
            self.files.add_fault(kind=kind, rank=None, generation=generation,
                                 step=command["step"])
            return
        if kind in chaos.IN_STEP:  # the rank fires it in a step
            hit = [p for p in procs if p.rank == command.get("rank") and p.popen.returncode is None]
            if hit:  # as the rank knows itself: in its replica's world, under replicas
                self.files.add_fault(
                    kind=kind, rank=self.ranks.own_rank(hit[0]), generation=generation,
                    seconds=command.get("seconds", 0.0),
                    **({"step": command["step"]} if isinstance(command.get("step"), int)
                       else {}))
            return
        for p in procs:
            if p.rank == command.get("rank") and p.popen.returncode is None:
                sig = signal.SIGKILL if kind == "kill_rank" else signal.SIGSTOP
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.popen.pid, sig)

    def check_node_faults(self) -> None:
        """The plan's node faults (a job file's kill_node): this node dies at its step."""
        plan, generation = self.ranks.plan, self.ranks.generation
        if plan is None or generation is None:
            return
        node_rank = plan.nodes.index(self.node) if self.node in plan.nodes else -1
        step = max((b.get("step", 0) for b in self.ranks.beats.values()), default=0)
        for fault in plan.node_faults:
            if (fault.generation == generation and fault.node == node_rank
                    and step >= fault.step):
                self.voice.event("chaos", f"fault injection: node {self.node} (node rank "
                                 f"{node_rank}) dies at step {step}", fault="kill_node")
                self._die()

    def _die(self) -> None:
        """A node lost: the ranks and the agent, at once, with no goodbye."""
        for p in self.ranks.procs.values():
            signal_group(p.popen, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def signal_group(popen: Any, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)
