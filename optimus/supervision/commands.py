"""Commands agreed by all ranks: pause, stop, checkpoint now, stop without saving.

Each rank collects what it was asked: SIGTERM asks for STOP; the agent's control file
($OPTIMUS_CONTROL_FILE, a small JSON object the agent rewrites atomically when an operator acts:
{"pause": true, "checkpoint": 3}) asks for PAUSE while "pause" is true, and for a checkpoint
each time "checkpoint" (a sequence number) grows; "save": false, which an agent writes before
it sends SIGTERM for a stop on evidence of wrong arithmetic (a bad tile) or for a rewind, makes
that stop one without a checkpoint (NO_SAVE). At every step boundary all ranks agree, in one
all-reduce (MAX) of four integers: a bit set on any rank is set on all (a MAX of 0/1 is an OR),
and the checkpoint number agreed is the newest any rank has seen. Every rank then acts on the
same values after the same step: nobody pauses, saves or stops a step before another. Ranks
read the file with one stat() per boundary; they need not see a change at the same moment.
"""

from __future__ import annotations

import enum
import json
import os
import signal
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from optimus.contract import env

PAUSE_POLL_S = 0.2  # while paused, how often the ranks agree on the commands again


class Command(enum.IntFlag):
    """What all ranks do together after a step: the bits of the word they agree on."""

    STOP = 1  # save a checkpoint of this step and leave training (SIGTERM)
    PAUSE = 2  # wait at this step boundary until no rank is asked to pause any more
    NO_SAVE = 4  # a STOP saves nothing: the state may be wrong (the control file's "save")


@dataclass(frozen=True)
class Agreed:
    """The commands every rank acts on after one step: the same on all of them."""

    commands: Command
    checkpoint: int  # the newest checkpoint request any rank has seen (0: none)
    quorum: int = 0  # the newest quorum id any rank of the world has read (replicas)

    @property
    def stop(self) -> bool:
        return bool(self.commands & Command.STOP)

    @property
    def pause(self) -> bool:
        return bool(self.commands & Command.PAUSE)

    @property
    def no_save(self) -> bool:
        return bool(self.commands & Command.NO_SAVE)


class Commands:
    """The commands this rank was given, and what all ranks agree on at a step boundary.

    `listen()` makes SIGTERM request STOP (from the main thread only: Python runs signal
    handlers there); `close()` puts the previous handler back. `start()` is the first agreement,
    before the first step: it fixes which checkpoint request counts as done already (every rank
    the same), so a restarted generation does not repeat an old one.
    """

    def __init__(self, world_size: int, device: torch.device, control_file: str | None = None):
        self.requested = Command(0)
        self.checkpoint_seen = 0  # the newest checkpoint number in the control file
        self.checkpoint_done = 0  # agreed: requests up to this one are served
        self.no_save = False  # agreed: stop without a checkpoint (kept once agreed)
        self.world_size, self.device = world_size, device
        # The group the word is all-reduced over: a host (gloo) group under nccl or xccl, so the
        # agreement never waits on the device (optimus/runtime/dist.py `host_group`); None: the
        # default group.
        self.group: dist.ProcessGroup | None = None
        self.control_file = control_file if control_file is not None else os.environ.get(
            env.CONTROL_FILE)
        self._control_key: tuple | None = None
        self._listening = False
        self._previous = None
        # The newest quorum id this rank has read (optimus/parallel/replica_mode.py): agreed
        # with the commands, so every rank of a replica knows it after the same step.
        self.quorum_seen = 0

    def listen(self) -> Commands:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._listening = True
        return self

    def close(self) -> None:
        if self._listening:
            # None: the previous handler was not set from Python; the default is the best guess.
            signal.signal(signal.SIGTERM,
                          signal.SIG_DFL if self._previous is None else self._previous)
            self._listening = False

    def start(self) -> Agreed:
        """The agreement before the first step; requests made before it are not repeated."""
        agreed = self.agree()
        self.checkpoint_done = agreed.checkpoint
        return agreed

    def agree(self) -> Agreed:
        """Every rank's requests combined. Collective on the default group (all ranks call it
        at the same step boundary); free with one rank."""
        # STOP before the file: an agent writes a stop's "save": false before its SIGTERM, so
        # a STOP taken here comes with its NO_SAVE (a SIGTERM from now on waits a boundary).
        stop = self.requested & Command.STOP
        self._read_control()
        requested = self.requested & ~Command.STOP | stop
        if self.world_size == 1:
            agreed, checkpoint, quorum = requested, self.checkpoint_seen, self.quorum_seen
        else:
            flags = [int(bool(requested & c)) for c in Command]
            word = torch.tensor([*flags, self.checkpoint_seen, self.quorum_seen],
                                dtype=torch.int64, device=self.device)
            dist.all_reduce(word, op=dist.ReduceOp.MAX, group=self.group)
            values = word.tolist()
            agreed, checkpoint, quorum = Command(0), values[-2], values[-1]
            for command, on in zip(Command, values, strict=False):
                if on:
                    agreed |= command
        if agreed & Command.STOP and agreed & Command.NO_SAVE:
            self.no_save = True
        self.quorum_seen = quorum
        return Agreed(agreed, checkpoint, quorum)

    def checkpoint_due(self, agreed: Agreed) -> bool:
        """Whether `agreed` carries a checkpoint request not served yet; marks it served."""
        if agreed.checkpoint <= self.checkpoint_done:
            return False
        self.checkpoint_done = agreed.checkpoint
        return True

    def _read_control(self) -> None:
        """Re-read the agent's control file when it changed (one stat() otherwise)."""
        if not self.control_file:
            return
        try:
            st = os.stat(self.control_file)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key == self._control_key:
                return
            with open(self.control_file, "rb") as f:
                control = json.loads(f.read())
        except (OSError, ValueError):
            return  # none yet, or mid-replace: the next boundary reads it
        self._control_key = key
        if control.get("pause"):
            self.requested |= Command.PAUSE
        else:
            self.requested &= ~Command.PAUSE
        self.checkpoint_seen = max(self.checkpoint_seen, int(control.get("checkpoint") or 0))
        if control.get("save") is False:
            self.requested |= Command.NO_SAVE

    def _on_sigterm(self, signum, frame) -> None:
        self.requested |= Command.STOP
