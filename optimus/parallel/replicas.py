"""What crosses data-parallel replicas when a lost replica must not stop the others
(`supervision.on_replica_loss: continue`): the quorum groups, the step's one exchange, the heal.

In that mode each replica trains as its own torch.distributed world: its groups (shard, tensor,
pipeline, context, experts) hold only its own ranks, so a fault in one replica breaks no group
of another. What crosses replicas goes through a *quorum group*, one per position inside a
replica (a rank's rank in its replica's world): the ranks at that position in every replica of
the current quorum. The controller is the quorum's authority: it names each quorum in a
`Quorum` record (optimus/contract/records.py: an id that only grows, the member replicas, the
store their groups meet at) that every rank reads from its quorum file.

Why groups of our own rather than torch's: `dist.new_group` is collective over the whole
default world, whose lost ranks can no longer take part, and gloo does not implement
`shrink_group` (torch 2.13: NCCL only). A quorum group is a backend object made directly on a
prefix of the quorum's store (`optimus/quorum/<id>/<position>/`): made by its members alone,
with no world-wide rendezvous, and the groups inside each replica are left as they are.

One exchange a step (`QuorumGroup.reduce`): each replica's gradients, computed with its loss
divided by its own token count, are scaled back by that count, and go in one all-reduce (SUM)
with the count itself, the replica's loss sum and, in the member's own slot, the newest quorum
id it has seen. Dividing by the summed count gives the gradient of the loss over the tokens of
the replicas taking part, whichever they are; the summed slots tell every member the same
newest id, so all switch to it after the same step (`switch_step`). A step whose exchange
fails (a peer gone, or silent past the hang bound) is not applied by this replica: it waits
for the next quorum and takes the step again in it.

Two replicas can disagree about a step only if an exchange completes for one and fails for the
other, the dead peer's part having reached the first (an all-reduce completes nowhere without
every member's part). So each new quorum starts by agreeing on its members' steps (`agree`):
a member behind the others (that case, or a replica rejoining) heals from the lowest-indexed
member ahead, which sends it its model and optimizer shards (`heal`: a large tensor as a
message of its own, the small ones packed, each message with a checksum the receiver verifies
before it takes any). A step is thus never applied in one replica and
not in another once a quorum has formed, and a rank outside the current quorum applies none:
its exchange has no peers. Inside a replica of several ranks, each position's exchange and heal
succeed or fail on their own; its ranks apply what crossed over only when every position has
(optimus/parallel/positions.py), so a replica never applies a step at one position and takes it
again without the lost replica at another.

The group itself is optimus/parallel/quorum_group.py's; this module is a rank's life with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import torch

from optimus.contract.records import Quorum
from optimus.files import file_stamp
from optimus.parallel.heal import (  # noqa: F401 (re-exported)
    HealError,
    checksum,
    device_checksum,
    state_tensors,
)
from optimus.parallel.positions import Positions
from optimus.parallel.quorum_file import (  # noqa: F401 (re-exported)
    QuorumError,
    ReplicaOut,
    meet,
    read_quorum,
    wait_for_quorum,
)
from optimus.parallel.quorum_group import (  # noqa: F401 (re-exported)
    CONNECT_S,
    SLOTS,
    Notes,
    QuorumGroup,
    Reduced,
    Summed,
    connect,
    switch_step,
)


class Replicas:
    """A rank's side of the quorum through training: it joins a quorum, exchanges each step
    in it, notices newer quorums, switches with the other members, and after a failed exchange
    waits for the controller's next quorum and heals or is healed.

    `state` gives, in a fixed order, the tensors a heal carries (this rank's model and
    optimizer shards and progress counters): the same shapes at this position in every
    replica; `notes`, the host-side state it carries besides. `beat` runs while it waits (the
    rank's heartbeat says it is alive). `positions`: the replica's ranks, when it has several
    (they form the same quorums, and apply an exchange or a heal only when all have theirs)."""

    def __init__(self, path: Path, *, replica: int, position: int, backend: str,
                 timeout_s: float, wait_s: float, state: Callable[[], Sequence[torch.Tensor]],
                 beat: Callable[[], None] | None = None, notes: Notes | None = None,
                 positions: Positions | None = None):
        self.path, self.replica, self.position = Path(path), replica, position
        self.backend, self.timeout_s, self.wait_s = backend, timeout_s, wait_s
        self.state, self.beat, self.notes = state, beat, notes
        self.positions = positions if positions is not None and positions.size > 1 else None
        self.group: QuorumGroup | None = None
        self.seen = 0  # the newest quorum id this rank has read
        self.read: dict[int, Quorum] = {}  # the quorums it read, by id (the last few)
        self._stamp: tuple | None = None  # the quorum file as `look` last read it
        self._moved: tuple = (None, None)  # (its stamp, the quorum) as `_moved_on` read it
        self.pending: tuple[int, int] | None = None  # (id, step before which to switch)
        self.heals: list[dict] = []  # what each (re)formed quorum healed, for the log
        self.missed: list[dict] = []  # quorums whose members did not all meet
        self.failed: list[dict] = []  # exchanges that failed, each taken again in the next
        self.tried = 0  # the newest quorum id this rank formed or tried to

    @property
    def quorum(self) -> Quorum | None:
        return self.group.quorum if self.group is not None else None

    def join(self, step: int, after: int = 0) -> None:
        """Wait for a quorum newer than `after` that holds this replica, form its group and
        agree on the step with its members (healing whoever is behind); a quorum whose members
        do not all meet within the timeout is given up for the next one. `step`: the last step
        this rank applied (0 when it has none)."""
        while True:
            quorum = wait_for_quorum(self.path, after=after, replica=self.replica,
                                     member=bool(self.heals),
                                     timeout_s=self.wait_s, beat=self.beat)
            if self.positions is not None:  # the replica's ranks read the same quorum
                read = self.positions.decide(True, quorum.id, self._out)
                if not read.same:  # the file moved on between their reads: read it again
                    after = max(after, read.high - 1)
                    continue
            why = self._form(quorum, step)
            if why is None:
                return
            self.missed.append({"quorum": quorum.id, "error": why[:200]})
            after = quorum.id

    def _form(self, quorum: Quorum, step: int) -> str | None:
        """Form `quorum`'s group, agree and heal; None once formed, else why it did not (a
        member missing or gone meanwhile, at this position or another of the replica's)."""
        if self.group is not None:
            self.group.close()
        self.group, self.pending, self.tried = None, None, quorum.id
        self.seen = max(self.seen, quorum.id)
        began = formed = time.perf_counter()
        group, why = None, None
        try:
            group = self._reach(quorum)
            formed = time.perf_counter()
            steps = group.agree(step)
            source, behind, taken = group.heal(self.state, steps, self.notes)
        except (RuntimeError, TimeoutError) as e:
            why = str(e) or type(e).__name__
        if self.positions is not None:
            decided = self.positions.decide(why is None, quorum.id, self._out)
            if why is None and not decided.all:
                why = (f"another rank of replica {self.replica} did not form quorum "
                       f"{quorum.id}: none of its ranks takes what that quorum healed")
        if why is not None:
            if group is not None:
                group.close()
            return why
        taken()
        self.group = group
        self.heals.append({"quorum": quorum.id, "members": list(quorum.members),
                           "steps": steps, "source": quorum.members[source],
                           "healed": [quorum.members[i] for i in behind],
                           "group_s": round(formed - began, 4),  # the members meeting
                           "heal_s": round(time.perf_counter() - formed, 4)})
        return None

    def _reach(self, quorum: Quorum) -> QuorumGroup:
        """The quorum's group, its store tried CONNECT_S at a time: between tries, a newer
        quorum in the file (its store's host lost meanwhile) ends the wait."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                store = connect(quorum, min(CONNECT_S, self.timeout_s))
                break
            except (RuntimeError, TimeoutError):
                newer = read_quorum(self.path)
                if time.monotonic() > deadline or (newer is not None and newer.id > quorum.id):
                    raise
        store.set_timeout(timedelta(seconds=self.timeout_s))
        meet(store, quorum, position=self.position, replica=self.replica, path=self.path,
             timeout_s=max(deadline - time.monotonic(), 1.0))
        return QuorumGroup(quorum, replica=self.replica, position=self.position,
                           backend=self.backend, timeout_s=self.timeout_s, store=store)

    def exchange(self, grads: Sequence[torch.Tensor], tokens: torch.Tensor,
                 loss_sum: torch.Tensor, last: int, word: Sequence[int] = ()) -> Reduced | None:
        """The step's exchange, finished without whoever is lost: when it fails (a member
        gone or silent) nothing of it is applied, this rank waits for the controller's next
        quorum and exchanges the same gradients again in it (they are untouched until an
        exchange succeeds: the step is not computed again). `last`: the last step this rank
        applied. None when the new quorum healed this rank past `last` (the others had
        applied this step: its state now holds it, and its own gradients are to be dropped).
        `word`: what this rank tells the other members (QuorumGroup.reduce)."""
        while True:
            summed, why = None, ""
            try:
                summed = self.group.reduce(grads, tokens, loss_sum, self.seen, self._moved_on,
                                           word)
            except (RuntimeError, TimeoutError) as e:
                why = str(e) or type(e).__name__
            if self.positions is not None:  # applied by all the replica's ranks, or by none
                decided = self.positions.decide(summed is not None, self.quorum.id, self._out)
                if summed is not None and not decided.all:
                    summed = None
                    why = (f"another rank of replica {self.replica} failed its exchange in "
                           f"quorum {self.quorum.id}: no rank of it applies that exchange")
            if summed is not None:
                return summed.apply()
            self.failed.append({"quorum": self.quorum.id, "error": why[:200]})
            self.recover(last)
            if self.heals[-1]["steps"][self.group.index] != max(self.heals[-1]["steps"]):
                return None

    def _newest(self) -> Quorum | None:
        """The quorum in the file, read only when it changed (a stat otherwise: this is asked
        after every exchange); None while there is none, or none readable."""
        stamp = file_stamp(self.path)
        if stamp != self._moved[0]:
            try:
                quorum = read_quorum(self.path)
            except QuorumError:
                quorum = None
            self._moved = (stamp, quorum)
        return self._moved[1]

    def _moved_on(self) -> str | None:
        """Why the current quorum's exchange is to be given up: a newer quorum in the file
        that leaves out one of its members (their part will not come)."""
        quorum = self._newest()
        if quorum is None or quorum.id <= self.quorum.id:
            return None
        gone = sorted(set(self.quorum.members) - set(quorum.members))
        return f"quorum {quorum.id} leaves out replica(s) {gone}" if gone else None

    def _out(self) -> str | None:
        """Why this rank's replica is out: it was a member, and a quorum newer than the last
        it formed or tried leaves it out (as `wait_for_quorum` says it: ReplicaOut)."""
        quorum = self._newest()
        if (not self.heals or quorum is None or quorum.id <= self.tried
                or self.replica in quorum.members):
            return None
        return f"replica {self.replica} is out of quorum {quorum.id} ({quorum.members})"

    def recover(self, step: int) -> None:
        """After a failed exchange or switch: the next quorum holding this replica, formed and
        agreed. `step`: the last step this rank applied."""
        self.join(step, after=self.tried)

    def look(self) -> None:
        """At a step boundary: read the quorum file (a stat, and a read when it changed) for
        an id newer than those seen; the next exchange tells the other members of it."""
        stamp = file_stamp(self.path)
        if stamp is None or stamp == self._stamp:  # none yet, or unchanged: unread
            return
        self._stamp = stamp
        quorum = read_quorum(self.path)
        if quorum is not None and quorum.id > self.seen:
            self.seen = quorum.id
            self.read = {i: q for i, q in self.read.items() if i >= self.quorum.id}
            self.read[quorum.id] = quorum

    def after(self, step: int, reduced: Reduced | int) -> None:
        """After step `step`'s exchange (`reduced`, read when the step's figures are, or the
        newest id it revealed): a newer quorum id any member had seen is switched to before
        `switch_step(step)`, by all."""
        newest = reduced if isinstance(reduced, int) else reduced.newest()
        if newest > self.quorum.id and (self.pending is None or self.pending[0] < newest):
            self.pending = (newest, switch_step(step))

    def before(self, step: int, last: int) -> bool:
        """Before step `step`: when it is the switch step, form the newer quorum (agreeing on
        `last`, the last step applied). Returns False when that quorum leaves this replica
        out: the rank must apply no further update and wait (`recover`)."""
        if self.pending is None or step < self.pending[1]:
            return True
        # The members form the quorum revealed, which this rank has normally read itself by
        # now; if the file moved past it unread, the newest (members that formed another
        # fail to meet within the timeout, and meet again in the controller's next).
        quorum = self.read.get(self.pending[0]) or read_quorum(self.path)
        if quorum is None or quorum.id < self.pending[0]:
            raise QuorumError(f"the quorum file went back from id {self.pending[0]}")
        if self.replica not in quorum.members:
            self.group.close()
            self.group, self.pending, self.tried = None, None, quorum.id
            return False
        why = self._form(quorum, last)
        if why is not None:
            raise QuorumError(why)
        return True
