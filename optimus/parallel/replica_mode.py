"""`optimus train` as one data-parallel replica among several, when a lost replica must not stop
the others (`supervision.on_replica_loss: continue`; the exchange, the quorum and the heal are
optimus/parallel/replicas.py's).

The launch says so: `OPTIMUS_QUORUM_FILE` names the quorum file and `OPTIMUS_REPLICA` the
replica this rank's world is (0 .. parallel.replicas - 1); a standby started for a lost rank is
told `OPTIMUS_QUORUM_AFTER`, the newest quorum id it must not join (its replica's place in older
ones is the rank it replaces). The rank's torch.distributed world is its replica's alone. The
job is the whole job: `parallel.replicas` replicas of a world each, so the layout inside a
replica is the job's with one replica (its shard, tensor, context and expert degrees), and the
data are sliced over every replica's ranks: replica r's rank at batch index b reads slice
r x (batch ranks a replica) + b of each global batch, as under HSDP.

What changes in a rank's life:
- each step, between backward and clip, the replica's gradients go to the quorum (one
  all-reduce per position: `exchange`); the step's loss and token count become the quorum's;
- before a step, a newer quorum the members agreed on is formed (`before`); a rank left out of
  it waits to be let back in, and comes back healed;
- a rank healed past the step it was computing drops that step and takes the next one from the
  state it was sent (`Healed`): the loop reopens its data where that state stands;
- the lowest member replica writes the metrics and the checkpoints (`writes`): the others
  hold the same state;
- at the end, the members check that they hold the same state bit for bit (`finish`).

Host reads: none a step. The quorum's figures (token count, loss, the members' newest seen ids)
stay on the device for the step's own figures, and reach host memory behind the step, as the
step's figures do (optimus/runtime/readback.py): the newest id is read at the next boundary.
On gloo the exchange waits for its all-reduce on the host (there the host is the device).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from optimus.contract.env import QUORUM_AFTER, QUORUM_FILE, REPLICA
from optimus.metrics import CATCH_UP_ROWS, ROW_KEYS
from optimus.parallel.heal import HealError
from optimus.parallel.positions import Positions
from optimus.parallel.replicas import (
    SLOTS,
    Notes,
    QuorumError,
    ReplicaOut,
    Replicas,
    state_tensors,
)
from optimus.runtime.launch import LaunchError
from optimus.runtime.readback import Pending, Readback
from optimus.supervision.commands import Agreed, Command
from optimus.supervision.inprocess import launch_count

WORD = ("stop", "pause", "no_save", "checkpoint")  # what a replica tells the others a step


class Healed(Exception):  # noqa: N818 (a signal to the loop, not an error)
    """This rank was healed past the step it was computing: the loop goes on from the state's
    step (its data reopened there)."""


@dataclass(frozen=True)
class ReplicaLaunch:
    """What the launch says of replicas: which one this rank's world is, of how many."""

    replica: int
    replicas: int
    quorum_file: Path
    after: int = 0  # the first quorum joined is newer than this id
    launch: int = 0  # its replica's launch in the generation: > 0, relaunched within it

    @classmethod
    def from_env(cls, replicas: int, environ=None) -> ReplicaLaunch | None:
        """None unless the launch names a quorum file; a launch that does, wrongly, is a
        LaunchError naming the variable and its fix."""
        environ = os.environ if environ is None else environ
        path = environ.get(QUORUM_FILE)
        if not path:
            return None
        raw = environ.get(REPLICA, "")
        if not (raw.isdigit() and len(raw) <= 6):
            raise LaunchError(f"{REPLICA}={raw!r}: with {QUORUM_FILE} set, name the rank's "
                              f"replica as a number from 0 to parallel.replicas - 1")
        if replicas < 2:
            raise LaunchError(f"{QUORUM_FILE} is set but parallel.replicas is {replicas}: "
                              "replicas that carry on need at least 2 (set parallel.replicas)")
        if int(raw) >= replicas:
            raise LaunchError(f"{REPLICA}={raw} but parallel.replicas is {replicas}: name a "
                              f"replica from 0 to {replicas - 1}")
        after = environ.get(QUORUM_AFTER, "0")
        if not (after.isdigit() and len(after) <= 18):
            raise LaunchError(f"{QUORUM_AFTER}={after!r}: a quorum id (a whole number)")
        return cls(int(raw), replicas, Path(path), int(after), launch_count(environ))

    def world_job(self, job):
        """The job as one replica's world runs it: its layout with one replica (which has no
        other to carry on without it)."""
        return job.model_copy(update={
            "parallel": job.parallel.model_copy(update={"replicas": 1}),
            "supervision": job.supervision.model_copy(update={"on_replica_loss": "restart"})})

    def batch_slice(self, batch_rank: int, batch_ranks: int) -> tuple[int, int]:
        """(this rank's slice of the global batch, the slices): over every replica's ranks."""
        return self.replica * batch_ranks + batch_rank, self.replicas * batch_ranks


class ReplicaSteps:
    """The rank's side of the quorum through `optimus train`'s loop."""

    def __init__(self, launch: ReplicaLaunch, *, position: int, backend: str, model,
                 optimizer, progress, watch, commands, timeout_s: float, wait_s: float,
                 log=None, positions: Positions | None = None):
        self.launch, self.model, self.optimizer = launch, model, optimizer
        self.progress, self.watch, self.commands = progress, watch, commands
        self.log = log  # the rank's MetricsLog: its recent rows travel with a heal
        self.replicas = Replicas(launch.quorum_file, replica=launch.replica, position=position,
                                 backend=backend, timeout_s=timeout_s, wait_s=wait_s,
                                 state=self.state, notes=Notes(self._give, self._take),
                                 positions=positions)
        self.readback: Readback | None = None  # the exchanges' figures, to host memory
        # (step, quorum id, members, its figures), of the exchanges not read yet
        self.tails: list[tuple[int, int, int, Pending]] = []
        self.word = [0] * len(WORD)  # this replica's commands, for its next exchange
        self.told = [0] * len(WORD)  # every member's, as the last exchange read summed them
        self.told_step = 0  # that exchange's step
        self.paused_at = -1  # the last boundary all members paused at
        self.writer: int | None = None  # the replica that wrote the metrics at the last step

    def state(self) -> list[torch.Tensor]:
        """What a heal carries: this rank's model and optimizer shards."""
        view = self.model.state_view()
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        return state_tensors(get_model_state_dict(view),
                             get_optimizer_state_dict(view, self.optimizer, options=flat))

    def _give(self) -> dict:
        rows = list(self.log.recent) if self.log is not None else []
        return {"progress": self.progress.meta(), "stability": self.watch.state_dict(),
                "rows": rows}

    def _take(self, notes: dict):
        """A heal's notes, checked (a peer's message: the progress must be whole numbers, or
        the heal fails); returns what takes them, once the replica's ranks all have theirs."""
        progress, stability = notes.get("progress"), notes.get("stability")
        if not (isinstance(progress, dict) and isinstance(stability, dict)
                and all(type(progress.get(k)) is int and progress[k] >= 0
                        for k in ("step", "tokens", "data_index"))):
            raise HealError("a heal's notes do not hold progress and the stability history")
        # The source's recent metrics rows: the steps this rank is healed past, should it
        # write the metrics next (its writer lost before writing them: `roles`).
        rows = notes.get("rows", [])
        if not (isinstance(rows, list) and len(rows) <= CATCH_UP_ROWS and all(
                isinstance(r, dict) and type(r.get("step")) is int and r["step"] >= 0
                and r.keys() <= ROW_KEYS for r in rows)):
            raise HealError("a heal's notes hold metrics rows that are not rows of steps")

        def taken() -> None:
            self.progress.load_state_dict(progress)
            self.watch.load_state_dict(stability)  # takes only what it recognises
            if self.log is not None:
                self.log.adopt(rows)
        return taken

    @property
    def members(self) -> list[int]:
        quorum = self.replicas.quorum
        return list(quorum.members) if quorum is not None else []

    def writes(self) -> bool:
        """Whether this replica writes the run's metrics and checkpoints: the lowest member."""
        return bool(self.members) and self.launch.replica == min(self.members)

    def join(self) -> None:
        """The first quorum holding this replica, agreed (healed if it is behind). The rank's
        log says when it starts waiting: a standby is then ready to be let in. A replica
        relaunched within its generation (it read no checkpoint: a member heals it) makes the
        state a heal carries first (its optimizer's, where it has none yet), so that the heal
        the members wait on only carries bytes."""
        if self.launch.launch:
            self.state()
        print(f"replica {self.launch.replica}: ready at step {self.progress.step}, waiting for "
              f"a quorum after id {self.launch.after} that holds it", file=sys.stderr,
              flush=True)
        self.replicas.join(self.progress.step, after=self.launch.after)

    def before(self, step: int, settle) -> bool:
        """Before `step`: form the newer quorum due now (the step before read and judged
        first: a heal carries its figures). A rank left out waits to be let back in. True
        when this rank was healed to another step (the loop goes on from `progress.step`)."""
        rep = self.replicas
        if rep.pending is None or step < rep.pending[1]:
            return False
        settle()
        was = self.progress.step
        try:
            inside = rep.before(step, was)
        except ReplicaOut:
            raise
        except (RuntimeError, TimeoutError):  # the newer quorum did not meet: the next one
            inside = False
        if not inside:
            rep.recover(was)
        return self.progress.step != was

    def exchange(self, parameters, tokens: torch.Tensor, loss: torch.Tensor, step: int):
        """Step `step`'s gradients, token count and loss (this rank's share, of the replica's
        tokens) summed over the quorum: (tokens, loss share) of every member's tokens. Raises
        Healed when the quorum that took the step again healed this rank past it."""
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for p in parameters if p.grad is not None]
        reduced = self.replicas.exchange(grads, tokens, loss.detach() * tokens,
                                         self.progress.step, self.word)
        if reduced is None:
            raise Healed(step)
        figures = reduced.figures
        if self.readback is None:
            self.readback = Readback(figures.device)
        # Its members' newest seen ids, read one step late, with no wait (`look`).
        quorum = self.replicas.quorum
        self.tails.append((step, quorum.id, len(quorum.members), self.readback.start(figures)))
        total = figures[0].clamp(min=1.0)
        return total, figures[1] / total

    def fingerprint(self, batch_slice: int) -> dict:
        """What a step's sample fingerprint adds (optimus/data/audit.py): the slice the writer
        read, and the replicas whose slices were trained, of how many."""
        return {"slice": batch_slice, "replicas": self.members, "of": self.launch.replicas}

    def look(self) -> None:
        """At the step boundary, before the ranks agree: a newer quorum in the file, told to
        the other ranks of the replica with the commands (all then hold the same newest id)."""
        rep = self.replicas
        # The exchange before this step's: its figures have long reached host memory. It
        # revealed the newest id any member had seen; all switch two steps after it, together
        # (`switch_step`). Figures of an earlier quorum than the one formed since are dropped:
        # members who joined since did not see them.
        while len(self.tails) > 1:
            step, quorum, size, pending = self.tails.pop(0)
            values = pending.read()
            if rep.quorum is not None and quorum == rep.quorum.id:
                rep.after(step, int(max(values[SLOTS:SLOTS + size])))
                words = values[SLOTS + size:]
                self.told = [max(words[i::len(WORD)]) for i in range(len(WORD))]
                self.told_step = step
        rep.look()
        self.commands.quorum_seen = max(self.commands.quorum_seen, rep.seen)

    def across(self, agreed: Agreed, step: int) -> Agreed:
        """The commands every member acts on after step `step`: what each member's ranks
        agreed two boundaries ago, carried by the exchange between and read at this boundary
        (the same figures in every member: all act after the same step). What this replica's
        ranks agreed now goes into the next exchange. A pause is a state: words agreed up to
        the boundary of the last pause, which it has ended since, no longer pause."""
        self.word = [int(agreed.stop), int(agreed.pause), int(agreed.no_save),
                     agreed.checkpoint]
        stop, pause, no_save, checkpoint = (int(x) for x in self.told)
        if pause and self.told_step - 1 <= self.paused_at:
            pause = 0
        if pause:
            self.paused_at = step
        return self._agreed(stop, pause, no_save, checkpoint, agreed.quorum)

    def across_now(self, agreed: Agreed) -> Agreed:
        """While every member is paused after the same step: the members' commands now, in
        one all-reduce (so all resume, or stop, together)."""
        self.word = [int(agreed.stop), int(agreed.pause), int(agreed.no_save),
                     agreed.checkpoint]
        stop, pause, no_save, checkpoint = self.replicas.group.words(self.word)
        return self._agreed(stop, pause, no_save, checkpoint, agreed.quorum)

    def _agreed(self, stop: int, pause: int, no_save: int, checkpoint: int,
                quorum: int) -> Agreed:
        commands = Command(0)
        for on, command in ((stop, Command.STOP), (pause, Command.PAUSE),
                            (no_save, Command.NO_SAVE)):
            if on:
                commands |= command
        if stop and no_save:
            self.commands.no_save = True
        return Agreed(commands, max(checkpoint, self.commands.checkpoint_done), quorum)

    def agreed(self) -> None:
        """After the ranks agreed: the newest quorum id any rank of the replica had read."""
        self.replicas.seen = max(self.replicas.seen, self.commands.quorum_seen)

    def report(self, log) -> None:
        """Quorums formed, missed and exchanges failed since the last report, as events."""
        rep = self.replicas
        for kind, rows in (("quorum", rep.heals), ("quorum_missed", rep.missed),
                           ("exchange_failed", rep.failed)):
            for row in rows[getattr(self, f"_{kind}", 0):]:
                log.event(kind, _say(kind, row, self.launch.replica), replica=self.launch.replica,
                          **row)
            setattr(self, f"_{kind}", len(rows))

    def roles(self, log, saves, ckpt, logs: bool) -> bool:
        """Before a step: the metrics, checkpoints and memory snapshots are this replica's to
        write when it is the lowest member (`logs`: this rank writes the metrics at all); a
        save in flight lands before its writer hands the role on. Returns whether it writes."""
        writes = self.writes()
        was, self.writer = self.writer, min(self.members) if self.members else None
        log.enabled = logs and writes
        if writes and was is not None and was != self.writer and was not in self.members:
            # its writer was lost: the rows of steps it had not written, from this rank's
            caught = log.catch_up()
            if caught:
                log.event("metrics_caught_up", f"replica {self.launch.replica} writes the "
                          f"metrics now; replica {was} was lost before writing steps "
                          f"{caught[0]}-{caught[-1]}, written from this replica's figures",
                          steps=caught, lost=was)
        if saves.ckpt is not None and not writes:
            saves.ckpt.wait()
        saves.ckpt = ckpt if writes else None
        return writes

    def close(self) -> None:
        if self.replicas.group is not None:
            self.replicas.group.close()

    def finish(self, log) -> None:
        """At the end: the members hold the same state, checked (an error if not)."""
        rep = self.replicas
        began = time.perf_counter()
        same = rep.group.verify(self.state())
        members = self.members
        if not same:
            raise QuorumError(f"replicas {members} end at step {self.progress.step} with "
                              "different states")
        log.event("replicas", f"replicas {members} end at step {self.progress.step} with the "
                  f"same state, bit for bit (checked in {time.perf_counter() - began:.2f} s)",
                  members=members, step=self.progress.step)
        rep.group.close()


def _say(kind: str, row: dict, replica: int) -> str:
    if kind == "quorum":
        healed = f"; replica(s) {row['healed']} healed from replica {row['source']} in " \
                 f"{row['heal_s']:.3f} s" if row["healed"] else ""
        return f"quorum {row['quorum']} formed with replicas {row['members']}{healed}"
    if kind == "quorum_missed":
        return f"quorum {row['quorum']} did not meet: {row['error']}"
    return f"replica {replica}'s exchange in quorum {row['quorum']} failed: {row['error']}"
