"""The leader's watch over the nodes' in-memory snapshots while a generation runs (part of
`Controller`): every CHECK_S it reads the nodes' reports once and

- shows the newest usable point (recovery.memory_point) in the job record, for `optimus job
  status` and the exporter, and lets go of earlier incarnations' reports it outlived;
- names the point every node pushes next when their own pushes do not meet (`align_point`),
  and the usable point every node keeps until a newer one is usable.

Why the second. Each agent pushes its newest complete point when its last push has ended
(controller/node/snapshots.py), and a point is usable only once every node's shards of it are
replicated. When pushes take longer than the snapshot interval, nodes skip points, each by its
own timing (one pushes 10 then 15, another 10, 12 then 16), and they keep only their two newest
confirmed points: under load their confirmed points can stop meeting, and a failure then
resumes from the disk checkpoint although every node holds a recent snapshot. A named point is
one every node has taken whole; each agent pushes it before its own choice and keeps it (and
its buddy keeps the copy) while it is named, so the nodes meet on it within a push or two. On
a quiet run the pushes meet anyway and the named point is one they have sent or are sending.
The usable point is named too, to keep: without it, a node that confirms two newer points the
others did not confirm would drop its copy of the only point they share.
"""

from __future__ import annotations

import time

from controller.control import recovery
from optimus.checkpoint.snapshot_files import parse_point, point_name

CHECK_S = 5.0  # how often the nodes' snapshot reports are read while a job runs
# ... until the generation has a usable point named to keep: its first one is named within a
# second of existing (the nodes keep more meanwhile: controller/node/snapshots.py UNNAMED_KEEP).
FIRST_CHECK_S = 1.0
ALIGN_READS = 3  # a named point not replicated by every node after this many reads gives way


def align_point(plan: dict, reports: dict[str, dict], usable_step: int | None,
                named: str | None, reads: int) -> str | None:
    """The point every node of `plan` should push next, or None when there is none to name.

    Candidates are points of the plan's generation that every planned node has taken whole
    (its report's `own` holds all of its ranks; under replicas that carry on, the nodes of the
    replica that wrote it: `writers`), newer than the newest usable point (`usable_step`), and
    not yet confirmed by every node that took it (`replicated`). The point named now
    (`named`, for `reads` reads) stays named while it is a candidate, at most ALIGN_READS reads
    (a buddy that refuses it must not hold the nodes on it); otherwise the newest candidate
    newer than it. None where some planned node has no buddy (it replicates nothing: no point
    can become usable)."""
    nodes, generation = plan["nodes"], plan["generation"]
    if any(node not in plan.get("buddies", {}) for node in nodes):
        return None
    candidates: dict[tuple[int, int], str] = {}
    for name in {n for node in nodes for n in reports.get(node, {}).get("own", {})}:
        parsed = parse_point(name)
        if not parsed or parsed[1] != generation:
            continue
        if usable_step is not None and parsed[0] <= usable_step:
            continue
        took = writers(plan, reports, name)
        confirmed = took is not None and all(
            name in (reports.get(node, {}).get("replicated") or {}) for node in took)
        if took is not None and not confirmed:
            candidates[parsed] = name
    if named in candidates.values() and reads < ALIGN_READS:
        return named
    floor = (named and parse_point(named)) or (-1, -1)
    newer = [p for p in candidates if p > floor]
    return candidates[max(newer)] if newer else None


def writers(plan: dict, reports: dict[str, dict], name: str) -> list[str] | None:
    """The planned nodes that took point `name` whole, one for each of its shard slots: every
    node; under replicas, the nodes of one replica (the one that wrote it, whichever that was);
    None where some slot's shards are not all there."""
    nodes, shards = plan["nodes"], recovery.slot_shards(plan)

    def whole(i: int) -> bool:
        return shards[i] <= set(reports.get(nodes[i], {}).get("own", {}).get(name, ()))
    if not plan.get("replicas"):
        return list(nodes) if all(whole(i) for i in range(len(nodes))) else None
    per = recovery.replica_nodes(plan)
    for first in range(0, len(nodes), per):
        if all(whole(i) for i in range(first, first + per)):
            return nodes[first:first + per]
    return None


class SnapshotWatch:
    """What the leader last read and showed of the nodes' snapshots."""

    def __init__(self, store):
        self.store = store
        self.read_at = 0.0
        self.shown: int | None = None  # the usable step in the job record
        self.named: tuple[int, str | None, int] = (-1, None, 0)  # generation, point, reads
        self.written: tuple | None = None  # (generation, push, keep) as last stored

    def check(self, plan: dict, job: dict) -> None:
        """Every CHECK_S while `plan` runs: the usable step into `job` (the job record's
        changes) when it changed, and the point to align on into the store."""
        named_keep = self.written is not None and self.written[0] == plan["generation"] \
            and self.written[2] is not None
        if time.monotonic() - self.read_at < (CHECK_S if named_keep else FIRST_CHECK_S):
            return
        self.read_at = time.monotonic()
        reports = self.store.reports.snapshots()
        point, _ = recovery.memory_point(plan, reports, set(plan["nodes"]), None)
        step = point["step"] if point and point["generation"] == plan["generation"] else None
        if step is not None:
            self.store.reports.drop_snapshots(recovery.outlived(reports, step))
        if step != self.shown:
            job["memory_snapshot"] = step
            self.shown = step
        generation, named, reads = self.named
        if generation != plan["generation"]:
            named, reads = None, 0
        name = align_point(plan, reports, step, named, reads)
        keep = point_name(step, plan["generation"]) if step is not None else None
        if (plan["generation"], name, keep) != self.written:
            self.store.set_snapshot_align(plan["generation"], name, keep)
            self.written = (plan["generation"], name, keep)
        self.named = (plan["generation"], name, reads + 1 if name == named else 1)
