"""ETTR when a lost replica costs only its share (`--replica-ranks` of bench/ettr.py): the
model of the replica mode whose rank side optimus/parallel/replicas.py builds.

The data-parallel dimension is R replicas of `replica_ranks` ranks each. A failure takes one
replica out of the quorum: the others step on after a stall, the lost one is replaced (a
standby per lost rank, started past its imports) and healed from a live peer, and rejoins.
Per failure the job loses:

- the survivors' stall. They finish the step the fault fell in (its work is kept: a failed
  exchange leaves the gradients as they were, and the same ones are exchanged again in the
  next quorum), then wait at its exchange until the controller's decision (the detection
  times of bench/ettr.py), then form the next quorum (measured, bench/replicas.py). A fault
  a fraction u into a step of s seconds, decided d seconds later, stalls them
  max(0, d - (1 - u) s) + the forming; over u uniform, d^2 / 2s for d < s, else d - s/2.
  A rank that dies resets its connections and the exchange fails at once; a lost node, a
  frozen rank or a hung collective answer nothing, and the exchange is let go when the
  controller names a quorum without the lost member (optimus/parallel/replicas.py does so for
  an exchange on the host, gloo; on a device, NCCL or XCCL, it waits for the operation's
  timeout, the hang bound, until it aborts the communicator instead: the table's last row);
- the lost replica's share while it is out: (its detection, its ranks' start as standbys with
  a rendezvous of its own nodes only, its heal from a peer, two steps to the switch) / R.

Failures are bench/ettr.py's (same rates, kinds and draws). Two replicas out at once are
independent; a fall below `min_replicas` (the restart of today) needs R - min + 1 replicas out
at once, not modelled: with R = 128 and a replica out for well under a minute every ~20 min
it does not happen in a month. Snapshots stay as configured (the fallback's recovery point),
and their cost is charged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bench.ettr_model import KINDS, Costs, Failures, Inputs

REPLICAS_RUN = "bench/replicas.py --peer, 2026-12-02 16:01 (2-core VM)"


def _measured(value: float, source: str):
    return field(default=value, metadata={"measured": True, "source": source})


@dataclass(frozen=True)
class ReplicaInputs:
    reform_s: float = _measured(
        0.075, REPLICAS_RUN + ": SIGKILL to the survivors' next applied step (the exchange "
                              "failing, the next quorum read and formed, the exchange again), "
                              "the quorum written at once")
    heal_bytes_per_s: float = _measured(
        140e6, REPLICAS_RUN + ": the standby's heal, 12.6 MB of model, optimizer and progress "
                              "from the lowest live member over gloo on loopback in 0.090 s "
                              "(agreement and checksums included)")
    standby_start_s: float = _measured(
        0.88, "bench/recovery.py warm-memory-inprocess (REC4 of bench/ettr_model.py): after "
              "the decision to the next step for a killed rank, in process (ranks past their "
              "imports); a standby's start is taken as the same")


@dataclass(frozen=True)
class ReplicaCosts:
    replicas: int
    decided_s: dict[str, float]  # fault to the survivors' exchange let go, per kind
    reform_s: float  # then the next quorum formed
    step_s: float
    out_s: dict[str, float]  # the lost replica's time out of the quorum, per kind

    def stall_s(self, kind: str) -> float:
        """The survivors' mean stall for a fault of `kind` (over where in a step it falls)."""
        d, s = self.decided_s[kind], self.step_s
        return (d * d / (2 * s) if d < s else d - s / 2) + self.reform_s


def replica_costs(c: Costs, i: Inputs, r: ReplicaInputs, ranks: int, replica_ranks: int,
                  ranks_per_node: int) -> ReplicaCosts:
    replicas = max(1, ranks // replica_ranks)
    nodes = math.ceil(replica_ranks / ranks_per_node)
    rendezvous = max(i.rendezvous_s_per_1k_nodes * nodes / 1000, i.rendezvous_floor_s)
    heal = c.shard_bytes / r.heal_bytes_per_s
    out = {k: c.detect_s[k] + r.standby_start_s + rendezvous + heal + 2 * c.step_s
           for k in KINDS}
    return ReplicaCosts(replicas, dict(c.detect_s), r.reform_s, c.step_s, out)


def ettr_replicas(c: Costs, rc: ReplicaCosts, failures: Failures, horizon_s: float,
                  overhead: float) -> tuple[float, float]:
    """(ETTR, the mean time lost per failure) for `failures` over `horizon_s`, with the steady
    checkpoint `overhead` (the share of training time, as bench/ettr.py's memory policy)."""
    lost = 0.0
    n = 0
    for t, k in zip(failures.times, failures.kinds, strict=True):
        if t >= horizon_s:
            break
        kind = KINDS[k]
        lost += rc.stall_s(kind) + rc.out_s[kind] / rc.replicas
        n += 1
    ettr = max(0.0, horizon_s - lost) / horizon_s * (1.0 - overhead)
    return ettr, lost / max(n, 1)
