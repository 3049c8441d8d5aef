"""A quorum's group at one position (optimus/parallel/replicas.py tells the whole story): made
on the quorum's store by its members alone, it sums each step over the members (`reduce`, then
`Summed.apply` once the replica's ranks agree: optimus/parallel/positions.py), agrees on the
members' steps and heals whoever is behind from a live peer (`agree`, `heal`), and checks at
the end that the members hold the same state (`verify`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from optimus.contract.records import Quorum
from optimus.parallel.heal import (
    HealError,
    by_dtype,
    checksum,
    give,
    receive_notes,
    send_notes,
    take,
)
from optimus.parallel.quorum_file import QuorumError

GIVE_UP_S = 0.05  # how often a waiting exchange asks whether the controller moved on without it
LATE_S = 0.25  # an exchange this long after the last may have completed after a member let go
CONNECT_S = 5.0  # a try to reach a quorum's store; then the quorum file is looked at again
FORM = timedelta(seconds=20)  # for a gloo group's rendezvous: a member lost in it is not waited
# Our figures after the gradients, before the members' slots: the token count, the loss sum.
_TOKENS, _LOSS, SLOTS = 0, 1, 2


# Groups let go while an operation of theirs still waited on a lost peer, with it (close).
_LET_GO: list[tuple[dist.ProcessGroup, dist.Work]] = []


def wait_asking(work: dist.Work, ask: Callable[[], str | None],
                every_s: float = GIVE_UP_S) -> str | None:
    """Wait for `work` to end, asking `ask` every `every_s` whether to stop waiting: its answer
    when it says why (the operation goes on behind the caller's back), else None once the
    operation ended (`work.wait()` then raises what it raised). Woken by the operation's end
    (its future's callback), not by polling, which would take the cores the collective's own
    threads need."""
    done = threading.Event()
    work.get_future().add_done_callback(lambda _: done.set())
    while not done.wait(every_s):
        why = ask()
        if why:
            return why
    return None


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
    take: Callable[[dict], Callable[[], None]]  # checks the notes; returns what takes them


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


@dataclass
class Summed:
    """A step's exchange, completed and not applied yet: the members' sum of the gradients
    (weighted by each member's tokens) and of the figures after them."""

    buffer: torch.Tensor
    grads: list[torch.Tensor]  # where the gradients go
    n: int  # the gradients' elements, first in the buffer
    size: int  # the members

    def apply(self) -> Reduced:
        """The gradients, in place, of the loss over every member's tokens; the figures."""
        n = self.n
        self.buffer[:n].div_(self.buffer[n + _TOKENS].clamp(min=1.0))
        flat = self.buffer[:n].split([g.numel() for g in self.grads])
        torch._foreach_copy_(self.grads, [f.view_as(g) for f, g in
                                          zip(flat, self.grads, strict=True)])
        return Reduced(self.buffer[n:].clone(), self.size)


_DEVICE_OF = {"nccl": "cuda", "xccl": "xpu"}


def connect(quorum: Quorum, timeout_s: float) -> dist.TCPStore:
    """A client of the quorum's store (a member's world store), tried for `timeout_s`."""
    return dist.TCPStore(quorum.store_addr, quorum.store_port, is_master=False,
                         wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def _nothing() -> None:
    """Nothing received in a heal, nothing to take."""


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
        why = wait_asking(work, give_up)
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
               word: Sequence[int] = ()) -> Summed:
        """Sum this step over the quorum: `grads` (this replica's local gradient shards, of its
        loss over its own `tokens`) are to become the gradients of the loss over every
        member's tokens, in place, when the sum is applied (`Summed.apply`, once the
        replica's other ranks have theirs too). `loss_sum`: this replica's loss summed over
        its tokens; `seen`: the newest quorum id this rank has read; `word`: small integers
        each member tells the others (its replica's commands), in slots of its own after the
        ids. Raises what the backend raises when a member is gone or silent past the
        timeout, or QuorumError when `give_up` says to stop waiting; the gradients are as they
        were until the sum is applied."""
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
        return Summed(buffer, list(grads), n, self.size)

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
             notes: Notes | None = None) -> tuple[int, list[int], Callable[[], None]]:
        """Bring every member behind the others to the step of the lowest-indexed member ahead:
        that member sends `state()` (this rank's model and optimizer shards, the progress
        counters: the same shapes in every replica at this position) to each member behind,
        which checks them all (heal.py `give`, `take`); then `notes`' host-side state (JSON:
        progress, the stability rules' history), checked by the receiver. Returns (the
        source's index, the indices healed, what takes what this rank received: called once
        the replica's other ranks received theirs, a no-op where it received nothing). Only
        the members concerned take part, and only they call `state` (making an optimizer's
        state where it has none yet takes a step of it)."""
        ahead = max(steps)
        source = steps.index(ahead)
        behind = [i for i, s in enumerate(steps) if s != ahead]
        if not behind or (self.index != source and self.index not in behind):
            return source, behind, _nothing
        tensors = list(state())
        taken = _nothing
        try:
            if self.index == source:
                tag = give(self.group, tensors, behind, self.device, self.timeout)
            else:
                tag, taken = take(self.group, tensors, source, self.device, self.timeout)
            if notes is not None:  # its tags after the pieces'
                if self.index == source:
                    told = notes.give()
                    for peer in behind:
                        send_notes(self.group, told, peer, tag, self.device, self.timeout)
                    return source, behind, _nothing
                noted = notes.take(receive_notes(self.group, source, tag, self.device,
                                                 self.timeout))
                return source, behind, lambda: (taken(), noted())
        except HealError as e:
            raise QuorumError(f"{e} (from replica {self.quorum.members[source]})") from None
        return source, behind, taken

    def verify(self, state: Sequence[torch.Tensor]) -> bool:
        """Whether every member holds the same `state` (its checksum, in a slot each)."""
        sums = torch.zeros(self.size, 2, dtype=torch.int64, device=self.device)
        flat = [checksum(buffer) for _, buffer in by_dtype(state)]
        mine = torch.stack(flat).sum(0) if flat else torch.zeros(2, dtype=torch.int64)
        sums[self.index] = mine.to(self.device) % (1 << 40)  # summed over members: no overflow
        self._all_reduce(sums)
        return bool((sums == sums[0]).all())
