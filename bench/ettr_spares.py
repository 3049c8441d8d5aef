"""When the spares run out: what waiting for a repair costs against shrinking (issue 32).

bench/ettr.py's simulation gives every failure a spare. Here the pool is finite: each failure
takes its node out for a repair (the controller excludes the node of a hard failure at once,
and of a soft one at `flaky_failures: 1`, the default), the node returns after the repair, and
the job has `spares` nodes beyond those it trains on. While more nodes are out than spares:

- wait (`supervision.when_no_spare: wait`): no training until a node returns; then the job
  resumes from memory (the survivors' snapshots and the lost node's buddy copy);
- shrink (the default): training goes on on the nodes left, at their share of the rate (the
  data-parallel degree shrinks; assumed linear, as the planner predicts it at this scale where
  the job's own layout stays), after a restart from the last disk checkpoint (a memory
  snapshot loads only into the layout that took it: the work since that checkpoint is trained
  again); each node's return grows the job back at the next disk checkpoint (it runs at the
  reduced rate until then, then pays a restart and a disk load).

Only this difference is simulated: the time lost beyond bench/ettr.py's (every failure's
detection, restart and load are there already). Failures are a Poisson process at the job's
MTTF; repairs take an exponentially distributed time of the given mean (an assumption: no
figure for repair times at this scale was found; 1, 4 and 24 hours span a swap from a hot
pool, a reboot-and-burn-in and a vendor's replacement). The result multiplies bench/ettr.py's
ETTR.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Pool:
    nodes: int  # training nodes
    spares: int
    mttf_s: float  # the job's mean time to failure, all kinds
    repair_s: float  # a failed node's mean time out
    disk_every_s: float  # disk checkpoint interval (shrinking resumes from it)
    restart_s: float  # a warm restart, rendezvous included
    load_disk_s: float  # loading the disk checkpoint (a reshard)


def lost_fraction(pool: Pool, policy: str, horizon_s: float, rng: np.random.Generator) -> float:
    """The share of `horizon_s` lost to running short of spares under `policy` (wait, shrink)."""
    times = np.cumsum(rng.exponential(pool.mttf_s, int(3 * horizon_s / pool.mttf_s) + 10))
    times = times[times < horizon_s]
    back = times + rng.exponential(pool.repair_s, len(times))
    events = sorted([(t, 1) for t in times] + [(t, -1) for t in back if t < horizon_s])
    out, lost, last = 0, 0.0, 0.0
    for t, change in events:
        short = max(0, out - pool.spares)
        if short:  # the interval since the last event ran short of `short` nodes
            lost += (t - last) * (1.0 if policy == "wait" else short / pool.nodes)
        out += change
        now_short = max(0, out - pool.spares)
        if policy == "shrink" and now_short > short:  # shrunk: from disk, work since retrained
            lost += rng.uniform(0, pool.disk_every_s) + pool.load_disk_s
        elif policy == "shrink" and now_short < short:  # grows back at the next checkpoint
            lost += (pool.disk_every_s / 2) * short / pool.nodes + pool.restart_s
            lost += pool.load_disk_s
        last = t
    if max(0, out - pool.spares):
        lost += (horizon_s - last) * (1.0 if policy == "wait" else
                                      max(0, out - pool.spares) / pool.nodes)
    return min(lost / horizon_s, 1.0)


def table(nodes: int, mttf_s: float, disk_every_s: float, restart_s: float, load_disk_s: float,
          days: float, trials: int, seed: int,
          pools=(0, 4, 16, 64), repairs_h=(1, 4, 24)) -> list[dict]:
    """Mean lost share per (spares, repair) for both policies."""
    out = []
    for spares in pools:
        for hours in repairs_h:
            pool = Pool(nodes, spares, mttf_s, hours * 3600.0, disk_every_s, restart_s,
                        load_disk_s)
            row = {"spares": spares, "repair_h": hours}
            for policy in ("wait", "shrink"):
                rng = np.random.default_rng(seed)
                row[policy] = float(np.mean([lost_fraction(pool, policy, days * 86400.0, rng)
                                             for _ in range(trials)]))
            out.append(row)
    return out
