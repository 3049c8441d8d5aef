"""The ranks of one replica agreeing on what each did in its own quorum group.

A replica of several ranks (shard, tensor, pipeline) crosses replicas through one quorum group
per position (optimus/parallel/replicas.py), and each group's exchange or heal succeeds or fails
on its own. One position's exchange can complete (the lost peer's part had reached it) while
another's fails; applying the one and taking the other again without the lost replica would
mix two updates inside one replica. So before anything crossed over is applied, the replica's
ranks agree: in one small all-reduce on the replica's host group, whether every position
succeeded, and in which quorum. Either all apply, or none does and all take the step (or the
quorum) again, together.

Only a loss inside this replica ends the wait: a rank of it gone (the backend says so) or the
controller having taken this replica out of the quorum. Either way the replica's launch is over
and its state is replaced by a heal, so what its ranks decided no longer matters; a survivor
of another replica waits until its own replica's ranks have each decided.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from optimus.parallel.quorum_file import ReplicaOut
from optimus.parallel.quorum_group import wait_asking


@dataclass(frozen=True)
class Decided:
    """What the replica's ranks decided together."""

    ok: bool  # every rank's part succeeded
    low: int  # the lowest quorum id a rank named
    high: int  # the highest

    @property
    def same(self) -> bool:
        """Every rank named the same quorum."""
        return self.low == self.high

    @property
    def all(self) -> bool:
        return self.ok and self.same


class Positions:
    """This rank's replica, agreeing: `group` its host-side group (None: the default group,
    under gloo), of `size` ranks. `timeout_s` bounds one agreement: the longest another rank of
    the replica may take to reach it (its exchange's timeout, or its wait for a quorum)."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, timeout_s: float):
        self.group, self.size = group, size
        self.timeout = timedelta(seconds=timeout_s)

    def decide(self, ok: bool, quorum: int, out: Callable[[], str | None]) -> Decided:
        """Every rank's `ok`, and the quorum ids they named. `out`, asked while another rank
        has not decided yet (quorum_group.py `wait_asking`), says why this replica is out
        (the rank then leaves: ReplicaOut). A rank of the replica lost: ReplicaOut too, the
        backend's words in it."""
        if self.size == 1:
            return Decided(ok, quorum, quorum)
        figures = torch.tensor([int(ok), quorum, -quorum], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        options.timeout = self.timeout
        group = self.group if self.group is not None else dist.group.WORLD
        try:
            work = group.allreduce([figures], options)
            why = wait_asking(work, out)
            if not why:
                work.wait()
        except (RuntimeError, TimeoutError) as e:
            raise ReplicaOut(f"a rank of this replica is lost while its ranks agree: "
                             f"{str(e)[:200]}") from None
        if why:
            raise ReplicaOut(f"{why}: its ranks stop agreeing (a rank of it is out of quorum)")
        return Decided(bool(figures[0]), int(figures[1]), -int(figures[2]))
