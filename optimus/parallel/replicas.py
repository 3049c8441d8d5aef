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
its exchange has no peers.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from optimus.contract.records import Quorum
from optimus.files import file_stamp
from optimus.parallel.heal import (  # noqa: F401 (checksum, device_checksum, state_tensors: re-exported)
    HealError,
    by_dtype,
    checksum,
    device_checksum,
    give,
    receive_notes,
    send_notes,
    state_tensors,
    take,
)
from optimus.parallel.quorum_file import (  # noqa: F401 (re-exported)
    QuorumError,
    ReplicaOut,
    meet,
    read_quorum,
    wait_for_quorum,
)

GIVE_UP_S = 0.05  # how often a waiting exchange asks whether the controller moved on without it
LATE_S = 0.25  # an exchange this long after the last may have completed after a member let go
CONNECT_S = 5.0  # a try to reach a quorum's store; then the quorum file is looked at again
FORM = timedelta(seconds=20)  # for a gloo group's rendezvous: a member lost in it is not waited
# Our figures after the gradients, before the members' slots: the token count, the loss sum.
_TOKENS, _LOSS, SLOTS = 0, 1, 2


# Groups let go while an operation of theirs still waited on a lost peer, with it (close).
_LET_GO: list[tuple[dist.ProcessGroup, dist.Work]] = []


def switch_step(revealed_at: int) -> int:
    """The step before which every member moves to a newer quorum id revealed by the exchange of
    step `revealed_at`: two steps on, so that a rank reading a step's figures one step behind
    (optimus/step.py's Readback) has read it before then, as every member has."""
    return revealed_at + 2


def _group(backend: str, store: dist.Store, rank: int, size: int,
           timeout: timedelta) -> dist.ProcessGroup:
    """A process group of `size` made on `store` by its members alone."""
    if backend == "gloo":  # its rendezvous bounded by FORM_S; each operation passes `timeout`
        return dist.ProcessGroupGloo(store, rank, size, min(timeout, FORM))
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    if backend == "xccl":
        return dist.ProcessGroupXCCL(store, rank, size)
    raise QuorumError(f"no quorum group on backend {backend!r} (gloo, nccl or xccl)")


@dataclass
class Notes:
    """A heal's host-side state: `give` on the member healing, `take` on those healed."""

    give: Callable[[], dict]
    take: Callable[[dict], None]


@dataclass
class Reduced:
    """One step's exchange, as the members summed it: the figures after the gradients."""

    figures: torch.Tensor  # [tokens, loss sum, each member's newest seen id, their words]
    size: int | None = None  # the members (None: no words follow the ids)

    def tokens(self) -> float:
        return float(self.figures[_TOKENS])

    def loss(self) -> float:
        """The step's loss over the tokens of every replica taking part."""
        return float(self.figures[_LOSS]) / max(self.tokens(), 1.0)

    def newest(self) -> int:
        """The newest quorum id any member had seen when it sent its part."""
        end = None if self.size is None else SLOTS + self.size
        return int(self.figures[SLOTS:end].max())


_DEVICE_OF = {"nccl": "cuda", "xccl": "xpu"}


def connect(quorum: Quorum, timeout_s: float) -> dist.TCPStore:
    """A client of the quorum's store (a member's world store), tried for `timeout_s`."""
    return dist.TCPStore(quorum.store_addr, quorum.store_port, is_master=False,
                         wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


class QuorumGroup:
    """This rank's group of one quorum: the ranks at its position in each member replica."""

    def __init__(self, quorum: Quorum, *, replica: int, position: int, backend: str,
                 timeout_s: float, store: dist.TCPStore | None = None):
        if replica not in quorum.members:
            raise QuorumError(f"replica {replica} is not in quorum {quorum.id} "
                              f"({quorum.members})")
        self.quorum, self.replica, self.position = quorum, replica, position
        self.index = quorum.members.index(replica)
        self.size = len(quorum.members)
        self.timeout = timedelta(seconds=timeout_s)
        self.store = store or connect(quorum, timeout_s)  # reached already, or now
        prefix = dist.PrefixStore(f"optimus/quorum/{quorum.id}/{position}/", self.store)
        self.group = _group(backend, prefix, self.index, self.size, self.timeout)
        # Where its small messages live: NCCL and XCCL take only their device's tensors.
        self.device = torch.device(_DEVICE_OF.get(backend, "cpu"))
        self.work: dist.Work | None = None  # the last collective started
        self._gone_key = f"optimus/quorum/{quorum.id}/let_go"
        self.last = time.monotonic()  # the group formed, or its last exchange completed

    def close(self) -> None:
        """Let the group go (its peers may be gone: abort, never drain). A group whose last
        operation still waits on a lost peer is kept until that ends: dropping it would
        block here (its destructor waits out the operation's timeout)."""
        abort = getattr(self.group, "abort", None)
        if abort is not None:
            with contextlib.suppress(RuntimeError):  # gloo's may refuse
                abort()
        _LET_GO[:] = [(g, w) for g, w in _LET_GO if not w.is_completed()]
        if self.work is not None and not self.work.is_completed():
            _LET_GO.append((self.group, self.work))
        self.group = self.work = None

    def _all_reduce(self, buffer: torch.Tensor,
                    give_up: Callable[[], str | None] | None = None) -> None:
        """SUM `buffer` over the group. `give_up`, asked every GIVE_UP_S while the exchange
        waits on a peer, says why to stop waiting (the controller has named a quorum without
        one of this group's members): gloo's abort does not wake a waiting operation (torch
        2.13), so the wait is left instead, and the operation, on a buffer of its own, ends
        by its timeout behind the rank's back."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        options.timeout = self.timeout
        work = self.work = self.group.allreduce([buffer], options)
        if give_up is None or buffer.device.type != "cpu":
            work.wait()
            return
        # Woken by the operation's end (its future's callback), or every GIVE_UP_S to ask:
        # no polling, which would take the cores the collective's own threads need.
        done = threading.Event()
        work.get_future().add_done_callback(lambda _: done.set())
        while not done.wait(GIVE_UP_S):
            why = give_up()
            if why:
                self._let_go()
                raise QuorumError(f"the exchange in quorum {self.quorum.id} let go: {why}")
        work.wait()  # raises what the operation raised

    def _let_go(self) -> None:
        """Say in the quorum's store that a member let an exchange go: its operation runs on
        behind its back, and a silent member woken late would complete it with the others'
        parts. That member reads this before it applies anything (`reduce`)."""
        with contextlib.suppress(RuntimeError, TimeoutError):  # the store's host may be gone
            self.store.set(self._gone_key, str(self.replica))

    def let_go(self) -> bool:
        """Whether a member let an exchange of this quorum go (one store round trip)."""
        return self.store.check([self._gone_key])

    def reduce(self, grads: Sequence[torch.Tensor], tokens: torch.Tensor,
               loss_sum: torch.Tensor, seen: int,
               give_up: Callable[[], str | None] | None = None,
               word: Sequence[int] = ()) -> Reduced:
        """Sum this step over the quorum: `grads` (this replica's local gradient shards, of its
        loss over its own `tokens`) become, in place, the gradients of the loss over every
        member's tokens. `loss_sum`: this replica's loss summed over its tokens; `seen`: the
        newest quorum id this rank has read; `word`: small integers each member tells the others
        (its replica's commands), in slots of its own after the ids. Raises what the backend
        raises when a member is
        gone or silent past the timeout, or QuorumError when `give_up` says to stop waiting;
        the gradients are then as they were."""
        dtype = grads[0].dtype if grads else torch.float32
        device = grads[0].device if grads else tokens.device
        if any(g.dtype != dtype for g in grads):
            raise QuorumError("the gradients to reduce are of several dtypes")
        count = tokens.to(device=device, dtype=dtype).reshape(1)
        tail = torch.zeros(SLOTS + self.size * (1 + len(word)), dtype=dtype, device=device)
        tail[_TOKENS] = count[0]
        tail[_LOSS] = loss_sum.to(device=device, dtype=dtype)
        tail[SLOTS + self.index] = seen
        if word:
            at = SLOTS + self.size + self.index * len(word)
            tail[at:at + len(word)] = torch.tensor(list(word), dtype=dtype)
        buffer = torch.cat([*(g.reshape(-1) for g in grads), tail])
        n = buffer.numel() - tail.numel()
        buffer[:n].mul_(count)  # back to this replica's loss sum's gradient
        self._all_reduce(buffer, give_up)
        # Completed, but perhaps late: with the parts of members that had let it go. Not
        # applied then (they did not apply it, and the controller has moved on without this
        # rank). Members let go only of an exchange that waits on a silent member, once the
        # controller has named a quorum without it: so the store is asked only after a wait
        # longer than LATE_S since this rank's last exchange, or when its quorum file has
        # moved on (a stat); every exchange of steps longer than LATE_S asks.
        now = time.monotonic()
        late = now - self.last > LATE_S or (give_up is not None and give_up())
        if late and self.let_go():
            raise QuorumError(f"the exchange in quorum {self.quorum.id} completed after a "
                              "member had let it go")
        self.last = now
        total = buffer[n + _TOKENS].clamp(min=1.0)
        buffer[:n].div_(total)
        flat = buffer[:n].split([g.numel() for g in grads])
        torch._foreach_copy_(list(grads), [f.view_as(g) for f, g in zip(flat, grads, strict=True)])
        return Reduced(buffer[n:].clone(), self.size)

    def words(self, word: Sequence[int]) -> list[int]:
        """Each field of `word` at its largest over the members (one all-reduce of a slot
        each: the commands of members paused together, which exchange nothing else)."""
        slots = torch.zeros(self.size, len(word), dtype=torch.int64, device=self.device)
        slots[self.index] = torch.tensor(list(word), dtype=torch.int64)
        self._all_reduce(slots)
        return [int(x) for x in slots.max(0).values.tolist()]

    def agree(self, step: int) -> list[int]:
        """Every member's step, by member index (one all-reduce of a slot each)."""
        steps = torch.zeros(self.size, dtype=torch.int64, device=self.device)
        steps[self.index] = step + 1  # 0: "no step yet" stays apart from step 0
        self._all_reduce(steps)
        return [int(s) - 1 for s in steps.tolist()]

    def heal(self, state: Callable[[], Sequence[torch.Tensor]], steps: list[int],
             notes: Notes | None = None) -> tuple[int, list[int]]:
        """Bring every member behind the others to the step of the lowest-indexed member ahead:
        that member sends `state()` (this rank's model and optimizer shards, the progress
        counters: the same shapes in every replica at this position) to each member behind,
        which checks them all before it takes them (heal.py `give`, `take`); then `notes`'
        host-side state (JSON: progress, the stability rules' history), taken by the
        receiver. Returns (the source's index, the indices healed). Only the members
        concerned take part, and only they call `state` (making an optimizer's state where it
        has none yet takes a step of it)."""
        ahead = max(steps)
        source = steps.index(ahead)
        behind = [i for i, s in enumerate(steps) if s != ahead]
        if not behind or (self.index != source and self.index not in behind):
            return source, behind
        tensors = list(state())
        try:
            if self.index == source:
                tag = give(self.group, tensors, behind, self.device, self.timeout)
            else:
                tag = take(self.group, tensors, source, self.device, self.timeout)
        except HealError as e:
            raise QuorumError(f"{e} (from replica {self.quorum.members[source]})") from None
        if notes is not None:  # its tags after the pieces'
            if self.index == source:
                told = notes.give()
                for peer in behind:
                    send_notes(self.group, told, peer, tag, self.device, self.timeout)
            else:
                notes.take(receive_notes(self.group, source, tag, self.device, self.timeout))
        return source, behind

    def verify(self, state: Sequence[torch.Tensor]) -> bool:
        """Whether every member holds the same `state` (its checksum, in a slot each)."""
        sums = torch.zeros(self.size, 2, dtype=torch.int64, device=self.device)
        flat = [checksum(buffer) for _, buffer in by_dtype(state)]
        mine = torch.stack(flat).sum(0) if flat else torch.zeros(2, dtype=torch.int64)
        sums[self.index] = mine.to(self.device) % (1 << 40)  # summed over members: no overflow
        self._all_reduce(sums)
        return bool((sums == sums[0]).all())


class Replicas:
    """A rank's side of the quorum through training: it joins a quorum, exchanges each step
    in it, notices newer quorums, switches with the other members, and after a failed exchange
    waits for the controller's next quorum and heals or is healed.

    `state` gives, in a fixed order, the tensors a heal carries (this rank's model and
    optimizer shards and progress counters): the same shapes at this position in every
    replica; `notes`, the host-side state it carries besides. `beat` runs while it waits (the
    rank's heartbeat says it is alive)."""

    def __init__(self, path: Path, *, replica: int, position: int, backend: str,
                 timeout_s: float, wait_s: float, state: Callable[[], Sequence[torch.Tensor]],
                 beat: Callable[[], None] | None = None, notes: Notes | None = None):
        self.path, self.replica, self.position = Path(path), replica, position
        self.backend, self.timeout_s, self.wait_s = backend, timeout_s, wait_s
        self.state, self.beat, self.notes = state, beat, notes
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
            try:
                self._form(quorum, step)
                return
            except (RuntimeError, TimeoutError) as e:  # a member missing, or gone meanwhile
                self.missed.append({"quorum": quorum.id, "error": str(e)[:200]})
                after = quorum.id

    def _form(self, quorum: Quorum, step: int) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.pending, self.tried = None, None, quorum.id
        self.seen = max(self.seen, quorum.id)
        began = time.perf_counter()
        group = self._reach(quorum)
        formed = time.perf_counter()
        steps = group.agree(step)
        source, behind = group.heal(self.state, steps, self.notes)
        self.group = group
        self.heals.append({"quorum": quorum.id, "members": list(quorum.members),
                           "steps": steps, "source": quorum.members[source],
                           "healed": [quorum.members[i] for i in behind],
                           "group_s": round(formed - began, 4),  # the members meeting
                           "heal_s": round(time.perf_counter() - formed, 4)})

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
            try:
                return self.group.reduce(grads, tokens, loss_sum, self.seen, self._moved_on,
                                         word)
            except (RuntimeError, TimeoutError) as e:
                self.failed.append({"quorum": self.quorum.id, "error": str(e)[:200]})
            self.recover(last)
            if self.heals[-1]["steps"][self.group.index] != max(self.heals[-1]["steps"]):
                return None

    def _moved_on(self) -> str | None:
        """Why the current quorum's exchange is to be given up: a newer quorum in the file
        that leaves out one of its members (their part will not come). The file is read
        only when it changed (a stat otherwise: this is asked after every exchange)."""
        stamp = file_stamp(self.path)
        if stamp != self._moved[0]:
            try:
                quorum = read_quorum(self.path)
            except QuorumError:
                quorum = None
            self._moved = (stamp, quorum)
        quorum = self._moved[1]
        if quorum is None or quorum.id <= self.quorum.id:
            return None
        gone = sorted(set(self.quorum.members) - set(quorum.members))
        return f"quorum {quorum.id} leaves out replica(s) {gone}" if gone else None

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
        self._form(quorum, last)
        return True
